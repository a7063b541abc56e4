//! The SVG plot of a [`Report`]: hit rate per policy, TTFT percentiles per
//! policy, and every request's TTFT over time with a rolling median line.

use std::fmt::Write as _;
use std::path::Path;

use crate::error::{Error, Result};
use crate::report::Report;
use crate::stats;

/// Colours of successive policies in plots.
const COLOURS: [&str; 8] = [
    "#1f77b4", "#ff7f0e", "#2ca02c", "#d62728", "#9467bd", "#8c564b", "#e377c2", "#7f7f7f",
];

/// Most points drawn per policy on the TTFT-over-time panel.
const MAX_POINTS: usize = 3_000;

/// `s` escaped for SVG text and attributes.
pub fn esc(s: &str) -> String {
    s.replace('&', "&amp;")
        .replace('<', "&lt;")
        .replace('>', "&gt;")
        .replace('"', "&quot;")
}

/// A "nice" axis maximum ≥ `v` (1, 2 or 5 × 10^k).
pub fn nice_max(v: f64) -> f64 {
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

/// The plot as SVG text (see [`write_svg_plot`]): three panels under a title.
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
    hit_rate_panel(&mut s, report);
    let ymax = ttft_panel(&mut s, report);
    timeline_panel(&mut s, report, ymax);
    s.push_str("</svg>\n");
    s
}

/// Panel 1: hit rate per policy (x 60..440, y 60..300).
fn hit_rate_panel(s: &mut String, report: &Report) {
    let n = report.policies.len().max(1) as f64;
    let (x0, x1, y0, y1) = (60.0, 440.0, 60.0, 300.0);
    axes(s, x0, x1, y0, y1, "hit rate (%)", 100.0);
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
}

/// Panel 2: TTFT p50 / p90 / p99 per policy (x 540..920); returns the y
/// axis' top, which the timeline panel shares.
fn ttft_panel(s: &mut String, report: &Report) -> f64 {
    let n = report.policies.len().max(1) as f64;
    let (y0, y1) = (60.0, 300.0);
    let (x0, x1) = (540.0, 920.0);
    let top = report
        .policies
        .iter()
        .map(|(_, r)| r.ttft_ms.p99)
        .fold(0.0, f64::max);
    let ymax = nice_max(top);
    axes(s, x0, x1, y0, y1, "TTFT ms (p50, p90, p99)", ymax);
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
    ymax
}

/// Panel 3: every request's TTFT over time, with a rolling median line per
/// policy (x 60..920, y 380..660), on the TTFT panel's scale `ymax`.
fn timeline_panel(s: &mut String, report: &Report, ymax: f64) {
    let (x0, x1, y0, y1) = (60.0, 920.0, 380.0, 660.0);
    let tmax = nice_max(
        report
            .policies
            .iter()
            .filter_map(|(_, r)| r.timeline.last().map(|t| t.0))
            .fold(0.0, f64::max),
    );
    axes(
        s,
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
}

/// Requests in the rolling median of the TTFT-over-time panel.
const ROLLING_WINDOW: usize = 25;

/// Where a bar's policy name goes: every other name one line lower, so long
/// names side by side do not overlap.
fn label_y(axis_y: f64, i: usize) -> f64 {
    axis_y + if i.is_multiple_of(2) { 16.0 } else { 30.0 }
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
        stats::sort_samples(&mut buf);
        out.push((sorted[i].0, stats::median(&buf)));
    }
    out
}

/// Draws a panel's axes, its title, and the y axis' top value.
pub fn axes(s: &mut String, x0: f64, x1: f64, y0: f64, y1: f64, title: &str, ymax: f64) {
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
    use crate::report::table;
    use crate::report::tests::policy;
    use serde_json::json;

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
