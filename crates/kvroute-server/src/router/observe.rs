//! What routing did, kept for people to look at: the last routing decisions
//! with every candidate's cost terms (so "why did this go to w3?" has an
//! answer), running totals of routing quality, and the times to first token
//! and to the end of recent answers. The dashboard reads these; so do the
//! metrics that count the same things, so each number has one source.

use std::collections::{BTreeMap, VecDeque};
use std::sync::{Arc, Mutex, PoisonError};

use kvroute_core::index::DpRank;
use kvroute_core::scheduler::Scored;
use prometheus_client::collector::Collector;
use prometheus_client::encoding::DescriptorEncoder;
use serde::Serialize;

use crate::metrics::{
    encode_rank_family, encode_single, RankLabels, PROXY_ROUTED, PROXY_ROUTED_ON_LOAD,
    QUALITY_CACHED_TOKENS, QUALITY_PREDICTED_TOKENS, QUALITY_PROMPT_TOKENS,
};

/// Decisions kept.
pub const DECISIONS_KEPT: usize = 50;

/// Candidates kept per decision, in the order they would be tried.
pub const CANDIDATES_KEPT: usize = 8;

/// Recent timings kept (enough for a few minutes at a few hundred req/s).
const TIMINGS_KEPT: usize = 8_192;

/// One rank a request could have gone to, as it was scored.
#[derive(Debug, Clone, Serialize)]
pub struct CandidateView {
    /// The worker.
    pub worker: Arc<str>,
    /// Its data-parallel rank.
    pub dp_rank: DpRank,
    /// Leading blocks of the request the index says the rank holds on the device.
    pub device_blocks: u32,
    /// The same in tokens.
    pub matched_tokens: u64,
    /// Requests in flight on the rank.
    pub active_requests: u64,
    /// Prompt tokens still to prefill on the rank.
    pub active_prefill_tokens: u64,
    /// Blocks the rank's requests in flight hold.
    pub active_decode_blocks: u64,
    /// Cost terms: prefill work, decode load, requests, and their total.
    pub prefill: f64,
    /// See `prefill`.
    pub decode_load: f64,
    /// See `prefill`.
    pub requests: f64,
    /// See `prefill`.
    pub total: f64,
    /// Over a busy threshold.
    pub overloaded: bool,
}

impl CandidateView {
    /// A scored rank of worker `worker`.
    pub fn of(s: &Scored, worker: Arc<str>) -> Self {
        let c = &s.candidate;
        CandidateView {
            worker,
            dp_rank: s.key.rank,
            device_blocks: c.device_blocks,
            matched_tokens: u64::from(c.device_blocks) * u64::from(s.block_size),
            active_requests: c.active_requests,
            active_prefill_tokens: c.active_prefill_tokens,
            active_decode_blocks: c.active_decode_blocks,
            prefill: s.cost.prefill,
            decode_load: s.cost.decode_load,
            requests: s.cost.requests,
            total: s.cost.total,
            overloaded: s.overloaded,
        }
    }
}

/// Why a request went where it went.
#[derive(Debug, Clone, Serialize)]
pub struct Decision {
    /// When, in milliseconds since the Unix epoch.
    pub at_ms: u64,
    /// The request's id.
    pub request_id: String,
    /// Prompt tokens (0 when the request was not tokenized).
    pub prompt_tokens: u64,
    /// The routing policy.
    pub policy: &'static str,
    /// The rank it was sent to (its index in `candidates`, which holds it).
    pub chosen: usize,
    /// Attempts before it (candidates that refused).
    pub retries: usize,
    /// The cache played no part: why (`None`: it did).
    pub load_only: Option<String>,
    /// The first candidates in the order they would be tried, and the chosen one.
    pub candidates: Vec<CandidateView>,
    /// In a disaggregated fleet: where each phase went and why.
    pub disagg: Option<String>,
    /// A migrated request's continuation: from which worker, after what,
    /// and why it moved.
    pub migrated: Option<String>,
}

impl Decision {
    /// In words: why the chosen rank won (made when shown, not per request).
    pub fn reason(&self) -> String {
        let mut reason = match (&self.load_only, self.candidates.get(self.chosen)) {
            (Some(why), _) => format!("routed on load alone ({why})"),
            (None, Some(c)) => format!(
                "lowest cost {:.1}: {} of {} prompt tokens cached, {} in flight",
                c.total, c.matched_tokens, self.prompt_tokens, c.active_requests
            ),
            (None, None) => "lowest cost".to_owned(),
        };
        if self.retries > 0 {
            reason.push_str(&format!(", after {} refused", self.retries));
        }
        if let Some(disagg) = &self.disagg {
            reason = format!("{disagg}; decode rank: {reason}");
        }
        if let Some(migrated) = &self.migrated {
            reason = format!("{migrated}; the continuation: {reason}");
        }
        reason
    }
}

/// Running totals since the start.
#[derive(Debug, Clone, Default)]
pub struct Totals {
    /// Requests sent to a worker, per (worker, rank).
    pub routed: BTreeMap<(Arc<str>, DpRank), u64>,
    /// Of those, routed without cache knowledge.
    pub routed_on_load: u64,
    /// Responses whose `cached_tokens` the engine reported.
    pub compared: u64,
    /// Of those, predicted exactly.
    pub exact: u64,
    /// Their prompt tokens.
    pub prompt_tokens: u64,
    /// The cached tokens the engines reported for them.
    pub cached_tokens: u64,
    /// The cached tokens the index predicted for them.
    pub predicted_tokens: u64,
}

/// One answer's timings.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Timing {
    /// When the answer ended, in milliseconds since the Unix epoch.
    pub at_ms: u64,
    /// Milliseconds to the first streamed chunk (`None`: not streamed).
    pub ttft_ms: Option<f64>,
    /// Milliseconds to the end of the answer.
    pub latency_ms: f64,
}

/// Everything kept; shared by the requests that write it and the pages
/// that read it.
#[derive(Debug, Default)]
pub struct Observed {
    decisions: Mutex<VecDeque<Decision>>,
    totals: Mutex<Totals>,
    timings: Mutex<VecDeque<Timing>>,
}

fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(PoisonError::into_inner)
}

impl Observed {
    /// Records a request sent to `decision.candidates[decision.chosen]`.
    pub fn routed(&self, decision: Decision) {
        {
            let mut totals = lock(&self.totals);
            if let Some(c) = decision.candidates.get(decision.chosen) {
                *totals
                    .routed
                    .entry((c.worker.clone(), c.dp_rank))
                    .or_default() += 1;
            }
            if decision.load_only.is_some() {
                totals.routed_on_load += 1;
            }
        }
        let mut ring = lock(&self.decisions);
        if ring.len() == DECISIONS_KEPT {
            ring.pop_front();
        }
        ring.push_back(decision);
    }

    /// Records an engine's `cached_tokens` for a response against the prediction.
    pub fn compared(&self, prompt_tokens: u64, predicted: u64, reported: u64) {
        let mut totals = lock(&self.totals);
        totals.compared += 1;
        totals.exact += u64::from(predicted == reported);
        totals.prompt_tokens += prompt_tokens;
        totals.cached_tokens += reported;
        totals.predicted_tokens += predicted;
    }

    /// Records an answer's timings.
    pub fn timed(&self, timing: Timing) {
        let mut ring = lock(&self.timings);
        if ring.len() == TIMINGS_KEPT {
            ring.pop_front();
        }
        ring.push_back(timing);
    }

    /// The decisions kept, newest first.
    pub fn decisions(&self) -> Vec<Decision> {
        lock(&self.decisions).iter().rev().cloned().collect()
    }

    /// The totals now.
    pub fn totals(&self) -> Totals {
        lock(&self.totals).clone()
    }

    /// Timings of answers that ended at or after `since_ms`.
    pub fn timings_since(&self, since_ms: u64) -> Vec<Timing> {
        lock(&self.timings)
            .iter()
            .filter(|t| t.at_ms >= since_ms)
            .copied()
            .collect()
    }
}

/// The routing totals as metrics (`kvroute_proxy_routed_*`,
/// `kvroute_quality_*`), read at scrape time.
#[derive(Debug)]
pub struct ObservedCollector {
    router: Arc<super::Router>,
}

impl ObservedCollector {
    /// A collector over `router`'s totals.
    pub fn new(router: Arc<super::Router>) -> Self {
        ObservedCollector { router }
    }
}

impl Collector for ObservedCollector {
    fn encode(&self, mut encoder: DescriptorEncoder) -> Result<(), std::fmt::Error> {
        encode_totals(&self.router.observed.totals(), &mut encoder)
    }
}

fn encode_totals(totals: &Totals, encoder: &mut DescriptorEncoder) -> Result<(), std::fmt::Error> {
    let rows: Vec<(RankLabels, u64)> = totals
        .routed
        .iter()
        .map(|((worker, dp_rank), &n)| {
            let labels = RankLabels {
                worker: worker.clone(),
                dp_rank: dp_rank.0,
            };
            (labels, n)
        })
        .collect();
    encode_rank_family(encoder, &PROXY_ROUTED, rows.iter().map(|(l, n)| (l, *n)))?;
    for (info, value) in [
        (PROXY_ROUTED_ON_LOAD, totals.routed_on_load),
        (QUALITY_PROMPT_TOKENS, totals.prompt_tokens),
        (QUALITY_CACHED_TOKENS, totals.cached_tokens),
        (QUALITY_PREDICTED_TOKENS, totals.predicted_tokens),
    ] {
        encode_single(encoder, &info, value)?;
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::listen::ConnectionMetrics;
    use crate::metrics::{Metrics, ProxyMetrics};

    fn decision(worker: &str, load_only: bool) -> Decision {
        Decision {
            at_ms: 1,
            request_id: "r".into(),
            prompt_tokens: 10,
            policy: "kv",
            chosen: 0,
            retries: 0,
            load_only: load_only.then(|| "no tokens".to_owned()),
            candidates: vec![CandidateView {
                worker: worker.into(),
                dp_rank: DpRank(0),
                device_blocks: 1,
                matched_tokens: 16,
                active_requests: 0,
                active_prefill_tokens: 0,
                active_decode_blocks: 0,
                prefill: 1.0,
                decode_load: 0.0,
                requests: 0.0,
                total: 1.0,
                overloaded: false,
            }],
            disagg: None,
            migrated: None,
        }
    }

    #[test]
    fn the_ring_keeps_the_newest_decisions_and_the_totals_count_them_all() {
        let observed = Observed::default();
        for i in 0..DECISIONS_KEPT + 5 {
            observed.routed(decision(if i % 2 == 0 { "w0" } else { "w1" }, i < 3));
        }
        let kept = observed.decisions();
        assert_eq!(kept.len(), DECISIONS_KEPT);
        assert_eq!(
            kept[0].reason(),
            "lowest cost 1.0: 16 of 10 prompt tokens cached, 0 in flight"
        );
        let mut refused = decision("w0", true);
        refused.retries = 2;
        assert_eq!(
            refused.reason(),
            "routed on load alone (no tokens), after 2 refused"
        );
        // Newest first: the last one routed went to w0 (an even index).
        assert_eq!(&*kept[0].candidates[0].worker, "w0");
        let totals = observed.totals();
        assert_eq!(
            totals.routed.values().sum::<u64>(),
            (DECISIONS_KEPT + 5) as u64
        );
        assert_eq!(totals.routed_on_load, 3);
        observed.compared(100, 64, 48);
        let totals = observed.totals();
        assert_eq!(
            (
                totals.prompt_tokens,
                totals.cached_tokens,
                totals.predicted_tokens
            ),
            (100, 48, 64)
        );
        observed.timed(Timing {
            at_ms: 5,
            ttft_ms: Some(3.0),
            latency_ms: 9.0,
        });
        observed.timed(Timing {
            at_ms: 9,
            ttft_ms: None,
            latency_ms: 2.0,
        });
        assert_eq!(observed.timings_since(6).len(), 1);
    }

    /// A collector that encodes fixed totals, as `ObservedCollector` does a router's.
    #[derive(Debug)]
    struct Fixed(Totals);

    impl Collector for Fixed {
        fn encode(&self, mut encoder: DescriptorEncoder) -> Result<(), std::fmt::Error> {
            encode_totals(&self.0, &mut encoder)
        }
    }

    #[test]
    fn routed_requests_are_counted_per_rank_in_both_formats() {
        let observed = Observed::default();
        observed.routed(decision("w0", false));
        observed.routed(decision("w0", true));
        observed.compared(100, 64, 48);
        let collector: Box<dyn Collector> = Box::new(Fixed(observed.totals()));
        let metrics = Metrics::new(
            &ProxyMetrics::default(),
            &ConnectionMetrics::default(),
            vec![collector],
        );
        let (kind, text) = metrics.render(Some("text/plain"));
        assert!(kind.starts_with("text/plain"));
        assert!(
            text.contains("# TYPE kvroute_proxy_routed_total counter"),
            "{text}"
        );
        assert!(text.contains("kvroute_proxy_routed_total{worker=\"w0\",dp_rank=\"0\"} 2"));
        assert!(text.contains("kvroute_proxy_routed_on_load_total 1"));
        assert!(text.contains("kvroute_quality_cached_tokens_total 48"));
        let (kind, text) = metrics.render(Some("application/openmetrics-text;version=1.0.0"));
        assert!(kind.starts_with("application/openmetrics-text"));
        assert!(
            text.contains("# TYPE kvroute_proxy_routed counter"),
            "{text}"
        );
        assert!(text.contains("kvroute_proxy_routed_total{worker=\"w0\",dp_rank=\"0\"} 2"));
        assert!(text.ends_with("# EOF\n"));
    }
}
