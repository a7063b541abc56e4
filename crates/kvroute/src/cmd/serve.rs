//! `kvroute serve`: ingest every worker's KV events into the index and serve
//! the HTTP API.

use std::path::PathBuf;
use std::process::ExitCode;
use std::time::Duration;

use anyhow::{bail, Context, Result};
use clap::Args;
use kvroute_core::index::IndexConfig;
use kvroute_core::multimodal::ImageTokenRule;
use kvroute_core::scheduler::policy::DealBy;
use kvroute_core::scheduler::{BusyThresholds, Policy};
use kvroute_core::scheduler::{CostWeights, LocalPrefillRule, SpeedConfig};
use kvroute_prompt::{Renderer, Tokenizer};
use kvroute_server::admin::Access;
use kvroute_server::ingest::address::AllowedHosts;
use kvroute_server::ingest::rank::Timing;
use kvroute_server::ingest::registry::{default_max_ranks, IngestConfig, RankLimitSource};
use kvroute_server::ingest::spec::{parse_config, WorkerSpec};
use kvroute_server::listen::{default_max_connections, raise_fd_limit};
use kvroute_server::proxy::ProxyConfig;
use kvroute_server::proxy::SessionConfig;
use kvroute_server::replica::pins::PinsSecret;
use kvroute_server::replica::ReplicaConfig;
use kvroute_server::{serve_with_epp, ServeConfig, StateConfig};
use std::sync::Arc;

/// Arguments of `kvroute serve`.
#[derive(Debug, Args)]
pub struct ServeArgs {
    /// Address to listen on.
    #[arg(long, default_value = "127.0.0.1", env = "KVROUTE_HOST")]
    host: String,
    /// Port to listen on.
    #[arg(long, default_value_t = 8000, env = "KVROUTE_PORT")]
    port: u16,
    /// Tokens per KV block, for workers that do not give their own. Without
    /// it, such a worker's block size is learned from its first stored event
    /// (until then it is routed on load alone).
    #[arg(long, value_parser = clap::value_parser!(u32).range(1..), env = "KVROUTE_BLOCK_SIZE")]
    block_size: Option<u32>,
    /// A worker: `name=w0,url=http://…,events=tcp://…:5557,replay=tcp://…:5657,dp=2,block_size=16,flavor=vllm`
    /// (repeatable; `replay`, `dp`, `block_size`, `topic`, `model`, `flavor`, `speed`,
    /// `role`, `bootstrap_port` optional; `flavor=sglang` for SGLang engines, whose
    /// image pads differ from vLLM's; `role=prefill|decode|both` for disaggregated
    /// fleets, with `bootstrap_port` on SGLang prefill workers).
    /// In the environment, specs are separated by `;`.
    #[arg(
        long = "worker",
        value_name = "SPEC",
        env = "KVROUTE_WORKERS",
        value_delimiter = ';'
    )]
    workers: Vec<String>,
    /// A TOML file with `[[worker]]` tables using the same keys as `--worker`.
    #[arg(long, value_name = "FILE", env = "KVROUTE_CONFIG")]
    config: Option<PathBuf>,
    /// An SGLang worker URL whose `/server_info` describes its event sockets
    /// (repeatable; in the environment, URLs separated by `;`).
    #[arg(
        long,
        value_name = "URL",
        env = "KVROUTE_DISCOVER_SGLANG",
        value_delimiter = ';'
    )]
    discover_sglang: Vec<String>,
    /// Bearer token of the admin API (`/register`, `/unregister`), which is
    /// closed without one; `/workers`, `/query` and `/query_by_hash` need it too.
    #[arg(long, env = "KVROUTE_ADMIN_TOKEN", hide_env_values = true)]
    admin_token: Option<String>,
    /// Let `/workers`, `/query` and `/query_by_hash` answer without the admin token.
    #[arg(long, env = "KVROUTE_PUBLIC_INTROSPECTION")]
    public_introspection: bool,
    /// Hosts, addresses and CIDR networks (comma-separated) that workers'
    /// URLs and sockets may name; default: any.
    #[arg(long, value_name = "LIST", env = "KVROUTE_ALLOW_WORKER_HOSTS")]
    allow_worker_hosts: Option<AllowedHosts>,
    /// Seconds a worker may stay unreachable before its blocks leave the index.
    #[arg(long, default_value_t = ServeConfig::default().unreachable_grace.as_secs(), env = "KVROUTE_UNREACHABLE_GRACE_SECS")]
    unreachable_grace_secs: u64,
    /// Residencies kept per (worker, rank) at most.
    #[arg(long, default_value_t = IndexConfig::default().default_capacity.unwrap_or(u64::MAX), env = "KVROUTE_MAX_BLOCKS_PER_RANK")]
    max_blocks_per_rank: u64,
    /// Shards of ranks the index is split into, so events of ranks in
    /// different shards are applied in parallel (default: one per core, at
    /// most 8). Each lookup reads every shard.
    #[arg(long, env = "KVROUTE_INDEX_SHARDS", value_parser = clap::value_parser!(u64).range(1..=64))]
    index_shards: Option<u64>,
    /// Routing policy: kv, approx (no events: the index learns from routing
    /// decisions), round-robin, random, least-loaded, or a peer's as a
    /// baseline: sglang-cache-aware or dynamo (docs/serving.md).
    #[arg(long, default_value_t = ProxyConfig::default().policy, env = "KVROUTE_POLICY")]
    policy: Policy,
    /// Multiplies the prefill term of the cost (Dynamo's default: 1;
    /// docs/serving.md says why kvroute's default is higher).
    #[arg(long, default_value_t = CostWeights::default().prefill_load_scale, env = "KVROUTE_PREFILL_LOAD_SCALE")]
    prefill_load_scale: f64,
    /// Credit per block cached on the device (Dynamo's default: 1).
    #[arg(long, default_value_t = CostWeights::default().overlap_credit, env = "KVROUTE_OVERLAP_CREDIT")]
    overlap_credit: f64,
    /// Credit per block cached only in host memory.
    #[arg(long, default_value_t = CostWeights::default().host_weight, env = "KVROUTE_HOST_CACHE_WEIGHT")]
    host_cache_weight: f64,
    /// Credit per block cached only on disk or an external pool.
    #[arg(long, default_value_t = CostWeights::default().disk_weight, env = "KVROUTE_DISK_CACHE_WEIGHT")]
    disk_cache_weight: f64,
    /// Cost per request already active on the worker.
    #[arg(long, default_value_t = CostWeights::default().active_request_weight, env = "KVROUTE_ACTIVE_REQUEST_WEIGHT")]
    active_request_weight: f64,
    /// Credit per leading block that a request active on the worker holds
    /// (a prefix in flight, not yet announced by the engine's events).
    #[arg(long, default_value_t = CostWeights::default().active_prefix_weight, env = "KVROUTE_ACTIVE_PREFIX_WEIGHT")]
    active_prefix_weight: f64,
    /// Cost per block that the worker's decode steps read for the requests
    /// active there (counted once per request: a shared prefix read by n
    /// requests counts n times).
    #[arg(long, default_value_t = CostWeights::default().request_kv_weight, env = "KVROUTE_REQUEST_KV_WEIGHT")]
    request_kv_weight: f64,
    /// Cost per block of the request itself: the same on ranks of one speed,
    /// so it only weighs a faster rank against a slower one that caches more
    /// of the request (0: the cache decides alone).
    #[arg(long, default_value_t = CostWeights::default().request_size_weight, env = "KVROUTE_REQUEST_SIZE_WEIGHT")]
    request_size_weight: f64,
    /// 0: lowest cost wins; > 0: softmax sampling over normalised costs.
    #[arg(long, default_value_t = ProxyConfig::default().temperature, env = "KVROUTE_TEMPERATURE")]
    temperature: f64,
    /// Under `kv`, where a request whose prefix no rank holds goes: the
    /// rank dealt the least `work` so far (prompt tokens it was sent
    /// uncached, over its speed: SGLang's smallest tree), or the fewest
    /// `prefixes` or `requests`; `off`: the cheapest rank.
    #[arg(long, default_value = "work", value_parser = parse_deal, env = "KVROUTE_DEAL_NEW_PREFIXES")]
    deal_new_prefixes: Deal,
    /// Under `kv`, a request stays on the rank holding most of its prefix
    /// unless that rank costs over this many times the cheapest (below 1: off).
    #[arg(long, default_value_t = ProxyConfig::default().holder_stickiness, env = "KVROUTE_HOLDER_STICKINESS")]
    holder_stickiness: f64,
    /// Seeds the placements' random draws (ties between equal costs,
    /// `--temperature` sampling, `--policy random`), so that the same
    /// requests on the same fleet state are placed alike run after run, as
    /// `kvroute bench sim --seeds` places them. Default: a seed from the clock.
    #[arg(long, value_name = "N", env = "KVROUTE_ROUTING_SEED")]
    routing_seed: Option<u64>,
    /// A rank with this many prompt tokens in prefill is skipped (busy).
    #[arg(long, value_name = "TOKENS", env = "KVROUTE_BUSY_PREFILL_TOKENS")]
    busy_prefill_tokens: Option<u64>,
    /// A rank with this many active decode blocks is skipped (busy).
    #[arg(long, value_name = "BLOCKS", env = "KVROUTE_BUSY_DECODE_BLOCKS")]
    busy_decode_blocks: Option<u64>,
    /// A rank with this many requests in flight from this router (and its
    /// peers) is skipped (busy).
    #[arg(long, value_name = "REQUESTS", env = "KVROUTE_BUSY_REQUESTS")]
    busy_requests: Option<u64>,
    /// Workers tried per request at most: a request moves on only when it
    /// never reached a worker or the worker refused it with 503 or 429.
    #[arg(long, default_value_t = u32::try_from(ProxyConfig::default().max_attempts).unwrap_or(u32::MAX), value_parser = clap::value_parser!(u32).range(1..), env = "KVROUTE_MAX_ATTEMPTS")]
    max_attempts: u32,
    /// Times one request may be moved to another rank after its worker
    /// failed it mid-way (a stream continued from what it had generated, a
    /// whole answer asked again elsewhere); 0: never. A request opts out with
    /// the header `x-kvroute-migrate: 0`.
    #[arg(long, default_value_t = ProxyConfig::default().migration_limit, env = "KVROUTE_MIGRATION_LIMIT")]
    migration_limit: u32,
    /// Seconds allowed for a whole upstream request, streaming included.
    #[arg(long, default_value_t = ProxyConfig::default().request_timeout.as_secs(), env = "KVROUTE_REQUEST_TIMEOUT_SECS")]
    request_timeout_secs: u64,
    /// Milliseconds allowed to connect to a worker.
    #[arg(long, default_value_t = millis(ProxyConfig::default().connect_timeout), env = "KVROUTE_CONNECT_TIMEOUT_MS")]
    connect_timeout_ms: u64,
    /// Consecutive failures that take a worker out of rotation.
    #[arg(long, default_value_t = ProxyConfig::default().breaker_failures, value_parser = clap::value_parser!(u32).range(1..), env = "KVROUTE_BREAKER_FAILURES")]
    breaker_failures: u32,
    /// Seconds a failing worker stays out before one request probes it.
    #[arg(long, default_value_t = ProxyConfig::default().breaker_open.as_secs(), env = "KVROUTE_BREAKER_OPEN_SECS")]
    breaker_open_secs: u64,
    /// Seconds after which a request still counted as active is dropped from the load.
    #[arg(long, default_value_t = ProxyConfig::default().active_expiry.as_secs(), env = "KVROUTE_ACTIVE_EXPIRY_SECS")]
    active_expiry_secs: u64,
    /// Name the chosen rank of every multi-rank worker in the body as
    /// `data_parallel_rank`. Without it, `flavor=sglang` workers get the body
    /// field and vLLM workers the `X-data-parallel-rank` header.
    #[arg(long, env = "KVROUTE_DP_RANK_IN_BODY")]
    dp_rank_in_body: bool,
    /// Requests that may wait (rather than get a 503) while every rank is
    /// over its busy thresholds; 0: no queue.
    #[arg(long, default_value_t = ProxyConfig::default().queue_capacity, env = "KVROUTE_QUEUE_CAPACITY")]
    queue_capacity: usize,
    /// Longest wait in that queue, in milliseconds, before the 503.
    #[arg(long, default_value_t = millis(ProxyConfig::default().queue_timeout), env = "KVROUTE_QUEUE_TIMEOUT_MS")]
    queue_timeout_ms: u64,
    /// A Hugging Face `tokenizer.json` for text prompts and chat messages, or
    /// `builtin` for the mocker's built-in tokenizer. Chats are rendered with
    /// the model's own chat template when a `tokenizer_config.json` with one
    /// sits beside the file, else in the ChatML layout. Without it, text
    /// requests are routed on load alone.
    #[arg(long, value_name = "FILE|builtin", env = "KVROUTE_TOKENIZER")]
    tokenizer: Option<PathBuf>,
    /// A model's own tokenizer (and chat template beside it), for requests
    /// naming that model; repeat for each model (`--model a=/m/a/tokenizer.json
    /// --model b=builtin`). Others use `--tokenizer`
    #[arg(long = "model", value_name = "NAME=FILE|builtin", value_parser = parse_model_tokenizer, value_delimiter = ',', env = "KVROUTE_MODELS")]
    models: Vec<(String, PathBuf)>,
    /// Prompt positions each image takes (the model's image token count; the
    /// same setting as `kvroute mocker --mm-tokens-per-image`).
    #[arg(long, default_value_t = u32::try_from(ImageTokenRule::DEFAULT_TOKENS_PER_IMAGE).unwrap_or(u32::MAX), value_parser = clap::value_parser!(u32).range(1..), env = "KVROUTE_MM_TOKENS_PER_IMAGE")]
    mm_tokens_per_image: u32,
    /// Context length (prompt + output tokens) of workers that do not report
    /// `max_model_len` in their `/v1/models`; requests that cannot fit are
    /// refused with 400 before they are sent.
    #[arg(long, value_name = "TOKENS", env = "KVROUTE_MAX_MODEL_LEN")]
    max_model_len: Option<u64>,
    /// Learn each rank's speed from its streamed responses (time per token
    /// against the load it decoded under), in place of the declared
    /// `speed=` once learned. Speeds within 20 % of the fleet's median
    /// count as equal.
    #[arg(long, env = "KVROUTE_LEARN_SPEEDS")]
    learn_speeds: bool,
    /// Client connections served at once; more are closed as they arrive.
    /// Default: a tenth of the open-file limit (raised to its hard limit at
    /// start) after a reserve; the rest is for the engines' streams.
    #[arg(long, env = "KVROUTE_MAX_CONNECTIONS")]
    max_connections: Option<usize>,
    /// Most (worker, DP rank) event streams, in slots (a rank without a
    /// replay endpoint takes two); a registration beyond it is refused (409),
    /// and a configured worker beyond it stops serve.
    ///
    /// A rank takes one slot; a rank without a replay endpoint takes two (its
    /// SUB needs a socket monitor of its own, as many descriptors again), so
    /// 2 048 ranks without replay endpoints fill 4 096 slots, as 4 096 ranks
    /// with them do.
    ///
    /// Default: what the open-file limit (raised to its hard limit at start)
    /// leaves after a reserve of 256 and two descriptors per connection of
    /// --max-connections, at four descriptors per slot; at a limit of 20 000,
    /// (20 000 − 256 − 2 × 1 974) / 4 = 3 949 slots. For more, raise the
    /// open-file limit (`ulimit -n`) or set this flag.
    #[arg(long, value_parser = clap::value_parser!(u64).range(1..), env = "KVROUTE_MAX_RANKS")]
    max_ranks: Option<u64>,
    /// Ingest threads, each serving many ranks; default: the number of cores.
    #[arg(long, value_parser = clap::value_parser!(u64).range(1..=64), env = "KVROUTE_INGEST_THREADS")]
    ingest_threads: Option<u64>,
    /// Directory where the router keeps its state (the index and where each
    /// rank's stream stood), so that a restart resumes from it instead of
    /// what the engines' replay rings still hold.
    #[arg(long, env = "KVROUTE_STATE_DIR")]
    state_dir: Option<std::path::PathBuf>,
    /// A NATS server (with JetStream) shared by router replicas, e.g.
    /// `nats://127.0.0.1:4222`: replicas share their in-flight requests and
    /// an index snapshot there. Without it the router stands alone.
    #[arg(long, value_name = "URL", env = "KVROUTE_NATS")]
    nats: Option<String>,
    /// This replica's name among its peers (default: host name and port).
    #[arg(long, env = "KVROUTE_REPLICA_ID", requires = "nats")]
    replica_id: Option<String>,
    /// First token of the NATS subjects and bucket names, so several router
    /// fleets can share one NATS server.
    #[arg(long, default_value_t = ReplicaConfig::new("", "").prefix, env = "KVROUTE_NATS_PREFIX", value_parser = parse_nats_prefix)]
    nats_prefix: String,
    /// Secret keying the pins' hashes, the same at every replica (see
    /// docs/replicas.md); `--nats-pins-key-file` keeps it off the command line.
    #[arg(
        long,
        env = "KVROUTE_NATS_PINS_KEY",
        hide_env_values = true,
        requires = "nats"
    )]
    nats_pins_key: Option<String>,
    /// A file holding `--nats-pins-key` (16 to 4096 bytes).
    #[arg(
        long,
        value_name = "FILE",
        env = "KVROUTE_NATS_PINS_KEY_FILE",
        requires = "nats"
    )]
    nats_pins_key_file: Option<PathBuf>,
    /// Seconds between two saves of the state (with `--state-dir`, also at
    /// shutdown; with `--nats`, to the object store).
    #[arg(long, default_value_t = StateConfig::DEFAULT_EVERY.as_secs(), value_parser = clap::value_parser!(u64).range(1..=86_400), env = "KVROUTE_SNAPSHOT_SECS")]
    snapshot_secs: u64,
    /// Seconds between continuity checks of a quiet stream (a replay request
    /// for the last batch applied, which proves the engine did not restart).
    #[arg(long, default_value_t = Timing::default().verify_ms / 1_000, value_parser = clap::value_parser!(u64).range(1..=3600), env = "KVROUTE_VERIFY_SECS")]
    verify_secs: u64,
    /// Disaggregated fleets (workers with `role=prefill` and `role=decode`):
    /// a decode rank prefills a request itself, skipping the transfer, when
    /// fewer than this many of its prompt tokens are uncached there (and
    /// under --local-prefill-max-fraction of the prompt); 0: never.
    #[arg(long, default_value_t = LocalPrefillRule::default().max_uncached_tokens, env = "KVROUTE_LOCAL_PREFILL_MAX_TOKENS")]
    local_prefill_max_tokens: u64,
    /// The uncached share of the prompt under which a decode rank may
    /// prefill it itself.
    #[arg(long, default_value_t = LocalPrefillRule::default().max_uncached_fraction, env = "KVROUTE_LOCAL_PREFILL_MAX_FRACTION")]
    local_prefill_max_fraction: f64,
    /// Disaggregated fleets: seconds allowed for a prefill leg's answer.
    #[arg(long, default_value_t = ProxyConfig::default().prefill_timeout.as_secs(), value_parser = clap::value_parser!(u64).range(1..), env = "KVROUTE_PREFILL_TIMEOUT_SECS")]
    prefill_timeout_secs: u64,
    /// Read each worker's `/metrics` this often (ms) for the load its engine
    /// reports (requests running and waiting, KV-cache usage), counted where
    /// it exceeds what the router sent there: for fleets that other routers
    /// or clients also reach. Off by default (docs/serving.md)
    #[arg(long, value_name = "MS", value_parser = clap::value_parser!(u64).range(50..=600_000), env = "KVROUTE_ENGINE_METRICS_MS")]
    engine_metrics_ms: Option<u64>,
    /// The header naming a request's session: its turns go back to the rank
    /// the last one went to while the cost agrees (docs/serving.md)
    #[arg(long, default_value_t = SessionConfig::default().header, env = "KVROUTE_SESSION_HEADER", value_parser = super::args::parse_header_name)]
    session_header: String,
    /// Sessions remembered at most (the oldest forgotten first).
    #[arg(long, default_value_t = SessionConfig::default().capacity, value_parser = clap::value_parser!(usize), env = "KVROUTE_SESSION_CAPACITY")]
    session_capacity: usize,
    /// Seconds a session is remembered after its last turn.
    #[arg(long, default_value_t = SessionConfig::default().ttl.as_secs(), value_parser = clap::value_parser!(u64).range(1..=604_800), env = "KVROUTE_SESSION_TTL_SECS")]
    session_ttl_secs: u64,
    /// Log level: error, warn, info, debug or trace.
    #[arg(long, default_value = "info", env = "KVROUTE_LOG")]
    log: tracing::Level,
    #[command(flatten)]
    endpoints: super::endpoints::EndpointsArgs,
    #[command(flatten)]
    epp: super::epp::EppArgs,
    #[command(flatten)]
    tenancy: super::tenancy::TenancyArgs,
    #[command(flatten)]
    bounds: super::bounds::BoundsArgs,
    #[command(flatten)]
    tokenizers: super::tokenizers::TokenizerArgs,
    #[command(flatten)]
    otlp: super::otlp::OtlpArgs,
    #[command(flatten)]
    fetch: super::fetch::FetchArgs,
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
    let fd_limit = raise_fd_limit();
    let runtime = crate::cmd::runtime()?;
    runtime.block_on(async {
        let client = reqwest::Client::builder()
            .timeout(Duration::from_secs(10))
            .build()
            .context("http client")?;
        for url in &args.discover_sglang {
            let spec = kvroute_server::ingest::discover::discover_sglang(&client, url).await?;
            workers.push(spec);
        }
        let mut names = std::collections::BTreeSet::new();
        for w in &workers {
            if !names.insert(w.name.clone()) {
                bail!("two workers are named `{}`", w.name);
            }
        }
        args.epp.check_built()?;
        let addr = format!("{}:{}", args.host, args.port);
        // Before the address is printed: a SIGTERM from then on stops serve cleanly.
        let stop = super::shutdown_signal();
        let listener = tokio::net::TcpListener::bind(&addr)
            .await
            .with_context(|| format!("binding {addr}"))?;
        // The bound address, so that `--port 0` tells its caller the port.
        let addr = listener.local_addr().context("the listening address")?;
        eprintln!(
            "kvroute serve: listening on http://{addr} with {} worker(s)",
            workers.len()
        );
        let picker = args.epp.bind(&args.host).await?;
        let config = serve_config(args, workers, fd_limit, addr.port())?;
        let traces = args.otlp.install()?;
        let served = serve_with_epp(config, listener, picker, stop).await;
        if let Some(traces) = traces {
            // The last spans, flushed before the runtime stops.
            let _ = tokio::task::spawn_blocking(move || traces.shutdown()).await;
        }
        served?;
        Ok(())
    })?;
    Ok(ExitCode::SUCCESS)
}

/// The server's configuration from the flags, the workers already read, the
/// open-file limit and the bound port: every default comes from the config
/// types themselves, so `--help` and an embedded router agree.
fn serve_config(
    args: &ServeArgs,
    workers: Vec<WorkerSpec>,
    fd_limit: u64,
    port: u16,
) -> Result<ServeConfig> {
    let admin_token = args.admin_token.clone().filter(|t| !t.is_empty());
    let max_connections = args
        .max_connections
        .unwrap_or_else(|| default_max_connections(fd_limit));
    Ok(ServeConfig {
        block_size: args.block_size,
        workers,
        discovery: args.endpoints.discovery()?,
        access: Access {
            admin_token,
            public_introspection: args.public_introspection,
        },
        allowed_worker_hosts: args.allow_worker_hosts.clone().unwrap_or_default(),
        unreachable_grace: Duration::from_secs(args.unreachable_grace_secs),
        index: IndexConfig {
            default_capacity: Some(args.max_blocks_per_rank),
            ..IndexConfig::default()
        },
        index_shards: args
            .index_shards
            .map_or_else(kvroute_server::default_index_shards, |n| n as usize),
        ingest: ingest_config(args, max_connections, fd_limit),
        state: args.state_dir.clone().map(|dir| StateConfig {
            dir,
            every: Duration::from_secs(args.snapshot_secs),
        }),
        replicas: replica_config(args, port)?,
        proxy: router_config(args)?,
        max_body_bytes: args.bounds.max_body_bytes(),
        query: args.bounds.query(),
        http: args.bounds.http(max_connections),
        epp: args.epp.config(&args.host),
        // The operator's own flags: say what the admin API accepts.
        announce_access: true,
    })
}

/// A duration in whole milliseconds, for a flag's default.
fn millis(d: Duration) -> u64 {
    u64::try_from(d.as_millis()).unwrap_or(u64::MAX)
}

/// The router's prompt renderer: the same rendering as `kvroute mocker`'s
/// (chat template or ChatML layout, tokenizer, `mm_tokens_per_image`
/// positions per image), so router and engine agree token for token.
pub fn renderer(tokenizer: Tokenizer, mm_tokens_per_image: usize) -> Arc<Renderer> {
    Arc::new(Renderer::new(
        tokenizer,
        ImageTokenRule::fixed(mm_tokens_per_image),
    ))
}

/// `--deal-new-prefixes`: a tally, or `off`.
#[derive(Debug, Clone, Copy)]
struct Deal(Option<DealBy>);

fn parse_deal(value: &str) -> Result<Deal, String> {
    match value {
        "off" => Ok(Deal(None)),
        _ => value.parse().map(|by| Deal(Some(by))),
    }
}

/// `--model`'s value: `NAME=FILE` or `NAME=builtin`.
fn parse_model_tokenizer(value: &str) -> Result<(String, PathBuf), String> {
    match value.split_once('=') {
        Some((name, file)) if !name.is_empty() && !file.is_empty() => {
            Ok((name.to_owned(), PathBuf::from(file)))
        }
        _ => Err(format!("`{value}`: expected NAME=FILE or NAME=builtin")),
    }
}

fn router_config(args: &ServeArgs) -> Result<ProxyConfig> {
    let load = |path: &PathBuf, flag: &str| -> Result<Arc<Renderer>> {
        let tokenizer = if path.as_os_str() == "builtin" {
            Tokenizer::builtin()
        } else {
            Tokenizer::from_file(path).with_context(|| format!("{flag} {}", path.display()))?
        };
        Ok(renderer(tokenizer, args.mm_tokens_per_image as usize))
    };
    let renderer = match &args.tokenizer {
        None => None,
        Some(p) => Some(load(p, "--tokenizer")?),
    };
    let mut model_renderers = std::collections::HashMap::new();
    for (name, path) in &args.models {
        model_renderers.insert(name.clone(), load(path, &format!("--model {name}="))?);
    }
    Ok(ProxyConfig {
        policy: args.policy,
        weights: CostWeights {
            prefill_load_scale: args.prefill_load_scale,
            overlap_credit: args.overlap_credit,
            host_weight: args.host_cache_weight,
            disk_weight: args.disk_cache_weight,
            active_request_weight: args.active_request_weight,
            active_prefix_weight: args.active_prefix_weight,
            request_kv_weight: args.request_kv_weight,
            request_size_weight: args.request_size_weight,
        },
        temperature: args.temperature,
        deal_new_prefixes: args.deal_new_prefixes.0,
        holder_stickiness: args.holder_stickiness,
        routing_seed: args.routing_seed,
        busy: BusyThresholds {
            prefill_tokens: args.busy_prefill_tokens,
            decode_blocks: args.busy_decode_blocks,
            requests: args.busy_requests,
        },
        max_attempts: args.max_attempts as usize,
        request_timeout: Duration::from_secs(args.request_timeout_secs),
        connect_timeout: Duration::from_millis(args.connect_timeout_ms),
        migration_limit: args.migration_limit,
        breaker_failures: args.breaker_failures,
        breaker_open: Duration::from_secs(args.breaker_open_secs),
        active_expiry: Duration::from_secs(args.active_expiry_secs),
        dp_rank_in_body: args.dp_rank_in_body,
        queue_capacity: args.queue_capacity,
        queue_timeout: Duration::from_millis(args.queue_timeout_ms),
        max_model_len: args.max_model_len,
        learn_speeds: args.learn_speeds.then(SpeedConfig::default),
        local_prefill: LocalPrefillRule {
            max_uncached_tokens: args.local_prefill_max_tokens,
            max_uncached_fraction: args.local_prefill_max_fraction,
        },
        prefill_timeout: Duration::from_secs(args.prefill_timeout_secs),
        bodies: args.bounds.bodies(),
        tokenizer_discovery: args
            .tokenizers
            .discovery(ImageTokenRule::fixed(args.mm_tokens_per_image as usize)),
        max_answer_bytes: args.bounds.max_answer_bytes(),
        engine_metrics_every: args.engine_metrics_ms.map(Duration::from_millis),
        sessions: SessionConfig {
            header: args.session_header.clone(),
            capacity: args.session_capacity,
            ttl: Duration::from_secs(args.session_ttl_secs),
        },
        tenants: args.tenancy.config()?,
        fetch: args.fetch.config(),
        replicate: args.fetch.replicate(),
        renderer,
        model_renderers,
    })
}

/// Ingestion settings from the flags and the open-file limit.
fn ingest_config(args: &ServeArgs, max_connections: usize, fd_limit: u64) -> IngestConfig {
    let defaults = IngestConfig::default();
    let (max_ranks, max_ranks_source) = match args.max_ranks {
        Some(n) => (
            usize::try_from(n).unwrap_or(usize::MAX),
            RankLimitSource::Given,
        ),
        None => (
            default_max_ranks(fd_limit, max_connections),
            RankLimitSource::OpenFiles { limit: fd_limit },
        ),
    };
    IngestConfig {
        threads: args.ingest_threads.map_or(defaults.threads, |n| n as usize),
        max_ranks,
        max_ranks_source,
        timing: Timing {
            verify_ms: args.verify_secs.saturating_mul(1_000),
            ..Timing::default()
        },
    }
}

/// `--nats` and what goes with it.
fn replica_config(args: &ServeArgs, port: u16) -> Result<Option<ReplicaConfig>> {
    let Some(url) = args.nats.clone() else {
        return Ok(None);
    };
    let id = args
        .replica_id
        .clone()
        .unwrap_or_else(|| default_replica_id(port));
    let (key, file) = (&args.nats_pins_key, &args.nats_pins_key_file);
    let pins_secret = PinsSecret::from_flags(key.as_deref(), file.as_deref())?;
    Ok(Some(ReplicaConfig {
        prefix: args.nats_prefix.clone(),
        snapshot_every: Duration::from_secs(args.snapshot_secs),
        pins_secret,
        ..ReplicaConfig::new(url, id)
    }))
}

/// `--replica-id`'s default: the host's name and the listening port.
fn default_replica_id(port: u16) -> String {
    let host = std::fs::read_to_string("/proc/sys/kernel/hostname")
        .ok()
        .map(|h| h.trim().to_owned())
        .filter(|h| !h.is_empty())
        .unwrap_or_else(|| "kvroute".into());
    format!("{host}-{port}")
}

/// A NATS subject token that is also a valid bucket name: letters, digits,
/// `-` and `_`.
fn parse_nats_prefix(s: &str) -> Result<String, String> {
    let ok = !s.is_empty()
        && s.len() <= 64
        && s.bytes()
            .all(|b| b.is_ascii_alphanumeric() || b == b'-' || b == b'_');
    if ok {
        Ok(s.to_owned())
    } else {
        Err("letters, digits, `-` and `_` only (at most 64)".into())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use clap::{CommandFactory, Parser};
    use kvroute_server::ingest::registry::FDS_PER_RANK;

    /// `kvroute serve`'s flags alone, as the binary parses them.
    #[derive(Debug, Parser)]
    struct Serve {
        #[command(flatten)]
        args: ServeArgs,
    }

    fn defaults() -> ServeConfig {
        let args = Serve::try_parse_from(["serve"])
            .expect("no flags parse")
            .args;
        serve_config(&args, Vec::new(), 65_536, 8_000).expect("the defaults build")
    }

    #[test]
    fn the_flags_defaults_are_the_configs_defaults() {
        let (got, want) = (defaults(), ServeConfig::default());
        assert_eq!(got.unreachable_grace, want.unreachable_grace);
        assert_eq!(got.index.default_capacity, want.index.default_capacity);
        assert_eq!(got.max_body_bytes, want.max_body_bytes);
        assert_eq!(got.query.max_body_bytes, want.query.max_body_bytes);
        assert_eq!(got.http.header_timeout, want.http.header_timeout);
        assert_eq!(got.http.idle_timeout, want.http.idle_timeout);
        assert_eq!(got.ingest.timing.verify_ms, want.ingest.timing.verify_ms);
        assert!(got.state.is_none() && got.replicas.is_none());
        assert_eq!(got.announce_access, want.announce_access);
        let (p, q) = (&got.proxy, &want.proxy);
        assert_eq!(p.policy, q.policy);
        assert_eq!(p.weights, q.weights);
        assert_eq!(p.temperature, q.temperature);
        assert_eq!(p.deal_new_prefixes, q.deal_new_prefixes);
        assert_eq!(p.holder_stickiness, q.holder_stickiness);
        assert_eq!(p.busy, q.busy);
        assert_eq!(p.max_attempts, q.max_attempts);
        assert_eq!(p.request_timeout, q.request_timeout);
        assert_eq!(p.connect_timeout, q.connect_timeout);
        assert_eq!(p.migration_limit, q.migration_limit);
        assert_eq!(p.breaker_failures, q.breaker_failures);
        assert_eq!(p.breaker_open, q.breaker_open);
        assert_eq!(p.active_expiry, q.active_expiry);
        assert_eq!(p.dp_rank_in_body, q.dp_rank_in_body);
        assert_eq!(p.queue_capacity, q.queue_capacity);
        assert_eq!(p.queue_timeout, q.queue_timeout);
        assert_eq!(p.max_model_len, q.max_model_len);
        assert_eq!(p.learn_speeds.is_some(), q.learn_speeds.is_some());
        assert_eq!(p.local_prefill, q.local_prefill);
        assert_eq!(p.prefill_timeout, q.prefill_timeout);
        assert_eq!(p.tenants, q.tenants);
    }

    /// The text `--help` prints for one flag, up to the next flag.
    fn help_of(help: &str, flag: &str) -> String {
        // A flag's own line starts with six spaces; prose that names it is
        // indented further.
        let start = help
            .find(&format!("\n      --{flag} "))
            .unwrap_or_else(|| panic!("--{flag} is in the help"));
        let rest = &help[start + 1..];
        let next_flag = |at: &str| rest[2..].find(at).map(|i| i + 2);
        let end = [next_flag("\n      --"), next_flag("\n  -")]
            .into_iter()
            .flatten()
            .min()
            .unwrap_or(rest.len());
        rest[..end].to_owned()
    }

    #[test]
    fn help_prints_the_defaults_the_config_holds() {
        let help = Serve::command().render_long_help().to_string();
        let d = ServeConfig::default();
        let w = d.proxy.weights;
        let secs = |t: Duration| t.as_secs().to_string();
        let shown = [
            ("policy", d.proxy.policy.to_string()),
            ("prefill-load-scale", w.prefill_load_scale.to_string()),
            ("overlap-credit", w.overlap_credit.to_string()),
            ("host-cache-weight", w.host_weight.to_string()),
            ("disk-cache-weight", w.disk_weight.to_string()),
            ("active-prefix-weight", w.active_prefix_weight.to_string()),
            ("request-kv-weight", w.request_kv_weight.to_string()),
            ("request-size-weight", w.request_size_weight.to_string()),
            ("max-attempts", d.proxy.max_attempts.to_string()),
            ("request-timeout-secs", secs(d.proxy.request_timeout)),
            (
                "connect-timeout-ms",
                millis(d.proxy.connect_timeout).to_string(),
            ),
            ("breaker-failures", d.proxy.breaker_failures.to_string()),
            ("migration-limit", d.proxy.migration_limit.to_string()),
            ("breaker-open-secs", secs(d.proxy.breaker_open)),
            (
                "queue-timeout-ms",
                millis(d.proxy.queue_timeout).to_string(),
            ),
            ("unreachable-grace-secs", secs(d.unreachable_grace)),
            ("max-body-mib", (d.max_body_bytes >> 20).to_string()),
            ("snapshot-secs", secs(StateConfig::DEFAULT_EVERY)),
            ("header-timeout-secs", secs(d.http.header_timeout)),
            ("idle-timeout-secs", secs(d.http.idle_timeout)),
            ("prefill-timeout-secs", secs(d.proxy.prefill_timeout)),
            (
                "local-prefill-max-tokens",
                d.proxy.local_prefill.max_uncached_tokens.to_string(),
            ),
            (
                "local-prefill-max-fraction",
                d.proxy.local_prefill.max_uncached_fraction.to_string(),
            ),
        ];
        for (flag, value) in shown {
            let text = help_of(&help, flag);
            assert!(
                text.contains(&format!("[default: {value}]")),
                "--{flag} should show [default: {value}]: {text}"
            );
        }
        // Prose states no default of its own beside clap's: the weights'
        // reasons name Dynamo's, never a number for kvroute's.
        let scale = help_of(&help, "prefill-load-scale");
        assert!(!scale.contains("kvroute's is"), "{scale}");
    }

    /// `1974` as the help writes it: `1 974`.
    fn spaced(n: u64) -> String {
        let digits = n.to_string();
        let mut out = String::new();
        for (i, d) in digits.chars().enumerate() {
            if i > 0 && (digits.len() - i).is_multiple_of(3) {
                out.push(' ');
            }
            out.push(d);
        }
        out
    }

    #[test]
    fn max_ranks_help_states_the_arithmetic_the_code_does() {
        let help = Serve::command().render_long_help().to_string();
        // Clap prints each paragraph of the doc comment on one line.
        let text = help_of(&help, "max-ranks");
        assert!(
            text.contains("a rank without a replay endpoint takes two")
                && text.contains("2 048 ranks without replay endpoints fill 4 096 slots"),
            "{text}"
        );
        // The worked example is the code's own default at that limit.
        let limit = 20_000;
        let connections = default_max_connections(limit);
        let ranks = default_max_ranks(limit, connections) as u64;
        assert_eq!(ranks, (limit - 256 - 2 * connections as u64) / FDS_PER_RANK);
        let example = format!(
            "({} − 256 − 2 × {}) / {FDS_PER_RANK} = {} slots",
            spaced(limit),
            spaced(connections as u64),
            spaced(ranks)
        );
        assert!(text.contains(&example), "{example} not in {text}");
        assert!(text.contains("`ulimit -n`"), "{text}");
    }
}
