//! The routing proxy: OpenAI requests in, the chosen worker's response out.
//!
//! A request flows through one module per step:
//! 1. `kvroute_prompt::body` reads the body once for what routing needs;
//! 2. the prompt tokenizer turns a text prompt or chat messages into token
//!    ids (requests with ids skip it; without a tokenizer they are routed on
//!    load alone);
//! 3. [`candidates`] hashes the prompt per block size and engine flavour,
//!    matches the index and prices every rank with the core's scheduler;
//! 4. [`attempt`] orders the candidates by the policy, waits in the bounded
//!    overload queue if every rank is busy, and sends the request to the
//!    first, then the next only when the worker did no work (the retry rule
//!    of [`outcome`]: a connection error, a 503 or 429), skipping workers
//!    whose circuit [`breaker`] is open; [`rewrite`] adds the rank, image
//!    hashes or `include_usage` to the body on the way;
//! 5. [`relay`] passes the answer back (streams chunk by chunk) and compares
//!    the engine's `cached_tokens` with the prediction; how the answer ends
//!    (whole, or cut off) is what the worker's breaker records;
//! 6. [`active`] holds the request's place in its rank's load until it
//!    ends, and with `--learn-speeds` tells [`speeds`] how fast it decoded.

pub mod active;
pub mod answer;
pub mod attempt;
pub mod breaker;
pub mod candidates;
pub mod context;
pub mod continuations;
pub mod disagg;
pub mod handoff;
pub mod intake;
pub mod merge;
pub mod model_list;
pub mod observe;
pub mod outcome;
pub mod owners;
pub mod queue;
pub mod relay;
pub mod reported;
pub mod rewrite;
pub mod sessions;
pub mod shared;
pub mod speeds;
pub mod tenants;

use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, OnceLock, PoisonError, RwLock};
use std::time::{Duration, Instant};

use axum::extract::State;
use axum::http::{HeaderMap, HeaderValue};
use axum::response::{IntoResponse, Response};
use kvroute_core::index::{SharedIndex, WorkerRank};
use kvroute_core::rng::{mix, unit_f64, SplitMix64};
use kvroute_core::scheduler::policy::{DealBy, PrefixDealer, DEFAULT_STICKINESS};
use kvroute_core::scheduler::{BusyThresholds, CostWeights, LocalPrefillRule, Policy, SpeedConfig};

use crate::api::{Body, ProxyError};
use crate::dialect::Dialect;
use crate::ingest::registry::Registry;
use crate::metrics::ProxyMetrics;
use crate::replica::outbox::Outbox;
use crate::replica::pins::{PinKeys, PinShare};
use crate::replica::speeds::SpeedShare;
use active::ActiveTable;
use breaker::Breakers;
use candidates::Target;
use context::ContextLengths;
use kvroute_prompt::body::{self, RoutingRequest, TextPrompt};
use kvroute_prompt::{Prompt, PromptFields, PromptSource, Renderer};

/// How requests are routed and forwarded.
#[derive(Debug, Clone)]
pub struct ProxyConfig {
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
    /// Renders text prompts and chat messages to token ids as the engines
    /// do; without it they are routed on load only.
    pub renderer: Option<Arc<Renderer>>,
    /// Each named model's own tokenizer and chat template (`--model
    /// NAME=FILE`), used for requests naming it instead of `renderer`.
    pub model_renderers: HashMap<String, Arc<Renderer>>,
    /// Requests that may wait for a rank to drop below its busy thresholds
    /// when every rank is over them; 0: refuse at once with 503.
    pub queue_capacity: usize,
    /// Longest wait in that queue before the 503.
    pub queue_timeout: Duration,
    /// The context length of workers that do not report theirs.
    pub max_model_len: Option<u64>,
    /// Learn each rank's speed from its streamed responses, in place of its
    /// worker's declared one once learned (`None`: declared speeds only).
    pub learn_speeds: Option<SpeedConfig>,
    /// In a disaggregated fleet: when a decode rank prefills a request
    /// itself instead of fetching its blocks from a prefill worker.
    pub local_prefill: LocalPrefillRule,
    /// In a disaggregated fleet: time allowed for a prefill leg's answer.
    pub prefill_timeout: Duration,
    /// How often each worker's `/metrics` is read for the load it reports
    /// ([`reported`]; `None`: the router's own accounting alone).
    pub engine_metrics_every: Option<Duration>,
    /// Which header names a request's session, and how many sessions are
    /// remembered for how long ([`sessions`]).
    pub sessions: sessions::SessionConfig,
    /// Which header names a request's tenant, and what each tenant weighs
    /// in the queue's fair order ([`tenants`]).
    pub tenants: tenants::TenantConfig,
    /// Under `kv`: a request whose prefix no rank holds goes to the rank
    /// dealt the least of this so far (`None`: to the cheapest).
    pub deal_new_prefixes: Option<DealBy>,
    /// Under `kv`: how much dearer than the cheapest the rank holding most
    /// of a request's prefix may be and still take it (below 1: off).
    pub holder_stickiness: f64,
    /// How long a request body may take, and the memory all of them (over
    /// HTTP and through the endpoint picker) may hold at once.
    pub bodies: crate::bodies::BodyLimits,
    /// The most of a worker's answer the router reads whole (a prefill
    /// leg's, a merged answer's; a larger non-streamed answer to a client
    /// is passed on unread).
    pub max_answer_bytes: usize,
    /// How each model's tokenizer is found when neither `--tokenizer` nor
    /// `--model` names it.
    pub tokenizer_discovery: crate::tokenizers::DiscoveryConfig,
}

impl Default for ProxyConfig {
    fn default() -> Self {
        ProxyConfig {
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
            renderer: None,
            model_renderers: HashMap::new(),
            queue_capacity: 0,
            queue_timeout: Duration::from_secs(30),
            max_model_len: None,
            learn_speeds: None,
            local_prefill: LocalPrefillRule::default(),
            prefill_timeout: Duration::from_secs(120),
            engine_metrics_every: None,
            sessions: sessions::SessionConfig::default(),
            tenants: tenants::TenantConfig::default(),
            deal_new_prefixes: Some(DealBy::Work),
            holder_stickiness: DEFAULT_STICKINESS,
            bodies: crate::bodies::BodyLimits::default(),
            max_answer_bytes: 16 << 20,
            tokenizer_discovery: crate::tokenizers::DiscoveryConfig::default(),
        }
    }
}

/// The routing state every request shares.
#[derive(Debug)]
pub struct Proxy {
    config: ProxyConfig,
    index: Arc<SharedIndex>,
    client: reqwest::Client,
    /// Shared, not copied, by each request.
    targets: RwLock<Arc<Vec<Target>>>,
    active: ActiveTable,
    breakers: Breakers,
    context: ContextLengths,
    /// The counters requests bump.
    pub metrics: ProxyMetrics,
    /// Recent decisions, quality totals and timings (the dashboard's).
    pub observed: observe::Observed,
    next_id: AtomicU64,
    turn: AtomicU64,
    rng: AtomicU64,
    started: Instant,
    /// Woken whenever a rank's load drops (a prefill ends or a request ends).
    load_dropped: tokio::sync::Notify,
    /// Where requests tell peer replicas of themselves (`--nats`).
    outbox: OnceLock<Arc<Outbox>>,
    /// The ranks' learned speeds (`--learn-speeds`).
    speeds: Option<speeds::SpeedBook>,
    /// Where responses tell peer replicas what they taught of speeds.
    speed_share: OnceLock<Arc<SpeedShare>>,
    /// The load each rank's engine reports (`--engine-metrics-ms`).
    reported: reported::ReportBook,
    /// Where each session's last turn went.
    sessions: sessions::Sessions,
    /// The requests waiting in the queue, in the order they take ranks.
    waiting: queue::Waiting,
    /// The rank that produced each recent Responses API answer.
    continuations: continuations::Continuations,
    /// Where sessions and responses are pinned for peer replicas (`--nats`).
    pin_share: OnceLock<Arc<PinShare>>,
    /// The keys of this router's sessions and responses without `--nats`.
    local_keys: PinKeys,
    /// SGLang's `cache_aware` tree (`--policy sglang-cache-aware`).
    sglang: std::sync::Mutex<kvroute_core::scheduler::peers::CacheAware>,
    /// What each worker was dealt (`--deal-new-prefixes`).
    dealer: Option<std::sync::Mutex<PrefixDealer>>,
    /// The memory every request body in flight shares, over both doors.
    budget: Arc<crate::budget::MemoryBudget>,
    /// Each model's tokenizer, as the router found it.
    tokenizers: crate::tokenizers::ModelTokenizers,
}

impl Proxy {
    /// A proxy over `index` with no workers yet (see [`Proxy::refresh`]).
    pub fn new(config: ProxyConfig, index: Arc<SharedIndex>) -> Result<Self, reqwest::Error> {
        let client = reqwest::Client::builder()
            .connect_timeout(config.connect_timeout)
            .pool_max_idle_per_host(256)
            .build()?;
        let sessions = sessions::Sessions::new(&config.sessions);
        let waiting = queue::Waiting::new(config.queue_capacity, &config.tenants);
        let metrics = ProxyMetrics::default();
        metrics.tenants.export(config.tenants.names());
        let continuations = continuations::Continuations::new(
            config.sessions.capacity,
            u64::try_from(config.sessions.ttl.as_millis()).unwrap_or(u64::MAX),
        );
        let seed = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map_or(0x9e37_79b9, |d| d.as_nanos() as u64);
        Ok(Proxy {
            budget: config.bodies.budget(),
            tokenizers: crate::tokenizers::ModelTokenizers::new(config.tokenizer_discovery.clone()),
            dealer: config
                .deal_new_prefixes
                .map(|by| std::sync::Mutex::new(PrefixDealer::new(by))),
            speeds: config.learn_speeds.map(speeds::SpeedBook::new),
            load_dropped: tokio::sync::Notify::new(),
            breakers: Breakers::new(config.breaker_failures, config.breaker_open),
            context: ContextLengths::default(),
            config,
            index,
            client,
            targets: RwLock::new(Arc::new(Vec::new())),
            active: ActiveTable::default(),
            metrics,
            observed: observe::Observed::default(),
            next_id: AtomicU64::new(1),
            turn: AtomicU64::new(0),
            rng: AtomicU64::new(seed | 1),
            started: Instant::now(),
            outbox: OnceLock::new(),
            speed_share: OnceLock::new(),
            reported: reported::ReportBook::default(),
            sessions,
            waiting,
            continuations,
            pin_share: OnceLock::new(),
            local_keys: PinKeys::random(),
            sglang: std::sync::Mutex::default(),
        })
    }

    /// Tells peer replicas of every request from now on, through `outbox`
    /// (once; later calls are ignored).
    pub fn share_with(&self, outbox: Arc<Outbox>) {
        let _ = self.outbox.set(outbox);
    }

    /// Where requests tell peer replicas of themselves, if anywhere.
    pub fn outbox(&self) -> Option<&Outbox> {
        self.outbox.get().map(|o| o.as_ref())
    }

    /// Tells peer replicas what every response teaches of its rank's speed,
    /// through `share` (once; later calls are ignored).
    pub fn share_speeds_with(&self, share: Arc<SpeedShare>) {
        let _ = self.speed_share.set(share);
    }

    /// Pins sessions and responses for peer replicas in `share`, and
    /// looks up there the ones it does not have (once; later calls are
    /// ignored).
    pub fn share_pins_with(&self, share: Arc<PinShare>) {
        let _ = self.pin_share.set(share);
    }

    /// The rules a body of at most `max_bytes` is read under: the
    /// configured time and the budget every body shares.
    pub fn body_rules(&self, max_bytes: usize) -> crate::bodies::BodyRules {
        crate::bodies::BodyRules {
            max_bytes,
            limits: self.config.bodies,
            budget: self.budget.clone(),
        }
    }

    /// The memory budget of request bodies (shared by both doors).
    pub fn body_budget(&self) -> &Arc<crate::budget::MemoryBudget> {
        &self.budget
    }

    /// The keyed hash sessions and responses are pinned under: the
    /// replicas' shared one with `--nats`, else this process's own.
    pub fn pin_keys(&self) -> &PinKeys {
        self.pin_share
            .get()
            .map_or(&self.local_keys, |share| share.keys())
    }

    /// Each model's tokenizer, as found.
    pub fn tokenizers(&self) -> &crate::tokenizers::ModelTokenizers {
        &self.tokenizers
    }

    /// The client workers are asked with.
    pub(crate) fn client(&self) -> &reqwest::Client {
        &self.client
    }

    /// Every model the workers' learned lists hold.
    pub(crate) fn learned_models(&self) -> Vec<model_list::Model> {
        self.context.learned_models()
    }

    /// The URLs of the workers that serve `model`, in the workers' order.
    pub(crate) fn urls_serving(&self, model: &str) -> Vec<String> {
        self.targets()
            .iter()
            .filter(|t| self.serves(t, model))
            .map(|t| t.url.clone())
            .collect()
    }

    /// The one model every worker's list holds, when there is exactly one
    /// (what a request that names none is taken to ask for).
    pub(crate) fn only_model(&self) -> Option<String> {
        let models = self.context.learned_models();
        match models.as_slice() {
            [one] => Some(one.id.clone()),
            _ => None,
        }
    }

    /// Whether the proxy learns speeds (`--learn-speeds`).
    pub fn learns_speeds(&self) -> bool {
        self.speeds.is_some()
    }

    /// The configuration.
    pub fn config(&self) -> &ProxyConfig {
        &self.config
    }

    /// The index routing reads.
    pub fn index(&self) -> &SharedIndex {
        &self.index
    }

    /// The workers requests can go to now. A worker whose block size its
    /// stream taught since the last [`Proxy::refresh`] gets it at once: the
    /// first requests after a start are hashed at the engine's block size,
    /// not at 0 until the next refresh.
    pub fn targets(&self) -> Arc<Vec<Target>> {
        let targets = self
            .targets
            .read()
            .unwrap_or_else(PoisonError::into_inner)
            .clone();
        if targets
            .iter()
            .all(|t| t.newly_learned_block_size().is_none())
        {
            return targets;
        }
        let updated: Vec<Target> = targets
            .iter()
            .map(|t| {
                let mut t = t.clone();
                if let Some(size) = t.newly_learned_block_size() {
                    t.route.block_size = size;
                }
                t
            })
            .collect();
        let updated = Arc::new(updated);
        *self.targets.write().unwrap_or_else(PoisonError::into_inner) = updated.clone();
        updated
    }

    /// The speeds learned so far, by rank (`None`: not learning).
    pub fn learned_speeds(&self) -> Option<Arc<std::collections::HashMap<WorkerRank, f64>>> {
        self.speeds.as_ref().map(speeds::SpeedBook::learned)
    }

    /// The load in flight: (rank, requests, prefill tokens, decode blocks) of every rank seen.
    pub fn load(&self) -> Vec<(WorkerRank, u64, u64, u64)> {
        self.active.snapshot()
    }

    /// Records the timings of an answer to a request that arrived at
    /// `arrived` and (streamed) sent its first chunk at `first_chunk`.
    pub fn timed(&self, arrived: Instant, first_chunk: Option<Instant>) {
        let ms = |d: Duration| d.as_secs_f64() * 1e3;
        let latency = arrived.elapsed();
        let ttft = first_chunk.map(|f| f.saturating_duration_since(arrived));
        self.metrics.latency.observe(latency.as_secs_f64());
        if let Some(ttft) = ttft {
            self.metrics.ttft.observe(ttft.as_secs_f64());
        }
        self.observed.timed(observe::Timing {
            at_ms: attempt::unix_ms(),
            ttft_ms: ttft.map(ms),
            latency_ms: ms(latency),
        });
    }

    /// Milliseconds since the proxy started: the clock of the approximate index.
    pub fn now_ms(&self) -> u64 {
        self.started.elapsed().as_millis() as u64
    }

    /// Re-reads the workers from the registry.
    pub fn refresh(&self, registry: &Registry) {
        let targets: Vec<Target> = registry
            .view()
            .iter()
            .filter_map(Target::from_view)
            .collect();
        if let Some(book) = &self.speeds {
            let fleet = targets
                .iter()
                .flat_map(|t| {
                    t.ranks
                        .iter()
                        .map(|&rank| WorkerRank { worker: t.id, rank })
                })
                .collect();
            book.retain(&fleet);
        }
        *self.targets.write().unwrap_or_else(PoisonError::into_inner) = Arc::new(targets);
        // A worker gone takes its models along at once (see `context`).
        self.rebuild_models();
    }

    /// Drops active requests older than the expiry.
    pub fn expire_active(&self) {
        let max = self.config.active_expiry.as_millis() as u64;
        self.active.expire(self.now_ms(), max);
    }

    /// A uniform number in `[0, 1)` (SplitMix64 over an atomic state).
    pub fn random(&self) -> f64 {
        unit_f64(self.random_u64())
    }

    /// A uniform 64-bit number (the same generator as [`Proxy::random`]).
    pub fn random_u64(&self) -> u64 {
        let state = self
            .rng
            .fetch_add(SplitMix64::GAMMA, Ordering::Relaxed)
            .wrapping_add(SplitMix64::GAMMA);
        mix(state)
    }

    /// The request's id: the client's `x-request-id` when it is a short
    /// printable token, else a new one.
    pub fn request_id(&self, headers: &HeaderMap) -> String {
        let given = headers
            .get(attempt::REQUEST_ID)
            .and_then(|v| v.to_str().ok())
            .filter(|v| (1..=128).contains(&v.len()) && v.bytes().all(|b| b.is_ascii_graphic()));
        match given {
            Some(id) => id.to_owned(),
            None => format!(
                "kvroute-{:016x}",
                mix(self.rng.load(Ordering::Relaxed) ^ self.next_id.fetch_add(1, Ordering::Relaxed))
            ),
        }
    }

    /// The renderer of requests naming `model` (or none): `--model`'s for
    /// it, else `--tokenizer`'s, else the one found for it; a request that
    /// names no model is taken to ask for the one model the workers list.
    pub fn renderer_for(&self, model: Option<&str>) -> Option<Arc<Renderer>> {
        let model = model.map(str::to_owned).or_else(|| self.only_model());
        let explicit = model
            .as_deref()
            .and_then(|m| self.config.model_renderers.get(m))
            .or(self.config.renderer.as_ref())
            .cloned();
        explicit.or_else(|| model.as_deref().and_then(|m| self.tokenizers.renderer(m)))
    }

    /// Fills in `req.tokens` and `req.images` from its text with the
    /// renderer of the model it names, else the default one, if there is one. Requests with token ids keep them as
    /// given; a prompt the renderer refuses is routed on load alone (the
    /// engine then answers the client).
    pub fn tokenize(&self, req: &mut RoutingRequest) {
        if req.tokens.is_some() {
            return;
        }
        let (Some(renderer), Some(text)) = (self.renderer_for(req.model.as_deref()), &req.text)
        else {
            return;
        };
        let source = match text {
            TextPrompt::Completion(p) => PromptSource::Completion(Some(p)),
            TextPrompt::Chat(m) => PromptSource::Chat(Some(m)),
        };
        let fields = PromptFields {
            source,
            mm_hashes: req.mm_hashes.as_ref(),
            model: req.model.as_deref(),
        };
        let rendered = Prompt::from_fields(&fields).and_then(|p| renderer.render_for_routing(&p));
        match rendered {
            Ok(prompt) => {
                req.tokens = Some(prompt.tokens);
                req.images = prompt.images;
            }
            Err(e) => tracing::debug!(error = %e, "prompt not rendered; routed on load alone"),
        }
    }
}

/// Which OpenAI endpoint a request came in on.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Endpoint {
    /// `/v1/completions`.
    Completions,
    /// `/v1/chat/completions`.
    Chat,
    /// SGLang's native `/generate`.
    Generate,
    /// OpenAI's Responses API.
    Responses,
    /// Anthropic's Messages API.
    Messages,
}

impl Endpoint {
    /// The path forwarded to the worker.
    pub fn path(self) -> &'static str {
        match self {
            Endpoint::Completions => "/v1/completions",
            Endpoint::Chat => "/v1/chat/completions",
            Endpoint::Generate => "/generate",
            Endpoint::Responses => "/v1/responses",
            Endpoint::Messages => "/v1/messages",
        }
    }

    /// The endpoint a request path names (as a gateway passes it on, with
    /// any prefix before `/v1`), if kvroute reads its body.
    pub fn of_path(path: &str) -> Option<Endpoint> {
        let path = path.split('?').next().unwrap_or(path).trim_end_matches('/');
        [
            Endpoint::Chat,
            Endpoint::Completions,
            Endpoint::Responses,
            Endpoint::Messages,
            Endpoint::Generate,
        ]
        .into_iter()
        .find(|e| path.ends_with(e.path()))
    }

    /// Reads a body sent to this endpoint for routing.
    pub fn parse(self, body: &[u8]) -> Result<RoutingRequest, body::ParseError> {
        match self {
            Endpoint::Generate => kvroute_prompt::generate::parse_generate(body),
            Endpoint::Responses => kvroute_prompt::responses::parse_responses(body),
            Endpoint::Messages => kvroute_prompt::messages::parse_messages(body),
            Endpoint::Completions | Endpoint::Chat => {
                body::parse_request(body, self == Endpoint::Chat)
            }
        }
    }

    /// The API conventions its answers and errors follow.
    pub fn dialect(self) -> Dialect {
        match self {
            Endpoint::Completions | Endpoint::Chat | Endpoint::Generate => Dialect::OpenAi,
            Endpoint::Responses => Dialect::Responses,
            Endpoint::Messages => Dialect::Anthropic,
        }
    }

    /// Whether a disaggregated fleet splits its requests: the Responses
    /// and Messages APIs are served whole, by a rank that decodes.
    pub fn splits(self) -> bool {
        matches!(
            self,
            Endpoint::Completions | Endpoint::Chat | Endpoint::Generate
        )
    }
}

/// `POST /v1/responses`: OpenAI's Responses API.
pub async fn responses(
    State(proxy): State<Arc<Proxy>>,
    headers: HeaderMap,
    body: Result<Body, ProxyError>,
) -> Response {
    handle(proxy, headers, body, Endpoint::Responses).await
}

/// `POST /v1/messages`: Anthropic's Messages API.
pub async fn messages(
    State(proxy): State<Arc<Proxy>>,
    headers: HeaderMap,
    body: Result<Body, ProxyError>,
) -> Response {
    handle(proxy, headers, body, Endpoint::Messages).await
}

/// `POST /generate`: SGLang's native endpoint, for SGLang workers.
pub async fn generate(
    State(proxy): State<Arc<Proxy>>,
    headers: HeaderMap,
    body: Result<Body, ProxyError>,
) -> Response {
    handle(proxy, headers, body, Endpoint::Generate).await
}

/// `POST /v1/completions`.
pub async fn completions(
    State(proxy): State<Arc<Proxy>>,
    headers: HeaderMap,
    body: Result<Body, ProxyError>,
) -> Response {
    handle(proxy, headers, body, Endpoint::Completions).await
}

/// `POST /v1/chat/completions`.
pub async fn chat_completions(
    State(proxy): State<Arc<Proxy>>,
    headers: HeaderMap,
    body: Result<Body, ProxyError>,
) -> Response {
    handle(proxy, headers, body, Endpoint::Chat).await
}

/// Answers one completion request; every error kvroute answers it with is
/// counted here, once.
async fn handle(
    proxy: Arc<Proxy>,
    headers: HeaderMap,
    body: Result<Body, ProxyError>,
    endpoint: Endpoint,
) -> Response {
    let arrived = Instant::now();
    proxy.metrics.requests.inc();
    let request_id = proxy.request_id(&headers);
    let routed = match body {
        Ok(Body(body, share)) => {
            let request = (request_id.as_str(), arrived);
            route(&proxy, &headers, (&body, share), endpoint, request).await
        }
        Err(e) => Err(e),
    };
    let mut response = routed.unwrap_or_else(|e| {
        proxy.metrics.answered(e.kind());
        // Refused by the queue for its tenant's share, or for the memory
        // bodies hold: worth a retry in a second.
        let shed = matches!(
            e.kind(),
            crate::api::ErrorKind::RateLimited | crate::api::ErrorKind::Overloaded
        );
        let mut response = e.into_response_in(endpoint.dialect());
        if shed {
            let retry = HeaderValue::from_static("1");
            response
                .headers_mut()
                .insert(axum::http::header::RETRY_AFTER, retry);
        }
        response
    });
    if let Ok(id) = HeaderValue::from_str(&request_id) {
        response.headers_mut().insert(attempt::REQUEST_ID, id);
    }
    response
}

async fn route(
    proxy: &Arc<Proxy>,
    headers: &HeaderMap,
    (body, share): (&axum::body::Bytes, crate::budget::Share),
    endpoint: Endpoint,
    (request_id, arrived): (&str, Instant),
) -> Result<Response, ProxyError> {
    let large = body.len() > LARGE_BODY;
    let session = proxy.session_of(headers)?;
    let identity = proxy.identify(headers)?;
    let priority = proxy.allowed_priority(&identity, priority_of(headers)?);
    let priorities = identity.priorities;
    let tenant = identity.tenant;
    // Sessions and responses are their owner's: keyed by owner and id.
    let owner = owners::owner_of(headers, &tenant).0;
    let session = session.map(|id| proxy.session_key(&owner, &id));
    let read = {
        let (proxy, body) = (proxy.clone(), body.clone());
        on_cpu(large, move || {
            let mut share = share;
            let mut req = intake::read(&proxy, endpoint, &body, &mut share)?;
            if let Some(asked) = req.engine_priority {
                if priorities.clamp(asked) != asked {
                    return Err(ProxyError::bad_request(format!(
                        "`priority` {asked} is not one this client may ask the engine for \
                         (docs/serving.md, tenants, keys and priorities)"
                    )));
                }
            }
            req.session = session;
            req.priority = priority;
            req.tenant = Some(tenant);
            req.owner = Some(owner);
            // A LoRA adapter named as the model is hashed into the engine's
            // blocks: the request's must be too.
            if req.lora_name.is_none() {
                let model = req.model.as_deref();
                if model.is_some_and(|m| proxy.context.is_adapter(m)) {
                    req.lora_name = req.model.clone();
                }
            }
            Ok::<_, ProxyError>((req, share))
        })
        .await
    };
    let (mut req, _share) = read??;
    let chat = endpoint == Endpoint::Chat;
    crate::tokenizers::complete_from_engine(proxy, &mut req, body, chat).await;
    proxy.fetch_pins(&req).await;
    proxy.check_continuation(&req)?;
    let req = Arc::new(req);
    if let Some(model) = req.model.as_deref() {
        if !proxy.targets().is_empty() && !proxy.model_served(model) {
            return Err(ProxyError::ModelNotFound(model.to_owned()));
        }
    }
    if req.tokens.is_none() {
        proxy.metrics.load_only.inc();
    }
    let request = attempt::Request {
        req: &req,
        headers,
        body,
        endpoint,
        request_id,
        large,
        arrived,
        disagg: None,
    };
    let admitted = if disagg::splits(&proxy.targets()) {
        if endpoint.splits() {
            return disagg::route(proxy, &req, request).await;
        }
        let decodes: attempt::Eligible = Some(Arc::new(|t: &Target| t.role.decodes()));
        attempt::admit_among(proxy, &req, large, decodes).await?
    } else {
        attempt::admit(proxy, &req, large).await?
    };
    attempt::forward(proxy, admitted, request).await
}

/// A request's `x-priority` as asked: an integer, lower served first from
/// the queue (vLLM's sense of `priority`); 0 without the header, a 400 when
/// it is not one. What the request gets is clamped into what its tenant may
/// use ([`Proxy::allowed_priority`]).
fn priority_of(headers: &HeaderMap) -> Result<i64, ProxyError> {
    let Some(value) = headers.get("x-priority") else {
        return Ok(0);
    };
    value
        .to_str()
        .ok()
        .and_then(|v| v.trim().parse::<i32>().ok())
        .map(i64::from)
        .ok_or_else(|| {
            ProxyError::bad_request("`x-priority` must be an integer (lower is served first)")
        })
}

/// Bodies longer than this (bytes) are read, tokenized, hashed and
/// rewritten on the blocking pool, so a huge prompt never holds up the
/// runtime's other requests; shorter ones are quicker inline.
pub const LARGE_BODY: usize = 256 << 10;

/// Runs `work` inline, or on the blocking pool when `large`.
pub async fn on_cpu<T: Send + 'static>(
    large: bool,
    work: impl FnOnce() -> T + Send + 'static,
) -> Result<T, ProxyError> {
    if !large {
        return Ok(work());
    }
    tokio::task::spawn_blocking(work)
        .await
        .map_err(|e| ProxyError::internal(format!("request processing failed: {e}")))
}

/// `GET /v1/models`: the union of the workers' models as last learned
/// ([`context`]), never asked of the workers while the client waits.
pub async fn models(State(proxy): State<Arc<Proxy>>) -> Response {
    let json = HeaderValue::from_static("application/json");
    (
        [(axum::http::header::CONTENT_TYPE, json)],
        proxy.models_answer(),
    )
        .into_response()
}
