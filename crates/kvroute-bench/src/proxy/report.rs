//! What `kvroute bench proxy` reports: per concurrency, each path's
//! latency figures, what the router added, and the router's CPU time per
//! routed request; as a table or one JSON object per concurrency.

use std::fmt;

use serde::Serialize;
use serde_json::{json, Value};

use super::{Prompt, ProxyBenchConfig};
use crate::stats;

/// One path's figures: throughput and latency statistics in µs.
///
/// A percentile that only a larger sample could tell apart from the maximum
/// (p99 of fewer than 100 requests, p99.9 of fewer than 1,000) is `None`,
/// so that a maximum is never reported under a percentile's name.
#[derive(Debug, Clone, Copy, Serialize)]
pub struct PathFigures {
    /// Requests completed per second of the phase.
    pub rps: f64,
    /// Median latency.
    pub p50_us: f64,
    /// 90th percentile.
    pub p90_us: f64,
    /// 99th percentile.
    pub p99_us: Option<f64>,
    /// 99.9th percentile.
    pub p999_us: Option<f64>,
    /// The slowest request.
    pub max_us: f64,
    /// Requests completed.
    pub requests: u64,
}

impl PathFigures {
    /// The figures of `latencies_us`, completed in `secs`.
    pub(crate) fn of(latencies_us: Vec<f64>, secs: f64) -> Self {
        let lat = stats::sorted(latencies_us);
        PathFigures {
            rps: lat.len() as f64 / secs,
            p50_us: stats::percentile(&lat, 0.5),
            p90_us: stats::percentile(&lat, 0.9),
            p99_us: stats::resolved_percentile(&lat, 0.99),
            p999_us: stats::resolved_percentile(&lat, 0.999),
            max_us: stats::max(&lat),
            requests: lat.len() as u64,
        }
    }
}

/// The figures at one concurrency.
#[derive(Debug, Clone, Copy)]
pub struct ProxyRun {
    /// Requests in flight at once (per path; with `interleave`, per pair).
    pub concurrency: u64,
    /// Straight to the engines.
    pub direct: PathFigures,
    /// Through the router.
    pub proxy: PathFigures,
    /// CPU time (user + system) the router process used over the routed
    /// phase, s.
    pub router_cpu_s: f64,
    /// The router's exact predictions of the engines' `cached_tokens` per
    /// response compared during the routed phase.
    pub index_accuracy: Option<f64>,
}

impl ProxyRun {
    /// The router's CPU µs per routed request completed.
    pub fn router_cpu_us_per_request(&self) -> f64 {
        self.router_cpu_s * 1e6 / self.proxy.requests.max(1) as f64
    }
}

/// The benchmark's result: one [`ProxyRun`] per concurrency, in order.
#[derive(Debug, Clone)]
pub struct ProxyBenchReport {
    /// The settings it ran with.
    pub config: ProxyBenchConfig,
    /// Per concurrency.
    pub runs: Vec<ProxyRun>,
}

/// `a - b` when both are known.
fn minus(a: Option<f64>, b: Option<f64>) -> Option<f64> {
    Some(a? - b?)
}

/// A µs figure for the table: `-` when unknown.
fn cell(v: Option<f64>) -> String {
    v.map_or_else(|| "-".into(), |v| format!("{v:.0}"))
}

impl ProxyBenchReport {
    /// One JSON object per concurrency: the settings, `direct`, `proxy`,
    /// `added_us`, and the router's CPU.
    pub fn to_json(&self) -> Vec<Value> {
        let c = &self.config;
        self.runs
            .iter()
            .map(|run| {
                let (d, p) = (run.direct, run.proxy);
                let mut doc = json!({
                    "requests": c.requests, "concurrency": run.concurrency, "rate": c.rate,
                    "workers": c.pd.map_or(c.workers, |pd| pd.engines()), "interleave": c.interleave,
                    "pd": c.pd.map(|pd| pd.to_string()),
                    "direct": d,
                    "proxy": p,
                    "added_us": {
                        "p50": p.p50_us - d.p50_us,
                        "p90": p.p90_us - d.p90_us,
                        "p99": minus(p.p99_us, d.p99_us),
                    },
                    "router_cpu_s": run.router_cpu_s,
                    "router_cpu_us_per_request": run.router_cpu_us_per_request(),
                    "index_accuracy": run.index_accuracy,
                });
                match &c.prompt {
                    Prompt::TokenIds { tokens } => doc["prompt_tokens"] = json!(tokens),
                    Prompt::Text {
                        words,
                        tokenizer,
                        repeat,
                    } => {
                        doc["prompt_words"] = json!(words);
                        doc["tokenizer"] = json!(tokenizer.to_string());
                        doc["repeated_prompt"] = json!(repeat);
                    }
                }
                doc
            })
            .collect()
    }

    fn heading(&self, run: &ProxyRun) -> String {
        let c = &self.config;
        let prompt = match &c.prompt {
            Prompt::TokenIds { tokens } => format!("{tokens} prompt tokens"),
            Prompt::Text {
                words,
                tokenizer,
                repeat,
            } => {
                let which = if *repeat { ", one repeated" } else { "" };
                format!("{words}-word text prompts{which} ({tokenizer} tokenizer)")
            }
        };
        let mode = if c.rate > 0.0 {
            format!(", open loop at {} req/s", c.rate)
        } else if c.interleave {
            ", closed loop, paths interleaved".into()
        } else {
            ", closed loop".into()
        };
        let engines = match c.pd {
            Some(pd) => format!(
                "{} prefill + {} decode engines, every request split",
                pd.prefill, pd.decode
            ),
            None => format!("{} engines", c.workers),
        };
        format!(
            "{} requests, concurrency {}, {prompt}, {engines}{mode}",
            c.requests, run.concurrency
        )
    }
}

impl fmt::Display for ProxyBenchReport {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        for (i, run) in self.runs.iter().enumerate() {
            let (d, p) = (run.direct, run.proxy);
            if i > 0 {
                writeln!(f)?;
            }
            writeln!(f, "{}", self.heading(run))?;
            writeln!(
                f,
                "path      req/s      p50 µs    p90 µs    p99 µs  p99.9 µs    max µs"
            )?;
            for (name, s) in [("direct", d), ("proxy", p)] {
                writeln!(
                    f,
                    "{name:<8}{:>8.0}{:>11.0}{:>10.0}{:>10}{:>10}{:>10.0}",
                    s.rps,
                    s.p50_us,
                    s.p90_us,
                    cell(s.p99_us),
                    cell(s.p999_us),
                    s.max_us
                )?;
            }
            writeln!(
                f,
                "added   {:>8}{:>11.0}{:>10.0}{:>10}{:>10}",
                "",
                p.p50_us - d.p50_us,
                p.p90_us - d.p90_us,
                cell(minus(p.p99_us, d.p99_us)),
                cell(minus(p.p999_us, d.p999_us)),
            )?;
            writeln!(
                f,
                "router CPU: {:.0} µs per routed request ({:.2} s over {} requests); index accuracy {}",
                run.router_cpu_us_per_request(),
                run.router_cpu_s,
                p.requests,
                run.index_accuracy
                    .map_or_else(|| "-".into(), |a| format!("{:.1} %", a * 100.0))
            )?;
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::proxy::TokenizerSource;

    #[test]
    fn figures_name_the_max_and_leave_out_percentiles_too_few_requests_resolve() {
        let f = PathFigures::of((1..=50).map(f64::from).collect(), 2.0);
        assert_eq!(
            (f.rps, f.p50_us, f.max_us, f.requests),
            (25.0, 25.0, 50.0, 50)
        );
        assert_eq!((f.p99_us, f.p999_us), (None, None));
        let f = PathFigures::of((1..=1000).rev().map(f64::from).collect(), 1.0);
        assert_eq!((f.p99_us, f.p999_us), (Some(990.0), Some(999.0)));
    }

    #[test]
    fn each_concurrency_gets_a_json_object_and_a_table_block_with_the_router_cpu() {
        let figures = PathFigures::of((1..=200).map(f64::from).collect(), 1.0);
        let run = |concurrency| ProxyRun {
            concurrency,
            direct: figures,
            proxy: figures,
            router_cpu_s: 0.02,
            index_accuracy: Some(1.0),
        };
        let report = ProxyBenchReport {
            config: ProxyBenchConfig {
                router_exe: "kvroute".into(),
                workers: 2,
                pd: None,
                requests: 200,
                concurrency: vec![1, 8],
                rate: 0.0,
                prompt: Prompt::Text {
                    words: 512,
                    tokenizer: TokenizerSource::Builtin,
                    repeat: false,
                },
                speedup: 1.0,
                interleave: false,
            },
            runs: vec![run(1), run(8)],
        };
        let json = report.to_json();
        assert_eq!(json.len(), 2);
        assert_eq!(json[1]["concurrency"], 8);
        assert_eq!(json[0]["router_cpu_us_per_request"], 100.0);
        assert_eq!(json[0]["tokenizer"], "builtin");
        assert_eq!(json[0]["prompt_words"], 512);
        assert!(json[0].get("prompt_tokens").is_none());
        assert_eq!(json[0]["added_us"]["p99"], 0.0);
        let table = report.to_string();
        assert_eq!(
            table
                .matches("router CPU: 100 µs per routed request")
                .count(),
            2
        );
        assert!(table.contains("512-word text prompts (builtin tokenizer)"));
        assert!(table.contains("index accuracy 100.0 %"));
    }
}
