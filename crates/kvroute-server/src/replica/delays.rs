//! The last few thousand samples of a delay, for exact percentiles in
//! `/workers` (the histograms in `/metrics` only give buckets).

/// A ring of the latest samples, in microseconds.
#[derive(Debug, Clone)]
pub struct Reservoir {
    samples: Vec<u64>,
    next: usize,
    capacity: usize,
    seen: u64,
}

/// Percentiles of a reservoir, in microseconds.
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize)]
pub struct Summary {
    /// Samples ever taken.
    pub count: u64,
    /// Median of the kept samples.
    pub p50_us: u64,
    /// 99th percentile of the kept samples.
    pub p99_us: u64,
    /// Largest kept sample.
    pub max_us: u64,
}

impl Reservoir {
    /// Keeps the last `capacity` samples.
    pub fn new(capacity: usize) -> Self {
        Reservoir {
            samples: Vec::new(),
            next: 0,
            capacity: capacity.max(1),
            seen: 0,
        }
    }

    /// Adds a sample.
    pub fn record(&mut self, us: u64) {
        self.seen += 1;
        if self.samples.len() < self.capacity {
            self.samples.push(us);
        } else {
            self.samples[self.next] = us;
            self.next = (self.next + 1) % self.capacity;
        }
    }

    /// Nearest-rank percentiles of what is kept (`None`: no sample yet).
    pub fn summary(&self) -> Option<Summary> {
        if self.samples.is_empty() {
            return None;
        }
        let mut sorted = self.samples.clone();
        sorted.sort_unstable();
        let at = |q: f64| {
            let rank = (q * sorted.len() as f64).ceil() as usize;
            sorted[rank.clamp(1, sorted.len()) - 1]
        };
        Some(Summary {
            count: self.seen,
            p50_us: at(0.50),
            p99_us: at(0.99),
            max_us: sorted[sorted.len() - 1],
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn percentiles_of_the_latest_samples() {
        let mut r = Reservoir::new(100);
        assert_eq!(r.summary(), None);
        for us in 1..=100 {
            r.record(us);
        }
        let s = r.summary().expect("samples");
        assert_eq!((s.count, s.p50_us, s.p99_us, s.max_us), (100, 50, 99, 100));
        for _ in 0..100 {
            r.record(7);
        }
        let s = r.summary().expect("samples");
        assert_eq!(
            (s.count, s.p50_us, s.max_us),
            (200, 7, 7),
            "old samples leave"
        );
    }
}
