//! The bounded overload queue: where a request waits while every rank it
//! could go to is over its busy thresholds (`--queue-capacity`,
//! `--queue-timeout-ms`), in what order the waiting requests take a rank
//! that frees up, and whom a full queue refuses.
//!
//! Order: by priority (`x-priority`, lower first, as vLLM's `priority`
//! field; 0 by default), then by weighted fair queueing among the tenants
//! ([`super::tenants`]) waiting at that priority, then by arrival
//! (`kvroute_core::scheduler::fair`, which also holds the proofs). A
//! request tries for a rank only while no request ahead of it waits: a
//! newcomer goes straight to the ranks only when nothing waits, and a
//! queued one once it is first. So a freed rank goes to the most urgent
//! request of the tenant furthest below its share, not to whichever woke
//! or arrived first. Only the first waits for load to drop; each other
//! request sleeps until it becomes first (rung by whichever request left or
//! arrived to make it so) or is refused, so a freed rank wakes one task,
//! not the whole queue.
//!
//! Tenants the flags do not name are told apart only up to
//! `--queue-max-tenants` at once: a newcomer of another such tenant waits
//! as `other`, one turn they share (`FairQueue::queue_as`), so names made
//! up per request cannot each take a turn before a named tenant's.
//!
//! A full queue answers 429 (`rate_limited`, with `retry-after`) to a
//! request of the tenant with the most requests waiting for its weight: the
//! newcomer, or that tenant's request that would be served last, which
//! leaves the queue so that the newcomer takes its place. A tenant may fill
//! the places others leave empty, and gives them back as others arrive: no
//! place stands empty while a request is refused.

use std::collections::{HashMap, HashSet};
use std::pin::Pin;
use std::sync::{Arc, Mutex, PoisonError};
use std::time::Duration;

use kvroute_core::scheduler::fair::{Admission, FairQueue, Place};
use tokio::sync::futures::Notified;

use super::intake::RoutedRequest;
use super::tenants::{TenantConfig, Tenants};
use super::Router;
use crate::api::ProxyError;
use crate::metrics::tenants::OTHER_TENANT;
use crate::metrics::tenants::{PriorityClass, TenantLabel};

/// The requests waiting in the queue, in the order they take ranks.
#[derive(Debug)]
pub struct Waiting {
    state: Mutex<State>,
    capacity: usize,
    tenants: Tenants,
}

/// The queue under its lock.
#[derive(Debug, Default)]
struct State {
    queue: FairQueue<Arc<str>>,
    /// Places refused to make room for another tenant's request, until
    /// their requests see it and answer 429; at most the queue's capacity.
    evicted: HashSet<Place>,
    /// Each waiting request's bell: rung when it becomes first or is refused.
    bells: HashMap<Place, Arc<tokio::sync::Notify>>,
    /// The first place when a bell was last rung for it.
    rung: Option<Place>,
}

impl State {
    /// Rings the first request's bell if it changed since the last ring.
    fn ring_first(&mut self) {
        let first = self.queue.first();
        if first != self.rung {
            self.rung = first;
            if let Some(bell) = first.and_then(|p| self.bells.get(&p)) {
                bell.notify_one();
            }
        }
    }
}

impl Waiting {
    /// An empty queue of `capacity` places shared among `tenants`.
    pub fn new(capacity: usize, tenants: &TenantConfig) -> Self {
        Waiting {
            state: Mutex::default(),
            capacity,
            tenants: Tenants::new(tenants),
        }
    }

    /// Requests waiting now.
    pub fn len(&self) -> usize {
        self.lock().queue.len()
    }

    /// Whether none is.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// The tenants' weights, labels, keys and priorities.
    pub fn tenants(&self) -> &Tenants {
        &self.tenants
    }

    fn is_first(&self, place: Place) -> bool {
        self.lock().queue.first() == Some(place)
    }

    /// Whether `place` was refused to make room, forgetting it.
    fn take_evicted(&self, place: Place) -> bool {
        self.lock().evicted.remove(&place)
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, State> {
        self.state.lock().unwrap_or_else(PoisonError::into_inner)
    }
}

/// A request's wait in the queue, for as long as `--queue-timeout-ms`
/// allows; leaving it (dropping it) gives its turn to the next.
pub(super) struct QueueWait<'a> {
    router: &'a Router,
    tenant: Arc<str>,
    label: TenantLabel,
    weight: f64,
    priority: i64,
    /// Its prompt tokens (the cost fair queueing charges its tenant).
    cost: u64,
    until: tokio::time::Instant,
    /// Its place and when it took it, once queued.
    place: Option<(Place, tokio::time::Instant)>,
    /// Rung when it becomes first or is refused.
    bell: Arc<tokio::sync::Notify>,
    /// Listening for load to drop since before its last try, so that a
    /// rank freed while it was being scored still wakes it.
    armed: Option<Pin<Box<Notified<'a>>>>,
    /// It left the queue without a rank: timed out or refused.
    refused: bool,
}

impl<'a> QueueWait<'a> {
    /// A wait that has not started for `req`: no place in the queue taken
    /// yet; counts the request under its tenant.
    pub(super) fn new(router: &'a Router, req: &RoutedRequest) -> Self {
        let tenants = &router.waiting.tenants;
        let tenant: Arc<str> = Arc::from(req.tenant.as_str());
        let label = tenants.label(&tenant).clone();
        router.metrics.tenants.requests.get_or_create(&label).inc();
        QueueWait {
            router,
            weight: tenants.weight(&tenant),
            tenant,
            label,
            priority: req.priority,
            cost: super::sessions::history_tokens(&req.body).max(1),
            until: tokio::time::Instant::now() + router.config().queue_timeout,
            place: None,
            bell: Arc::default(),
            armed: None,
            refused: false,
        }
    }

    /// Whether the request may try for a rank now: when nothing waits
    /// before it queued, or once it is first in the waiting order. When it
    /// may, it listens for load to drop from now on (see [`Self::busy`]).
    pub(super) fn may_try(&mut self) -> bool {
        let may = self.is_first();
        if may {
            let mut listen = Box::pin(self.router.load_dropped.notified());
            listen.as_mut().enable();
            self.armed = Some(listen);
        }
        may
    }

    fn is_first(&self) -> bool {
        match self.place {
            None => self.router.waiting.is_empty(),
            Some((place, _)) => self.router.waiting.is_first(place),
        }
    }

    /// After a placement found all `ranks` busy (or while others are ahead
    /// of it): takes a place in the queue (once), then waits until load
    /// drops or the order moves, for the caller to try again; the 503 when
    /// the queue is off or the wait is over, the 429 when a full queue
    /// refuses it (see the module docs).
    pub(super) async fn busy(&mut self, ranks: usize) -> Result<(), ProxyError> {
        let router = self.router;
        match self.place {
            None => {
                let place = self.enter(ranks)?;
                if router.waiting.is_first(place) {
                    return Ok(());
                }
            }
            Some((place, _)) if router.waiting.take_evicted(place) => {
                self.place = None;
                return Err(self.refuse(true));
            }
            Some(_) => {}
        }
        if tokio::time::Instant::now() >= self.until {
            self.refused = true;
            return Err(overloaded(router, ranks, true));
        }
        if self.is_first() {
            // First: woken when a prefill or a request ends since it was
            // last scored (or now, if it was not); re-checked at least every
            // 100 ms as a safety net.
            let recheck =
                (tokio::time::Instant::now() + Duration::from_millis(100)).min(self.until);
            let listen = match self.armed.take() {
                Some(listen) => listen,
                None => Box::pin(router.load_dropped.notified()),
            };
            let _ = tokio::time::timeout_at(recheck, listen).await;
        } else {
            // Behind others: woken by its bell (a ring while it was busy
            // is kept), and at least every second as a safety net.
            let recheck = (tokio::time::Instant::now() + Duration::from_secs(1)).min(self.until);
            let _ = tokio::time::timeout_at(recheck, self.bell.notified()).await;
        }
        Ok(())
    }

    /// Takes a place in the queue, perhaps in the room made by refusing
    /// another tenant's request (woken to answer); the 503 when the queue
    /// is off, the 429 when this request is the one refused.
    fn enter(&mut self, ranks: usize) -> Result<Place, ProxyError> {
        let router = self.router;
        if self.router.waiting.capacity == 0 {
            return Err(overloaded(router, ranks, false));
        }
        let admission = {
            let mut state = router.waiting.lock();
            self.pool_unless_told_apart(&state.queue);
            let admission = state.queue.admit(
                router.waiting.capacity,
                &self.tenant,
                self.weight,
                self.priority,
                self.cost,
            );
            match admission {
                Admission::Queued(place) => {
                    state.bells.insert(place, self.bell.clone());
                }
                Admission::Evicting(place, evicted) => {
                    state.bells.insert(place, self.bell.clone());
                    state.evicted.insert(evicted);
                    if let Some(bell) = state.bells.remove(&evicted) {
                        bell.notify_one();
                    }
                }
                Admission::Refused => {}
            }
            state.ring_first();
            admission
        };
        let place = match admission {
            Admission::Queued(place) | Admission::Evicting(place, _) => place,
            Admission::Refused => return Err(self.refuse(false)),
        };
        router.metrics.queued.inc();
        let tenants = &router.metrics.tenants;
        tenants.queued.get_or_create(&self.label).inc();
        tenants.waiting.get_or_create(&self.label).inc();
        self.place = Some((place, tokio::time::Instant::now()));
        Ok(place)
    }

    /// Waits as `other` when the queue already tells `--queue-max-tenants`
    /// tenants the flags do not name apart and this is another one.
    fn pool_unless_told_apart(&mut self, queue: &FairQueue<Arc<str>>) {
        let tenants = &self.router.waiting.tenants;
        let pool: Arc<str> = Arc::from(OTHER_TENANT);
        let waits_as = queue.queue_as(&self.tenant, tenants.max_tenants(), &pool, |k| {
            tenants.is_known(k)
        });
        if **waits_as != *self.tenant {
            self.tenant = pool;
            self.weight = tenants.weight(OTHER_TENANT);
            self.router.metrics.tenants.pooled.inc();
        }
    }

    /// The 429 for a request of the tenant most over its share of the full
    /// queue (`waited`: refused after queueing, to make room).
    fn refuse(&mut self, waited: bool) -> ProxyError {
        self.refused = true;
        let router = self.router;
        let tenants = &router.metrics.tenants;
        tenants.refused.get_or_create(&self.label).inc();
        if waited {
            tenants.waiting.get_or_create(&self.label).dec();
        }
        let when = if waited {
            "this request left the queue to make room for another tenant's"
        } else {
            "this request was not queued"
        };
        let pooled = if *self.tenant == *OTHER_TENANT {
            format!(
                " (where the tenants beyond the {} the queue tells apart wait as one)",
                router.waiting.tenants.max_tenants()
            )
        } else {
            String::new()
        };
        ProxyError::RateLimited(format!(
            "tenant `{}`{pooled} has the most requests waiting for its weight ({}) in the full \
             overload queue ({} places): {when}; retry later",
            self.tenant, self.weight, router.waiting.capacity,
        ))
    }
}

impl Drop for QueueWait<'_> {
    fn drop(&mut self) {
        let router = self.router;
        let class = PriorityClass::of(self.priority);
        let waited = self.place.map_or(0.0, |(_, at)| at.elapsed().as_secs_f64());
        let tenants = &router.metrics.tenants;
        tenants.queue_wait.get_or_create(&class).observe(waited);
        let Some((place, _)) = self.place.take() else {
            return;
        };
        tenants.waiting.get_or_create(&self.label).dec();
        let mut state = router.waiting.lock();
        // Refused to make room but placed meanwhile: nothing to answer.
        state.evicted.remove(&place);
        state.bells.remove(&place);
        state.queue.leave(place, !self.refused);
        state.ring_first();
    }
}

/// The 503 for a request no rank can take (`queued`: after its wait in the queue).
fn overloaded(router: &Router, ranks: usize, queued: bool) -> ProxyError {
    let config = router.config();
    let wait = if queued {
        format!(
            " after {} ms in the queue",
            config.queue_timeout.as_millis()
        )
    } else {
        String::new()
    };
    let all = match ranks {
        0 => "all worker ranks are".to_owned(),
        n => format!("all {n} worker rank(s) are"),
    };
    let message = format!(
        "{all} over their busy thresholds (prefill tokens {:?}, decode blocks {:?}, requests {:?}){wait}; retry later",
        config.busy.prefill_tokens, config.busy.decode_blocks, config.busy.requests,
    );
    if queued {
        ProxyError::QueueTimeout(message)
    } else {
        ProxyError::Overloaded(message)
    }
}
