//! The hot path's side of the sync: routed requests hand their admission,
//! prefill and release here and return at once; the publisher drains the
//! outbox in batches. Bounded: when NATS is slow or down, the overflow is
//! dropped and the whole state is sent again instead.
//!
//! A request never wakes the publisher while it is busy: under load the
//! publisher polls every batch window on its own thread, and only once it
//! has gone to sleep after a quiet spell does the next event unpark it
//! (one futex call, on the first event of a burst).

use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Mutex, OnceLock, PoisonError};
use std::thread::Thread;
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use prometheus_client::metrics::histogram::Histogram;

use super::delays::{Reservoir, Summary};
use super::message::{Admission, Event, RequestRef};

/// Events held at most between two publishes.
const CAPACITY: usize = 65_536;

/// Microseconds since the Unix epoch.
pub fn unix_us() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| d.as_micros() as u64)
}

/// Queues `item` for peers unless `queue` already holds `max` (the bus is
/// behind): then it is counted in `dropped` and let go, so a slow bus never
/// grows a replica's memory. Whether it was queued.
pub fn push_bounded<T>(queue: &Mutex<Vec<T>>, item: T, max: usize, dropped: &AtomicU64) -> bool {
    let mut pending = queue.lock().unwrap_or_else(PoisonError::into_inner);
    if pending.len() >= max {
        dropped.fetch_add(1, Ordering::Relaxed);
        return false;
    }
    pending.push(item);
    true
}

/// An id for one sharer of notes on the bus (a pin or speed share): notes
/// carrying it are its own and skipped. Unique within the process even for
/// two made in the same microsecond (a counter in the top byte), and
/// unlikely to repeat across processes (the clock and the process id).
pub fn sender_id() -> u64 {
    static MADE: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(0);
    let made = MADE.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
    unix_us() ^ u64::from(std::process::id()).rotate_left(32) ^ (made << 56)
}

#[derive(Debug, Default)]
struct Pending {
    events: Vec<Event>,
    /// Events were dropped: peers need the whole state again.
    overflowed: bool,
}

/// Events waiting to be published.
#[derive(Debug)]
pub struct Outbox {
    pending: Mutex<Pending>,
    /// The publisher's thread, unparked when it sleeps and there is work.
    publisher: OnceLock<Thread>,
    sleeping: AtomicBool,
    connected: AtomicBool,
    dropped: AtomicU64,
    cost: Histogram,
    costs: Mutex<Reservoir>,
}

impl Default for Outbox {
    fn default() -> Self {
        Outbox {
            pending: Mutex::default(),
            publisher: OnceLock::new(),
            sleeping: AtomicBool::new(false),
            connected: AtomicBool::new(false),
            dropped: AtomicU64::new(0),
            cost: Histogram::new([1e-6, 2e-6, 5e-6, 10e-6, 20e-6, 50e-6, 100e-6, 1e-3]),
            costs: Mutex::new(Reservoir::new(16_384)),
        }
    }
}

impl Outbox {
    fn push(&self, event: Event) {
        let started = Instant::now();
        {
            let mut p = self.pending.lock().unwrap_or_else(PoisonError::into_inner);
            if p.events.len() >= CAPACITY || !self.connected.load(Ordering::Relaxed) {
                p.overflowed = true;
                self.dropped.fetch_add(1, Ordering::Relaxed);
            } else {
                p.events.push(event);
            }
        }
        if self.sleeping.load(Ordering::SeqCst) {
            self.wake();
        }
        let cost = started.elapsed();
        self.cost.observe(cost.as_secs_f64());
        if let Ok(mut costs) = self.costs.try_lock() {
            costs.record(cost.as_micros() as u64);
        }
    }

    /// A request was routed to `at`'s rank with these blocks and uncached tokens.
    pub fn admitted(&self, at: RequestRef, blocks: Vec<u64>, prefill_tokens: u64, ttl_ms: u64) {
        self.push(Event::Admit(Admission {
            at,
            prefill_tokens,
            prefilling: true,
            blocks,
            ttl_ms,
            admitted_us: unix_us(),
        }));
    }

    /// The request's first token came back.
    pub fn prefilled(&self, at: RequestRef) {
        self.push(Event::Prefilled(at));
    }

    /// The request ended.
    pub fn released(&self, at: RequestRef) {
        self.push(Event::Release(at));
    }

    fn wake(&self) {
        if let Some(publisher) = self.publisher.get() {
            publisher.unpark();
        }
    }

    /// Makes the calling thread the publisher (the one [`Outbox::sleep`] parks).
    pub(super) fn attach_publisher(&self) {
        let _ = self.publisher.set(std::thread::current());
    }

    /// The publisher sleeps at most `max`, or until an event comes (at
    /// once if one is pending).
    pub(super) fn sleep(&self, max: Duration) {
        self.sleeping.store(true, Ordering::SeqCst);
        let empty = self
            .pending
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .events
            .is_empty();
        if empty {
            std::thread::park_timeout(max);
        }
        self.sleeping.store(false, Ordering::SeqCst);
    }

    /// Takes what is pending, and whether some was dropped since the last take.
    pub(super) fn take(&self) -> (Vec<Event>, bool) {
        let mut p = self.pending.lock().unwrap_or_else(PoisonError::into_inner);
        let overflowed = std::mem::take(&mut p.overflowed);
        (std::mem::take(&mut p.events), overflowed)
    }

    /// Wakes the publisher with nothing new pending (a resync to send).
    pub(super) fn nudge(&self) {
        self.wake();
    }

    /// Whether the NATS connection is up (events are dropped while it is not).
    pub(super) fn set_connected(&self, up: bool) {
        self.connected.store(up, Ordering::Relaxed);
        if up {
            self.wake();
        }
    }

    /// Whether the NATS connection is up.
    pub fn connected(&self) -> bool {
        self.connected.load(Ordering::Relaxed)
    }

    /// Events dropped (NATS down or too slow).
    pub fn dropped(&self) -> u64 {
        self.dropped.load(Ordering::Relaxed)
    }

    /// What handing an event over costs the request.
    pub fn cost_histogram(&self) -> &Histogram {
        &self.cost
    }

    /// Percentiles of that cost over the last samples.
    pub fn cost_summary(&self) -> Option<Summary> {
        self.costs
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .summary()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use kvroute_core::index::DpRank;

    #[test]
    fn sender_ids_made_in_one_microsecond_differ() {
        let ids: std::collections::HashSet<u64> = (0..200).map(|_| sender_id()).collect();
        assert_eq!(ids.len(), 200);
    }

    fn at(id: u64) -> RequestRef {
        RequestRef {
            id,
            worker: "w".into(),
            rank: DpRank(0),
        }
    }

    #[test]
    fn events_wait_while_connected_and_are_dropped_while_not() {
        let outbox = Outbox::default();
        outbox.released(at(1));
        assert_eq!(
            outbox.take(),
            (Vec::new(), true),
            "down: dropped, state to resend"
        );
        outbox.set_connected(true);
        outbox.admitted(at(2), vec![1, 2], 32, 1000);
        outbox.prefilled(at(2));
        let (events, overflowed) = outbox.take();
        assert_eq!((events.len(), overflowed), (2, false));
        assert!(matches!(&events[0], Event::Admit(a) if a.blocks == [1, 2] && a.admitted_us > 0));
        assert_eq!(outbox.dropped(), 1);
        assert_eq!(outbox.cost_summary().map(|s| s.count), Some(3));
    }
}
