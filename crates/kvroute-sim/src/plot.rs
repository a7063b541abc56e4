//! The frontier plot of `kvroute bench sim --frontier`, drawn with the load
//! generator's SVG pieces ([`kvroute_loadgen::plot`]).

use std::fmt::Write as _;
use std::path::Path;

use kvroute_loadgen::plot::{axes, esc, nice_max};

use crate::error::{Error, Result};

/// Panels per row in the frontier plot.
const FRONTIER_COLUMNS: usize = 3;

/// The frontier plot of `kvroute bench sim --frontier`: one panel per case
/// (preset or trace, seed), latency p99 across and TTFT p99 up; every `kv`
/// setting a grey dot, the frontier's settings blue (a darker blue for a
/// higher hit rate, which each point's tooltip gives), kvroute's default
/// green, `sglang-cache-aware` an orange square and `dynamo` a red one.
pub fn svg_frontier(results: &[crate::frontier::CaseResult]) -> String {
    let (pw, ph) = (320.0, 260.0);
    let rows = results.len().div_ceil(FRONTIER_COLUMNS).max(1);
    let (w, h) = (pw * FRONTIER_COLUMNS as f64, 40.0 + ph * rows as f64);
    let mut s = String::new();
    let _ = writeln!(
        s,
        r#"<svg xmlns="http://www.w3.org/2000/svg" width="{w}" height="{h}" viewBox="0 0 {w} {h}" font-family="sans-serif" font-size="11">"#
    );
    let _ = writeln!(s, r#"<rect width="{w}" height="{h}" fill="white"/>"#);
    let _ = writeln!(
        s,
        r#"<text x="{}" y="22" text-anchor="middle" font-size="15">kvroute bench sim --frontier: TTFT p99 against latency p99 (ms)</text>"#,
        w / 2.0
    );
    for (k, r) in results.iter().enumerate() {
        let ox = pw * (k % FRONTIER_COLUMNS) as f64;
        let oy = 40.0 + ph * (k / FRONTIER_COLUMNS) as f64;
        frontier_panel(&mut s, r, (ox, oy, pw, ph));
    }
    s.push_str("</svg>\n");
    s
}

/// One case's panel at `(x, y, width, height)`.
fn frontier_panel(
    s: &mut String,
    r: &crate::frontier::CaseResult,
    (ox, oy, pw, ph): (f64, f64, f64, f64),
) {
    let all = r.points.iter().chain(&r.baselines);
    let (xmax, ymax) = all.fold((0.0f64, 0.0f64), |(x, y), p| {
        (x.max(p.latency_p99), y.max(p.ttft_p99))
    });
    let (xmax, ymax) = (nice_max(xmax), nice_max(ymax));
    let (x0, x1, y0, y1) = (ox + 50.0, ox + pw - 15.0, oy + 25.0, oy + ph - 35.0);
    axes(s, x0, x1, y0, y1, "", ymax);
    let _ = writeln!(
        s,
        r#"<text x="{:.1}" y="{:.1}" text-anchor="middle" font-size="12">{} seed {}</text>"#,
        (x0 + x1) / 2.0,
        oy + 15.0,
        esc(&r.name),
        r.seed
    );
    let _ = writeln!(
        s,
        r#"<text x="{x1:.1}" y="{:.1}" text-anchor="end">latency p99 ≤ {xmax:.0}</text>"#,
        y1 + 24.0
    );
    let at = |p: &crate::frontier::Point| {
        (
            x0 + (p.latency_p99 / xmax).clamp(0.0, 1.0) * (x1 - x0),
            y1 - (p.ttft_p99 / ymax).clamp(0.0, 1.0) * (y1 - y0),
        )
    };
    let tip = |p: &crate::frontier::Point| {
        format!(
            "<title>{} hit {:.4} ttft p99 {:.1} lat p99 {:.1}</title>",
            esc(&p.label),
            p.hit,
            p.ttft_p99,
            p.latency_p99
        )
    };
    for (i, p) in r.points.iter().enumerate() {
        let (x, y) = at(p);
        let (radius, fill) = if i == 0 {
            (5.0, "#2ca02c".to_string())
        } else if r.frontier.contains(&i) {
            let shade = (255.0 * (1.0 - p.hit.clamp(0.0, 1.0))).round() as u8;
            (4.0, format!("rgb({shade},{shade},220)"))
        } else {
            (2.0, "#bbb".to_string())
        };
        let _ = writeln!(
            s,
            r#"<circle cx="{x:.1}" cy="{y:.1}" r="{radius}" fill="{fill}" stroke="{}">{}</circle>"#,
            if r.frontier.contains(&i) {
                "#1f77b4"
            } else {
                "none"
            },
            tip(p)
        );
    }
    for (p, colour) in r.baselines.iter().zip(["#ff7f0e", "#d62728"]) {
        let (x, y) = at(p);
        let _ = writeln!(
            s,
            r#"<rect x="{:.1}" y="{:.1}" width="9" height="9" fill="{colour}">{}</rect><text x="{:.1}" y="{:.1}">{}</text>"#,
            x - 4.5,
            y - 4.5,
            tip(p),
            x + 7.0,
            y - 6.0,
            esc(&p.label)
        );
    }
}

/// Writes [`svg_frontier`] to `path`.
pub fn write_frontier_svg(path: &Path, results: &[crate::frontier::CaseResult]) -> Result<()> {
    std::fs::write(path, svg_frontier(results)).map_err(Error::io(format!(
        "writing the frontier plot {}",
        path.display()
    )))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_frontier_plot_draws_every_setting_and_names_each_baseline() {
        use crate::frontier::{CaseResult, Point};
        let p = |label: &str, hit: f64| Point {
            label: label.into(),
            hit,
            ttft_p99: 100.0,
            latency_p99: 500.0,
        };
        let r = CaseResult {
            name: "long".into(),
            seed: 1,
            points: vec![p("kv", 0.93), p("kv[t=0.05]", 0.9)],
            frontier: vec![0],
            baselines: vec![p("sglang-cache-aware", 0.9), p("dynamo", 0.8)],
        };
        let svg = svg_frontier(&[r]);
        assert!(svg.starts_with("<svg") && svg.trim_end().ends_with("</svg>"));
        assert_eq!(svg.matches("<circle").count(), 2);
        assert!(svg.contains(">sglang-cache-aware</text>") && svg.contains(">dynamo</text>"));
    }
}
