//! The ranks' speeds as learned from their streamed responses
//! (`--learn-speeds`): each response that decoded more than one token
//! feeds the core's [`SpeedLearner`] with its time per token after the
//! first and its rank's load, and every refit publishes the speeds that
//! scoring reads without waiting on the learner.

use std::collections::{HashMap, HashSet};
use std::sync::{Arc, Mutex, MutexGuard, PoisonError, RwLock};
use std::time::Duration;

use kvroute_core::index::WorkerRank;
use kvroute_core::scheduler::{SpeedConfig, SpeedLearner};

/// The learner and the speeds of its last refit.
#[derive(Debug)]
pub struct SpeedBook {
    learner: Mutex<SpeedLearner<WorkerRank>>,
    learned: RwLock<Arc<HashMap<WorkerRank, f64>>>,
}

impl SpeedBook {
    /// A book that knows no speed yet.
    pub fn new(config: SpeedConfig) -> Self {
        SpeedBook {
            learner: Mutex::new(SpeedLearner::new(config)),
            learned: RwLock::new(Arc::new(HashMap::new())),
        }
    }

    /// A response of rank `key` decoded `tokens` tokens, the last `decoding`
    /// after the first, while the rank had `loads` blocks in flight at the
    /// first token and at the end.
    pub fn observe(&self, key: WorkerRank, loads: (u64, u64), decoding: Duration, tokens: u64) {
        let ms = decoding.as_secs_f64() * 1e3;
        let mut learner = self.learner.lock().unwrap_or_else(PoisonError::into_inner);
        if learner.observe_response(key, loads, ms, tokens) {
            self.publish(learner);
        }
    }

    /// Makes the learner's speeds the ones scoring reads.
    fn publish(&self, learner: MutexGuard<'_, SpeedLearner<WorkerRank>>) {
        let speeds = learner.speeds().collect();
        drop(learner);
        *self.learned.write().unwrap_or_else(PoisonError::into_inner) = Arc::new(speeds);
    }

    /// Forgets the ranks not in `fleet` (their workers left).
    pub fn retain(&self, fleet: &HashSet<WorkerRank>) {
        let mut learner = self.learner.lock().unwrap_or_else(PoisonError::into_inner);
        if learner.retain(|key| fleet.contains(&key)) {
            self.publish(learner);
        }
    }

    /// The speeds learned so far, by rank.
    pub fn learned(&self) -> Arc<HashMap<WorkerRank, f64>> {
        self.learned
            .read()
            .unwrap_or_else(PoisonError::into_inner)
            .clone()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_rank_twice_as_slow_per_token_is_published_at_half_speed() {
        let book = SpeedBook::new(SpeedConfig::default());
        let (fast, slow) = (WorkerRank::new(0, 0), WorkerRank::new(1, 0));
        for i in 0..40u64 {
            let load = 100 + (i % 5) * 50;
            let ms = 5.0 + 0.01 * load as f64;
            let per = |ms: f64| Duration::from_secs_f64(ms * 15.0 / 1e3);
            book.observe(fast, (load, load), per(ms), 16);
            book.observe(slow, (load, load), per(2.0 * ms), 16);
            // One token says nothing about decoding.
            book.observe(slow, (load, load), per(100.0), 1);
        }
        let learned = book.learned();
        // Two ranks: the median is their geometric mean.
        let ratio = learned[&slow] / learned[&fast];
        assert!((ratio - 0.5).abs() < 0.01, "{learned:?}");
        // The slow rank's worker leaves: it is no longer published.
        book.retain(&HashSet::from([fast]));
        assert!(!book.learned().contains_key(&slow));
    }
}
