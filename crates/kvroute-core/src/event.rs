//! Normalized KV-cache events: what every engine's wire format decodes into.
//!
//! One [`KvEvent`] describes a change to the prefix cache of one worker's
//! data-parallel rank. Stored blocks carry both hash spaces: the engine's own
//! [`ExternalHash`] (needed to resolve later parents and removals, which name
//! blocks only by it) and the router's [`LocalBlockHash`] (which navigates the
//! index and matches request prompts).

use crate::hash::LocalBlockHash;

/// An engine's own block hash, normalized to 64 bits.
///
/// vLLM publishes unsigned hashes, SGLang signed ones (kept as their two's
/// complement bits), and vLLM with int hashes off publishes digests (the last 8
/// bytes read big-endian, which equals vLLM's own int form). Opaque to kvroute.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct ExternalHash(pub u64);

/// Where a cached block lives on its worker.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum Tier {
    /// GPU memory: a hit costs no transfer (`GPU`, or `medium` absent).
    Device,
    /// Host memory (`CPU`, `CPU_PINNED`): a hit costs a PCIe transfer.
    Host,
    /// Local disk or storage (`DISK`, `STORAGE`).
    Disk,
    /// A shared external pool (`EXTERNAL`, e.g. Mooncake).
    External,
}

impl Tier {
    /// Maps an engine's `medium` string (ASCII case ignored); `None` when unknown.
    pub fn from_medium(medium: &str) -> Option<Tier> {
        const NAMES: [(&str, Tier); 12] = [
            ("GPU", Tier::Device),
            ("DEVICE", Tier::Device),
            ("CPU", Tier::Host),
            ("CPU_PINNED", Tier::Host),
            ("CPU_TIER1", Tier::Host),
            ("CPU_TIER2", Tier::Disk),
            ("DISK", Tier::Disk),
            ("NVME", Tier::Disk),
            ("STORAGE", Tier::Disk),
            ("EXTERNAL", Tier::External),
            ("NETWORK", Tier::External),
            ("SHARED", Tier::External),
        ];
        NAMES
            .iter()
            .find(|(name, _)| name.eq_ignore_ascii_case(medium))
            .map(|&(_, tier)| tier)
    }

    /// Lower-case name, stable for JSON output and metric labels.
    pub fn as_str(self) -> &'static str {
        match self {
            Tier::Device => "device",
            Tier::Host => "host",
            Tier::Disk => "disk",
            Tier::External => "external",
        }
    }
}

/// One stored block in both hash spaces.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct StoredBlock {
    /// The engine's hash of the block (resolves parents and removals).
    pub external: ExternalHash,
    /// The router's hash of the block's tokens and namespace (navigates the index).
    pub local: LocalBlockHash,
}

/// Blocks newly cached on a worker, in chain order.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Stored {
    /// The engine hash of the block before `blocks[0]`; `None` when the chain starts here.
    pub parent: Option<ExternalHash>,
    /// The stored blocks, in order; each one's parent is the one before it.
    pub blocks: Vec<StoredBlock>,
    /// Where the blocks live.
    pub tier: Tier,
    /// Tokens per block, as the event declared it (a worker whose block size
    /// is not configured learns it from its first stored event).
    pub block_size: u32,
    /// The LoRA adapter the blocks belong to (part of the local hash seed).
    pub lora_name: Option<String>,
    /// The tenant cache salt (part of the local hash seed); explicit on the event,
    /// found in vLLM `extra_keys`, or inherited from a salted parent block.
    pub cache_salt: Option<String>,
    /// Tokens after each block that its local hash also covers: 1 for SGLang
    /// EAGLE (bigram) events, L for vLLM lookahead hashing, 0 otherwise. The
    /// request side must hash prompts for this worker with the same window.
    pub lookahead: u32,
    /// Hashes of the event that were not kept, because the event's block size
    /// differs from the worker's or its token list ran short.
    pub dropped_blocks: u32,
    /// The folded token ids of the kept blocks, only when the decoder was asked
    /// to keep them (debugging; the hot path never builds this list).
    pub token_ids: Option<Vec<u32>>,
    /// The image item hashes each kept block's local hash covers, as
    /// `(block, item hash)`, only when the decoder was asked to keep tokens.
    pub image_items: Option<Vec<(u32, u64)>>,
}

impl Stored {
    /// Blocks on one tier with nothing else attached (no LoRA, salt,
    /// lookahead or tokens): what traces and tests build.
    pub fn plain(
        parent: Option<ExternalHash>,
        blocks: Vec<StoredBlock>,
        tier: Tier,
        block_size: u32,
    ) -> Stored {
        Stored {
            parent,
            blocks,
            tier,
            block_size,
            lora_name: None,
            cache_salt: None,
            lookahead: 0,
            dropped_blocks: 0,
            token_ids: None,
            image_items: None,
        }
    }
}

/// Blocks evicted from one tier of a worker.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Removed {
    /// Engine hashes of the evicted blocks.
    pub blocks: Vec<ExternalHash>,
    /// The tier they were evicted from.
    pub tier: Tier,
}

/// How a KV-cache group other than full attention limits which prefixes a
/// new request can reuse (hybrid models; vLLM's `HybridKVCacheCoordinator`
/// reuses the longest prefix every group accepts).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum GroupRule {
    /// Windowed attention (sliding window, chunked local): a prefix ending
    /// at an attention block boundary is reusable only if the group holds
    /// its `blocks` group blocks ending there (all of them when the prefix
    /// is shorter). A group block spans `stride` attention blocks, and the
    /// prefix must end on a group block boundary.
    Window {
        /// Group blocks the window needs (`cdiv(window − 1, group block size)`).
        blocks: u32,
        /// Attention blocks per group block.
        stride: u32,
    },
    /// A recurrent state (Mamba): a prefix is reusable only where the group
    /// holds the state at its end.
    State,
}

/// Blocks of a constraining KV-cache group stored or evicted, by engine
/// hash: a group block's hash is the attention chain's hash at the same
/// boundary, which is how the index lines them up.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct GroupBlocks {
    /// The engine's group index.
    pub group: u32,
    /// How the group limits reuse.
    pub rule: GroupRule,
    /// Engine hashes of the group's blocks.
    pub blocks: Vec<ExternalHash>,
    /// Where they live.
    pub tier: Tier,
    /// Stored (true) or evicted (false).
    pub stored: bool,
}

/// A change to one (worker, data-parallel rank)'s prefix cache.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum KvEvent {
    /// Blocks were cached.
    Stored(Stored),
    /// Blocks were evicted.
    Removed(Removed),
    /// Every block of this rank was dropped (cache reset).
    Cleared,
    /// Blocks of a hybrid model's window or state group were stored or evicted.
    Group(GroupBlocks),
}

impl KvEvent {
    /// `"stored"`, `"removed"`, `"cleared"` or `"group"`.
    pub fn kind(&self) -> &'static str {
        match self {
            KvEvent::Stored(_) => "stored",
            KvEvent::Removed(_) => "removed",
            KvEvent::Cleared => "cleared",
            KvEvent::Group(_) => "group",
        }
    }
}

/// Which engine a worker runs. It decides the engine's wire dialect (vLLM:
/// unsigned `sha256_cbor` hashes, one store per cached run; SGLang: signed
/// page digests, coalesced stores, wide image pads; TensorRT-LLM: signed
/// radix-key hashes, coalesced stores, digest-first images), how the engine
/// lays images out in its prompt tokens (and so how the router hashes a
/// prompt with images for it), and how it is told a data-parallel rank.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum WorkerFlavor {
    /// vLLM 0.33/0.34: placeholder ids in an image span, the item in each
    /// overlapping block's extra keys.
    #[default]
    Vllm,
    /// SGLang 0.5.23: the item's four wide pad values cycled over an image span.
    Sglang,
    /// TensorRT-LLM (the streaming KV events of its V2 cache manager): an
    /// image span digest-first (the item's digest, then ids above the
    /// vocabulary), the item in each overlapping block's `mm_keys`; the
    /// decoder and the request side write image position k as
    /// `1_000_000 + k` (see `wire::blocks`).
    Trtllm,
}

impl WorkerFlavor {
    /// Every flavour, in flag order.
    pub const ALL: [WorkerFlavor; 3] = [
        WorkerFlavor::Vllm,
        WorkerFlavor::Sglang,
        WorkerFlavor::Trtllm,
    ];

    /// The flavour's name in flags and documents (`vllm`, `sglang`, `trtllm`).
    pub fn as_str(self) -> &'static str {
        match self {
            WorkerFlavor::Vllm => "vllm",
            WorkerFlavor::Sglang => "sglang",
            WorkerFlavor::Trtllm => "trtllm",
        }
    }

    /// Whether the engine enters a block in its prefix cache when it
    /// schedules the step that fills it (vLLM), rather than once the block
    /// is computed (SGLang's radix tree, TensorRT-LLM's committed blocks).
    pub fn caches_when_scheduled(self) -> bool {
        self == WorkerFlavor::Vllm
    }
}

impl std::fmt::Display for WorkerFlavor {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.as_str())
    }
}

impl std::str::FromStr for WorkerFlavor {
    type Err = String;

    fn from_str(s: &str) -> Result<Self, String> {
        match s {
            "vllm" => Ok(WorkerFlavor::Vllm),
            "sglang" => Ok(WorkerFlavor::Sglang),
            "trtllm" => Ok(WorkerFlavor::Trtllm),
            _ => Err(format!("unknown flavor `{s}` (vllm, sglang, trtllm)")),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn mediums_map_to_tiers_ignoring_case() {
        assert_eq!(Tier::from_medium("GPU"), Some(Tier::Device));
        assert_eq!(Tier::from_medium("cpu"), Some(Tier::Host));
        assert_eq!(Tier::from_medium("CPU_PINNED"), Some(Tier::Host));
        assert_eq!(Tier::from_medium("DISK"), Some(Tier::Disk));
        assert_eq!(Tier::from_medium("STORAGE"), Some(Tier::Disk));
        assert_eq!(Tier::from_medium("EXTERNAL"), Some(Tier::External));
        assert_eq!(Tier::from_medium("FS"), None);
        assert_eq!(Tier::from_medium(""), None);
    }
}
