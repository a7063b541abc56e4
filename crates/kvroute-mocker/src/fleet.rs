//! A fleet: `--workers` engines, each with `--dp-size` ranks, started and stopped together.
//!
//! Ports: engine k serves HTTP on `port + k`; its rank r publishes on
//! `kv_events_port + k·dp + r` and replays on `replay_port + k·dp + r`. A base
//! port of 0 gives every socket of that kind an ephemeral port instead (tests);
//! [`WorkerInfo`] reports the ports actually bound. An SGLang prefill
//! engine k also serves its bootstrap rooms on `bootstrap_port + k`.

use std::future::Future;
use std::net::{IpAddr, Ipv4Addr, Ipv6Addr, SocketAddr};
use std::sync::atomic::AtomicU64;
use std::sync::{Arc, Mutex};
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use tokio::sync::watch;
use tokio::task::JoinHandle;

use crate::bootstrap::{self, BootstrapState, RoomTable};
use crate::config::{ConfigError, MockerConfig, Role};
use crate::driver::{self, DriverOptions, RankHandle};
use crate::encode::EncodeOptions;
use crate::engine::Engine;
use crate::faults::FailureDice;
use crate::filler::{Filler, FillerError};
use crate::http::handoff::{HandoffStats, PdState};
use crate::http::openai::PromptSettings;
use crate::http::{self, EngineState, EventEndpoints};
use crate::publisher::{PublisherError, PublisherHandle, PublisherSettings};
use kvroute_core::event::WorkerFlavor;
use kvroute_prompt::{ImageTokenRule, Renderer, Tokenizer, TokenizerError};

/// How long shutdown waits for in-flight HTTP responses.
const DRAIN_TIMEOUT: Duration = Duration::from_secs(5);

/// Why the mocker could not start.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum MockerError {
    /// A configuration value is invalid.
    #[error(transparent)]
    Config(#[from] ConfigError),
    /// The tokenizer could not be loaded.
    #[error(transparent)]
    Tokenizer(#[from] TokenizerError),
    /// The tokenizer cannot generate the filler text.
    #[error(transparent)]
    Filler(#[from] FillerError),
    /// A ZeroMQ socket could not be set up.
    #[error(transparent)]
    Publisher(#[from] PublisherError),
    /// An HTTP port could not be bound.
    #[error("cannot bind HTTP on {addr}")]
    Http {
        /// The address.
        addr: SocketAddr,
        /// Why.
        #[source]
        source: std::io::Error,
    },
}

/// What every engine of a fleet renders prompts and generates text with.
struct Prompts {
    renderer: Arc<Renderer>,
    filler: Arc<Filler>,
}

/// One engine as `kvroute serve` needs to know it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct WorkerInfo {
    /// `w{k}`.
    pub name: String,
    /// The HTTP address bound.
    pub http_addr: SocketAddr,
    /// Host clients should connect to (the bind host, or loopback for a wildcard).
    pub connect_host: String,
    /// PUB endpoint of each rank, as bound.
    pub events: Vec<String>,
    /// Replay endpoint of each rank, as bound.
    pub replay: Vec<String>,
    /// Tokens per block.
    pub block_size: usize,
    /// The engine flavour (how its prompts lay out images; `flavor=` in the line).
    pub flavor: WorkerFlavor,
    /// The prefill/decode role (`role=` in the line unless `both`).
    pub role: Role,
    /// The bootstrap server's port (SGLang prefill engines, and `both`
    /// engines with `--kv-both`; `bootstrap_port=`).
    pub bootstrap_port: Option<u16>,
}

impl WorkerInfo {
    /// The engine's base URL.
    pub fn url(&self) -> String {
        format!("http://{}:{}", self.connect_host, self.http_addr.port())
    }

    /// The `--worker` value of `kvroute serve`:
    /// `name=…,url=…,events=tcp://…,replay=tcp://…,flavor=…,dp=…,block_size=…`
    /// (events and replay of rank 0; rank r uses the next ports), then
    /// `,role=prefill|decode` for a disaggregated engine and
    /// `,bootstrap_port=…` for an SGLang engine serving bootstrap rooms.
    pub fn worker_arg(&self) -> String {
        self.worker_arg_as(&self.name)
    }

    /// [`WorkerInfo::worker_arg`] naming the worker `name` instead (fleets
    /// of different roles each number their engines from `w0`).
    pub fn worker_arg_as(&self, name: &str) -> String {
        let port = |endpoints: &[String]| {
            endpoints
                .first()
                .and_then(|e| e.rsplit(':').next())
                .unwrap_or("0")
                .to_owned()
        };
        let mut line = format!(
            "name={name},url={},events=tcp://{host}:{},replay=tcp://{host}:{},flavor={},dp={},block_size={}",
            self.url(),
            port(&self.events),
            port(&self.replay),
            self.flavor.as_str(),
            self.events.len(),
            self.block_size,
            host = self.connect_host,
        );
        if self.role != Role::Both {
            line.push_str(&format!(",role={}", self.role));
        }
        if let Some(port) = self.bootstrap_port {
            line.push_str(&format!(",bootstrap_port={port}"));
        }
        line
    }
}

struct RunningEngine {
    server: JoinHandle<()>,
    /// The bootstrap server (SGLang prefill engines).
    bootstrap: Option<JoinHandle<()>>,
    drivers: Vec<JoinHandle<PublisherHandle>>,
}

/// A running fleet of mock engines.
pub struct Fleet {
    engines: Vec<RunningEngine>,
    workers: Vec<WorkerInfo>,
    shutdown: watch::Sender<bool>,
}

impl std::fmt::Debug for Fleet {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Fleet")
            .field("workers", &self.workers)
            .finish_non_exhaustive()
    }
}

fn connect_host(host: IpAddr) -> String {
    match host {
        IpAddr::V4(ip) if ip.is_unspecified() => Ipv4Addr::LOCALHOST.to_string(),
        IpAddr::V4(ip) => ip.to_string(),
        IpAddr::V6(ip) if ip.is_unspecified() => format!("[{}]", Ipv6Addr::LOCALHOST),
        IpAddr::V6(ip) => format!("[{ip}]"),
    }
}

fn offset(base: u16, by: u32) -> u16 {
    if base == 0 {
        0
    } else {
        // validate() guarantees the range fits below 65536.
        u16::try_from(u32::from(base) + by).unwrap_or(0)
    }
}

impl Fleet {
    /// Validates the configuration, binds every socket and starts every engine.
    /// Must run inside a multi-threaded tokio runtime.
    pub async fn start(config: MockerConfig) -> Result<Fleet, MockerError> {
        config.validate()?;
        let tokenizer = match &config.tokenizer {
            Some(path) => Tokenizer::from_file(path)?,
            None => Tokenizer::builtin(),
        };
        let prompts = Prompts {
            filler: Arc::new(Filler::new(&tokenizer)?),
            renderer: Arc::new(Renderer::new(
                tokenizer,
                ImageTokenRule::fixed(config.mm_tokens_per_image),
            )),
        };
        let (shutdown, shutdown_rx) = watch::channel(false);
        let mut fleet = Fleet {
            engines: Vec::new(),
            workers: Vec::new(),
            shutdown,
        };
        for k in 0..config.workers {
            if let Err(e) = fleet.start_engine(&config, k, &prompts, &shutdown_rx).await {
                fleet.shutdown().await;
                return Err(e);
            }
        }
        Ok(fleet)
    }

    async fn start_engine(
        &mut self,
        config: &MockerConfig,
        k: u16,
        prompts: &Prompts,
        shutdown_rx: &watch::Receiver<bool>,
    ) -> Result<(), MockerError> {
        let (ranks, drivers, events, replay) = self.spawn_ranks(config, k, shutdown_rx).await?;
        let (listener, bootstrap_listener) = match bind_listeners(config, k).await {
            Ok(l) => l,
            Err(e) => {
                let _ = self.shutdown.send(true);
                for d in drivers {
                    stop_driver(d).await;
                }
                return Err(e);
            }
        };
        let http_addr = listener
            .local_addr()
            .unwrap_or_else(|_| SocketAddr::new(config.host, 0));
        let bootstrap_port = bootstrap_listener.as_ref().and_then(port_of_listener);
        let rooms = bootstrap_listener
            .is_some()
            .then(|| Arc::new(RoomTable::new(config.kv_lease)));
        let name = format!("w{k}");
        let host = connect_host(config.host);
        let port_of = |e: &str| {
            e.rsplit(':')
                .next()
                .and_then(|p| p.parse().ok())
                .unwrap_or(0)
        };
        let state = Arc::new(EngineState {
            name: name.clone(),
            model: config.model.clone(),
            root: model_root(config),
            lora_adapters: config.lora_adapters.clone(),
            flavor: config.flavor,
            ranks,
            renderer: prompts.renderer.clone(),
            filler: prompts.filler.clone(),
            prompt: PromptSettings {
                flavor: config.flavor,
                seed: config.seed,
            },
            block_size: config.block_size,
            delay: config.faults.delay,
            dice: Mutex::new(FailureDice::new(
                config.faults.fail_rate,
                config.seed.wrapping_add(u64::from(k)),
            )),
            cut_dice: Mutex::new(FailureDice::new(
                config.faults.cut_streams,
                config.seed.wrapping_add(u64::from(k)) ^ 0xC07_C07,
            )),
            created: SystemTime::now()
                .duration_since(UNIX_EPOCH)
                .map_or(0, |d| d.as_secs()),
            endpoints: EventEndpoints {
                host: host.clone(),
                events_port_base: events.first().map_or(0, |e| port_of(e)),
                replay_port_base: replay.first().map_or(0, |e| port_of(e)),
            },
            counter: AtomicU64::new(0),
            pd: pd_state(
                config,
                &name,
                (&host, http_addr.port()),
                (rooms.clone(), bootstrap_port),
            ),
            responses: http::ResponseStore::default(),
        });
        let bootstrap = match (bootstrap_listener, rooms) {
            (Some(listener), Some(rooms)) => {
                let ranks = state.ranks.clone();
                let app = bootstrap::app(BootstrapState { rooms, ranks });
                Some(serve_http(listener, app, shutdown_rx.clone()))
            }
            _ => None,
        };
        let server = serve_http(listener, http::app(state), shutdown_rx.clone());
        tracing::info!(worker = %name, %http_addr, ?events, ?replay, role = %config.role, ?bootstrap_port, "engine started");
        self.engines.push(RunningEngine {
            server,
            bootstrap,
            drivers,
        });
        self.workers.push(WorkerInfo {
            name,
            http_addr,
            connect_host: host,
            events,
            replay,
            block_size: config.block_size,
            flavor: config.flavor,
            role: config.role,
            bootstrap_port,
        });
        Ok(())
    }

    /// Engine `k`'s ranks: a publisher and a scheduler driver each.
    async fn spawn_ranks(
        &mut self,
        config: &MockerConfig,
        k: u16,
        shutdown_rx: &watch::Receiver<bool>,
    ) -> Result<SpawnedRanks, MockerError> {
        let ctx = zmq::Context::new();
        let dp = u32::from(config.dp_size);
        let mut ranks = Vec::new();
        let mut drivers = Vec::new();
        let mut events = Vec::new();
        let mut replay = Vec::new();
        for r in 0..dp {
            let index = u32::from(k) * dp + r;
            let settings = PublisherSettings {
                host: config.host,
                events_port: offset(config.kv_events_port, index),
                replay_port: offset(config.replay_port, index),
                replay_frames: config.replay_frames,
                encode: EncodeOptions {
                    flavor: config.flavor,
                    format: config.event_format,
                },
                dp_rank: r,
                faults: config.faults.clone(),
                buffer_steps: config.replay_buffer_steps,
            };
            let publisher = match PublisherHandle::spawn(&ctx, settings) {
                Ok(p) => p,
                Err(e) => {
                    let _ = self.shutdown.send(true);
                    for d in drivers {
                        stop_driver(d).await;
                    }
                    return Err(e.into());
                }
            };
            events.push(publisher.events_endpoint().to_owned());
            replay.push(publisher.replay_endpoint().to_owned());
            let engine = Engine::new(config.engine_config());
            let options = DriverOptions {
                ts_source: config.ts_source,
                restart_every: config.faults.restart_every,
                hold_lease: config.kv_lease,
            };
            let (handle, task) = driver::spawn(r, engine, publisher, options, shutdown_rx.clone());
            ranks.push(handle);
            drivers.push(task);
        }

        Ok((ranks, drivers, events, replay))
    }

    /// The engines, in order.
    pub fn workers(&self) -> &[WorkerInfo] {
        &self.workers
    }

    /// Stops every engine: HTTP drains for up to 5 s, drivers stop, publisher
    /// threads send what they have queued and exit.
    pub async fn shutdown(self) {
        let _ = self.shutdown.send(true);
        for engine in self.engines {
            let mut server = engine.server;
            if tokio::time::timeout(DRAIN_TIMEOUT, &mut server)
                .await
                .is_err()
            {
                tracing::warn!("HTTP responses still open after {DRAIN_TIMEOUT:?}: aborted");
                server.abort();
            }
            if let Some(mut bootstrap) = engine.bootstrap {
                if tokio::time::timeout(DRAIN_TIMEOUT, &mut bootstrap)
                    .await
                    .is_err()
                {
                    bootstrap.abort();
                }
            }
            tracing::debug!("HTTP server stopped");
            for d in engine.drivers {
                stop_driver(d).await;
            }
            tracing::debug!("drivers and publishers stopped");
        }
    }
}

/// Engine `k`'s HTTP listener, and its bootstrap listener if it serves one.
async fn bind_listeners(
    config: &MockerConfig,
    k: u16,
) -> Result<(tokio::net::TcpListener, Option<tokio::net::TcpListener>), MockerError> {
    let bind = |port: u16| async move {
        let addr = SocketAddr::new(config.host, offset(port, u32::from(k)));
        tokio::net::TcpListener::bind(addr)
            .await
            .map_err(|source| MockerError::Http { addr, source })
    };
    let http = bind(config.port).await?;
    let bootstrap = if config.serves_bootstrap() {
        Some(bind(config.bootstrap_port).await?)
    } else {
        None
    };
    Ok((http, bootstrap))
}

/// The port a listener is bound to.
fn port_of_listener(listener: &tokio::net::TcpListener) -> Option<u16> {
    listener.local_addr().ok().map(|a| a.port())
}

/// What engine `name`, reached at `host:port`, needs for its role, with
/// its bootstrap rooms and port when it serves them.
fn pd_state(
    config: &MockerConfig,
    name: &str,
    (host, port): (&str, u16),
    (rooms, bootstrap_port): (Option<Arc<RoomTable>>, Option<u16>),
) -> PdState {
    PdState {
        role: config.role,
        engine_id: format!("{name}@{host}:{port}"),
        side_host: host
            .trim_start_matches('[')
            .trim_end_matches(']')
            .to_owned(),
        side_port: port,
        transfer_us_per_block: config.transfer_us_per_block,
        speedup: config.timing.speedup,
        lease: config.kv_lease,
        rooms,
        bootstrap_port,
        stats: Arc::new(HandoffStats::default()),
    }
}

/// One engine's ranks as [`Fleet::spawn_ranks`] starts them: their handles,
/// their driver tasks, and their event and replay endpoints.
type SpawnedRanks = (
    Vec<RankHandle>,
    Vec<JoinHandle<PublisherHandle>>,
    Vec<String>,
    Vec<String>,
);

/// Serves `app` on `listener` until `stop` turns true.
fn serve_http(
    listener: tokio::net::TcpListener,
    app: axum::Router,
    mut stop: watch::Receiver<bool>,
) -> JoinHandle<()> {
    tokio::spawn(async move {
        let graceful = async move {
            while !*stop.borrow() {
                if stop.changed().await.is_err() {
                    break;
                }
            }
        };
        // Tokens stream as small writes: send each at once (no Nagle
        // delay behind the client's delayed ACK on kept-alive connections).
        let listener = axum::serve::ListenerExt::tap_io(listener, |tcp| {
            if let Err(e) = tcp.set_nodelay(true) {
                tracing::debug!("cannot set TCP_NODELAY: {e}");
            }
        });
        if let Err(e) = axum::serve(listener, app)
            .with_graceful_shutdown(graceful)
            .await
        {
            tracing::error!("HTTP server failed: {e}");
        }
    })
}

async fn stop_driver(task: JoinHandle<PublisherHandle>) {
    match task.await {
        Ok(publisher) => {
            // Joining a thread blocks: do it where blocking is allowed.
            let _ = tokio::task::spawn_blocking(move || publisher.shutdown()).await;
        }
        Err(e) => tracing::error!("engine driver failed: {e}"),
    }
}

/// Runs a fleet until `shutdown` resolves: starts it, prints one `--worker`
/// line per engine on stdout, waits, stops it.
pub async fn run(
    config: MockerConfig,
    shutdown: impl Future<Output = ()>,
) -> Result<(), MockerError> {
    let fleet = Fleet::start(config).await?;
    {
        use std::io::Write as _;
        let mut out = std::io::stdout().lock();
        for worker in fleet.workers() {
            let _ = writeln!(out, "{}", worker.worker_arg());
        }
        let _ = out.flush();
    }
    shutdown.await;
    tracing::info!("shutting down");
    fleet.shutdown().await;
    Ok(())
}

/// The `root` `/v1/models` names: the folder of the engine's tokenizer, as
/// vLLM names the folder it loaded the model from, else the model name.
fn model_root(config: &MockerConfig) -> String {
    config
        .tokenizer
        .as_deref()
        .and_then(|t| std::fs::canonicalize(t).ok())
        .and_then(|t| t.parent().map(|d| d.display().to_string()))
        .unwrap_or_else(|| config.model.clone())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn worker_line_has_the_keys_in_order() {
        let w = WorkerInfo {
            name: "w1".into(),
            http_addr: "127.0.0.1:8101".parse().expect("addr"),
            connect_host: "127.0.0.1".into(),
            events: vec!["tcp://127.0.0.1:5559".into(), "tcp://127.0.0.1:5560".into()],
            replay: vec!["tcp://127.0.0.1:5659".into(), "tcp://127.0.0.1:5660".into()],
            block_size: 16,
            flavor: WorkerFlavor::Sglang,
            role: Role::Both,
            bootstrap_port: None,
        };
        assert_eq!(
            w.worker_arg(),
            "name=w1,url=http://127.0.0.1:8101,events=tcp://127.0.0.1:5559,\
             replay=tcp://127.0.0.1:5659,flavor=sglang,dp=2,block_size=16"
        );
        let prefill = WorkerInfo {
            role: Role::Prefill,
            bootstrap_port: Some(8998),
            ..w.clone()
        };
        assert!(prefill
            .worker_arg()
            .ends_with(",block_size=16,role=prefill,bootstrap_port=8998"));
        let decode = WorkerInfo {
            role: Role::Decode,
            ..w
        };
        assert!(decode.worker_arg().ends_with(",block_size=16,role=decode"));
    }

    #[test]
    fn wildcard_hosts_connect_through_loopback() {
        assert_eq!(connect_host("0.0.0.0".parse().expect("ip")), "127.0.0.1");
        assert_eq!(connect_host("::".parse().expect("ip")), "[::1]");
        assert_eq!(offset(0, 5), 0);
        assert_eq!(offset(5557, 3), 5560);
    }
}
