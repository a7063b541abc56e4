//! kvroute's shell: everything that waits on the outside world.
//!
//! Sockets, threads, timers and HTTP live here and hand plain data to
//! `kvroute-core`. Two paths run through it:
//! * engine bytes → [`ingest`] (a few ingest threads, each polling the
//!   ZeroMQ sockets of many ranks: frames to the core's cursor and decoder,
//!   events to the index);
//! * HTTP → [`app`] → [`proxy`] (scan the body, tokenize, score with the
//!   core's scheduler, forward, relay) → a worker.
//!
//! [`admin`] registers workers, [`query`] explains a decision without
//! making it, [`metrics`] declares everything `/metrics` shows, and [`api`]
//! holds the error every endpoint answers with. [`serve`] runs it all on a
//! bound listener until a shutdown future completes; [`serve_with_epp`]
//! also runs [`epp`], the Gateway API Inference Extension endpoint picker
//! (Envoy's ext_proc over gRPC), on the same routing state.

// The router's modules are private to the crate (both front doors reach
// them through `router::Router` and the intake); their docs link to one
// another for the crate's developers: `cargo doc --document-private-items`.
#![allow(rustdoc::private_intra_doc_links)]

pub mod admin;
pub mod api;
pub mod app;
pub mod bodies;
pub mod budget;
pub mod dashboard;
pub mod dialect;
pub mod discovery;
pub mod epp;
pub mod ingest;
pub mod listen;
pub mod metrics;
pub mod model_list;
pub mod otel;
pub mod prom_text;
pub mod proxy;
pub mod query;
pub mod replica;
pub mod router;
pub mod sse;
pub mod state;
pub mod tokenizers;

use std::future::Future;
use std::sync::Arc;
use std::time::Duration;

use kvroute_core::index::{Index, IndexConfig, SharedIndex};
use tracing::{info, warn};

use app::AppState;
use ingest::address::AllowedHosts;
use ingest::registry::IngestConfig;
use ingest::registry::Registry;
use ingest::spec::WorkerSpec;
use listen::{serve_bounded, ConnectionMetrics, HttpLimits};
use metrics::{IngestCollector, Metrics, ReplicaCollector};
use proxy::Proxy;
use query::QueryLimits;
use replica::speeds::SharedSpeeds;
use replica::Replica;
use router::active::ActiveCollector;
use router::observe::ObservedCollector;
use router::{ProxyConfig, Router};

/// Everything `kvroute serve` needs, validated.
#[derive(Debug, Clone)]
pub struct ServeConfig {
    /// Default tokens per block for workers that do not say (`None`: each
    /// such worker's is learned from its stream).
    pub block_size: Option<u32>,
    /// Workers known at start.
    pub workers: Vec<WorkerSpec>,
    /// Workers listed in an endpoints file (`--endpoints-file`), or the
    /// pods of an InferencePool (`--inference-pool`, feature `kube`),
    /// followed as they change.
    pub discovery: Option<discovery::Discovery>,
    /// Who may use the admin and introspection endpoints.
    pub access: admin::Access,
    /// Where workers may point (`--allow-worker-hosts`; empty: anywhere).
    pub allowed_worker_hosts: AllowedHosts,
    /// How long a worker may stay unreachable before its blocks are dropped.
    pub unreachable_grace: Duration,
    /// Index settings.
    pub index: IndexConfig,
    /// Shards of ranks the index is split into (`--index-shards`).
    pub index_shards: usize,
    /// Ingestion settings.
    pub ingest: IngestConfig,
    /// Routing and forwarding settings.
    pub proxy: ProxyConfig,
    /// Largest request body accepted, in bytes (larger: 413).
    pub max_body_bytes: usize,
    /// Connections, and how long a connection may take or idle.
    pub http: HttpLimits,
    /// Bounds of `/query` and `/query_by_hash`.
    pub query: QueryLimits,
    /// Where and how often the router's state is saved (`--state-dir`).
    pub state: Option<StateConfig>,
    /// Replicas sharing in-flight state and index snapshots over NATS (`--nats`).
    pub replicas: Option<replica::ReplicaConfig>,
    /// The endpoint picker (`--epp-port`), served on the listeners given to
    /// [`serve_with_epp`].
    pub epp: Option<epp::EppConfig>,
    /// Whether to say at start what the admin API accepts, and warn when it
    /// is closed or registrations may point anywhere: for an operator who
    /// set (or forgot) `--admin-token`. A program embedding the router that
    /// chose `access` itself (the demo) turns it off, so its user gets no
    /// advice about flags they never had.
    pub announce_access: bool,
}

/// Index shards when none are asked for: one per core, at most 8, so the
/// events of as many ranks are applied at once.
pub fn default_index_shards() -> usize {
    std::thread::available_parallelism().map_or(1, |n| n.get().min(8))
}

/// `--state-dir` and `--snapshot-secs`.
#[derive(Debug, Clone)]
pub struct StateConfig {
    /// The directory of the snapshot.
    pub dir: std::path::PathBuf,
    /// How often it is written (and once more at shutdown).
    pub every: Duration,
}

impl StateConfig {
    /// How often the state is saved unless told otherwise (`--snapshot-secs`).
    pub const DEFAULT_EVERY: Duration = Duration::from_secs(10);
}

impl Default for ServeConfig {
    fn default() -> Self {
        ServeConfig {
            block_size: None,
            workers: Vec::new(),
            discovery: None,
            access: admin::Access::default(),
            allowed_worker_hosts: AllowedHosts::default(),
            unreachable_grace: Duration::from_secs(30),
            index: IndexConfig::default(),
            index_shards: default_index_shards(),
            ingest: IngestConfig::default(),
            proxy: ProxyConfig::default(),
            max_body_bytes: 32 << 20,
            http: HttpLimits::default(),
            query: QueryLimits::default(),
            state: None,
            replicas: None,
            epp: None,
            announce_access: true,
        }
    }
}

/// Why the server stopped with an error.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum ServeError {
    /// A configured worker could not be registered; the reason names the
    /// worker (once: it is the whole message).
    #[error(transparent)]
    Worker(ingest::registry::RegistryError),
    /// Ingestion could not start.
    #[error("ingestion: {0}")]
    Ingest(ingest::registry::RegistryError),
    /// The HTTP server failed.
    #[error("http server: {0}")]
    Http(#[from] std::io::Error),
    /// The NATS URL is not one (`--nats`).
    #[error("nats: {0}")]
    Nats(async_nats::ConnectError),
    /// The HTTP client could not be built.
    #[error("http client: {0}")]
    Client(#[from] reqwest::Error),
    /// The endpoint picker could not start.
    #[error(transparent)]
    Epp(#[from] epp::EppError),
    /// Discovery could not start (no Kubernetes API to reach).
    #[error(transparent)]
    Discovery(#[from] discovery::DiscoveryError),
}

/// Runs ingestion and the HTTP server on `listener` until `shutdown` completes.
pub async fn serve(
    config: ServeConfig,
    listener: tokio::net::TcpListener,
    shutdown: impl Future<Output = ()> + Send + 'static,
) -> Result<(), ServeError> {
    serve_with_epp(config, listener, None, shutdown).await
}

/// [`serve`], and the endpoint picker on `epp` when `config.epp` is set
/// (the same index, workers, load and metrics; it stops with the server).
pub async fn serve_with_epp(
    config: ServeConfig,
    listener: tokio::net::TcpListener,
    epp: Option<epp::EppListeners>,
    shutdown: impl Future<Output = ()> + Send + 'static,
) -> Result<(), ServeError> {
    let index = Arc::new(SharedIndex::sharded(
        Index::new(config.index.clone()),
        config.index_shards,
    ));
    let replica = match config.replicas.clone() {
        Some(replicas) => Some(Replica::connect(replicas).await.map_err(ServeError::Nats)?),
        None => None,
    };
    let from_peers = match &replica {
        Some(r) => r.snapshot_at_start().await,
        None => None,
    };
    let registry = start_registry(&config, index.clone(), from_peers)?;
    let saved = state::SnapshotCounters::default();
    let snapshots = config
        .state
        .clone()
        .map(|state| spawn_snapshots(registry.clone(), state, saved.clone()));
    let pins = replica.as_ref().map(|r| pin_share(r, &config));
    let router = Arc::new(build_router(
        &config,
        index.clone(),
        replica.as_ref(),
        pins.clone(),
    )?);
    router.refresh(&registry);
    let mut collectors = base_collectors(&registry, &index, &router, &saved);
    // Exported whether or not a source is followed (at 0 without one).
    let counters = discovery::DiscoveryCounters::default();
    collectors.push(Box::new(counters.clone()));
    let discovered = match config.discovery.clone() {
        Some(source) => {
            let watched = (registry.clone(), router.clone());
            Some(discovery::start(source, watched, config.block_size, counters).await?)
        }
        None => None,
    };
    let replica_tasks = replica.as_ref().zip(pins).map(|(r, pins)| {
        collectors.push(Box::new(ReplicaCollector::new(
            r.sync.clone(),
            r.speeds.clone(),
            pins.clone(),
        )));
        run_replica(r, pins, &router, &registry)
    });
    let (epp_tasks, stopping) = start_epp(&config, epp, &router, &mut collectors)?;
    let connections = ConnectionMetrics::default();
    let metrics = Arc::new(Metrics::new(&router.metrics, &connections, collectors));
    let series = Arc::new(dashboard::series::Series::default());
    let mut background = spawn_housekeeping(&registry, &index, &router, &series);
    background.extend(snapshots);
    background.extend(epp_tasks);
    background.extend(discovered);
    background.extend(spawn_engine_scrapes(&router));
    background.extend(replica_tasks.into_iter().flatten());
    let admin = admin::AdminState {
        registry: registry.clone(),
        router: router.clone(),
        access: config.access.clone(),
        default_block_size: config.block_size,
        replica: replica.as_ref().map(|r| r.sync.clone()),
        series: series.clone(),
    };
    let state = AppState {
        admin,
        proxy: Arc::new(Proxy::new(router)?),
        metrics,
        max_body_bytes: config.max_body_bytes,
        query: config.query,
    };
    info!(addr = ?listener.local_addr().ok(), "kvroute listening");
    config
        .announce_access
        .then(|| log_access(&config.access, &config.allowed_worker_hosts));
    let shutdown = async move {
        shutdown.await;
        let _ = stopping.send(true);
    };
    // Every accepted connection gets TCP_NODELAY (`listen.rs`).
    let served = serve_bounded(
        listener,
        app::app(state),
        config.http,
        connections,
        shutdown,
    );
    let result = served.await;
    background.iter().for_each(tokio::task::JoinHandle::abort);
    let state_dir = config.state.map(|s| s.dir);
    stop(replica.as_ref(), registry, state_dir, saved).await;
    result.map_err(ServeError::Http)
}

/// The collectors `/metrics` reads at every scrape that every router has:
/// the index and streams, the load, the observed requests, the body budget,
/// the models' tokenizers and the state snapshots.
fn base_collectors(
    registry: &Arc<Registry>,
    index: &Arc<SharedIndex>,
    router: &Arc<Router>,
    saved: &state::SnapshotCounters,
) -> Vec<Box<dyn prometheus_client::collector::Collector>> {
    vec![
        Box::new(IngestCollector::new(registry.clone(), index.clone())),
        Box::new(ActiveCollector::new(router.clone())),
        Box::new(ObservedCollector::new(router.clone())),
        Box::new(budget::BudgetCollector(router.body_budget().clone())),
        Box::new(tokenizers::TokenizerCollector(router.shared_tokenizers())),
        Box::new(saved.clone()),
    ]
}

/// The pins bucket the replicas share sessions and responses in.
fn pin_share(replica: &Replica, config: &ServeConfig) -> Arc<replica::pins::PinShare> {
    Arc::new(replica::pins::PinShare::new(
        &replica.config().prefix,
        config.proxy.sessions.ttl,
        replica::pins::PinKeys::shared(replica.config().pins_secret.as_ref()),
    ))
}

/// The router, with what it shares with the peer replicas (`--nats`):
/// requests, learned speeds, pins.
fn build_router(
    config: &ServeConfig,
    index: Arc<SharedIndex>,
    replica: Option<&Replica>,
    pins: Option<Arc<replica::pins::PinShare>>,
) -> Result<Router, ServeError> {
    let mut builder = Router::builder(config.proxy.clone(), index);
    if let Some(r) = replica {
        builder = builder.with_outbox(r.sync.outbox().clone());
        if config.proxy.learn_speeds.is_some() {
            builder = builder.with_speed_share(r.speeds.clone());
        }
    }
    if let Some(pins) = pins {
        builder = builder.with_pins(pins);
    }
    Ok(builder.build()?)
}

/// The replica's tasks: the request bus, the speeds and the pins.
fn run_replica(
    replica: &Replica,
    pins: Arc<replica::pins::PinShare>,
    router: &Arc<Router>,
    registry: &Arc<Registry>,
) -> Vec<tokio::task::JoinHandle<()>> {
    let speeds: Option<Arc<dyn SharedSpeeds>> = router
        .learns_speeds()
        .then(|| router.clone() as Arc<dyn SharedSpeeds>);
    let mut tasks = replica.run(router.clone(), registry.clone(), speeds);
    let connections = replica.sync.connections();
    tasks.extend(pins.run(replica.client().clone(), router.clone(), connections));
    tasks
}

/// After the server stopped: the replica's last snapshot, the state saved
/// in `dir`, ingestion shut down.
async fn stop(
    replica: Option<&Replica>,
    registry: Arc<Registry>,
    dir: Option<std::path::PathBuf>,
    saved: state::SnapshotCounters,
) {
    if let Some(r) = replica {
        r.save_now(&registry).await;
        r.stop();
    }
    let _ = tokio::task::spawn_blocking(move || {
        if let Some(dir) = dir {
            save_state(&registry, &dir, &saved);
        }
        registry.shutdown();
    })
    .await;
}

/// Starts the endpoint picker when there are listeners and a config for
/// it (its metrics join `collectors` either way); its tasks, and the
/// sender that stops it when set to true.
fn start_epp(
    config: &ServeConfig,
    listeners: Option<epp::EppListeners>,
    router: &Arc<Router>,
    collectors: &mut Vec<Box<dyn prometheus_client::collector::Collector>>,
) -> Result<
    (
        Vec<tokio::task::JoinHandle<()>>,
        tokio::sync::watch::Sender<bool>,
    ),
    ServeError,
> {
    let (stopping, stop) = tokio::sync::watch::channel(false);
    // Exported whether or not the picker runs (at 0 without it), as every
    // metric of the catalogue is.
    let metrics = Arc::new(metrics::epp::EppMetrics::default());
    collectors.push(Box::new(metrics::epp::EppCollector(metrics.clone())));
    let (Some(listeners), Some(epp_config)) = (listeners, &config.epp) else {
        return Ok((Vec::new(), stopping));
    };
    let shared = epp::EppShared {
        router: router.clone(),
        metrics,
        max_body_bytes: config.max_body_bytes,
    };
    let tasks = epp::spawn(shared, epp_config, listeners, stop)?;
    Ok((tasks, stopping))
}

/// Reads the workers' `/metrics` every `--engine-metrics-ms`, when set.
fn spawn_engine_scrapes(router: &Arc<Router>) -> Option<tokio::task::JoinHandle<()>> {
    let every = router.config().engine_metrics_every?;
    let router = router.clone();
    Some(tokio::spawn(async move {
        let mut tick = tokio::time::interval(every);
        tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        loop {
            tick.tick().await;
            router.scrape_engines(every).await;
        }
    }))
}

/// The periodic chores: every second the `/v1/models` of the workers that
/// are new or were last asked 10 s ago (their context lengths and models),
/// unreachable workers, the workers' list, expired requests and
/// approximate blocks.
fn spawn_housekeeping(
    registry: &Arc<Registry>,
    index: &Arc<SharedIndex>,
    router: &Arc<Router>,
    series: &Arc<dashboard::series::Series>,
) -> Vec<tokio::task::JoinHandle<()>> {
    let context_lengths = {
        let router = router.clone();
        tokio::spawn(async move {
            let mut tick = tokio::time::interval(Duration::from_secs(1));
            tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
            loop {
                tick.tick().await;
                router.learn_context_lengths().await;
                crate::router::tokens::discover_due(&router);
            }
        })
    };
    let (registry, index, router) = (registry.clone(), index.clone(), router.clone());
    let series = series.clone();
    let housekeeping = tokio::spawn(async move {
        let mut tick = tokio::time::interval(Duration::from_secs(1));
        loop {
            tick.tick().await;
            let (registry, index, router) = (registry.clone(), index.clone(), router.clone());
            let series = series.clone();
            let _ = tokio::task::spawn_blocking(move || {
                registry.check_unreachable();
                router.refresh(&registry);
                router.expire_active();
                index.expire(router.now_ms());
                let now = router::unix_ms();
                let window = dashboard::series::WINDOW_SECS * 1_000;
                let recent = router.observed.timings_since(now.saturating_sub(window));
                series.tick(now, router.observed.totals(), &recent);
            })
            .await;
        }
    });
    vec![context_lengths, housekeeping]
}

/// The registry, restored from the peers' snapshot (`--nats`) or else from
/// `--state-dir` when there is one, with the configured workers and those
/// the snapshot had registered.
fn start_registry(
    config: &ServeConfig,
    index: Arc<SharedIndex>,
    from_peers: Option<state::Snapshot>,
) -> Result<Arc<Registry>, ServeError> {
    let registry = Registry::new(index, config.ingest.clone(), config.unreachable_grace)
        .map_err(ServeError::Ingest)?
        .with_allowed_hosts(config.allowed_worker_hosts.clone());
    let registry = Arc::new(registry);
    let restored_from_peers =
        from_peers.is_some_and(|snapshot| match registry.restore(&snapshot) {
            Ok(()) => true,
            Err(e) => {
                warn!(error = %e, "the peers' snapshot could not be restored");
                false
            }
        });
    if let (false, Some(state)) = (restored_from_peers, &config.state) {
        restore_state(&registry, state);
    }
    for spec in &config.workers {
        registry
            .register(spec.clone())
            .map_err(ServeError::Worker)?;
    }
    registry.register_saved();
    Ok(registry)
}

/// Saves the state every `state.every`, off the runtime's threads,
/// counting each snapshot in `saved`.
fn spawn_snapshots(
    registry: Arc<Registry>,
    state: StateConfig,
    saved: state::SnapshotCounters,
) -> tokio::task::JoinHandle<()> {
    tokio::spawn(async move {
        let mut tick = tokio::time::interval(state.every);
        tick.tick().await;
        loop {
            tick.tick().await;
            let (registry, dir, saved) = (registry.clone(), state.dir.clone(), saved.clone());
            let _ = tokio::task::spawn_blocking(move || save_state(&registry, &dir, &saved)).await;
        }
    })
}

/// Loads the snapshot in `state.dir`, if any; a damaged one is set aside
/// (renamed `*.bad`) and the router starts cold.
fn restore_state(registry: &Registry, state: &StateConfig) {
    let loaded = state::load(&state.dir);
    let restored = loaded.and_then(|snapshot| match snapshot {
        Some(snapshot) => registry.restore(&snapshot).map(|()| true),
        None => Ok(false),
    });
    match restored {
        Ok(true) => {}
        Ok(false) => info!(dir = %state.dir.display(), "no saved state yet; starting cold"),
        Err(e) => {
            let file = state::state_file(&state.dir);
            let _ = std::fs::rename(&file, file.with_extension("state.bad"));
            warn!(error = %e, "saved state unreadable (set aside as router.state.bad); starting cold");
        }
    }
}

/// Writes a snapshot into `dir`, counting it in `saved` (the
/// `kvroute_state_snapshot*` metrics) and logging a failure (routing goes on).
fn save_state(registry: &Registry, dir: &std::path::Path, saved: &state::SnapshotCounters) {
    let started = std::time::Instant::now();
    let snapshot = registry.snapshot();
    // Counted outside the log macros: their fields are not evaluated when
    // the level is off.
    match state::save(dir, &snapshot) {
        Ok(()) => {
            let written = saved.count_written();
            tracing::debug!(
                written,
                bytes = snapshot.index.len(),
                ms = started.elapsed().as_millis() as u64,
                dir = %dir.display(),
                "state snapshot written"
            );
        }
        Err(e) => {
            let failed = saved.count_failed();
            warn!(failed, error = %e, "saving the router's state failed");
        }
    }
}

/// One line at start saying what the admin and introspection endpoints
/// accept, so an operator sees an exposed or a closed API at once.
fn log_access(access: &admin::Access, allowed: &AllowedHosts) {
    match (&access.admin_token, access.public_introspection) {
        (None, _) => warn!(
            "admin API disabled (/register and /unregister answer 403): set --admin-token or \
             KVROUTE_ADMIN_TOKEN to enable it; /workers and /query are open"
        ),
        (Some(_), false) => {
            info!("admin API enabled; /register, /unregister, /workers and /query need the bearer token")
        }
        (Some(_), true) => info!(
            "admin API enabled; /register and /unregister need the bearer token, \
             /workers and /query are public (--public-introspection)"
        ),
    }
    if allowed.is_unrestricted() && access.admin_token.is_some() {
        warn!("workers may be registered at any host: limit them with --allow-worker-hosts");
    }
}
