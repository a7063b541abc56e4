//! `kvroute bench fairness`: how the overload queue shares a saturated
//! fleet between tenants and priorities, in real time.
//!
//! A `kvroute serve` child process routes to mock engines in this process,
//! with busy thresholds that keep each engine's own queue short (one
//! prefill at a time, a few requests per rank), so that waiting happens in
//! the router's queue, where the order is decided. Open-loop Poisson
//! arrivals of streamed requests with unique prompts (no cache hits); a
//! request's TTFT runs from its scheduled start to the first chunk of its
//! answer. Four phases per run, each `secs` long and drained before the
//! next (only requests scheduled after `warmup_secs` count):
//!
//! * `alone`: the small tenant alone at `rate`: the unloaded baseline;
//! * `one-tenant`: the small tenant's requests and ten times as many more
//!   (`ratio`), all under one tenant name: what arrival order gives;
//! * `two-tenants`: the same load, the small and the big tenant named
//!   apart: what weighted fair queueing gives;
//! * `priority`: `rate` of `x-priority: -1` and `ratio` times as many of
//!   `x-priority: 1`, under one tenant.
//!
//! Outside timing: starting the engines and the router, and the drain
//! between phases.

use std::path::PathBuf;
use std::sync::Arc;
use std::time::{Duration, Instant};

use kvroute_core::rng::SplitMix64;
use kvroute_mocker::MockerConfig;
use serde::Serialize;
use serde_json::{json, Value};

use super::child::RouterProcess;
use crate::embedded_router::wait_until_connected;
use crate::engines::Engines;
use crate::error::{Error, Result};
use crate::stats::{percentile, sorted, PoissonArrivals};

/// What `kvroute bench fairness` runs.
#[derive(Debug, Clone, Serialize)]
pub struct FairnessBenchConfig {
    /// The `kvroute` executable whose `serve` is measured.
    #[serde(skip)]
    pub router_exe: PathBuf,
    /// Mock engines (one rank each).
    pub workers: u16,
    /// Prompt tokens of every request (unique prompts).
    pub prompt_tokens: u32,
    /// Tokens each answer streams.
    pub max_tokens: u32,
    /// Divides the engines' simulated time (below 1: slower engines, so
    /// fewer requests saturate them and the load generator stays light).
    pub speedup: f64,
    /// Requests per second of the small tenant, and of the high priority.
    pub rate: f64,
    /// The big tenant's (and the low priority's) rate over `rate`.
    pub ratio: f64,
    /// Length of each phase, s.
    pub secs: f64,
    /// Requests scheduled in the first seconds of a phase are not counted.
    pub warmup_secs: f64,
    /// Runs of the four phases; the report gives each figure's median.
    pub runs: usize,
    /// `--busy-requests` of the router.
    pub busy_requests: u64,
    /// `--busy-prefill-tokens` of the router (1: one prefill per rank).
    pub busy_prefill_tokens: u64,
    /// `--queue-capacity` of the router.
    pub queue_capacity: usize,
    /// Seed of the arrivals and prompts.
    pub seed: u64,
}

/// One class of requests in a phase: who sends them, at what rate.
#[derive(Debug, Clone, Copy)]
struct Class {
    name: &'static str,
    tenant: &'static str,
    priority: i32,
    rate: f64,
}

/// What one class of one phase got.
#[derive(Debug, Clone, Serialize)]
pub struct ClassFigures {
    /// The phase.
    pub phase: &'static str,
    /// The class (`small`, `big`, `high`, `low`).
    pub class: &'static str,
    /// Requests per second sent.
    pub rate: f64,
    /// Requests counted (scheduled after the warm-up).
    pub requests: usize,
    /// Of them, refused with 429 (over their tenant's share).
    pub refused: usize,
    /// Of them, failed otherwise (status or connection).
    pub failed: usize,
    /// TTFT of those answered, ms: median.
    pub ttft_p50_ms: f64,
    /// TTFT, ms: 99th percentile.
    pub ttft_p99_ms: f64,
}

/// One request's outcome: its TTFT in ms, or its status.
enum Outcome {
    Answered(f64),
    Refused,
    Failed,
}

/// The phases: name and classes.
fn phases(config: &FairnessBenchConfig) -> [(&'static str, Vec<Class>); 4] {
    let (r, big) = (config.rate, config.rate * config.ratio);
    let class = |name, tenant, priority, rate| Class {
        name,
        tenant,
        priority,
        rate,
    };
    [
        ("alone", vec![class("small", "small", 0, r)]),
        (
            "one-tenant",
            vec![
                class("small", "shared", 0, r),
                class("big", "shared", 0, big),
            ],
        ),
        (
            "two-tenants",
            vec![class("small", "small", 0, r), class("big", "big", 0, big)],
        ),
        (
            "priority",
            vec![
                class("high", "shared", -1, r),
                class("low", "shared", 1, big),
            ],
        ),
    ]
}

/// Sends one streamed request at `start` and times its first chunk.
async fn one(
    client: reqwest::Client,
    url: Arc<str>,
    body: Value,
    class: Class,
    start: Instant,
) -> Outcome {
    tokio::time::sleep_until(start.into()).await;
    let sent = client
        .post(&*url)
        .header("x-tenant", class.tenant)
        .header("x-priority", class.priority.to_string())
        .json(&body)
        .send()
        .await;
    let Ok(resp) = sent else {
        return Outcome::Failed;
    };
    match resp.status().as_u16() {
        200 => {}
        429 => return Outcome::Refused,
        _ => return Outcome::Failed,
    }
    let mut resp = resp;
    let ttft = match resp.chunk().await {
        Ok(Some(_)) => start.elapsed().as_secs_f64() * 1e3,
        _ => return Outcome::Failed,
    };
    loop {
        match resp.chunk().await {
            Ok(Some(_)) => {}
            Ok(None) => return Outcome::Answered(ttft),
            Err(_) => return Outcome::Failed,
        }
    }
}

/// A request body with a prompt of unique token ids.
fn body(config: &FairnessBenchConfig, rng: &mut SplitMix64) -> Value {
    let prompt: Vec<u32> = (0..config.prompt_tokens)
        .map(|_| 1 + (rng.next_u64() % 30_000) as u32)
        .collect();
    json!({
        "model": "mock-model",
        "prompt": prompt,
        "max_tokens": config.max_tokens,
        "stream": true,
    })
}

/// Runs one phase: every class's arrivals for `secs`, then waits for all.
async fn phase(
    config: &FairnessBenchConfig,
    url: &Arc<str>,
    (name, classes): (&'static str, &[Class]),
    seed: u64,
) -> Result<Vec<ClassFigures>> {
    let client = crate::driver::client()?;
    let begin = Instant::now() + Duration::from_millis(200);
    let mut tasks = Vec::new();
    for (k, class) in classes.iter().enumerate() {
        let mut arrivals = PoissonArrivals::new(class.rate, seed ^ ((k as u64 + 1) * 0x9e37));
        let mut rng = SplitMix64::new(seed.wrapping_mul(31).wrapping_add(k as u64));
        loop {
            let at = arrivals.next_arrival();
            if at >= config.secs {
                break;
            }
            let start = begin + Duration::from_secs_f64(at);
            let request = one(
                client.clone(),
                url.clone(),
                body(config, &mut rng),
                *class,
                start,
            );
            tasks.push((k, at >= config.warmup_secs, tokio::spawn(request)));
        }
    }
    let mut outcomes: Vec<Vec<Outcome>> = classes.iter().map(|_| Vec::new()).collect();
    for (k, counted, task) in tasks {
        let outcome = task
            .await
            .map_err(|e| Error::Unexpected(format!("a request task: {e}")))?;
        if counted {
            outcomes[k].push(outcome);
        }
    }
    Ok(classes
        .iter()
        .zip(outcomes)
        .map(|(class, outcomes)| figures(name, class, &outcomes))
        .collect())
}

/// A class's figures from its outcomes.
fn figures(phase: &'static str, class: &Class, outcomes: &[Outcome]) -> ClassFigures {
    let ttft = sorted(
        outcomes
            .iter()
            .filter_map(|o| match o {
                Outcome::Answered(ms) => Some(*ms),
                _ => None,
            })
            .collect(),
    );
    let count = |f: fn(&Outcome) -> bool| outcomes.iter().filter(|o| f(o)).count();
    ClassFigures {
        phase,
        class: class.name,
        rate: class.rate,
        requests: outcomes.len(),
        refused: count(|o| matches!(o, Outcome::Refused)),
        failed: count(|o| matches!(o, Outcome::Failed)),
        ttft_p50_ms: percentile(&ttft, 0.5),
        ttft_p99_ms: percentile(&ttft, 0.99),
    }
}

/// The router's flags for `config`.
fn router_flags(config: &FairnessBenchConfig) -> Vec<String> {
    let mut flags: Vec<String> = [
        "--busy-requests",
        &config.busy_requests.to_string(),
        "--busy-prefill-tokens",
        &config.busy_prefill_tokens.to_string(),
        "--queue-capacity",
        &config.queue_capacity.to_string(),
        "--queue-timeout-ms",
        "120000",
        // The load generator is the gateway that names the tenants and
        // priorities.
        "--trust-tenant-header",
    ]
    .map(String::from)
    .to_vec();
    for tenant in ["small", "big", "shared"] {
        flags.extend(["--tenant-weight".to_owned(), format!("{tenant}=1")]);
    }
    flags
}

/// Runs the benchmark: every phase `runs` times.
pub async fn run(config: &FairnessBenchConfig) -> Result<FairnessReport> {
    let positive = [config.rate, config.ratio, config.speedup];
    if !(positive.iter().all(|&x| x > 0.0) && config.secs > config.warmup_secs) {
        return Err(Error::Invalid(
            "rate, ratio and speedup must be positive, and secs longer than the warm-up".into(),
        ));
    }
    let mut mocker = MockerConfig {
        workers: config.workers,
        port: 0,
        kv_events_port: 0,
        replay_port: 0,
        ..MockerConfig::default()
    };
    mocker.timing.speedup = config.speedup;
    let fleet = Engines::start(mocker, None).await?;
    let (exe, specs, flags) = (
        config.router_exe.clone(),
        fleet.worker_args(),
        router_flags(config),
    );
    let router = tokio::task::spawn_blocking(move || RouterProcess::spawn(&exe, &specs, &flags))
        .await
        .map_err(|e| Error::Unexpected(format!("starting the router: {e}")))??;
    let client = crate::driver::client()?;
    let result = async {
        wait_until_connected(&client, &router.url, Duration::from_secs(20)).await?;
        let url: Arc<str> = Arc::from(format!("{}/v1/completions", router.url));
        let mut runs = Vec::new();
        for run in 0..config.runs.max(1) {
            let mut figures = Vec::new();
            for (k, (name, classes)) in phases(config).iter().enumerate() {
                eprintln!("[bench fairness] run {} phase {name}", run + 1);
                let seed = config.seed ^ ((run * 8 + k) as u64).wrapping_mul(0x1000_0001);
                figures.extend(phase(config, &url, (name, classes), seed).await?);
            }
            runs.push(figures);
        }
        Ok::<_, Error>(runs)
    }
    .await;
    drop(router);
    fleet.shutdown().await;
    Ok(FairnessReport {
        config: config.clone(),
        runs: result?,
    })
}

/// Every run's figures.
#[derive(Debug, Clone)]
pub struct FairnessReport {
    /// What ran.
    pub config: FairnessBenchConfig,
    /// Per run, every (phase, class).
    pub runs: Vec<Vec<ClassFigures>>,
}

impl FairnessReport {
    /// Per (phase, class): the median over runs of each figure.
    pub fn medians(&self) -> Vec<ClassFigures> {
        let Some(first) = self.runs.first() else {
            return Vec::new();
        };
        let median = |k: usize, f: fn(&ClassFigures) -> f64| {
            let values = sorted(self.runs.iter().filter_map(|r| r.get(k)).map(f).collect());
            percentile(&values, 0.5)
        };
        first
            .iter()
            .enumerate()
            .map(|(k, c)| ClassFigures {
                requests: median(k, |c| c.requests as f64) as usize,
                refused: median(k, |c| c.refused as f64) as usize,
                failed: median(k, |c| c.failed as f64) as usize,
                ttft_p50_ms: median(k, |c| c.ttft_p50_ms),
                ttft_p99_ms: median(k, |c| c.ttft_p99_ms),
                ..c.clone()
            })
            .collect()
    }

    /// The median TTFT p99 of the small tenant alone: the unloaded baseline.
    fn alone_p99(medians: &[ClassFigures]) -> f64 {
        medians
            .iter()
            .find(|c| c.phase == "alone")
            .map_or(f64::NAN, |c| c.ttft_p99_ms)
    }

    /// The report as JSON: the settings, every run, the medians.
    pub fn to_json(&self) -> Value {
        json!({
            "config": self.config,
            "runs": self.runs,
            "medians": self.medians(),
        })
    }
}

impl std::fmt::Display for FairnessReport {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let medians = self.medians();
        let alone = Self::alone_p99(&medians);
        writeln!(
            f,
            "medians of {} run(s); TTFT in ms; p99 ratio: over the small tenant's p99 alone",
            self.runs.len()
        )?;
        writeln!(
            f,
            "| phase | class | req/s | requests | 429 | failed | TTFT p50 | TTFT p99 | p99 ratio |"
        )?;
        writeln!(
            f,
            "| --- | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: |"
        )?;
        for c in &medians {
            writeln!(
                f,
                "| {} | {} | {:.0} | {} | {} | {} | {:.1} | {:.1} | {:.2} |",
                c.phase,
                c.class,
                c.rate,
                c.requests,
                c.refused,
                c.failed,
                c.ttft_p50_ms,
                c.ttft_p99_ms,
                c.ttft_p99_ms / alone
            )?;
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn figures(phase: &'static str, class: &'static str, p99: f64) -> ClassFigures {
        ClassFigures {
            phase,
            class,
            rate: 1.0,
            requests: 10,
            refused: 0,
            failed: 0,
            ttft_p50_ms: p99 / 2.0,
            ttft_p99_ms: p99,
        }
    }

    #[test]
    fn the_report_gives_each_figures_median_over_runs_and_the_ratio_to_alone() {
        let config = FairnessBenchConfig {
            router_exe: PathBuf::new(),
            workers: 1,
            prompt_tokens: 1,
            max_tokens: 1,
            speedup: 1.0,
            rate: 1.0,
            ratio: 10.0,
            secs: 2.0,
            warmup_secs: 1.0,
            runs: 3,
            busy_requests: 1,
            busy_prefill_tokens: 1,
            queue_capacity: 1,
            seed: 0,
        };
        let runs = [(10.0, 12.0), (20.0, 30.0), (14.0, 21.0)]
            .map(|(alone, fair)| {
                vec![
                    figures("alone", "small", alone),
                    figures("two-tenants", "small", fair),
                ]
            })
            .to_vec();
        let report = FairnessReport { config, runs };
        let medians = report.medians();
        assert_eq!(medians[0].ttft_p99_ms, 14.0);
        assert_eq!(medians[1].ttft_p99_ms, 21.0);
        let table = report.to_string();
        assert!(
            table.contains("| two-tenants | small | 1 | 10 | 0 | 0 | 10.5 | 21.0 | 1.50 |"),
            "{table}"
        );
    }

    #[test]
    fn every_phase_but_the_first_overloads_with_ratio_times_the_rate() {
        let config = FairnessBenchConfig {
            router_exe: PathBuf::new(),
            workers: 1,
            prompt_tokens: 1,
            max_tokens: 1,
            speedup: 1.0,
            rate: 2.0,
            ratio: 10.0,
            secs: 2.0,
            warmup_secs: 1.0,
            runs: 1,
            busy_requests: 1,
            busy_prefill_tokens: 1,
            queue_capacity: 1,
            seed: 0,
        };
        let [alone, rest @ ..] = phases(&config);
        assert_eq!(alone.1.len(), 1);
        for (_, classes) in rest {
            let total: f64 = classes.iter().map(|c| c.rate).sum();
            assert_eq!(total, 22.0);
        }
    }
}
