//! A batch of simulations and their report: every job run on every core,
//! each run's result as a JSON object, and the table `kvroute bench sim`
//! prints of them.

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Mutex;

use serde_json::{json, Value};

use super::{simulate, SimConfig, SimLoad, SimReport};
use crate::error::{Error, Result};

/// One simulation to run: its policy's name, its seed, the router and fleet,
/// and the load.
pub type Job = (String, u64, SimConfig, SimLoad);

/// One run's result as a JSON object.
pub fn row(name: &str, seed: u64, r: &SimReport, cpu_ms: f64) -> Value {
    json!({
        "policy": name,
        "seed": seed,
        "report": r.report,
        "per_engine": r.per_engine,
        "prefilled_tokens": r.prefilled_tokens,
        "transferred_blocks": r.transferred_blocks,
        "fetches": r.fetches,
        "fetched_blocks": r.fetched_blocks,
        "fetch_misses": r.fetch_misses,
        "replicas": r.replicas,
        "replicated_blocks": r.replicated_blocks,
        "fetched_rate": fetched_rate(r),
        "steps": r.steps,
        "skipped_events": r.skipped_events,
        "sim_cpu_ms": cpu_ms,
    })
}

/// The share of prompt tokens received by fetches (0 without any).
fn fetched_rate(r: &SimReport) -> f64 {
    let prompt = r.report.prompt_tokens;
    if prompt == 0 {
        return 0.0;
    }
    r.fetched_tokens as f64 / prompt as f64
}

/// Runs every job on every core; results in the jobs' order.
pub fn run_all(jobs: &[Job]) -> Result<Vec<Value>> {
    let next = AtomicUsize::new(0);
    let results: Mutex<Vec<Option<Result<Value>>>> =
        Mutex::new((0..jobs.len()).map(|_| None).collect());
    let threads = std::thread::available_parallelism()
        .map_or(1, |n| n.get())
        .min(jobs.len().max(1));
    std::thread::scope(|s| {
        for _ in 0..threads {
            s.spawn(|| loop {
                let i = next.fetch_add(1, Ordering::Relaxed);
                let Some((name, seed, config, load)) = jobs.get(i) else {
                    break;
                };
                let started = std::time::Instant::now();
                let out = simulate(config, load)
                    .map(|r| row(name, *seed, &r, started.elapsed().as_secs_f64() * 1e3));
                if let Ok(mut slots) = results.lock() {
                    slots[i] = Some(out);
                }
            });
        }
    });
    let slots = results
        .into_inner()
        .map_err(|_| Error::Unexpected("a simulation panicked".into()))?;
    slots
        .into_iter()
        .map(|r| r.unwrap_or_else(|| Err(Error::Unexpected("a simulation did not finish".into()))))
        .collect()
}

/// One line per run, then the mean over seeds of each policy when there
/// are several; a prefill-side hit rate column when the runs measured one
/// (a prefill/decode fleet).
pub fn table(rows: &[Value], seeds: usize) -> String {
    use std::fmt::Write as _;
    let pd = rows
        .iter()
        .any(|r| r["report"]["prefill_hit_rate"].is_number());
    let fetched = rows.iter().any(|r| r["fetches"].as_u64() > Some(0));
    let mut out = format!("{:<34}{:>6}{:>8}", "policy", "seed", "hit");
    if pd {
        let _ = write!(out, "{:>8}", "pf hit");
    }
    if fetched {
        let _ = write!(out, "{:>8}", "fetched");
    }
    let _ = writeln!(
        out,
        "{:>10}{:>10}{:>10}{:>10}{:>10}{:>10}{:>9}  per engine",
        "ttft p50", "ttft p90", "ttft p99", "lat p50", "lat p99", "tpot p50", "cpu ms"
    );
    let f = |r: &Value, path: &[&str]| path.iter().fold(r, |v, k| &v[*k]).as_f64().unwrap_or(0.0);
    let line = |out: &mut String, name: &str, seed: &str, r: &[&Value]| {
        let mean =
            |path: &[&str]| r.iter().map(|v| f(v, path)).sum::<f64>() / r.len().max(1) as f64;
        let _ = write!(
            out,
            "{name:<34}{seed:>6}{:>8.4}",
            mean(&["report", "hit_rate"])
        );
        if pd {
            let _ = write!(out, "{:>8.4}", mean(&["report", "prefill_hit_rate"]));
        }
        if fetched {
            let _ = write!(out, "{:>8.4}", mean(&["fetched_rate"]));
        }
        let _ = write!(
            out,
            "{:>10.1}{:>10.1}{:>10.1}{:>10.1}{:>10.1}{:>10.2}{:>9.0}",
            mean(&["report", "ttft_ms", "p50"]),
            mean(&["report", "ttft_ms", "p90"]),
            mean(&["report", "ttft_ms", "p99"]),
            mean(&["report", "latency_ms", "p50"]),
            mean(&["report", "latency_ms", "p99"]),
            mean(&["report", "tpot_ms", "p50"]),
            mean(&["sim_cpu_ms"]),
        );
        if let [one] = r {
            let _ = write!(out, "  {}", one["per_engine"]);
        }
        out.push('\n');
    };
    for group in rows.chunks(seeds.max(1)) {
        for r in group {
            let name = r["policy"].as_str().unwrap_or("?");
            line(
                &mut out,
                name,
                &r["seed"].to_string(),
                std::slice::from_ref(&r),
            );
        }
        if group.len() > 1 {
            let name = group[0]["policy"].as_str().unwrap_or("?");
            let refs: Vec<&Value> = group.iter().collect();
            line(&mut out, name, "mean", &refs);
        }
    }
    out.push_str("times in ms; hit = the engines' cached_tokens / prompt tokens, as clients see them; tpot = time per output token\n");
    if fetched {
        out.push_str("fetched = prompt tokens received from another engine by fetches / prompt tokens (in hit: not recomputed)\n");
    }
    if pd {
        out.push_str("pf hit = prompt tokens found cached on the engine that prefilled them / prompt tokens (a decode engine's received KV is no hit)\n");
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_pd_run_shows_its_prefill_side_hit_rate_and_every_run_its_tpot() {
        let row = |pf: Option<f64>| {
            let mut report = json!({
                "hit_rate": 0.99, "ttft_ms": {"p50": 50.0, "p90": 60.0, "p99": 70.0},
                "latency_ms": {"p50": 900.0, "p99": 990.0}, "tpot_ms": {"p50": 27.5, "p99": 30.0},
            });
            if let Some(pf) = pf {
                report["prefill_hit_rate"] = json!(pf);
            }
            json!({"policy": "kv", "seed": 1, "report": report, "per_engine": [1, 2], "sim_cpu_ms": 3.0})
        };
        let pd = table(&[row(Some(0.8125))], 1);
        let header = pd.lines().next().expect("a header");
        assert!(
            header.contains("pf hit") && header.contains("tpot p50"),
            "{pd}"
        );
        let line = pd.lines().nth(1).expect("a row");
        assert!(line.contains("0.8125") && line.contains("27.50"), "{pd}");
        let plain = table(&[row(None)], 1);
        assert!(
            !plain.contains("pf hit") && plain.contains("27.50"),
            "{plain}"
        );
    }
}
