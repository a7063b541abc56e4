//! How requests are routed and forwarded: every setting of `kvroute serve`
//! that the router and the forwarder read, each default stated once.

use std::collections::HashMap;
use std::sync::Arc;
use std::time::Duration;

use kvroute_core::scheduler::peers::CacheAwareConfig;
use kvroute_core::scheduler::policy::{DealBy, DEFAULT_STICKINESS};
use kvroute_core::scheduler::{
    BusyThresholds, CostWeights, FetchConfig, LocalPrefillRule, PlacerConfig, Policy,
    ReplicaConfig, SpeedConfig, WhenAllBusy,
};
use kvroute_prompt::Renderer;

use super::{sessions, tenants};

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
    /// How many times one request may be moved to another rank after its
    /// worker failed it mid-way ([`crate::proxy::migrate`]); 0: never.
    pub migration_limit: u32,
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
    /// (`reported`; `None`: the router's own accounting alone).
    pub engine_metrics_every: Option<Duration>,
    /// Which header names a request's session, and how many sessions are
    /// remembered for how long ([`super::sessions`]).
    pub sessions: sessions::SessionConfig,
    /// Which header names a request's tenant, and what each tenant weighs
    /// in the queue's fair order ([`super::tenants`]).
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
    /// The seed of the placer's random draws (ties, sampling, `random`):
    /// the same seed and the same requests give the same placements
    /// (`None`: a seed from the clock).
    pub routing_seed: Option<u64>,
    /// Under `kv` on aggregated vLLM workers: when a request runs on a
    /// cooler rank that first receives its prefix from the busy holder,
    /// with the engines' own hand-off ([`crate::proxy::fetch`]; `None`:
    /// never, the default).
    pub fetch: Option<FetchConfig>,
    /// Under `kv` on aggregated vLLM workers: when a hot prefix is copied
    /// ahead of demand to a second rank ([`crate::proxy::replicate`];
    /// `None`: never, the default).
    pub replicate: Option<ReplicaConfig>,
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
            migration_limit: 3,
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
            routing_seed: None,
            fetch: None,
            replicate: None,
        }
    }
}

impl ProxyConfig {
    /// The placer's half of the configuration, its draws seeded by `seed`.
    pub fn placer(&self, seed: u64) -> PlacerConfig {
        PlacerConfig {
            policy: self.policy,
            weights: self.weights,
            temperature: self.temperature,
            deal_new_prefixes: self.deal_new_prefixes,
            stickiness: self.holder_stickiness,
            local_prefill: self.local_prefill,
            tree: CacheAwareConfig::default(),
            when_all_busy: WhenAllBusy::Wait,
            seed,
            fetch: self.fetch,
            replicate: self.replicate,
        }
    }
}
