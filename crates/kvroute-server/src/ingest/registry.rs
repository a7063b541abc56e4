//! The worker registry: which workers exist, which ingest thread follows
//! each of their ranks, the limit on ranks, and the rule that a worker's blocks leave the index when it leaves (unregistered,
//! or unreachable past the grace period).

use std::collections::BTreeMap;
use std::sync::atomic::{AtomicU32, Ordering};
use std::sync::{Arc, Mutex, PoisonError};
use std::time::Duration;

use kvroute_core::event::WorkerFlavor;
use kvroute_core::index::{DpRank, SharedIndex, WorkerId, WorkerRank};
use kvroute_core::scheduler::WorkerRole;
use serde::Serialize;
use tracing::{info, warn};

use super::address::{worker_hosts, AllowedHosts};
use super::pool::{IngestPool, PoolError};
use super::rank::{RankStream, RankTarget, Timing};
use super::spec::{RankEndpoints, SpecError, WorkerSpec};
use super::stats::{RankCounters, RankState, RankStats, ResumePoint};
use crate::state::SavedWorker;

mod saved;

/// Ingestion settings.
#[derive(Debug, Clone)]
pub struct IngestConfig {
    /// Ingest threads (each serves many ranks).
    pub threads: usize,
    /// Most (worker, rank) streams; a rank without a replay endpoint counts twice.
    pub max_ranks: usize,
    /// Where `max_ranks` came from, so that a refusal says what to raise.
    pub max_ranks_source: RankLimitSource,
    /// Timeouts and the continuity check period.
    pub timing: Timing,
}

/// Where the limit on ranks came from: a refused registration tells the
/// operator to raise the flag they gave, or the open-file limit that the
/// default follows.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
#[non_exhaustive]
pub enum RankLimitSource {
    /// Given as such (`--max-ranks`, or by the program embedding the router).
    #[default]
    Given,
    /// Computed by [`default_max_ranks`] from the open-file limit in force.
    OpenFiles {
        /// The open-file limit (soft, after raising it to the hard one).
        limit: u64,
    },
}

impl RankLimitSource {
    /// The end of a refusal: what to raise.
    fn advice(&self) -> String {
        match self {
            RankLimitSource::Given => "raise --max-ranks".to_owned(),
            RankLimitSource::OpenFiles { limit } => format!(
                "raise the open-file limit (`ulimit -n`, now {limit}), which the default \
                 of --max-ranks follows, or set --max-ranks"
            ),
        }
    }
}

impl Default for IngestConfig {
    fn default() -> Self {
        IngestConfig {
            threads: std::thread::available_parallelism().map_or(2, |n| n.get()),
            max_ranks: 4_096,
            max_ranks_source: RankLimitSource::Given,
            timing: Timing::default(),
        }
    }
}

impl IngestConfig {
    /// ZeroMQ sockets the ranks need: a SUB each, a monitor for those
    /// without a replay endpoint, and each thread's ROUTER and monitor.
    fn max_sockets(&self) -> usize {
        self.max_ranks * 2 + self.threads * 4 + 64
    }

    /// Live batches each rank's SUB may queue before dropping (the drop is
    /// a gap, replayed from the ring): four million across `max_ranks`, at
    /// least 1 000 and at most 100 000, so a flood cannot hold unbounded memory.
    fn queue_per_rank(&self) -> i32 {
        let share = 4_000_000 / self.max_ranks.max(1);
        i32::try_from(share.clamp(1_000, 100_000)).unwrap_or(1_000)
    }
}

/// Descriptors a rank costs: its SUB's mailbox (2) and connection, and its
/// connection of the thread's ROUTER; those without replay use a monitor
/// instead (twice as many in all).
pub const FDS_PER_RANK: u64 = 4;

/// The default `--max-ranks` for an open-file limit and `--max-connections`:
/// what the reserve and the HTTP connections (two descriptors each: the
/// client's and the worker's) leave, at [`FDS_PER_RANK`] per rank.
pub fn default_max_ranks(fd_limit: u64, max_connections: usize) -> usize {
    let http = 2 * max_connections as u64;
    let left = fd_limit.saturating_sub(256).saturating_sub(http);
    usize::try_from(left / FDS_PER_RANK)
        .unwrap_or(usize::MAX)
        .max(1)
}

/// Why a registration was refused.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum RegistryError {
    /// A different worker already has this name.
    #[error("a different worker named `{0}` is already registered")]
    NameTaken(String),
    /// The same rank of a worker registered twice with different endpoints.
    #[error("worker `{name}` rank {rank} is already registered with other endpoints")]
    RankTaken {
        /// The worker.
        name: String,
        /// The rank.
        rank: DpRank,
    },
    /// The ingest threads could not start.
    #[error(transparent)]
    Start(#[from] PoolError),
    /// The registration would exceed `--max-ranks`: one sentence naming
    /// the worker once and what to raise.
    #[error(
        "worker `{name}` needs {requested} rank slot(s) but --max-ranks {max} has {free} free \
         (a rank takes one slot, two without a replay endpoint); {advice}",
        free = max.saturating_sub(*used),
        advice = limit.advice()
    )]
    TooManyRanks {
        /// The worker.
        name: String,
        /// Rank units asked for.
        requested: usize,
        /// Rank units registered.
        used: usize,
        /// The limit.
        max: usize,
        /// Where the limit came from.
        limit: RankLimitSource,
    },
    /// A URL or socket address is not of a form a worker may have.
    #[error("worker `{name}`: {error}")]
    Address {
        /// The worker.
        name: String,
        /// What is wrong with the address (part of the message, not a
        /// separate cause, so the reason is printed once).
        error: SpecError,
    },
    /// An address names a host outside `--allow-worker-hosts`.
    #[error("worker `{name}`: host `{host}` is not in --allow-worker-hosts")]
    HostNotAllowed {
        /// The worker.
        name: String,
        /// The host.
        host: String,
    },
}

struct Rank {
    endpoints: RankEndpoints,
    stats: Arc<RankStats>,
    /// The ingest thread following it.
    thread: usize,
}

/// What a rank costs against `--max-ranks`.
fn rank_units(endpoints: &RankEndpoints) -> usize {
    if endpoints.replay.is_some() {
        1
    } else {
        2
    }
}

struct Worker {
    id: WorkerId,
    spec: WorkerSpec,
    ranks: Vec<Rank>,
    /// Highest registered rank + 1, shared with its streams (foreign ranks).
    dp_size: Arc<AtomicU32>,
    /// Tokens per block, shared with its streams; 0 until learned when the
    /// spec gave none.
    block_size: Arc<AtomicU32>,
    registered_ms: u64,
    /// Blocks were dropped because the worker was unreachable; cleared again on reconnect.
    cleared_unreachable: bool,
}

/// Registered workers and their ingestion.
pub struct Registry {
    workers: Mutex<BTreeMap<String, Worker>>,
    /// Workers of a restored snapshot not registered again yet, by name.
    saved: Mutex<BTreeMap<String, SavedWorker>>,
    next_id: Mutex<u32>,
    index: Arc<SharedIndex>,
    pool: IngestPool,
    ingest: IngestConfig,
    grace: Duration,
    allowed: AllowedHosts,
}

impl std::fmt::Debug for Registry {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Registry")
            .field("grace", &self.grace)
            .finish_non_exhaustive()
    }
}

fn now_ms() -> u64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_millis() as u64)
}

impl Registry {
    /// An empty registry feeding `index`, with its ingest threads started.
    pub fn new(
        index: Arc<SharedIndex>,
        ingest: IngestConfig,
        grace: Duration,
    ) -> Result<Self, RegistryError> {
        let pool = IngestPool::start(
            ingest.threads,
            ingest.max_sockets(),
            ingest.queue_per_rank(),
        )?;
        Ok(Registry {
            workers: Mutex::new(BTreeMap::new()),
            saved: Mutex::new(BTreeMap::new()),
            next_id: Mutex::new(0),
            index,
            pool,
            ingest,
            grace,
            allowed: AllowedHosts::default(),
        })
    }

    /// Limits the hosts that registered workers' addresses may name.
    pub fn with_allowed_hosts(mut self, allowed: AllowedHosts) -> Self {
        self.allowed = allowed;
        self
    }

    /// Checks the form of every address of `spec` and that each names an
    /// allowed host.
    fn check_addresses(&self, spec: &WorkerSpec) -> Result<(), RegistryError> {
        let hosts = worker_hosts(spec).map_err(|error| RegistryError::Address {
            name: spec.name.clone(),
            error,
        })?;
        for host in hosts {
            if !self.allowed.allows(&host) {
                return Err(RegistryError::HostNotAllowed {
                    name: spec.name.clone(),
                    host,
                });
            }
        }
        Ok(())
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, BTreeMap<String, Worker>> {
        self.workers.lock().unwrap_or_else(PoisonError::into_inner)
    }

    fn start_rank(
        &self,
        worker: &Worker,
        endpoints: &RankEndpoints,
        from: Option<ResumePoint>,
    ) -> Rank {
        let stats = Arc::new(RankStats::default());
        let target = RankTarget {
            worker: worker.spec.name.clone(),
            key: WorkerRank {
                worker: worker.id,
                rank: endpoints.rank,
            },
            endpoints: endpoints.clone(),
            topic: worker.spec.topic.clone(),
            block_size: worker.block_size.clone(),
            dp_size: worker.dp_size.clone(),
            stats: stats.clone(),
        };
        let stream = RankStream::resumed(target, self.index.clone(), self.ingest.timing, from);
        let thread = self.pool.add(stream);
        Rank {
            endpoints: endpoints.clone(),
            stats,
            thread,
        }
    }

    /// Rank units registered now.
    fn units_used(workers: &BTreeMap<String, Worker>) -> usize {
        workers
            .values()
            .flat_map(|w| &w.ranks)
            .map(|r| rank_units(&r.endpoints))
            .sum()
    }

    /// Refuses ranks beyond `--max-ranks` before anything is registered.
    fn check_capacity(
        &self,
        workers: &BTreeMap<String, Worker>,
        spec: &WorkerSpec,
    ) -> Result<(), RegistryError> {
        let existing = workers.get(&spec.name);
        let requested: usize = spec
            .ranks
            .iter()
            .filter(|e| {
                existing.is_none_or(|w| !w.ranks.iter().any(|r| r.endpoints.rank == e.rank))
            })
            .map(rank_units)
            .sum();
        let used = Self::units_used(workers);
        if requested > 0 && used + requested > self.ingest.max_ranks {
            return Err(RegistryError::TooManyRanks {
                name: spec.name.clone(),
                requested,
                used,
                max: self.ingest.max_ranks,
                limit: self.ingest.max_ranks_source,
            });
        }
        Ok(())
    }

    /// Registers a worker (or adds ranks to one registered with the same
    /// name, URL, block size, role and bootstrap port) and starts ingesting
    /// its ranks. Registering the same worker twice is a no-op.
    pub fn register(&self, spec: WorkerSpec) -> Result<WorkerId, RegistryError> {
        self.check_addresses(&spec)?;
        let mut workers = self.lock();
        if let Some(existing) = workers.get(&spec.name) {
            let same = existing.spec.url == spec.url
                && existing.spec.block_size == spec.block_size
                && existing.spec.role == spec.role
                && existing.spec.bootstrap_port == spec.bootstrap_port;
            if !same {
                return Err(RegistryError::NameTaken(spec.name));
            }
            for endpoints in &spec.ranks {
                let known = existing
                    .ranks
                    .iter()
                    .find(|r| r.endpoints.rank == endpoints.rank);
                if known.is_some_and(|r| r.endpoints != *endpoints) {
                    return Err(RegistryError::RankTaken {
                        name: spec.name.clone(),
                        rank: endpoints.rank,
                    });
                }
            }
        }
        self.check_capacity(&workers, &spec)?;
        let saved = self.take_saved(&spec);
        let worker = match workers.remove(&spec.name) {
            Some(existing) => existing,
            None => {
                let id = match &saved {
                    Some(s) => WorkerId(s.id),
                    None => {
                        let mut next = self.next_id.lock().unwrap_or_else(PoisonError::into_inner);
                        *next += 1;
                        WorkerId(*next - 1)
                    }
                };
                let learned = saved.as_ref().and_then(|s| s.block_size);
                let block_size = spec.block_size.or(learned).unwrap_or(0);
                let mut spec = spec.clone();
                spec.ranks.clear();
                Worker {
                    id,
                    spec,
                    ranks: Vec::new(),
                    dp_size: Arc::new(AtomicU32::new(0)),
                    block_size: Arc::new(AtomicU32::new(block_size)),
                    registered_ms: now_ms(),
                    cleared_unreachable: false,
                }
            }
        };
        let worker = self.add_ranks(worker, &spec.ranks, saved.as_ref());
        let id = worker.id;
        workers.insert(spec.name, worker);
        Ok(id)
    }

    /// Starts the ranks of `endpoints` the worker does not have yet.
    fn add_ranks(
        &self,
        mut worker: Worker,
        endpoints: &[RankEndpoints],
        saved: Option<&SavedWorker>,
    ) -> Worker {
        let new: Vec<&RankEndpoints> = endpoints
            .iter()
            .filter(|e| !worker.ranks.iter().any(|r| r.endpoints.rank == e.rank))
            .collect();
        let size = new
            .iter()
            .map(|e| e.rank.0.saturating_add(1))
            .max()
            .unwrap_or(0)
            .max(worker.dp_size.load(Ordering::Relaxed));
        // Before its streams start: their first batches may be for the new ranks.
        worker.dp_size.store(size, Ordering::Relaxed);
        for endpoints in &new {
            let from = saved.and_then(|s| saved::resume_point(s, endpoints));
            let rank = self.start_rank(&worker, endpoints, from);
            worker.ranks.push(rank);
            worker.spec.ranks.push((*endpoints).clone());
        }
        if !new.is_empty() {
            info!(worker = %worker.spec.name, ranks = new.len(), dp_size = size, "worker registered");
        }
        worker
    }

    /// Stops ingesting a worker and drops its blocks; false when unknown.
    pub fn unregister(&self, name: &str) -> bool {
        let removed = self.lock().remove(name);
        match removed {
            Some(worker) => {
                for rank in &worker.ranks {
                    let key = WorkerRank {
                        worker: worker.id,
                        rank: rank.endpoints.rank,
                    };
                    self.pool.remove(rank.thread, key);
                }
                self.index.remove_worker(worker.id);
                info!(worker = %name, "worker unregistered");
                true
            }
            None => false,
        }
    }

    /// Drops the blocks of workers whose every rank has been disconnected for
    /// longer than the grace period (they keep their registration, and are
    /// ingested again when they come back).
    pub fn check_unreachable(&self) {
        let now = now_ms();
        let grace = self.grace.as_millis() as u64;
        let mut workers = self.lock();
        for worker in workers.values_mut() {
            let down_since = |s: &RankStats| {
                if s.connected.load(Ordering::Relaxed) {
                    None
                } else {
                    Some(
                        s.last_connected_ms
                            .load(Ordering::Relaxed)
                            .max(worker.registered_ms),
                    )
                }
            };
            let all_down = worker.ranks.iter().all(|r| {
                down_since(&r.stats).is_some_and(|since| now.saturating_sub(since) > grace)
            });
            if all_down && !worker.cleared_unreachable {
                warn!(worker = %worker.spec.name, grace_ms = grace, "worker unreachable; dropping its blocks");
                for rank in &worker.ranks {
                    self.index.clear_rank(WorkerRank {
                        worker: worker.id,
                        rank: rank.endpoints.rank,
                    });
                }
                worker.cleared_unreachable = true;
            } else if !all_down {
                worker.cleared_unreachable = false;
            }
        }
    }

    /// Every registered worker as it is now: its spec, and each rank's
    /// connection, position in its stream, counters and blocks per tier.
    /// Routing, `/workers` and `/metrics` all read this one view.
    pub fn view(&self) -> Vec<WorkerView> {
        let stats = self.index.stats();
        let tiers_of: std::collections::HashMap<WorkerRank, [u64; 4]> =
            stats.per_rank.into_iter().collect();
        let workers = self.lock();
        workers
            .values()
            .map(|w| WorkerView {
                name: w.spec.name.clone(),
                id: w.id,
                url: w.spec.url.clone(),
                model: w.spec.model.clone(),
                block_size: Some(w.block_size.load(Ordering::Relaxed)).filter(|&b| b > 0),
                shared_block_size: w.block_size.clone(),
                flavor: w.spec.flavor,
                speed: w.spec.speed.get(),
                role: w.spec.role,
                bootstrap_port: w.spec.bootstrap_port,
                ranks: w
                    .ranks
                    .iter()
                    .map(|r| {
                        let key = WorkerRank {
                            worker: w.id,
                            rank: r.endpoints.rank,
                        };
                        let tiers = tiers_of.get(&key).copied().unwrap_or([0; 4]);
                        rank_view(&r.endpoints, &r.stats, tiers)
                    })
                    .collect(),
            })
            .collect()
    }

    /// How many workers are registered.
    pub fn len(&self) -> usize {
        self.lock().len()
    }

    /// Whether no worker is registered.
    pub fn is_empty(&self) -> bool {
        self.lock().is_empty()
    }

    /// Stops every ingest thread.
    pub fn shutdown(&self) {
        self.pool.shutdown();
    }
}

/// One registered worker, as [`Registry::view`] sees it; serialized, the
/// entries of `GET /workers`.
#[derive(Debug, Clone, Serialize)]
pub struct WorkerView {
    /// Unique name.
    pub name: String,
    /// Its id in the index.
    #[serde(skip)]
    pub id: WorkerId,
    /// HTTP base URL.
    pub url: String,
    /// Model the engine serves, if known.
    pub model: Option<String>,
    /// Tokens per KV block; `None` until learned from the stream.
    pub block_size: Option<u32>,
    /// The worker's block size as its streams set it (0 until learned),
    /// shared with them: a view taken before the first stored event can
    /// still see the size its streams learn afterwards.
    #[serde(skip)]
    pub shared_block_size: Arc<AtomicU32>,
    /// The engine flavour.
    #[serde(with = "super::spec::flavor_name")]
    pub flavor: WorkerFlavor,
    /// Its declared speed (1: the fleet's reference engine).
    pub speed: f64,
    /// What it does in a disaggregated fleet: which legs routing may send it.
    #[serde(with = "super::spec::role_name")]
    pub role: WorkerRole,
    /// Its SGLang bootstrap server's port, which a disaggregated request's
    /// legs are given (`None`: not declared; left out of `/workers`).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub bootstrap_port: Option<u16>,
    /// Its data-parallel ranks.
    pub ranks: Vec<RankView>,
}

/// One rank of a worker, as [`Registry::view`] sees it.
#[derive(Debug, Clone, Serialize)]
pub struct RankView {
    /// The rank.
    pub dp_rank: DpRank,
    /// Its event publisher.
    pub events_endpoint: String,
    /// Its replay socket, if any.
    pub replay_endpoint: Option<String>,
    /// The event socket is connected.
    pub connected: bool,
    /// The last sequence number applied.
    pub last_seq: Option<u64>,
    /// Milliseconds between the last batch's timestamp and its application.
    pub lag_ms: u64,
    /// Blocks in the index per tier.
    pub blocks: TierBlocks,
    /// How far its blocks can be trusted.
    pub state: RankState,
    /// Why it is in that state (always set for `error` and `degraded`).
    pub state_reason: Option<String>,
    /// Its blocks may be a dead engine's (the link dropped, or they were
    /// restored, and no replay has proven the stream since): kept, but not
    /// counted by routing.
    pub in_doubt: bool,
    /// The stream's counters.
    #[serde(flatten)]
    pub counters: RankCounters,
    /// Shared state, for routing's accuracy labels and recovery.
    #[serde(skip)]
    pub stats: Arc<RankStats>,
}

/// A rank's residencies in the index, per tier.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize)]
pub struct TierBlocks {
    /// On the GPU.
    pub device: u64,
    /// In host memory.
    pub host: u64,
    /// On local disk.
    pub disk: u64,
    /// In an external pool.
    pub external: u64,
}

fn rank_view(endpoints: &RankEndpoints, stats: &Arc<RankStats>, tiers: [u64; 4]) -> RankView {
    RankView {
        dp_rank: endpoints.rank,
        events_endpoint: endpoints.events.clone(),
        replay_endpoint: endpoints.replay.clone(),
        connected: stats.connected.load(Ordering::Relaxed),
        last_seq: stats.next_seq.load(Ordering::Relaxed).checked_sub(1),
        lag_ms: stats.lag_ms.load(Ordering::Relaxed),
        blocks: TierBlocks {
            device: tiers[0],
            host: tiers[1],
            disk: tiers[2],
            external: tiers[3],
        },
        state: stats.state(),
        state_reason: stats.reason(),
        in_doubt: stats.in_doubt.load(Ordering::Relaxed),
        counters: stats.counters(),
        stats: stats.clone(),
    }
}
