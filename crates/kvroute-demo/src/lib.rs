//! `kvroute demo`: the win, shown in one command.
//!
//! Starts a fleet of mock engines in this process, then for each policy in
//! turn (kv, approx, round-robin, random, and the oracle that reads the
//! engines' true caches) empties every engine's cache, starts a fresh router
//! with that policy, drives the same seeded workload through it, and reads
//! the engines' own `cached_tokens`. Everything runs in this process, so an
//! interruption (or the end) stops the router, the engines and their sockets.
//!
//! With a [`PdLayout`] the engines are prefill engines and decode engines
//! (`crate::engines`): `kv` and `round-robin` place each request's two phases,
//! `kv-split` never lets a decode engine prefill, `aggregated` registers
//! the same engines as aggregated ones; the report adds the prefill-side
//! hit rate from the engines' own counters.
//!
//! With [`DemoConfig::real_engines`] the engines are real ones (vLLM, as
//! `scripts/real-engines start` runs them), emptied before each policy,
//! and the oracle routes by each engine's own KV events
//! (`crate::event_oracle`): real vLLM has no endpoint that answers what it
//! holds.
//!
//! With `replicas` ≥ 2 every router policy runs through that many routers
//! (replicas sharing their state over a NATS server the demo starts as a
//! child process) and the client balances its requests round-robin over
//! them, as a load balancer in front of router replicas would.

pub mod real_engines;
pub mod rounds;

use std::fmt;
use std::future::Future;
use std::path::Path;
use std::time::{Duration, Instant};

// The load generator's modules the demo builds on, under their own names.
use kvroute_loadgen::{
    contender, driver, embedded_router, engines, error, event_oracle, nats, preset, report,
    workload,
};

use crate::contender::{Disagg, Routing};
use crate::engines::{Engines, PromptWork};
use crate::preset::PdLayout;
use crate::real_engines::{Fleet, RealEngines};
use kvroute_core::event::WorkerFlavor;
use kvroute_mocker::MockerConfig;
use kvroute_server::ingest::spec::WorkerSpec;
use kvroute_server::replica::ReplicaConfig;
use serde_json::{json, Map, Value};

use crate::driver::{Endpoint, LoadOptions};
use crate::embedded_router::{RouterTokenizer, RunningRouter};
use crate::error::{Error, Result};
use crate::nats::NatsServer;
use crate::report::{table, Fetches, PolicyReport, Report, ORACLE};
use crate::workload::WorkloadKind;

/// Positions each image takes, for the engines and the router alike.
pub const MM_TOKENS_PER_IMAGE: usize = 64;

/// How often each demo replica writes its index snapshot (short, so that a
/// run of a few seconds writes some).
const REPLICA_SNAPSHOT_EVERY: Duration = Duration::from_secs(2);

/// Longest wait for each replica to connect to NATS and hear its peers.
const REPLICA_READY_WITHIN: Duration = Duration::from_secs(10);

pub use crate::contender::Contender;

/// What the demo runs: the engines, the policies, the workload.
#[derive(Debug, Clone)]
pub struct DemoConfig {
    /// Engine flavour of every mock worker.
    pub flavor: WorkerFlavor,
    /// Mock engines (at least 1); ignored with a `layout`.
    pub workers: u16,
    /// A disaggregated fleet: this many prefill engines and decode engines
    /// instead of `workers` aggregated ones.
    pub layout: Option<PdLayout>,
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
    /// Routers per router policy: 1 runs one router; 2 or more run that many
    /// replicas sharing their state over a NATS server the demo starts
    /// (`nats-server` must be installed), the client balancing round-robin
    /// over them ([`Endpoint::Balanced`]).
    pub replicas: usize,
    /// Keep the engines and the routers of the first router policy up after
    /// the run ([`Kept`]), for a look at their dashboard.
    pub keep: bool,
    /// Real engines instead of mock ones (`workers`, `gpu_blocks`,
    /// `speedup` and `layout` then do not apply): each policy starts from
    /// their emptied caches, and the oracle follows their own KV events
    /// (`crate::event_oracle`).
    pub real_engines: Option<RealEngines>,
}

/// The engines and the first router policy's routers, still serving after
/// the run (`--keep`).
pub struct Kept {
    fleet: Fleet,
    routers: Vec<RunningRouter>,
    policy: String,
}

impl Kept {
    /// The policy the kept routers route with.
    pub fn policy(&self) -> &str {
        &self.policy
    }

    /// Each kept router's dashboard.
    pub fn dashboard_urls(&self) -> Vec<String> {
        self.routers
            .iter()
            .map(|r| format!("{}/dashboard", r.url))
            .collect()
    }

    /// Stops the routers, then the engines.
    pub async fn shutdown(self) {
        for router in self.routers {
            router.stop().await;
        }
        self.fleet.shutdown().await;
    }
}

/// The router policies that ran through replicas, and where they met.
#[derive(Debug, Clone)]
struct ReplicaRun {
    count: usize,
    nats_url: String,
    policies: Vec<String>,
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
    layout: Option<PdLayout>,
    replicas: Option<ReplicaRun>,
}

impl DemoReport {
    /// The report as `demo-report.json` holds it: each router policy's entry
    /// also has `kv_events`, `blocks_stored` and `decode_errors` (of its
    /// first replica, each replica ingesting every engine), and `replicas`
    /// and `replica_messages_received` (peer messages over NATS, all
    /// replicas together) when it ran through several.
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
        write_pretty_json(path, &self.document()?)
    }

    fn policy(&self, name: &str) -> Option<&PolicyReport> {
        self.report.get(name)
    }

    /// The disaggregated fleet's comparisons: kv-aware against round-robin
    /// placement, conditional disaggregation against always splitting, and
    /// against the same engines serving aggregated.
    fn pd_lines(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let Some(layout) = self.layout else {
            return Ok(());
        };
        let Some(kv) = self.policy("kv") else {
            return Ok(());
        };
        let pf = |p: &PolicyReport| {
            p.prefill_hit_rate
                .map_or_else(|| "-".to_owned(), |h| format!("{:.3}", h))
        };
        for (name, what) in [
            ("round-robin", "round-robin P/D"),
            (crate::contender::KV_SPLIT, "kv-split (always transfer)"),
            (
                crate::contender::AGGREGATED,
                "aggregated (the same engines)",
            ),
        ] {
            let Some(other) = self.policy(name) else {
                continue;
            };
            if kv.ttft_ms.p50 > 0.0 {
                writeln!(
                    f,
                    "kv P/D on {layout} vs {what}: prefill hit {} vs {}, TTFT p50 {:.1} vs {:.1} ms ({:.2}×), TPOT p50 {:.2} vs {:.2} ms, {:.0} vs {:.0} output tok/s.",
                    pf(kv),
                    pf(other),
                    kv.ttft_ms.p50,
                    other.ttft_ms.p50,
                    other.ttft_ms.p50 / kv.ttft_ms.p50,
                    kv.tpot_ms.p50,
                    other.tpot_ms.p50,
                    kv.output_tokens_per_s,
                    other.output_tokens_per_s,
                )?;
            }
        }
        Ok(())
    }

    /// What the fetch lever (and the copies of hot prefixes) did, beside
    /// `kv` without it.
    fn fetch_line(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        for name in [crate::contender::KV_FETCH, crate::contender::KV_REPLICATE] {
            let Some((fetching, Some(fetches))) = self.policy(name).map(|p| (p, p.fetches)) else {
                continue;
            };
            write!(
                f,
                "{name}: {} requests fetched their prefix from a busy holder ({} blocks moved, {} fell back to recomputing)",
                fetches.handed_off, fetches.blocks, fetches.fell_back
            )?;
            if name == crate::contender::KV_REPLICATE {
                write!(
                    f,
                    "; {} hot prefixes copied ahead of demand ({} blocks)",
                    fetches.copies, fetches.copied_blocks
                )?;
            }
            match self.policy("kv") {
                Some(kv) => writeln!(
                    f,
                    "; vs kv: hit rate {:.3} vs {:.3}, TTFT p50 {:.1} vs {:.1} ms, p99 {:.1} vs {:.1} ms.",
                    fetching.hit_rate,
                    kv.hit_rate,
                    fetching.ttft_ms.p50,
                    kv.ttft_ms.p50,
                    fetching.ttft_ms.p99,
                    kv.ttft_ms.p99,
                )?,
                None => writeln!(f, ".")?,
            }
        }
        Ok(())
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
        if let (Some(kv), Some(rr), None) =
            (self.policy("kv"), self.policy("round-robin"), self.layout)
        {
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
        self.pd_lines(f)?;
        self.fetch_line(f)?;
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
        if let Some(run) = &self.replicas {
            let retried: u64 = run
                .policies
                .iter()
                .filter_map(|name| self.policy(name))
                .map(|p| p.retried)
                .sum();
            writeln!(
                f,
                "{} ran through {} router replicas each, sharing state over NATS at {}; the client balanced round-robin over them ({retried} connections retried).",
                run.policies.join(", "),
                run.count,
                run.nats_url
            )?;
        }
        Ok(())
    }
}

/// Writes `doc` as pretty JSON, with a final newline, to `path` (a run's
/// report and the rounds' alike).
pub(crate) fn write_pretty_json(path: &Path, doc: &Value) -> Result<()> {
    let text = serde_json::to_string_pretty(doc)?;
    std::fs::write(path, text + "\n").map_err(Error::io(format!("writing {}", path.display())))
}

/// Empties every mock engine's prefix cache, so each policy starts cold.
pub(crate) async fn reset_caches(client: &reqwest::Client, urls: &[String]) -> Result<()> {
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
/// first, after the routers and engines have stopped. With
/// [`DemoConfig::keep`], the engines and the first router policy's routers
/// are returned still running (when there was a router policy).
pub async fn run(
    config: &DemoConfig,
    tokenizer: RouterTokenizer,
    interrupt: impl Future<Output = ()>,
) -> Result<Option<(DemoReport, Option<Kept>)>> {
    if config.workers == 0 || config.contenders.is_empty() {
        return Err(Error::Invalid(
            "the demo needs at least one worker and one policy".into(),
        ));
    }
    if config.replicas == 0 {
        return Err(Error::Invalid(
            "replicas must be at least 1 (one router per policy)".into(),
        ));
    }
    if config.layout.is_some() {
        check_pd_contenders(config)?;
    }
    let routed = config
        .contenders
        .iter()
        .any(|(_, c)| matches!(c, Contender::Router(_)));
    // Before the engines: a missing nats-server stops the demo at once.
    let nats = if config.replicas >= 2 && routed {
        Some(
            tokio::task::spawn_blocking(NatsServer::start)
                .await
                .map_err(|e| Error::Unexpected(format!("starting nats-server: {e}")))??,
        )
    } else {
        None
    };
    let mocker = mocker_config(config);
    let block_size = match &config.real_engines {
        Some(real) => real.block_size,
        None => mocker.block_size as u32,
    };
    let concurrency = match config.load.arrival {
        driver::Arrival::Closed { concurrency } => concurrency.to_string(),
        driver::Arrival::Poisson { rate } => format!("{rate} req/s"),
        driver::Arrival::Trace => "the trace's".to_owned(),
    };
    let engines = match (&config.real_engines, config.layout) {
        (Some(real), _) => format!("{} real", real.engines.len()),
        (None, Some(layout)) => format!("{} prefill + {} decode", layout.prefill, layout.decode),
        (None, None) => config.workers.to_string(),
    };
    let kind = if config.real_engines.is_some() {
        ""
    } else {
        " mock"
    };
    eprintln!(
        "kvroute demo: {engines} {}{kind} engines, {} {} requests per policy, concurrency {concurrency}",
        config.flavor.as_str(),
        config.load.requests,
        config.load.workload.kind.name(),
    );
    if let Some(nats) = &nats {
        eprintln!(
            "  every router policy runs through {} replicas sharing state over NATS at {}, behind a round-robin balancer",
            config.replicas,
            nats.url()
        );
    }
    let fleet = start_fleet(config, mocker).await?;
    let outcome = tokio::select! {
        r = compare(&fleet, config, block_size, tokenizer, nats.as_ref()) => Some(r),
        () = interrupt => None,
    };
    match outcome {
        Some(Ok((report, Some((policy, routers))))) => {
            let kept = Kept {
                fleet,
                routers,
                policy,
            };
            Ok(Some((report, Some(kept))))
        }
        other => {
            fleet.shutdown().await;
            other
                .transpose()
                .map(|o| o.map(|(report, _)| (report, None)))
        }
    }
}

/// The engines of `config`: its real ones, or mock ones started with `mocker`.
/// The mock engines' configuration: ephemeral ports, the demo's sizes,
/// and, when a policy fetches prefixes between aggregated SGLang engines,
/// engines that are both ends of a bootstrap hand-off.
fn mocker_config(config: &DemoConfig) -> MockerConfig {
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
    let fetching = config
        .contenders
        .iter()
        .any(|(_, c)| matches!(c, Contender::Router(r) if r.fetch.is_some()));
    if fetching && config.flavor == WorkerFlavor::Sglang && config.layout.is_none() {
        // Aggregated SGLang engines a fetch can move a prefix between,
        // each serving its bootstrap rooms on a port of its own.
        mocker.kv_both = true;
        mocker.bootstrap_port = 0;
    }
    mocker
}

async fn start_fleet(config: &DemoConfig, mocker: MockerConfig) -> Result<Fleet> {
    match &config.real_engines {
        Some(real) if config.layout.is_some() || config.flavor != WorkerFlavor::Vllm => {
            Err(Error::Invalid(format!(
                "the real engines of {} are aggregated vLLM engines: no P/D layout or other flavour",
                real.path.display()
            )))
        }
        Some(real) => Ok(Fleet::Real(real.clone())),
        None => Ok(Fleet::Mock(Engines::start(mocker, config.layout).await?)),
    }
}

/// The routers kept running after the run, and their policy's name.
type KeptRouters = Option<(String, Vec<RunningRouter>)>;

async fn compare(
    fleet: &Fleet,
    config: &DemoConfig,
    block_size: u32,
    tokenizer: RouterTokenizer,
    nats: Option<&NatsServer>,
) -> Result<(DemoReport, KeptRouters)> {
    let client = driver::client()?;
    let urls = fleet.urls();
    let mut report = Report::new(config.load.workload.describe());
    let mut extras = Extras::new();
    let mut replicated = Vec::new();
    let mut kept: KeptRouters = None;
    for (k, (name, contender)) in config.contenders.iter().enumerate() {
        fleet.reset(&client).await?;
        let mut options = config.load.clone();
        options.label = name.clone();
        let started = Instant::now();
        let work_before = match fleet.disaggregated() {
            true => PromptWork::read(&client, &urls, config.flavor).await?,
            false => None,
        };
        let (mut result, extra) = match contender {
            Contender::Oracle => {
                let endpoint = fleet.oracle();
                (driver::run(&client, &endpoint, &options).await?, Map::new())
            }
            Contender::Router(routing) => {
                let replicas = replica_configs(nats, config.replicas, k);
                if nats.is_some() {
                    replicated.push(name.clone());
                }
                let specs = fleet.specs(block_size, routing.disagg)?;
                let routers = Routers {
                    specs: &specs,
                    routing: *routing,
                    block_size,
                    tokenizer: &tokenizer,
                };
                let keep = config.keep && kept.is_none();
                let (result, extra, running) =
                    routers.run(&client, replicas, &options, keep).await?;
                if keep {
                    kept = Some((name.clone(), running));
                }
                (result, extra)
            }
        };
        if let Some(before) = work_before {
            if let Some(after) = PromptWork::read(&client, &urls, config.flavor).await? {
                result.prefill_hit_rate = Some(before.hit_rate_until(after, result.prompt_tokens)?);
            }
        }
        eprintln!(
            "  {name:<12} hit rate {:>5.1} %   TTFT p50 {:>7.1} ms   p99 {:>7.1} ms   {} failed{}   ({:.1} s)",
            result.hit_rate * 100.0,
            result.ttft_ms.p50,
            result.ttft_ms.p99,
            result.failed,
            if nats.is_some() {
                format!(", {} retried", result.retried)
            } else {
                String::new()
            },
            started.elapsed().as_secs_f64()
        );
        report.push(name.clone(), result);
        extras.push((name.clone(), extra));
    }
    let report = DemoReport {
        report,
        extras,
        flavor: config.flavor,
        layout: config.layout,
        replicas: nats.map(|nats| ReplicaRun {
            count: config.replicas,
            nats_url: nats.url(),
            policies: replicated,
        }),
    };
    Ok((report, kept))
}

/// Refuses the contenders a disaggregated fleet cannot serve: the oracle
/// (it sends whole requests to engines that only prefill or only decode),
/// and `aggregated` on SGLang decode engines (they take no request without
/// a bootstrap room).
fn check_pd_contenders(config: &DemoConfig) -> Result<()> {
    for (name, contender) in &config.contenders {
        let refused = match contender {
            Contender::Oracle => Some("the oracle sends whole requests to single engines"),
            Contender::Router(r)
                if r.disagg == Disagg::Aggregated && config.flavor == WorkerFlavor::Sglang =>
            {
                Some("SGLang decode engines serve no request without a bootstrap room")
            }
            Contender::Router(_) => None,
        };
        if let Some(why) = refused {
            return Err(Error::Invalid(format!(
                "`{name}` cannot run on a disaggregated fleet: {why}"
            )));
        }
    }
    Ok(())
}

/// One router's replica setting per router a policy runs through: `[None]`
/// without NATS; else `count` replicas named `demo-0`, `demo-1`, … under a
/// prefix of the policy's own (`policy_index`), so no policy starts from
/// the state an earlier one left in NATS.
fn replica_configs(
    nats: Option<&NatsServer>,
    count: usize,
    policy_index: usize,
) -> Vec<Option<ReplicaConfig>> {
    match nats {
        None => vec![None],
        Some(nats) => (0..count)
            .map(|i| {
                Some(ReplicaConfig {
                    prefix: format!("kvroute-demo-{policy_index}"),
                    snapshot_every: REPLICA_SNAPSHOT_EVERY,
                    ..ReplicaConfig::new(nats.url(), format!("demo-{i}"))
                })
            })
            .collect(),
    }
}

/// What every router of one policy is started with.
struct Routers<'a> {
    specs: &'a [WorkerSpec],
    routing: Routing,
    block_size: u32,
    tokenizer: &'a RouterTokenizer,
}

impl Routers<'_> {
    /// Starts one router per entry of `replicas`, waits until each has every
    /// event stream connected, drives the workload through them (straight to
    /// a lone one, round-robin over several) and stops them, unless `keep`
    /// (then they are returned running). The extras are the first router's
    /// ingestion counts, and `replicas` when several ran.
    async fn run(
        &self,
        client: &reqwest::Client,
        replicas: Vec<Option<ReplicaConfig>>,
        options: &LoadOptions,
        keep: bool,
    ) -> Result<(PolicyReport, Map<String, Value>, Vec<RunningRouter>)> {
        let mut routers = Vec::with_capacity(replicas.len());
        for replica in replicas {
            let router = RunningRouter::start(
                self.specs,
                self.routing,
                self.block_size,
                self.tokenizer.clone(),
                replica,
            )
            .await?;
            routers.push(router);
        }
        for router in &routers {
            router.ready(client).await?;
        }
        let peers = routers.len() as u64 - 1;
        if peers > 0 {
            for router in &routers {
                if !router
                    .replica_ready(client, peers, REPLICA_READY_WITHIN)
                    .await
                {
                    tracing::warn!(
                        router = %router.url,
                        "a replica did not connect to NATS and hear its {peers} peer(s) within {} s; running anyway",
                        REPLICA_READY_WITHIN.as_secs()
                    );
                }
            }
        }
        let endpoint = match routers.as_slice() {
            [one] => Endpoint::OpenAi {
                base_url: one.url.clone(),
            },
            many => Endpoint::Balanced {
                base_urls: many.iter().map(|r| r.url.clone()).collect(),
            },
        };
        let mut result = driver::run(client, &endpoint, options).await?;
        if self.routing.fetch.is_some() || self.routing.replicate.is_some() {
            let mut fetches = Fetches::default();
            for router in &routers {
                let f = router.fetches(client).await?;
                fetches.handed_off += f.handed_off;
                fetches.fell_back += f.fell_back;
                fetches.blocks += f.blocks;
                fetches.copies += f.copies;
                fetches.copied_blocks += f.copied_blocks;
            }
            result.fetches = Some(fetches);
        }
        let mut extra = match routers.first() {
            Some(first) => first.ingest_counts(client).await?,
            None => Map::new(),
        };
        if routers.len() > 1 {
            extra.insert("replicas".into(), json!(routers.len()));
            let mut received = 0;
            for router in &routers {
                received += router.replica_messages_received(client).await?;
            }
            extra.insert("replica_messages_received".into(), json!(received));
        }
        if keep {
            return Ok((result, extra, routers));
        }
        for router in routers {
            router.stop().await;
        }
        Ok((result, extra, Vec::new()))
    }
}

#[cfg(test)]
mod tests;
