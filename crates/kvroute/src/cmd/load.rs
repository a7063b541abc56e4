//! `kvroute bench` without a subcommand: the load generator's flags, turned
//! into a `kvroute_loadgen` run (a workload, a preset or a trace, at any
//! OpenAI-compatible endpoint, or through the oracle).

use std::io::IsTerminal;
use std::path::PathBuf;
use std::process::ExitCode;
use std::time::Duration;

use anyhow::{bail, Context, Result};
use clap::Args;
use kvroute_loadgen as load;

use super::args::{parse_preset, workload_parser};

/// The load generator's flags (`kvroute bench` without a subcommand).
#[derive(Debug, Args)]
pub struct LoadArgs {
    /// Base URL of the OpenAI-compatible target (kvroute, an engine, another
    /// router). Several (comma-separated or repeated): router replicas behind
    /// a client-side balancer, round-robin, with a refused connection retried
    /// on the next URL.
    #[arg(
        long,
        value_name = "URL",
        value_delimiter = ',',
        default_value = "http://127.0.0.1:8000"
    )]
    url: Vec<String>,
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
    /// Ask for whole answers instead of streams (TTFT is then the latency).
    #[arg(long)]
    no_stream: bool,
    /// A named workload (`long`, `short`): its groups, prefix and suffix
    /// sizes, requests and concurrency; run its engines with `kvroute
    /// mocker --preset` of the same name.
    #[arg(long, value_parser = parse_preset, conflicts_with_all = ["workload", "groups", "scale", "question_tokens", "requests", "concurrency", "rate", "max_tokens"])]
    preset: Option<load::Preset>,
    /// Replay a Mooncake-format trace (JSONL: timestamp, input_length,
    /// output_length, hash_ids) at its own times, every request of it.
    #[arg(long, value_name = "FILE", conflicts_with_all = ["preset", "workload", "requests", "concurrency", "rate"])]
    trace: Option<PathBuf>,
}

/// The load options a command line asks for.
pub(super) fn load_options(a: &LoadArgs) -> Result<(load::Endpoint, load::LoadOptions)> {
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
    let concurrency = a.preset.map_or(a.concurrency, |p| p.concurrency());
    let arrival = match a.rate {
        Some(rate) if rate.is_finite() && rate > 0.0 => load::Arrival::Poisson { rate },
        Some(_) => bail!("--rate must be a positive number"),
        None if concurrency == 0 => bail!("--concurrency must be at least 1"),
        None => load::Arrival::Closed { concurrency },
    };
    if a.url.iter().any(|u| u.trim().is_empty()) {
        bail!("--url has an empty URL");
    }
    let endpoint = if !a.oracle.is_empty() {
        load::Endpoint::Oracle {
            workers: a.oracle.clone(),
        }
    } else if let [url] = a.url.as_slice() {
        load::Endpoint::OpenAi {
            base_url: url.clone(),
        }
    } else {
        load::Endpoint::Balanced {
            base_urls: a.url.clone(),
        }
    };
    let label = a.label.clone().unwrap_or_else(|| {
        if a.oracle.is_empty() {
            "target".into()
        } else {
            load::ORACLE.into()
        }
    });
    let trace = a
        .trace
        .as_deref()
        .map(load::mooncake::Trace::read)
        .transpose()?;
    let base = match (a.preset, &trace) {
        (Some(preset), _) => preset.workload(a.seed),
        (None, Some(trace)) => load::WorkloadSpec {
            kind: load::WorkloadKind::Trace,
            seed: a.seed,
            trace: Some(trace.clone()),
            ..load::WorkloadSpec::default()
        },
        (None, None) => load::WorkloadSpec {
            kind: a.workload,
            seed: a.seed,
            scale: a.scale,
            groups: a.groups.max(1),
            max_tokens: a.max_tokens,
            question_tokens: a.question_tokens,
            ..load::WorkloadSpec::default()
        },
    };
    let options = load::LoadOptions {
        workload: load::WorkloadSpec {
            mm_tokens_per_image: a.mm_tokens_per_image,
            text: a.text || a.tokenizer.is_some(),
            model: a.model.clone(),
            stream: !a.no_stream,
            text_renderer: match &a.tokenizer {
                None => None,
                Some(path) => Some(
                    load::TextRenderer::from_tokenizer_file(path)
                        .with_context(|| format!("--tokenizer {}", path.display()))?,
                ),
            },
            ..base
        },
        arrival: if trace.is_some() {
            load::Arrival::Trace
        } else {
            arrival
        },
        requests: match (a.preset, &trace) {
            (Some(p), _) => p.requests(),
            (None, Some(t)) => t.requests.len(),
            (None, None) => a.requests,
        },
        max_duration,
        progress: !a.no_progress && std::io::stderr().is_terminal(),
        label,
    };
    Ok((endpoint, options))
}

pub(super) fn run_load(a: &LoadArgs) -> Result<ExitCode> {
    let (endpoint, options) = load_options(a)?;
    super::init_logging(tracing_subscriber::filter::LevelFilter::WARN);
    let runtime = super::runtime()?;
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
        bail!(
            "every request failed (is the target at {} up?)",
            a.url.join(", ")
        );
    }
    Ok(ExitCode::SUCCESS)
}
