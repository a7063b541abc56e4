//! KV-cache events as the engines' `kv_events.py` classes declare them.
//!
//! One model for the three engines: the union of vLLM 0.33's, SGLang 0.5.23's
//! and TensorRT-LLM's fields that the mocker can produce. [`crate::encode`]
//! writes each flavour's own subset, in its own field order and integer
//! signedness. Hashes are kept as 64 bits: vLLM publishes them unsigned,
//! SGLang and TensorRT-LLM as the same bits signed.

/// One event of a batch.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum KvCacheEvent {
    /// Blocks were cached.
    BlockStored(BlockStored),
    /// Blocks were evicted.
    BlockRemoved(BlockRemoved),
    /// The whole prefix cache was dropped (`reset_prefix_cache`).
    AllBlocksCleared,
}

/// `BlockStored`: a run of newly cached blocks, each the parent of the next.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct BlockStored {
    /// One engine hash per block, in chain order (bits; SGLang writes them signed).
    pub block_hashes: Vec<u64>,
    /// The hash of the block before the first one; `None` when the chain starts here.
    pub parent_block_hash: Option<u64>,
    /// `block_hashes.len() * block_size` token ids (SGLang multimodal pads exceed `u32`).
    pub token_ids: Vec<u64>,
    /// Tokens per block.
    pub block_size: u32,
    /// Deprecated adapter id (always present on the wire, usually nil).
    pub lora_id: Option<i64>,
    /// Where the blocks live (`"GPU"` for the mocker).
    pub medium: Option<String>,
    /// Adapter name (vLLM always writes the key; SGLang only when set).
    pub lora_name: Option<String>,
    /// vLLM only: one entry per block, `None` for a block without extra keys.
    pub extra_keys: Option<Vec<Option<Vec<ExtraKey>>>>,
    /// SGLang only: the request's cache salt.
    pub cache_salt: Option<String>,
    /// The request's session id (vLLM and SGLang, optional).
    pub session_id: Option<String>,
    /// TensorRT-LLM only, for stores with images: `mm_keys` and digest tokens.
    pub trtllm_images: Option<Box<TrtllmImages>>,
}

/// How a TensorRT-LLM store names its images.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct TrtllmImages {
    /// One list per block of the images it overlaps (`mm_keys`).
    pub mm_keys: Vec<Vec<MmKey>>,
    /// Positions in `token_ids` written as an image's digest (64 hex digits)
    /// instead of the id kept there.
    pub digest_tokens: Vec<(usize, String)>,
}

/// One TensorRT-LLM `mm_key`: an image a block overlaps.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct MmKey {
    /// The image's digest, 64 hex digits.
    pub hash: String,
    /// The item-local position of the image's first position in the block.
    pub start_offset: u64,
    /// The client's name for the image, when it gave one.
    pub uuid: Option<String>,
}

/// One untagged item of a vLLM `extra_keys` entry.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum ExtraKey {
    /// A LoRA name or cache salt.
    Str(String),
    /// `[mm_identifier, offset]`: a multimodal item overlapping the block.
    Mm {
        /// The item identifier (a hex digest).
        identifier: String,
        /// Item start − block start.
        offset: i64,
    },
}

/// `BlockRemoved`: evicted blocks.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct BlockRemoved {
    /// Engine hashes of the evicted blocks (vLLM: exactly one per event).
    pub block_hashes: Vec<u64>,
    /// Where they were evicted from (`"GPU"`).
    pub medium: Option<String>,
}

/// The medium of the mocker's only tier.
pub const MEDIUM_GPU: &str = "GPU";
