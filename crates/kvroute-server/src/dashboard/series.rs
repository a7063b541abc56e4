//! Routing quality over the last minutes, one sample a second: what the
//! dashboard charts. Each sample is the difference between two readings of
//! the router's running totals, plus percentiles of the answers that ended
//! in the last few seconds. Plain data in, plain data out: the caller
//! supplies the readings and the clock.

use std::collections::{BTreeMap, VecDeque};
use std::sync::{Arc, Mutex, PoisonError};

use kvroute_core::index::DpRank;
use serde::Serialize;

use crate::router::observe::{Timing, Totals};

/// Samples kept: ten minutes at one a second.
pub const SAMPLES_KEPT: usize = 600;

/// Seconds of answers each sample's percentiles are taken over.
pub const WINDOW_SECS: u64 = 10;

/// One second of routing.
#[derive(Debug, Clone, Serialize, PartialEq)]
pub struct Sample {
    /// When it was taken, in milliseconds since the Unix epoch.
    pub t_ms: u64,
    /// Requests forwarded since the previous sample.
    pub routed: u64,
    /// Of those, routed on load alone.
    pub on_load: u64,
    /// Prompt tokens of responses compared with the engines' `cached_tokens`.
    pub prompt_tokens: u64,
    /// The cached tokens the engines reported for them.
    pub reported_tokens: u64,
    /// The cached tokens the index predicted for them.
    pub predicted_tokens: u64,
    /// Reported cached tokens over prompt tokens (`None`: nothing compared).
    pub hit_rate: Option<f64>,
    /// Time to first token of streamed answers of the last [`WINDOW_SECS`], ms.
    pub ttft_p50_ms: Option<f64>,
    /// See `ttft_p50_ms`.
    pub ttft_p99_ms: Option<f64>,
    /// Latency of the answers of the last [`WINDOW_SECS`], ms.
    pub latency_p99_ms: Option<f64>,
    /// Requests forwarded since the previous sample, per worker that took any.
    pub by_worker: BTreeMap<Arc<str>, u64>,
    /// The same per (worker, rank), for rates per rank.
    #[serde(skip)]
    pub by_rank: BTreeMap<(Arc<str>, DpRank), u64>,
}

/// The samples, and the reading the next one is taken against.
#[derive(Debug, Default)]
pub struct Series {
    inner: Mutex<Inner>,
}

#[derive(Debug, Default)]
struct Inner {
    last: Option<Totals>,
    samples: VecDeque<Sample>,
}

/// The `q` quantile (0 to 1) of `values`, by the nearest rank.
fn quantile(values: &mut [f64], q: f64) -> Option<f64> {
    if values.is_empty() {
        return None;
    }
    values.sort_by(f64::total_cmp);
    let rank = ((q * values.len() as f64).ceil() as usize).clamp(1, values.len());
    Some(values[rank - 1])
}

impl Series {
    /// Takes a sample at `now_ms` from a reading of the totals and the
    /// answers that ended in the last [`WINDOW_SECS`]. The first reading
    /// only sets the baseline.
    pub fn tick(&self, now_ms: u64, totals: Totals, recent: &[Timing]) {
        let mut inner = self.inner.lock().unwrap_or_else(PoisonError::into_inner);
        let Some(last) = inner.last.replace(totals.clone()) else {
            return;
        };
        let mut by_rank = BTreeMap::new();
        let mut by_worker: BTreeMap<Arc<str>, u64> = BTreeMap::new();
        for (key, &n) in &totals.routed {
            let d = n.saturating_sub(last.routed.get(key).copied().unwrap_or(0));
            // Only ranks that took requests: a large, mostly idle fleet
            // would otherwise repeat every rank in every sample.
            if d > 0 {
                by_rank.insert(key.clone(), d);
                *by_worker.entry(key.0.clone()).or_default() += d;
            }
        }
        let diff = |now: u64, then: u64| now.saturating_sub(then);
        let prompt_tokens = diff(totals.prompt_tokens, last.prompt_tokens);
        let reported_tokens = diff(totals.cached_tokens, last.cached_tokens);
        let mut ttft: Vec<f64> = recent.iter().filter_map(|t| t.ttft_ms).collect();
        let mut latency: Vec<f64> = recent.iter().map(|t| t.latency_ms).collect();
        let sample = Sample {
            t_ms: now_ms,
            routed: by_rank.values().sum(),
            on_load: diff(totals.routed_on_load, last.routed_on_load),
            prompt_tokens,
            reported_tokens,
            predicted_tokens: diff(totals.predicted_tokens, last.predicted_tokens),
            hit_rate: (prompt_tokens > 0).then(|| reported_tokens as f64 / prompt_tokens as f64),
            ttft_p50_ms: quantile(&mut ttft, 0.50),
            ttft_p99_ms: quantile(&mut ttft, 0.99),
            latency_p99_ms: quantile(&mut latency, 0.99),
            by_worker,
            by_rank,
        };
        if inner.samples.len() == SAMPLES_KEPT {
            inner.samples.pop_front();
        }
        inner.samples.push_back(sample);
    }

    /// The samples, oldest first.
    pub fn samples(&self) -> Vec<Sample> {
        let inner = self.inner.lock().unwrap_or_else(PoisonError::into_inner);
        inner.samples.iter().cloned().collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn totals(routed: &[(&str, u32, u64)], prompt: u64, cached: u64, on_load: u64) -> Totals {
        Totals {
            routed: routed
                .iter()
                .map(|&(w, r, n)| ((Arc::from(w), DpRank(r)), n))
                .collect(),
            routed_on_load: on_load,
            compared: 0,
            exact: 0,
            prompt_tokens: prompt,
            cached_tokens: cached,
            predicted_tokens: cached,
        }
    }

    #[test]
    fn a_sample_is_the_difference_of_two_readings() {
        let series = Series::default();
        series.tick(1_000, totals(&[("w0", 0, 5)], 100, 50, 0), &[]);
        assert!(
            series.samples().is_empty(),
            "the first reading is the baseline"
        );
        let recent: Vec<Timing> = (1..=100)
            .map(|i| Timing {
                at_ms: 1_500,
                ttft_ms: Some(f64::from(i)),
                latency_ms: 10.0 * f64::from(i),
            })
            .collect();
        series.tick(
            2_000,
            totals(&[("w0", 0, 8), ("w0", 1, 1), ("w1", 0, 2)], 300, 200, 1),
            &recent,
        );
        let s = &series.samples()[0];
        assert_eq!((s.t_ms, s.routed, s.on_load), (2_000, 6, 1));
        assert_eq!(s.by_worker[&Arc::<str>::from("w0")], 4);
        assert_eq!(s.by_worker[&Arc::<str>::from("w1")], 2);
        assert_eq!(s.hit_rate, Some(0.75));
        assert_eq!((s.ttft_p50_ms, s.ttft_p99_ms), (Some(50.0), Some(99.0)));
        assert_eq!(s.latency_p99_ms, Some(990.0));
        // Nothing compared in a second: no hit rate rather than a zero.
        series.tick(
            3_000,
            totals(&[("w0", 0, 8), ("w0", 1, 1), ("w1", 0, 2)], 300, 200, 1),
            &[],
        );
        assert_eq!(series.samples()[1].hit_rate, None);
        for t in 0..SAMPLES_KEPT as u64 {
            series.tick(4_000 + t, totals(&[], 300, 200, 1), &[]);
        }
        assert_eq!(series.samples().len(), SAMPLES_KEPT);
    }
}
