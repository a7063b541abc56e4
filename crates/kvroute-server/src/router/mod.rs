//! The router: the decision state both front doors share — the HTTP
//! forwarder ([`crate::router`]) and the endpoint picker ([`crate::epp`]) —
//! and the one way requests reach it. It holds no HTTP client: it decides
//! where requests go and keeps the load they put there, and the doors send
//! them (or let the gateway send them).
//!
//! A request goes through one module per step:
//! 1. [`intake`] reads who sent it and its body into a
//!    [`RoutedRequest`](intake::RoutedRequest), the same at both doors;
//! 2. [`candidates`] hashes the prompt per block size and engine flavour,
//!    matches the index and prices every rank with the core's scheduler;
//! 3. [`admission`] places it with the core's `Placer` (the session's and
//!    the continued response's ranks from [`sessions`] and
//!    [`continuations`]) and charges the first rank, or waits in the
//!    bounded overload queue ([`queue`], ordered by [`tenants`] and
//!    priority) while every rank is busy; [`split`] does the same for a
//!    disaggregated fleet's two phases;
//! 4. [`active`] holds the request's place in its rank's load until its
//!    answer ends, and [`accuracy`] compares the engine's `cached_tokens`
//!    with the prediction.
//!
//! Beside them: each worker's served models and context length
//! ([`models`]), circuit breakers ([`breaker`]), engine-reported load
//! ([`reported`]), learned speeds ([`speeds`]), peers' load and pins
//! ([`shared`]), recent decisions ([`observe`]).
//!
//! Built once by a [`RouterBuilder`], with whatever it shares with peer
//! replicas; nothing is attached later.

pub(crate) mod accuracy;
pub(crate) mod active;
pub(crate) mod admission;
pub(crate) mod breaker;
pub(crate) mod candidates;
pub mod config;
pub(crate) mod continuations;
pub(crate) mod endpoint;
pub(crate) mod intake;
pub(crate) mod load;
pub(crate) mod models;
pub(crate) mod observe;
pub(crate) mod owners;
pub(crate) mod queue;
pub(crate) mod reported;
pub(crate) mod sessions;
pub(crate) mod shared;
pub(crate) mod speeds;
pub(crate) mod split;
pub(crate) mod target;
pub(crate) mod tenants;
pub(crate) mod tokens;

pub use config::ProxyConfig;
pub use endpoint::Endpoint;

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, PoisonError, RwLock};
use std::time::{Duration, Instant};

use axum::http::HeaderMap;
use kvroute_core::index::{SharedIndex, WorkerRank};
use kvroute_core::rng::{mix, unit_f64, SplitMix64};
use kvroute_core::scheduler::Placer;

use crate::api::ProxyError;
use crate::ingest::registry::Registry;
use crate::metrics::ProxyMetrics;
use crate::replica::outbox::Outbox;
use crate::replica::pins::{PinKeys, PinShare};
use crate::replica::speeds::SpeedShare;
use breaker::Breakers;
use load::ActiveTable;
use models::WorkerModels;
use target::Target;

/// The header naming a request in logs, upstream and in the answer.
pub const REQUEST_ID: &str = "x-request-id";

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

/// Milliseconds since the Unix epoch.
pub fn unix_ms() -> u64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_millis() as u64)
}

/// The decision state every request shares (see the module docs).
#[derive(Debug)]
pub struct Router {
    config: ProxyConfig,
    index: Arc<SharedIndex>,
    /// Reads the workers' model lists, metrics and `/tokenize`.
    client: reqwest::Client,
    /// Shared, not copied, by each request.
    targets: RwLock<Arc<Vec<Target>>>,
    active: ActiveTable,
    breakers: Breakers,
    models: WorkerModels,
    /// The counters requests bump.
    pub metrics: ProxyMetrics,
    /// Recent decisions, quality totals and timings (the dashboard's).
    pub observed: observe::Observed,
    next_id: AtomicU64,
    /// Request ids and bootstrap rooms (placements draw from the placer's own).
    rng: AtomicU64,
    started: Instant,
    /// Woken whenever a rank's load drops (a prefill ends or a request ends).
    load_dropped: tokio::sync::Notify,
    /// Where requests tell peer replicas of themselves (`--nats`).
    outbox: Option<Arc<Outbox>>,
    /// The ranks' learned speeds (`--learn-speeds`).
    speeds: Option<speeds::SpeedBook>,
    /// Where responses tell peer replicas what they taught of speeds.
    speed_share: Option<Arc<SpeedShare>>,
    /// The load each rank's engine reports (`--engine-metrics-ms`).
    reported: reported::ReportBook,
    /// Where each session's last turn went.
    sessions: sessions::Sessions,
    /// The requests waiting in the queue, in the order they take ranks.
    waiting: queue::Waiting,
    /// The rank that produced each recent Responses API answer.
    continuations: continuations::Continuations,
    /// Where sessions and responses are pinned for peer replicas (`--nats`).
    pin_share: Option<Arc<PinShare>>,
    /// The keys of this router's sessions and responses without `--nats`.
    local_keys: PinKeys,
    /// The placement state (the dealer, SGLang's tree, turns and draws);
    /// locked while the active table is, never the other way round.
    placer: Mutex<Placer>,
    /// The memory every request body in flight shares, over both doors.
    budget: Arc<crate::budget::MemoryBudget>,
    /// Each model's tokenizer, as the router found it.
    tokenizers: Arc<crate::tokenizers::ModelTokenizers>,
}

/// Builds a [`Router`]: its configuration and index, and what it shares
/// with peer replicas (`--nats`), each given before it starts.
#[derive(Debug)]
pub struct RouterBuilder {
    config: ProxyConfig,
    index: Arc<SharedIndex>,
    outbox: Option<Arc<Outbox>>,
    speed_share: Option<Arc<SpeedShare>>,
    pin_share: Option<Arc<PinShare>>,
}

impl RouterBuilder {
    /// Tells peer replicas of every request through `outbox`.
    pub fn with_outbox(mut self, outbox: Arc<Outbox>) -> Self {
        self.outbox = Some(outbox);
        self
    }

    /// Tells peer replicas what every response teaches of its rank's speed.
    pub fn with_speed_share(mut self, share: Arc<SpeedShare>) -> Self {
        self.speed_share = Some(share);
        self
    }

    /// Pins sessions and responses for peer replicas in `share`, and looks
    /// up there the ones it does not have.
    pub fn with_pins(mut self, share: Arc<PinShare>) -> Self {
        self.pin_share = Some(share);
        self
    }

    /// The router, with no workers yet (see [`Router::refresh`]); an
    /// error when its HTTP client cannot be built.
    pub fn build(self) -> Result<Router, reqwest::Error> {
        let RouterBuilder {
            config,
            index,
            outbox,
            speed_share,
            pin_share,
        } = self;
        let metrics = ProxyMetrics::default();
        metrics.tenants.export(config.tenants.names());
        let ttl_ms = u64::try_from(config.sessions.ttl.as_millis()).unwrap_or(u64::MAX);
        let clock_seed = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map_or(0x9e37_79b9, |d| d.as_nanos() as u64);
        let seed = config.routing_seed.unwrap_or(clock_seed);
        let client = reqwest::Client::builder()
            .connect_timeout(config.connect_timeout)
            .build()?;
        Ok(Router {
            client,
            placer: Mutex::new(Placer::new(config.placer(seed))),
            budget: config.bodies.budget(),
            tokenizers: Arc::new(crate::tokenizers::ModelTokenizers::new(
                config.tokenizer_discovery.clone(),
            )),
            speeds: config.learn_speeds.map(speeds::SpeedBook::new),
            load_dropped: tokio::sync::Notify::new(),
            breakers: Breakers::new(config.breaker_failures, config.breaker_open),
            models: WorkerModels::default(),
            sessions: sessions::Sessions::new(&config.sessions),
            waiting: queue::Waiting::new(config.queue_capacity, &config.tenants),
            continuations: continuations::Continuations::new(config.sessions.capacity, ttl_ms),
            index,
            targets: RwLock::new(Arc::new(Vec::new())),
            active: ActiveTable::default(),
            metrics,
            observed: observe::Observed::default(),
            next_id: AtomicU64::new(1),
            rng: AtomicU64::new(clock_seed | 1),
            started: Instant::now(),
            outbox,
            speed_share,
            reported: reported::ReportBook::default(),
            pin_share,
            local_keys: PinKeys::random(),
            config,
        })
    }
}

impl Router {
    /// A builder of a router over `index` configured by `config`.
    pub fn builder(config: ProxyConfig, index: Arc<SharedIndex>) -> RouterBuilder {
        RouterBuilder {
            config,
            index,
            outbox: None,
            speed_share: None,
            pin_share: None,
        }
    }

    /// The client the router reads workers with.
    pub(crate) fn client(&self) -> &reqwest::Client {
        &self.client
    }

    /// Where requests tell peer replicas of themselves, if anywhere.
    pub fn outbox(&self) -> Option<&Outbox> {
        self.outbox.as_deref()
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
            .as_ref()
            .map_or(&self.local_keys, |share| share.keys())
    }

    /// Each model's tokenizer, as found.
    pub fn tokenizers(&self) -> &crate::tokenizers::ModelTokenizers {
        &self.tokenizers
    }

    /// The models' tokenizers, shared (for the metric that lists them).
    pub fn shared_tokenizers(&self) -> Arc<crate::tokenizers::ModelTokenizers> {
        self.tokenizers.clone()
    }

    /// Whether the router learns speeds (`--learn-speeds`).
    pub fn learns_speeds(&self) -> bool {
        self.speeds.is_some()
    }

    /// The placement state, locked (inside the active table's lock when
    /// both are held).
    pub(crate) fn placer(&self) -> std::sync::MutexGuard<'_, Placer> {
        self.placer.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// The configuration.
    pub fn config(&self) -> &ProxyConfig {
        &self.config
    }

    /// The index routing reads.
    pub fn index(&self) -> &SharedIndex {
        &self.index
    }

    /// The workers requests can go to now.
    ///
    /// A worker whose block size its stream taught since the last refresh
    /// gets it at once: the first requests after a start are hashed at the
    /// engine's block size, not at 0 until the next refresh.
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

    /// The workers' circuit breakers (fed by the forwarder's attempts).
    pub(crate) fn breakers(&self) -> &Breakers {
        &self.breakers
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
            at_ms: unix_ms(),
            ttft_ms: ttft.map(ms),
            latency_ms: ms(latency),
        });
    }

    /// Milliseconds since the router started: the clock of the approximate index.
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
                    t.route.ranks.iter().map(|&rank| WorkerRank {
                        worker: t.route.id,
                        rank,
                    })
                })
                .collect();
            book.retain(&fleet);
        }
        *self.targets.write().unwrap_or_else(PoisonError::into_inner) = Arc::new(targets);
        // A worker gone takes its models along at once (see `models`).
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

    /// A uniform 64-bit number (the same generator as [`Router::random`]).
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
            .get(REQUEST_ID)
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
}
