//! `kvroute bench`: measurements that all come from one tool.
//!
//! With a subcommand it measures one of kvroute's parts (`index`, `ingest`,
//! `proxy`, `replicas`); without one it is the load generator: a seeded workload sent at
//! any OpenAI-compatible endpoint (kvroute, one engine, another router) or
//! through the oracle, so policies compare side by side. The measurements
//! live in `kvroute-loadgen`; this module turns flags into its configs.

use std::io::IsTerminal;
use std::process::ExitCode;
use std::time::Duration;

use anyhow::{bail, Context, Result};
use clap::{Args, Subcommand};
use kvroute_bench::{self as bench, fairness, index, ingest, proxy, replicas, restore};
use kvroute_loadgen as load;

/// Arguments of `kvroute bench`.
#[derive(Debug, Args)]
#[command(args_conflicts_with_subcommands = true)]
pub struct BenchArgs {
    #[command(subcommand)]
    what: Option<BenchCommand>,
    #[command(flatten)]
    load: super::load::LoadArgs,
}

/// What to measure.
#[derive(Debug, Subcommand)]
enum BenchCommand {
    /// The prefix index alone: apply throughput, lookup latency, memory, snapshots.
    Index(IndexArgs),
    /// A `kvroute serve` process ingesting many ranks: time to live, threads,
    /// idle CPU, memory per rank, apply rate under a flood.
    Ingest(IngestArgs),
    /// Latency `kvroute serve` adds per request: through the router vs straight to mock engines.
    Proxy(ProxyArgs),
    /// Router replicas: one router vs two synced over NATS vs two unsynced,
    /// and one replica killed under load (hit rate, balance, peer delay).
    Replicas(ReplicasArgs),
    /// Time to ready of a `kvroute serve` that starts on a saved index
    /// (`--state-dir`, or its peers' snapshot over `--nats`).
    Restore(RestoreArgs),
    /// Tenants and priorities in the overload queue, in real time: a small
    /// tenant's and a high priority's TTFT alone vs beside ten times the
    /// load (docs/serving.md, "Tenants and priorities").
    Fairness(FairnessArgs),
    /// Routing quality on a virtual clock: the mocker's engines and
    /// kvroute's scheduler with no sockets and no sleeping, per policy,
    /// seed and cost weights (a sweep in seconds).
    Sim(Box<super::sim::SimArgs>),
    /// Print a synthesized Mooncake-format trace (JSONL) for `--trace`.
    SynthTrace(super::sim::SynthTraceArgs),
}

/// Arguments of `kvroute bench restore`.
#[derive(Debug, Args)]
struct RestoreArgs {
    /// Residencies of the saved index.
    #[arg(long, default_value_t = 1_000_000, value_parser = clap::value_parser!(u64).range(1..))]
    residencies: u64,
    /// Workers of the saved fleet.
    #[arg(long, default_value_t = 128, value_parser = clap::value_parser!(u32).range(1..))]
    workers: u32,
    /// Starts timed per source (the median is reported).
    #[arg(long, default_value_t = 5, value_parser = clap::value_parser!(u64).range(1..=100))]
    runs: u64,
    /// Seed of the trace.
    #[arg(long, default_value_t = 42)]
    seed: u64,
    /// Print one JSON object.
    #[arg(long)]
    json: bool,
}

/// Arguments of `kvroute bench index`.
#[derive(Debug, Args)]
struct IndexArgs {
    /// Workers in the simulated fleet.
    #[arg(long, default_value_t = 128, value_parser = clap::value_parser!(u32).range(1..))]
    workers: u32,
    /// Resident (block, worker) entries the index holds once every cache is full.
    #[arg(long, default_value_t = 1_000_000)]
    blocks: u64,
    /// A tenth of the size and fewer queries (under 30 s).
    #[arg(long)]
    quick: bool,
    /// Print one JSON object instead of a table.
    #[arg(long)]
    json: bool,
    /// Seed of the trace.
    #[arg(long, default_value_t = 42)]
    seed: u64,
    /// Blocks per lookup query.
    #[arg(long, default_value_t = 64)]
    query_blocks: usize,
    /// Also replay a Mooncake-format trace (JSONL: timestamp, input_length,
    /// output_length, hash_ids) over `--workers` simulated workers; its
    /// figures are reported under `trace`.
    #[arg(long, value_name = "FILE")]
    trace: Option<std::path::PathBuf>,
    /// `--trace`: blocks each simulated worker's cache holds (default:
    /// `--blocks` ÷ `--workers`).
    #[arg(long, value_parser = clap::value_parser!(u64).range(1..))]
    trace_blocks_per_worker: Option<u64>,
    /// Writer threads (and index shards) of the sharded apply (default: the
    /// cores available).
    #[arg(long, value_parser = clap::value_parser!(u64).range(1..=64))]
    threads: Option<u64>,
}

/// Arguments of `kvroute bench ingest`.
#[derive(Debug, Args)]
struct IngestArgs {
    /// Workers registered with the router.
    #[arg(long, default_value_t = 512, value_parser = clap::value_parser!(u32).range(1..))]
    workers: u32,
    /// Data-parallel ranks per worker (one event stream each).
    #[arg(long, default_value_t = 8, value_parser = clap::value_parser!(u32).range(1..=500))]
    dp: u32,
    /// Seconds over which the router's CPU is measured with every rank connected and quiet.
    #[arg(long, default_value_t = 10.0)]
    idle_secs: f64,
    /// Seconds every rank publishes.
    #[arg(long, default_value_t = 10.0)]
    flood_secs: f64,
    /// Block operations per second the publishers offer together during the
    /// flood (0: as fast as they can, which on a small machine starves the
    /// router of CPU and measures the publishers instead).
    #[arg(long, default_value_t = 1_500_000)]
    flood_rate: u64,
    /// Stored events per batch (each batch also removes the blocks of an older one).
    #[arg(long, default_value_t = 4, value_parser = clap::value_parser!(u32).range(1..))]
    events_per_batch: u32,
    /// Blocks per stored event.
    #[arg(long, default_value_t = 16, value_parser = clap::value_parser!(u32).range(1..))]
    blocks_per_event: u32,
    /// Tokens per block.
    #[arg(long, default_value_t = 16, value_parser = clap::value_parser!(u32).range(1..))]
    block_size: u32,
    /// Batches each rank keeps for replay.
    #[arg(long, default_value_t = 64)]
    replay_buffer: usize,
    /// Ranks per publisher process (each one thread; at most 500: ZeroMQ's
    /// 1 023 sockets per context, two per rank).
    #[arg(long, default_value_t = 500, value_parser = clap::value_parser!(u32).range(1..=500))]
    ranks_per_publisher: u32,
    /// Longest wait, in seconds, for every rank to be `live`.
    #[arg(long, default_value_t = 180)]
    live_timeout_secs: u64,
    /// First 127.0.0.1 port tried for the publishers' sockets (all stay below 32768).
    #[arg(long, default_value_t = 20_000)]
    first_port: u16,
    /// The `kvroute` executable whose `serve` is measured (default: this one).
    #[arg(long, value_name = "PATH")]
    router_exe: Option<std::path::PathBuf>,
    /// Print one JSON object instead of a table.
    #[arg(long)]
    json: bool,
}

/// Arguments of `kvroute bench-publisher` (hidden): one publisher process
/// of `kvroute bench ingest`, driven through its stdin.
#[derive(Debug, Args)]
pub struct PublisherArgs {
    /// Ranks per worker.
    #[arg(long)]
    dp: u32,
    /// `EVENTS/REPLAY` base ports of each worker served, comma-separated.
    #[arg(long, value_delimiter = ',', value_parser = parse_port_pair)]
    ports: Vec<(u16, u16)>,
    /// Stored events per batch.
    #[arg(long)]
    events_per_batch: u32,
    /// Blocks per stored event.
    #[arg(long)]
    blocks_per_event: u32,
    /// Tokens per block.
    #[arg(long)]
    block_size: u32,
    /// Batches each rank keeps for replay.
    #[arg(long)]
    replay_buffer: usize,
    /// Seed of the hashes and tokens.
    #[arg(long, default_value_t = 1)]
    seed: u64,
}

/// `EVENTS/REPLAY`, two ports.
fn parse_port_pair(s: &str) -> Result<(u16, u16)> {
    let (e, r) = s
        .split_once('/')
        .context("expected EVENTS_PORT/REPLAY_PORT")?;
    Ok((e.parse()?, r.parse()?))
}

/// Runs one publisher process of `kvroute bench ingest`.
pub fn run_publisher(a: &PublisherArgs) -> Result<ExitCode> {
    super::init_logging(tracing_subscriber::filter::LevelFilter::WARN);
    let rank_count = a.ports.len() as u64 * u64::from(a.dp);
    if rank_count > u64::from(ingest::publisher::MAX_RANKS_PER_PUBLISHER) {
        bail!("{rank_count} ranks: a publisher serves at most 500");
    }
    ingest::publisher::run(&ingest::publisher::PublisherConfig {
        workers: a.ports.clone(),
        dp: a.dp,
        events_per_batch: a.events_per_batch,
        blocks_per_event: a.blocks_per_event,
        block_size: a.block_size,
        replay_buffer: a.replay_buffer,
        seed: a.seed,
    })?;
    Ok(ExitCode::SUCCESS)
}

/// Arguments of `kvroute bench proxy`.
#[derive(Debug, Args)]
struct ProxyArgs {
    /// Mock engines behind the router.
    #[arg(long, default_value_t = 2, conflicts_with = "pd")]
    workers: u16,
    /// PREFILL:DECODE engines (e.g. `2:2`) instead: the router splits every
    /// request into a prefill leg and a decode leg, so its CPU per request
    /// compares with an aggregated run's.
    #[arg(long, value_name = "P:D", value_parser = super::args::parse_layout)]
    pd: Option<kvroute_loadgen::PdLayout>,
    /// Requests per phase (direct, then through the router), at each concurrency.
    #[arg(long, default_value_t = 20_000)]
    requests: u64,
    /// Requests in flight at once; a list (`1,8,32`) runs each in turn.
    #[arg(long, default_value = "16", value_delimiter = ',')]
    concurrency: Vec<u64>,
    /// Target requests per second (open loop, latency measured from each
    /// request's scheduled start); 0: closed loop, as fast as possible.
    #[arg(long, default_value_t = 0.0)]
    rate: f64,
    /// Prompt tokens per request (a shared prefix of half, then a unique suffix).
    #[arg(long, default_value_t = 256, conflicts_with = "text")]
    prompt_tokens: u32,
    /// Text prompts instead of token ids, tokenized by the router and the
    /// engines with `--tokenizer`.
    #[arg(long)]
    text: bool,
    /// `--text`: words per prompt (half shared by one request in 8, half unique).
    #[arg(long, default_value_t = 512, requires = "text")]
    prompt_words: u32,
    /// `--text`: a Hugging Face `tokenizer.json`, or `builtin` for the
    /// mocker's built-in tokenizer; given to the router and the engines.
    #[arg(
        long,
        value_name = "FILE|builtin",
        default_value = "builtin",
        requires = "text"
    )]
    tokenizer: proxy::TokenizerSource,
    /// `--text`: every request sends the same prompt, as a load tool replaying
    /// one body does (`wrk`); without it half of each prompt is new.
    #[arg(long, requires = "text")]
    repeat: bool,
    /// The `kvroute` executable whose `serve` is measured (default: this one),
    /// to compare two builds on the same load.
    #[arg(long, value_name = "PATH")]
    router_exe: Option<std::path::PathBuf>,
    /// Divides the engines' simulated time (large: measure the router, not the engine).
    #[arg(long, default_value_t = 10_000.0)]
    speedup: f64,
    /// Print one JSON object per concurrency (one per line) instead of a table.
    #[arg(long)]
    json: bool,
    /// Alternate the two paths request by request (each task sends one
    /// request straight to an engine, then one through the router) instead of
    /// running all direct requests before all routed ones, so that drift in
    /// the machine's speed weighs on both alike. Closed loop only.
    #[arg(long)]
    interleave: bool,
}

/// Arguments of `kvroute bench replicas`.
#[derive(Debug, Args)]
struct ReplicasArgs {
    /// Mock engines behind the routers (one DP rank each).
    #[arg(long, default_value_t = 4, value_parser = clap::value_parser!(u16).range(1..))]
    engines: u16,
    /// KV-cache blocks per engine (the mocker's default; fewer than the
    /// workload's prefixes need make where requests go show in the hit rate).
    #[arg(long, default_value_t = 16_384, value_parser = clap::value_parser!(u64).range(1..))]
    gpu_blocks: u64,
    /// Requests per phase.
    #[arg(long, default_value_t = 10_000)]
    requests: usize,
    /// Requests in flight at once (closed loop).
    #[arg(long, default_value_t = 16)]
    concurrency: usize,
    /// The traffic (the same seeded requests in every phase).
    #[arg(long, default_value = "shared-prefix", value_parser = super::args::workload_parser())]
    workload: load::WorkloadKind,
    /// Multiplies every workload size.
    #[arg(long, default_value_t = 0.05)]
    scale: f64,
    /// Prefix groups, conversations, documents or image pool size (per workload).
    #[arg(long, default_value_t = 8)]
    groups: usize,
    /// Tokens generated per request.
    #[arg(long, default_value_t = 16)]
    max_tokens: u32,
    /// Divides the engines' simulated time.
    #[arg(long, default_value_t = 50.0)]
    speedup: f64,
    /// Seed of the workload.
    #[arg(long, default_value_t = 1)]
    seed: u64,
    /// Milliseconds after the load of the last phase starts that replica r0 is killed.
    #[arg(long, default_value_t = 1_000)]
    kill_after_ms: u64,
    /// Print one JSON object instead of the tables.
    #[arg(long)]
    json: bool,
}

/// Runs the chosen benchmark, or the load generator without a subcommand.
pub fn run(args: &BenchArgs) -> Result<ExitCode> {
    match &args.what {
        Some(BenchCommand::Index(a)) => run_index(a),
        Some(BenchCommand::Ingest(a)) => run_ingest(a),
        Some(BenchCommand::Proxy(a)) => run_proxy(a),
        Some(BenchCommand::Restore(a)) => run_restore(a),
        Some(BenchCommand::Fairness(a)) => run_fairness(a),
        Some(BenchCommand::Replicas(a)) => run_replicas(a),
        Some(BenchCommand::Sim(a)) => super::sim::run(a),
        Some(BenchCommand::SynthTrace(a)) => super::sim::synth_trace(a),
        None => super::load::run_load(&args.load),
    }
}

/// Prints a flat report as JSON or as aligned lines.
fn print_flat(report: &serde_json::Value, json: bool, width: usize) {
    if json {
        println!("{report}");
    } else {
        print!("{}", bench::key_value_lines(report, width));
    }
}

fn run_index(a: &IndexArgs) -> Result<ExitCode> {
    let config = index::IndexBenchConfig {
        workers: a.workers,
        residencies: if a.quick {
            (a.blocks / 10).max(1_000)
        } else {
            a.blocks
        },
        queries: if a.quick { 20_000 } else { 100_000 },
        query_blocks: a.query_blocks,
        seed: a.seed,
        threads: a.threads.map_or_else(
            || std::thread::available_parallelism().map_or(1, usize::from),
            |t| t as usize,
        ),
        heap_meter: crate::heap_meter(),
    };
    if config.heap_meter.is_none() {
        eprintln!(
            "[bench index] bytes_per_residency needs a heap-counting build: \
             cargo build --release -p kvroute --features alloc-meter \
             (estimated_heap_bytes_per_residency, from table capacities, is reported either way)"
        );
    }
    let trace = a
        .trace
        .as_deref()
        .map(load::mooncake::Trace::read)
        .transpose()?;
    let mut report = index::run(&config)?;
    if let Some(trace) = trace {
        let replay = bench::index_trace::TraceReplayConfig {
            workers: a.workers,
            blocks_per_worker: a
                .trace_blocks_per_worker
                .unwrap_or((config.residencies / u64::from(a.workers)).max(1)),
            seed: a.seed,
        };
        report["trace"] = bench::index_trace::replay(&trace, &replay)?;
    }
    print_flat(&report, a.json, 40);
    Ok(ExitCode::SUCCESS)
}

fn run_ingest(a: &IngestArgs) -> Result<ExitCode> {
    let exe = match &a.router_exe {
        Some(path) => path.clone(),
        None => std::env::current_exe().context("the path of this kvroute executable")?,
    };
    let config = ingest::IngestBenchConfig {
        workers: a.workers,
        dp: a.dp,
        idle_secs: a.idle_secs,
        flood_secs: a.flood_secs,
        flood_rate: a.flood_rate,
        events_per_batch: a.events_per_batch,
        blocks_per_event: a.blocks_per_event,
        block_size: a.block_size,
        replay_buffer: a.replay_buffer,
        ranks_per_publisher: a.ranks_per_publisher,
        live_timeout: Duration::from_secs(a.live_timeout_secs),
        first_port: a.first_port,
        ..ingest::IngestBenchConfig::new(exe)
    };
    print_flat(&ingest::run(&config)?, a.json, 36);
    Ok(ExitCode::SUCCESS)
}

fn run_restore(a: &RestoreArgs) -> Result<ExitCode> {
    let config = restore::RestoreBenchConfig {
        router_exe: std::env::current_exe().context("the path of this kvroute executable")?,
        workers: a.workers,
        residencies: a.residencies,
        runs: a.runs as usize,
        seed: a.seed,
    };
    let report = super::runtime()?.block_on(restore::run(&config))?;
    if a.json {
        println!("{report}");
    } else {
        println!("{}", serde_json::to_string_pretty(&report)?);
    }
    Ok(ExitCode::SUCCESS)
}

fn run_proxy(a: &ProxyArgs) -> Result<ExitCode> {
    if crate::heap_meter().is_some() {
        bail!(
            "this kvroute counts every allocation (built with --features alloc-meter), \
             which would weigh on the router it measures: build without the feature"
        );
    }
    if a.concurrency.iter().any(|&c| c == 0 || a.requests < c) {
        bail!("--requests must be at least every --concurrency (≥ 1)");
    }
    if a.interleave && a.rate > 0.0 {
        bail!("--interleave runs a closed loop; leave out --rate");
    }
    let config = proxy::ProxyBenchConfig {
        router_exe: match &a.router_exe {
            Some(path) => path.clone(),
            None => std::env::current_exe().context("the path of this kvroute executable")?,
        },
        workers: a.workers,
        pd: a.pd,
        requests: a.requests,
        concurrency: a.concurrency.clone(),
        rate: a.rate,
        prompt: if a.text {
            proxy::Prompt::Text {
                words: a.prompt_words,
                tokenizer: a.tokenizer.clone(),
                repeat: a.repeat,
            }
        } else {
            proxy::Prompt::TokenIds {
                tokens: a.prompt_tokens,
            }
        },
        speedup: a.speedup,
        interleave: a.interleave,
    };
    let report = super::runtime()?.block_on(proxy::run(&config))?;
    if a.json {
        for run in report.to_json() {
            println!("{run}");
        }
    } else {
        print!("{report}");
    }
    Ok(ExitCode::SUCCESS)
}

fn run_replicas(a: &ReplicasArgs) -> Result<ExitCode> {
    super::init_logging(tracing_subscriber::filter::LevelFilter::WARN);
    let config = replicas::ReplicasBenchConfig {
        engines: a.engines,
        gpu_blocks: usize::try_from(a.gpu_blocks).context("--gpu-blocks is too large")?,
        requests: a.requests,
        concurrency: a.concurrency,
        workload: a.workload,
        scale: a.scale,
        groups: a.groups,
        max_tokens: a.max_tokens,
        speedup: a.speedup,
        seed: a.seed,
        kill_after: Duration::from_millis(a.kill_after_ms),
        progress: std::io::stderr().is_terminal(),
        ..replicas::ReplicasBenchConfig::new(
            std::env::current_exe().context("the path of this kvroute executable")?,
        )
    };
    let report = super::runtime()?.block_on(replicas::run(&config))?;
    if a.json {
        println!("{}", report.to_json());
    } else {
        print!("{report}");
    }
    Ok(ExitCode::SUCCESS)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::cmd::load::load_options;
    use clap::Parser;

    #[derive(Debug, Parser)]
    struct Cli {
        #[command(flatten)]
        bench: BenchArgs,
    }

    #[test]
    fn a_preset_sets_the_workload_requests_and_concurrency() {
        let cli = Cli::try_parse_from(["bench", "--preset", "long", "--seed", "3", "--no-stream"])
            .expect("parses");
        let (_, o) = load_options(&cli.bench.load).expect("valid");
        assert_eq!(o.requests, 1_000);
        assert_eq!(o.arrival, load::Arrival::Closed { concurrency: 16 });
        assert_eq!(o.workload.groups, 32);
        assert_eq!(o.workload.describe()["sizes"]["prefix_tokens"], 2_048);
        assert_eq!((o.workload.seed, o.workload.stream), (3, false));
        assert!(Cli::try_parse_from(["bench", "--preset", "long", "--groups", "4"]).is_err());
        let unknown = Cli::try_parse_from(["bench", "--preset", "huge"]).expect_err("unknown");
        assert!(
            unknown.to_string().contains("known: long, short"),
            "{unknown}"
        );
    }

    #[test]
    fn without_a_subcommand_the_flags_configure_the_load_generator() {
        let cli = Cli::try_parse_from([
            "bench",
            "--workload",
            "multi-turn",
            "--rate",
            "20",
            "--duration-secs",
            "60",
            "--scale",
            "0.1",
            "--label",
            "kv",
        ])
        .expect("parses");
        assert!(cli.bench.what.is_none());
        let (endpoint, o) = load_options(&cli.bench.load).expect("valid");
        assert_eq!(
            endpoint,
            load::Endpoint::OpenAi {
                base_url: "http://127.0.0.1:8000".into()
            }
        );
        assert_eq!(o.workload.kind, load::WorkloadKind::MultiTurn);
        assert_eq!(o.arrival, load::Arrival::Poisson { rate: 20.0 });
        assert_eq!(o.max_duration, Some(Duration::from_secs(60)));
        assert_eq!(o.label, "kv");

        let cli =
            Cli::try_parse_from(["bench", "--oracle", "http://a:1,http://b:2"]).expect("parses");
        let (endpoint, o) = load_options(&cli.bench.load).expect("valid");
        assert_eq!(
            endpoint,
            load::Endpoint::Oracle {
                workers: vec!["http://a:1".into(), "http://b:2".into()]
            }
        );
        assert_eq!(o.label, "oracle");
        assert_eq!(o.arrival, load::Arrival::Closed { concurrency: 16 });

        let cli = Cli::try_parse_from(["bench", "--url", "http://a:1,http://b:2", "--url", "c:3"])
            .expect("parses");
        let (endpoint, o) = load_options(&cli.bench.load).expect("valid");
        assert_eq!(
            endpoint,
            load::Endpoint::Balanced {
                base_urls: vec!["http://a:1".into(), "http://b:2".into(), "c:3".into()]
            }
        );
        assert_eq!(o.label, "target");
        let cli = Cli::try_parse_from(["bench", "--url", "http://a:1,"]).expect("parses");
        assert!(load_options(&cli.bench.load).is_err());
    }

    #[test]
    fn subcommands_still_work_and_conflict_with_load_flags() {
        let cli = Cli::try_parse_from(["bench", "index", "--quick"]).expect("parses");
        assert!(matches!(cli.bench.what, Some(BenchCommand::Index(_))));
        let cli = Cli::try_parse_from(["bench", "replicas", "--requests", "200"]).expect("parses");
        let Some(BenchCommand::Replicas(r)) = cli.bench.what else {
            panic!("bench replicas parses as its subcommand");
        };
        assert_eq!((r.engines, r.requests, r.concurrency), (4, 200, 16));
        assert_eq!(r.gpu_blocks, 16_384);
        assert_eq!((r.scale, r.groups, r.max_tokens), (0.05, 8, 16));
        assert_eq!((r.speedup, r.seed, r.kill_after_ms), (50.0, 1, 1_000));
        assert_eq!(r.workload, load::WorkloadKind::SharedPrefix);
        assert!(Cli::try_parse_from(["bench", "replicas", "--engines", "0"]).is_err());
        assert!(Cli::try_parse_from(["bench", "--requests", "5", "index"]).is_err());
        assert!(Cli::try_parse_from(["bench", "--rate", "5", "--concurrency", "2"]).is_err());
        let cli = Cli::try_parse_from(["bench", "--rate", "0"]).expect("parses");
        assert!(load_options(&cli.bench.load).is_err());
        let cli = Cli::try_parse_from(["bench", "--requests", "0"]).expect("parses");
        assert!(load_options(&cli.bench.load).is_err());
    }
}

/// Arguments of `kvroute bench fairness` (the fields of
/// [`fairness::FairnessBenchConfig`]).
#[derive(Debug, Args)]
struct FairnessArgs {
    /// Mock engines behind the router.
    #[arg(long, default_value_t = 24, value_parser = clap::value_parser!(u16).range(1..))]
    workers: u16,
    /// Prompt tokens of every request.
    #[arg(long, default_value_t = 1024)]
    prompt_tokens: u32,
    /// Tokens each answer streams (1: a rank is free again at its first
    /// token, with no decode step to wait behind).
    #[arg(long, default_value_t = 1)]
    max_tokens: u32,
    /// Divides the engines' simulated time (below 1: slower engines).
    #[arg(long, default_value_t = 0.1)]
    speedup: f64,
    /// Requests per second of the small tenant (and of the high priority).
    #[arg(long, default_value_t = 8.0)]
    rate: f64,
    /// The big tenant's (and the low priority's) rate over --rate.
    #[arg(long, default_value_t = 10.0)]
    ratio: f64,
    /// Seconds of each phase.
    #[arg(long, default_value_t = 24.0)]
    secs: f64,
    /// Requests scheduled in a phase's first seconds are not counted.
    #[arg(long, default_value_t = 4.0)]
    warmup_secs: f64,
    /// Runs of the four phases (the table gives medians).
    #[arg(long, default_value_t = 3)]
    runs: usize,
    /// The router's --busy-requests.
    #[arg(long, default_value_t = 16)]
    busy_requests: u64,
    /// The router's --busy-prefill-tokens (1: one prefill per rank at a time).
    #[arg(long, default_value_t = 1)]
    busy_prefill_tokens: u64,
    /// The router's --queue-capacity.
    #[arg(long, default_value_t = 256)]
    queue_capacity: usize,
    /// Seed of the arrivals and prompts.
    #[arg(long, default_value_t = 7)]
    seed: u64,
    /// The `kvroute` executable to measure (default: this one).
    #[arg(long, value_name = "PATH")]
    router_exe: Option<std::path::PathBuf>,
    /// Print the settings, every run and the medians as one JSON object.
    #[arg(long)]
    json: bool,
}

fn run_fairness(a: &FairnessArgs) -> Result<ExitCode> {
    let config = fairness::FairnessBenchConfig {
        router_exe: match &a.router_exe {
            Some(path) => path.clone(),
            None => std::env::current_exe().context("the path of this kvroute executable")?,
        },
        workers: a.workers,
        prompt_tokens: a.prompt_tokens,
        max_tokens: a.max_tokens,
        speedup: a.speedup,
        rate: a.rate,
        ratio: a.ratio,
        secs: a.secs,
        warmup_secs: a.warmup_secs,
        runs: a.runs,
        busy_requests: a.busy_requests,
        busy_prefill_tokens: a.busy_prefill_tokens,
        queue_capacity: a.queue_capacity,
        seed: a.seed,
    };
    let report = super::runtime()?.block_on(fairness::run(&config))?;
    if a.json {
        println!("{}", report.to_json());
    } else {
        print!("{report}");
    }
    Ok(ExitCode::SUCCESS)
}
