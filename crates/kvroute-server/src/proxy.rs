//! The routing proxy: OpenAI requests in, the chosen worker's response out.
//!
//! A request is parsed only as far as routing needs ([`crate::routing`]),
//! scored against every available (worker, rank), and forwarded unchanged
//! (but for SGLang's `data_parallel_rank`) to the cheapest. Streams pass
//! through chunk by chunk; dropping the client's body drops the upstream one.
//! Connection errors and 5xx answers before the first byte are retried on the
//! next candidate, and a worker failing repeatedly is left out for a while.

use std::collections::HashMap;
use std::fmt::Write as _;
use std::pin::Pin;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, PoisonError, RwLock};
use std::task::{Context, Poll};
use std::time::{Duration, Instant};

use axum::body::{Body, Bytes};
use axum::extract::State;
use axum::http::{header, HeaderMap, HeaderValue, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::Json;
use futures_util::Stream;
use kvroute_core::event::WorkerFlavor;
use kvroute_core::hash::{sequence_hashes, LocalBlockHash, SequenceHash};
use kvroute_core::index::{RankMatch, SharedIndex, WorkerId, WorkerRank};
use kvroute_core::multimodal::RoutingPrompt;
use kvroute_core::rng::{mix, unit_f64, SplitMix64};
use kvroute_core::scheduler::{ActiveSequences, CostWeights};
use kvroute_core::tokens::fold_token_id;
use serde_json::{json, Map, Value};
use tracing::{debug, warn};

use crate::http::AppState;
use crate::registry::Registry;
use crate::routing::{
    self, inject_dp_rank, inject_include_usage, inject_mm_hashes, order, predicted_cached_tokens,
    BusyThresholds, Load, Policy, RoutingRequest, Scored, Target,
};

/// Turns a text or chat request body into the prompt token ids the engine
/// will cache (tokenizer plus chat template). Implemented by the binary.
pub trait PromptTokenizer: Send + Sync + std::fmt::Debug {
    /// The prompt's token ids, or `None` when the body cannot be tokenized.
    fn tokenize(&self, body: &[u8], chat: bool) -> Option<Vec<u64>>;

    /// The prompt with its images: folded token ids with the placeholder id in
    /// every image position, and each image's span and identity, from which
    /// the router builds each worker flavour's block hashes. The default has
    /// no images: [`PromptTokenizer::tokenize`], folded.
    fn prompt(&self, body: &[u8], chat: bool) -> Option<RoutingPrompt> {
        self.tokenize(body, chat).map(|ids| RoutingPrompt {
            tokens: ids.into_iter().map(fold_token_id).collect(),
            images: Vec::new(),
        })
    }
}

/// How requests are routed and forwarded.
#[derive(Debug, Clone)]
pub struct RouterConfig {
    /// Routing policy.
    pub policy: Policy,
    /// Cost weights.
    pub weights: CostWeights,
    /// 0: lowest cost; > 0: softmax sampling.
    pub temperature: f64,
    /// Busy thresholds.
    pub busy: BusyThresholds,
    /// Candidates tried per request at most.
    pub max_attempts: usize,
    /// Time allowed for a whole upstream request.
    pub request_timeout: Duration,
    /// Time allowed to connect to a worker.
    pub connect_timeout: Duration,
    /// Consecutive failures that open a worker's circuit breaker.
    pub breaker_failures: u32,
    /// How long an open breaker keeps the worker out.
    pub breaker_open: Duration,
    /// Active requests older than this are dropped from the load.
    pub active_expiry: Duration,
    /// Name the rank in the body as `data_parallel_rank` for every worker;
    /// otherwise only SGLang-flavour workers get the body field and vLLM
    /// workers the `X-data-parallel-rank` header.
    pub dp_rank_in_body: bool,
    /// Tokenizes text prompts and chat messages; without it they are routed on load only.
    pub tokenizer: Option<Arc<dyn PromptTokenizer>>,
    /// Requests that may wait for a rank to drop below its busy thresholds
    /// when every rank is over them; 0: refuse at once with 503.
    pub queue_capacity: usize,
    /// Longest wait in that queue before the 503.
    pub queue_timeout: Duration,
}

impl Default for RouterConfig {
    fn default() -> Self {
        RouterConfig {
            policy: Policy::Kv,
            weights: CostWeights::default(),
            temperature: 0.0,
            busy: BusyThresholds::default(),
            max_attempts: 3,
            request_timeout: Duration::from_secs(600),
            connect_timeout: Duration::from_secs(2),
            breaker_failures: 3,
            breaker_open: Duration::from_secs(10),
            active_expiry: Duration::from_secs(600),
            dp_rank_in_body: false,
            tokenizer: None,
            queue_capacity: 0,
            queue_timeout: Duration::from_secs(30),
        }
    }
}

#[derive(Debug, Default)]
struct Breaker {
    failures: u32,
    /// Open (worker skipped) until then.
    open_until: Option<Instant>,
    /// A half-open probe is in flight until then.
    probe_until: Option<Instant>,
}

impl Breaker {
    fn allows(&self, now: Instant) -> bool {
        match self.open_until {
            None => true,
            Some(until) => now >= until && self.probe_until.is_none_or(|p| now >= p),
        }
    }
}

/// Buckets (upper bounds, tokens) of the accuracy histogram.
const ACCURACY_BUCKETS: [u64; 7] = [0, 1, 16, 64, 256, 1024, 4096];

#[derive(Debug, Default)]
pub(crate) struct Metrics {
    requests: AtomicU64,
    upstream_errors: AtomicU64,
    retries: AtomicU64,
    overloaded: AtomicU64,
    queued: AtomicU64,
    queue_timeouts: AtomicU64,
    no_workers: AtomicU64,
    bad_requests: AtomicU64,
    pub(crate) load_only: AtomicU64,
    comparisons: AtomicU64,
    exact: AtomicU64,
    diff_sum: AtomicU64,
    diff_buckets: [AtomicU64; ACCURACY_BUCKETS.len()],
    /// Requests forwarded per worker name, then rank (keyed so that counting
    /// allocates nothing once a pair has been seen).
    routed: Mutex<HashMap<String, HashMap<u32, u64>>>,
}

/// The routing state shared by every request.
#[derive(Debug)]
pub struct Router {
    config: RouterConfig,
    client: reqwest::Client,
    /// Shared, not copied, by each request.
    pub(crate) targets: RwLock<Arc<Vec<Target>>>,
    active: Mutex<HashMap<WorkerRank, ActiveSequences>>,
    breakers: Mutex<HashMap<String, Breaker>>,
    pub(crate) metrics: Metrics,
    next_id: AtomicU64,
    turn: AtomicU64,
    rng: AtomicU64,
    started: Instant,
    /// Places in the overload queue.
    queue: tokio::sync::Semaphore,
    /// Woken whenever a rank's load drops (a prefill ends or a request ends).
    load_dropped: tokio::sync::Notify,
}

fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(PoisonError::into_inner)
}

/// The workers of the registry with their ranks, from its `/workers` document.
fn targets_of(registry: &Registry) -> Vec<Target> {
    let ids: HashMap<String, WorkerId> = registry
        .workers()
        .into_iter()
        .map(|(name, id, _, _)| (name, id))
        .collect();
    let doc = registry.describe();
    doc["workers"]
        .as_array()
        .into_iter()
        .flatten()
        .filter_map(|w| {
            let name = w["name"].as_str()?.to_owned();
            let id = *ids.get(&name)?;
            let mut ranks: Vec<u32> = w["ranks"]
                .as_array()
                .into_iter()
                .flatten()
                .filter_map(|r| r["dp_rank"].as_u64().and_then(|r| u32::try_from(r).ok()))
                .collect();
            ranks.sort_unstable();
            Some(Target {
                flavor: w["flavor"]
                    .as_str()
                    .and_then(|f| f.parse().ok())
                    .unwrap_or_default(),
                url: w["url"]
                    .as_str()
                    .unwrap_or_default()
                    .trim_end_matches('/')
                    .to_owned(),
                block_size: w["block_size"]
                    .as_u64()
                    .and_then(|b| u32::try_from(b).ok())
                    .unwrap_or(16),
                id,
                name,
                ranks,
            })
        })
        .filter(|t| !t.url.is_empty() && !t.ranks.is_empty())
        .collect()
}

impl Router {
    /// A router with no workers yet (see [`Router::refresh`]).
    pub fn new(config: RouterConfig) -> Result<Self, reqwest::Error> {
        let client = reqwest::Client::builder()
            .connect_timeout(config.connect_timeout)
            .pool_max_idle_per_host(256)
            .build()?;
        let seed = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map_or(0x9e37_79b9, |d| d.as_nanos() as u64);
        Ok(Router {
            queue: tokio::sync::Semaphore::new(config.queue_capacity),
            load_dropped: tokio::sync::Notify::new(),
            config,
            client,
            targets: RwLock::new(Arc::new(Vec::new())),
            active: Mutex::new(HashMap::new()),
            breakers: Mutex::new(HashMap::new()),
            metrics: Metrics::default(),
            next_id: AtomicU64::new(1),
            turn: AtomicU64::new(0),
            rng: AtomicU64::new(seed | 1),
            started: Instant::now(),
        })
    }

    /// Fills in `req.tokens` and `req.images` from its text with the
    /// tokenizer, if there is one. Requests with token ids keep them as given.
    pub(crate) fn tokenize(&self, req: &mut RoutingRequest, body: &[u8], chat: bool) {
        if req.tokens.is_some() {
            return;
        }
        if let Some(prompt) = self
            .config
            .tokenizer
            .as_ref()
            .and_then(|t| t.prompt(body, chat))
        {
            req.tokens = Some(prompt.tokens);
            req.images = prompt.images;
        }
    }

    /// The configuration.
    pub fn config(&self) -> &RouterConfig {
        &self.config
    }

    /// Milliseconds since the router started: the clock of the approximate index.
    pub fn now_ms(&self) -> u64 {
        self.started.elapsed().as_millis() as u64
    }

    /// Re-reads the workers from the registry.
    pub fn refresh(&self, registry: &Registry) {
        let targets = Arc::new(targets_of(registry));
        *self.targets.write().unwrap_or_else(PoisonError::into_inner) = targets;
    }

    /// Drops active requests older than the expiry.
    pub fn expire_active(&self) {
        let now = self.now_ms();
        let max = self.config.active_expiry.as_millis() as u64;
        for a in lock(&self.active).values_mut() {
            a.expire(now, max);
        }
    }

    /// A uniform number in `[0, 1)` (splitmix64 over an atomic counter).
    pub(crate) fn random(&self) -> f64 {
        let state = self
            .rng
            .fetch_add(SplitMix64::GAMMA, Ordering::Relaxed)
            .wrapping_add(SplitMix64::GAMMA);
        unit_f64(mix(state))
    }

    /// Whether a worker may be chosen: its breaker is closed, or open past
    /// its period with no probe in flight.
    fn available(&self, name: &str) -> bool {
        let breakers = lock(&self.breakers);
        breakers.get(name).is_none_or(|b| b.allows(Instant::now()))
    }

    /// Called just before sending to a worker: a worker whose breaker is
    /// half-open gets one probe at a time (a probe lost without an outcome
    /// expires after the breaker period). `false`: skip this worker.
    fn begin_attempt(&self, name: &str) -> bool {
        let mut breakers = lock(&self.breakers);
        let Some(b) = breakers.get_mut(name) else {
            return true;
        };
        let now = Instant::now();
        if !b.allows(now) {
            return false;
        }
        if b.open_until.is_some() {
            b.probe_until = Some(now + self.config.breaker_open);
        }
        true
    }

    fn record_outcome(&self, name: &str, ok: bool) {
        let mut breakers = lock(&self.breakers);
        if ok {
            // A worker without an entry has a closed breaker already.
            if let Some(b) = breakers.get_mut(name) {
                *b = Breaker::default();
            }
        } else {
            let b = match breakers.get_mut(name) {
                Some(b) => b,
                None => breakers.entry(name.to_owned()).or_default(),
            };
            b.failures += 1;
            b.probe_until = None;
            if b.failures >= self.config.breaker_failures {
                warn!(worker = name, failures = b.failures, "circuit breaker open");
                b.open_until = Some(Instant::now() + self.config.breaker_open);
            }
        }
    }

    /// Scores every available candidate for a request. `locals_at(block_size,
    /// flavor)` gives the request's local hashes for a worker; when
    /// `flavor_matters` is false (no images) every flavour shares one set.
    pub(crate) fn score(
        &self,
        index: &SharedIndex,
        locals_at: &dyn Fn(u32, WorkerFlavor) -> Vec<LocalBlockHash>,
        request_tokens: u64,
        flavor_matters: bool,
    ) -> (Arc<Vec<Target>>, Vec<Scored>) {
        let (targets, scored, _) =
            self.score_keeping_hashes(index, locals_at, request_tokens, flavor_matters);
        (targets, scored)
    }

    /// [`Router::score`], also returning the request's hashes computed on the
    /// way, so that the chosen candidate's need not be computed again.
    fn score_keeping_hashes(
        &self,
        index: &SharedIndex,
        locals_at: &dyn Fn(u32, WorkerFlavor) -> Vec<LocalBlockHash>,
        request_tokens: u64,
        flavor_matters: bool,
    ) -> (Arc<Vec<Target>>, Vec<Scored>, RequestHashes) {
        let targets = self
            .targets
            .read()
            .unwrap_or_else(PoisonError::into_inner)
            .clone();
        let key = |f: WorkerFlavor| {
            if flavor_matters {
                f
            } else {
                WorkerFlavor::Vllm
            }
        };
        // Index walks first, outside the active-sequence lock: one per
        // (block size, flavour) present in the fleet.
        type Found = (u32, WorkerFlavor, Vec<RankMatch>, Vec<SequenceHash>);
        let mut matches: Vec<Found> = Vec::new();
        let mut hashes = RequestHashes {
            flavor_matters,
            sets: Vec::new(),
        };
        for t in targets.iter() {
            let f = key(t.flavor);
            if !matches
                .iter()
                .any(|(bs, fl, _, _)| *bs == t.block_size && *fl == f)
            {
                let locals = locals_at(t.block_size, f);
                let seqs = sequence_hashes(&locals);
                matches.push((t.block_size, f, index.find_matches(&locals), seqs.clone()));
                hashes.sets.push((t.block_size, f, locals, seqs));
            }
        }
        let active = lock(&self.active);
        let scored = routing::score(
            &targets,
            request_tokens,
            &mut |bs, flavor| {
                let f = key(flavor);
                matches
                    .iter()
                    .find(|(b, fl, _, _)| *b == bs && *fl == f)
                    .map(|(_, _, m, s)| (m.clone(), s.clone()))
                    .unwrap_or_default()
            },
            &|k, seqs| Load::of(active.get(&k), seqs),
            &|n| self.available(n),
            &self.config.weights,
            &self.config.busy,
        );
        drop(active);
        (targets, scored, hashes)
    }
}

/// A request's local and sequence hashes per (block size, flavour) of the
/// fleet, as scoring computed them.
struct RequestHashes {
    flavor_matters: bool,
    sets: Vec<(u32, WorkerFlavor, Vec<LocalBlockHash>, Vec<SequenceHash>)>,
}

impl RequestHashes {
    /// The hashes for a worker of this block size and flavour, if scored.
    fn get(
        &self,
        block_size: u32,
        flavor: WorkerFlavor,
    ) -> Option<(&[LocalBlockHash], &[SequenceHash])> {
        let f = if self.flavor_matters {
            flavor
        } else {
            WorkerFlavor::Vllm
        };
        self.sets
            .iter()
            .find(|(bs, fl, _, _)| *bs == block_size && *fl == f)
            .map(|(_, _, l, s)| (l.as_slice(), s.as_slice()))
    }
}

/// Frees a request's active entry when dropped (end, error or disconnect).
struct ActiveGuard {
    router: Arc<Router>,
    key: WorkerRank,
    id: u64,
}

impl ActiveGuard {
    fn add(
        router: &Arc<Router>,
        key: WorkerRank,
        blocks: &[kvroute_core::hash::SequenceHash],
        prefill: u64,
    ) -> Self {
        let id = router.next_id.fetch_add(1, Ordering::Relaxed);
        let now = router.now_ms();
        lock(&router.active)
            .entry(key)
            .or_default()
            .add(id, blocks, prefill, now);
        ActiveGuard {
            router: router.clone(),
            key,
            id,
        }
    }

    fn prefill_done(&self) {
        if let Some(a) = lock(&self.router.active).get_mut(&self.key) {
            a.prefill_done(self.id);
        }
        self.router.load_dropped.notify_waiters();
    }
}

impl Drop for ActiveGuard {
    fn drop(&mut self) {
        if let Some(a) = lock(&self.router.active).get_mut(&self.key) {
            a.free(self.id);
        }
        self.router.load_dropped.notify_waiters();
    }
}

/// What the accuracy check needs after the response.
#[derive(Debug, Clone, Copy)]
struct Prediction {
    predicted: u64,
}

impl Router {
    fn compare(&self, predicted: u64, reported: u64) {
        let m = &self.metrics;
        let diff = predicted.abs_diff(reported);
        m.comparisons.fetch_add(1, Ordering::Relaxed);
        if diff == 0 {
            m.exact.fetch_add(1, Ordering::Relaxed);
        }
        m.diff_sum.fetch_add(diff, Ordering::Relaxed);
        for (i, bound) in ACCURACY_BUCKETS.iter().enumerate() {
            if diff <= *bound {
                m.diff_buckets[i].fetch_add(1, Ordering::Relaxed);
            }
        }
    }
}

/// `usage.prompt_tokens_details.cached_tokens` of a JSON document.
fn cached_tokens(doc: &Value) -> Option<u64> {
    doc.get("usage")?
        .get("prompt_tokens_details")?
        .get("cached_tokens")?
        .as_u64()
}

#[derive(serde::Deserialize)]
struct UsageDoc {
    usage: Option<UsageOnly>,
}

#[derive(serde::Deserialize)]
struct UsageOnly {
    prompt_tokens_details: Option<Details>,
}

#[derive(serde::Deserialize)]
struct Details {
    cached_tokens: Option<u64>,
}

/// `usage.prompt_tokens_details.cached_tokens` of a response body, read
/// without building the rest of the document.
fn reported_cached_tokens(body: &[u8]) -> Option<u64> {
    serde_json::from_slice::<UsageDoc>(body)
        .ok()?
        .usage?
        .prompt_tokens_details?
        .cached_tokens
}

/// The cached tokens reported in an SSE chunk's usage, if it has one.
fn cached_tokens_in_sse(chunk: &[u8]) -> Option<u64> {
    let text = std::str::from_utf8(chunk).ok()?;
    text.lines()
        .filter_map(|l| l.strip_prefix("data: "))
        .filter(|d| d.contains("cached_tokens"))
        .filter_map(|d| serde_json::from_str::<Value>(d).ok())
        .find_map(|d| cached_tokens(&d))
}

/// The end of the first complete SSE event in `buf` (after its blank line).
fn sse_event_end(buf: &[u8]) -> Option<usize> {
    let lf = buf.windows(2).position(|w| w == b"\n\n").map(|i| i + 2);
    let crlf = buf.windows(4).position(|w| w == b"\r\n\r\n").map(|i| i + 4);
    match (lf, crlf) {
        (Some(a), Some(b)) => Some(a.min(b)),
        (a, b) => a.or(b),
    }
}

/// Whether JSON text has `"choices"` followed by an empty array.
fn has_empty_choices(text: &[u8]) -> bool {
    let key = b"\"choices\"";
    let mut from = 0;
    while let Some(i) = text[from..].windows(key.len()).position(|w| w == key) {
        let rest = text[from + i + key.len()..]
            .iter()
            .copied()
            .filter(|b| !b.is_ascii_whitespace());
        let mut rest = rest.take(3);
        if rest.next() == Some(b':') && rest.next() == Some(b'[') && rest.next() == Some(b']') {
            return true;
        }
        from += i + key.len();
    }
    false
}

/// If one SSE event is a usage-only chunk (`"choices": []` and a `usage`
/// object, what an engine sends last for `include_usage`), its usage's
/// `cached_tokens` (`Some(None)` when it has none); otherwise `None`.
fn usage_only_event(event: &[u8]) -> Option<Option<u64>> {
    if !has_empty_choices(event) {
        return None;
    }
    let text = std::str::from_utf8(event).ok()?;
    let data: String = text
        .lines()
        .filter_map(|l| l.strip_prefix("data:"))
        .map(|d| d.strip_prefix(' ').unwrap_or(d))
        .collect::<Vec<_>>()
        .join("\n");
    let doc: Value = serde_json::from_str(&data).ok()?;
    let empty = doc.get("choices")?.as_array()?.is_empty();
    (empty && doc.get("usage")?.is_object()).then(|| cached_tokens(&doc))
}

/// Removes usage-only chunks from an SSE stream that kvroute asked for
/// (`stream_options.include_usage` added by the proxy), reading their
/// `cached_tokens` first. Holds at most one incomplete event: every complete
/// event is passed on as soon as its blank line arrives.
#[derive(Debug, Default)]
struct UsageStripper {
    pending: Vec<u8>,
}

impl UsageStripper {
    /// Takes the next upstream bytes; returns what to pass on now and the
    /// `cached_tokens` of a usage chunk removed from them, if any.
    fn feed(&mut self, chunk: &[u8]) -> (Vec<u8>, Option<u64>) {
        self.pending.extend_from_slice(chunk);
        let mut out = Vec::with_capacity(self.pending.len());
        let mut reported = None;
        let mut start = 0;
        while let Some(len) = sse_event_end(&self.pending[start..]) {
            let event = &self.pending[start..start + len];
            match usage_only_event(event) {
                Some(cached) => reported = reported.or(cached),
                None => out.extend_from_slice(event),
            }
            start += len;
        }
        self.pending.drain(..start);
        (out, reported)
    }

    /// What is left when the upstream ends (an unterminated event), passed on as is.
    fn finish(&mut self) -> Vec<u8> {
        std::mem::take(&mut self.pending)
    }
}

/// The upstream body, passed through chunk by chunk; holds the active entry.
struct Passthrough<S> {
    inner: S,
    guard: Option<ActiveGuard>,
    first: bool,
    prediction: Option<Prediction>,
    /// Set when the proxy added `include_usage`: drop the usage-only chunk.
    strip: Option<UsageStripper>,
    done: bool,
}

impl<S> Passthrough<S> {
    fn report(&mut self, reported: Option<u64>) {
        if let (Some(p), Some(g), Some(reported)) = (self.prediction, &self.guard, reported) {
            g.router.compare(p.predicted, reported);
            self.prediction = None;
        }
    }
}

impl<S> Stream for Passthrough<S>
where
    S: Stream<Item = Result<Bytes, reqwest::Error>> + Unpin,
{
    type Item = Result<Bytes, reqwest::Error>;

    fn poll_next(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Option<Self::Item>> {
        let this = &mut *self;
        if this.done {
            return Poll::Ready(None);
        }
        loop {
            match Pin::new(&mut this.inner).poll_next(cx) {
                Poll::Ready(Some(Ok(chunk))) => {
                    if this.first {
                        this.first = false;
                        if let Some(g) = &this.guard {
                            g.prefill_done();
                        }
                    }
                    let (out, reported) = match &mut this.strip {
                        Some(strip) => {
                            let (out, reported) = strip.feed(&chunk);
                            (Bytes::from(out), reported)
                        }
                        None => {
                            let reported =
                                this.prediction.and_then(|_| cached_tokens_in_sse(&chunk));
                            (chunk, reported)
                        }
                    };
                    this.report(reported);
                    if out.is_empty() {
                        continue;
                    }
                    return Poll::Ready(Some(Ok(out)));
                }
                Poll::Ready(Some(Err(e))) => {
                    this.guard = None;
                    this.done = true;
                    return Poll::Ready(Some(Err(e)));
                }
                Poll::Ready(None) => {
                    this.guard = None;
                    this.done = true;
                    let rest = this.strip.as_mut().map(UsageStripper::finish);
                    return match rest {
                        Some(rest) if !rest.is_empty() => Poll::Ready(Some(Ok(Bytes::from(rest)))),
                        _ => Poll::Ready(None),
                    };
                }
                Poll::Pending => return Poll::Pending,
            }
        }
    }
}

fn error_response(status: StatusCode, kind: &str, message: impl Into<String>) -> Response {
    (
        status,
        Json(json!({"error": {"message": message.into(), "type": kind, "code": status.as_u16()}})),
    )
        .into_response()
}

/// `POST /v1/completions`.
pub async fn completions(
    State(state): State<AppState>,
    headers: HeaderMap,
    body: Bytes,
) -> Response {
    proxy(state, headers, body, "/v1/completions", false).await
}

/// `POST /v1/chat/completions`.
pub async fn chat_completions(
    State(state): State<AppState>,
    headers: HeaderMap,
    body: Bytes,
) -> Response {
    proxy(state, headers, body, "/v1/chat/completions", true).await
}

async fn proxy(
    state: AppState,
    headers: HeaderMap,
    body: Bytes,
    path: &str,
    chat: bool,
) -> Response {
    let router = state.router.clone();
    router.metrics.requests.fetch_add(1, Ordering::Relaxed);
    let mut req = match routing::parse_request(&body, chat) {
        Ok(r) => r,
        Err(e) => {
            router.metrics.bad_requests.fetch_add(1, Ordering::Relaxed);
            return error_response(StatusCode::BAD_REQUEST, "invalid_request_error", e.0);
        }
    };
    router.tokenize(&mut req, &body, chat);
    if req.tokens.is_none() {
        router.metrics.load_only.fetch_add(1, Ordering::Relaxed);
    }
    let request_tokens = req.tokens.as_ref().map_or(0, |t| t.len() as u64);
    let locals_at = |bs: u32, flavor: WorkerFlavor| routing::request_hashes(&req, bs, flavor);
    let index = state.index.clone();
    let queued_until = tokio::time::Instant::now() + router.config.queue_timeout;
    let mut place_in_queue = None;
    let (targets, scored, hashes, ordered) = loop {
        let (targets, scored, hashes) =
            router.score_keeping_hashes(&index, &locals_at, request_tokens, !req.images.is_empty());
        if scored.is_empty() {
            router.metrics.no_workers.fetch_add(1, Ordering::Relaxed);
            return error_response(
                StatusCode::SERVICE_UNAVAILABLE,
                "no_workers",
                "no worker is available (none registered, or all failing)",
            );
        }
        let turn = router.turn.fetch_add(1, Ordering::Relaxed);
        let ordered = order(
            &scored,
            router.config.policy,
            router.config.temperature,
            router.random(),
            turn,
        );
        if !ordered.is_empty() {
            break (targets, scored, hashes, ordered);
        }
        // Every rank is over a busy threshold: wait in the bounded queue
        // for load to drop, or refuse.
        if place_in_queue.is_none() {
            place_in_queue = router.queue.try_acquire().ok();
            if place_in_queue.is_some() {
                router.metrics.queued.fetch_add(1, Ordering::Relaxed);
            }
        }
        let may_wait = place_in_queue.is_some() && tokio::time::Instant::now() < queued_until;
        if !may_wait {
            router.metrics.overloaded.fetch_add(1, Ordering::Relaxed);
            if place_in_queue.is_some() {
                router
                    .metrics
                    .queue_timeouts
                    .fetch_add(1, Ordering::Relaxed);
            }
            return error_response(
                StatusCode::SERVICE_UNAVAILABLE,
                "overloaded",
                format!(
                    "all {} worker rank(s) are over their busy thresholds (prefill tokens {:?}, decode blocks {:?}){}; retry later",
                    scored.len(),
                    router.config.busy.prefill_tokens,
                    router.config.busy.decode_blocks,
                    if place_in_queue.is_some() {
                        format!(" after {} ms in the queue", router.config.queue_timeout.as_millis())
                    } else if router.config.queue_capacity > 0 {
                        " and the queue is full".to_owned()
                    } else {
                        String::new()
                    }
                ),
            );
        }
        // Woken when a prefill or a request ends; re-checked at least every
        // 100 ms in case a wake-up came between scoring and waiting.
        let recheck = (tokio::time::Instant::now() + Duration::from_millis(100)).min(queued_until);
        let _ = tokio::time::timeout_at(recheck, router.load_dropped.notified()).await;
    };
    drop(place_in_queue);
    let mut last_error = String::new();
    for (attempt, &i) in ordered
        .iter()
        .take(router.config.max_attempts.max(1))
        .enumerate()
    {
        let s = &scored[i];
        let Some(target) = targets.get(s.worker) else {
            continue;
        };
        if !router.begin_attempt(&s.name) {
            continue;
        }
        if attempt > 0 {
            router.metrics.retries.fetch_add(1, Ordering::Relaxed);
        }
        let computed;
        let (locals, seqs) = match hashes.get(s.block_size, s.flavor) {
            Some(found) => found,
            None => {
                let locals = locals_at(s.block_size, s.flavor);
                let seqs = sequence_hashes(&locals);
                computed = (locals, seqs);
                (computed.0.as_slice(), computed.1.as_slice())
            }
        };
        let cached = u64::from(s.candidate.device_blocks) * u64::from(s.block_size);
        let guard = ActiveGuard::add(&router, s.key, seqs, request_tokens.saturating_sub(cached));
        let multi_rank = target.ranks.len() > 1;
        let rank_in_body = router.config.dp_rank_in_body || s.flavor == WorkerFlavor::Sglang;
        let mut payload = body.clone();
        if multi_rank && rank_in_body {
            match inject_dp_rank(&payload, s.key.rank) {
                Ok(b) => payload = Bytes::from(b),
                Err(e) => {
                    return error_response(StatusCode::BAD_REQUEST, "invalid_request_error", e.0)
                }
            }
        }
        let add_usage = req.stream && !req.include_usage && req.tokens.is_some();
        if add_usage {
            match inject_include_usage(&payload) {
                Ok(b) => payload = Bytes::from(b),
                Err(e) => {
                    return error_response(StatusCode::BAD_REQUEST, "invalid_request_error", e.0)
                }
            }
        }
        if s.flavor == WorkerFlavor::Sglang && !req.images.is_empty() && !req.mm_hashes_given {
            let hashes: Vec<u64> = req.images.iter().map(|i| i.identity.hash).collect();
            match inject_mm_hashes(&payload, &hashes) {
                Ok(b) => payload = Bytes::from(b),
                Err(e) => {
                    return error_response(StatusCode::BAD_REQUEST, "invalid_request_error", e.0)
                }
            }
        }
        let mut upstream = router
            .client
            .post(format!("{}{path}", target.url))
            .timeout(router.config.request_timeout)
            .header(header::CONTENT_TYPE, "application/json")
            .body(payload);
        if multi_rank && !rank_in_body {
            upstream = upstream.header("X-data-parallel-rank", s.key.rank.to_string());
        }
        if let Some(auth) = headers.get(header::AUTHORIZATION) {
            upstream = upstream.header(header::AUTHORIZATION, auth.clone());
        }
        let resp = match upstream.send().await {
            Ok(r) => r,
            Err(e) => {
                debug!(worker = %s.name, error = %e, "upstream request failed");
                router
                    .metrics
                    .upstream_errors
                    .fetch_add(1, Ordering::Relaxed);
                router.record_outcome(&s.name, false);
                last_error = format!("worker `{}`: {e}", s.name);
                continue;
            }
        };
        let status = resp.status();
        if status.is_server_error() {
            router
                .metrics
                .upstream_errors
                .fetch_add(1, Ordering::Relaxed);
            router.record_outcome(&s.name, false);
            last_error = format!("worker `{}` answered {status}", s.name);
            continue;
        }
        router.record_outcome(&s.name, true);
        if router.config.policy == Policy::Approx && !locals.is_empty() {
            let now = router.now_ms();
            index.write().record_routing_decision(s.key, locals, now);
        }
        {
            let mut routed = lock(&router.metrics.routed);
            let ranks = match routed.get_mut(s.name.as_str()) {
                Some(ranks) => ranks,
                None => routed.entry(s.name.clone()).or_default(),
            };
            *ranks.entry(s.key.rank).or_insert(0) += 1;
        }
        let prediction = req.tokens.as_ref().map(|t| Prediction {
            predicted: predicted_cached_tokens(
                s.candidate.device_blocks,
                s.block_size,
                t.len() as u64,
            ),
        });
        let mut builder = Response::builder()
            .status(status.as_u16())
            .header("x-kvroute-worker", s.name.as_str())
            .header("x-kvroute-dp-rank", s.key.rank);
        if let Some(ct) = resp.headers().get(header::CONTENT_TYPE) {
            if let Ok(v) = HeaderValue::from_bytes(ct.as_bytes()) {
                builder = builder.header(header::CONTENT_TYPE, v);
            }
        }
        let streaming = req.stream
            || resp
                .headers()
                .get(header::CONTENT_TYPE)
                .is_some_and(|v| v.as_bytes().starts_with(b"text/event-stream"));
        if streaming {
            let body = Body::from_stream(Passthrough {
                inner: Box::pin(resp.bytes_stream()),
                guard: Some(guard),
                first: true,
                prediction: prediction.filter(|_| status.is_success()),
                strip: (add_usage && status.is_success()).then(UsageStripper::default),
                done: false,
            });
            return builder.body(body).unwrap_or_else(|e| {
                error_response(
                    StatusCode::INTERNAL_SERVER_ERROR,
                    "internal_error",
                    e.to_string(),
                )
            });
        }
        guard.prefill_done();
        let bytes = match resp.bytes().await {
            Ok(b) => b,
            Err(e) => {
                return error_response(
                    StatusCode::BAD_GATEWAY,
                    "upstream_error",
                    format!("worker `{}`: reading the response: {e}", s.name),
                )
            }
        };
        drop(guard);
        if let (true, Some(p)) = (status.is_success(), prediction) {
            if let Some(reported) = reported_cached_tokens(&bytes) {
                router.compare(p.predicted, reported);
            }
        }
        return builder.body(Body::from(bytes)).unwrap_or_else(|e| {
            error_response(
                StatusCode::INTERNAL_SERVER_ERROR,
                "internal_error",
                e.to_string(),
            )
        });
    }
    error_response(
        StatusCode::BAD_GATEWAY,
        "upstream_error",
        format!("no worker answered: {last_error}"),
    )
}

/// `GET /v1/models`: the union of every worker's models.
pub async fn models(State(state): State<AppState>) -> Response {
    let targets = state
        .router
        .targets
        .read()
        .unwrap_or_else(PoisonError::into_inner)
        .clone();
    let mut seen = Map::new();
    for t in targets.iter() {
        let Ok(resp) = state
            .router
            .client
            .get(format!("{}/v1/models", t.url))
            .timeout(Duration::from_secs(5))
            .send()
            .await
        else {
            continue;
        };
        let Ok(doc) = resp.json::<Value>().await else {
            continue;
        };
        for m in doc["data"].as_array().into_iter().flatten() {
            if let Some(id) = m["id"].as_str() {
                seen.entry(id.to_owned()).or_insert_with(|| m.clone());
            }
        }
    }
    let data: Vec<Value> = seen.into_iter().map(|(_, v)| v).collect();
    Json(json!({"object": "list", "data": data})).into_response()
}

/// Prometheus text of the routing counters.
pub fn metrics_text(router: &Router, out: &mut String) {
    let m = &router.metrics;
    let get = |a: &AtomicU64| a.load(Ordering::Relaxed);
    let counters = [
        (
            "kvroute_proxy_requests_total",
            "Completion requests received.",
            get(&m.requests),
        ),
        (
            "kvroute_proxy_bad_requests_total",
            "Requests refused as malformed.",
            get(&m.bad_requests),
        ),
        (
            "kvroute_proxy_upstream_errors_total",
            "Connection errors and 5xx answers from workers.",
            get(&m.upstream_errors),
        ),
        (
            "kvroute_proxy_retries_total",
            "Attempts on a further candidate after a failure.",
            get(&m.retries),
        ),
        (
            "kvroute_proxy_overloaded_total",
            "Requests refused because every candidate was busy.",
            get(&m.overloaded),
        ),
        (
            "kvroute_proxy_queued_total",
            "Requests that waited in the overload queue.",
            get(&m.queued),
        ),
        (
            "kvroute_proxy_queue_timeouts_total",
            "Queued requests refused when their wait ran out.",
            get(&m.queue_timeouts),
        ),
        (
            "kvroute_proxy_no_workers_total",
            "Requests refused because no worker was available.",
            get(&m.no_workers),
        ),
        (
            "kvroute_proxy_load_only_total",
            "Text requests routed on load alone (no tokenizer).",
            get(&m.load_only),
        ),
        (
            "kvroute_accuracy_comparisons_total",
            "Responses whose cached_tokens were compared with the prediction.",
            get(&m.comparisons),
        ),
        (
            "kvroute_accuracy_exact_total",
            "Comparisons where prediction and cached_tokens agreed exactly.",
            get(&m.exact),
        ),
    ];
    for (name, help, value) in counters {
        let _ = writeln!(
            out,
            "# HELP {name} {help}\n# TYPE {name} counter\n{name} {value}"
        );
    }
    let name = "kvroute_accuracy_difference_tokens";
    let _ = writeln!(
        out,
        "# HELP {name} |predicted cached tokens - engine cached_tokens|.\n# TYPE {name} histogram"
    );
    for (i, bound) in ACCURACY_BUCKETS.iter().enumerate() {
        let _ = writeln!(
            out,
            "{name}_bucket{{le=\"{bound}\"}} {}",
            get(&m.diff_buckets[i])
        );
    }
    let count = get(&m.comparisons);
    let _ = writeln!(out, "{name}_bucket{{le=\"+Inf\"}} {count}");
    let _ = writeln!(out, "{name}_sum {}\n{name}_count {count}", get(&m.diff_sum));
    let name = "kvroute_proxy_routed_total";
    let _ = writeln!(
        out,
        "# HELP {name} Requests forwarded per (worker, rank).\n# TYPE {name} counter"
    );
    let mut routed: Vec<((String, u32), u64)> = lock(&m.routed)
        .iter()
        .flat_map(|(w, ranks)| ranks.iter().map(|(&r, &n)| ((w.clone(), r), n)))
        .collect();
    routed.sort();
    for ((worker, rank), n) in routed {
        let _ = writeln!(out, "{name}{{worker=\"{worker}\",dp_rank=\"{rank}\"}} {n}");
    }
    let name = "kvroute_active_requests";
    let _ = writeln!(
        out,
        "# HELP {name} Requests in flight per (worker, rank).\n# TYPE {name} gauge"
    );
    let names: HashMap<WorkerId, String> = router
        .targets
        .read()
        .unwrap_or_else(PoisonError::into_inner)
        .iter()
        .map(|t| (t.id, t.name.clone()))
        .collect();
    let mut active: Vec<(WorkerRank, u64, u64, u64)> = lock(&router.active)
        .iter()
        .map(|(k, a)| {
            (
                *k,
                a.active_requests(),
                a.active_prefill_tokens(),
                a.active_blocks(),
            )
        })
        .collect();
    active.sort();
    for (k, reqs, _, _) in &active {
        let w = names.get(&k.worker).map_or("", String::as_str);
        let _ = writeln!(
            out,
            "{name}{{worker=\"{w}\",dp_rank=\"{}\"}} {reqs}",
            k.rank
        );
    }
    let name = "kvroute_active_prefill_tokens";
    let _ = writeln!(out, "# TYPE {name} gauge");
    for (k, _, p, _) in &active {
        let w = names.get(&k.worker).map_or("", String::as_str);
        let _ = writeln!(out, "{name}{{worker=\"{w}\",dp_rank=\"{}\"}} {p}", k.rank);
    }
    let name = "kvroute_active_decode_blocks";
    let _ = writeln!(out, "# TYPE {name} gauge");
    for (k, _, _, b) in &active {
        let w = names.get(&k.worker).map_or("", String::as_str);
        let _ = writeln!(out, "{name}{{worker=\"{w}\",dp_rank=\"{}\"}} {b}", k.rank);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn usage_is_found_in_documents_and_sse_chunks() {
        let doc = json!({"usage": {"prompt_tokens_details": {"cached_tokens": 48}}});
        assert_eq!(cached_tokens(&doc), Some(48));
        assert_eq!(reported_cached_tokens(doc.to_string().as_bytes()), Some(48));
        assert_eq!(reported_cached_tokens(b"{\"id\":1}"), None);
        let chunk = b"data: {\"choices\":[],\"usage\":{\"prompt_tokens_details\":{\"cached_tokens\":32}}}\n\ndata: [DONE]\n\n";
        assert_eq!(cached_tokens_in_sse(chunk), Some(32));
        assert_eq!(cached_tokens_in_sse(b"data: {\"choices\":[]}\n\n"), None);
    }

    const ROLE: &[u8] =
        b"data: {\"id\":\"c\",\"choices\":[{\"index\":0,\"text\":\"a\"}],\"usage\":null}\n\n";
    const USAGE: &[u8] = b"data: {\"id\":\"c\",\"choices\":[],\"usage\":{\"prompt_tokens\":64,\"prompt_tokens_details\":{\"cached_tokens\":48}}}\n\n";
    const DONE: &[u8] = b"data: [DONE]\n\n";

    #[test]
    fn the_usage_chunk_is_removed_whatever_the_chunk_boundaries() {
        let stream: Vec<u8> = [ROLE, ROLE, USAGE, DONE].concat();
        let expected: Vec<u8> = [ROLE, ROLE, DONE].concat();
        // Every way of cutting the stream in two, and byte by byte.
        for cut in 0..=stream.len() {
            let mut f = UsageStripper::default();
            let (mut out, a) = f.feed(&stream[..cut]);
            let (rest, b) = f.feed(&stream[cut..]);
            out.extend(rest);
            out.extend(f.finish());
            assert_eq!(out, expected, "cut at {cut}");
            assert_eq!(a.or(b), Some(48), "cut at {cut}");
        }
        let mut f = UsageStripper::default();
        let mut out = Vec::new();
        let mut reported = None;
        for byte in &stream {
            let (o, r) = f.feed(std::slice::from_ref(byte));
            // Nothing is held beyond the event in progress.
            assert!(f.pending.len() <= USAGE.len());
            out.extend(o);
            reported = reported.or(r);
        }
        assert_eq!((out, reported), (expected, Some(48)));
    }

    #[test]
    fn complete_events_pass_at_once_and_other_chunks_stay() {
        let mut f = UsageStripper::default();
        // A whole event and half of the next: the whole one passes now.
        let (out, _) = f.feed(&[ROLE, &ROLE[..10]].concat());
        assert_eq!(out, ROLE);
        let (out, _) = f.feed(&ROLE[10..]);
        assert_eq!(out, ROLE);
        // CRLF framing, and a chunk with choices and usage is kept.
        let crlf = b"data: {\"choices\": [ ], \"usage\": {\"prompt_tokens_details\": {\"cached_tokens\": 16}}}\r\n\r\n";
        assert_eq!(f.feed(crlf), (Vec::new(), Some(16)));
        let with_choices =
            b"data: {\"choices\":[{\"text\":\"\"}],\"usage\":{\"prompt_tokens\":1}}\n\n";
        assert_eq!(f.feed(with_choices).0, with_choices);
        // An unterminated tail is passed on at the end.
        assert_eq!(f.feed(b"data: [DO").0, b"");
        assert_eq!(f.finish(), b"data: [DO");
        assert!(has_empty_choices(b"{\"choices\" :\n[]}"));
        assert!(!has_empty_choices(b"{\"choices\":[1]}"));
    }

    #[test]
    fn the_breaker_opens_after_repeated_failures_and_a_success_closes_it() {
        let router = Router::new(RouterConfig {
            breaker_failures: 2,
            breaker_open: Duration::from_secs(60),
            ..RouterConfig::default()
        })
        .expect("client");
        router.record_outcome("w0", false);
        assert!(router.available("w0"));
        router.record_outcome("w0", false);
        assert!(!router.available("w0"));
        router.record_outcome("w0", true);
        assert!(router.available("w0"));
    }

    #[test]
    fn a_half_open_breaker_lets_one_probe_through() {
        let t0 = Instant::now();
        let s = Duration::from_secs;
        let mut b = Breaker {
            failures: 3,
            open_until: Some(t0 + s(10)),
            probe_until: None,
        };
        assert!(!b.allows(t0));
        assert!(b.allows(t0 + s(11)));
        // A probe in flight keeps everyone else out until it ends or expires.
        b.probe_until = Some(t0 + s(21));
        assert!(!b.allows(t0 + s(12)));
        assert!(b.allows(t0 + s(22)));
        assert!(Breaker::default().allows(t0));
    }

    #[test]
    fn the_accuracy_histogram_is_cumulative() {
        let router = Router::new(RouterConfig::default()).expect("client");
        router.compare(48, 48);
        router.compare(64, 48);
        let mut text = String::new();
        metrics_text(&router, &mut text);
        assert!(text.contains("kvroute_accuracy_comparisons_total 2"));
        assert!(text.contains("kvroute_accuracy_exact_total 1"));
        assert!(text.contains("kvroute_accuracy_difference_tokens_bucket{le=\"0\"} 1"));
        assert!(text.contains("kvroute_accuracy_difference_tokens_bucket{le=\"16\"} 2"));
    }
}
