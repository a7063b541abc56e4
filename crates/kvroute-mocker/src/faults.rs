//! Fault injection for reliability tests; every fault is off by default.
//!
//! | flag | effect |
//! | --- | --- |
//! | `--drop-every N` | live batch number N, 2N, … (seq N−1, 2N−1, …) is not sent on the PUB socket; its seq is used and it stays in the replay ring, so a subscriber sees a gap it can repair by replay |
//! | `--cut-replay N` | the first N replay answers of each rank stop before their end marker (the batches are sent, the end marker is not), as a replay socket that dropped the tail of its answer |
//! | `--bad-event-every N` | batch number N, 2N, … carries one extra malformed event in the middle of its events (valid msgpack, invalid event: a decoder must skip it and keep the rest) |
//! | `--restart-every-secs S` | every S seconds each rank "restarts": in-flight requests fail with 503, the cache is emptied without events, the publisher's sockets are re-bound, seq starts again at 0 and the replay ring is emptied |
//! | `--delay-ms MS` | every HTTP response is held back MS milliseconds |
//! | `--fail-rate F` | a fraction F of completion and chat requests is answered 500 (drawn from a generator seeded by `--seed`) |
//! | `--cut-streams F` | a fraction F of streamed answers is cut off after half their `max_tokens`: the connection closes in the middle of the body, as when an engine dies (drawn from its own seeded generator) |

use std::time::Duration;

use crate::config::ConfigError;
use kvroute_core::rng::SplitMix64;

/// The fault flags.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct FaultConfig {
    /// Skip every Nth live batch (`None`: never).
    pub drop_every: Option<u64>,
    /// The first this many replay answers of each rank lack their end marker.
    pub cut_replay: u64,
    /// Add a malformed event to every Nth batch (`None`: never).
    pub bad_event_every: Option<u64>,
    /// Restart the publisher and clear the cache this often.
    pub restart_every: Option<Duration>,
    /// Delay added to every HTTP response.
    pub delay: Duration,
    /// Fraction of inference requests answered 500, in `[0, 1]`.
    pub fail_rate: f64,
    /// Fraction of streamed answers cut off half-way, in `[0, 1]`.
    pub cut_streams: f64,
}

impl FaultConfig {
    /// Checks ranges (`N` ≥ 1, `F` in `[0, 1]`, `S` > 0).
    pub fn validate(&self) -> Result<(), ConfigError> {
        if self.drop_every == Some(0) {
            return Err(ConfigError::Zero { flag: "drop-every" });
        }
        if self.bad_event_every == Some(0) {
            return Err(ConfigError::Zero {
                flag: "bad-event-every",
            });
        }
        if self.restart_every == Some(Duration::ZERO) {
            return Err(ConfigError::Zero {
                flag: "restart-every-secs",
            });
        }
        if !(0.0..=1.0).contains(&self.fail_rate) {
            return Err(ConfigError::OutOfRange {
                flag: "fail-rate",
                value: self.fail_rate,
                expected: "between 0 and 1",
            });
        }
        if !(0.0..=1.0).contains(&self.cut_streams) {
            return Err(ConfigError::OutOfRange {
                flag: "cut-streams",
                value: self.cut_streams,
                expected: "between 0 and 1",
            });
        }
        Ok(())
    }

    /// True when the batch with this seq must not be sent live.
    pub fn drops(&self, seq: u64) -> bool {
        matches!(self.drop_every, Some(n) if (seq + 1).is_multiple_of(n))
    }

    /// True when the batch with this seq carries a malformed event.
    pub fn corrupts(&self, seq: u64) -> bool {
        matches!(self.bad_event_every, Some(n) if (seq + 1).is_multiple_of(n))
    }
}

/// Decides which inference requests fail, reproducibly for a given seed.
#[derive(Debug, Clone)]
pub struct FailureDice {
    rate: f64,
    rng: SplitMix64,
}

impl FailureDice {
    /// Dice failing a fraction `rate` of rolls, seeded.
    pub fn new(rate: f64, seed: u64) -> Self {
        FailureDice {
            rate,
            rng: SplitMix64::new(seed ^ 0xFA11_FA11_FA11_FA11),
        }
    }

    /// True when this request must be answered 500.
    pub fn roll(&mut self) -> bool {
        // No draw at all when failures are off, so enabling other features
        // never shifts the sequence.
        self.rate > 0.0 && self.rng.next_f64() < self.rate
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_nth_batch_counts_from_one() {
        let f = FaultConfig {
            drop_every: Some(3),
            bad_event_every: Some(2),
            ..FaultConfig::default()
        };
        let dropped: Vec<u64> = (0..9).filter(|&s| f.drops(s)).collect();
        assert_eq!(dropped, [2, 5, 8]);
        let bad: Vec<u64> = (0..6).filter(|&s| f.corrupts(s)).collect();
        assert_eq!(bad, [1, 3, 5]);
        assert!(!FaultConfig::default().drops(0));
    }

    #[test]
    fn fail_rate_is_roughly_honoured_and_reproducible() {
        let mut a = FailureDice::new(0.25, 42);
        let mut b = FailureDice::new(0.25, 42);
        let rolls: Vec<bool> = (0..4000).map(|_| a.roll()).collect();
        assert!(rolls
            .iter()
            .zip((0..4000).map(|_| b.roll()))
            .all(|(x, y)| *x == y));
        let failed = rolls.iter().filter(|&&r| r).count();
        assert!((800..1200).contains(&failed), "{failed}");
        assert!(!FailureDice::new(0.0, 1).roll());
        assert!(FailureDice::new(1.0, 1).roll());
    }

    #[test]
    fn out_of_range_values_are_rejected() {
        let f = FaultConfig {
            fail_rate: 1.5,
            ..FaultConfig::default()
        };
        assert!(f.validate().is_err());
        let f = FaultConfig {
            drop_every: Some(0),
            ..FaultConfig::default()
        };
        assert!(f.validate().is_err());
    }
}
