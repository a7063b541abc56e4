//! Per-rank concurrency caps learned from time to first token: a rank whose
//! requests start too slowly takes fewer at once, the way TCP's congestion
//! window backs off (additive increase, multiplicative decrease).
//!
//! A rank at its cap counts as busy, as one over `--busy-requests` does, so
//! the cost moves the next request elsewhere (or the queue holds it). The
//! cap is a fixed `--busy-requests` that each rank finds for itself: a rank
//! that holds hot prefixes, or is slower, gets a lower one. A lever measured
//! in the simulator (docs/serving.md, "Against the peers").

use std::collections::HashMap;

use kvroute_core::index::WorkerRank;

/// How caps are learned.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct CapConfig {
    /// A first token later than this (ms) after the request was sent
    /// lowers its rank's cap.
    pub ttft_target_ms: f64,
    /// The cap every rank starts at and never exceeds.
    pub max_cap: f64,
    /// What a late first token leaves of the requests in flight when the
    /// late one was sent.
    pub backoff: f64,
}

impl Default for CapConfig {
    fn default() -> Self {
        CapConfig {
            ttft_target_ms: 150.0,
            max_cap: 64.0,
            backoff: 0.75,
        }
    }
}

/// Each rank's learned cap on requests in flight.
#[derive(Debug, Clone, Default)]
pub struct CapLearner {
    config: CapConfig,
    caps: HashMap<WorkerRank, f64>,
}

impl CapLearner {
    /// Every rank at `config.max_cap`.
    pub fn new(config: CapConfig) -> Self {
        CapLearner {
            config,
            caps: HashMap::new(),
        }
    }

    /// The requests `key` may have in flight (at least 1).
    pub fn cap(&self, key: WorkerRank) -> u64 {
        let cap = self.caps.get(&key).copied().unwrap_or(self.config.max_cap);
        (cap.floor() as u64).max(1)
    }

    /// Whether a rank with `in_flight` requests is at its cap.
    pub fn at_cap(&self, key: WorkerRank, in_flight: u64) -> bool {
        in_flight >= self.cap(key)
    }

    /// A request sent to `key` when it had `in_flight` requests (this one
    /// included) saw its first token after `ttft_ms`: late, the cap drops
    /// to `backoff` × `in_flight` (if lower); on time, it grows by one over
    /// a cap's worth of requests.
    pub fn observe(&mut self, key: WorkerRank, ttft_ms: f64, in_flight: u64) {
        let c = self.config;
        let cap = self.caps.entry(key).or_insert(c.max_cap);
        if ttft_ms > c.ttft_target_ms {
            *cap = cap.min((in_flight as f64 * c.backoff).max(1.0));
        } else {
            *cap = (*cap + 1.0 / cap.max(1.0)).min(c.max_cap);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_late_first_token_lowers_the_cap_and_on_time_ones_raise_it_slowly() {
        let key = WorkerRank::new(0, 0);
        let other = WorkerRank::new(1, 0);
        let mut caps = CapLearner::new(CapConfig {
            ttft_target_ms: 100.0,
            max_cap: 16.0,
            backoff: 0.5,
        });
        assert_eq!(caps.cap(key), 16);
        caps.observe(key, 150.0, 8);
        assert_eq!(caps.cap(key), 4);
        assert!(caps.at_cap(key, 4) && !caps.at_cap(key, 3));
        // A later late one with more in flight does not raise it.
        caps.observe(key, 150.0, 12);
        assert_eq!(caps.cap(key), 4);
        // About a cap's worth on time add one.
        for _ in 0..5 {
            caps.observe(key, 50.0, 2);
        }
        assert_eq!(caps.cap(key), 5);
        // Never below one, never above the start; other ranks untouched.
        caps.observe(key, 500.0, 1);
        assert_eq!(caps.cap(key), 1);
        for _ in 0..10_000 {
            caps.observe(key, 1.0, 1);
        }
        assert_eq!(caps.cap(key), 16);
        assert_eq!(caps.cap(other), 16);
    }
}
