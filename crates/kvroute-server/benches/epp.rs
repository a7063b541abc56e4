//! The endpoint picker's decision latency, as the data plane sees it: from
//! sending a request body's last chunk to receiving the headers answer that
//! names the endpoint, over a real loopback gRPC stream (plaintext) to the
//! picker of `kvroute serve`, for a 2 000-token text prompt on a fleet of 8
//! workers whose index holds prompts of the same shape.
//!
//! Inside the time: the gRPC hop both ways, parsing the body, tokenizing
//! it (the built-in tokenizer; its segment cache is warm after the first
//! request, as for a real fleet's repeated prefixes), hashing, the index
//! walk, pricing and ordering every rank, charging the chosen one, and
//! building the answer. Outside it: the body's echo and the stream's end.
//! Requests are sent one at a time (this measures latency, not capacity).
//!
//! `cargo bench -p kvroute-server --bench epp` prints p50, p90, p99 and max
//! over 2 000 requests after 200 unmeasured ones. It is a plain harness,
//! not criterion: criterion reports means and medians, and the goal is a
//! tail (p99 ≤ 200 µs).
#![allow(missing_docs, clippy::unwrap_used)]

use std::sync::Arc;
use std::time::{Duration, Instant};

use axum::body::Bytes;
use envoy_types::pb::envoy::config::core::v3::{HeaderMap, HeaderValue};
use envoy_types::pb::envoy::service::ext_proc::v3::external_processor_client::ExternalProcessorClient;
use envoy_types::pb::envoy::service::ext_proc::v3::processing_request::Request;
use envoy_types::pb::envoy::service::ext_proc::v3::{HttpBody, HttpHeaders, ProcessingRequest};
use kvroute_core::event::WorkerFlavor;
use kvroute_core::index::{DpRank, Index, IndexConfig, SharedIndex, WorkerRank};
use kvroute_core::multimodal::ImageTokenRule;
use kvroute_prompt::{Renderer, Tokenizer};
use kvroute_server::epp::exchange::RequestHead;
use kvroute_server::epp::pick::pick;
use kvroute_server::epp::{self, EppConfig, EppListeners, EppShared, EppTls};
use kvroute_server::ingest::registry::{IngestConfig, Registry};
use kvroute_server::ingest::spec::WorkerSpec;
use kvroute_server::metrics::epp::EppMetrics;
use kvroute_server::router::{ProxyConfig, Router};
use tokio::sync::mpsc;
use tokio_stream::wrappers::ReceiverStream;

const WORKERS: u32 = 8;
const PROMPT_TOKENS: usize = 2_000;
const WARMUP: usize = 200;
const MEASURED: usize = 2_000;
/// Distinct system prompts the fleet caches (each on one worker).
const GROUPS: usize = 16;

/// A completion body whose text prompt is `PROMPT_TOKENS` tokens or a few
/// more, for group `group` (its first three quarters shared by the group),
/// and its token count.
fn body(proxy: &Router, group: usize, question: usize) -> (Vec<u8>, usize) {
    let doc = |words: usize| {
        let text: Vec<String> = (0..words)
            .map(|i| {
                if i < words * 3 / 4 {
                    format!("g{group}w{i}")
                } else {
                    format!("q{question}w{i}")
                }
            })
            .collect();
        serde_json::json!({"model": "m", "prompt": text.join(" "), "max_tokens": 16})
            .to_string()
            .into_bytes()
    };
    let tokens_of = |bytes: &[u8]| {
        let mut req = kvroute_prompt::body::parse_request(bytes, false).unwrap();
        proxy.tokenize(&mut req);
        req.tokens.map_or(0, |t| t.len())
    };
    let per_100 = tokens_of(&doc(100)).max(1);
    let mut words = PROMPT_TOKENS * 100 / per_100;
    while tokens_of(&doc(words)) < PROMPT_TOKENS {
        words += 10;
    }
    let bytes = doc(words);
    let tokens = tokens_of(&bytes);
    (bytes, tokens)
}

fn message(request: Request) -> ProcessingRequest {
    ProcessingRequest {
        request: Some(request),
        ..ProcessingRequest::default()
    }
}

fn headers() -> Request {
    let header = |k: &str, v: &str| HeaderValue {
        key: k.to_owned(),
        raw_value: v.as_bytes().to_vec(),
        ..HeaderValue::default()
    };
    Request::RequestHeaders(HttpHeaders {
        headers: Some(HeaderMap {
            headers: vec![
                header(":method", "POST"),
                header(":path", "/v1/completions"),
                header("content-type", "application/json"),
            ],
        }),
        end_of_stream: false,
        ..HttpHeaders::default()
    })
}

/// The picker's proxy over a fleet of `WORKERS` workers (nothing listens on
/// their addresses: the picker never connects to them).
fn fleet(renderer: Arc<Renderer>) -> (Arc<Router>, Arc<Registry>) {
    let index = Arc::new(SharedIndex::new(Index::new(IndexConfig::default())));
    let registry = Arc::new(
        Registry::new(
            index.clone(),
            IngestConfig::default(),
            Duration::from_secs(3600),
        )
        .unwrap(),
    );
    for i in 0..WORKERS {
        let spec = format!(
            "name=w{i},url=http://10.0.0.{}:8000,events=tcp://127.0.0.1:9,block_size=16",
            i + 1
        );
        registry
            .register(WorkerSpec::parse(&spec, None).unwrap())
            .unwrap();
    }
    let config = ProxyConfig {
        renderer: Some(renderer),
        ..ProxyConfig::default()
    };
    let proxy = Arc::new(Router::builder(config, index).build().unwrap());
    proxy.refresh(&registry);
    (proxy, registry)
}

/// Puts each group's prompt prefix on one worker of the index.
fn warm(proxy: &Router) {
    let targets = proxy.targets();
    for group in 0..GROUPS {
        let (bytes, _) = body(proxy, group, usize::MAX);
        let mut req = kvroute_prompt::body::parse_request(&bytes, false).unwrap();
        proxy.tokenize(&mut req);
        let locals = req.local_hashes(16, WorkerFlavor::Vllm);
        let target = &targets[group % targets.len()];
        let key = WorkerRank {
            worker: target.id,
            rank: DpRank(0),
        };
        proxy
            .index()
            .record_routing_decision(key, &locals, proxy.now_ms());
    }
}

fn percentile(sorted: &[Duration], p: f64) -> Duration {
    let i = ((sorted.len() as f64 - 1.0) * p).round() as usize;
    sorted[i.min(sorted.len() - 1)]
}

async fn run() {
    let renderer = Arc::new(Renderer::new(
        Tokenizer::builtin(),
        ImageTokenRule::fixed(64),
    ));
    let (proxy, _registry) = fleet(renderer);
    warm(&proxy);
    let (_stopping, stop) = tokio::sync::watch::channel(false);
    let ext_proc = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let health = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = ext_proc.local_addr().unwrap();
    let shared = EppShared {
        router: proxy.clone(),
        metrics: Arc::new(EppMetrics::default()),
        max_body_bytes: 32 << 20,
    };
    let config = EppConfig {
        tls: EppTls::Plaintext,
        host: "127.0.0.1".into(),
    };
    let _tasks = epp::spawn(shared, &config, EppListeners { ext_proc, health }, stop).unwrap();
    let mut client = ExternalProcessorClient::connect(format!("http://{addr}"))
        .await
        .unwrap();
    let bodies: Vec<(Vec<u8>, usize)> = (0..64).map(|q| body(&proxy, q % GROUPS, q)).collect();
    let mut times = Vec::with_capacity(MEASURED);
    for i in 0..WARMUP + MEASURED {
        let (bytes, _) = &bodies[i % bodies.len()];
        let (tx, rx) = mpsc::channel(4);
        tx.send(message(headers())).await.unwrap();
        let mut answers = client
            .process(ReceiverStream::new(rx))
            .await
            .unwrap()
            .into_inner();
        let last = HttpBody {
            body: bytes.clone(),
            end_of_stream: true,
            ..HttpBody::default()
        };
        let started = Instant::now();
        tx.send(message(Request::RequestBody(last))).await.unwrap();
        let first = answers.message().await.unwrap().unwrap();
        let took = started.elapsed();
        assert!(
            first.dynamic_metadata.is_some(),
            "a routed answer: {first:?}"
        );
        drop(tx);
        while answers.message().await.unwrap().is_some() {}
        if i >= WARMUP {
            times.push(took);
        }
    }
    report(
        "over gRPC (last chunk sent → headers answer received)",
        &bodies[0],
        times,
    );
    // The same decisions in-process, without gRPC: the picker's own work.
    let head = RequestHead {
        path: "/v1/completions".into(),
        ..RequestHead::default()
    };
    let mut times = Vec::with_capacity(MEASURED);
    for i in 0..WARMUP + MEASURED {
        let body = Bytes::from(bodies[i % bodies.len()].0.clone());
        let started = Instant::now();
        let share = kvroute_server::budget::Share::unbounded();
        let picked = pick(&proxy, &head, (&body, share), true, started)
            .await
            .unwrap();
        let took = started.elapsed();
        drop(picked);
        if i >= WARMUP {
            times.push(took);
        }
    }
    report(
        "in-process pick (parse, tokenize, score, charge)",
        &bodies[0],
        times,
    );
}

fn report(what: &str, body: &(Vec<u8>, usize), mut times: Vec<Duration>) {
    times.sort_unstable();
    let us = |d: Duration| d.as_secs_f64() * 1e6;
    println!(
        "epp decision {what}, {} tokens ({} bytes), {WORKERS} workers, {} requests: \
         p50 {:.0} µs, p90 {:.0} µs, p99 {:.0} µs, max {:.0} µs",
        body.1,
        body.0.len(),
        times.len(),
        us(percentile(&times, 0.5)),
        us(percentile(&times, 0.9)),
        us(percentile(&times, 0.99)),
        us(times[times.len() - 1]),
    );
}

fn main() {
    // `cargo test --benches` runs benches once as tests: skip the work then.
    if std::env::args().any(|a| a == "--test" || a == "--list") {
        return;
    }
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .unwrap();
    runtime.block_on(run());
}
