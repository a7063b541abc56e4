//! The validated configuration of a mocker fleet; every default is stated here once.

use std::net::{IpAddr, Ipv4Addr};
use std::path::PathBuf;
use std::time::Duration;

use kvroute_core::event::WorkerFlavor;

use crate::engine::timing::TimingModel;
use crate::faults::FaultConfig;

/// The shape of events inside a batch.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum EventFormat {
    /// Tagged maps (vLLM ≥ 0.24, SGLang ≥ 0.5.20): the default.
    Map,
    /// Tagged arrays (vLLM ≤ 0.23, SGLang ≤ 0.5.19).
    LegacyArray,
}

/// The layout of replay replies as a DEALER receives them.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum ReplayFrames {
    /// `[b"", topic, seq, payload]` (vLLM ≥ 0.26, SGLang ≥ 0.5.22): the default.
    Four,
    /// `[b"", seq, payload]` (older releases).
    Three,
}

/// Where batch timestamps (`ts`) come from.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum TsSource {
    /// `time.time()` at publication, as the engines do.
    Wall,
    /// `start` plus the engine's simulated time: byte-identical payloads across
    /// runs with the same requests (tests, golden captures).
    Simulated {
        /// Seconds since the epoch at simulated time zero.
        start: f64,
    },
}

/// What an engine does in a prefill/decode disaggregated fleet (`--role`).
///
/// `Both` is an ordinary engine and ignores every transfer field. A vLLM
/// `Prefill` or `Decode` engine is an engine with a NIXL connector: it hands
/// off (`do_remote_decode`) and takes over (`do_remote_prefill`) KV as the
/// request asks, and its role only says which pool it serves, as vLLM's
/// `kv_role` does for NIXL. An SGLang engine's role is its
/// `--disaggregation-mode`: a prefill engine serves the bootstrap rooms, a
/// decode engine waits on them. See `docs/mocker.md`, "Prefill and decode roles".
///
/// The same type as the router's worker role, so a mock engine's
/// `role=` and the router's parse alike.
pub use kvroute_core::scheduler::WorkerRole as Role;

/// Modelled time to move one KV block from a prefill to a decode engine,
/// in microseconds (`--transfer-us-per-block`): a 16-token block of an
/// 8B-class model in fp16 is about 2 MiB, which takes about 20 µs at
/// 100 GB/s (RDMA or NVLink); see `docs/mocker.md`.
pub const DEFAULT_TRANSFER_US_PER_BLOCK: u64 = 20;

/// How long a prefill keeps a finished transfer for its decode (vLLM's
/// `kv_lease_duration`), and how long an SGLang decode waits for its room.
pub const DEFAULT_KV_LEASE: Duration = Duration::from_secs(30);

/// SGLang's default `--disaggregation-bootstrap-port`.
pub const DEFAULT_BOOTSTRAP_PORT: u16 = 8998;

/// Everything a fleet of mock engines needs; build with [`MockerConfig::default`]
/// and override fields, then [`MockerConfig::validate`].
#[derive(Debug, Clone)]
pub struct MockerConfig {
    /// Engine imitated on the wire (default vLLM).
    pub flavor: WorkerFlavor,
    /// Independent engines in this process (default 1).
    pub workers: u16,
    /// Address every socket binds (default 127.0.0.1).
    pub host: IpAddr,
    /// HTTP port of engine 0; engine k uses `port + k` (default 8100; 0 = ephemeral ports).
    pub port: u16,
    /// PUB port of engine 0 rank 0; engine k rank r uses `+ k·dp + r` (default 5557; 0 = ephemeral).
    pub kv_events_port: u16,
    /// Replay ROUTER port, offset like the PUB port (default 5657; 0 = ephemeral).
    pub replay_port: u16,
    /// Data-parallel ranks per engine, each with its own cache and sockets (default 1).
    pub dp_size: u16,
    /// KV-cache blocks per rank (default 16384).
    pub num_gpu_blocks: usize,
    /// Tokens per block (default 16).
    pub block_size: usize,
    /// Most requests running at once per rank (default 256).
    pub max_num_seqs: usize,
    /// Token budget of one scheduler step per rank (default 8192).
    pub max_num_batched_tokens: usize,
    /// Step-time model; its `speedup` divides every simulated time (default 1).
    pub timing: TimingModel,
    /// Seed of the filler text and injected failures (default 0).
    pub seed: u64,
    /// Event shape (default maps).
    pub event_format: EventFormat,
    /// Replay reply layout (default 4 frames).
    pub replay_frames: ReplayFrames,
    /// Tokens each image occupies in a prompt (default 64).
    pub mm_tokens_per_image: usize,
    /// A Hugging Face `tokenizer.json`; `None` uses the built-in tokenizer.
    pub tokenizer: Option<PathBuf>,
    /// The served model name (default `"mock-model"`).
    pub model: String,
    /// LoRA adapters loaded on every engine (`--lora-adapters`): each is
    /// listed in `/v1/models` with the model as its `parent`, served when a
    /// request names it, and hashed into its blocks.
    pub lora_adapters: Vec<String>,
    /// Fault injection (all off by default).
    pub faults: FaultConfig,
    /// Batch timestamps (default wall clock).
    pub ts_source: TsSource,
    /// Batches each rank keeps for replay (default 10,000, as both engines).
    pub replay_buffer_steps: usize,
    /// Prefill/decode disaggregation role (default [`Role::Both`]: none).
    pub role: Role,
    /// Modelled microseconds per KV block moved to a decode engine, divided
    /// by the speedup like every simulated time (default 20).
    pub transfer_us_per_block: u64,
    /// Lease of a prefill's finished transfer, and an SGLang decode's
    /// longest wait for its bootstrap room (default 30 s).
    pub kv_lease: Duration,
    /// Bootstrap port of SGLang prefill engine 0; engine k uses `+ k`
    /// (default 8998; 0 = ephemeral). Bound only by SGLang prefill engines
    /// and SGLang `both` engines with [`MockerConfig::kv_both`].
    pub bootstrap_port: u16,
    /// SGLang `both` engines are both ends of a bootstrap hand-off
    /// (`--kv-both`, as a vLLM `both` engine always is of its connector):
    /// each serves bootstrap rooms, computes a leg whose bootstrap names
    /// itself as the source and reads a leg naming another engine from it,
    /// so a router can move a prefix between aggregated engines (default off).
    pub kv_both: bool,
}

impl MockerConfig {
    /// The engine core each rank runs (`kvroute bench sim` runs the same one
    /// on a virtual clock).
    pub fn engine_config(&self) -> crate::engine::EngineConfig {
        crate::engine::EngineConfig {
            flavor: self.flavor,
            block_size: self.block_size,
            num_gpu_blocks: self.num_gpu_blocks,
            max_num_seqs: self.max_num_seqs,
            max_num_batched_tokens: self.max_num_batched_tokens,
            timing: self.timing,
        }
    }
}

impl Default for MockerConfig {
    fn default() -> Self {
        MockerConfig {
            flavor: WorkerFlavor::Vllm,
            workers: 1,
            host: IpAddr::V4(Ipv4Addr::LOCALHOST),
            port: 8100,
            kv_events_port: 5557,
            replay_port: 5657,
            dp_size: 1,
            num_gpu_blocks: 16384,
            block_size: 16,
            max_num_seqs: 256,
            max_num_batched_tokens: 8192,
            timing: TimingModel::default(),
            seed: 0,
            event_format: EventFormat::Map,
            replay_frames: ReplayFrames::Four,
            mm_tokens_per_image: 64,
            tokenizer: None,
            model: "mock-model".to_owned(),
            lora_adapters: Vec::new(),
            faults: FaultConfig::default(),
            ts_source: TsSource::Wall,
            replay_buffer_steps: 10_000,
            role: Role::Both,
            transfer_us_per_block: DEFAULT_TRANSFER_US_PER_BLOCK,
            kv_lease: DEFAULT_KV_LEASE,
            bootstrap_port: DEFAULT_BOOTSTRAP_PORT,
            kv_both: false,
        }
    }
}

/// A configuration value that cannot work, named by its flag.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
#[non_exhaustive]
pub enum ConfigError {
    /// A count that must be at least 1 is 0.
    #[error("--{flag} must be at least 1")]
    Zero {
        /// The flag.
        flag: &'static str,
    },
    /// A port range runs past 65535.
    #[error("--{flag} {base} + {count} sockets runs past port 65535")]
    PortOverflow {
        /// The flag.
        flag: &'static str,
        /// The base port.
        base: u16,
        /// How many consecutive ports are needed.
        count: u32,
    },
    /// Two port ranges overlap.
    #[error("port ranges overlap: {detail}")]
    PortOverlap {
        /// Which ranges.
        detail: String,
    },
    /// A float outside its range.
    #[error("--{flag} {value} is out of range ({expected})")]
    OutOfRange {
        /// The flag.
        flag: &'static str,
        /// The value given.
        value: f64,
        /// What is allowed.
        expected: &'static str,
    },
    /// The token budget cannot hold a single block.
    #[error("--max-num-batched-tokens {budget} is smaller than --block-size {block_size}")]
    BudgetBelowBlock {
        /// The budget.
        budget: usize,
        /// The block size.
        block_size: usize,
    },
    /// The model name is empty.
    #[error("--model must not be empty")]
    EmptyModel,
    /// A TensorRT-LLM engine with a prefill or decode role.
    #[error(
        "--role {role}: a TensorRT-LLM engine (--engine-flavor trtllm) serves aggregated only"
    )]
    TrtllmRole {
        /// The role given.
        role: Role,
    },
    /// `--kv-both` on an engine that is not an SGLang `both` engine.
    #[error("--kv-both is for SGLang engines in --role both (a vLLM both engine always is one)")]
    KvBoth,
}

impl MockerConfig {
    /// Checks every value; the fleet refuses to start on an error.
    pub fn validate(&self) -> Result<(), ConfigError> {
        for (flag, value) in [
            ("workers", usize::from(self.workers)),
            ("dp-size", usize::from(self.dp_size)),
            ("num-gpu-blocks", self.num_gpu_blocks),
            ("block-size", self.block_size),
            ("max-num-seqs", self.max_num_seqs),
            ("max-num-batched-tokens", self.max_num_batched_tokens),
            ("mm-tokens-per-image", self.mm_tokens_per_image),
        ] {
            if value == 0 {
                return Err(ConfigError::Zero { flag });
            }
        }
        if self.replay_buffer_steps == 0 {
            return Err(ConfigError::Zero {
                flag: "replay-buffer",
            });
        }
        if self.max_num_batched_tokens < self.block_size {
            return Err(ConfigError::BudgetBelowBlock {
                budget: self.max_num_batched_tokens,
                block_size: self.block_size,
            });
        }
        if self.model.is_empty() {
            return Err(ConfigError::EmptyModel);
        }
        if self.flavor == WorkerFlavor::Trtllm && self.role != Role::Both {
            return Err(ConfigError::TrtllmRole { role: self.role });
        }
        if self.kv_both && (self.flavor != WorkerFlavor::Sglang || self.role != Role::Both) {
            return Err(ConfigError::KvBoth);
        }
        if !(self.timing.speedup.is_finite() && self.timing.speedup > 0.0) {
            return Err(ConfigError::OutOfRange {
                flag: "speedup",
                value: self.timing.speedup,
                expected: "a finite number above 0",
            });
        }
        if let TsSource::Simulated { start } = self.ts_source {
            if !start.is_finite() {
                return Err(ConfigError::OutOfRange {
                    flag: "ts-start",
                    value: start,
                    expected: "a finite number of seconds",
                });
            }
        }
        if self.kv_lease.is_zero() {
            return Err(ConfigError::OutOfRange {
                flag: "kv-lease-secs",
                value: 0.0,
                expected: "a duration above 0",
            });
        }
        self.faults.validate()?;
        self.check_port_ranges()
    }

    /// No port range runs past 65535 or into another (ranges based at 0 are ephemeral).
    fn check_port_ranges(&self) -> Result<(), ConfigError> {
        let sockets = u32::from(self.workers) * u32::from(self.dp_size);
        let mut ranges = vec![
            ("port", self.port, u32::from(self.workers)),
            ("kv-events-port", self.kv_events_port, sockets),
            ("replay-port", self.replay_port, sockets),
        ];
        if self.serves_bootstrap() {
            ranges.push((
                "bootstrap-port",
                self.bootstrap_port,
                u32::from(self.workers),
            ));
        }
        for &(flag, base, count) in &ranges {
            if u32::from(base) + count - 1 > u32::from(u16::MAX) {
                return Err(ConfigError::PortOverflow { flag, base, count });
            }
        }
        for (i, a) in ranges.iter().enumerate() {
            for b in &ranges[i + 1..] {
                let (a_lo, a_hi) = (u32::from(a.1), u32::from(a.1) + a.2);
                let (b_lo, b_hi) = (u32::from(b.1), u32::from(b.1) + b.2);
                if a.1 != 0 && b.1 != 0 && a_lo < b_hi && b_lo < a_hi {
                    return Err(ConfigError::PortOverlap {
                        detail: format!(
                            "--{} {}..{} and --{} {}..{}",
                            a.0,
                            a_lo,
                            a_hi - 1,
                            b.0,
                            b_lo,
                            b_hi - 1
                        ),
                    });
                }
            }
        }
        Ok(())
    }

    /// Token capacity of one rank's KV cache.
    pub fn capacity_tokens(&self) -> usize {
        self.num_gpu_blocks.saturating_mul(self.block_size)
    }

    /// Whether each engine binds a bootstrap server (SGLang prefill
    /// engines, and `both` engines with [`MockerConfig::kv_both`]).
    pub fn serves_bootstrap(&self) -> bool {
        self.flavor == WorkerFlavor::Sglang
            && (self.role == Role::Prefill || (self.role == Role::Both && self.kv_both))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn defaults_are_valid() {
        assert_eq!(MockerConfig::default().validate(), Ok(()));
    }

    #[test]
    fn zero_counts_and_bad_speedups_are_named_by_flag() {
        let c = MockerConfig {
            dp_size: 0,
            ..MockerConfig::default()
        };
        assert_eq!(
            c.validate().expect_err("invalid").to_string(),
            "--dp-size must be at least 1"
        );
        let mut c = MockerConfig::default();
        c.timing.speedup = 0.0;
        assert!(c
            .validate()
            .expect_err("invalid")
            .to_string()
            .contains("--speedup"));
    }

    #[test]
    fn roles_parse_and_print_by_their_flag_names() {
        for role in [Role::Both, Role::Prefill, Role::Decode] {
            assert_eq!(role.as_str().parse::<Role>(), Ok(role));
        }
        assert!("encode".parse::<Role>().is_err());
        assert_eq!(MockerConfig::default().role, Role::Both);
    }

    #[test]
    fn the_bootstrap_range_is_checked_only_where_it_is_bound() {
        // 8998 + 2 engines would overlap HTTP ports 8998.. only for SGLang prefill.
        let c = MockerConfig {
            workers: 2,
            port: 8999,
            ..MockerConfig::default()
        };
        assert_eq!(c.validate(), Ok(()));
        let c = MockerConfig {
            flavor: WorkerFlavor::Sglang,
            role: Role::Prefill,
            ..c
        };
        assert!(matches!(c.validate(), Err(ConfigError::PortOverlap { .. })));
        let c = MockerConfig {
            kv_lease: Duration::ZERO,
            ..MockerConfig::default()
        };
        assert!(c
            .validate()
            .expect_err("zero lease")
            .to_string()
            .contains("--kv-lease-secs"));
    }

    #[test]
    fn overlapping_port_ranges_are_rejected() {
        // 100 workers of HTTP ports from 5500 run into the event ports at 5557.
        let c = MockerConfig {
            workers: 100,
            port: 5500,
            ..MockerConfig::default()
        };
        assert!(matches!(c.validate(), Err(ConfigError::PortOverlap { .. })));
        let c = MockerConfig {
            workers: 2,
            kv_events_port: 65535,
            ..MockerConfig::default()
        };
        assert!(matches!(
            c.validate(),
            Err(ConfigError::PortOverflow { .. })
        ));
    }
}
