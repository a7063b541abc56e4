//! Every statistic kvroute's measurements report: percentiles, medians,
//! maxima, and the Poisson arrivals of open-loop runs.
//!
//! Percentiles use the nearest-rank definition: the p-th percentile of n
//! sorted samples is the sample at rank `ceil(p/100 · n)` (1-based), so every
//! reported value is one that was measured, and p100 is the maximum. An empty
//! sample set gives 0 (the report's `requests` then says there was nothing).
//! With fewer than `1 / (1 - p/100)` samples the p-th percentile *is* the
//! maximum; [`resolved_percentile`] says so by returning `None`, for reports
//! that must not print a maximum under a percentile's name.

use kvroute_core::rng::SplitMix64;
use serde::Serialize;

/// The nearest-rank percentile `q` (0–1) of `sorted` (ascending); 0 when empty.
///
/// `q` at or below 0 gives the minimum, at or above 1 the maximum.
pub fn percentile(sorted: &[f64], q: f64) -> f64 {
    let n = sorted.len();
    if n == 0 {
        return 0.0;
    }
    let q = if q.is_nan() { 0.0 } else { q.clamp(0.0, 1.0) };
    // Rank in 1..=n; a tiny epsilon keeps 0.9 · 10 from becoming 9.000000000000002.
    let rank = ((q * n as f64) - 1e-9).ceil().max(1.0) as usize;
    sorted[rank.min(n) - 1]
}

/// [`percentile`] when `sorted` has enough samples for it to differ from
/// the maximum (rank below n); `None` otherwise.
pub fn resolved_percentile(sorted: &[f64], q: f64) -> Option<f64> {
    let n = sorted.len() as f64;
    ((q * n - 1e-9).ceil() < n).then(|| percentile(sorted, q))
}

/// The median ([`percentile`] 0.5) of `sorted`; 0 when empty.
pub fn median(sorted: &[f64]) -> f64 {
    percentile(sorted, 0.5)
}

/// The largest of `sorted` (its last sample); 0 when empty.
pub fn max(sorted: &[f64]) -> f64 {
    sorted.last().copied().unwrap_or(0.0)
}

/// Sorts samples ascending (NaNs last) so [`percentile`] can read them.
pub fn sort_samples(samples: &mut [f64]) {
    samples.sort_by(f64::total_cmp);
}

/// `samples`, sorted ascending (see [`sort_samples`]).
pub fn sorted(mut samples: Vec<f64>) -> Vec<f64> {
    sort_samples(&mut samples);
    samples
}

/// p50, p90 and p99 of a distribution (time to first token), in the report's units.
#[derive(Debug, Clone, Copy, Default, PartialEq, Serialize)]
pub struct Percentiles3 {
    /// Median.
    pub p50: f64,
    /// 90th percentile.
    pub p90: f64,
    /// 99th percentile.
    pub p99: f64,
}

impl Percentiles3 {
    /// The three percentiles of `sorted` (ascending).
    pub fn of(sorted: &[f64]) -> Self {
        Percentiles3 {
            p50: percentile(sorted, 0.50),
            p90: percentile(sorted, 0.90),
            p99: percentile(sorted, 0.99),
        }
    }
}

/// p50 and p99 of a distribution (end-to-end latency), in the report's units.
#[derive(Debug, Clone, Copy, Default, PartialEq, Serialize)]
pub struct Percentiles2 {
    /// Median.
    pub p50: f64,
    /// 99th percentile.
    pub p99: f64,
}

impl Percentiles2 {
    /// The two percentiles of `sorted` (ascending).
    pub fn of(sorted: &[f64]) -> Self {
        Percentiles2 {
            p50: percentile(sorted, 0.50),
            p99: percentile(sorted, 0.99),
        }
    }
}

/// Arrival times of a Poisson process: independent exponential gaps with
/// mean `1 / rate`, drawn from a seeded generator, so an open-loop run
/// issues the same schedule every time.
#[derive(Debug, Clone)]
pub struct PoissonArrivals {
    rng: SplitMix64,
    rate: f64,
    now: f64,
}

impl PoissonArrivals {
    /// A process of `rate` arrivals per second (must be positive and finite;
    /// anything else is treated as one per second) starting at time 0.
    pub fn new(rate: f64, seed: u64) -> Self {
        let rate = if rate.is_finite() && rate > 0.0 {
            rate
        } else {
            1.0
        };
        PoissonArrivals {
            rng: SplitMix64::new(seed),
            rate,
            now: 0.0,
        }
    }

    /// The next gap in seconds: `-ln(1 - u) / rate`, u uniform in [0, 1).
    pub fn next_gap(&mut self) -> f64 {
        let u = self.rng.next_f64();
        -(1.0 - u).ln() / self.rate
    }

    /// The next arrival, in seconds since the start.
    pub fn next_arrival(&mut self) -> f64 {
        self.now += self.next_gap();
        self.now
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn nearest_rank_percentiles_of_small_arrays() {
        let ten: Vec<f64> = (1..=10).map(f64::from).collect();
        assert_eq!(percentile(&ten, 0.5), 5.0);
        assert_eq!(percentile(&ten, 0.9), 9.0);
        assert_eq!(percentile(&ten, 0.99), 10.0);
        assert_eq!(percentile(&ten, 0.0), 1.0);
        assert_eq!(percentile(&ten, 1.0), 10.0);
        assert_eq!(percentile(&ten, 0.51), 6.0);
        let hundred: Vec<f64> = (1..=100).map(f64::from).collect();
        assert_eq!(percentile(&hundred, 0.99), 99.0);
        assert_eq!(percentile(&hundred, 0.9), 90.0);
        assert_eq!(percentile(&[7.0], 0.5), 7.0);
        assert_eq!(percentile(&[7.0], 0.99), 7.0);
        assert_eq!(percentile(&[1.0, 2.0], 0.5), 1.0);
        assert_eq!(percentile(&[1.0, 2.0], 0.99), 2.0);
        assert_eq!(
            Percentiles3::of(&ten),
            Percentiles3 {
                p50: 5.0,
                p90: 9.0,
                p99: 10.0
            }
        );
        assert_eq!(
            Percentiles2::of(&ten),
            Percentiles2 {
                p50: 5.0,
                p99: 10.0
            }
        );
    }

    #[test]
    fn empty_input_gives_zero_and_odd_quantiles_are_clamped() {
        assert_eq!(percentile(&[], 0.5), 0.0);
        assert_eq!(Percentiles3::of(&[]), Percentiles3::default());
        assert_eq!(Percentiles2::of(&[]), Percentiles2::default());
        assert_eq!(percentile(&[1.0, 2.0, 3.0], -1.0), 1.0);
        assert_eq!(percentile(&[1.0, 2.0, 3.0], 7.0), 3.0);
        assert_eq!(percentile(&[1.0, 2.0, 3.0], f64::NAN), 1.0);
    }

    #[test]
    fn medians_maxima_and_percentiles_that_would_only_be_the_maximum() {
        let ten: Vec<f64> = (1..=10).map(f64::from).collect();
        assert_eq!(median(&ten), 5.0);
        assert_eq!(median(&[3.0, 7.0, 9.0]), 7.0);
        assert_eq!(max(&ten), 10.0);
        assert_eq!((median(&[]), max(&[])), (0.0, 0.0));
        // p90 of 10 samples is the 9th; p99 of 10 would be the 10th, the maximum.
        assert_eq!(resolved_percentile(&ten, 0.9), Some(9.0));
        assert_eq!(resolved_percentile(&ten, 0.99), None);
        let hundred: Vec<f64> = (1..=100).map(f64::from).collect();
        assert_eq!(resolved_percentile(&hundred, 0.99), Some(99.0));
        assert_eq!(resolved_percentile(&hundred, 0.999), None);
        let thousand: Vec<f64> = (1..=1000).map(f64::from).collect();
        assert_eq!(resolved_percentile(&thousand, 0.999), Some(999.0));
        assert_eq!(resolved_percentile(&[], 0.5), None);
    }

    #[test]
    fn sorting_puts_samples_in_order() {
        let mut v = vec![3.0, 1.0, 2.0];
        sort_samples(&mut v);
        assert_eq!(v, [1.0, 2.0, 3.0]);
        assert_eq!(sorted(vec![2.0, f64::NAN, -1.0])[..2], [-1.0, 2.0]);
    }

    #[test]
    fn poisson_gaps_average_one_over_rate() {
        for rate in [0.5, 20.0, 1000.0] {
            let mut p = PoissonArrivals::new(rate, 42);
            let n = 100_000;
            let mut last = 0.0;
            let mut gaps = Vec::with_capacity(n);
            for _ in 0..n {
                let t = p.next_arrival();
                assert!(t >= last);
                gaps.push(t - last);
                last = t;
            }
            let mean = last / n as f64;
            let expected = 1.0 / rate;
            assert!(
                (mean - expected).abs() < 0.02 * expected,
                "rate {rate}: mean gap {mean}, expected {expected}"
            );
            // Exponential: the standard deviation equals the mean.
            let var = gaps.iter().map(|g| (g - mean).powi(2)).sum::<f64>() / n as f64;
            assert!((var.sqrt() - expected).abs() < 0.03 * expected);
        }
    }

    #[test]
    fn poisson_arrivals_are_deterministic_per_seed() {
        let a: Vec<f64> = {
            let mut p = PoissonArrivals::new(10.0, 7);
            (0..100).map(|_| p.next_arrival()).collect()
        };
        let b: Vec<f64> = {
            let mut p = PoissonArrivals::new(10.0, 7);
            (0..100).map(|_| p.next_arrival()).collect()
        };
        assert_eq!(a, b);
        let mut c = PoissonArrivals::new(10.0, 8);
        assert_ne!(a[0], c.next_arrival());
        // A rate that is not positive falls back to one per second instead of panicking.
        assert!(PoissonArrivals::new(0.0, 1).next_gap().is_finite());
        assert!(PoissonArrivals::new(f64::NAN, 1).next_gap().is_finite());
    }
}
