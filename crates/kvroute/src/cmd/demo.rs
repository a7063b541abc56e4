//! `kvroute demo`: the win, shown in one command (see `kvroute_loadgen::demo`).
//!
//! Turns the flags into a [`DemoConfig`], runs it until the end or Ctrl-C /
//! SIGTERM (exit 130), then prints the table and writes `demo-report.json`
//! and the SVG plot.

use std::path::PathBuf;
use std::process::ExitCode;
use std::time::Duration;

use anyhow::{bail, Context, Result};
use clap::Args;
use kvroute_core::event::WorkerFlavor;
use kvroute_loadgen::demo::{self, Contender, DemoConfig, MM_TOKENS_PER_IMAGE};
use kvroute_loadgen::{Arrival, LoadOptions, WorkloadKind, WorkloadSpec};
use kvroute_prompt::Tokenizer;

use crate::cmd::serve::renderer;

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
    /// Routers per router policy: with 2 or more, that many replicas share
    /// their state over a NATS server the demo starts (`nats-server` must be
    /// installed) and the client balances round-robin over them.
    #[arg(long, default_value_t = 1, value_parser = clap::value_parser!(u16).range(1..=64))]
    replicas: u16,
    /// A named workload (`long`, `short`): its prefix groups and sizes,
    /// engines' cache, requests and concurrency, with no time limit (add
    /// `--speedup 1` for real time).
    #[arg(long, value_parser = super::bench::parse_preset, conflicts_with_all = ["workload", "groups", "scale", "question_tokens", "gpu_blocks", "requests", "concurrency", "quick", "max_tokens"])]
    preset: Option<kvroute_loadgen::Preset>,
    /// Replay a Mooncake-format trace (JSONL: timestamp, input_length,
    /// output_length, hash_ids) at its own times instead of a workload.
    #[arg(long, value_name = "FILE", conflicts_with_all = ["preset", "workload", "requests", "concurrency", "quick"])]
    trace: Option<PathBuf>,
    /// Keep the engines and the first router policy's router up after the
    /// run, print its dashboard's URL, and stop on Ctrl-C.
    #[arg(long)]
    keep: bool,
    /// Where the JSON report goes.
    #[arg(long, default_value = "demo-report.json")]
    report: PathBuf,
    /// Where the SVG plot goes.
    #[arg(long, default_value = "demo-report.svg")]
    plot: PathBuf,
}

fn config(args: &DemoArgs) -> Result<DemoConfig> {
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
    let trace = args
        .trace
        .as_deref()
        .map(kvroute_loadgen::mooncake::Trace::read)
        .transpose()?;
    let arrival = match &trace {
        Some(_) => Arrival::Trace,
        None => Arrival::Closed {
            concurrency: args.preset.map_or(concurrency, |p| p.concurrency()),
        },
    };
    let (workload, gpu_blocks, requests, max_duration) = match (args.preset, trace) {
        (Some(p), _) => (
            WorkloadSpec {
                mm_tokens_per_image: MM_TOKENS_PER_IMAGE,
                ..p.workload(args.seed)
            },
            p.gpu_blocks(),
            p.requests(),
            None,
        ),
        (None, Some(trace)) => (
            WorkloadSpec {
                kind: WorkloadKind::Trace,
                seed: args.seed,
                mm_tokens_per_image: MM_TOKENS_PER_IMAGE,
                trace: Some(trace.clone()),
                ..WorkloadSpec::default()
            },
            args.gpu_blocks,
            trace.requests.len(),
            None,
        ),
        (None, None) => (
            workload,
            args.gpu_blocks,
            requests,
            Some(Duration::from_secs(if args.quick { 20 } else { 40 })),
        ),
    };
    let mut contenders = Vec::new();
    for name in &args.policies {
        let contender: Contender = name.parse().with_context(|| "--policies".to_owned())?;
        contenders.push((name.clone(), contender));
    }
    if contenders.is_empty() {
        bail!("--policies is empty");
    }
    Ok(DemoConfig {
        flavor: args.flavor,
        workers,
        gpu_blocks,
        speedup: args.speedup,
        seed: args.seed,
        contenders,
        load: LoadOptions {
            workload,
            arrival,
            requests,
            max_duration,
            progress: true,
            label: String::new(),
        },
        replicas: usize::from(args.replicas),
        keep: args.keep,
    })
}

/// Runs the demo.
pub fn run(args: &DemoArgs) -> Result<ExitCode> {
    let config = config(args)?;
    super::init_logging(tracing_subscriber::filter::LevelFilter::WARN);
    // Text and chat requests are tokenized as the mock engines do.
    let tokenizer = renderer(Tokenizer::builtin(), MM_TOKENS_PER_IMAGE);
    let runtime = super::runtime()?;
    let outcome = runtime.block_on(demo::run(&config, tokenizer, super::shutdown_signal()))?;
    let Some((done, kept)) = outcome else {
        eprintln!("kvroute demo: interrupted; the router and the engines are stopped");
        return Ok(ExitCode::from(130));
    };
    println!();
    print!("{done}");
    done.write_json(&args.report)
        .with_context(|| format!("--report {}", args.report.display()))?;
    kvroute_loadgen::write_svg_plot(&args.plot, &done.report)
        .with_context(|| format!("--plot {}", args.plot.display()))?;
    println!(
        "\nwrote {} and {} ({} requests per policy)",
        args.report.display(),
        args.plot.display(),
        config.load.requests
    );
    if let Some(kept) = kept {
        println!(
            "\nthe {} router is still up, with the engines; its dashboard:",
            kept.policy()
        );
        for url in kept.dashboard_urls() {
            println!("  {url}");
        }
        println!("press Ctrl-C to stop");
        runtime.block_on(async {
            super::shutdown_signal().await;
            kept.shutdown().await;
        });
    } else if args.keep {
        println!("\n--keep: no router policy ran, so there is no dashboard to keep");
    }
    Ok(ExitCode::SUCCESS)
}
