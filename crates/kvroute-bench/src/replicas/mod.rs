//! `kvroute bench replicas`: what router replicas cost and what they buy,
//! with real processes.
//!
//! Four phases run the same seeded workload in closed loop, each on a fresh
//! mock fleet (in this process, empty caches, so hit rates compare fairly)
//! with fresh `kvroute serve` child processes over it:
//!
//! 1. [`PhaseKind::OneRouter`]: one router; the reference.
//! 2. [`PhaseKind::Synced`]: two replicas sharing their requests in flight
//!    over a fresh `nats-server` (a prefix of their own), the client
//!    alternating between them. Replicas route as one when this phase's hit
//!    rate and balance are the first's.
//! 3. [`PhaseKind::NoSync`]: two routers that share nothing; what is lost
//!    without the sharing (two routers herding the same prefix onto
//!    different engines, or the same burst onto one).
//! 4. [`PhaseKind::KillOne`]: as phase 2, and replica `r0` is killed with
//!    SIGKILL [`ReplicasBenchConfig::kill_after`] into the load; the
//!    balancing client retries on `r1` what `r0` never answered. Whole
//!    answers instead of streams, so that requests in flight can be retried.
//!
//! After each phase the bench reads every live router's
//! `kvroute_proxy_routed_total` (requests per engine) and `/workers`
//! (the replica sync's peer delay and publish cost); in phase 4 only the
//! survivor's, since `r0`'s figures die with it.

mod report;
mod scrape;

use std::collections::BTreeMap;
use std::path::PathBuf;
use std::time::{Duration, Instant};

use kvroute_mocker::{Fleet, MockerConfig};

use super::child::RouterProcess;
use crate::driver::{self, Arrival, Endpoint, LoadOptions};
use crate::embedded_router::wait_until_connected;
use crate::error::{Error, Result};
use crate::nats::NatsServer;
use crate::workload::{WorkloadKind, WorkloadSpec};
pub use report::{PhaseKind, PhaseReport, ReplicasBenchReport};
pub use scrape::{Delay, SyncFigures};

/// Longest wait for each replica of a synced phase to hear the other.
const PEERS_WITHIN: Duration = Duration::from_secs(10);

/// Longest wait for a router's event streams to connect to every engine.
const CONNECTED_WITHIN: Duration = Duration::from_secs(20);

/// What `kvroute bench replicas` runs.
#[derive(Debug, Clone)]
pub struct ReplicasBenchConfig {
    /// The `kvroute` executable whose `serve` runs the routers.
    pub router_exe: PathBuf,
    /// Mock engines (one DP rank each) behind the routers.
    pub engines: u16,
    /// KV-cache blocks per engine: fewer than the workload's prefixes need
    /// make the engines evict, so that where requests go shows in the hit
    /// rate.
    pub gpu_blocks: usize,
    /// Requests per phase.
    pub requests: usize,
    /// Requests in flight at once (closed loop).
    pub concurrency: usize,
    /// The traffic.
    pub workload: WorkloadKind,
    /// Multiplies every workload size.
    pub scale: f64,
    /// Prefix groups, conversations, documents or image pool size.
    pub groups: usize,
    /// Tokens generated per request.
    pub max_tokens: u32,
    /// Divides the engines' simulated time.
    pub speedup: f64,
    /// Seed of the workload.
    pub seed: u64,
    /// How long after the load starts phase 4 kills replica `r0`.
    pub kill_after: Duration,
    /// Draw a progress bar per phase on stderr.
    pub progress: bool,
}

impl ReplicasBenchConfig {
    /// The defaults of `kvroute bench replicas`, routers from `router_exe`.
    pub fn new(router_exe: PathBuf) -> Self {
        ReplicasBenchConfig {
            router_exe,
            engines: 4,
            gpu_blocks: MockerConfig::default().num_gpu_blocks,
            requests: 10_000,
            concurrency: 16,
            workload: WorkloadKind::SharedPrefix,
            scale: 0.05,
            groups: 8,
            max_tokens: 16,
            speedup: 50.0,
            seed: 1,
            kill_after: Duration::from_secs(1),
            progress: false,
        }
    }

    fn validate(&self) -> Result<()> {
        if self.engines == 0 || self.gpu_blocks == 0 {
            return Err(Error::Invalid(
                "engines and gpu_blocks must be at least 1".into(),
            ));
        }
        if self.concurrency == 0 || self.requests < self.concurrency {
            return Err(Error::Invalid(
                "requests must be at least concurrency, and concurrency at least 1".into(),
            ));
        }
        if !(self.scale.is_finite() && self.scale > 0.0) {
            return Err(Error::Invalid("scale must be a positive number".into()));
        }
        if !(self.speedup.is_finite() && self.speedup > 0.0) {
            return Err(Error::Invalid("speedup must be a positive number".into()));
        }
        if self.max_tokens == 0 {
            return Err(Error::Invalid("max_tokens must be at least 1".into()));
        }
        Ok(())
    }

    /// Every phase's workload: the same spec, streamed or not.
    pub fn workload_spec(&self, stream: bool) -> WorkloadSpec {
        WorkloadSpec {
            kind: self.workload,
            seed: self.seed,
            scale: self.scale,
            groups: self.groups.max(1),
            max_tokens: self.max_tokens,
            stream,
            ..WorkloadSpec::default()
        }
    }
}

/// Runs the four phases in order.
pub async fn run(config: &ReplicasBenchConfig) -> Result<ReplicasBenchReport> {
    config.validate()?;
    if !NatsServer::available() {
        return Err(Error::NatsNotFound);
    }
    let client = driver::client()?;
    let mut phases = Vec::with_capacity(PhaseKind::ALL.len());
    for kind in PhaseKind::ALL {
        tracing::info!(phase = kind.title(), "starting a phase");
        phases.push(run_phase(config, kind, &client).await?);
    }
    Ok(ReplicasBenchReport {
        config: config.clone(),
        workload: config.workload_spec(true).describe(),
        phases,
    })
}

/// One phase on a fresh fleet, which is shut down whatever happens.
async fn run_phase(
    config: &ReplicasBenchConfig,
    kind: PhaseKind,
    client: &reqwest::Client,
) -> Result<PhaseReport> {
    let mut mocker = MockerConfig {
        workers: config.engines,
        num_gpu_blocks: config.gpu_blocks,
        port: 0,
        kv_events_port: 0,
        replay_port: 0,
        ..MockerConfig::default()
    };
    mocker.timing.speedup = config.speedup;
    let fleet = Fleet::start(mocker).await?;
    let result = phase_on(config, kind, &fleet, client).await;
    fleet.shutdown().await;
    result
}

/// One router of a phase: its replica id, and its process until it is killed.
struct Router {
    id: String,
    url: String,
    process: Option<RouterProcess>,
    /// CPU time when the load started.
    cpu_before: Duration,
    /// CPU time when the load ended or it was killed.
    cpu_after: Duration,
}

/// Starts the phase's routers (and NATS) over `fleet`, drives the load,
/// then reads the live routers' figures.
async fn phase_on(
    config: &ReplicasBenchConfig,
    kind: PhaseKind,
    fleet: &Fleet,
    client: &reqwest::Client,
) -> Result<PhaseReport> {
    let nats = if kind.synced() {
        Some(blocking("starting nats-server", NatsServer::start).await?)
    } else {
        None
    };
    let specs: Vec<String> = fleet.workers().iter().map(|w| w.worker_arg()).collect();
    let prefix = format!("bench-{}-{}", std::process::id(), kind.key());
    let mut routers = Vec::with_capacity(kind.routers());
    for i in 0..kind.routers() {
        let id = format!("r{i}");
        let mut flags = Vec::new();
        if let Some(nats) = &nats {
            flags.extend([
                "--nats".to_owned(),
                nats.url(),
                "--replica-id".to_owned(),
                id.clone(),
                "--nats-prefix".to_owned(),
                prefix.clone(),
            ]);
        }
        if config.workload == WorkloadKind::Images {
            flags.extend(["--tokenizer".to_owned(), "builtin".to_owned()]);
        }
        let (exe, specs) = (config.router_exe.clone(), specs.clone());
        let process = blocking("starting a router", move || {
            RouterProcess::spawn(&exe, &specs, &flags)
        })
        .await?;
        routers.push(Router {
            id,
            url: process.url.clone(),
            process: Some(process),
            cpu_before: Duration::ZERO,
            cpu_after: Duration::ZERO,
        });
    }
    for router in &routers {
        if let Err(e) = wait_until_connected(client, &router.url, CONNECTED_WITHIN).await {
            let ranks = scrape::rank_states(client, &router.url).await;
            return Err(Error::Unexpected(format!(
                "{}, router {}: {e}; its ranks: {ranks}",
                kind.title(),
                router.id
            )));
        }
    }
    if kind.synced() {
        for router in &routers {
            for peer in routers.iter().filter(|p| p.id != router.id) {
                scrape::wait_for_peer(client, &router.url, &peer.id, PEERS_WITHIN).await?;
            }
        }
    }
    let engines: Vec<String> = fleet.workers().iter().map(|w| w.url()).collect();
    let stop = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
    let sampler = tokio::spawn(sample_imbalance(client.clone(), engines, stop.clone()));
    let driven = drive(config, kind, &mut routers, client).await;
    stop.store(true, std::sync::atomic::Ordering::Relaxed);
    let imbalance = sampler.await.unwrap_or_default();
    let (load, killed_at) = driven?;
    let mut report = read_figures(kind, fleet, &routers, client, load, killed_at).await?;
    report.in_flight_imbalance = imbalance;
    Ok(report)
}

/// Every [`SAMPLE_EVERY`] until `stop`: the engines' requests in flight
/// (running and waiting), as max / mean over the engines, for each sample
/// with any in flight. Herding shows here, while it happens: the phase's
/// request totals smooth it out.
async fn sample_imbalance(
    client: reqwest::Client,
    engines: Vec<String>,
    stop: std::sync::Arc<std::sync::atomic::AtomicBool>,
) -> Vec<f64> {
    let mut samples = Vec::new();
    while !stop.load(std::sync::atomic::Ordering::Relaxed) {
        let mut counts = Vec::with_capacity(engines.len());
        for engine in &engines {
            if let Ok(n) = scrape::engine_in_flight(&client, engine).await {
                counts.push(n);
            }
        }
        let total: u64 = counts.iter().sum();
        if counts.len() == engines.len() && total > 0 {
            let max = counts.iter().copied().max().unwrap_or(0);
            samples.push(max as f64 * counts.len() as f64 / total as f64);
        }
        tokio::time::sleep(SAMPLE_EVERY).await;
    }
    samples
}

/// How often the engines' requests in flight are sampled.
const SAMPLE_EVERY: Duration = Duration::from_millis(20);

/// Runs the load through the phase's routers (killing `r0` in phase 4 if
/// the load is still running then); the report, and when `r0` was killed
/// (s into the load).
async fn drive(
    config: &ReplicasBenchConfig,
    kind: PhaseKind,
    routers: &mut [Router],
    client: &reqwest::Client,
) -> Result<(crate::PolicyReport, Option<f64>)> {
    let endpoint = match &*routers {
        [one] => Endpoint::OpenAi {
            base_url: one.url.clone(),
        },
        many => Endpoint::Balanced {
            base_urls: many.iter().map(|r| r.url.clone()).collect(),
        },
    };
    let options = LoadOptions {
        workload: config.workload_spec(kind.streamed()),
        arrival: Arrival::Closed {
            concurrency: config.concurrency,
        },
        requests: config.requests,
        max_duration: None,
        progress: config.progress,
        label: kind.title().to_owned(),
    };
    for router in routers.iter_mut() {
        router.cpu_before = cpu_of(router)?;
    }
    let started = Instant::now();
    let load = driver::run(client, &endpoint, &options);
    tokio::pin!(load);
    let mut killed_at = None;
    if kind == PhaseKind::KillOne {
        tokio::select! {
            done = &mut load => {
                tracing::warn!("the load ended before r0 was to be killed: nothing was killed");
                return finish(routers, done, None);
            }
            () = tokio::time::sleep(config.kill_after) => {}
        }
        if let Some(victim) = routers.first_mut() {
            victim.cpu_after = cpu_of(victim)?;
            if let Some(mut process) = victim.process.take() {
                process.kill()?;
            }
            killed_at = Some(started.elapsed().as_secs_f64());
            tracing::info!(replica = %victim.id, "killed with SIGKILL");
        }
    }
    let done = load.await;
    finish(routers, done, killed_at)
}

/// Reads the live routers' CPU time at the end of the load.
fn finish(
    routers: &mut [Router],
    done: Result<crate::PolicyReport>,
    killed_at: Option<f64>,
) -> Result<(crate::PolicyReport, Option<f64>)> {
    let report = done?;
    for router in routers.iter_mut().filter(|r| r.process.is_some()) {
        router.cpu_after = cpu_of(router)?;
    }
    Ok((report, killed_at))
}

/// The router's CPU time so far (zero once it is killed).
fn cpu_of(router: &Router) -> Result<Duration> {
    router
        .process
        .as_ref()
        .map_or(Ok(Duration::ZERO), RouterProcess::cpu_time)
}

/// The phase's report: the load's figures, and what the live routers say
/// (requests per engine, their replica sync).
async fn read_figures(
    kind: PhaseKind,
    fleet: &Fleet,
    routers: &[Router],
    client: &reqwest::Client,
    load: crate::PolicyReport,
    killed_at: Option<f64>,
) -> Result<PhaseReport> {
    let mut per_engine: BTreeMap<String, u64> = fleet
        .workers()
        .iter()
        .map(|w| (w.name.clone(), 0))
        .collect();
    let mut counted_from = Vec::new();
    let mut sync = Vec::new();
    for router in routers.iter().filter(|r| r.process.is_some()) {
        for (worker, n) in scrape::routed_per_worker(client, &router.url).await? {
            *per_engine.entry(worker).or_insert(0) += n;
        }
        counted_from.push(router.id.clone());
        if let Some(figures) = scrape::sync_figures(client, &router.url).await? {
            sync.push(figures);
        }
    }
    let router_cpu_s = routers
        .iter()
        .map(|r| r.cpu_after.saturating_sub(r.cpu_before).as_secs_f64())
        .sum();
    Ok(PhaseReport {
        kind,
        load,
        per_engine,
        counted_from,
        sync,
        router_cpu_s,
        killed_at_s: killed_at,
        in_flight_imbalance: Vec::new(),
    })
}

/// Runs blocking start-up work (a child process's start) off the runtime.
async fn blocking<T: Send + 'static>(
    what: &str,
    f: impl FnOnce() -> Result<T> + Send + 'static,
) -> Result<T> {
    tokio::task::spawn_blocking(f)
        .await
        .map_err(|e| Error::Unexpected(format!("{what}: {e}")))?
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn settings_out_of_range_are_refused_and_phases_share_one_workload() {
        let ok = ReplicasBenchConfig::new("kvroute".into());
        assert!(ok.validate().is_ok());
        for bad in [
            ReplicasBenchConfig {
                engines: 0,
                ..ok.clone()
            },
            ReplicasBenchConfig {
                concurrency: 0,
                ..ok.clone()
            },
            ReplicasBenchConfig {
                requests: 8,
                concurrency: 16,
                ..ok.clone()
            },
            ReplicasBenchConfig {
                scale: 0.0,
                ..ok.clone()
            },
            ReplicasBenchConfig {
                speedup: f64::NAN,
                ..ok.clone()
            },
            ReplicasBenchConfig {
                max_tokens: 0,
                ..ok.clone()
            },
        ] {
            assert!(bad.validate().is_err(), "{bad:?}");
        }
        let (streamed, whole) = (ok.workload_spec(true), ok.workload_spec(false));
        assert_eq!(
            WorkloadSpec {
                stream: true,
                ..whole
            },
            streamed
        );
        assert_eq!(
            (streamed.scale, streamed.groups, streamed.max_tokens),
            (0.05, 8, 16)
        );
    }
}
