//! `kvroute mocker`: run simulated vLLM / SGLang engines for tests, demos and benchmarks.
//!
//! Turns the flags into a [`MockerConfig`] and runs the fleet until Ctrl-C or
//! SIGTERM. Prints one `--worker` line per engine on stdout (for `kvroute
//! serve`); logs go to stderr (`RUST_LOG`, default `info`). See `docs/mocker.md`.

use std::path::PathBuf;
use std::process::ExitCode;
use std::time::Duration;

use anyhow::Result;
use clap::{Args, ValueEnum};
use kvroute_core::event::WorkerFlavor;
use kvroute_mocker::config::{
    DEFAULT_BOOTSTRAP_PORT, DEFAULT_KV_LEASE, DEFAULT_TRANSFER_US_PER_BLOCK,
};
use kvroute_mocker::engine::timing::TimingModel;
use kvroute_mocker::faults::FaultConfig;
use kvroute_mocker::{EventFormat, MockerConfig, ReplayFrames, Role, TsSource};

/// Arguments of `kvroute mocker`.
#[derive(Debug, Args)]
pub struct MockerArgs {
    /// Engine imitated on the wire: vllm, sglang or trtllm (TensorRT-LLM's
    /// streaming KV events: signed radix-key hashes, coalesced stores, images
    /// digest-first with `mm_keys`; aggregated only).
    #[arg(long, default_value_t = WorkerFlavor::Vllm)]
    engine_flavor: WorkerFlavor,
    /// Independent engines in this process.
    #[arg(long, default_value_t = 1, value_parser = clap::value_parser!(u16).range(1..))]
    workers: u16,
    /// Address every socket binds.
    #[arg(long, default_value = "127.0.0.1")]
    host: std::net::IpAddr,
    /// HTTP port of engine 0 (engine k: port + k).
    #[arg(long, default_value_t = 8100)]
    port: u16,
    /// KV-event PUB port of engine 0 rank 0 (engine k rank r: + k·dp + r).
    #[arg(long, default_value_t = 5557)]
    kv_events_port: u16,
    /// Replay ROUTER port of engine 0 rank 0 (offset like --kv-events-port).
    #[arg(long, default_value_t = 5657)]
    replay_port: u16,
    /// Data-parallel ranks per engine, each with its own cache and sockets.
    #[arg(long, default_value_t = 1, value_parser = clap::value_parser!(u16).range(1..))]
    dp_size: u16,
    /// KV-cache blocks per rank.
    #[arg(long, default_value_t = 16384)]
    num_gpu_blocks: usize,
    /// The engines of a named workload (`long`, `short`): its KV-cache
    /// blocks of 16 tokens per rank; send it with `kvroute bench --preset`.
    #[arg(long, value_parser = super::args::parse_preset, conflicts_with_all = ["num_gpu_blocks", "block_size"])]
    preset: Option<kvroute_loadgen::Preset>,
    /// Tokens per block.
    #[arg(long, default_value_t = 16)]
    block_size: usize,
    /// Most running requests per rank.
    #[arg(long, default_value_t = 256)]
    max_num_seqs: usize,
    /// Token budget of one scheduler step.
    #[arg(long, default_value_t = 8192)]
    max_num_batched_tokens: usize,
    /// Divides every simulated time (10 = ten times faster than the timing model).
    #[arg(long, default_value_t = 1.0)]
    speedup: f64,
    /// Seed of the filler text and injected failures.
    #[arg(long, default_value_t = 0)]
    seed: u64,
    /// Event shape: tagged maps (current engines) or tagged arrays (vLLM ≤ 0.23, SGLang ≤ 0.5.19).
    #[arg(long, value_enum, default_value_t = Format::Map)]
    event_format: Format,
    /// Replay reply layout: 4 = [b"", topic, seq, payload] (current), 3 = [b"", seq, payload].
    #[arg(long, default_value_t = 4, value_parser = clap::value_parser!(u8).range(3..=4))]
    replay_frames: u8,
    /// Batches each rank's replay ring keeps (10000, as vLLM); a small ring wraps
    /// quickly, so a replay from an older seq cannot reach back.
    #[arg(long, value_name = "N", default_value_t = 10_000, value_parser = clap::value_parser!(u32).range(1..))]
    replay_buffer: u32,
    /// Prompt positions each image occupies.
    #[arg(long, default_value_t = 64)]
    mm_tokens_per_image: usize,
    /// A Hugging Face tokenizer.json (needs the `hf-tokenizer` feature); default: the built-in tokenizer.
    #[arg(long, value_name = "FILE")]
    tokenizer: Option<PathBuf>,
    /// Served model name.
    #[arg(long, default_value = "mock-model")]
    model: String,
    /// LoRA adapters every engine has loaded: listed in `/v1/models` with
    /// the model as parent, served when a request names one as its model,
    /// hashed into its blocks and named in its events.
    #[arg(long, value_delimiter = ',', value_name = "NAME,…")]
    lora_adapters: Vec<String>,
    /// Do not send every Nth live batch (it stays in the replay ring).
    #[arg(long, value_name = "N", value_parser = clap::value_parser!(u64).range(1..))]
    drop_every: Option<u64>,
    /// The first N replay answers of each rank stop before their end marker.
    #[arg(long, value_name = "N", default_value_t = 0)]
    cut_replay: u64,
    /// Add one malformed event to every Nth batch.
    #[arg(long, value_name = "N", value_parser = clap::value_parser!(u64).range(1..))]
    bad_event_every: Option<u64>,
    /// Restart the publisher (seq back to 0) and clear the cache every S seconds.
    #[arg(long, value_name = "S")]
    restart_every_secs: Option<f64>,
    /// Delay added to every HTTP response, in milliseconds.
    #[arg(long, value_name = "MS", default_value_t = 0)]
    delay_ms: u64,
    /// Fraction of completion requests answered 500.
    #[arg(long, value_name = "F", default_value_t = 0.0)]
    fail_rate: f64,
    /// Fraction of streamed answers cut off after half their tokens (the
    /// connection closes mid-body, as when an engine dies).
    #[arg(long, value_name = "F", default_value_t = 0.0)]
    cut_streams: f64,
    /// Batch timestamps = SECONDS + the engine's simulated time, so runs with the
    /// same requests publish byte-identical payloads (default: the wall clock).
    #[arg(long, value_name = "SECONDS")]
    ts_start: Option<f64>,
    /// Prefill/decode disaggregation role: both (an ordinary engine), prefill or decode.
    #[arg(long, default_value_t = Role::Both)]
    role: Role,
    /// Modelled microseconds to move one KV block to a decode engine (divided by --speedup).
    #[arg(long, value_name = "US", default_value_t = DEFAULT_TRANSFER_US_PER_BLOCK)]
    transfer_us_per_block: u64,
    /// How long a prefill holds a finished transfer for its decode, and an SGLang
    /// decode waits for its bootstrap room, in seconds.
    #[arg(long, value_name = "S", default_value_t = DEFAULT_KV_LEASE.as_secs_f64())]
    kv_lease_secs: f64,
    /// Bootstrap port of SGLang prefill engine 0 (engine k: port + k; 0 = ephemeral).
    #[arg(long, default_value_t = DEFAULT_BOOTSTRAP_PORT)]
    bootstrap_port: u16,
    /// SGLang `both` engines are both ends of a bootstrap hand-off: each serves
    /// bootstrap rooms (on --bootstrap-port) and reads a leg naming another engine
    /// from it, so a router can move a prefix between them (vLLM's always are).
    #[arg(long)]
    kv_both: bool,
}

#[derive(Debug, Clone, Copy, ValueEnum)]
enum Format {
    Map,
    LegacyArray,
}

impl MockerArgs {
    fn config(&self) -> Result<MockerConfig> {
        let restart_every = match self.restart_every_secs {
            None => None,
            Some(s) if s.is_finite() && s > 0.0 => Some(Duration::from_secs_f64(s)),
            Some(s) => anyhow::bail!("--restart-every-secs {s} must be a number above 0"),
        };
        let kv_lease = match self.kv_lease_secs {
            s if s.is_finite() && s > 0.0 && s <= 86_400.0 => Duration::from_secs_f64(s),
            s => anyhow::bail!("--kv-lease-secs {s} must be above 0 and at most a day"),
        };
        let config = MockerConfig {
            flavor: self.engine_flavor,
            workers: self.workers,
            host: self.host,
            port: self.port,
            kv_events_port: self.kv_events_port,
            replay_port: self.replay_port,
            dp_size: self.dp_size,
            num_gpu_blocks: self.preset.map_or(self.num_gpu_blocks, |p| p.gpu_blocks()),
            block_size: self.block_size,
            max_num_seqs: self.max_num_seqs,
            max_num_batched_tokens: self.max_num_batched_tokens,
            timing: TimingModel {
                speedup: self.speedup,
                ..TimingModel::default()
            },
            seed: self.seed,
            event_format: match self.event_format {
                Format::Map => EventFormat::Map,
                Format::LegacyArray => EventFormat::LegacyArray,
            },
            replay_frames: if self.replay_frames == 3 {
                ReplayFrames::Three
            } else {
                ReplayFrames::Four
            },
            replay_buffer_steps: usize::try_from(self.replay_buffer).map_err(|_| {
                anyhow::anyhow!("--replay-buffer {} is too large", self.replay_buffer)
            })?,
            mm_tokens_per_image: self.mm_tokens_per_image,
            tokenizer: self.tokenizer.clone(),
            model: self.model.clone(),
            lora_adapters: self.lora_adapters.clone(),
            faults: FaultConfig {
                drop_every: self.drop_every,
                cut_replay: self.cut_replay,
                bad_event_every: self.bad_event_every,
                restart_every,
                delay: Duration::from_millis(self.delay_ms),
                fail_rate: self.fail_rate,
                cut_streams: self.cut_streams,
            },
            ts_source: match self.ts_start {
                Some(start) => TsSource::Simulated { start },
                None => TsSource::Wall,
            },
            role: self.role,
            transfer_us_per_block: self.transfer_us_per_block,
            kv_lease,
            bootstrap_port: self.bootstrap_port,
            kv_both: self.kv_both,
        };
        config.validate()?;
        Ok(config)
    }
}

/// Runs the fleet until Ctrl-C or SIGTERM.
pub fn run(args: &MockerArgs) -> Result<ExitCode> {
    let config = args.config()?;
    super::init_logging(tracing_subscriber::filter::LevelFilter::INFO);
    let runtime = super::runtime()?;
    runtime.block_on(async { kvroute_mocker::run(config, super::shutdown_signal()).await })?;
    Ok(ExitCode::SUCCESS)
}
