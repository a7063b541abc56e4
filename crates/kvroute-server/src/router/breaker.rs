//! Circuit breakers: a worker that fails repeatedly is left out of routing
//! for a while, then let back in one probe request at a time.

use std::collections::HashMap;
use std::sync::{Mutex, MutexGuard, PoisonError};
use std::time::{Duration, Instant};

use tracing::warn;

#[derive(Debug, Default)]
struct Breaker {
    failures: u32,
    /// Open (worker skipped) until then.
    open_until: Option<Instant>,
    /// A half-open probe is in flight until then.
    probe_until: Option<Instant>,
}

impl Breaker {
    fn allows(&self, now: Instant) -> bool {
        match self.open_until {
            None => true,
            Some(until) => now >= until && self.probe_until.is_none_or(|p| now >= p),
        }
    }
}

/// Every worker's breaker, keyed by worker name.
#[derive(Debug)]
pub struct Breakers {
    /// Consecutive failures that open a breaker.
    failures: u32,
    /// How long an open breaker keeps its worker out.
    open: Duration,
    by_worker: Mutex<HashMap<String, Breaker>>,
}

impl Breakers {
    /// Breakers that open after `failures` consecutive failures for `open`.
    pub fn new(failures: u32, open: Duration) -> Self {
        Breakers {
            failures,
            open,
            by_worker: Mutex::new(HashMap::new()),
        }
    }

    fn lock(&self) -> MutexGuard<'_, HashMap<String, Breaker>> {
        self.by_worker
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
    }

    /// Whether a worker may be chosen: its breaker is closed, or open past
    /// its period with no probe in flight.
    pub fn available(&self, name: &str) -> bool {
        self.lock()
            .get(name)
            .is_none_or(|b| b.allows(Instant::now()))
    }

    /// Called just before sending to a worker: a worker whose breaker is
    /// half-open gets one probe at a time (a probe lost without an outcome
    /// expires after the breaker period). `false`: skip this worker.
    pub fn begin_attempt(&self, name: &str) -> bool {
        let mut breakers = self.lock();
        let Some(b) = breakers.get_mut(name) else {
            return true;
        };
        let now = Instant::now();
        if !b.allows(now) {
            return false;
        }
        if b.open_until.is_some() {
            b.probe_until = Some(now + self.open);
        }
        true
    }

    /// Records how an attempt on a worker ended: a success closes its
    /// breaker; enough failures in a row open it.
    pub fn record_outcome(&self, name: &str, ok: bool) {
        let mut breakers = self.lock();
        if ok {
            // A worker without an entry has a closed breaker already.
            if let Some(b) = breakers.get_mut(name) {
                *b = Breaker::default();
            }
        } else {
            let b = match breakers.get_mut(name) {
                Some(b) => b,
                None => breakers.entry(name.to_owned()).or_default(),
            };
            b.failures += 1;
            b.probe_until = None;
            if b.failures >= self.failures {
                warn!(worker = name, failures = b.failures, "circuit breaker open");
                b.open_until = Some(Instant::now() + self.open);
            }
        }
    }
}

impl Breakers {
    /// Opens a worker's breaker at once: it failed in a way that may hurt
    /// whatever is sent to it next.
    pub fn trip(&self, name: &str) {
        let mut breakers = self.lock();
        let b = match breakers.get_mut(name) {
            Some(b) => b,
            None => breakers.entry(name.to_owned()).or_default(),
        };
        b.failures = b.failures.max(self.failures);
        b.probe_until = None;
        b.open_until = Some(Instant::now() + self.open);
        warn!(worker = name, "circuit breaker open");
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_breaker_opens_after_repeated_failures_and_a_success_closes_it() {
        let breakers = Breakers::new(2, Duration::from_secs(60));
        breakers.record_outcome("w0", false);
        assert!(breakers.available("w0"));
        breakers.record_outcome("w0", false);
        assert!(!breakers.available("w0"));
        breakers.record_outcome("w0", true);
        assert!(breakers.available("w0"));
        breakers.trip("w1");
        assert!(
            !breakers.available("w1"),
            "one failure that may hurt opens it"
        );
    }

    #[test]
    fn a_half_open_breaker_lets_one_probe_through() {
        let t0 = Instant::now();
        let s = Duration::from_secs;
        let mut b = Breaker {
            failures: 3,
            open_until: Some(t0 + s(10)),
            probe_until: None,
        };
        assert!(!b.allows(t0));
        assert!(b.allows(t0 + s(11)));
        // A probe in flight keeps everyone else out until it ends or expires.
        b.probe_until = Some(t0 + s(21));
        assert!(!b.allows(t0 + s(12)));
        assert!(b.allows(t0 + s(22)));
        assert!(Breaker::default().allows(t0));
    }
}
