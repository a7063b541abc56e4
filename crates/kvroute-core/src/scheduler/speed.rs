//! Worker speeds learned from the decode times the router sees, for fleets
//! whose operators did not (or could not) declare them: a slower GPU, an
//! engine sharing its GPU, one that throttles.
//!
//! An engine's decode step lengthens with the KV its batch reads, so the
//! time per output token says as much about an engine's load as about its
//! speed: an engine that is slow takes fewer requests, decodes smaller
//! batches and looks faster than it is. The learner therefore fits one
//! curve for the whole fleet, the time per token of the reference engine at
//! each load, and one factor per worker against it:
//! `time_per_token × speed = a + b × load`, the load being the blocks the
//! router has in flight on the worker while the request decodes. Each
//! worker keeps the sums of its own observations with exponential
//! forgetting, so an engine that slows down or recovers is followed, and a
//! refit is a few passes over the workers' sums.
//!
//! Speeds are relative to the fleet's median worker (which is at 1). Routing on
//! noise would move prefixes between equal engines and cost cache hits, so a
//! speed within [`SpeedConfig::dead_band`] of 1 is reported as 1, and a
//! worker with fewer than [`SpeedConfig::min_observations`] (forgotten
//! weight included) has no learned speed.

use std::collections::HashMap;
use std::hash::Hash;

/// How the learner weighs and reports.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct SpeedConfig {
    /// Weight kept by a worker's earlier observations at each new one
    /// (0.98: the last ~50 responses count most).
    pub forget: f64,
    /// Observation weight a worker needs before it has a learned speed.
    pub min_observations: f64,
    /// Relative distance from 1 below which a speed is reported as 1.
    pub dead_band: f64,
    /// Observations between refits of the fleet's curve.
    pub refit_every: u32,
    /// The slowest and fastest speeds reported.
    pub bounds: (f64, f64),
}

impl Default for SpeedConfig {
    fn default() -> Self {
        SpeedConfig {
            forget: 0.98,
            min_observations: 5.0,
            dead_band: 0.2,
            refit_every: 16,
            bounds: (0.05, 20.0),
        }
    }
}

/// One worker's forgetting sums of (load x, time per token t).
#[derive(Debug, Clone, Copy, Default, PartialEq)]
struct Sums {
    n: f64,
    x: f64,
    xx: f64,
    t: f64,
    tx: f64,
    tt: f64,
}

impl Sums {
    fn add(&mut self, forget: f64, x: f64, t: f64) {
        let keep = |v: &mut f64, add: f64| *v = *v * forget + add;
        keep(&mut self.n, 1.0);
        keep(&mut self.x, x);
        keep(&mut self.xx, x * x);
        keep(&mut self.t, t);
        keep(&mut self.tx, t * x);
        keep(&mut self.tt, t * t);
    }
}

/// Learns each worker's speed from its responses (see the module docs).
#[derive(Debug, Clone)]
pub struct SpeedLearner<K> {
    config: SpeedConfig,
    sums: HashMap<K, Sums>,
    /// The last fit's raw factors (no dead band, no bounds).
    fitted: HashMap<K, f64>,
    /// The fleet's curve: time per token at load x is `curve.0 + curve.1 × x`.
    curve: (f64, f64),
    since_refit: u32,
}

impl<K: Copy + Eq + Hash> SpeedLearner<K> {
    /// A learner that knows nothing yet.
    pub fn new(config: SpeedConfig) -> Self {
        SpeedLearner {
            config,
            sums: HashMap::new(),
            fitted: HashMap::new(),
            curve: (0.0, 0.0),
            since_refit: 0,
        }
    }

    /// A response of `worker` decoded at `ms_per_token` while the router had
    /// `load` blocks in flight there. Times that are not positive finite
    /// numbers are ignored. True when the observation completed a refit,
    /// so the speeds may have changed.
    pub fn observe(&mut self, worker: K, load: f64, ms_per_token: f64) -> bool {
        if !(ms_per_token.is_finite() && ms_per_token > 0.0 && load.is_finite() && load >= 0.0) {
            return false;
        }
        let forget = self.config.forget.clamp(0.0, 1.0);
        self.sums
            .entry(worker)
            .or_default()
            .add(forget, load, ms_per_token);
        self.since_refit += 1;
        if self.since_refit < self.config.refit_every.max(1) {
            return false;
        }
        self.refit();
        true
    }

    /// A whole response of `worker`: `tokens` generated, the last
    /// `decoding_ms` after the first, while the router had `loads.0` blocks
    /// in flight there at the first token and `loads.1` at the end. A
    /// response of one token says nothing of decoding. True as for
    /// [`SpeedLearner::observe`].
    pub fn observe_response(
        &mut self,
        worker: K,
        loads: (u64, u64),
        decoding_ms: f64,
        tokens: u64,
    ) -> bool {
        if tokens < 2 {
            return false;
        }
        let load = (loads.0 as f64 + loads.1 as f64) / 2.0;
        self.observe(worker, load, decoding_ms / (tokens - 1) as f64)
    }

    /// Every worker with a learned speed, and that speed.
    pub fn speeds(&self) -> impl Iterator<Item = (K, f64)> + '_ {
        self.fitted
            .keys()
            .filter_map(|&k| Some((k, self.speed(k)?)))
    }

    /// The worker's learned speed against the fleet, once it has enough
    /// observations: 1 inside the dead band, else within the bounds.
    pub fn speed(&self, worker: K) -> Option<f64> {
        let raw = *self.fitted.get(&worker)?;
        let band = self.config.dead_band.max(0.0);
        if (raw - 1.0).abs() <= band * raw.min(1.0) {
            return Some(1.0);
        }
        let (lo, hi) = self.config.bounds;
        Some(raw.clamp(lo, hi))
    }

    /// Forgets the workers for which `keep` is false (gone from the fleet),
    /// so that their old factors no longer set the fleet's median. True
    /// when one was forgotten (and the speeds refitted).
    pub fn retain(&mut self, mut keep: impl FnMut(K) -> bool) -> bool {
        let before = self.sums.len();
        self.sums.retain(|&k, _| keep(k));
        let forgot = self.sums.len() != before;
        if forgot {
            self.refit();
        }
        forgot
    }

    /// The fleet's time per token at `load` blocks on the reference engine
    /// (0 before the first fit).
    pub fn reference_ms_per_token(&self, load: f64) -> f64 {
        self.curve.0 + self.curve.1 * load
    }

    /// Fits the curve and the factors again from every worker's sums.
    pub fn refit(&mut self) {
        self.since_refit = 0;
        let min = self.config.min_observations;
        let workers: Vec<(K, Sums)> = self
            .sums
            .iter()
            .filter(|(_, s)| s.n >= min && s.tt > 0.0)
            .map(|(&k, &s)| (k, s))
            .collect();
        if workers.is_empty() {
            self.fitted.clear();
            return;
        }
        let mut factors: Vec<f64> = workers
            .iter()
            .map(|(k, _)| self.fitted.get(k).copied().unwrap_or(1.0))
            .collect();
        for _ in 0..8 {
            let curve = fleet_curve(&workers, &factors);
            for (f, (_, s)) in factors.iter_mut().zip(&workers) {
                // The factor that best maps this worker's times onto the curve.
                let fit = (curve.0 * s.t + curve.1 * s.tx) / s.tt;
                *f = if fit.is_finite() && fit > 0.0 {
                    fit
                } else {
                    1.0
                };
            }
            let scale = 1.0 / median(&factors);
            for f in &mut factors {
                *f *= scale;
            }
        }
        self.curve = fleet_curve(&workers, &factors);
        self.fitted = workers.iter().map(|(k, _)| *k).zip(factors).collect();
    }
}

/// The median of positive factors, the middle two's geometric mean when
/// their number is even (1 for none).
fn median(factors: &[f64]) -> f64 {
    let mut sorted = factors.to_vec();
    sorted.sort_by(f64::total_cmp);
    let mid = sorted.len() / 2;
    match sorted.len() {
        0 => 1.0,
        n if n % 2 == 1 => sorted[mid],
        _ => (sorted[mid - 1] * sorted[mid]).sqrt(),
    }
}

/// The least-squares line through every worker's observations, each time
/// scaled by its worker's factor: `(a, b)` of `t × factor = a + b × x`.
fn fleet_curve<K>(workers: &[(K, Sums)], factors: &[f64]) -> (f64, f64) {
    let (mut n, mut x, mut xx, mut y, mut xy) = (0.0, 0.0, 0.0, 0.0, 0.0);
    for ((_, s), f) in workers.iter().zip(factors) {
        n += s.n;
        x += s.x;
        xx += s.xx;
        y += f * s.t;
        xy += f * s.tx;
    }
    let spread = n * xx - x * x;
    // Loads that hardly vary fix no slope: the curve is then flat.
    if n <= 0.0 || spread <= 1e-9 * n * xx.max(1.0) {
        return (if n > 0.0 { y / n } else { 0.0 }, 0.0);
    }
    let b = (n * xy - x * y) / spread;
    ((y - b * x) / n, b)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::rng::SplitMix64;

    /// Engine `i` decodes at `(6 + 0.02 × load) / speed[i]` ms a token, with
    /// ±`noise` relative jitter, under loads that fall as the engine slows
    /// (as they do when a router sends a slow engine less).
    fn learn(speeds: &[f64], noise: f64, rounds: usize) -> SpeedLearner<usize> {
        let mut learner = SpeedLearner::new(SpeedConfig::default());
        let mut rng = SplitMix64::new(7);
        for _ in 0..rounds {
            for (i, &s) in speeds.iter().enumerate() {
                let load = 200.0 + 600.0 * s.min(1.0) * rng.next_f64();
                let jitter = 1.0 + noise * (2.0 * rng.next_f64() - 1.0);
                learner.observe(i, load, (6.0 + 0.02 * load) / s * jitter);
            }
        }
        learner
    }

    #[test]
    fn a_half_speed_engine_is_found_although_its_lighter_load_makes_it_look_faster() {
        let learner = learn(&[1.0, 1.0, 1.0, 0.5], 0.1, 200);
        let slow = learner.speed(3).expect("learned");
        assert!((slow - 0.5).abs() < 0.05, "{slow}");
        assert_eq!(learner.speed(0), Some(1.0));
        let curve = learner.reference_ms_per_token(500.0) / learner.reference_ms_per_token(0.0);
        assert!((curve - 16.0 / 6.0).abs() < 0.3, "{curve}");
    }

    #[test]
    fn equal_engines_learn_no_difference_and_too_few_observations_learn_nothing() {
        let learner = learn(&[1.0, 1.0, 1.0, 1.0], 0.3, 200);
        for i in 0..4 {
            assert_eq!(learner.speed(i), Some(1.0));
        }
        let early = learn(&[1.0, 0.5], 0.0, 4);
        assert_eq!(early.speed(0), None);
        assert_eq!(early.speed(1), None);
    }

    #[test]
    fn an_engine_that_slows_down_is_followed() {
        let mut learner = learn(&[1.0, 1.0, 1.0, 1.0], 0.05, 100);
        assert_eq!(learner.speed(2), Some(1.0));
        for round in 0..200 {
            for i in 0..4 {
                let s = if i == 2 { 0.25 } else { 1.0 };
                let load = s * (300.0 + 50.0 * (i + round % 7) as f64);
                learner.observe(i, load, (6.0 + 0.02 * load) / s);
            }
        }
        let slow = learner.speed(2).expect("learned");
        assert!((slow - 0.25).abs() < 0.03, "{slow}");
        assert_eq!(learner.speed(0), Some(1.0));
    }

    #[test]
    fn a_worker_that_left_no_longer_sets_the_median() {
        let mut learner = learn(&[1.0, 0.5, 0.5], 0.0, 100);
        // The median is a slow worker: the fast one counts as twice as fast.
        assert!((learner.speed(0).expect("learned") - 2.0).abs() < 0.05);
        learner.retain(|k| k != 2);
        assert_eq!(learner.speed(2), None);
        let ratio = learner.speed(1).expect("learned") / learner.speed(0).expect("learned");
        assert!((ratio - 0.5).abs() < 0.05, "{ratio}");
    }

    #[test]
    fn times_that_are_not_numbers_are_ignored_and_speeds_stay_bounded() {
        let mut learner = SpeedLearner::new(SpeedConfig::default());
        for _ in 0..100 {
            learner.observe(0, 100.0, f64::NAN);
            learner.observe(0, f64::INFINITY, 5.0);
            learner.observe(1, 100.0, -1.0);
        }
        assert_eq!(learner.speed(0), None);
        assert_eq!(learner.speed(1), None);
        for _ in 0..100 {
            learner.observe(0, 100.0, 1.0);
            learner.observe(1, 100.0, 1e9);
        }
        let (lo, hi) = SpeedConfig::default().bounds;
        assert_eq!(learner.speed(1), Some(lo));
        assert_eq!(learner.speed(0), Some(hi));
    }
}
