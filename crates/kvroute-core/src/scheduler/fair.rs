//! Weighted fair queueing among tenants: the order in which the requests
//! waiting in the router's overload queue take a rank, and which of them a
//! full queue refuses.
//!
//! **Order.** Self-clocked fair queueing (Golestani, 1994), one virtual
//! clock per priority level. A request of tenant `t`, weight `w_t`, costing
//! `c` (its prompt tokens), arriving at a level whose virtual time is `v`,
//! gets the finish tag `F = max(v, F_t) + c / w_t`, where `F_t` is the tag
//! of `t`'s last request still waiting at that level. Requests are served
//! in the order (priority, finish tag, backlog, arrival): every lower
//! priority first, then the smallest tag; on equal tags, the request whose
//! tenant had fewer requests waiting when it came (a tenant that keeps no
//! backlog does not wait behind one that does), then arrival. Serving a
//! request moves its level's
//! virtual time up to its tag. While tenants `i` and `j` both keep
//! requests waiting, the cost served to each, divided by its weight, stays
//! within `c_max / w_i + c_max / w_j` of the other's: each gets a share of
//! the fleet in proportion to its weight, however many requests it sends.
//! A tenant that stops waiting leaves no credit or debt behind (its next
//! request starts from the virtual time), and a level with nothing waiting
//! is forgotten, so the state is bounded by the requests waiting.
//!
//! **Refusal.** A full queue refuses from the tenant most over its
//! weighted share of the places: the largest `n_t / w_t` (its waiting
//! requests, counting the newcomer, over its weight); on a tie, the
//! newcomer's tenant. Of that tenant's requests (the newcomer included) the
//! one that would be served last goes: the newcomer itself when it is its
//! tenant's last, else an already-waiting request, whose place the newcomer
//! takes. So a small tenant arriving at a queue full of a big tenant's
//! requests is queued, and the big tenant's newest request is refused.
//!
//! Pure and synchronous: the caller owns the lock and the clock.

use std::collections::{BTreeMap, BTreeSet, HashMap};
use std::hash::Hash;

/// Fixed-point units of one cost unit at weight 1 in a finish tag.
const TAG_UNIT: f64 = 65_536.0;

/// The smallest and largest weight a tenant may have: weights are clamped
/// to this range, so a tag step is always finite and at least 1.
pub const WEIGHT_RANGE: (f64, f64) = (1e-3, 1e6);

/// A waiting request's place in the order: compares as (priority, finish
/// tag, backlog, arrival), the order requests take ranks in.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct Place {
    /// Lower goes first (`x-priority`).
    pub priority: i64,
    /// Its finish tag in its level's virtual time (fixed point).
    pub finish: u64,
    /// Requests of its tenant waiting when it came.
    pub backlog: u64,
    /// Its arrival number: unique, increasing.
    pub seq: u64,
}

/// What a newcomer gets from [`FairQueue::admit`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Admission {
    /// Queued at this place.
    Queued(Place),
    /// Queued at the first place, in the room made by refusing the waiting
    /// request at the second (the caller answers it).
    Evicting(Place, Place),
    /// Refused: the queue is full and its tenant is the most over its share.
    Refused,
}

/// One tenant's waiting requests.
#[derive(Debug, Clone)]
struct Flow {
    weight: f64,
    places: BTreeSet<Place>,
}

/// The requests waiting, ordered by weighted fair queueing within each
/// priority level (see the module docs). `K` names a tenant.
#[derive(Debug, Clone)]
pub struct FairQueue<K> {
    order: BTreeMap<Place, K>,
    flows: HashMap<K, Flow>,
    /// Each level's virtual time, while requests wait at it.
    clocks: HashMap<i64, u64>,
    arrivals: u64,
}

impl<K> Default for FairQueue<K> {
    fn default() -> Self {
        FairQueue {
            order: BTreeMap::new(),
            flows: HashMap::new(),
            clocks: HashMap::new(),
            arrivals: 0,
        }
    }
}

impl<K: Clone + Eq + Hash> FairQueue<K> {
    /// An empty queue.
    pub fn new() -> Self {
        Self::default()
    }

    /// Requests waiting.
    pub fn len(&self) -> usize {
        self.order.len()
    }

    /// Whether none is.
    pub fn is_empty(&self) -> bool {
        self.order.is_empty()
    }

    /// The request to be served next.
    pub fn first(&self) -> Option<Place> {
        self.order.keys().next().copied()
    }

    /// Whether `place` still waits.
    pub fn contains(&self, place: Place) -> bool {
        self.order.contains_key(&place)
    }

    /// Requests of `tenant` waiting.
    pub fn waiting_of(&self, tenant: &K) -> usize {
        self.flows.get(tenant).map_or(0, |f| f.places.len())
    }

    /// The tenant a newcomer of `tenant` waits as, in a queue that tells
    /// at most `cap` unknown tenants apart: `tenant` itself when `is_known`
    /// holds for it, when it already has requests waiting, or when fewer
    /// than `cap` unknown tenants do; else `pool`, the one turn the unknown
    /// tenants beyond the cap share. So names made up per request (Sybils)
    /// take at most `cap` turns of the fair order between them, and a
    /// known tenant's share is at least its weight over the known tenants'
    /// weights plus `cap + 1` (`pool` counts as known).
    pub fn queue_as<'a>(
        &self,
        tenant: &'a K,
        cap: usize,
        pool: &'a K,
        is_known: impl Fn(&K) -> bool,
    ) -> &'a K {
        if is_known(tenant) || self.flows.contains_key(tenant) {
            return tenant;
        }
        let unknown = self.flows.keys().filter(|k| !is_known(k)).count();
        if unknown < cap {
            tenant
        } else {
            pool
        }
    }

    /// Queues a request of `tenant` (its `weight`, clamped to
    /// [`WEIGHT_RANGE`]) at `priority`, costing `cost` (0 counts as 1),
    /// into a queue of at most `capacity` places, refusing from the tenant
    /// most over its share when it is full (see the module docs).
    pub fn admit(
        &mut self,
        capacity: usize,
        tenant: &K,
        weight: f64,
        priority: i64,
        cost: u64,
    ) -> Admission {
        let weight = clamp_weight(weight);
        if self.order.len() < capacity {
            return Admission::Queued(self.push(tenant, weight, priority, cost));
        }
        let Some(victim) = self.victim(tenant, weight, priority, cost) else {
            return Admission::Refused;
        };
        self.leave(victim, false);
        Admission::Evicting(self.push(tenant, weight, priority, cost), victim)
    }

    /// Takes `place` out of the queue: `served` when it took a rank (its
    /// level's virtual time moves up to its tag), otherwise it timed out,
    /// was refused or its client left. Unknown places are ignored.
    pub fn leave(&mut self, place: Place, served: bool) {
        let Some(tenant) = self.order.remove(&place) else {
            return;
        };
        if let Some(flow) = self.flows.get_mut(&tenant) {
            flow.places.remove(&place);
            if flow.places.is_empty() {
                self.flows.remove(&tenant);
            }
        }
        let level_waits = self
            .order
            .range(level_start(place.priority)..)
            .next()
            .is_some_and(|(p, _)| p.priority == place.priority);
        if !level_waits {
            self.clocks.remove(&place.priority);
        } else if served {
            let clock = self.clocks.entry(place.priority).or_insert(0);
            *clock = (*clock).max(place.finish);
        }
    }

    /// The place a request of `tenant` would get now.
    fn tag(&self, tenant: &K, weight: f64, priority: i64, cost: u64) -> Place {
        let clock = self.clocks.get(&priority).copied().unwrap_or(0);
        let last = self.flows.get(tenant).and_then(|f| {
            f.places
                .range(level_start(priority)..level_start(priority.saturating_add(1)))
                .map(|p| p.finish)
                .next_back()
        });
        let start = last.map_or(clock, |l| l.max(clock));
        let step = (cost.max(1) as f64 * TAG_UNIT / weight).ceil();
        // Weights are clamped, so the step is finite; it saturates at the top.
        let step = if step >= u64::MAX as f64 {
            u64::MAX
        } else {
            (step as u64).max(1)
        };
        Place {
            priority,
            finish: start.saturating_add(step),
            backlog: self.waiting_of(tenant) as u64,
            seq: self.arrivals,
        }
    }

    fn push(&mut self, tenant: &K, weight: f64, priority: i64, cost: u64) -> Place {
        let place = self.tag(tenant, weight, priority, cost);
        self.arrivals += 1;
        self.clocks.entry(priority).or_insert(0);
        self.order.insert(place, tenant.clone());
        let flow = self.flows.entry(tenant.clone()).or_insert_with(|| Flow {
            weight,
            places: BTreeSet::new(),
        });
        flow.weight = weight;
        flow.places.insert(place);
        place
    }

    /// In a full queue: the waiting request to refuse for a newcomer of
    /// `tenant`, or `None` to refuse the newcomer.
    fn victim(&self, tenant: &K, weight: f64, priority: i64, cost: u64) -> Option<Place> {
        let own = self.waiting_of(tenant) as f64 + 1.0;
        // The tenant most over its share: the largest count over weight,
        // the newcomer's tenant on a tie.
        let mut worst: Option<(&K, &Flow)> = None;
        let mut worst_ratio = own / weight;
        for (k, flow) in &self.flows {
            if k == tenant {
                continue;
            }
            let ratio = flow.places.len() as f64 / flow.weight;
            let later = |w: &Flow| flow.places.last() > w.places.last();
            if ratio > worst_ratio || (ratio == worst_ratio && worst.is_some_and(|(_, w)| later(w)))
            {
                worst = Some((k, flow));
                worst_ratio = ratio;
            }
        }
        match worst {
            Some((_, flow)) => flow.places.last().copied(),
            None => {
                // The newcomer's tenant: its request served last goes.
                let newcomer = self.tag(tenant, weight, priority, cost);
                let last = self
                    .flows
                    .get(tenant)
                    .and_then(|f| f.places.last().copied());
                last.filter(|&l| l > newcomer)
            }
        }
    }
}

/// The first place of a priority level.
fn level_start(priority: i64) -> Place {
    Place {
        priority,
        finish: 0,
        backlog: 0,
        seq: 0,
    }
}

/// A weight inside [`WEIGHT_RANGE`] (1 for one that is not a number).
pub fn clamp_weight(weight: f64) -> f64 {
    if weight.is_nan() {
        return 1.0;
    }
    weight.clamp(WEIGHT_RANGE.0, WEIGHT_RANGE.1)
}

#[cfg(test)]
mod tests;
