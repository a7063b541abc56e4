//! `kvroute demo`: the win, shown in one command (see `kvroute_demo`).
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
use kvroute_demo::real_engines::RealEngines;
use kvroute_demo::{self as demo, Contender, DemoConfig, MM_TOKENS_PER_IMAGE};
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
    #[arg(long, value_name = "P:D", value_parser = super::args::parse_layout)]
    pd: Option<PdLayout>,
    /// Requests per policy (default 400; 160 with `--quick`).
    #[arg(long)]
    requests: Option<usize>,
    /// Requests in flight at once (default 16; 2 for `--workload images`, a
    /// client sending repeats).
    #[arg(long)]
    concurrency: Option<usize>,
    /// Size of prompts relative to llm-d's shared-prefix benchmark (6,000-token
    /// prefixes, 1,200-token questions) [default: 1; with --engines,
    /// 2,048-token prefixes and 64-token questions, and 0.3 for long-doc and
    /// random].
    #[arg(long)]
    scale: Option<f64>,
    /// Prefix groups (shared-prefix), conversations (multi-turn), documents
    /// (long-doc) or images (images) [default: 16; 6 with --engines].
    #[arg(long)]
    groups: Option<usize>,
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
    #[arg(long, value_parser = super::args::parse_preset, conflicts_with_all = ["workload", "groups", "scale", "question_tokens", "gpu_blocks", "requests", "concurrency", "quick", "max_tokens"])]
    preset: Option<kvroute_loadgen::Preset>,
    /// Replay a Mooncake-format trace (JSONL: timestamp, input_length,
    /// output_length, hash_ids) at its own times instead of a workload.
    #[arg(long, value_name = "FILE", conflicts_with_all = ["preset", "workload", "requests", "concurrency", "quick"])]
    trace: Option<PathBuf>,
    /// Keep the engines and the first router policy's router up after the
    /// run, print its dashboard's URL, and stop on Ctrl-C.
    #[arg(long, conflicts_with = "rounds")]
    keep: bool,
    /// Run the comparison this many times, the policies' order reversed
    /// every other round, and print each figure's median with its spread
    /// (lowest–highest round), and each policy's latency p99 over
    /// dynamo's and hit rate less sglang-cache-aware's, taken round by
    /// round. One run on a shared machine cannot rank two routers.
    #[arg(long, default_value_t = 1, value_parser = clap::value_parser!(u16).range(1..=9))]
    rounds: u16,
    /// Where the JSON report goes.
    #[arg(long, default_value = "demo-report.json")]
    report: PathBuf,
    /// Where the SVG plot goes.
    #[arg(long, default_value = "demo-report.svg")]
    plot: PathBuf,
    /// Real vLLM engines instead of the mock ones: the `engines.json` of
    /// `scripts/real-engines start N --dir DIR` (docs/real-engines.md).
    /// Their caches are emptied before each policy; the oracle routes by
    /// each engine's own KV events; prompts are token ids of the model's
    /// plain vocabulary. Defaults: 6 groups of 2,048-token prefixes with
    /// 64-token questions, 160 requests (80 with --quick), concurrency 4.
    #[arg(long, value_name = "FILE", conflicts_with_all = ["workers", "pd", "preset", "trace", "gpu_blocks", "speedup", "replicas"])]
    engines: Option<PathBuf>,
}

/// `--engines`' shared-prefix sizes (without `--scale`): a 2,048-token
/// prefix and a 64-token question fit the tiny model's 4,096-token context,
/// and 6 prefixes (384 blocks of 32) overflow one engine's 256 blocks. (At
/// 1,024 tokens a cached prefix saves the tiny model about 15 ms of a
/// 30 ms prefill, less than the queueing noise of two shared cores.)
const REAL_PREFIX_TOKENS: usize = 2_048;
const REAL_GROUPS: usize = 6;
const REAL_QUESTION_TOKENS: usize = 64;

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

/// Requests in flight and requests per policy: the flags', else the
/// defaults of the fleet (a client sending repeated images, real engines on
/// two shared cores, or mock engines).
fn load_defaults(args: &DemoArgs, images: bool, on_real: bool) -> (usize, usize) {
    let concurrency = args.concurrency.unwrap_or(match (images, on_real) {
        (true, _) => 2,
        (false, true) => 4,
        (false, false) => 16,
    });
    let requests = args.requests.unwrap_or(match (on_real, args.quick) {
        (true, true) => 80,
        (true, false) => 160,
        (false, true) => 160,
        (false, false) => 400,
    });
    (concurrency.max(1), requests)
}

/// The workload of `--workload` and its sizes; with real engines, sized
/// for the tiny model (its 4,096-token context, its vocabulary, its name).
fn workload_spec(args: &DemoArgs, kind: WorkloadKind, real: Option<&RealEngines>) -> WorkloadSpec {
    let on_real = real.is_some();
    let sized_for_real = on_real && args.scale.is_none();
    WorkloadSpec {
        kind,
        seed: args.seed,
        // long-doc's 10,000 and random's 7,200 tokens fit at 0.3.
        scale: args.scale.unwrap_or(match kind {
            WorkloadKind::LongDoc | WorkloadKind::Random if on_real => 0.3,
            _ => 1.0,
        }),
        groups: args
            .groups
            .unwrap_or(if on_real { REAL_GROUPS } else { 16 }),
        mm_tokens_per_image: MM_TOKENS_PER_IMAGE,
        max_tokens: args.max_tokens,
        question_tokens: args
            .question_tokens
            .or(sized_for_real.then_some(REAL_QUESTION_TOKENS)),
        prefix_tokens: sized_for_real.then_some(REAL_PREFIX_TOKENS),
        model: real.map(|r| r.served_model.clone()),
        token_ids: real.map(|r| r.token_ids),
        ..WorkloadSpec::default()
    }
}

/// The engines of `--engines`, checked against the workload they can serve.
fn real_engines(args: &DemoArgs) -> Result<Option<RealEngines>> {
    let Some(path) = &args.engines else {
        return Ok(None);
    };
    if matches!(
        args.workload,
        DemoWorkload::Pd | DemoWorkload::Kind(WorkloadKind::Images)
    ) || args.flavor != WorkerFlavor::Vllm
    {
        bail!("--engines runs text workloads on aggregated vLLM engines (not images, pd or --flavor sglang)");
    }
    Ok(Some(RealEngines::read(path).with_context(|| {
        format!("--engines {}", path.display())
    })?))
}

/// The routers `--policies` names (by default the demo's, or the P/D
/// demo's when the fleet is split), each under its name.
fn contenders(args: &DemoArgs, split: bool) -> Result<Vec<(String, Contender)>> {
    let default_policies = if split { PD_POLICIES } else { POLICIES };
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
    Ok(contenders)
}

fn config(args: &DemoArgs) -> Result<DemoConfig> {
    let real = real_engines(args)?;
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
    let on_real = real.is_some();
    let (concurrency, requests) = load_defaults(args, images, on_real);
    let workload = workload_spec(args, kind, real.as_ref());
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
        (None, None) => {
            let cap = match (on_real, args.quick) {
                (true, true) => 60,
                (true, false) => 120,
                (false, true) => 20,
                (false, false) => 40,
            };
            (
                workload,
                args.gpu_blocks,
                requests,
                Some(Duration::from_secs(cap)),
            )
        }
    };
    let contenders = contenders(args, layout.is_some())?;
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
        real_engines: real,
    })
}

/// Runs the demo.
pub fn run(args: &DemoArgs) -> Result<ExitCode> {
    let config = config(args)?;
    super::init_logging(tracing_subscriber::filter::LevelFilter::WARN);
    // Text and chat requests are tokenized as the engines do: the mock
    // engines' built-in tokenizer, or the real engines' model's.
    let tokenizer = match config
        .real_engines
        .as_ref()
        .and_then(|r| r.tokenizer.as_ref())
    {
        Some(path) => Tokenizer::from_file(path)
            .with_context(|| format!("the engines' tokenizer {}", path.display()))?,
        None => Tokenizer::builtin(),
    };
    let tokenizer = renderer(tokenizer, MM_TOKENS_PER_IMAGE);
    let runtime = super::runtime()?;
    if args.rounds > 1 {
        return run_rounds(args, &config, tokenizer, &runtime);
    }
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

/// `--rounds N` (N ≥ 2): every round's table, then the medians; the report
/// holds every round's document and the summary, the plot the last
/// round's.
fn run_rounds(
    args: &DemoArgs,
    config: &DemoConfig,
    tokenizer: kvroute_loadgen::embedded_router::RouterTokenizer,
    runtime: &tokio::runtime::Runtime,
) -> Result<ExitCode> {
    let rounds = usize::from(args.rounds);
    let outcome = runtime.block_on(async {
        demo::rounds::run_rounds(config, tokenizer, rounds, super::shutdown_signal()).await
    })?;
    let Some(done) = outcome else {
        eprintln!("kvroute demo: interrupted; the routers and the engines are stopped");
        return Ok(ExitCode::from(130));
    };
    for (i, round) in done.reports().iter().enumerate() {
        println!("\nround {} of {rounds}:", i + 1);
        print!("{round}");
    }
    println!();
    print!("{done}");
    done.write_json(&args.report)
        .with_context(|| format!("--report {}", args.report.display()))?;
    if let Some(last) = done.reports().last() {
        kvroute_loadgen::write_svg_plot(&args.plot, &last.report)
            .with_context(|| format!("--plot {}", args.plot.display()))?;
    }
    println!(
        "\nwrote {} (every round and the medians) and {} (the last round), {} requests per policy per round",
        args.report.display(),
        args.plot.display(),
        config.load.requests
    );
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
    fn real_engines_get_prompts_that_fit_the_tiny_model() {
        let dir = std::env::temp_dir().join(format!("kvroute-demo-engines-{}", std::process::id()));
        std::fs::create_dir_all(&dir).expect("dir");
        let file = dir.join("engines.json");
        let doc = serde_json::json!({"served_model_name": "tiny", "block_size": 32,
            "token_ids": [16, 32000], "engines": [{"name": "e0", "url": "http://127.0.0.1:1",
            "events": "tcp://127.0.0.1:2", "replay": "tcp://127.0.0.1:3",
            "worker": "name=e0,url=http://127.0.0.1:1,events=tcp://127.0.0.1:2,replay=tcp://127.0.0.1:3"}]});
        std::fs::write(&file, doc.to_string()).expect("write");
        let path = file.to_string_lossy().into_owned();
        let c = parse(&["--engines", &path]).expect("valid");
        let w = &c.load.workload;
        assert_eq!(
            (
                w.shared_prefix_tokens(),
                w.shared_question_tokens(),
                w.groups
            ),
            (REAL_PREFIX_TOKENS, REAL_QUESTION_TOKENS, REAL_GROUPS)
        );
        assert_eq!(
            (w.token_ids, w.model.as_deref()),
            (Some((16, 32_000)), Some("tiny"))
        );
        assert_eq!(c.load.arrival, Arrival::Closed { concurrency: 4 });
        assert_eq!(c.load.requests, 160);
        assert!(c.real_engines.is_some());
        let doc = parse(&["--engines", &path, "--workload", "long-doc"]).expect("valid");
        assert_eq!(
            doc.load.workload.scale, 0.3,
            "10,000 tokens do not fit 4,096"
        );
        assert!(parse(&["--engines", &path, "--workload", "images"]).is_err());
        assert!(parse(&["--engines", &path, "--workers", "3"]).is_err());
        let _ = std::fs::remove_dir_all(&dir);
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
