//! The bounded overload queue: where a request waits while every rank it
//! could go to is over its busy thresholds (`--queue-capacity`,
//! `--queue-timeout-ms`), and in what order the waiting requests take a rank
//! that frees up.
//!
//! Order: by priority (`x-priority`, lower first, as vLLM's `priority`
//! field; 0 by default), then by arrival. A queued request tries for a
//! rank only while no request ahead of it waits, so a freed rank goes to
//! the most urgent request, not to whichever woke first. A request that
//! leaves the queue (placed, timed out, or dropped by its client) wakes the
//! others.

use std::collections::BTreeSet;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Mutex, PoisonError};
use std::time::Duration;

use super::Proxy;
use crate::api::ProxyError;

/// A place in the waiting order: (priority, arrival).
type Ticket = (i64, u64);

/// The requests waiting in the queue, in the order they take ranks.
#[derive(Debug, Default)]
pub struct Waiting {
    tickets: Mutex<BTreeSet<Ticket>>,
    arrivals: AtomicU64,
}

impl Waiting {
    fn enter(&self, priority: i64) -> Ticket {
        let ticket = (priority, self.arrivals.fetch_add(1, Ordering::Relaxed));
        self.lock().insert(ticket);
        ticket
    }

    fn leave(&self, ticket: Ticket) {
        self.lock().remove(&ticket);
    }

    fn is_first(&self, ticket: Ticket) -> bool {
        self.lock().first() == Some(&ticket)
    }

    /// Requests waiting now.
    pub fn len(&self) -> usize {
        self.lock().len()
    }

    /// Whether none is.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, BTreeSet<Ticket>> {
        self.tickets.lock().unwrap_or_else(PoisonError::into_inner)
    }
}

/// A request's wait in the queue, for as long as `--queue-timeout-ms`
/// allows; leaving it (dropping it) gives its turn to the next.
pub(super) struct QueueWait<'a> {
    proxy: &'a Proxy,
    priority: i64,
    until: tokio::time::Instant,
    place: Option<tokio::sync::SemaphorePermit<'a>>,
    ticket: Option<Ticket>,
}

impl<'a> QueueWait<'a> {
    /// A wait that has not started: no place in the queue taken yet.
    pub(super) fn new(proxy: &'a Proxy, priority: i64) -> Self {
        QueueWait {
            proxy,
            priority,
            until: tokio::time::Instant::now() + proxy.config().queue_timeout,
            place: None,
            ticket: None,
        }
    }

    /// Whether the request may try for a rank now: before it queued, or
    /// once it is first in the waiting order.
    pub(super) fn may_try(&self) -> bool {
        self.ticket
            .is_none_or(|ticket| self.proxy.waiting.is_first(ticket))
    }

    /// After a placement found all `ranks` busy (or while others are ahead
    /// of it): takes a place in the queue (once), then waits until load
    /// drops or the order moves, for the caller to try again; the 503 when
    /// the queue is full or off, or the wait is over.
    pub(super) async fn busy(&mut self, ranks: usize) -> Result<(), ProxyError> {
        let proxy = self.proxy;
        if self.place.is_none() {
            self.place = proxy.queue.try_acquire().ok();
            if self.place.is_some() {
                proxy.metrics.queued.inc();
                self.ticket = Some(proxy.waiting.enter(self.priority));
            }
        }
        let queued = self.place.is_some();
        if !queued || tokio::time::Instant::now() >= self.until {
            return Err(overloaded(proxy, ranks, queued));
        }
        // Woken when a prefill or a request ends, or a request leaves the
        // queue; re-checked at least every 100 ms in case a wake-up came
        // between scoring and waiting.
        let recheck = (tokio::time::Instant::now() + Duration::from_millis(100)).min(self.until);
        let _ = tokio::time::timeout_at(recheck, proxy.load_dropped.notified()).await;
        Ok(())
    }
}

impl Drop for QueueWait<'_> {
    fn drop(&mut self) {
        if let Some(ticket) = self.ticket.take() {
            self.proxy.waiting.leave(ticket);
            self.proxy.load_dropped.notify_waiters();
        }
    }
}

/// The 503 for a request no rank can take (`queued`: after its wait in the queue).
fn overloaded(proxy: &Proxy, ranks: usize, queued: bool) -> ProxyError {
    let config = proxy.config();
    let wait = if queued {
        format!(
            " after {} ms in the queue",
            config.queue_timeout.as_millis()
        )
    } else if config.queue_capacity > 0 {
        " and the queue is full".to_owned()
    } else {
        String::new()
    };
    let message = format!(
        "all {ranks} worker rank(s) are over their busy thresholds (prefill tokens {:?}, decode blocks {:?}, requests {:?}){wait}; retry later",
        config.busy.prefill_tokens, config.busy.decode_blocks, config.busy.requests,
    );
    if queued {
        ProxyError::QueueTimeout(message)
    } else {
        ProxyError::Overloaded(message)
    }
}
