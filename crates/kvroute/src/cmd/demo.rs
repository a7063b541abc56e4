//! `kvroute demo`: the win, shown in one command.
//!
//! Starts a fleet of mock engines in this process, then for each policy in
//! turn (kv, approx, round-robin, random, and the oracle that reads the
//! engines' true caches) empties every engine's cache, starts a fresh router
//! with that policy, drives the same seeded workload through it, and reads
//! the engines' own `cached_tokens`. The results go to a table on stdout,
//! `demo-report.json` and an SVG plot. Everything runs in this process, so
//! Ctrl-C (or the end) stops the router, the engines and their sockets.

use std::path::PathBuf;
use std::process::ExitCode;
use std::time::{Duration, Instant};

use anyhow::{bail, Context, Result};
use clap::Args;
use kvroute_core::event::WorkerFlavor;
use kvroute_core::index::IndexConfig;
use kvroute_mocker::{Fleet, MockerConfig};
use kvroute_server::ingest::IngestConfig;
use kvroute_server::proxy::RouterConfig;
use kvroute_server::routing::Policy;
use kvroute_server::spec::WorkerSpec;
use kvroute_server::{serve, ServeConfig};
use serde_json::{json, Map, Value};
use tokio::sync::oneshot;

use crate::cmd::serve::prompt_tokenizer;
use kvroute_loadgen::{
    self as load, Arrival, Endpoint, LoadOptions, PolicyReport, Report, WorkloadKind, WorkloadSpec,
};
use kvroute_mocker::tokenizer::Tokenizer;

/// Positions each image takes, for the engines and the router alike.
const MM_TOKENS_PER_IMAGE: usize = 64;

/// Arguments of `kvroute demo`.
#[derive(Debug, Args)]
pub struct DemoArgs {
    /// The workload (see docs/bench.md).
    #[arg(long, default_value_t = WorkloadKind::SharedPrefix, value_parser = super::bench::workload_parser())]
    workload: WorkloadKind,
    /// Engine flavour of every mock worker: vllm or sglang.
    #[arg(long, default_value_t = WorkerFlavor::Vllm)]
    flavor: WorkerFlavor,
    /// A shorter run (under a minute) with the same report; what CI runs.
    #[arg(long)]
    quick: bool,
    /// Mock engines (default 4; 2 for `--workload images`).
    #[arg(long)]
    workers: Option<u16>,
    /// Requests per policy (default 400; 160 with `--quick`).
    #[arg(long)]
    requests: Option<usize>,
    /// Requests in flight at once (default 16; 2 for `--workload images`, a
    /// client sending repeats).
    #[arg(long)]
    concurrency: Option<usize>,
    /// Size of prompts relative to llm-d's shared-prefix benchmark (6,000-token
    /// prefixes, 1,200-token questions).
    #[arg(long, default_value_t = 1.0)]
    scale: f64,
    /// Prefix groups (shared-prefix), conversations (multi-turn), documents
    /// (long-doc) or images (images).
    #[arg(long, default_value_t = 16)]
    groups: usize,
    /// `shared-prefix`: tokens per question instead of 1,200 × `--scale`.
    #[arg(long)]
    question_tokens: Option<usize>,
    /// KV-cache blocks per engine: small enough that no engine can hold
    /// every group, as in a real fleet.
    #[arg(long, default_value_t = 2560)]
    gpu_blocks: usize,
    /// Divides the engines' simulated step times.
    #[arg(long, default_value_t = 4.0)]
    speedup: f64,
    /// Output tokens per request.
    #[arg(long, default_value_t = 16)]
    max_tokens: u32,
    /// Seed of the workload and the engines.
    #[arg(long, default_value_t = 1)]
    seed: u64,
    /// Policies to compare, in order.
    #[arg(
        long,
        value_delimiter = ',',
        default_value = "kv,approx,least-loaded,round-robin,random,oracle"
    )]
    policies: Vec<String>,
    /// Where the JSON report goes.
    #[arg(long, default_value = "demo-report.json")]
    report: PathBuf,
    /// Where the SVG plot goes.
    #[arg(long, default_value = "demo-report.svg")]
    plot: PathBuf,
}

/// One policy of the comparison: a router policy, or the oracle.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Contender {
    Router(Policy),
    Oracle,
}

fn contender(name: &str) -> Result<Contender> {
    if name == load::ORACLE {
        return Ok(Contender::Oracle);
    }
    name.parse::<Policy>()
        .map(Contender::Router)
        .map_err(|e| anyhow::anyhow!("--policies: {e}"))
}

/// A router started for one policy; dropping it shuts the router down.
struct RunningRouter {
    url: String,
    stop: Option<oneshot::Sender<()>>,
    task: tokio::task::JoinHandle<Result<(), kvroute_server::ServeError>>,
}

impl RunningRouter {
    async fn start(
        specs: &[WorkerSpec],
        policy: Policy,
        block_size: u32,
        mm_tokens_per_image: usize,
    ) -> Result<Self> {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0")
            .await
            .context("binding the router's port")?;
        let addr = listener.local_addr()?;
        let (stop, stopped) = oneshot::channel::<()>();
        let router = RouterConfig {
            policy,
            // Text and chat requests are tokenized as the mock engines do.
            tokenizer: Some(prompt_tokenizer(Tokenizer::builtin(), mm_tokens_per_image)),
            ..RouterConfig::default()
        };
        let task = tokio::spawn(serve(
            ServeConfig {
                block_size,
                workers: specs.to_vec(),
                admin_token: None,
                unreachable_grace: Duration::from_secs(60),
                index: IndexConfig::default(),
                ingest: IngestConfig::default(),
                router,
                max_body_bytes: 64 << 20,
            },
            listener,
            async move {
                let _ = stopped.await;
            },
        ));
        Ok(RunningRouter {
            url: format!("http://{addr}"),
            stop: Some(stop),
            task,
        })
    }

    /// Waits until every rank's event stream is connected.
    async fn ready(&self, client: &reqwest::Client) -> Result<()> {
        let deadline = Instant::now() + Duration::from_secs(20);
        loop {
            if let Ok(resp) = client.get(format!("{}/workers", self.url)).send().await {
                if let Ok(doc) = resp.json::<Value>().await {
                    let ranks: Vec<bool> = doc["workers"]
                        .as_array()
                        .into_iter()
                        .flatten()
                        .flat_map(|w| w["ranks"].as_array().cloned().unwrap_or_default())
                        .map(|r| r["connected"].as_bool().unwrap_or(false))
                        .collect();
                    if !ranks.is_empty() && ranks.iter().all(|c| *c) {
                        return Ok(());
                    }
                }
            }
            if Instant::now() > deadline {
                bail!("the router's event streams did not connect within 20 s");
            }
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    }

    /// What the router's ingestion did: events and blocks applied, and
    /// events or envelopes it could not decode.
    async fn ingest_counts(&self, client: &reqwest::Client) -> Result<Map<String, Value>> {
        let text = client
            .get(format!("{}/metrics", self.url))
            .send()
            .await?
            .text()
            .await?;
        let mut counts = Map::new();
        counts.insert(
            "kv_events".into(),
            json!(sum_metric(&text, "kvroute_ingest_events_total")),
        );
        counts.insert(
            "blocks_stored".into(),
            json!(sum_metric(&text, "kvroute_index_blocks_stored_total")),
        );
        counts.insert(
            "decode_errors".into(),
            json!(
                sum_metric(&text, "kvroute_ingest_decode_errors_total")
                    + sum_metric(&text, "kvroute_ingest_envelope_errors_total")
            ),
        );
        Ok(counts)
    }

    async fn stop(mut self) {
        if let Some(stop) = self.stop.take() {
            let _ = stop.send(());
        }
        let _ = tokio::time::timeout(Duration::from_secs(10), &mut self.task).await;
    }
}

impl Drop for RunningRouter {
    fn drop(&mut self) {
        if let Some(stop) = self.stop.take() {
            let _ = stop.send(());
        }
    }
}

/// Sum of every sample of a Prometheus counter in `text`.
fn sum_metric(text: &str, name: &str) -> u64 {
    text.lines()
        .filter(|l| !l.starts_with('#'))
        .filter_map(|l| {
            let (key, value) = l.rsplit_once(' ')?;
            let metric = key.split('{').next()?;
            (metric == name).then(|| value.parse::<f64>().ok())?
        })
        .sum::<f64>() as u64
}

/// Empties every engine's prefix cache, so each policy starts cold.
async fn reset_caches(client: &reqwest::Client, urls: &[String]) -> Result<()> {
    for url in urls {
        let resp = client
            .post(format!("{url}/reset_prefix_cache"))
            .send()
            .await
            .with_context(|| format!("resetting {url}"))?;
        if !resp.status().is_success() {
            bail!("{url}/reset_prefix_cache answered {}", resp.status());
        }
    }
    Ok(())
}

struct Plan {
    concurrency: usize,
    flavor: WorkerFlavor,
    workers: u16,
    requests: usize,
    contenders: Vec<(String, Contender)>,
    options: LoadOptions,
}

fn plan(args: &DemoArgs) -> Result<Plan> {
    let images = args.workload == WorkloadKind::Images;
    let workers = args.workers.unwrap_or(if images { 2 } else { 4 });
    if workers == 0 {
        bail!("--workers must be at least 1");
    }
    let concurrency = args
        .concurrency
        .unwrap_or(if images { 2 } else { 16 })
        .max(1);
    let requests = args.requests.unwrap_or(if args.quick { 160 } else { 400 });
    let mut contenders = Vec::new();
    for name in &args.policies {
        contenders.push((name.clone(), contender(name)?));
    }
    if contenders.is_empty() {
        bail!("--policies is empty");
    }
    let workload = WorkloadSpec {
        kind: args.workload,
        seed: args.seed,
        scale: args.scale,
        groups: args.groups,
        mm_tokens_per_image: MM_TOKENS_PER_IMAGE,
        max_tokens: args.max_tokens,
        question_tokens: args.question_tokens,
        ..WorkloadSpec::default()
    };
    Ok(Plan {
        concurrency,
        flavor: args.flavor,
        workers,
        requests,
        contenders,
        options: LoadOptions {
            workload,
            arrival: Arrival::Closed { concurrency },
            requests,
            max_duration: Some(Duration::from_secs(if args.quick { 20 } else { 40 })),
            progress: true,
            label: String::new(),
        },
    })
}

/// Runs the demo.
pub fn run(args: &DemoArgs) -> Result<ExitCode> {
    let plan = plan(args)?;
    super::init_logging(tracing_subscriber::filter::LevelFilter::WARN);
    let runtime = crate::cmd::runtime()?;
    runtime.block_on(async {
        let mut config = MockerConfig {
            flavor: plan.flavor,
            workers: plan.workers,
            port: 0,
            kv_events_port: 0,
            replay_port: 0,
            num_gpu_blocks: args.gpu_blocks,
            seed: args.seed,
            mm_tokens_per_image: MM_TOKENS_PER_IMAGE,
            ..MockerConfig::default()
        };
        config.timing.speedup = args.speedup;
        let block_size = config.block_size as u32;
        eprintln!(
            "kvroute demo: {} {} mock engines, {} {} requests per policy, concurrency {}",
            plan.workers,
            plan.flavor.as_str(),
            plan.requests,
            args.workload.name(),
            plan.concurrency
        );
        let fleet = Fleet::start(config)
            .await
            .context("starting the mock engines")?;
        let outcome = tokio::select! {
            r = compare(&fleet, &plan, block_size) => Some(r),
            _ = tokio::signal::ctrl_c() => None,
        };
        fleet.shutdown().await;
        let Some(report) = outcome else {
            eprintln!("kvroute demo: interrupted; the router and the engines are stopped");
            return Ok(ExitCode::from(130));
        };
        let (report, extras) = report?;
        finish(args, &plan, &report, &extras)?;
        Ok(ExitCode::SUCCESS)
    })
}

/// Per-policy fields the load generator does not know: router-side figures.
type Extras = Vec<(String, Map<String, Value>)>;

async fn compare(fleet: &Fleet, plan: &Plan, block_size: u32) -> Result<(Report, Extras)> {
    let client = reqwest::Client::builder()
        .pool_max_idle_per_host(256)
        .build()?;
    let urls: Vec<String> = fleet.workers().iter().map(|w| w.url()).collect();
    let mut specs = Vec::new();
    for w in fleet.workers() {
        specs.push(WorkerSpec::parse(&w.worker_arg(), block_size).context("worker spec")?);
    }
    let mut report = Report::new(plan.options.workload.describe());
    let mut extras = Extras::new();
    for (name, contender) in &plan.contenders {
        reset_caches(&client, &urls).await?;
        let mut options = plan.options.clone();
        options.label = name.clone();
        let started = Instant::now();
        let (result, extra) = match contender {
            Contender::Oracle => {
                let endpoint = Endpoint::Oracle {
                    workers: urls.clone(),
                };
                (load::run(&client, &endpoint, &options).await?, Map::new())
            }
            Contender::Router(policy) => {
                let router =
                    RunningRouter::start(&specs, *policy, block_size, MM_TOKENS_PER_IMAGE).await?;
                router.ready(&client).await?;
                let endpoint = Endpoint::OpenAi {
                    base_url: router.url.clone(),
                };
                let result = load::run(&client, &endpoint, &options).await?;
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
    Ok((report, extras))
}

fn with_extras(report: &Report, extras: &Extras) -> Result<Value> {
    let mut doc = serde_json::to_value(report)?;
    if let Some(policies) = doc.get_mut("policies").and_then(Value::as_object_mut) {
        for (name, extra) in extras {
            if let Some(Value::Object(entry)) = policies.get_mut(name) {
                entry.extend(extra.clone());
            }
        }
    }
    Ok(doc)
}

fn finish(args: &DemoArgs, plan: &Plan, report: &Report, extras: &Extras) -> Result<()> {
    println!();
    print!("{}", load::table(report));
    let doc = with_extras(report, extras)?;
    let hit = |name: &str| -> Option<&PolicyReport> {
        report
            .policies
            .iter()
            .find(|(n, _)| n == name)
            .map(|(_, r)| r)
    };
    if let (Some(kv), Some(oracle)) = (hit("kv"), hit(load::ORACLE)) {
        if oracle.hit_rate > 0.0 {
            println!(
                "\nkv reaches {:.1} % of the oracle's hit rate ({:.3} of {:.3}).",
                100.0 * kv.hit_rate / oracle.hit_rate,
                kv.hit_rate,
                oracle.hit_rate
            );
        }
    }
    if let (Some(kv), Some(rr)) = (hit("kv"), hit("round-robin")) {
        if kv.ttft_ms.p50 > 0.0 {
            println!(
                "kv vs round-robin: hit rate {:.3} vs {:.3}, TTFT p50 {:.1} vs {:.1} ms ({:.1}× faster).",
                kv.hit_rate,
                rr.hit_rate,
                kv.ttft_ms.p50,
                rr.ttft_ms.p50,
                rr.ttft_ms.p50 / kv.ttft_ms.p50
            );
        }
    }
    if let (Some(kv), true) = (
        hit("kv"),
        plan.options.workload.kind == WorkloadKind::Images,
    ) {
        let count = |key: &str| doc["policies"]["kv"][key].as_u64().unwrap_or(0);
        println!(
            "kv on {} workers: text-repeat hit rate {:.3}, image-repeat hit rate {:.3}; {} KV events ({} blocks stored) applied, {} decode errors.",
            plan.flavor.as_str(),
            kv.text_repeat_hit_rate.unwrap_or(0.0),
            kv.image_repeat_hit_rate.unwrap_or(0.0),
            count("kv_events"),
            count("blocks_stored"),
            count("decode_errors")
        );
    }
    let text = serde_json::to_string_pretty(&doc)?;
    std::fs::write(&args.report, text + "\n")
        .with_context(|| format!("writing {}", args.report.display()))?;
    load::write_svg_plot(&args.plot, report)
        .with_context(|| format!("writing {}", args.plot.display()))?;
    println!(
        "\nwrote {} and {} ({} requests per policy)",
        args.report.display(),
        args.plot.display(),
        plan.requests
    );
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn prometheus_counters_are_summed_over_labels() {
        let text = "# HELP x y\n# TYPE kvroute_a counter\nkvroute_a{worker=\"w0\",rank=\"0\"} 3\nkvroute_a{worker=\"w1\",rank=\"0\"} 4\nkvroute_ab 100\n";
        assert_eq!(sum_metric(text, "kvroute_a"), 7);
        assert_eq!(sum_metric(text, "kvroute_ab"), 100);
        assert_eq!(sum_metric(text, "kvroute_c"), 0);
    }

    #[test]
    fn policies_parse_and_unknown_ones_are_refused() {
        assert_eq!(contender("oracle").ok(), Some(Contender::Oracle));
        assert_eq!(contender("kv").ok(), Some(Contender::Router(Policy::Kv)));
        assert!(contender("best").is_err());
    }
}
