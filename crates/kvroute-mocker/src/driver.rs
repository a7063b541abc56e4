//! The task that owns one rank's [`Engine`] and gives it real time.
//!
//! One tokio task per rank: it steps the engine, sleeps for each step's
//! simulated duration (paced against a running target, so steps shorter than
//! the timer resolution still add up correctly), then publishes the step's
//! events and hands each request its tokens. HTTP handlers reach it through a
//! cloneable [`RankHandle`] and a bounded command channel; commands that arrive
//! during a step are applied at once and take effect from the next step.
//!
//! The driver also owns the leases of blocks held for remote decodes
//! ([`Handoff::hold`]): a finished prefill leg's blocks are released when
//! its decode reads them ([`RankHandle::release_held`]), when the lease ends,
//! or early when more than [`MAX_HELD_REQUESTS`] requests hold blocks.

use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use rustc_hash::FxHashMap;
use tokio::sync::{mpsc, oneshot, watch};
use tokio::time::{sleep_until, Instant};

use crate::config::TsSource;
use crate::engine::{
    validate_request, Engine, EngineStats, Handoff, NewRequest, RequestId, RequestOutput,
    SubmitError, Update,
};
use crate::event::KvCacheEvent;
use crate::lease::LeaseTable;
use crate::publisher::{PublisherHandle, PublisherStats};

/// Commands a rank accepts before the HTTP side waits (then it waits).
const COMMAND_QUEUE: usize = 1024;

/// Most finished requests one rank holds blocks for at once; past it the
/// oldest hold is released early (held blocks are bounded by the cache
/// anyway; this bounds the bookkeeping).
pub const MAX_HELD_REQUESTS: usize = 4096;

enum Command {
    Submit {
        id: RequestId,
        request: NewRequest,
        handoff: Handoff,
        updates: mpsc::UnboundedSender<Update>,
    },
    /// The block ids a finished request holds.
    Held {
        id: RequestId,
        reply: oneshot::Sender<Option<Vec<u32>>>,
    },
    /// Releases a finished request's held blocks; answers how many.
    Release {
        id: RequestId,
        reply: oneshot::Sender<Option<usize>>,
    },
    Reset(oneshot::Sender<()>),
    /// A read-only cache query: cached prefix tokens of a prompt.
    CacheMatch {
        request: NewRequest,
        reply: oneshot::Sender<usize>,
    },
}

/// Why a rank did not take a request.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum RankError {
    /// The request is invalid for this engine (HTTP 400).
    #[error(transparent)]
    Invalid(#[from] SubmitError),
    /// The engine is shutting down (HTTP 503).
    #[error("the engine is shutting down")]
    Stopped,
}

/// A cloneable handle to one rank's driver.
#[derive(Debug, Clone)]
pub struct RankHandle {
    rank: u32,
    tx: mpsc::Sender<Command>,
    stats: Arc<Mutex<EngineStats>>,
    publisher_stats: Arc<PublisherStats>,
    in_flight: Arc<AtomicUsize>,
    next_id: Arc<AtomicU64>,
    capacity_tokens: usize,
}

impl std::fmt::Debug for Command {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Command::Submit { id, .. } => write!(f, "Submit({})", id.0),
            Command::Reset(_) => f.write_str("Reset"),
            Command::CacheMatch { .. } => f.write_str("CacheMatch"),
            Command::Held { id, .. } => write!(f, "Held({})", id.0),
            Command::Release { id, .. } => write!(f, "Release({})", id.0),
        }
    }
}

impl RankHandle {
    /// The data-parallel rank.
    pub fn rank(&self) -> u32 {
        self.rank
    }

    /// Requests submitted and not yet finished (for least-loaded rank choice).
    pub fn in_flight(&self) -> usize {
        self.in_flight.load(Ordering::Relaxed)
    }

    /// The engine's counters after its last step.
    pub fn stats(&self) -> EngineStats {
        match self.stats.lock() {
            Ok(s) => *s,
            Err(poisoned) => *poisoned.into_inner(),
        }
    }

    /// The publisher's counters.
    pub fn publisher_stats(&self) -> &PublisherStats {
        &self.publisher_stats
    }

    /// KV capacity in tokens.
    pub fn capacity_tokens(&self) -> usize {
        self.capacity_tokens
    }

    /// Queues a request; its updates arrive on the returned channel, ending
    /// with `Finished` or `Failed` (or the channel closing on shutdown).
    pub async fn submit(
        &self,
        request: NewRequest,
    ) -> Result<mpsc::UnboundedReceiver<Update>, RankError> {
        Ok(self.submit_with(request, Handoff::default()).await?.1)
    }

    /// Queues a request whose KV crosses engines as `handoff` says; returns
    /// its id (for [`RankHandle::held_blocks`] and [`RankHandle::release_held`])
    /// and its updates.
    pub async fn submit_with(
        &self,
        request: NewRequest,
        handoff: Handoff,
    ) -> Result<(RequestId, mpsc::UnboundedReceiver<Update>), RankError> {
        validate_request(&request, self.capacity_tokens)?;
        let id = RequestId(self.next_id.fetch_add(1, Ordering::Relaxed));
        let (updates, rx) = mpsc::unbounded_channel();
        self.in_flight.fetch_add(1, Ordering::Relaxed);
        let sent = self
            .tx
            .send(Command::Submit {
                id,
                request,
                handoff,
                updates,
            })
            .await;
        if sent.is_err() {
            self.in_flight.fetch_sub(1, Ordering::Relaxed);
            return Err(RankError::Stopped);
        }
        Ok((id, rx))
    }

    /// The block ids finished request `id` holds for a remote decode, in
    /// prompt order; `None` once released (or when it never held any).
    pub async fn held_blocks(&self, id: RequestId) -> Result<Option<Vec<u32>>, RankError> {
        let (reply, answer) = oneshot::channel();
        self.tx
            .send(Command::Held { id, reply })
            .await
            .map_err(|_| RankError::Stopped)?;
        answer.await.map_err(|_| RankError::Stopped)
    }

    /// Releases the blocks `id` holds (its decode read them); how many, or
    /// `None` when it held none (released already, lease ended, restarted).
    pub async fn release_held(&self, id: RequestId) -> Result<Option<usize>, RankError> {
        let (reply, answer) = oneshot::channel();
        self.tx
            .send(Command::Release { id, reply })
            .await
            .map_err(|_| RankError::Stopped)?;
        answer.await.map_err(|_| RankError::Stopped)
    }

    /// Prompt tokens of `request` this rank's cache holds now (see
    /// [`Engine::cached_prefix_tokens`]); read-only, answered between steps
    /// and while a step's simulated time elapses.
    pub async fn cached_prefix_tokens(&self, request: NewRequest) -> Result<usize, RankError> {
        let (reply, answer) = oneshot::channel();
        self.tx
            .send(Command::CacheMatch { request, reply })
            .await
            .map_err(|_| RankError::Stopped)?;
        answer.await.map_err(|_| RankError::Stopped)
    }

    /// Clears the prefix cache (`AllBlocksCleared` goes out with the next batch).
    pub async fn reset_prefix_cache(&self) -> Result<(), RankError> {
        let (ack, done) = oneshot::channel();
        self.tx
            .send(Command::Reset(ack))
            .await
            .map_err(|_| RankError::Stopped)?;
        done.await.map_err(|_| RankError::Stopped)
    }
}

/// Where batch timestamps come from, restarts, and hold leases.
#[derive(Debug, Clone, Copy)]
pub struct DriverOptions {
    /// Batch timestamps.
    pub ts_source: TsSource,
    /// `--restart-every-secs`.
    pub restart_every: Option<Duration>,
    /// How long finished requests may hold blocks for a remote decode (`--kv-lease-secs`).
    pub hold_lease: Duration,
}

/// Starts the driver task of one rank; it returns the publisher when it stops.
pub fn spawn(
    rank: u32,
    engine: Engine,
    publisher: PublisherHandle,
    options: DriverOptions,
    shutdown: watch::Receiver<bool>,
) -> (RankHandle, tokio::task::JoinHandle<PublisherHandle>) {
    let (tx, rx) = mpsc::channel(COMMAND_QUEUE);
    let handle = RankHandle {
        rank,
        tx,
        stats: Arc::new(Mutex::new(engine.stats())),
        publisher_stats: publisher.stats().clone(),
        in_flight: Arc::new(AtomicUsize::new(0)),
        next_id: Arc::new(AtomicU64::new(1)),
        capacity_tokens: engine.capacity_tokens(),
    };
    let driver = Driver {
        engine,
        rx,
        publisher,
        requests: FxHashMap::default(),
        stats: handle.stats.clone(),
        in_flight: handle.in_flight.clone(),
        holds: LeaseTable::new(MAX_HELD_REQUESTS, options.hold_lease),
        options,
        target: Instant::now(),
        next_restart: options.restart_every.map(|every| Instant::now() + every),
        shutdown,
    };
    (handle, tokio::spawn(driver.run()))
}

struct Driver {
    engine: Engine,
    rx: mpsc::Receiver<Command>,
    publisher: PublisherHandle,
    requests: FxHashMap<RequestId, mpsc::UnboundedSender<Update>>,
    stats: Arc<Mutex<EngineStats>>,
    in_flight: Arc<AtomicUsize>,
    options: DriverOptions,
    /// Finished requests holding blocks, by lease.
    holds: LeaseTable<RequestId, ()>,
    /// When the simulated work done so far is due in real time.
    target: Instant,
    next_restart: Option<Instant>,
    shutdown: watch::Receiver<bool>,
}

impl Driver {
    async fn run(mut self) -> PublisherHandle {
        while !*self.shutdown.borrow() {
            self.maybe_restart();
            self.expire_holds();
            while let Ok(cmd) = self.rx.try_recv() {
                self.handle(cmd);
            }
            match self.engine.step() {
                Some(step) => {
                    let now = Instant::now();
                    self.target = self.target.max(now) + step.duration;
                    if self.target > now {
                        if !self.wait_until(self.target).await {
                            break;
                        }
                    } else {
                        tokio::task::yield_now().await;
                    }
                    self.publish(step.events);
                    // Stats first: a client that got its last token sees them updated.
                    self.store_stats();
                    self.dispatch(step.outputs);
                }
                None => {
                    self.store_stats();
                    let restart = self.next_restart;
                    let lease_end = self.holds.next_expiry().map(Instant::from_std);
                    tokio::select! {
                        changed = self.shutdown.changed() => if changed.is_err() {
                            // The fleet is gone without saying so.
                            break;
                        },
                        cmd = self.rx.recv() => match cmd {
                            Some(cmd) => self.handle(cmd),
                            None => break,
                        },
                        _ = sleep_until_opt(restart) => {}
                        _ = sleep_until_opt(lease_end) => {}
                    }
                }
            }
        }
        self.publisher
    }

    /// Sleeps until `deadline` while applying commands; false on shutdown.
    async fn wait_until(&mut self, deadline: Instant) -> bool {
        loop {
            tokio::select! {
                biased;
                _ = self.shutdown.changed() => return false,
                _ = sleep_until(deadline) => return true,
                cmd = self.rx.recv() => match cmd {
                    Some(cmd) => self.handle(cmd),
                    None => return false,
                },
            }
        }
    }

    fn handle(&mut self, cmd: Command) {
        match cmd {
            Command::Submit {
                id,
                request,
                handoff,
                updates,
            } => match self.engine.submit_with(id, request, handoff) {
                Ok(()) => {
                    self.requests.insert(id, updates);
                }
                Err(e) => {
                    // Validated by the handle already; kept for safety.
                    let _ = updates.send(Update::Failed(e.to_string()));
                    self.in_flight.fetch_sub(1, Ordering::Relaxed);
                }
            },
            Command::Reset(ack) => {
                self.engine.reset_prefix_cache();
                let _ = ack.send(());
            }
            Command::CacheMatch { request, reply } => {
                let _ = reply.send(self.engine.cached_prefix_tokens(&request));
            }
            Command::Held { id, reply } => {
                let _ = reply.send(self.engine.held_blocks(id).map(<[u32]>::to_vec));
            }
            Command::Release { id, reply } => {
                self.holds.remove(&id);
                let _ = reply.send(self.engine.release_held(id));
                self.store_stats();
            }
        }
    }

    /// Releases the holds whose lease ended.
    fn expire_holds(&mut self) {
        let expired = self.holds.purge(std::time::Instant::now());
        if expired.is_empty() {
            return;
        }
        for (id, ()) in expired {
            if let Some(blocks) = self.engine.release_held(id) {
                tracing::info!(
                    request = id.0,
                    blocks,
                    "held blocks released: lease ended unread"
                );
            }
        }
        self.store_stats();
    }

    /// Starts the lease of a request that finished holding blocks.
    fn lease_hold(&mut self, id: RequestId) {
        let evicted = self.holds.insert(id, (), std::time::Instant::now());
        if let Some((old, ())) = evicted {
            if let Some(blocks) = self.engine.release_held(old) {
                tracing::warn!(
                    request = old.0,
                    blocks,
                    "held blocks released early: more than {MAX_HELD_REQUESTS} holds"
                );
            }
        }
    }

    fn maybe_restart(&mut self) {
        let (Some(at), Some(every)) = (self.next_restart, self.options.restart_every) else {
            return;
        };
        let now = Instant::now();
        if now < at {
            return;
        }
        self.next_restart = Some(now + every);
        let failed = self.engine.restart();
        self.holds.clear();
        tracing::info!(failed = failed.len(), "simulated engine restart");
        for id in failed {
            if let Some(tx) = self.requests.remove(&id) {
                let _ = tx.send(Update::Failed("engine restarted".into()));
                self.in_flight.fetch_sub(1, Ordering::Relaxed);
            }
        }
        self.publisher.restart();
        self.store_stats();
    }

    fn publish(&self, events: Vec<KvCacheEvent>) {
        if events.is_empty() {
            return;
        }
        let ts = match self.options.ts_source {
            TsSource::Wall => SystemTime::now()
                .duration_since(UNIX_EPOCH)
                .map(|d| d.as_secs_f64())
                .unwrap_or(0.0),
            TsSource::Simulated { start } => start + self.engine.stats().elapsed.as_secs_f64(),
        };
        self.publisher.publish(ts, events);
    }

    fn dispatch(&mut self, outputs: Vec<RequestOutput>) {
        for RequestOutput { id, update } in outputs {
            let last = !matches!(update, Update::Token(_));
            if matches!(update, Update::Finished(_)) && self.engine.held_blocks(id).is_some() {
                self.lease_hold(id);
            }
            let Some(tx) = self.requests.get(&id) else {
                continue;
            };
            let delivered = tx.send(update).is_ok();
            if !delivered {
                // The client went away: free the request's blocks now.
                self.engine.abort(id);
            }
            if last || !delivered {
                self.requests.remove(&id);
                self.in_flight.fetch_sub(1, Ordering::Relaxed);
            }
        }
    }

    fn store_stats(&self) {
        let stats = self.engine.stats();
        match self.stats.lock() {
            Ok(mut s) => *s = stats,
            Err(poisoned) => *poisoned.into_inner() = stats,
        }
    }
}

async fn sleep_until_opt(at: Option<Instant>) {
    match at {
        Some(at) => sleep_until(at).await,
        None => std::future::pending().await,
    }
}
