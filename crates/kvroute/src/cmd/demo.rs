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
use kvroute_loadgen::{Arrival, LoadOptions, PdLayout, Preset, WorkloadKind, WorkloadSpec};
use kvroute_prompt::Tokenizer;

use crate::cmd::serve::renderer;

/// Arguments of `kvroute demo`.
#[derive(Debug, Args)]
pub struct DemoArgs {
    /// The workload (see docs/bench.md); `pd` is `--preset pd`: the `long`
    /// workload on 2 prefill + 2 decode engines.
    #[arg(long, default_value = "shared-prefix", value_parser = workload_parser())]
    workload: DemoWorkload,
    /// Engine flavour of every mock worker: vllm or sglang.
    #[arg(long, default_value_t = WorkerFlavor::Vllm)]
    flavor: WorkerFlavor,
    /// A shorter run (under a minute) with the same report; what CI runs.
    #[arg(long)]
    quick: bool,
    /// Mock engines (default 4; 2 for `--workload images`).
    #[arg(long, conflicts_with = "pd")]
    workers: Option<u16>,
    /// A disaggregated fleet of PREFILL:DECODE engines (e.g. `2:2`) with any
    /// workload; the default policies become kv, kv-split, round-robin and
    /// aggregated (the same engines registered as aggregated ones).
    #[arg(long, value_name = "P:D", value_parser = parse_layout)]
    pd: Option<PdLayout>,
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
    /// Policies to compare, in order [default:
    /// kv,approx,least-loaded,round-robin,random,oracle; on a disaggregated
    /// fleet kv,kv-split,round-robin,aggregated].
    #[arg(long, value_delimiter = ',')]
    policies: Option<Vec<String>>,
    /// Routers per router policy: with 2 or more, that many replicas share
    /// their state over a NATS server the demo starts (`nats-server` must be
    /// installed) and the client balances round-robin over them.
    #[arg(long, default_value_t = 1, value_parser = clap::value_parser!(u16).range(1..=64))]
    replicas: u16,
    /// A named workload (`long`, `short`, `pd`): its prefix groups and sizes,
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

/// The default `--policies` of an aggregated fleet.
const POLICIES: &str = "kv,approx,least-loaded,round-robin,random,oracle";

/// The default `--policies` of a disaggregated fleet.
const PD_POLICIES: &str = "kv,kv-split,round-robin,aggregated";

/// `--workload`: a load generator workload, or `pd` (the `pd` preset).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum DemoWorkload {
    Kind(WorkloadKind),
    Pd,
}

/// `--workload`'s values: every workload's name, and `pd`.
fn workload_parser() -> impl clap::builder::TypedValueParser<Value = DemoWorkload> {
    use clap::builder::TypedValueParser as _;
    let names = WorkloadKind::ALL.map(WorkloadKind::name);
    clap::builder::PossibleValuesParser::new(names.into_iter().chain(["pd"])).try_map(|s| {
        if s == "pd" {
            return Ok(DemoWorkload::Pd);
        }
        s.parse::<WorkloadKind>().map(DemoWorkload::Kind)
    })
}

/// `--pd`'s value.
pub(super) fn parse_layout(s: &str) -> Result<PdLayout, String> {
    s.parse().map_err(|e: kvroute_loadgen::Error| e.to_string())
}

fn config(args: &DemoArgs) -> Result<DemoConfig> {
    let (kind, preset) = match args.workload {
        DemoWorkload::Pd => (WorkloadKind::SharedPrefix, Some(Preset::Pd)),
        DemoWorkload::Kind(kind) => (kind, args.preset),
    };
    let layout = args.pd.or(preset.and_then(Preset::layout));
    let images = kind == WorkloadKind::Images;
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
        kind,
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
            concurrency: preset.map_or(concurrency, |p| p.concurrency()),
        },
    };
    let (workload, gpu_blocks, requests, max_duration) = match (preset, trace) {
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
    let default_policies = if layout.is_some() {
        PD_POLICIES
    } else {
        POLICIES
    };
    let names: Vec<String> = match &args.policies {
        Some(names) => names.clone(),
        None => default_policies.split(',').map(str::to_owned).collect(),
    };
    let mut contenders = Vec::new();
    for name in &names {
        let contender: Contender = name.parse().with_context(|| "--policies".to_owned())?;
        contenders.push((name.clone(), contender));
    }
    if contenders.is_empty() {
        bail!("--policies is empty");
    }
    Ok(DemoConfig {
        flavor: args.flavor,
        workers,
        layout,
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
    let outcome = runtime
        .block_on(async { demo::run(&config, tokenizer, super::shutdown_signal()).await })?;
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

#[cfg(test)]
mod tests {
    use super::*;
    use clap::Parser;

    #[derive(Debug, Parser)]
    struct Cli {
        #[command(flatten)]
        demo: DemoArgs,
    }

    fn parse(args: &[&str]) -> Result<DemoConfig> {
        let cli = Cli::try_parse_from(std::iter::once("demo").chain(args.iter().copied()))?;
        config(&cli.demo)
    }

    fn names(config: &DemoConfig) -> Vec<&str> {
        config.contenders.iter().map(|(n, _)| n.as_str()).collect()
    }

    #[test]
    fn the_pd_workload_is_the_pd_preset_on_two_prefill_and_two_decode_engines() {
        let pd = parse(&["--workload", "pd"]).expect("valid");
        assert_eq!(pd.layout, Some(PdLayout::DEFAULT));
        assert_eq!(names(&pd), ["kv", "kv-split", "round-robin", "aggregated"]);
        assert_eq!(pd.load.requests, Preset::Pd.requests());
        assert_eq!(pd.gpu_blocks, Preset::Pd.gpu_blocks());
        let preset = parse(&["--preset", "pd"]).expect("valid");
        assert_eq!(
            (preset.layout, preset.load.requests),
            (pd.layout, pd.load.requests)
        );
        let plain = parse(&[]).expect("valid");
        assert_eq!(plain.layout, None);
        assert_eq!(names(&plain).last(), Some(&"oracle"));
    }

    #[test]
    fn any_workload_runs_on_a_disaggregated_fleet_with_pd() {
        let c = parse(&[
            "--workload",
            "multi-turn",
            "--pd",
            "1:3",
            "--policies",
            "kv,kv-split",
        ])
        .expect("valid");
        assert_eq!(
            c.layout,
            Some(PdLayout {
                prefill: 1,
                decode: 3
            })
        );
        assert_eq!(c.load.workload.kind, WorkloadKind::MultiTurn);
        assert_eq!(names(&c), ["kv", "kv-split"]);
        assert!(
            parse(&["--pd", "2:2", "--workers", "4"]).is_err(),
            "one or the other"
        );
        assert!(parse(&["--pd", "0:2"]).is_err());
    }
}
