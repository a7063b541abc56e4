//! The memory budget of request bodies: one bound on the bytes every body
//! being read or routed holds at once, over HTTP and the endpoint picker
//! alike, so that no number of clients sending large bodies can make the
//! router use more than the operator allowed.
//!
//! A body takes a [`Share`] of the budget as its bytes arrive (never by
//! what a header announced), grows it before work that multiplies what it
//! holds (parsing a large body into values), shrinks it back after, and
//! gives it back when dropped. A body that would pass the budget is
//! refused at once (503), which costs its client a retry and no one else
//! anything.
//!
//! Small bodies keep a lane of their own: a share may grow past
//! [`SMALL_BODY`] bytes only while the shares in use leave the
//! [`MemoryBudget::reserve`] free, so a flood of large bodies never turns
//! away the ordinary requests behind it. Atomics and a wake-up for waiters;
//! no I/O.

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;

use crate::metrics::catalogue::{BODY_MEMORY, BODY_MEMORY_REFUSALS};
use crate::metrics::encode_single;

/// Bodies of at most this many bytes may use the reserve (the lane that
/// large bodies leave free).
pub const SMALL_BODY: usize = 256 << 10;

/// The budget: at most `limit` bytes held by all shares, of which large
/// shares leave `reserve` free.
#[derive(Debug)]
pub struct MemoryBudget {
    limit: usize,
    reserve: usize,
    used: AtomicUsize,
    refused: AtomicUsize,
    /// Woken whenever a share gives bytes back.
    released: tokio::sync::Notify,
}

impl MemoryBudget {
    /// A budget of `limit` bytes, keeping `reserve` of them for small
    /// bodies (at most `limit`).
    pub fn new(limit: usize, reserve: usize) -> Arc<Self> {
        Arc::new(MemoryBudget {
            limit,
            reserve: reserve.min(limit),
            used: AtomicUsize::new(0),
            refused: AtomicUsize::new(0),
            released: tokio::sync::Notify::new(),
        })
    }

    /// The whole budget, in bytes.
    pub fn limit(&self) -> usize {
        self.limit
    }

    /// The bytes only small bodies may use.
    pub fn reserve(&self) -> usize {
        self.reserve
    }

    /// The most one large body may hold (the budget less the reserve).
    pub fn large_limit(&self) -> usize {
        self.limit - self.reserve
    }

    /// The bytes held by every share now.
    pub fn used(&self) -> usize {
        self.used.load(Ordering::Relaxed)
    }

    /// How many times a share could not grow.
    pub fn refusals(&self) -> usize {
        self.refused.load(Ordering::Relaxed)
    }

    /// An empty share of the budget.
    pub fn share(self: &Arc<Self>) -> Share {
        Share {
            budget: Some(self.clone()),
            held: 0,
        }
    }

    /// Adds `more` bytes to the budget's use, if the share growing to
    /// `after` bytes may take them.
    fn take(&self, more: usize, after: usize) -> bool {
        let ceiling = if after <= SMALL_BODY {
            self.limit
        } else {
            self.limit - self.reserve
        };
        let taken = self
            .used
            .fetch_update(Ordering::AcqRel, Ordering::Acquire, |used| {
                used.checked_add(more).filter(|&u| u <= ceiling)
            })
            .is_ok();
        if !taken {
            self.refused.fetch_add(1, Ordering::Relaxed);
        }
        taken
    }

    fn give_back(&self, bytes: usize) {
        self.used.fetch_sub(bytes, Ordering::AcqRel);
        self.released.notify_waiters();
    }

    /// Completes when some share next gives bytes back (create it before
    /// trying to grow, so that a release in between is not missed).
    pub fn released(&self) -> tokio::sync::futures::Notified<'_> {
        self.released.notified()
    }
}

/// [`BODY_MEMORY`] and [`BODY_MEMORY_REFUSALS`] of a budget.
#[derive(Debug)]
pub struct BudgetCollector(pub Arc<MemoryBudget>);

impl prometheus_client::collector::Collector for BudgetCollector {
    fn encode(
        &self,
        mut encoder: prometheus_client::encoding::DescriptorEncoder,
    ) -> Result<(), std::fmt::Error> {
        let (used, refused) = (self.0.used(), self.0.refusals());
        encode_single(&mut encoder, &BODY_MEMORY, used as u64)?;
        encode_single(&mut encoder, &BODY_MEMORY_REFUSALS, refused as u64)
    }
}

/// The part of the budget one body holds; given back when dropped.
#[derive(Debug, Default)]
pub struct Share {
    /// `None`: a share of no budget (every growth is allowed).
    budget: Option<Arc<MemoryBudget>>,
    held: usize,
}

impl Share {
    /// A share of no budget: it grows without bound (for callers that
    /// bound bodies some other way, such as tests).
    pub fn unbounded() -> Self {
        Share::default()
    }

    /// The budget this is a share of, if any.
    pub fn budget(&self) -> Option<&Arc<MemoryBudget>> {
        self.budget.as_ref()
    }

    /// The bytes held.
    pub fn held(&self) -> usize {
        self.held
    }

    /// Grows the share to hold `bytes` in all; false (and nothing taken)
    /// when the budget cannot give them.
    pub fn grow_to(&mut self, bytes: usize) -> bool {
        if bytes <= self.held {
            return true;
        }
        let more = bytes - self.held;
        if let Some(budget) = &self.budget {
            if !budget.take(more, bytes) {
                return false;
            }
        }
        self.held = bytes;
        true
    }

    /// Gives back what the share holds beyond `bytes`.
    pub fn shrink_to(&mut self, bytes: usize) {
        if bytes >= self.held {
            return;
        }
        if let Some(budget) = &self.budget {
            budget.give_back(self.held - bytes);
        }
        self.held = bytes;
    }
}

impl Drop for Share {
    fn drop(&mut self) {
        self.shrink_to(0);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    #[test]
    fn large_bodies_leave_the_reserve_to_small_ones() {
        let budget = MemoryBudget::new(10 << 20, 2 << 20);
        let mut large = budget.share();
        assert!(large.grow_to(8 << 20));
        assert!(!large.grow_to((8 << 20) + 1), "past the large lane");
        let mut other_large = budget.share();
        assert!(!other_large.grow_to(SMALL_BODY + 1));
        let mut small = budget.share();
        assert!(small.grow_to(SMALL_BODY), "the reserve is the small lane's");
        assert_eq!(budget.used(), (8 << 20) + SMALL_BODY);
        assert_eq!(budget.refusals(), 2);
        drop(large);
        assert!(other_large.grow_to(4 << 20));
        small.shrink_to(10);
        assert_eq!(budget.used(), (4 << 20) + 10);
        drop((small, other_large));
        assert_eq!(budget.used(), 0);
    }

    #[test]
    fn an_unbounded_share_always_grows() {
        let mut share = Share::unbounded();
        assert!(share.grow_to(usize::MAX));
        share.shrink_to(0);
        assert_eq!(share.held(), 0);
    }

    proptest! {
        /// Whatever shares grow, shrink and drop in any order, the budget's
        /// use is the sum of what the live shares hold and never passes
        /// the limit, nor (counting only large shares) the large lane.
        #[test]
        fn the_budget_is_the_sum_of_its_shares_and_never_passes_its_limit(
            ops in proptest::collection::vec((0usize..4, 0usize..(3 << 20)), 1..200)
        ) {
            let budget = MemoryBudget::new(4 << 20, 1 << 20);
            let mut shares: Vec<Share> = (0..4).map(|_| budget.share()).collect();
            for (i, bytes) in ops {
                if bytes % 7 == 0 {
                    shares[i] = budget.share();
                } else if bytes % 3 == 0 {
                    shares[i].shrink_to(bytes / 2);
                } else {
                    let before = shares[i].held();
                    let grew = shares[i].grow_to(bytes);
                    prop_assert!(grew || shares[i].held() == before);
                }
                let held: usize = shares.iter().map(Share::held).sum();
                prop_assert_eq!(budget.used(), held);
                prop_assert!(held <= budget.limit());
            }
        }
    }
}
