//! Sends a workload at a target and measures every request.
//!
//! * **Closed loop** (`Arrival::Closed { concurrency }`): that many tasks,
//!   each sending its next request as soon as the previous one finished.
//!   Latency is measured from the moment a request is sent.
//! * **Open loop** (`Arrival::Poisson { rate }`): requests start at Poisson
//!   arrival times drawn from the seeded generator, whatever is in flight;
//!   latency and TTFT are measured from the *scheduled* start, so queueing in
//!   the client or at the target shows (no coordinated omission). A
//!   `multi-turn` arrival whose conversations all have a turn in flight waits
//!   for one to finish, and that wait counts.
//!
//! A run stops starting requests after `requests` or `max_duration`,
//! whichever comes first (`requests` 0 means "until the time is up"); requests
//! in flight then finish. A non-2xx answer, a transport error, an `error`
//! chunk or a stream that ends before `[DONE]` counts as failed, and the run
//! goes on.
//!
//! `Endpoint::Balanced` spreads the requests round-robin over several
//! servers (router replicas) and retries a refused connection on the next
//! one (see the balancer module); those retries are counted in the report.
//!
//! Per request, from the SSE stream: TTFT is the time to the first chunk with
//! non-empty text (`choices[].text` or `choices[].delta.content`), latency the
//! time to `[DONE]`, output tokens `usage.completion_tokens` (else the number
//! of text chunks), prompt and cached tokens `usage.prompt_tokens` and
//! `usage.prompt_tokens_details.cached_tokens` of the final usage chunk.

use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use tokio::task::JoinSet;

use crate::balancer::Balancer;
use crate::error::{Error, Result};
use crate::event_oracle::{EventOracle, EventSource};
use crate::exchange::{exchange, Failure, Measured};
use crate::metrics::{accuracy_between, accuracy_total};
use crate::oracle::Oracle;
use crate::progress::Progress;
use crate::report::{PolicyReport, Report};
use crate::stats::{sort_samples, Percentiles2, Percentiles3, PoissonArrivals};
use crate::workload::{PlannedRequest, RepeatLabel, Workload, WorkloadKind, WorkloadSpec};

/// Longest a single request may take before it counts as failed.
pub const REQUEST_TIMEOUT: Duration = Duration::from_secs(600);

/// How requests arrive.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum Arrival {
    /// Open loop: Poisson arrivals at `rate` requests per second.
    Poisson {
        /// Mean arrivals per second.
        rate: f64,
    },
    /// Closed loop: `concurrency` requests in flight at all times.
    Closed {
        /// Requests in flight.
        concurrency: usize,
    },
    /// Open loop at the arrival times of the workload's trace
    /// ([`WorkloadSpec::trace`](crate::WorkloadSpec::trace)).
    Trace,
}

/// What to run, how, and for how long.
#[derive(Debug, Clone)]
pub struct LoadOptions {
    /// The traffic.
    pub workload: WorkloadSpec,
    /// Open or closed loop.
    pub arrival: Arrival,
    /// Requests to start (0: no limit, `max_duration` must be set).
    pub requests: usize,
    /// No request starts after this long.
    pub max_duration: Option<Duration>,
    /// Draw a progress bar on stderr.
    pub progress: bool,
    /// The policy's name, shown on the progress bar.
    pub label: String,
}

/// Where requests go.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Endpoint {
    /// Any OpenAI-compatible server (kvroute, one engine, another router):
    /// `{base_url}/v1/completions` and `{base_url}/v1/chat/completions`.
    OpenAi {
        /// E.g. `http://127.0.0.1:8000`.
        base_url: String,
    },
    /// The oracle: asks every mocker's `/internal/cache_match`, then sends the
    /// request straight to the (worker, rank) holding the longest prefix,
    /// with `X-data-parallel-rank`.
    Oracle {
        /// The mockers' base URLs.
        workers: Vec<String>,
    },
    /// The oracle over real engines: each engine's cache as its own KV
    /// events tell it (`crate::event_oracle`); token-id prompts only.
    EventOracle {
        /// The engines, with their event publishers and replay sockets.
        engines: Vec<EventSource>,
    },
    /// Several OpenAI-compatible servers behind a client-side load balancer
    /// (router replicas): request n goes to URL n mod k, and a request whose
    /// connection is refused (nothing was sent) is retried on the next URL,
    /// each at most once per round, for a few rounds within 5 s. Other
    /// failures are not retried.
    Balanced {
        /// The servers' base URLs, e.g. `http://127.0.0.1:8000`.
        base_urls: Vec<String>,
    },
}

/// One finished request (the simulator builds these on its virtual clock
/// and summarises them as the driver does).
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Sample {
    /// When it was sent, in seconds from the run's start.
    pub start_s: f64,
    /// Time to its first token, in milliseconds.
    pub ttft_ms: f64,
    /// Time to its last token, in milliseconds.
    pub latency_ms: f64,
    /// Its prompt's tokens.
    pub prompt_tokens: u64,
    /// Of those, the tokens the engine found in its cache.
    pub cached_tokens: u64,
    /// The tokens it generated.
    pub output_tokens: u64,
    /// Which kind of repeat the workload made it (for the per-kind hit rates).
    pub label: RepeatLabel,
}

#[derive(Debug)]
enum Target {
    Url(String),
    Oracle(Oracle),
    EventOracle(EventOracle),
    Balanced(Balancer),
}

impl Target {
    /// The kvroute servers whose `/metrics` count the run's accuracy.
    fn routers(&self) -> &[String] {
        match self {
            Target::Url(base) => std::slice::from_ref(base),
            Target::Balanced(balancer) => balancer.urls(),
            Target::Oracle(_) | Target::EventOracle(_) => &[],
        }
    }
}

#[derive(Debug)]
struct Shared {
    client: reqwest::Client,
    target: Target,
    workload: Workload,
    started: Instant,
    samples: Mutex<Vec<Sample>>,
    issued: AtomicU64,
    done: AtomicU64,
    failed: AtomicU64,
    warned: AtomicBool,
}

/// A mutex's guard, poisoned or not (a panicked request task leaves plain data).
pub(crate) fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    match m.lock() {
        Ok(g) => g,
        Err(poisoned) => poisoned.into_inner(),
    }
}

/// `http://host:port` from what a user may type (`…/`, `…/v1`).
pub fn normalize_base_url(url: &str) -> String {
    let url = url.trim().trim_end_matches('/');
    let url = url.strip_suffix("/v1").unwrap_or(url);
    if url.contains("://") {
        url.to_owned()
    } else {
        format!("http://{url}")
    }
}

/// The HTTP client every load run, the demo and `bench proxy` use: a large
/// idle pool (one connection per request in flight is kept), a 10 s connect
/// timeout.
pub fn client() -> Result<reqwest::Client> {
    reqwest::Client::builder()
        .pool_max_idle_per_host(1024)
        .connect_timeout(Duration::from_secs(10))
        .build()
        .map_err(Error::http("building the HTTP client"))
}

/// Runs the workload against the endpoint with a fresh [`client`] and
/// reports it as one policy named `options.label`.
pub async fn measure(endpoint: &Endpoint, options: &LoadOptions) -> Result<Report> {
    let policy = run(&client()?, endpoint, options).await?;
    let mut report = Report::new(options.workload.describe());
    report.push(options.label.clone(), policy);
    Ok(report)
}

/// Runs the workload against the endpoint and summarises it.
pub async fn run(
    client: &reqwest::Client,
    endpoint: &Endpoint,
    options: &LoadOptions,
) -> Result<PolicyReport> {
    if options.requests == 0 && options.max_duration.is_none() {
        return Err(Error::Invalid(
            "a run needs a request count or a duration".into(),
        ));
    }
    match options.arrival {
        Arrival::Closed { concurrency: 0 } => {
            return Err(Error::Invalid("concurrency must be at least 1".into()))
        }
        Arrival::Poisson { rate } if !(rate.is_finite() && rate > 0.0) => {
            return Err(Error::Invalid(
                "the arrival rate must be a positive number".into(),
            ))
        }
        _ => {}
    }
    let target = target(endpoint, options.workload.seed)?;
    let accuracy_before = accuracy_total(client, target.routers()).await;
    let shared = Arc::new(Shared {
        client: client.clone(),
        target,
        workload: Workload::new(&options.workload),
        started: Instant::now(),
        samples: Mutex::new(Vec::new()),
        issued: AtomicU64::new(0),
        done: AtomicU64::new(0),
        failed: AtomicU64::new(0),
        warned: AtomicBool::new(false),
    });
    let deadline = options.max_duration.map(|d| shared.started + d);
    let limit = (options.requests > 0).then_some(options.requests as u64);
    let progress = options.progress.then(|| {
        let shared = shared.clone();
        Progress::spawn(options.clone(), shared.started, move || {
            (
                shared.done.load(Ordering::Relaxed),
                shared.failed.load(Ordering::Relaxed),
            )
        })
    });
    match options.arrival {
        Arrival::Closed { concurrency } => closed_loop(&shared, concurrency, limit, deadline).await,
        Arrival::Poisson { rate } => {
            let mut arrivals = PoissonArrivals::new(rate, options.workload.seed ^ 0xA55E_55ED);
            open_loop(
                &shared,
                move || Some(arrivals.next_arrival()),
                limit,
                deadline,
            )
            .await
        }
        Arrival::Trace => {
            let Some(trace) = options.workload.trace.clone() else {
                return Err(Error::Invalid("a trace arrival needs a trace".into()));
            };
            let mut next = trace.requests.iter().map(|r| r.timestamp as f64 / 1e3);
            let limit = limit.map_or(trace.requests.len() as u64, |l| {
                l.min(trace.requests.len() as u64)
            });
            open_loop(&shared, move || next.next(), Some(limit), deadline).await
        }
    }
    let duration = shared.started.elapsed();
    if let Some(progress) = progress {
        progress.finish().await;
    }
    let accuracy = match accuracy_before {
        Some(before) => {
            // The router compares after each response ends: give the last ones a moment.
            tokio::time::sleep(Duration::from_millis(200)).await;
            accuracy_total(client, shared.target.routers())
                .await
                .and_then(|after| accuracy_between(before, after))
        }
        None => None,
    };
    let samples = std::mem::take(&mut *lock(&shared.samples));
    let mut report = summarize(
        &samples,
        shared.issued.load(Ordering::Relaxed),
        shared.failed.load(Ordering::Relaxed),
        duration,
        options.workload.kind == WorkloadKind::Images,
    );
    report.index_accuracy = accuracy;
    if let Target::Balanced(balancer) = &shared.target {
        report.retried = balancer.retried();
    }
    Ok(report)
}

/// What an endpoint becomes for a run (URLs normalized, lists checked).
fn target(endpoint: &Endpoint, seed: u64) -> Result<Target> {
    let urls = |list: &[String], what: &str| {
        if list.is_empty() {
            return Err(Error::Invalid(format!("{what} needs at least one URL")));
        }
        Ok(list.iter().map(|u| normalize_base_url(u)).collect())
    };
    Ok(match endpoint {
        Endpoint::OpenAi { base_url } => Target::Url(normalize_base_url(base_url)),
        Endpoint::Oracle { workers } => {
            Target::Oracle(Oracle::new(urls(workers, "the oracle")?, seed))
        }
        Endpoint::EventOracle { engines } => {
            if engines.is_empty() {
                return Err(Error::Invalid(
                    "the oracle needs at least one engine".into(),
                ));
            }
            let engines = engines
                .iter()
                .map(|e| EventSource {
                    url: normalize_base_url(&e.url),
                    ..e.clone()
                })
                .collect();
            Target::EventOracle(EventOracle::start(engines, seed)?)
        }
        Endpoint::Balanced { base_urls } => {
            Target::Balanced(Balancer::new(urls(base_urls, "the balancer")?))
        }
    })
}

async fn closed_loop(
    shared: &Arc<Shared>,
    concurrency: usize,
    limit: Option<u64>,
    deadline: Option<Instant>,
) {
    let mut tasks = JoinSet::new();
    for _ in 0..concurrency {
        let shared = shared.clone();
        tasks.spawn(async move {
            loop {
                if deadline.is_some_and(|d| Instant::now() >= d) {
                    break;
                }
                let n = shared.issued.fetch_add(1, Ordering::Relaxed);
                if limit.is_some_and(|l| n >= l) {
                    shared.issued.fetch_sub(1, Ordering::Relaxed);
                    break;
                }
                let planned = tokio::select! {
                    p = shared.workload.next() => p,
                    _ = sleep_until_opt(deadline) => {
                        shared.issued.fetch_sub(1, Ordering::Relaxed);
                        break;
                    }
                };
                let scheduled = Instant::now();
                one_request(&shared, planned, scheduled).await;
            }
        });
    }
    while tasks.join_next().await.is_some() {}
}

/// Starts a request at each time `arrivals` gives (s since the start)
/// until it gives none, the limit is reached or the deadline passes.
async fn open_loop(
    shared: &Arc<Shared>,
    mut arrivals: impl FnMut() -> Option<f64>,
    limit: Option<u64>,
    deadline: Option<Instant>,
) {
    let mut tasks = JoinSet::new();
    loop {
        if limit.is_some_and(|l| shared.issued.load(Ordering::Relaxed) >= l) {
            break;
        }
        let Some(offset) = arrivals() else {
            break;
        };
        let at = shared.started + Duration::from_secs_f64(offset);
        if deadline.is_some_and(|d| at >= d) {
            break;
        }
        tokio::time::sleep_until(at.into()).await;
        shared.issued.fetch_add(1, Ordering::Relaxed);
        let s = shared.clone();
        tasks.spawn(async move {
            let planned = s.workload.next().await;
            one_request(&s, planned, at).await;
        });
        while tasks.try_join_next().is_some() {}
    }
    while tasks.join_next().await.is_some() {}
}

async fn sleep_until_opt(at: Option<Instant>) {
    match at {
        Some(at) => tokio::time::sleep_until(at.into()).await,
        None => std::future::pending().await,
    }
}

/// Sends one request, records its sample or failure, releases its conversation.
async fn one_request(shared: &Shared, planned: PlannedRequest, scheduled: Instant) {
    let outcome = tokio::time::timeout(REQUEST_TIMEOUT, send(shared, &planned, scheduled))
        .await
        .unwrap_or_else(|_| {
            Err(Failure::other(format!(
                "no answer within {REQUEST_TIMEOUT:?}"
            )))
        });
    shared.workload.finished(&planned);
    match outcome {
        Ok(m) => {
            let latency_ms = m.latency.as_secs_f64() * 1e3;
            let sample = Sample {
                start_s: scheduled
                    .saturating_duration_since(shared.started)
                    .as_secs_f64(),
                ttft_ms: m.ttft.map_or(latency_ms, |t| t.as_secs_f64() * 1e3),
                latency_ms,
                prompt_tokens: m.prompt_tokens,
                cached_tokens: m.cached_tokens.min(m.prompt_tokens),
                output_tokens: m.completion_tokens.unwrap_or(m.text_chunks),
                label: planned.label,
            };
            lock(&shared.samples).push(sample);
        }
        Err(failure) => {
            shared.failed.fetch_add(1, Ordering::Relaxed);
            let e = failure.message;
            if !shared.warned.swap(true, Ordering::Relaxed) {
                tracing::warn!(error = %e, "a request failed (further failures are only counted)");
            } else {
                tracing::debug!(error = %e, "request failed");
            }
        }
    }
    shared.done.fetch_add(1, Ordering::Relaxed);
}

async fn send(
    shared: &Shared,
    planned: &PlannedRequest,
    scheduled: Instant,
) -> Result<Measured, Failure> {
    match &shared.target {
        Target::Url(base) => {
            let url = format!("{base}{}", planned.path);
            exchange(&shared.client, &url, &planned.body, None, scheduled).await
        }
        Target::Oracle(oracle) => oracle.send(&shared.client, planned, scheduled).await,
        Target::EventOracle(oracle) => oracle.send(&shared.client, planned, scheduled).await,
        Target::Balanced(balancer) => balancer.send(&shared.client, planned, scheduled).await,
    }
}

/// The per-policy summary of a run's samples (the simulator's too).
pub fn summarize(
    samples: &[Sample],
    requests: u64,
    failed: u64,
    duration: Duration,
    per_kind: bool,
) -> PolicyReport {
    let mut ttft: Vec<f64> = samples.iter().map(|s| s.ttft_ms).collect();
    let mut latency: Vec<f64> = samples.iter().map(|s| s.latency_ms).collect();
    let mut tpot: Vec<f64> = samples
        .iter()
        .filter(|s| s.output_tokens >= 2)
        .map(|s| (s.latency_ms - s.ttft_ms).max(0.0) / (s.output_tokens - 1) as f64)
        .collect();
    sort_samples(&mut ttft);
    sort_samples(&mut latency);
    sort_samples(&mut tpot);
    let rate = |filter: &dyn Fn(&Sample) -> bool| {
        let (cached, prompt) = samples
            .iter()
            .filter(|s| filter(s))
            .fold((0u64, 0u64), |(c, p), s| {
                (c + s.cached_tokens, p + s.prompt_tokens)
            });
        (cached, prompt)
    };
    let ratio = |(c, p): (u64, u64)| if p == 0 { 0.0 } else { c as f64 / p as f64 };
    let (cached, prompt) = rate(&|_| true);
    let output: u64 = samples.iter().map(|s| s.output_tokens).sum();
    let secs = duration.as_secs_f64();
    let mut timeline: Vec<(f64, f64)> = samples.iter().map(|s| (s.start_s, s.ttft_ms)).collect();
    timeline.sort_by(|a, b| a.0.total_cmp(&b.0));
    PolicyReport {
        hit_rate: ratio((cached, prompt)),
        ttft_ms: Percentiles3::of(&ttft),
        latency_ms: Percentiles2::of(&latency),
        tpot_ms: Percentiles2::of(&tpot),
        output_tokens_per_s: if secs > 0.0 {
            output as f64 / secs
        } else {
            0.0
        },
        requests,
        failed,
        retried: 0,
        prompt_tokens: prompt,
        cached_tokens: cached,
        duration_s: secs,
        text_repeat_hit_rate: per_kind
            .then(|| ratio(rate(&|s| s.label == RepeatLabel::TextRepeat))),
        image_repeat_hit_rate: per_kind
            .then(|| ratio(rate(&|s| s.label == RepeatLabel::ImageRepeat))),
        index_accuracy: None,
        prefill_hit_rate: None,
        hit_rate_vs_oracle: None,
        fetches: None,
        timeline,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn base_urls_are_normalized() {
        assert_eq!(
            normalize_base_url("127.0.0.1:8000"),
            "http://127.0.0.1:8000"
        );
        assert_eq!(normalize_base_url("http://h:1/v1/"), "http://h:1");
        assert_eq!(normalize_base_url("https://h"), "https://h");
    }

    #[test]
    fn the_summary_counts_hits_over_all_and_over_repeats() {
        let s = |label, prompt, cached, ttft| Sample {
            start_s: ttft / 1000.0,
            ttft_ms: ttft,
            latency_ms: ttft * 2.0,
            prompt_tokens: prompt,
            cached_tokens: cached,
            output_tokens: 4,
            label,
        };
        let samples = [
            s(RepeatLabel::First, 100, 0, 30.0),
            s(RepeatLabel::TextRepeat, 100, 96, 10.0),
            s(RepeatLabel::ImageRepeat, 100, 64, 20.0),
        ];
        let r = summarize(&samples, 4, 1, Duration::from_secs(2), true);
        assert!((r.hit_rate - 160.0 / 300.0).abs() < 1e-12);
        assert_eq!(r.text_repeat_hit_rate, Some(0.96));
        assert_eq!(r.image_repeat_hit_rate, Some(0.64));
        assert_eq!((r.requests, r.failed), (4, 1));
        assert_eq!(r.ttft_ms.p50, 20.0);
        assert_eq!(r.latency_ms.p99, 60.0);
        assert_eq!(r.output_tokens_per_s, 6.0);
        // (latency − TTFT) / 3 tokens after the first: 10, 20/3, 10/3 ms.
        assert!((r.tpot_ms.p50 - 20.0 / 3.0).abs() < 1e-9, "{:?}", r.tpot_ms);
        assert_eq!(r.timeline.first().map(|t| t.1), Some(10.0));
        let plain = summarize(&[], 0, 0, Duration::ZERO, false);
        assert_eq!(plain.hit_rate, 0.0);
        assert_eq!(plain.text_repeat_hit_rate, None);
    }

    /// Two mock engines (the second with two DP ranks) on ephemeral ports.
    async fn fleet() -> kvroute_mocker::Fleet {
        let mut config = kvroute_mocker::MockerConfig {
            workers: 2,
            dp_size: 2,
            port: 0,
            kv_events_port: 0,
            replay_port: 0,
            num_gpu_blocks: 2048,
            ..kvroute_mocker::MockerConfig::default()
        };
        config.timing.speedup = 200.0;
        kvroute_mocker::Fleet::start(config)
            .await
            .expect("fleet starts")
    }

    fn options(kind: WorkloadKind, arrival: Arrival, requests: usize) -> LoadOptions {
        LoadOptions {
            workload: WorkloadSpec {
                kind,
                scale: 0.05,
                groups: 3,
                max_tokens: 4,
                ..WorkloadSpec::default()
            },
            arrival,
            requests,
            max_duration: Some(Duration::from_secs(60)),
            progress: false,
            label: "test".into(),
        }
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn every_workload_runs_against_an_engine_and_through_the_oracle() {
        use WorkloadKind as K;
        let fleet = fleet().await;
        let urls: Vec<String> = fleet.workers().iter().map(|w| w.url()).collect();
        let client = reqwest::Client::new();
        let closed = Arrival::Closed { concurrency: 4 };
        for kind in [
            K::SharedPrefix,
            K::MultiTurn,
            K::LongDoc,
            K::Images,
            K::Random,
        ] {
            let direct = Endpoint::OpenAi {
                base_url: format!("{}/v1", urls[0]),
            };
            let r = run(&client, &direct, &options(kind, closed, 24))
                .await
                .expect("run");
            assert_eq!((r.requests, r.failed), (24, 0), "{kind:?}");
            assert!(
                r.prompt_tokens > 0 && r.output_tokens_per_s > 0.0,
                "{kind:?}"
            );
            assert!(
                r.ttft_ms.p50 > 0.0 && r.ttft_ms.p50 <= r.latency_ms.p99,
                "{kind:?}"
            );
            assert_eq!(r.timeline.len(), 24);
            assert_eq!(r.index_accuracy, None, "an engine has no kvroute metrics");
            match kind {
                K::Random => assert_eq!(r.hit_rate, 0.0),
                _ => assert!(r.hit_rate > 0.3, "{kind:?}: {}", r.hit_rate),
            }
            assert_eq!(r.image_repeat_hit_rate.is_some(), kind == K::Images);
        }
        // The oracle over both engines (three ranks) keeps every group's prefix.
        let oracle = Endpoint::Oracle {
            workers: urls.clone(),
        };
        let o = run(&client, &oracle, &options(K::SharedPrefix, closed, 30))
            .await
            .expect("oracle run");
        assert_eq!(o.failed, 0);
        assert!(o.hit_rate > 0.5, "oracle hit rate {}", o.hit_rate);
        // Open loop at a modest rate.
        let open = Arrival::Poisson { rate: 200.0 };
        let r = run(
            &client,
            &Endpoint::OpenAi {
                base_url: urls[1].clone(),
            },
            &options(K::MultiTurn, open, 20),
        )
        .await
        .expect("open loop");
        assert_eq!((r.requests, r.failed), (20, 0));
        // A dead target fails every request but the run completes.
        let dead = Endpoint::OpenAi {
            base_url: "http://127.0.0.1:9".into(),
        };
        let r = run(&client, &dead, &options(K::Random, closed, 3))
            .await
            .expect("run completes");
        assert_eq!((r.requests, r.failed), (3, 3));
        assert_eq!(r.retried, 0, "only the balancer retries");
        fleet.shutdown().await;
    }

    /// Requests an engine has finished, from its own `/metrics`.
    async fn finished(client: &reqwest::Client, base: &str) -> u64 {
        let text = client
            .get(format!("{base}/metrics"))
            .send()
            .await
            .expect("the engine's /metrics answers")
            .text()
            .await
            .expect("a body");
        crate::metrics::sum(&text, "vllm:request_success_total")
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn the_balancer_alternates_and_retries_refused_connections() {
        let fleet = fleet().await;
        let urls: Vec<String> = fleet.workers().iter().map(|w| w.url()).collect();
        let client = reqwest::Client::new();
        let closed = Arrival::Closed { concurrency: 4 };
        // A dead port first: every other request is refused there and retried.
        let behind_a_dead_one = Endpoint::Balanced {
            base_urls: vec!["127.0.0.1:9".into(), urls[0].clone()],
        };
        let before = finished(&client, &urls[0]).await;
        let r = run(
            &client,
            &behind_a_dead_one,
            &options(WorkloadKind::Random, closed, 20),
        )
        .await
        .expect("run");
        assert_eq!((r.requests, r.failed), (20, 0));
        assert_eq!(r.retried, 10, "the requests whose turn was the dead port");
        assert_eq!(finished(&client, &urls[0]).await - before, 20);
        // Two live engines share the requests round-robin.
        let both = Endpoint::Balanced {
            base_urls: urls.clone(),
        };
        let before = [
            finished(&client, &urls[0]).await,
            finished(&client, &urls[1]).await,
        ];
        let r = run(
            &client,
            &both,
            &options(WorkloadKind::SharedPrefix, closed, 24),
        )
        .await
        .expect("run");
        assert_eq!((r.requests, r.failed, r.retried), (24, 0, 0));
        let after = [
            finished(&client, &urls[0]).await,
            finished(&client, &urls[1]).await,
        ];
        assert_eq!([after[0] - before[0], after[1] - before[1]], [12, 12]);
        assert_eq!(r.index_accuracy, None, "engines have no kvroute metrics");
        // Nothing listening at all: every request fails after its retries.
        let dead = Endpoint::Balanced {
            base_urls: vec!["127.0.0.1:9".into()],
        };
        let started = Instant::now();
        let r = run(&client, &dead, &options(WorkloadKind::Random, closed, 2))
            .await
            .expect("run completes");
        assert_eq!((r.requests, r.failed), (2, 2));
        assert_eq!(r.retried, 2 * (crate::balancer::RETRY_ROUNDS as u64 - 1));
        assert!(started.elapsed() < crate::balancer::RETRY_BUDGET * 2);
        let none = Endpoint::Balanced { base_urls: vec![] };
        assert!(
            run(&client, &none, &options(WorkloadKind::Random, closed, 1))
                .await
                .is_err()
        );
        fleet.shutdown().await;
    }
}
