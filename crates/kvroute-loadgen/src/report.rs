//! Results: one [`PolicyReport`] per routing policy, a [`Report`] of them,
//! and the table that prints them (the plot is [`crate::plot`]).

use std::fmt::Write as _;

use serde::ser::SerializeMap;
use serde::{Serialize, Serializer};
use serde_json::Value;

use crate::stats::{Percentiles2, Percentiles3};

/// What one run of a workload against one policy (endpoint) measured.
///
/// Rates are over successful requests; `requests` counts every request
/// started, `failed` those of them that failed.
#[derive(Debug, Clone, Default, PartialEq, Serialize)]
pub struct PolicyReport {
    /// Cached prompt tokens / prompt tokens, from the engines'
    /// `usage.prompt_tokens_details.cached_tokens`.
    pub hit_rate: f64,
    /// Time to first token, ms (from the scheduled start in open loop).
    pub ttft_ms: Percentiles3,
    /// Time to the end of the response, ms.
    pub latency_ms: Percentiles2,
    /// Time per output token after the first, ms: (latency − TTFT) /
    /// (output tokens − 1), over requests that generated at least two.
    pub tpot_ms: Percentiles2,
    /// Generated tokens per second of the whole run.
    pub output_tokens_per_s: f64,
    /// Requests started.
    pub requests: u64,
    /// Of those, requests that failed (non-2xx, transport error, broken stream).
    pub failed: u64,
    /// Attempts sent again to another URL after a refused connection
    /// (`Endpoint::Balanced` only; 0 otherwise): the failures a load
    /// balancer hid from the client.
    pub retried: u64,
    /// Prompt tokens of the successful requests.
    pub prompt_tokens: u64,
    /// Of those, tokens served from a prefix cache.
    pub cached_tokens: u64,
    /// Wall time of the run, s.
    pub duration_s: f64,
    /// `images` only: hit rate over text-only chats sent before.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub text_repeat_hit_rate: Option<f64>,
    /// `images` only: hit rate over requests repeating an image.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub image_repeat_hit_rate: Option<f64>,
    /// When the target is kvroute: its index's exact predictions of
    /// `cached_tokens` per compared response during the run.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub index_accuracy: Option<f64>,
    /// A disaggregated fleet's prefill-side hit rate: prompt tokens no
    /// engine had to compute (found in the cache of the engine that
    /// prefilled them) over prompt tokens, from the engines' own counters.
    /// The client's `hit_rate` counts the KV a decode engine received as
    /// cached, so only this one shows where prefill went.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub prefill_hit_rate: Option<f64>,
    /// This hit rate / the oracle's, when the report has an `oracle` policy.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub hit_rate_vs_oracle: Option<f64>,
    /// A router with the fetch lever on (`kv-fetch`): the prefixes it moved
    /// from busy holders to cooler ranks during the run, from its counters.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub fetches: Option<Fetches>,
    /// (s since start, TTFT ms) of every successful request, by start time (for plots).
    #[serde(skip)]
    pub timeline: Vec<(f64, f64)>,
}

/// What a router's fetch lever did during a run (`kvroute_proxy_fetches_total`
/// and `kvroute_proxy_fetched_blocks_total`, summed over its replicas).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize)]
pub struct Fetches {
    /// Requests that ran on a cooler rank which read their prefix from its
    /// busy holder (`handed_off`).
    pub handed_off: u64,
    /// Fetches whose hand-off failed: the receiver recomputed the prefix.
    pub fell_back: u64,
    /// Blocks the handed-off fetches moved (as the placer planned them).
    pub blocks: u64,
    /// Hot prefixes copied ahead of demand to a second rank
    /// (`kvroute_proxy_replications_total{outcome="copied"}`; 0 unless
    /// the router replicates).
    #[serde(skip_serializing_if = "is_zero")]
    pub copies: u64,
    /// Blocks those copies moved (`kvroute_proxy_replicated_blocks_total`).
    #[serde(skip_serializing_if = "is_zero")]
    pub copied_blocks: u64,
}

fn is_zero(n: &u64) -> bool {
    *n == 0
}

/// The policy whose hit rate the others are compared with.
pub const ORACLE: &str = "oracle";

/// A workload and its results per policy, in the order they ran.
///
/// Serializes as `{"workload": {...}, "policies": {"<name>": {...}, ...}}`.
#[derive(Debug, Clone, Default, PartialEq, Serialize)]
pub struct Report {
    /// The workload's description ([`crate::WorkloadSpec::describe`]).
    pub workload: Value,
    /// (policy name, report), in insertion order.
    #[serde(serialize_with = "as_map")]
    pub policies: Vec<(String, PolicyReport)>,
}

fn as_map<S: Serializer>(policies: &[(String, PolicyReport)], s: S) -> Result<S::Ok, S::Error> {
    let mut map = s.serialize_map(Some(policies.len()))?;
    for (name, report) in policies {
        map.serialize_entry(name, report)?;
    }
    map.end()
}

impl Report {
    /// A report of `workload` with no policy yet.
    pub fn new(workload: Value) -> Self {
        Report {
            workload,
            policies: Vec::new(),
        }
    }

    /// Adds (or replaces) a policy's results, and refreshes every policy's
    /// `hit_rate_vs_oracle` when an `oracle` policy is present.
    pub fn push(&mut self, name: impl Into<String>, report: PolicyReport) {
        let name = name.into();
        match self.policies.iter_mut().find(|(n, _)| *n == name) {
            Some(slot) => slot.1 = report,
            None => self.policies.push((name, report)),
        }
        let oracle = self.get(ORACLE).map(|r| r.hit_rate);
        for (_, r) in &mut self.policies {
            r.hit_rate_vs_oracle = oracle.filter(|&o| o > 0.0).map(|o| r.hit_rate / o);
        }
    }

    /// A policy's results.
    pub fn get(&self, name: &str) -> Option<&PolicyReport> {
        self.policies
            .iter()
            .find(|(n, _)| n == name)
            .map(|(_, r)| r)
    }
}

fn opt_pct(v: Option<f64>) -> String {
    v.map_or_else(|| "-".into(), |v| format!("{:.1}%", v * 100.0))
}

/// The per-policy table: one row per policy, then a line of units.
pub fn table(report: &Report) -> String {
    let mut out = String::new();
    let name = report.workload["name"].as_str().unwrap_or("workload");
    let _ = writeln!(out, "workload {name}: {}", report.workload);
    let images = report
        .policies
        .iter()
        .any(|(_, r)| r.text_repeat_hit_rate.is_some());
    let disagg = report
        .policies
        .iter()
        .any(|(_, r)| r.prefill_hit_rate.is_some());
    let fetched = report.policies.iter().any(|(_, r)| r.fetches.is_some());
    let _ = write!(out, "{:<14}", "policy");
    if disagg {
        let _ = write!(out, "{:>9}", "pf hit");
    }
    let _ = write!(
        out,
        "{:>8}{:>9}{:>10}{:>10}{:>10}{:>10}{:>10}{:>9}{:>10}{:>8}{:>8}{:>8}{:>9}",
        "hit",
        "vs orc",
        "ttft p50",
        "ttft p90",
        "ttft p99",
        "lat p50",
        "lat p99",
        "tpot p50",
        "out tok/s",
        "reqs",
        "failed",
        "retried",
        "idx acc"
    );
    if images {
        let _ = write!(out, "{:>9}{:>9}", "txt rep", "img rep");
    }
    if fetched {
        let _ = write!(
            out,
            "{:>9}{:>10}{:>10}",
            "fetched", "fetch blk", "fell back"
        );
    }
    out.push('\n');
    for (name, r) in &report.policies {
        let _ = write!(out, "{name:<14}");
        if disagg {
            let _ = write!(out, "{:>9}", opt_pct(r.prefill_hit_rate));
        }
        let _ = write!(
            out,
            "{:>8}{:>9}{:>10.1}{:>10.1}{:>10.1}{:>10.1}{:>10.1}{:>9.2}{:>10.1}{:>8}{:>8}{:>8}{:>9}",
            format!("{:.1}%", r.hit_rate * 100.0),
            opt_pct(r.hit_rate_vs_oracle),
            r.ttft_ms.p50,
            r.ttft_ms.p90,
            r.ttft_ms.p99,
            r.latency_ms.p50,
            r.latency_ms.p99,
            r.tpot_ms.p50,
            r.output_tokens_per_s,
            r.requests,
            r.failed,
            r.retried,
            opt_pct(r.index_accuracy),
        );
        if images {
            let _ = write!(
                out,
                "{:>9}{:>9}",
                opt_pct(r.text_repeat_hit_rate),
                opt_pct(r.image_repeat_hit_rate)
            );
        }
        if fetched {
            let cell = |v: Option<u64>| v.map_or_else(|| "-".to_owned(), |v| v.to_string());
            let f = r.fetches;
            let _ = write!(
                out,
                "{:>9}{:>10}{:>10}",
                cell(f.map(|f| f.handed_off)),
                cell(f.map(|f| f.blocks)),
                cell(f.map(|f| f.fell_back))
            );
        }
        out.push('\n');
    }
    out.push_str("times in ms; hit = cached / prompt tokens; vs orc = hit / the oracle's hit; tpot = time per output token\n");
    if disagg {
        out.push_str("pf hit = prompt tokens found cached where they were prefilled / prompt tokens (the engines' counters)\n");
    }
    if fetched {
        out.push_str("fetched = requests whose prefix moved from a busy holder to a cooler rank, fetch blk = blocks moved, fell back = fetches recomputed instead (the router's counters)\n");
    }
    out
}

#[cfg(test)]
pub(crate) mod tests {
    use super::*;
    use serde_json::json;

    /// A policy's results with hit rate `hit` and two timeline points.
    pub(crate) fn policy(hit: f64) -> PolicyReport {
        PolicyReport {
            hit_rate: hit,
            ttft_ms: Percentiles3 {
                p50: 10.0,
                p90: 20.0,
                p99: 30.0,
            },
            requests: 5,
            timeline: vec![(0.0, 10.0), (1.5, 30.0)],
            ..PolicyReport::default()
        }
    }

    #[test]
    fn the_json_has_the_demo_report_shape_in_insertion_order() {
        let mut r = Report::new(json!({"name": "shared-prefix"}));
        r.push("kv", policy(0.45));
        r.push("round-robin", policy(0.15));
        r.push(ORACLE, policy(0.5));
        let v = serde_json::to_value(&r).expect("json");
        let names: Vec<&String> = v["policies"].as_object().expect("map").keys().collect();
        assert_eq!(names, ["kv", "round-robin", "oracle"]);
        let kv = &v["policies"]["kv"];
        for key in [
            "hit_rate",
            "ttft_ms",
            "latency_ms",
            "output_tokens_per_s",
            "requests",
            "failed",
            "retried",
        ] {
            assert!(kv.get(key).is_some(), "{key}");
        }
        assert_eq!(
            kv["ttft_ms"],
            json!({"p50": 10.0, "p90": 20.0, "p99": 30.0})
        );
        assert_eq!(kv["latency_ms"], json!({"p50": 0.0, "p99": 0.0}));
        assert!((kv["hit_rate_vs_oracle"].as_f64().expect("fraction") - 0.9).abs() < 1e-12);
        assert!(kv.get("timeline").is_none());
        assert!(kv.get("text_repeat_hit_rate").is_none());
        assert!(kv.get("index_accuracy").is_none());
        assert!(kv.get("fetches").is_none());
        assert!(!table(&r).contains("fetched"));
        let mut fetching = policy(0.4);
        fetching.fetches = Some(Fetches {
            handed_off: 3,
            fell_back: 1,
            blocks: 57,
            ..Fetches::default()
        });
        r.push("kv-fetch", fetching);
        let v = serde_json::to_value(&r).expect("json");
        let counts = json!({"handed_off": 3, "fell_back": 1, "blocks": 57});
        assert_eq!(v["policies"]["kv-fetch"]["fetches"], counts);
        let shown = table(&r);
        let row = shown
            .lines()
            .find(|l| l.starts_with("kv-fetch"))
            .expect("row");
        assert!(row.trim_end().ends_with("3        57         1"), "{shown}");
        r.policies.retain(|(n, _)| n != "kv-fetch");
        // Replacing a policy keeps its place.
        r.push("kv", policy(0.25));
        assert_eq!(r.policies[0].0, "kv");
        assert_eq!(r.get("kv").map(|p| p.hit_rate), Some(0.25));
    }
}
