//! `kvroute serve`: ingest every worker's KV events into the index and serve
//! the HTTP API.

use std::path::PathBuf;
use std::process::ExitCode;
use std::time::Duration;

use anyhow::{bail, Context, Result};
use clap::Args;
use kvroute_core::index::IndexConfig;
use kvroute_core::multimodal::{ImageTokenRule, RoutingPrompt};
use kvroute_core::scheduler::CostWeights;
use kvroute_core::tokens::fold_token_id;
use kvroute_mocker::http::openai::{self, Endpoint};
use kvroute_mocker::tokenizer::Tokenizer;
use kvroute_server::ingest::IngestConfig;
use kvroute_server::proxy::{PromptTokenizer, RouterConfig};
use kvroute_server::routing::{BusyThresholds, Policy};
use kvroute_server::spec::{parse_config, WorkerSpec};
use kvroute_server::{serve, ServeConfig};
use std::sync::Arc;

/// Arguments of `kvroute serve`.
#[derive(Debug, Args)]
pub struct ServeArgs {
    /// Address to listen on.
    #[arg(long, default_value = "127.0.0.1")]
    host: String,
    /// Port to listen on.
    #[arg(long, default_value_t = 8000)]
    port: u16,
    /// Tokens per KV block, for workers that do not give their own.
    #[arg(long, default_value_t = 16, value_parser = clap::value_parser!(u32).range(1..))]
    block_size: u32,
    /// A worker: `name=w0,url=http://…,events=tcp://…:5557,replay=tcp://…:5657,dp=2,block_size=16,flavor=vllm`
    /// (repeatable; `replay`, `dp`, `block_size`, `topic`, `model`, `flavor` optional;
    /// `flavor=sglang` for SGLang engines, whose image pads differ from vLLM's).
    #[arg(long = "worker", value_name = "SPEC")]
    workers: Vec<String>,
    /// A TOML file with `[[worker]]` tables using the same keys as `--worker`.
    #[arg(long, value_name = "FILE")]
    config: Option<PathBuf>,
    /// An SGLang worker URL whose `/server_info` describes its event sockets (repeatable).
    #[arg(long, value_name = "URL")]
    discover_sglang: Vec<String>,
    /// Bearer token required by `/register` and `/unregister` (also `KVROUTE_ADMIN_TOKEN`).
    #[arg(long)]
    admin_token: Option<String>,
    /// Seconds a worker may stay unreachable before its blocks leave the index.
    #[arg(long, default_value_t = 30)]
    unreachable_grace_secs: u64,
    /// Residencies kept per (worker, rank) at most.
    #[arg(long, default_value_t = 4 << 20)]
    max_blocks_per_rank: u64,
    /// Routing policy: kv, approx (no events: the index learns from routing
    /// decisions), round-robin, random or least-loaded.
    #[arg(long, default_value = "kv")]
    policy: Policy,
    /// Multiplies the prefill term of the cost (Dynamo's default: 1; see
    /// docs/serving.md for why kvroute's is 4).
    #[arg(long, default_value_t = CostWeights::default().prefill_load_scale)]
    prefill_load_scale: f64,
    /// Credit per block cached on the device (Dynamo's default: 1).
    #[arg(long, default_value_t = CostWeights::default().overlap_credit)]
    overlap_credit: f64,
    /// Credit per block cached only in host memory.
    #[arg(long, default_value_t = 0.75)]
    host_cache_weight: f64,
    /// Credit per block cached only on disk or an external pool.
    #[arg(long, default_value_t = 0.25)]
    disk_cache_weight: f64,
    /// Cost per request already active on the worker.
    #[arg(long, default_value_t = 0.0)]
    active_request_weight: f64,
    /// Credit per leading block that a request active on the worker holds
    /// (a prefix in flight, not yet announced by the engine's events).
    #[arg(long, default_value_t = CostWeights::default().active_prefix_weight)]
    active_prefix_weight: f64,
    /// 0: lowest cost wins; > 0: softmax sampling over normalised costs.
    #[arg(long, default_value_t = 0.0)]
    temperature: f64,
    /// A rank with this many prompt tokens in prefill is skipped (busy).
    #[arg(long, value_name = "TOKENS")]
    busy_prefill_tokens: Option<u64>,
    /// A rank with this many active decode blocks is skipped (busy).
    #[arg(long, value_name = "BLOCKS")]
    busy_decode_blocks: Option<u64>,
    /// Workers tried per request at most (connection errors and 5xx before the first byte).
    #[arg(long, default_value_t = 3, value_parser = clap::value_parser!(u32).range(1..))]
    max_attempts: u32,
    /// Seconds allowed for a whole upstream request, streaming included.
    #[arg(long, default_value_t = 600)]
    request_timeout_secs: u64,
    /// Milliseconds allowed to connect to a worker.
    #[arg(long, default_value_t = 2000)]
    connect_timeout_ms: u64,
    /// Consecutive failures that take a worker out of rotation.
    #[arg(long, default_value_t = 3, value_parser = clap::value_parser!(u32).range(1..))]
    breaker_failures: u32,
    /// Seconds a failing worker stays out before one request probes it.
    #[arg(long, default_value_t = 10)]
    breaker_open_secs: u64,
    /// Seconds after which a request still counted as active is dropped from the load.
    #[arg(long, default_value_t = 600)]
    active_expiry_secs: u64,
    /// Name the chosen rank of every multi-rank worker in the body as
    /// `data_parallel_rank`. Without it, `flavor=sglang` workers get the body
    /// field and vLLM workers the `X-data-parallel-rank` header.
    #[arg(long)]
    dp_rank_in_body: bool,
    /// Requests that may wait (rather than get a 503) while every rank is
    /// over its busy thresholds; 0: no queue.
    #[arg(long, default_value_t = 0)]
    queue_capacity: usize,
    /// Longest wait in that queue, in milliseconds, before the 503.
    #[arg(long, default_value_t = 30_000)]
    queue_timeout_ms: u64,
    /// A Hugging Face `tokenizer.json` for text prompts and chat messages
    /// (ChatML template, as Qwen models and `kvroute mocker` use), or `builtin`
    /// for the mocker's built-in tokenizer. Without it, text requests are
    /// routed on load alone.
    #[arg(long, value_name = "FILE|builtin")]
    tokenizer: Option<PathBuf>,
    /// Prompt positions each image takes (the model's image token count; the
    /// same setting as `kvroute mocker --mm-tokens-per-image`).
    #[arg(long, default_value_t = 64, value_parser = clap::value_parser!(u32).range(1..))]
    mm_tokens_per_image: u32,
    /// Largest request body accepted, in MiB (larger: 413).
    #[arg(long, default_value_t = 32)]
    max_body_mib: usize,
    /// Log level: error, warn, info, debug or trace.
    #[arg(long, default_value = "info")]
    log: tracing::Level,
}

/// Builds the runtime and serves until Ctrl-C or SIGTERM.
pub fn run(args: &ServeArgs) -> Result<ExitCode> {
    tracing_subscriber::fmt()
        .with_max_level(args.log)
        .with_writer(std::io::stderr)
        .init();
    if crate::heap_meter().is_some() {
        tracing::warn!(
            "this kvroute was built with --features alloc-meter: every allocation \
             updates a shared counter; build without it to serve"
        );
    }
    let mut workers: Vec<WorkerSpec> = Vec::new();
    for text in &args.workers {
        let spec =
            WorkerSpec::parse(text, args.block_size).with_context(|| format!("--worker {text}"))?;
        workers.push(spec);
    }
    if let Some(path) = &args.config {
        let text =
            std::fs::read_to_string(path).with_context(|| format!("reading {}", path.display()))?;
        workers.extend(
            parse_config(&text, args.block_size)
                .with_context(|| format!("--config {}", path.display()))?,
        );
    }
    let admin_token = args
        .admin_token
        .clone()
        .or_else(|| std::env::var("KVROUTE_ADMIN_TOKEN").ok())
        .filter(|t| !t.is_empty());
    let runtime = crate::cmd::runtime()?;
    runtime.block_on(async {
        let client = reqwest::Client::builder()
            .timeout(Duration::from_secs(10))
            .build()
            .context("http client")?;
        for url in &args.discover_sglang {
            let spec = kvroute_server::discover::discover_sglang(&client, url).await?;
            workers.push(spec);
        }
        let mut names = std::collections::BTreeSet::new();
        for w in &workers {
            if !names.insert(w.name.clone()) {
                bail!("two workers are named `{}`", w.name);
            }
        }
        let addr = format!("{}:{}", args.host, args.port);
        let listener = tokio::net::TcpListener::bind(&addr)
            .await
            .with_context(|| format!("binding {addr}"))?;
        // The bound address, so that `--port 0` tells its caller the port.
        let addr = listener.local_addr().context("the listening address")?;
        eprintln!(
            "kvroute serve: listening on http://{addr} with {} worker(s)",
            workers.len()
        );
        let config = ServeConfig {
            block_size: args.block_size,
            workers,
            admin_token,
            unreachable_grace: Duration::from_secs(args.unreachable_grace_secs),
            index: IndexConfig {
                default_capacity: Some(args.max_blocks_per_rank),
                ..IndexConfig::default()
            },
            ingest: IngestConfig::default(),
            router: router_config(args)?,
            max_body_bytes: args.max_body_mib.saturating_mul(1 << 20),
        };
        serve(config, listener, super::shutdown_signal()).await?;
        Ok(())
    })?;
    Ok(ExitCode::SUCCESS)
}

/// Tokenizes requests exactly as `kvroute mocker` renders them: its
/// completion and chat parsing, ChatML template and tokenizer, and its image
/// layout (identity from `mm_hashes` or the image URL, `rule` positions each).
#[derive(Debug)]
struct ChatMlTokenizer {
    tokenizer: Tokenizer,
    rule: ImageTokenRule,
}

impl ChatMlTokenizer {
    fn layout(&self, body: &[u8], chat: bool) -> Option<openai::NeutralPrompt> {
        let endpoint = if chat {
            Endpoint::Chat
        } else {
            Endpoint::Completions
        };
        let parsed = openai::parse(endpoint, body).ok()?;
        openai::layout(&parsed, &self.tokenizer, self.rule).ok()
    }
}

impl PromptTokenizer for ChatMlTokenizer {
    fn tokenize(&self, body: &[u8], chat: bool) -> Option<Vec<u64>> {
        self.layout(body, chat).map(|p| p.tokens)
    }

    fn prompt(&self, body: &[u8], chat: bool) -> Option<RoutingPrompt> {
        self.layout(body, chat).map(|p| RoutingPrompt {
            tokens: p.tokens.into_iter().map(fold_token_id).collect(),
            images: p.images,
        })
    }
}

/// The router's view of prompts rendered as `kvroute mocker` renders them,
/// with `mm_tokens_per_image` positions per image.
pub fn prompt_tokenizer(
    tokenizer: Tokenizer,
    mm_tokens_per_image: usize,
) -> Arc<dyn PromptTokenizer> {
    Arc::new(ChatMlTokenizer {
        tokenizer,
        rule: ImageTokenRule::fixed(mm_tokens_per_image),
    })
}

fn router_config(args: &ServeArgs) -> Result<RouterConfig> {
    let load = |tokenizer| prompt_tokenizer(tokenizer, args.mm_tokens_per_image as usize);
    let tokenizer: Option<Arc<dyn PromptTokenizer>> = match &args.tokenizer {
        None => None,
        Some(p) if p.as_os_str() == "builtin" => Some(load(Tokenizer::builtin())),
        Some(p) => Some(load(
            Tokenizer::from_file(p).with_context(|| format!("--tokenizer {}", p.display()))?,
        )),
    };
    Ok(RouterConfig {
        policy: args.policy,
        weights: CostWeights {
            prefill_load_scale: args.prefill_load_scale,
            overlap_credit: args.overlap_credit,
            host_weight: args.host_cache_weight,
            disk_weight: args.disk_cache_weight,
            active_request_weight: args.active_request_weight,
            active_prefix_weight: args.active_prefix_weight,
        },
        temperature: args.temperature,
        busy: BusyThresholds {
            prefill_tokens: args.busy_prefill_tokens,
            decode_blocks: args.busy_decode_blocks,
        },
        max_attempts: args.max_attempts as usize,
        request_timeout: Duration::from_secs(args.request_timeout_secs),
        connect_timeout: Duration::from_millis(args.connect_timeout_ms),
        breaker_failures: args.breaker_failures,
        breaker_open: Duration::from_secs(args.breaker_open_secs),
        active_expiry: Duration::from_secs(args.active_expiry_secs),
        dp_rank_in_body: args.dp_rank_in_body,
        queue_capacity: args.queue_capacity,
        queue_timeout: Duration::from_millis(args.queue_timeout_ms),
        tokenizer,
    })
}
