//! Results: one [`PolicyReport`] per routing policy, a [`Report`] of them,
//! a table on stdout, and an SVG plot.

use std::fmt::Write as _;
use std::path::Path;

use serde::ser::SerializeMap;
use serde::{Serialize, Serializer};
use serde_json::Value;

use crate::error::{Error, Result};
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
    /// Generated tokens per second of the whole run.
    pub output_tokens_per_s: f64,
    /// Requests started.
    pub requests: u64,
    /// Of those, requests that failed (non-2xx, transport error, broken stream).
    pub failed: u64,
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
    /// This hit rate / the oracle's, when the report has an `oracle` policy.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub hit_rate_vs_oracle: Option<f64>,
    /// (s since start, TTFT ms) of every successful request, by start time (for plots).
    #[serde(skip)]
    pub timeline: Vec<(f64, f64)>,
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
    let _ = write!(
        out,
        "{:<14}{:>8}{:>9}{:>10}{:>10}{:>10}{:>10}{:>10}{:>10}{:>8}{:>8}{:>9}",
        "policy",
        "hit",
        "vs orc",
        "ttft p50",
        "ttft p90",
        "ttft p99",
        "lat p50",
        "lat p99",
        "out tok/s",
        "reqs",
        "failed",
        "idx acc"
    );
    if images {
        let _ = write!(out, "{:>9}{:>9}", "txt rep", "img rep");
    }
    out.push('\n');
    for (name, r) in &report.policies {
        let _ = write!(
            out,
            "{name:<14}{:>8}{:>9}{:>10.1}{:>10.1}{:>10.1}{:>10.1}{:>10.1}{:>10.1}{:>8}{:>8}{:>9}",
            format!("{:.1}%", r.hit_rate * 100.0),
            opt_pct(r.hit_rate_vs_oracle),
            r.ttft_ms.p50,
            r.ttft_ms.p90,
            r.ttft_ms.p99,
            r.latency_ms.p50,
            r.latency_ms.p99,
            r.output_tokens_per_s,
            r.requests,
            r.failed,
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
        out.push('\n');
    }
    out.push_str("times in ms; hit = cached / prompt tokens; vs orc = hit / the oracle's hit\n");
    out
}

/// Colours of successive policies in plots.
const COLOURS: [&str; 8] = [
    "#1f77b4", "#ff7f0e", "#2ca02c", "#d62728", "#9467bd", "#8c564b", "#e377c2", "#7f7f7f",
];

/// Most points drawn per policy on the TTFT-over-time panel.
const MAX_POINTS: usize = 3_000;

fn esc(s: &str) -> String {
    s.replace('&', "&amp;")
        .replace('<', "&lt;")
        .replace('>', "&gt;")
        .replace('"', "&quot;")
}

/// A "nice" axis maximum ≥ `v` (1, 2 or 5 × 10^k).
fn nice_max(v: f64) -> f64 {
    if !(v.is_finite() && v > 0.0) {
        return 1.0;
    }
    let mag = 10f64.powf(v.log10().floor());
    [1.0, 2.0, 5.0, 10.0]
        .iter()
        .map(|m| m * mag)
        .find(|&m| m >= v)
        .unwrap_or(10.0 * mag)
}

/// The plot as SVG text (see [`write_svg_plot`]).
pub fn svg_plot(report: &Report) -> String {
    let (w, h) = (960.0, 720.0);
    let mut s = String::new();
    let _ = writeln!(
        s,
        r#"<svg xmlns="http://www.w3.org/2000/svg" width="{w}" height="{h}" viewBox="0 0 {w} {h}" font-family="sans-serif" font-size="12">"#
    );
    let _ = writeln!(s, r#"<rect width="{w}" height="{h}" fill="white"/>"#);
    let name = report.workload["name"].as_str().unwrap_or("workload");
    let _ = writeln!(
        s,
        r#"<text x="{}" y="22" text-anchor="middle" font-size="16">kvroute bench: {}</text>"#,
        w / 2.0,
        esc(name)
    );
    let n = report.policies.len().max(1) as f64;
    // Panel 1: hit rate per policy (x 60..440, y 50..300).
    let (x0, x1, y0, y1) = (60.0, 440.0, 60.0, 300.0);
    axes(&mut s, x0, x1, y0, y1, "hit rate (%)", 100.0);
    let slot = (x1 - x0) / n;
    for (i, (policy, r)) in report.policies.iter().enumerate() {
        let bh = (r.hit_rate.clamp(0.0, 1.0)) * (y1 - y0);
        let x = x0 + slot * i as f64 + slot * 0.15;
        let _ = writeln!(
            s,
            r#"<rect x="{x:.1}" y="{:.1}" width="{:.1}" height="{bh:.1}" fill="{}"/>"#,
            y1 - bh,
            slot * 0.7,
            COLOURS[i % COLOURS.len()]
        );
        let _ = writeln!(
            s,
            r#"<text x="{:.1}" y="{:.1}" text-anchor="middle">{:.1}%</text>"#,
            x + slot * 0.35,
            y1 - bh - 4.0,
            r.hit_rate * 100.0
        );
        let _ = writeln!(
            s,
            r#"<text x="{:.1}" y="{:.1}" text-anchor="middle">{}</text>"#,
            x + slot * 0.35,
            label_y(y1, i),
            esc(policy)
        );
    }
    // Panel 2: TTFT p50 / p90 / p99 per policy (x 540..920).
    let (x0, x1) = (540.0, 920.0);
    let top = report
        .policies
        .iter()
        .map(|(_, r)| r.ttft_ms.p99)
        .fold(0.0, f64::max);
    let ymax = nice_max(top);
    axes(&mut s, x0, x1, y0, y1, "TTFT ms (p50, p90, p99)", ymax);
    let slot = (x1 - x0) / n;
    for (i, (policy, r)) in report.policies.iter().enumerate() {
        let colour = COLOURS[i % COLOURS.len()];
        for (k, (v, opacity)) in [
            (r.ttft_ms.p50, 1.0),
            (r.ttft_ms.p90, 0.7),
            (r.ttft_ms.p99, 0.4),
        ]
        .into_iter()
        .enumerate()
        {
            let bw = slot * 0.8 / 3.0;
            let bh = (v / ymax).clamp(0.0, 1.0) * (y1 - y0);
            let x = x0 + slot * i as f64 + slot * 0.1 + bw * k as f64;
            let _ = writeln!(
                s,
                r#"<rect x="{x:.1}" y="{:.1}" width="{bw:.1}" height="{bh:.1}" fill="{colour}" fill-opacity="{opacity}"><title>{} p{}: {v:.1} ms</title></rect>"#,
                y1 - bh,
                esc(policy),
                [50, 90, 99][k]
            );
        }
        let _ = writeln!(
            s,
            r#"<text x="{:.1}" y="{:.1}" text-anchor="middle">{}</text>"#,
            x0 + slot * (i as f64 + 0.5),
            label_y(y1, i),
            esc(policy)
        );
    }
    // Panel 3: TTFT over time (x 60..920, y 380..660).
    let (x0, x1, y0, y1) = (60.0, 920.0, 380.0, 660.0);
    let tmax = nice_max(
        report
            .policies
            .iter()
            .filter_map(|(_, r)| r.timeline.last().map(|t| t.0))
            .fold(0.0, f64::max),
    );
    axes(
        &mut s,
        x0,
        x1,
        y0,
        y1,
        "TTFT ms over time (s since start; lines: median of the last 25 requests)",
        ymax,
    );
    let _ = writeln!(
        s,
        r#"<text x="{x1}" y="{:.1}" text-anchor="end">{tmax} s</text>"#,
        y1 + 16.0
    );
    for (i, (policy, r)) in report.policies.iter().enumerate() {
        let colour = COLOURS[i % COLOURS.len()];
        let stride = r.timeline.len().div_ceil(MAX_POINTS).max(1);
        let at = |t: f64, ttft: f64| {
            (
                x0 + (t / tmax).clamp(0.0, 1.0) * (x1 - x0),
                y1 - (ttft / ymax).clamp(0.0, 1.0) * (y1 - y0),
            )
        };
        let _ = writeln!(s, r#"<g fill="{colour}" fill-opacity="0.25">"#);
        for &(t, ttft) in r.timeline.iter().step_by(stride) {
            let (x, y) = at(t, ttft);
            let _ = writeln!(s, r#"<circle cx="{x:.1}" cy="{y:.1}" r="1.6"/>"#);
        }
        s.push_str("</g>\n");
        let points: Vec<String> = rolling_median(&r.timeline, ROLLING_WINDOW)
            .into_iter()
            .step_by(stride)
            .map(|(t, v)| {
                let (x, y) = at(t, v);
                format!("{x:.1},{y:.1}")
            })
            .collect();
        if points.len() > 1 {
            let _ = writeln!(
                s,
                r#"<polyline points="{}" fill="none" stroke="{colour}" stroke-width="2"/>"#,
                points.join(" ")
            );
        }
        let ly = y0 + 14.0 * i as f64;
        let _ = writeln!(
            s,
            r#"<rect x="{:.1}" y="{:.1}" width="10" height="10" fill="{colour}"/><text x="{:.1}" y="{:.1}">{}</text>"#,
            x1 - 120.0,
            ly - 9.0,
            x1 - 105.0,
            ly,
            esc(policy)
        );
    }
    s.push_str("</svg>\n");
    s
}

/// Requests in the rolling median of the TTFT-over-time panel.
const ROLLING_WINDOW: usize = 25;

/// Where a bar's policy name goes: every other name one line lower, so long
/// names side by side do not overlap.
fn label_y(axis_y: f64, i: usize) -> f64 {
    axis_y + if i % 2 == 0 { 16.0 } else { 30.0 }
}

/// For each point (in time order), the median of the last `window` values.
fn rolling_median(timeline: &[(f64, f64)], window: usize) -> Vec<(f64, f64)> {
    let mut sorted: Vec<(f64, f64)> = timeline.to_vec();
    sorted.sort_by(|a, b| a.0.total_cmp(&b.0));
    let mut out = Vec::with_capacity(sorted.len());
    let mut buf: Vec<f64> = Vec::with_capacity(window);
    for i in 0..sorted.len() {
        let from = (i + 1).saturating_sub(window.max(1));
        buf.clear();
        buf.extend(sorted[from..=i].iter().map(|p| p.1));
        buf.sort_by(f64::total_cmp);
        out.push((sorted[i].0, buf[buf.len() / 2]));
    }
    out
}

/// Draws a panel's axes, its title, and the y axis' top value.
fn axes(s: &mut String, x0: f64, x1: f64, y0: f64, y1: f64, title: &str, ymax: f64) {
    let _ = writeln!(
        s,
        r#"<path d="M{x0} {y0} L{x0} {y1} L{x1} {y1}" stroke="black" fill="none"/>"#
    );
    let _ = writeln!(
        s,
        r#"<text x="{x0}" y="{:.1}">{}</text>"#,
        y0 - 8.0,
        esc(title)
    );
    for k in 0..=4 {
        let v = ymax * k as f64 / 4.0;
        let y = y1 - (y1 - y0) * k as f64 / 4.0;
        let _ = writeln!(
            s,
            r##"<line x1="{x0}" y1="{y:.1}" x2="{x1}" y2="{y:.1}" stroke="#ddd"/><text x="{:.1}" y="{:.1}" text-anchor="end">{}</text>"##,
            x0 - 4.0,
            y + 4.0,
            if v >= 100.0 || v == v.trunc() {
                format!("{v:.0}")
            } else {
                format!("{v:.1}")
            }
        );
    }
}

/// Writes an SVG: hit rate per policy, TTFT percentiles per policy, and TTFT
/// of every request over time (one colour per policy).
pub fn write_svg_plot(path: &Path, report: &Report) -> Result<()> {
    std::fs::write(path, svg_plot(report))
        .map_err(Error::io(format!("writing the plot {}", path.display())))
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn policy(hit: f64) -> PolicyReport {
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
        // Replacing a policy keeps its place.
        r.push("kv", policy(0.25));
        assert_eq!(r.policies[0].0, "kv");
        assert_eq!(r.get("kv").map(|p| p.hit_rate), Some(0.25));
    }

    #[test]
    fn table_and_plot_name_every_policy() {
        let mut r = Report::new(json!({"name": "images"}));
        let mut p = policy(0.3);
        p.text_repeat_hit_rate = Some(0.9);
        p.image_repeat_hit_rate = Some(0.5);
        r.push("kv", p);
        r.push("a<b", policy(0.1));
        let t = table(&r);
        assert!(t.contains("kv") && t.contains("30.0%") && t.contains("img rep"));
        let svg = svg_plot(&r);
        assert!(svg.starts_with("<svg") && svg.trim_end().ends_with("</svg>"));
        assert!(svg.contains("a&lt;b") && !svg.contains("a<b"));
        assert_eq!(svg.matches("<circle").count(), 4);
    }

    #[test]
    fn the_rolling_median_follows_time_order_and_ignores_spikes() {
        let points = [
            (2.0, 10.0),
            (0.0, 10.0),
            (1.0, 10.0),
            (3.0, 500.0),
            (4.0, 10.0),
        ];
        let m = rolling_median(&points, 3);
        let times: Vec<f64> = m.iter().map(|p| p.0).collect();
        assert_eq!(times, [0.0, 1.0, 2.0, 3.0, 4.0]);
        assert!(m.iter().all(|p| p.1 == 10.0));
        assert!(rolling_median(&[], 3).is_empty());
    }

    #[test]
    fn nice_axis_maxima() {
        assert_eq!(nice_max(0.0), 1.0);
        assert_eq!(nice_max(3.0), 5.0);
        assert_eq!(nice_max(10.0), 10.0);
        assert_eq!(nice_max(101.0), 200.0);
        assert_eq!(nice_max(f64::NAN), 1.0);
    }
}
