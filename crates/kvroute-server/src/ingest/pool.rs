//! The fixed set of ingest threads, and which rank each one serves.

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{mpsc, Arc, Mutex, PoisonError};
use std::thread::JoinHandle;
use std::time::Duration;

use kvroute_core::index::WorkerRank;
use mio::Waker;
use tracing::warn;

use super::rank::RankStream;
use super::reactor::{Command, Reactor};
use super::zmq_context::ZmqContext;

struct Thread {
    commands: mpsc::Sender<Command>,
    waker: Arc<Waker>,
    load: Arc<AtomicUsize>,
    handle: Option<JoinHandle<()>>,
}

/// Ingest threads, each running a [`Reactor`] over many ranks.
pub struct IngestPool {
    threads: Mutex<Vec<Thread>>,
}

impl std::fmt::Debug for IngestPool {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("IngestPool").finish_non_exhaustive()
    }
}

/// Why the pool could not start.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("cannot start ingest threads: {0}")]
pub struct PoolError(String);

impl IngestPool {
    /// Starts `threads` ingest threads sharing one ZeroMQ context of at most
    /// `max_sockets` sockets; each rank queues at most `queue` live batches.
    pub fn start(threads: usize, max_sockets: usize, queue: i32) -> Result<Self, PoolError> {
        let context = ZmqContext::new(max_sockets).map_err(|e| PoolError(e.to_string()))?;
        let mut started = Vec::new();
        for thread_no in 0..threads.max(1) {
            let (commands, receiver) = mpsc::channel();
            let load = Arc::new(AtomicUsize::new(0));
            let (reactor, waker) =
                Reactor::new(context.clone(), receiver, load.clone(), thread_no, queue)
                    .map_err(|e| PoolError(e.to_string()))?;
            let handle = std::thread::Builder::new()
                .name(format!("ingest-{thread_no}"))
                .spawn(move || reactor.run())
                .map_err(|e| PoolError(e.to_string()))?;
            started.push(Thread {
                commands,
                waker,
                load,
                handle: Some(handle),
            });
        }
        Ok(IngestPool {
            threads: Mutex::new(started),
        })
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, Vec<Thread>> {
        self.threads.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// Hands a rank to the least loaded thread; returns that thread's number.
    pub fn add(&self, stream: RankStream) -> usize {
        let threads = self.lock();
        let Some((n, thread)) = threads
            .iter()
            .enumerate()
            .min_by_key(|(_, t)| t.load.load(Ordering::Relaxed))
        else {
            return 0;
        };
        // Counted now, so a burst of registrations spreads before threads catch up.
        thread.load.fetch_add(1, Ordering::Relaxed);
        if thread.commands.send(Command::Add(Box::new(stream))).is_ok() {
            let _ = thread.waker.wake();
        }
        thread.load.fetch_sub(1, Ordering::Relaxed);
        n
    }

    /// Stops following a rank, waiting (briefly) until its thread let go, so
    /// nothing of it reaches the index afterwards.
    pub fn remove(&self, thread: usize, key: WorkerRank) {
        let (done, wait) = mpsc::channel();
        {
            let threads = self.lock();
            let Some(t) = threads.get(thread) else {
                return;
            };
            if t.commands.send(Command::Remove(key, done)).is_err() {
                return;
            }
            let _ = t.waker.wake();
        }
        // The thread drops `done` once the rank is gone.
        if let Err(mpsc::RecvTimeoutError::Timeout) = wait.recv_timeout(Duration::from_secs(5)) {
            warn!(rank = %key.rank, "ingest thread slow to drop a rank");
        }
    }

    /// Stops every thread.
    pub fn shutdown(&self) {
        let mut threads = self.lock();
        for t in threads.iter() {
            let _ = t.commands.send(Command::Shutdown);
            let _ = t.waker.wake();
        }
        for t in threads.iter_mut() {
            if let Some(handle) = t.handle.take() {
                let _ = handle.join();
            }
        }
    }
}

impl Drop for IngestPool {
    fn drop(&mut self) {
        self.shutdown();
    }
}
