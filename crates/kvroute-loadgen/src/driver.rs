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
//! Per request, from the SSE stream: TTFT is the time to the first chunk with
//! non-empty text (`choices[].text` or `choices[].delta.content`), latency the
//! time to `[DONE]`, output tokens `usage.completion_tokens` (else the number
//! of text chunks), prompt and cached tokens `usage.prompt_tokens` and
//! `usage.prompt_tokens_details.cached_tokens` of the final usage chunk.

use std::collections::HashMap;
use std::io::{IsTerminal, Write};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use kvroute_core::rng::SplitMix64;
use serde_json::Value;
use tokio::task::JoinSet;

use crate::error::{Error, Result};
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
}

/// One finished request.
#[derive(Debug, Clone, Copy, PartialEq)]
struct Sample {
    start_s: f64,
    ttft_ms: f64,
    latency_ms: f64,
    prompt_tokens: u64,
    cached_tokens: u64,
    output_tokens: u64,
    label: RepeatLabel,
}

/// What one exchange measured (times from the scheduled start).
#[derive(Debug, Default, Clone, Copy, PartialEq)]
struct Measured {
    ttft: Option<Duration>,
    latency: Duration,
    prompt_tokens: u64,
    completion_tokens: Option<u64>,
    cached_tokens: u64,
    text_chunks: u64,
}

/// The (worker, rank) picks of the oracle and their requests in flight.
#[derive(Debug)]
struct Oracle {
    workers: Vec<String>,
    in_flight: Mutex<HashMap<(usize, u32), usize>>,
    rng: Mutex<SplitMix64>,
}

#[derive(Debug)]
enum Target {
    Url(String),
    Oracle(Oracle),
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

fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
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

/// The HTTP client a load run uses: a large idle pool (one connection per
/// request in flight is kept), a 10 s connect timeout.
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
    let target = match endpoint {
        Endpoint::OpenAi { base_url } => Target::Url(normalize_base_url(base_url)),
        Endpoint::Oracle { workers } => {
            if workers.is_empty() {
                return Err(Error::Invalid(
                    "the oracle needs at least one worker URL".into(),
                ));
            }
            Target::Oracle(Oracle {
                workers: workers.iter().map(|w| normalize_base_url(w)).collect(),
                in_flight: Mutex::new(HashMap::new()),
                rng: Mutex::new(SplitMix64::new(options.workload.seed ^ 0x0AC1E)),
            })
        }
    };
    let accuracy_before = match &target {
        Target::Url(base) => accuracy_counters(client, base).await,
        Target::Oracle(_) => None,
    };
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
    let progress = options
        .progress
        .then(|| spawn_progress(shared.clone(), options.clone()));
    match options.arrival {
        Arrival::Closed { concurrency } => closed_loop(&shared, concurrency, limit, deadline).await,
        Arrival::Poisson { rate } => {
            open_loop(&shared, rate, options.workload.seed, limit, deadline).await
        }
    }
    let duration = shared.started.elapsed();
    if let Some((task, stop)) = progress {
        let _ = stop.send(());
        let _ = task.await;
    }
    let accuracy = match (&shared.target, accuracy_before) {
        (Target::Url(base), Some(before)) => {
            // The router compares after each response ends: give the last ones a moment.
            tokio::time::sleep(Duration::from_millis(200)).await;
            accuracy_counters(client, base)
                .await
                .and_then(|after| accuracy_between(before, after))
        }
        _ => None,
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
    Ok(report)
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

async fn open_loop(
    shared: &Arc<Shared>,
    rate: f64,
    seed: u64,
    limit: Option<u64>,
    deadline: Option<Instant>,
) {
    let mut arrivals = PoissonArrivals::new(rate, seed ^ 0xA55E_55ED);
    let mut tasks = JoinSet::new();
    loop {
        if limit.is_some_and(|l| shared.issued.load(Ordering::Relaxed) >= l) {
            break;
        }
        let at = shared.started + Duration::from_secs_f64(arrivals.next_arrival());
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
        .unwrap_or_else(|_| Err(format!("no answer within {REQUEST_TIMEOUT:?}")));
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
        Err(e) => {
            shared.failed.fetch_add(1, Ordering::Relaxed);
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
) -> Result<Measured, String> {
    match &shared.target {
        Target::Url(base) => {
            let url = format!("{base}{}", planned.path);
            exchange(&shared.client, &url, &planned.body, None, scheduled).await
        }
        Target::Oracle(oracle) => {
            let (worker, rank) = oracle_pick(&shared.client, oracle, planned).await?;
            // Released on every exit, the request timeout's cancellation included.
            let _in_flight = InFlight {
                oracle,
                key: (worker, rank),
            };
            let url = format!("{}{}", oracle.workers[worker], planned.path);
            exchange(&shared.client, &url, &planned.body, Some(rank), scheduled).await
        }
    }
}

/// One request the oracle sent to a (worker, rank); uncounted when dropped.
struct InFlight<'a> {
    oracle: &'a Oracle,
    key: (usize, u32),
}

impl Drop for InFlight<'_> {
    fn drop(&mut self) {
        if let Some(n) = lock(&self.oracle.in_flight).get_mut(&self.key) {
            *n = n.saturating_sub(1);
        }
    }
}

/// Asks every worker's `/internal/cache_match` at once and picks the (worker,
/// rank) with the most matched tokens; ties go to the fewest requests in
/// flight from this run, then to a seeded coin. Counts the pick as in flight.
async fn oracle_pick(
    client: &reqwest::Client,
    oracle: &Oracle,
    planned: &PlannedRequest,
) -> Result<(usize, u32), String> {
    let mut query = planned.body.clone();
    query["endpoint"] = Value::from(if planned.path.ends_with("chat/completions") {
        "chat"
    } else {
        "completions"
    });
    let query = Arc::new(query);
    let mut asks = JoinSet::new();
    for (i, worker) in oracle.workers.iter().enumerate() {
        let (client, query) = (client.clone(), query.clone());
        let url = format!("{worker}/internal/cache_match");
        asks.spawn(async move { (i, cache_match(&client, &url, &query).await) });
    }
    let mut candidates: Vec<(usize, u32, u64)> = Vec::new();
    let mut last_error = None;
    while let Some(joined) = asks.join_next().await {
        match joined {
            Ok((i, Ok(ranks))) => candidates.extend(ranks.into_iter().map(|(r, m)| (i, r, m))),
            Ok((i, Err(e))) => last_error = Some(format!("{}: {e}", oracle.workers[i])),
            Err(e) => last_error = Some(e.to_string()),
        }
    }
    let best = candidates.iter().map(|c| c.2).max().ok_or_else(|| {
        format!(
            "no worker answered /internal/cache_match ({})",
            last_error.unwrap_or_else(|| "no ranks".into())
        )
    })?;
    let mut in_flight = lock(&oracle.in_flight);
    let load = |c: &(usize, u32, u64)| in_flight.get(&(c.0, c.1)).copied().unwrap_or(0);
    let tied: Vec<(usize, u32, u64)> = candidates.iter().copied().filter(|c| c.2 == best).collect();
    let least = tied.iter().map(load).min().unwrap_or(0);
    let mut tied: Vec<(usize, u32)> = tied
        .iter()
        .filter(|c| load(c) == least)
        .map(|c| (c.0, c.1))
        .collect();
    tied.sort_unstable();
    let pick = tied[lock(&oracle.rng).below(tied.len())];
    *in_flight.entry(pick).or_insert(0) += 1;
    Ok(pick)
}

/// One worker's `/internal/cache_match` answer: (rank, matched tokens).
async fn cache_match(
    client: &reqwest::Client,
    url: &str,
    query: &Value,
) -> Result<Vec<(u32, u64)>, String> {
    let resp = client
        .post(url)
        .json(query)
        .send()
        .await
        .map_err(|e| e.to_string())?;
    let status = resp.status();
    let body: Value = resp.json().await.map_err(|e| e.to_string())?;
    if !status.is_success() {
        return Err(format!("{status}: {body}"));
    }
    let ranks = body["ranks"].as_array().ok_or("no `ranks` in the answer")?;
    Ok(ranks
        .iter()
        .filter_map(|r| {
            let rank = u32::try_from(r["rank"].as_u64()?).ok()?;
            Some((rank, r["matched_tokens"].as_u64()?))
        })
        .collect())
}

/// POSTs a body and reads the answer (SSE or a plain JSON body).
async fn exchange(
    client: &reqwest::Client,
    url: &str,
    body: &Value,
    rank: Option<u32>,
    scheduled: Instant,
) -> Result<Measured, String> {
    let mut request = client.post(url).json(body);
    if let Some(rank) = rank {
        request = request.header("X-data-parallel-rank", rank.to_string());
    }
    let mut resp = request.send().await.map_err(|e| e.to_string())?;
    let status = resp.status();
    if !status.is_success() {
        let text = resp.text().await.unwrap_or_default();
        let text: String = text.chars().take(300).collect();
        return Err(format!("{url} answered {status}: {text}"));
    }
    let sse = resp
        .headers()
        .get(reqwest::header::CONTENT_TYPE)
        .and_then(|v| v.to_str().ok())
        .is_some_and(|v| v.contains("event-stream"));
    let mut m = Measured::default();
    if !sse {
        let bytes = resp.bytes().await.map_err(|e| e.to_string())?;
        let v: Value = serde_json::from_slice(&bytes).map_err(|e| format!("not JSON: {e}"))?;
        m.latency = scheduled.elapsed();
        m.ttft = Some(m.latency);
        read_usage(&v, &mut m);
        return Ok(m);
    }
    let mut sse = SseParser::default();
    while let Some(chunk) = resp.chunk().await.map_err(|e| e.to_string())? {
        for event in sse.push(&chunk) {
            if event == "[DONE]" {
                m.latency = scheduled.elapsed();
                return Ok(m);
            }
            let v: Value = serde_json::from_str(&event)
                .map_err(|e| format!("bad SSE chunk ({e}): {event}"))?;
            if let Some(error) = v.get("error").filter(|e| !e.is_null()) {
                return Err(format!("error chunk: {error}"));
            }
            if has_text(&v) {
                m.text_chunks += 1;
                m.ttft.get_or_insert_with(|| scheduled.elapsed());
            }
            read_usage(&v, &mut m);
        }
    }
    Err("the stream ended before [DONE]".into())
}

/// True when a chunk carries generated text.
fn has_text(v: &Value) -> bool {
    v["choices"].as_array().is_some_and(|choices| {
        choices.iter().any(|c| {
            let text = c["text"]
                .as_str()
                .or_else(|| c["delta"]["content"].as_str())
                .or_else(|| c["message"]["content"].as_str());
            text.is_some_and(|t| !t.is_empty())
        })
    })
}

fn read_usage(v: &Value, m: &mut Measured) {
    let usage = &v["usage"];
    if !usage.is_object() {
        return;
    }
    if let Some(p) = usage["prompt_tokens"].as_u64() {
        m.prompt_tokens = p;
    }
    if let Some(c) = usage["completion_tokens"].as_u64() {
        m.completion_tokens = Some(c);
    }
    if let Some(c) = usage["prompt_tokens_details"]["cached_tokens"].as_u64() {
        m.cached_tokens = c;
    }
}

/// Splits an SSE byte stream into the `data:` payloads of its events.
#[derive(Debug, Default)]
struct SseParser {
    buf: Vec<u8>,
}

impl SseParser {
    /// Feeds bytes; returns the data of every event completed by them.
    fn push(&mut self, bytes: &[u8]) -> Vec<String> {
        self.buf
            .extend(bytes.iter().copied().filter(|&b| b != b'\r'));
        let mut out = Vec::new();
        while let Some(end) = self.buf.windows(2).position(|w| w == b"\n\n") {
            let event: Vec<u8> = self.buf.drain(..end + 2).collect();
            let text = String::from_utf8_lossy(&event);
            let data: Vec<&str> = text
                .lines()
                .filter_map(|l| l.strip_prefix("data:"))
                .map(|d| d.strip_prefix(' ').unwrap_or(d))
                .collect();
            if !data.is_empty() {
                out.push(data.join("\n"));
            }
        }
        out
    }
}

/// The router's accuracy counters (comparisons, exact agreements) from its
/// `/metrics`; `None` when the target is not kvroute or does not answer.
async fn accuracy_counters(client: &reqwest::Client, base: &str) -> Option<(u64, u64)> {
    let resp = client
        .get(format!("{base}/metrics"))
        .timeout(Duration::from_secs(5))
        .send()
        .await
        .ok()?;
    if !resp.status().is_success() {
        return None;
    }
    parse_accuracy(&resp.text().await.ok()?)
}

/// `kvroute_accuracy_comparisons_total` and `kvroute_accuracy_exact_total`.
fn parse_accuracy(metrics: &str) -> Option<(u64, u64)> {
    let value = |name: &str| {
        metrics.lines().find_map(|l| {
            let rest = l.strip_prefix(name)?;
            let rest = rest.strip_prefix(' ')?;
            rest.trim().parse::<f64>().ok().map(|v| v as u64)
        })
    };
    Some((
        value("kvroute_accuracy_comparisons_total")?,
        value("kvroute_accuracy_exact_total")?,
    ))
}

/// Exact agreements per comparison between two readings of the counters.
fn accuracy_between(before: (u64, u64), after: (u64, u64)) -> Option<f64> {
    let compared = after.0.checked_sub(before.0)?;
    let exact = after.1.checked_sub(before.1)?;
    (compared > 0).then(|| exact as f64 / compared as f64)
}

/// The per-policy summary of a run's samples.
fn summarize(
    samples: &[Sample],
    requests: u64,
    failed: u64,
    duration: Duration,
    per_kind: bool,
) -> PolicyReport {
    let mut ttft: Vec<f64> = samples.iter().map(|s| s.ttft_ms).collect();
    let mut latency: Vec<f64> = samples.iter().map(|s| s.latency_ms).collect();
    sort_samples(&mut ttft);
    sort_samples(&mut latency);
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
        output_tokens_per_s: if secs > 0.0 {
            output as f64 / secs
        } else {
            0.0
        },
        requests,
        failed,
        prompt_tokens: prompt,
        cached_tokens: cached,
        duration_s: secs,
        text_repeat_hit_rate: per_kind
            .then(|| ratio(rate(&|s| s.label == RepeatLabel::TextRepeat))),
        image_repeat_hit_rate: per_kind
            .then(|| ratio(rate(&|s| s.label == RepeatLabel::ImageRepeat))),
        index_accuracy: None,
        hit_rate_vs_oracle: None,
        timeline,
    }
}

/// Draws the progress bar every 100 ms (on a terminal) or prints a line every
/// 5 s (otherwise) until told to stop; then clears it.
fn spawn_progress(
    shared: Arc<Shared>,
    options: LoadOptions,
) -> (
    tokio::task::JoinHandle<()>,
    tokio::sync::oneshot::Sender<()>,
) {
    let (stop, mut stopped) = tokio::sync::oneshot::channel::<()>();
    let terminal = std::io::stderr().is_terminal();
    let every = if terminal {
        Duration::from_millis(100)
    } else {
        Duration::from_secs(5)
    };
    let task = tokio::spawn(async move {
        let mut tick = tokio::time::interval(every);
        tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Skip);
        loop {
            tokio::select! {
                _ = &mut stopped => break,
                _ = tick.tick() => {}
            }
            let line = progress_line(&shared, &options);
            let mut err = std::io::stderr().lock();
            let _ = if terminal {
                write!(err, "\r\x1b[2K{line}")
            } else {
                writeln!(err, "{line}")
            };
            let _ = err.flush();
        }
        if terminal {
            let _ = write!(std::io::stderr().lock(), "\r\x1b[2K");
        }
    });
    (task, stop)
}

fn progress_line(shared: &Shared, options: &LoadOptions) -> String {
    let done = shared.done.load(Ordering::Relaxed);
    let failed = shared.failed.load(Ordering::Relaxed);
    let elapsed = shared.started.elapsed().as_secs_f64();
    let by_count = (options.requests > 0).then(|| done as f64 / options.requests as f64);
    let by_time = options
        .max_duration
        .map(|d| elapsed / d.as_secs_f64().max(1e-9));
    let fraction = match (by_count, by_time) {
        (Some(a), Some(b)) => a.max(b),
        (Some(a), None) => a,
        (None, Some(b)) => b,
        (None, None) => 0.0,
    }
    .clamp(0.0, 1.0);
    const WIDTH: usize = 30;
    let filled = (fraction * WIDTH as f64).round() as usize;
    let bar: String = "#".repeat(filled) + &"-".repeat(WIDTH - filled);
    let total = if options.requests > 0 {
        options.requests.to_string()
    } else {
        "?".into()
    };
    format!(
        "{:<10} [{bar}] {done}/{total} done, {failed} failed, {elapsed:.1} s",
        options.label
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sse_events_are_split_across_chunk_boundaries() {
        let mut p = SseParser::default();
        assert!(p.push(b"data: {\"a\":").is_empty());
        assert_eq!(p.push(b"1}\n\ndata: [DO"), ["{\"a\":1}"]);
        assert_eq!(p.push(b"NE]\r\n\r\n: comment\n\n"), ["[DONE]"]);
        assert!(p.push(b"").is_empty());
    }

    #[test]
    fn chunks_with_text_and_usage_are_read() {
        let chunk: Value =
            serde_json::from_str(r#"{"choices":[{"index":0,"text":" lorem"}],"usage":null}"#)
                .expect("json");
        assert!(has_text(&chunk));
        let chat: Value =
            serde_json::from_str(r#"{"choices":[{"delta":{"role":"assistant","content":""}}]}"#)
                .expect("json");
        assert!(!has_text(&chat));
        let usage: Value = serde_json::from_str(
            r#"{"choices":[],"usage":{"prompt_tokens":100,"completion_tokens":4,"prompt_tokens_details":{"cached_tokens":96}}}"#,
        )
        .expect("json");
        let mut m = Measured::default();
        read_usage(&chunk, &mut m);
        assert_eq!(m, Measured::default());
        read_usage(&usage, &mut m);
        assert_eq!(
            (m.prompt_tokens, m.completion_tokens, m.cached_tokens),
            (100, Some(4), 96)
        );
    }

    #[test]
    fn accuracy_comes_from_the_router_counters() {
        let text = "# TYPE kvroute_accuracy_comparisons_total counter\nkvroute_accuracy_comparisons_total 10\nkvroute_accuracy_exact_total 7\n";
        assert_eq!(parse_accuracy(text), Some((10, 7)));
        assert_eq!(parse_accuracy("vllm:num_requests_running 1\n"), None);
        assert_eq!(accuracy_between((10, 7), (20, 16)), Some(0.9));
        assert_eq!(accuracy_between((10, 7), (10, 7)), None);
        assert_eq!(accuracy_between((10, 7), (0, 0)), None);
    }

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
        fleet.shutdown().await;
    }
}
