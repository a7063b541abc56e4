//! `kvroute demo`: the win, shown in one command.
//!
//! Starts a fleet of mock engines in this process, then for each policy in
//! turn (kv, approx, round-robin, random, and the oracle that reads the
//! engines' true caches) empties every engine's cache, starts a fresh router
//! with that policy, drives the same seeded workload through it, and reads
//! the engines' own `cached_tokens`. Everything runs in this process, so an
//! interruption (or the end) stops the router, the engines and their sockets.

use std::fmt;
use std::future::Future;
use std::path::Path;
use std::time::Instant;

use kvroute_core::event::WorkerFlavor;
use kvroute_core::scheduler::Policy;
use kvroute_mocker::{Fleet, MockerConfig};
use kvroute_server::ingest::spec::WorkerSpec;
use serde_json::{Map, Value};

use crate::driver::{self, Endpoint, LoadOptions};
use crate::error::{Error, Result};
use crate::report::{table, PolicyReport, Report, ORACLE};
use crate::router::{RouterTokenizer, RunningRouter};
use crate::workload::WorkloadKind;

/// Positions each image takes, for the engines and the router alike.
pub const MM_TOKENS_PER_IMAGE: usize = 64;

/// One policy of the comparison: a router policy, or the oracle.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Contender {
    /// A fresh `kvroute serve` with this policy.
    Router(Policy),
    /// The oracle over the mock engines' true caches ([`ORACLE`]).
    Oracle,
}

impl std::str::FromStr for Contender {
    type Err = Error;

    /// `oracle`, or a router policy's name (`kv`, `round-robin`, …).
    fn from_str(name: &str) -> Result<Self> {
        if name == ORACLE {
            return Ok(Contender::Oracle);
        }
        name.parse::<Policy>()
            .map(Contender::Router)
            .map_err(|e| Error::Invalid(e.to_string()))
    }
}

/// What the demo runs: the engines, the policies, the workload.
#[derive(Debug, Clone)]
pub struct DemoConfig {
    /// Engine flavour of every mock worker.
    pub flavor: WorkerFlavor,
    /// Mock engines (at least 1).
    pub workers: u16,
    /// KV-cache blocks per engine.
    pub gpu_blocks: usize,
    /// Divides the engines' simulated step times.
    pub speedup: f64,
    /// Seed of the engines (the workload has its own in `load`).
    pub seed: u64,
    /// The policies compared, in order, with their names in the report.
    pub contenders: Vec<(String, Contender)>,
    /// The workload, arrivals and bounds every policy gets (the label is
    /// set per policy; `mm_tokens_per_image` should be [`MM_TOKENS_PER_IMAGE`]).
    pub load: LoadOptions,
}

/// Per-policy fields the load generator does not know: router-side figures.
type Extras = Vec<(String, Map<String, Value>)>;

/// The demo's results: the per-policy report and the routers' own counts.
#[derive(Debug, Clone)]
pub struct DemoReport {
    /// Hit rates, TTFT, latency and throughput per policy.
    pub report: Report,
    extras: Extras,
    flavor: WorkerFlavor,
}

impl DemoReport {
    /// The report as `demo-report.json` holds it: each router policy's entry
    /// also has `kv_events`, `blocks_stored` and `decode_errors`.
    pub fn document(&self) -> Result<Value> {
        let mut doc = serde_json::to_value(&self.report)?;
        if let Some(policies) = doc.get_mut("policies").and_then(Value::as_object_mut) {
            for (name, extra) in &self.extras {
                if let Some(Value::Object(entry)) = policies.get_mut(name) {
                    entry.extend(extra.clone());
                }
            }
        }
        Ok(doc)
    }

    /// Writes [`DemoReport::document`] as pretty JSON to `path`.
    pub fn write_json(&self, path: &Path) -> Result<()> {
        let text = serde_json::to_string_pretty(&self.document()?)?;
        std::fs::write(path, text + "\n").map_err(Error::io(format!("writing {}", path.display())))
    }

    fn policy(&self, name: &str) -> Option<&PolicyReport> {
        self.report.get(name)
    }

    fn extra(&self, name: &str, key: &str) -> u64 {
        self.extras
            .iter()
            .find(|(n, _)| n == name)
            .and_then(|(_, e)| e.get(key))
            .and_then(Value::as_u64)
            .unwrap_or(0)
    }
}

/// The table, then one line per comparison the demo is about.
impl fmt::Display for DemoReport {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&table(&self.report))?;
        if let (Some(kv), Some(oracle)) = (self.policy("kv"), self.policy(ORACLE)) {
            if oracle.hit_rate > 0.0 {
                writeln!(
                    f,
                    "\nkv reaches {:.1} % of the oracle's hit rate ({:.3} of {:.3}).",
                    100.0 * kv.hit_rate / oracle.hit_rate,
                    kv.hit_rate,
                    oracle.hit_rate
                )?;
            }
        }
        if let (Some(kv), Some(rr)) = (self.policy("kv"), self.policy("round-robin")) {
            if kv.ttft_ms.p50 > 0.0 {
                writeln!(
                    f,
                    "kv vs round-robin: hit rate {:.3} vs {:.3}, TTFT p50 {:.1} vs {:.1} ms ({:.1}× faster).",
                    kv.hit_rate,
                    rr.hit_rate,
                    kv.ttft_ms.p50,
                    rr.ttft_ms.p50,
                    rr.ttft_ms.p50 / kv.ttft_ms.p50
                )?;
            }
        }
        let images = self.report.workload["name"] == WorkloadKind::Images.name();
        if let (Some(kv), true) = (self.policy("kv"), images) {
            writeln!(
                f,
                "kv on {} workers: text-repeat hit rate {:.3}, image-repeat hit rate {:.3}; {} KV events ({} blocks stored) applied, {} decode errors.",
                self.flavor.as_str(),
                kv.text_repeat_hit_rate.unwrap_or(0.0),
                kv.image_repeat_hit_rate.unwrap_or(0.0),
                self.extra("kv", "kv_events"),
                self.extra("kv", "blocks_stored"),
                self.extra("kv", "decode_errors")
            )?;
        }
        Ok(())
    }
}

/// Empties every engine's prefix cache, so each policy starts cold.
async fn reset_caches(client: &reqwest::Client, urls: &[String]) -> Result<()> {
    for url in urls {
        let resp = client
            .post(format!("{url}/reset_prefix_cache"))
            .send()
            .await
            .map_err(Error::http(format!("resetting {url}")))?;
        if !resp.status().is_success() {
            return Err(Error::Unexpected(format!(
                "{url}/reset_prefix_cache answered {}",
                resp.status()
            )));
        }
    }
    Ok(())
}

/// Runs the demo (progress on stderr); `None` when `interrupt` completed
/// first, after the routers and engines have stopped.
pub async fn run(
    config: &DemoConfig,
    tokenizer: RouterTokenizer,
    interrupt: impl Future<Output = ()>,
) -> Result<Option<DemoReport>> {
    if config.workers == 0 || config.contenders.is_empty() {
        return Err(Error::Invalid(
            "the demo needs at least one worker and one policy".into(),
        ));
    }
    let mut mocker = MockerConfig {
        flavor: config.flavor,
        workers: config.workers,
        port: 0,
        kv_events_port: 0,
        replay_port: 0,
        num_gpu_blocks: config.gpu_blocks,
        seed: config.seed,
        mm_tokens_per_image: config.load.workload.mm_tokens_per_image,
        ..MockerConfig::default()
    };
    mocker.timing.speedup = config.speedup;
    let block_size = mocker.block_size as u32;
    let concurrency = match config.load.arrival {
        driver::Arrival::Closed { concurrency } => concurrency.to_string(),
        driver::Arrival::Poisson { rate } => format!("{rate} req/s"),
    };
    eprintln!(
        "kvroute demo: {} {} mock engines, {} {} requests per policy, concurrency {concurrency}",
        config.workers,
        config.flavor.as_str(),
        config.load.requests,
        config.load.workload.kind.name(),
    );
    let fleet = Fleet::start(mocker).await?;
    let outcome = tokio::select! {
        r = compare(&fleet, config, block_size, tokenizer) => Some(r),
        () = interrupt => None,
    };
    fleet.shutdown().await;
    outcome.transpose()
}

async fn compare(
    fleet: &Fleet,
    config: &DemoConfig,
    block_size: u32,
    tokenizer: RouterTokenizer,
) -> Result<DemoReport> {
    let client = driver::client()?;
    let urls: Vec<String> = fleet.workers().iter().map(|w| w.url()).collect();
    let mut specs = Vec::new();
    for w in fleet.workers() {
        specs.push(WorkerSpec::parse(&w.worker_arg(), Some(block_size))?);
    }
    let mut report = Report::new(config.load.workload.describe());
    let mut extras = Extras::new();
    for (name, contender) in &config.contenders {
        reset_caches(&client, &urls).await?;
        let mut options = config.load.clone();
        options.label = name.clone();
        let started = Instant::now();
        let (result, extra) = match contender {
            Contender::Oracle => {
                let endpoint = Endpoint::Oracle {
                    workers: urls.clone(),
                };
                (driver::run(&client, &endpoint, &options).await?, Map::new())
            }
            Contender::Router(policy) => {
                let router =
                    RunningRouter::start(&specs, *policy, block_size, tokenizer.clone()).await?;
                router.ready(&client).await?;
                let endpoint = Endpoint::OpenAi {
                    base_url: router.url.clone(),
                };
                let result = driver::run(&client, &endpoint, &options).await?;
                let extra = router.ingest_counts(&client).await?;
                router.stop().await;
                (result, extra)
            }
        };
        eprintln!(
            "  {name:<12} hit rate {:>5.1} %   TTFT p50 {:>7.1} ms   p99 {:>7.1} ms   {} failed   ({:.1} s)",
            result.hit_rate * 100.0,
            result.ttft_ms.p50,
            result.ttft_ms.p99,
            result.failed,
            started.elapsed().as_secs_f64()
        );
        report.push(name.clone(), result);
        extras.push((name.clone(), extra));
    }
    Ok(DemoReport {
        report,
        extras,
        flavor: config.flavor,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn policies_parse_and_unknown_ones_are_refused() {
        assert_eq!("oracle".parse::<Contender>().ok(), Some(Contender::Oracle));
        assert_eq!(
            "kv".parse::<Contender>().ok(),
            Some(Contender::Router(Policy::Kv))
        );
        assert!("best".parse::<Contender>().is_err());
    }
}
