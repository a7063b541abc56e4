//! The worker registry: which workers exist, their rank threads, and the
//! rule that a worker's blocks leave the index when it leaves (unregistered,
//! or unreachable past the grace period).

use std::collections::BTreeMap;
use std::sync::atomic::Ordering;
use std::sync::{Arc, Mutex, PoisonError};
use std::time::Duration;

use kvroute_core::event::WorkerFlavor;
use kvroute_core::index::{SharedIndex, WorkerId, WorkerRank};
use serde::Serialize;
use tracing::{info, warn};

use super::address::{worker_hosts, AllowedHosts};
use super::spec::{RankEndpoints, SpecError, WorkerSpec};
use super::stream::{IngestConfig, RankCounters, RankIngest, RankStats, RankTarget};

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
        rank: u32,
    },
    /// The rank thread could not start.
    #[error("could not start ingestion: {0}")]
    Start(String),
    /// A URL or socket address is not of a form a worker may have.
    #[error("{0}")]
    Address(#[from] SpecError),
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
    ingest: RankIngest,
}

struct Worker {
    id: WorkerId,
    spec: WorkerSpec,
    ranks: Vec<Rank>,
    registered_ms: u64,
    /// Blocks were dropped because the worker was unreachable; cleared again on reconnect.
    cleared_unreachable: bool,
}

/// Registered workers and their ingestion.
pub struct Registry {
    workers: Mutex<BTreeMap<String, Worker>>,
    next_id: Mutex<u32>,
    index: Arc<SharedIndex>,
    zmq: zmq::Context,
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
    /// An empty registry feeding `index`.
    pub fn new(index: Arc<SharedIndex>, ingest: IngestConfig, grace: Duration) -> Self {
        Registry {
            workers: Mutex::new(BTreeMap::new()),
            next_id: Mutex::new(0),
            index,
            zmq: zmq::Context::new(),
            ingest,
            grace,
            allowed: AllowedHosts::default(),
        }
    }

    /// Limits the hosts that registered workers' addresses may name.
    pub fn with_allowed_hosts(mut self, allowed: AllowedHosts) -> Self {
        self.allowed = allowed;
        self
    }

    /// Checks the form of every address of `spec` and that each names an
    /// allowed host.
    fn check_addresses(&self, spec: &WorkerSpec) -> Result<(), RegistryError> {
        for host in worker_hosts(spec)? {
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
        id: WorkerId,
        spec: &WorkerSpec,
        endpoints: &RankEndpoints,
    ) -> Result<Rank, RegistryError> {
        let target = RankTarget {
            worker: &spec.name,
            key: WorkerRank {
                worker: id,
                rank: endpoints.rank,
            },
            endpoints,
            topic: &spec.topic,
            block_size: spec.block_size,
        };
        let ingest = RankIngest::start(&self.zmq, target, self.index.clone(), self.ingest.clone())
            .map_err(|e| RegistryError::Start(e.to_string()))?;
        Ok(Rank {
            endpoints: endpoints.clone(),
            ingest,
        })
    }

    /// Registers a worker (or adds ranks to one registered with the same
    /// name, URL and block size) and starts ingesting its ranks. Registering
    /// the same worker twice is a no-op.
    pub fn register(&self, spec: WorkerSpec) -> Result<WorkerId, RegistryError> {
        self.check_addresses(&spec)?;
        let mut workers = self.lock();
        if let Some(existing) = workers.get_mut(&spec.name) {
            if existing.spec.url != spec.url || existing.spec.block_size != spec.block_size {
                return Err(RegistryError::NameTaken(spec.name));
            }
            for endpoints in &spec.ranks {
                match existing
                    .ranks
                    .iter()
                    .find(|r| r.endpoints.rank == endpoints.rank)
                {
                    Some(r) if r.endpoints == *endpoints => {}
                    Some(_) => {
                        return Err(RegistryError::RankTaken {
                            name: spec.name.clone(),
                            rank: endpoints.rank,
                        })
                    }
                    None => {
                        let rank = self.start_rank(existing.id, &existing.spec, endpoints)?;
                        existing.ranks.push(rank);
                        existing.spec.ranks.push(endpoints.clone());
                    }
                }
            }
            return Ok(existing.id);
        }
        let id = {
            let mut next = self.next_id.lock().unwrap_or_else(PoisonError::into_inner);
            let id = WorkerId(*next);
            *next += 1;
            id
        };
        let mut ranks = Vec::with_capacity(spec.ranks.len());
        for endpoints in &spec.ranks {
            ranks.push(self.start_rank(id, &spec, endpoints)?);
        }
        info!(worker = %spec.name, ranks = ranks.len(), "worker registered");
        workers.insert(
            spec.name.clone(),
            Worker {
                id,
                spec,
                ranks,
                registered_ms: now_ms(),
                cleared_unreachable: false,
            },
        );
        Ok(id)
    }

    /// Stops ingesting a worker and drops its blocks; false when unknown.
    pub fn unregister(&self, name: &str) -> bool {
        let removed = self.lock().remove(name);
        match removed {
            Some(mut worker) => {
                for rank in &mut worker.ranks {
                    rank.ingest.stop();
                }
                self.index.write().remove_worker(worker.id);
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
                down_since(&r.ingest.stats).is_some_and(|since| now.saturating_sub(since) > grace)
            });
            if all_down && !worker.cleared_unreachable {
                warn!(worker = %worker.spec.name, grace_ms = grace, "worker unreachable; dropping its blocks");
                let mut index = self.index.write();
                for rank in &worker.ranks {
                    index.clear_rank(WorkerRank {
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
        let stats = self.index.read().stats();
        let workers = self.lock();
        workers
            .values()
            .map(|w| WorkerView {
                name: w.spec.name.clone(),
                id: w.id,
                url: w.spec.url.clone(),
                model: w.spec.model.clone(),
                block_size: w.spec.block_size,
                flavor: w.spec.flavor,
                ranks: w
                    .ranks
                    .iter()
                    .map(|r| {
                        let key = WorkerRank {
                            worker: w.id,
                            rank: r.endpoints.rank,
                        };
                        let tiers = stats
                            .per_rank
                            .iter()
                            .find(|(k, _)| *k == key)
                            .map_or([0; 4], |(_, t)| *t);
                        rank_view(&r.endpoints, &r.ingest.stats, tiers)
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

    /// Stops every rank thread.
    pub fn shutdown(&self) {
        let mut workers = self.lock();
        for worker in workers.values_mut() {
            for rank in &mut worker.ranks {
                rank.ingest.stop();
            }
        }
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
    /// Tokens per KV block.
    pub block_size: u32,
    /// The engine flavour.
    #[serde(with = "super::spec::flavor_name")]
    pub flavor: WorkerFlavor,
    /// Its data-parallel ranks.
    pub ranks: Vec<RankView>,
}

/// One rank of a worker, as [`Registry::view`] sees it.
#[derive(Debug, Clone, Serialize)]
pub struct RankView {
    /// The rank.
    pub dp_rank: u32,
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
    /// The stream's counters.
    #[serde(flatten)]
    pub counters: RankCounters,
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

fn rank_view(endpoints: &RankEndpoints, stats: &RankStats, tiers: [u64; 4]) -> RankView {
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
        counters: stats.counters(),
    }
}
