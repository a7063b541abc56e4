//! `kvroute bench`: measurements that all come from one tool.
//!
//! With a subcommand it measures one of kvroute's parts (`index`, `ingest`,
//! `proxy`); without one it is the load generator ([`load`]): a seeded
//! workload sent at any OpenAI-compatible endpoint (kvroute, one engine,
//! another router) or through the oracle, so policies compare side by side.

use std::io::IsTerminal;
use std::path::PathBuf;
use std::process::ExitCode;
use std::time::Duration;

use anyhow::{bail, Context, Result};
use clap::{Args, Subcommand};

pub mod index;
pub mod ingest;
pub mod proxy;

use kvroute_loadgen as load;

/// Arguments of `kvroute bench`.
#[derive(Debug, Args)]
#[command(args_conflicts_with_subcommands = true)]
pub struct BenchArgs {
    #[command(subcommand)]
    what: Option<BenchCommand>,
    #[command(flatten)]
    load: LoadArgs,
}

/// What to measure.
#[derive(Debug, Subcommand)]
enum BenchCommand {
    /// The prefix index alone: apply throughput, lookup latency, memory, snapshots.
    Index(index::IndexBenchArgs),
    /// Sustained ingest: mock engines' publishers → ZeroMQ → decoder → index.
    Ingest(ingest::IngestBenchArgs),
    /// Latency `kvroute serve` adds per request: through the router vs straight to mock engines.
    Proxy(proxy::ProxyBenchArgs),
}

/// The load generator's flags (`kvroute bench` without a subcommand).
#[derive(Debug, Args)]
struct LoadArgs {
    /// Base URL of the OpenAI-compatible target (kvroute, an engine, another router).
    #[arg(long, default_value = "http://127.0.0.1:8000")]
    url: String,
    /// Route like an oracle instead: ask these mockers' `/internal/cache_match`
    /// and send each request to the (worker, rank) holding the longest prefix
    /// (repeat the flag or separate with commas; `--url` is then unused).
    #[arg(long, value_name = "URL", value_delimiter = ',')]
    oracle: Vec<String>,
    /// The traffic.
    #[arg(long, default_value = "shared-prefix", value_parser = workload_parser())]
    workload: load::WorkloadKind,
    /// Requests to send (0: until --duration-secs is up).
    #[arg(long, default_value_t = 200)]
    requests: usize,
    /// Closed loop: requests in flight at once.
    #[arg(long, default_value_t = 16, conflicts_with = "rate")]
    concurrency: usize,
    /// Open loop: Poisson arrivals at this many requests per second
    /// (latency measured from each request's scheduled start).
    #[arg(long)]
    rate: Option<f64>,
    /// Start no request after this many seconds.
    #[arg(long)]
    duration_secs: Option<f64>,
    /// Multiplies every workload size (1.0: llm-d's 6,000-token prefixes and
    /// 1,200-token questions).
    #[arg(long, default_value_t = 1.0)]
    scale: f64,
    /// Prefix groups, conversations, documents or image pool size (per workload).
    #[arg(long, default_value_t = 8)]
    groups: usize,
    /// Seed of every random choice, token and arrival time.
    #[arg(long, default_value_t = 1)]
    seed: u64,
    /// Tokens generated per request.
    #[arg(long, default_value_t = 32)]
    max_tokens: u32,
    /// Prompt positions one image takes on the target (recorded in the report).
    #[arg(long, default_value_t = 64)]
    mm_tokens_per_image: usize,
    /// Send completion prompts as text (one word per token id) instead of
    /// token ids; kvroute then needs `--tokenizer` to see prefixes.
    #[arg(long)]
    text: bool,
    /// The `model` field of every request (omitted by default).
    #[arg(long)]
    model: Option<String>,
    /// A Hugging Face `tokenizer.json`: send completion prompts as the text
    /// this tokenizer decodes the workload's ids to (real text for a real
    /// engine; give the router the same file).
    #[arg(long, value_name = "FILE")]
    tokenizer: Option<std::path::PathBuf>,
    /// `shared-prefix`: tokens per question instead of 1,200 × `--scale`.
    #[arg(long)]
    question_tokens: Option<usize>,
    /// The policy's name in the report (default: `oracle` with --oracle, else `target`).
    #[arg(long)]
    label: Option<String>,
    /// Print one JSON object (`{"workload", "policies": {"<label>": {...}}}`) instead of a table.
    #[arg(long)]
    json: bool,
    /// Also write an SVG plot (hit rate and TTFT per policy, TTFT over time).
    #[arg(long, value_name = "FILE")]
    plot: Option<PathBuf>,
    /// No progress bar (it is drawn only when stderr is a terminal anyway).
    #[arg(long)]
    no_progress: bool,
}

/// Runs the chosen benchmark, or the load generator without a subcommand.
pub fn run(args: &BenchArgs) -> Result<ExitCode> {
    match &args.what {
        Some(BenchCommand::Index(a)) => index::run(a),
        Some(BenchCommand::Ingest(a)) => ingest::run(a),
        Some(BenchCommand::Proxy(a)) => proxy::run(a),
        None => run_load(&args.load),
    }
}

/// `--workload`: the load generator's names, listed in `--help`.
pub fn workload_parser() -> impl clap::builder::TypedValueParser<Value = load::WorkloadKind> {
    use clap::builder::TypedValueParser as _;
    clap::builder::PossibleValuesParser::new(load::WorkloadKind::ALL.map(load::WorkloadKind::name))
        .try_map(|s| s.parse::<load::WorkloadKind>())
}

/// The load options a command line asks for.
fn load_options(a: &LoadArgs) -> Result<(load::Endpoint, load::LoadOptions)> {
    if !(a.scale.is_finite() && a.scale > 0.0) {
        bail!("--scale must be a positive number");
    }
    if a.max_tokens == 0 {
        bail!("--max-tokens must be at least 1");
    }
    let max_duration = match a.duration_secs {
        None => None,
        Some(s) if s.is_finite() && s > 0.0 => Some(Duration::from_secs_f64(s)),
        Some(_) => bail!("--duration-secs must be a positive number"),
    };
    if a.requests == 0 && max_duration.is_none() {
        bail!("--requests 0 needs --duration-secs");
    }
    let arrival = match a.rate {
        Some(rate) if rate.is_finite() && rate > 0.0 => load::Arrival::Poisson { rate },
        Some(_) => bail!("--rate must be a positive number"),
        None if a.concurrency == 0 => bail!("--concurrency must be at least 1"),
        None => load::Arrival::Closed {
            concurrency: a.concurrency,
        },
    };
    let endpoint = if a.oracle.is_empty() {
        load::Endpoint::OpenAi {
            base_url: a.url.clone(),
        }
    } else {
        load::Endpoint::Oracle {
            workers: a.oracle.clone(),
        }
    };
    let label = a.label.clone().unwrap_or_else(|| {
        if a.oracle.is_empty() {
            "target".into()
        } else {
            load::ORACLE.into()
        }
    });
    let options = load::LoadOptions {
        workload: load::WorkloadSpec {
            kind: a.workload,
            seed: a.seed,
            scale: a.scale,
            groups: a.groups.max(1),
            mm_tokens_per_image: a.mm_tokens_per_image,
            max_tokens: a.max_tokens,
            text: a.text || a.tokenizer.is_some(),
            model: a.model.clone(),
            question_tokens: a.question_tokens,
            text_renderer: match &a.tokenizer {
                None => None,
                Some(path) => Some(
                    load::TextRenderer::from_tokenizer_file(path)
                        .with_context(|| format!("--tokenizer {}", path.display()))?,
                ),
            },
        },
        arrival,
        requests: a.requests,
        max_duration,
        progress: !a.no_progress && std::io::stderr().is_terminal(),
        label,
    };
    Ok((endpoint, options))
}

fn run_load(a: &LoadArgs) -> Result<ExitCode> {
    let (endpoint, options) = load_options(a)?;
    crate::cmd::init_logging(tracing_subscriber::filter::LevelFilter::WARN);
    let runtime = crate::cmd::runtime()?;
    let report = runtime.block_on(load::measure(&endpoint, &options))?;
    let all_failed = report
        .get(&options.label)
        .is_some_and(|p| p.requests > 0 && p.failed == p.requests);
    if a.json {
        println!("{}", serde_json::to_string(&report)?);
    } else {
        print!("{}", load::table(&report));
    }
    if let Some(path) = &a.plot {
        load::write_svg_plot(path, &report)?;
    }
    if all_failed {
        bail!("every request failed (is the target at {} up?)", a.url);
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
        bench: BenchArgs,
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
    }

    #[test]
    fn subcommands_still_work_and_conflict_with_load_flags() {
        let cli = Cli::try_parse_from(["bench", "index", "--quick"]).expect("parses");
        assert!(matches!(cli.bench.what, Some(BenchCommand::Index(_))));
        assert!(Cli::try_parse_from(["bench", "--requests", "5", "index"]).is_err());
        assert!(Cli::try_parse_from(["bench", "--rate", "5", "--concurrency", "2"]).is_err());
        let cli = Cli::try_parse_from(["bench", "--rate", "0"]).expect("parses");
        assert!(load_options(&cli.bench.load).is_err());
        let cli = Cli::try_parse_from(["bench", "--requests", "0"]).expect("parses");
        assert!(load_options(&cli.bench.load).is_err());
    }
}
