//! Prefill/decode disaggregation end to end: `kvroute serve` in front of
//! mock engines started with `--role prefill` and `--role decode`, in both
//! engines' protocols (vLLM's `kv_transfer_params`, SGLang's bootstrap
//! rooms), and workers that fail mid-way.

use std::io::Read;
use std::net::TcpListener;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::Duration;

use serde_json::{json, Value};

use crate::support::http::{count, dechunk, request, request_with, Reply};
use crate::support::{eventually, spawn_mocker, Proc};

const TOKEN: &str = "pd-test-token";

/// One mock engine of `flavor` in `role`, its `--worker` line renamed `name`.
pub(super) fn engine(flavor: &str, role: &str, name: &str) -> (Proc, String) {
    let (child, mut lines) = spawn_mocker(
        &[
            "--workers",
            "1",
            "--engine-flavor",
            flavor,
            "--role",
            role,
            "--port",
            "0",
            "--kv-events-port",
            "0",
            "--replay-port",
            "0",
            "--bootstrap-port",
            "0",
            "--speedup",
            "50",
        ],
        1,
    );
    let line = lines.remove(0);
    let renamed = line
        .split(',')
        .map(|kv| {
            if kv.starts_with("name=") {
                format!("name={name}")
            } else {
                kv.to_owned()
            }
        })
        .collect::<Vec<_>>()
        .join(",");
    assert!(renamed.contains(&format!("role={role}")), "{renamed}");
    (child, renamed)
}

/// A prefill engine `p0` and a decode engine `d0` of `flavor`, and the
/// router in front of them.
pub(super) fn fleet(flavor: &str, extra: &[&str]) -> (Vec<Proc>, String) {
    let (p, p_line) = engine(flavor, "prefill", "p0");
    let (d, d_line) = engine(flavor, "decode", "d0");
    let (serve, addr) = start_serve(&[p_line, d_line], extra, &["p0", "d0"]);
    (vec![p, d, serve], addr)
}

pub(super) fn auth() -> String {
    format!("Bearer {TOKEN}")
}

/// `kvroute serve` with the admin token and `extra` flags in front of
/// `lines`, once the workers named in `live` have every rank connected and
/// their models learned (the others may point at sockets no one publishes
/// on).
pub(super) fn start_serve(lines: &[String], extra: &[&str], live: &[&str]) -> (Proc, String) {
    start_serve_with_env(lines, extra, &[], live)
}

/// [`start_serve`] with `env` set for the router (see
/// [`crate::support::spawn_serve_with_env`]).
pub(super) fn start_serve_with_env(
    lines: &[String],
    extra: &[&str],
    env: &[(&str, &str)],
    live: &[&str],
) -> (Proc, String) {
    let mut args = vec!["--admin-token", TOKEN];
    args.extend_from_slice(extra);
    let (proc, serve) = crate::support::spawn_serve_with_env(lines, &args, env);
    eventually("serve up with the engines' ranks connected", || {
        let r = request_with(&serve, "GET", "/workers", &[("Authorization", &auth())], "");
        let doc: Value = if r.status == 200 {
            r.json()
        } else {
            Value::Null
        };
        let workers = doc["workers"].as_array().cloned().unwrap_or_default();
        workers.len() == lines.len()
            && live.iter().all(|name| {
                workers.iter().any(|w| {
                    w["name"] == *name
                        && w["ranks"].as_array().is_some_and(|r| {
                            !r.is_empty() && r.iter().all(|r| r["connected"] == true)
                        })
                        // Its models learned: a worker whose models are
                        // unknown is not offered a request for a named model.
                        && w["models"].is_array()
                })
            })
    });
    (proc, serve)
}

/// The newest routing decisions' reasons, newest first.
fn reasons(serve: &str) -> Vec<String> {
    let stats = request_with(
        serve,
        "GET",
        "/api/stats",
        &[("Authorization", &auth())],
        "",
    );
    assert_eq!(stats.status, 200, "{}", stats.body);
    stats.json()["decisions"]
        .as_array()
        .map(|d| {
            d.iter()
                .filter_map(|d| d["reason"].as_str().map(str::to_owned))
                .collect()
        })
        .unwrap_or_default()
}

/// A 320-token prompt (20 blocks of 16), different for each `seed`.
pub(super) fn prompt(seed: u32) -> Vec<u32> {
    (0..320).map(|i| 1_000 + seed * 1_000 + i).collect()
}

/// `/query`'s answer for `tokens`.
pub(super) fn query(serve: &str, tokens: &[u32]) -> Value {
    let q = json!({"token_ids": tokens}).to_string();
    let r = request_with(serve, "POST", "/query", &[("Authorization", &auth())], &q);
    assert_eq!(r.status, 200, "{}", r.body);
    r.json()
}

pub(super) fn complete(serve: &str, tokens: &[u32], stream: bool) -> Reply {
    let body = json!({"model": "mock-model", "prompt": tokens, "max_tokens": 6, "stream": stream});
    request(serve, "POST", "/v1/completions", &body.to_string())
}

/// The first request is split (prefill on `p0`, the answer from `d0`);
/// `d0` publishes the blocks it received, and the same prompt again is
/// prefilled on `d0` itself when `local_repeat` (vLLM), split again when
/// not (SGLang decode engines never prefill locally).
fn a_split_request_then_a_repeat(flavor: &str, local_repeat: bool) {
    let (_procs, serve) = fleet(flavor, &[]);
    let tokens = prompt(1);
    // `/query` explains the placement the proxy is about to make.
    let plan = query(&serve, &tokens)["disagg"].clone();
    assert_eq!(plan["decode"]["name"], "d0", "{plan}");
    assert_eq!(plan["prefill"]["name"], "p0", "{plan}");
    assert_eq!(plan["prefill_locally"], false, "{plan}");
    assert_eq!(plan["uncached_on_decode_tokens"], 320, "{plan}");
    assert!(
        plan["reason"]
            .as_str()
            .is_some_and(|r| r.starts_with("split:")),
        "{plan}"
    );
    let first = complete(&serve, &tokens, false);
    assert_eq!(first.status, 200, "{}", first.body);
    assert_eq!(first.header("x-kvroute-worker").as_deref(), Some("d0"));
    let doc: Value = first.json();
    assert!(doc["choices"][0]["text"].is_string(), "{doc}");
    let newest = reasons(&serve);
    assert!(
        newest
            .first()
            .is_some_and(|r| r.starts_with("split:") && r.contains("on p0/0")),
        "{newest:?}"
    );
    // The decode engine published the blocks it received: the router sees
    // them on d0, and the repeat is short enough to prefill there.
    eventually("d0's transferred blocks reach the index", || {
        query(&serve, &tokens)["scores"]["d0"]["0"]
            .as_u64()
            .unwrap_or(0)
            >= 256
    });
    let plan = query(&serve, &tokens)["disagg"].clone();
    assert_eq!(plan["prefill_locally"], local_repeat, "{plan}");
    assert_eq!(plan["prefill"].is_null(), local_repeat, "{plan}");
    let second = complete(&serve, &tokens, true);
    assert_eq!(second.status, 200, "{}", second.body);
    assert_eq!(second.header("x-kvroute-worker").as_deref(), Some("d0"));
    let (events, _) = dechunk(second.body.as_bytes());
    let text = String::from_utf8_lossy(&events);
    assert!(text.trim_end().ends_with("data: [DONE]"), "{text}");
    let (split, local) = (
        count(&serve, "kvroute_proxy_disagg_split_total"),
        count(&serve, "kvroute_proxy_disagg_local_total"),
    );
    assert_eq!((split, local), if local_repeat { (1, 1) } else { (2, 0) });
    let newest = reasons(&serve);
    let expected = if local_repeat {
        "prefilled on the decode rank"
    } else {
        "split:"
    };
    assert!(
        newest.first().is_some_and(|r| r.starts_with(expected)),
        "{newest:?}"
    );
}

#[test]
fn vllm_requests_are_split_then_prefilled_locally_once_the_decode_engine_caches_them() {
    a_split_request_then_a_repeat("vllm", true);
}

#[test]
fn sglang_requests_are_split_every_time_and_the_decode_engine_publishes_what_it_received() {
    a_split_request_then_a_repeat("sglang", false);
}

#[test]
fn a_streamed_split_request_relays_the_decode_engines_stream() {
    for flavor in ["vllm", "sglang"] {
        let (_procs, serve) = fleet(flavor, &["--local-prefill-max-tokens", "0"]);
        let reply = complete(&serve, &prompt(2), true);
        assert_eq!(reply.status, 200, "{flavor}: {}", reply.body);
        assert_eq!(reply.header("x-kvroute-worker").as_deref(), Some("d0"));
        let (events, complete) = dechunk(reply.body.as_bytes());
        let text = String::from_utf8_lossy(&events);
        assert!(complete, "{flavor}: {text}");
        assert!(text.contains("data: {"), "{flavor}: {text}");
        assert!(
            text.trim_end().ends_with("data: [DONE]"),
            "{flavor}: {text}"
        );
    }
}

/// An HTTP "worker" that takes every completion, counts it and drops the
/// connection without answering.
fn dropping_worker() -> (String, Arc<AtomicUsize>) {
    let listener = TcpListener::bind("127.0.0.1:0").expect("bind");
    let addr = listener.local_addr().expect("addr").to_string();
    let taken = Arc::new(AtomicUsize::new(0));
    let count = taken.clone();
    std::thread::spawn(move || {
        for stream in listener.incoming() {
            let Ok(mut stream) = stream else { continue };
            let mut buf = [0u8; 65536];
            let _ = stream.set_read_timeout(Some(Duration::from_millis(500)));
            if matches!(stream.read(&mut buf), Ok(n) if buf[..n].starts_with(b"POST /v1/")) {
                count.fetch_add(1, Ordering::SeqCst);
            }
            drop(stream);
        }
    });
    (addr, taken)
}

/// A decode worker that fails after taking the request ends it with a 502;
/// the request is never sent to the other decode worker, whichever of the
/// two the router placed it on.
#[test]
fn a_failed_decode_leg_is_never_sent_to_a_second_decode_worker() {
    let (_p, p_line) = engine("vllm", "prefill", "p0");
    let (_d, d_line) = engine("vllm", "decode", "d0");
    let (fake, taken) = dropping_worker();
    let dead_events = format!("tcp://127.0.0.1:{}", crate::support::free_port());
    // It answers no `/v1/models`: its spec names the model it serves.
    let fake_line =
        format!("name=dx,url=http://{fake},events={dead_events},dp=1,block_size=16,role=decode,model=mock-model");
    let (_serve, serve) = start_serve(
        &[p_line, d_line, fake_line],
        &["--policy", "round-robin", "--local-prefill-max-tokens", "0"],
        &["p0", "d0"],
    );
    let mut to_fake = 0;
    for seed in 0..4 {
        let before = taken.load(Ordering::SeqCst);
        let reply = complete(&serve, &prompt(10 + seed), false);
        let took = taken.load(Ordering::SeqCst) - before;
        match reply.status {
            200 => {
                assert_eq!(took, 0, "{}", reply.body);
                assert_eq!(reply.header("x-kvroute-worker").as_deref(), Some("d0"));
            }
            502 => {
                assert_eq!(took, 1, "{}", reply.body);
                to_fake += 1;
            }
            other => panic!("{other}: {}", reply.body),
        }
    }
    // Round-robin placed one request on the failing worker, whose breaker
    // then opened; the rest went to d0 alone.
    assert_eq!(to_fake, 1);
    assert_eq!(taken.load(Ordering::SeqCst), 1);
}

/// A prefill worker that cannot be reached is a retry on the next prefill
/// worker (vLLM's legs run one after the other, so no decode leg was sent).
/// Declared a thousand times as fast, the unreachable one is always tried first
/// until its breaker opens.
#[test]
fn an_unreachable_prefill_worker_is_retried_on_the_next() {
    let (_p, p_line) = engine("vllm", "prefill", "p0");
    let (_d, d_line) = engine("vllm", "decode", "d0");
    let closed = crate::support::free_port();
    let dead_events = format!("tcp://127.0.0.1:{}", crate::support::free_port());
    // Never reachable, so never listed its models: its spec names one.
    let gone = format!(
        "name=p-gone,url=http://127.0.0.1:{closed},events={dead_events},dp=1,block_size=16,role=prefill,speed=1000,model=mock-model"
    );
    let (_serve, serve) = start_serve(
        &[gone, p_line, d_line],
        &["--local-prefill-max-tokens", "0"],
        &["p0", "d0"],
    );
    for seed in 0..3 {
        let reply = complete(&serve, &prompt(20 + seed), false);
        assert_eq!(reply.status, 200, "{}", reply.body);
        assert_eq!(reply.header("x-kvroute-worker").as_deref(), Some("d0"));
    }
    assert!(count(&serve, "kvroute_proxy_retries_total") >= 1);
    assert!(
        reasons(&serve).iter().all(|r| r.starts_with("split:")),
        "{:?}",
        reasons(&serve)
    );
}

/// With every decode rank at `--busy-requests`, a split request waits in
/// the overload queue until the rank frees up, as an aggregated one does,
/// instead of a 503 at once.
#[test]
fn a_split_request_waits_in_the_queue_while_every_decode_rank_is_busy() {
    let (_procs, serve) = fleet(
        "vllm",
        &[
            "--busy-requests",
            "1",
            "--queue-capacity",
            "4",
            "--queue-timeout-ms",
            "30000",
        ],
    );
    let long = {
        let serve = serve.clone();
        std::thread::spawn(move || {
            let body = json!({"model": "mock-model", "prompt": prompt(1), "max_tokens": 1500});
            request(&serve, "POST", "/v1/completions", &body.to_string())
        })
    };
    eventually("the long request is split and decoding on d0", || {
        count(&serve, "kvroute_proxy_disagg_split_total") == 1
    });
    let waiting = complete(&serve, &prompt(2), false);
    assert_eq!(waiting.status, 200, "{}", waiting.body);
    assert_eq!(waiting.header("x-kvroute-worker").as_deref(), Some("d0"));
    assert_eq!(count(&serve, "kvroute_proxy_queued_total"), 1, "it waited");
    let long = long.join().expect("the long request's thread");
    assert_eq!(long.status, 200, "{}", long.body);
}

/// SGLang's native `/generate` through a split fleet: the decode engine
/// received the prompt's KV and lists none of its log-probabilities, so
/// the answer carries the prefill leg's, one per prompt token, merged in;
/// a streamed `/generate` is relayed to its `[DONE]`.
#[test]
fn sglang_generate_merges_the_prefill_legs_prompt_logprobs() {
    let (_procs, serve) = fleet("sglang", &[]);
    let tokens = prompt(3);
    let body = json!({"input_ids": tokens, "return_logprob": true,
        "sampling_params": {"max_new_tokens": 4}});
    let answer = request(&serve, "POST", "/generate", &body.to_string());
    assert_eq!(answer.status, 200, "{}", answer.body);
    assert_eq!(answer.header("x-kvroute-worker").as_deref(), Some("d0"));
    let doc: Value = answer.json();
    let meta = &doc["meta_info"];
    assert_eq!(meta["completion_tokens"], 4, "{doc}");
    let logprobs = meta["input_token_logprobs"]
        .as_array()
        .cloned()
        .unwrap_or_default();
    assert_eq!(logprobs.len(), tokens.len(), "one per prompt token: {meta}");
    assert_eq!(logprobs[0], json!([null, tokens[0], null]));
    assert_eq!(logprobs[1][1], tokens[1]);
    assert!(logprobs[1][0].is_f64(), "{}", logprobs[1]);
    assert_eq!(count(&serve, "kvroute_proxy_disagg_split_total"), 1);
    // Streamed: relayed as the decode engine sends it.
    let stream = json!({"input_ids": prompt(4), "stream": true,
        "sampling_params": {"max_new_tokens": 3}});
    let streamed = request(&serve, "POST", "/generate", &stream.to_string());
    assert_eq!(streamed.status, 200, "{}", streamed.body);
    let (events, _) = dechunk(streamed.body.as_bytes());
    let text = String::from_utf8_lossy(&events);
    assert!(text.contains("\"meta_info\""), "{text}");
    assert!(text.trim_end().ends_with("data: [DONE]"), "{text}");
}
