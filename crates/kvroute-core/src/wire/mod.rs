//! The wire decoder: one engine payload in, normalized events out.
//!
//! Input is the msgpack payload frame of one ZeroMQ message (the third frame of
//! `[topic, seq, payload]`) from one worker's data-parallel rank. Output is a
//! [`DecodedBatch`]: the batch's rank and, for every event in it, either a
//! [`KvEvent`] or the reason it was skipped.
//!
//! What it accepts (see `docs/wire.md` for the slot tables):
//! * envelopes `[ts, events]`, `[ts, events, rank|nil, …]` and maps with `ts`,
//!   `events` and `data_parallel_rank` / `attn_dp_rank`;
//! * events as tagged maps (any key order, unknown keys skipped) and as tagged
//!   arrays (vLLM ≤ 0.23, SGLang ≤ 0.5.19; early end allowed, extras ignored);
//! * hashes as `uint64`, negative `int64` and `bin` digests;
//! * token ids of any width (folded by [`crate::tokens::fold_token_id`]),
//!   flat or as EAGLE bigram pairs, plus vLLM lookahead tokens.
//!
//! Fault isolation: every event is located by its msgpack markers before it is
//! interpreted, so an event with a wrong type, a negative token or a missing
//! field is skipped with its index and reason while the rest of the batch
//! decodes. Only an unreadable envelope fails the whole batch. Token ids are
//! hashed straight from the payload bytes: a stored event allocates only its
//! block list.

mod blocks;
mod event;
mod groups;
mod items;
mod msgpack;
mod normalize;
pub mod write;

use std::fmt;
use std::sync::Arc;

use rustc_hash::FxHashMap;

use crate::event::KvEvent;
use crate::hash::BlockHasher;
use msgpack::{Kind, ReadError, Reader};

/// How one worker rank's stream is decoded.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct DecoderConfig {
    /// The worker's block size; a stored event with another block size is skipped.
    /// `None` trusts each event's own `block_size` (for inspecting unknown streams).
    pub block_size: Option<u32>,
    /// The rank this stream was registered as; used when the batch carries none.
    pub registered_rank: u32,
    /// Also return each stored event's folded token ids (debugging only).
    pub keep_tokens: bool,
    /// How many salted blocks the decoder remembers so that a vLLM child store,
    /// which carries no salt of its own, inherits its parent's cache salt.
    pub max_salted_blocks: usize,
}

impl Default for DecoderConfig {
    fn default() -> Self {
        DecoderConfig {
            block_size: None,
            registered_rank: 0,
            keep_tokens: false,
            max_salted_blocks: 1 << 20,
        }
    }
}

/// The events of one payload, each decoded or skipped, in payload order.
#[derive(Debug, Clone, PartialEq)]
pub struct DecodedBatch {
    /// The batch timestamp (seconds since the epoch), when it is a number.
    pub ts: Option<f64>,
    /// The rank the events belong to: the batch's own rank, else the registered one.
    pub dp_rank: u32,
    /// Every event the envelope declares and the decoder could locate.
    pub events: Vec<DecodedEvent>,
    /// Events declared after a point where the payload was cut or corrupt, and so lost.
    pub lost_events: u32,
}

impl DecodedBatch {
    /// The events that decoded, in order.
    pub fn decoded(&self) -> impl Iterator<Item = &KvEvent> {
        self.events.iter().filter_map(|e| e.outcome.as_ref().ok())
    }

    /// The events that were skipped, with their index and reason.
    pub fn skipped(&self) -> impl Iterator<Item = (u32, &Skipped)> {
        self.events
            .iter()
            .filter_map(|e| e.outcome.as_ref().err().map(|s| (e.index, s)))
    }
}

/// One event of a batch.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct DecodedEvent {
    /// Position of the event in the batch, from 0.
    pub index: u32,
    /// The normalized event, or why it was skipped.
    pub outcome: Result<KvEvent, Skipped>,
}

/// Why an event was skipped, with the offending value.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Skipped {
    /// The reason, a bounded set usable as a metric label.
    pub reason: SkipReason,
    /// What exactly was wrong, for the log line.
    pub detail: String,
}

impl fmt::Display for Skipped {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}: {}", self.reason.as_str(), self.detail)
    }
}

/// Why an event was skipped.
///
/// Some reasons are bad input ([`SkipReason::is_error`]); the others are events
/// kvroute drops on purpose because they do not describe the worker's own
/// main-attention cache at the worker's block size.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum SkipReason {
    /// The payload was cut or corrupt inside this event.
    Malformed,
    /// The event is neither a map nor an array.
    NotAnEvent,
    /// A required field is absent.
    MissingField,
    /// A field has the wrong type or an impossible value.
    InvalidField,
    /// A stored event names the same block twice, or its own parent.
    RepeatedHash,
    /// An event type kvroute does not know.
    UnknownType,
    /// A `medium` kvroute cannot map to a tier.
    UnknownMedium,
    /// A block held somewhere other than on this worker (`locality` not `LOCAL`).
    NonLocal,
    /// A block owned by a secondary cache, not the engine's own (`ownership` set).
    ForeignOwnership,
    /// A KV-cache group that is not main attention (sliding window, Mamba, …).
    NonAttentionGroup,
    /// A non-zero `group_idx` whose kind has not been seen yet.
    UnlearnedGroup,
    /// A stored event whose block size differs from the worker's.
    BlockSizeMismatch,
    /// A stored event without enough token ids for even its first block.
    TooFewTokens,
    /// A store that names a block but describes none of its tokens (vLLM's
    /// offloading connector for groups it cannot describe: `block_size` 0,
    /// no token ids).
    Placeholder,
}

impl SkipReason {
    /// Stable snake_case name, for metric labels and JSON.
    pub fn as_str(self) -> &'static str {
        match self {
            SkipReason::Malformed => "malformed",
            SkipReason::NotAnEvent => "not_an_event",
            SkipReason::MissingField => "missing_field",
            SkipReason::InvalidField => "invalid_field",
            SkipReason::RepeatedHash => "repeated_hash",
            SkipReason::UnknownType => "unknown_type",
            SkipReason::UnknownMedium => "unknown_medium",
            SkipReason::NonLocal => "non_local",
            SkipReason::ForeignOwnership => "foreign_ownership",
            SkipReason::NonAttentionGroup => "non_attention_group",
            SkipReason::UnlearnedGroup => "unlearned_group",
            SkipReason::BlockSizeMismatch => "block_size_mismatch",
            SkipReason::TooFewTokens => "too_few_tokens",
            SkipReason::Placeholder => "placeholder",
        }
    }

    /// True for bad input (worth a warning); false for events dropped on purpose.
    pub fn is_error(self) -> bool {
        matches!(
            self,
            SkipReason::Malformed
                | SkipReason::NotAnEvent
                | SkipReason::MissingField
                | SkipReason::InvalidField
                | SkipReason::RepeatedHash
        )
    }
}

/// Why a whole payload could not be decoded.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum EnvelopeError {
    /// Zero bytes.
    #[error("empty payload")]
    Empty,
    /// The payload is not a msgpack array or map.
    #[error("payload is a msgpack {found}, not a batch array or map")]
    NotABatch {
        /// The msgpack type found.
        found: &'static str,
    },
    /// An array envelope with fewer than two elements.
    #[error("batch array has {len} element(s); expected [ts, events, dp_rank?]")]
    TooShort {
        /// Elements present.
        len: usize,
    },
    /// A map envelope without `events`.
    #[error("batch map has no `events` key")]
    MissingEvents,
    /// `events` is not an array.
    #[error("batch `events` is a msgpack {found}, not an array")]
    EventsNotArray {
        /// The msgpack type found.
        found: &'static str,
    },
    /// The rank field is neither nil nor a non-negative integer below 2^32.
    #[error("batch dp rank is invalid: {detail}")]
    BadRank {
        /// What was found.
        detail: String,
    },
    /// The envelope's own bytes are cut or corrupt.
    #[error("batch envelope is malformed: {detail}")]
    Malformed {
        /// Where and how.
        detail: String,
    },
}

/// Decodes one payload with a fresh decoder (no state carried from earlier batches).
pub fn decode_batch(payload: &[u8], config: &DecoderConfig) -> Result<DecodedBatch, EnvelopeError> {
    StreamDecoder::new(config.clone()).decode(payload)
}

/// Decodes the successive payloads of one worker rank's event stream.
///
/// Pure and synchronous. It keeps what a later event may need from an earlier
/// one: the cache salt of salted blocks (vLLM publishes the salt only on a
/// sequence's first block) and the kind learned for each KV-cache group. It
/// also reuses its scratch buffers, so steady-state decoding allocates only
/// the events it returns.
#[derive(Debug, Clone)]
pub struct StreamDecoder {
    config: DecoderConfig,
    hasher: BlockHasher,
    scratch: Scratch,
    memory: StreamMemory,
}

/// Reused buffers for one event at a time.
#[derive(Debug, Clone, Default)]
struct Scratch {
    /// (block, item hash) of every image key of the event, sorted, no repeats.
    items: Vec<(u32, u64)>,
    /// Item hashes named by digest tokens of the block being hashed.
    token_items: Vec<u64>,
    /// One block's item hashes, sorted.
    mm_block: Vec<u64>,
    /// (block, item hash) of what the event's local hashes covered, when tokens are kept.
    kept_items: Vec<(u32, u64)>,
    /// Hashes being checked for repeats.
    sorted_hashes: Vec<u64>,
}

/// What the decoder remembers across events of one stream.
#[derive(Debug, Clone, Default)]
struct StreamMemory {
    /// Salt of each salted block still cached, by engine hash.
    salts: FxHashMap<u64, Arc<str>>,
    /// What each KV-cache group index is to the router, as learned from events.
    group_class: FxHashMap<u32, groups::GroupClass>,
    /// TensorRT-LLM's `mm_token_id_offset`, once learned from a digest token.
    trtllm_mm_offset: Option<u64>,
}

impl StreamDecoder {
    /// A decoder for one stream.
    pub fn new(config: DecoderConfig) -> Self {
        StreamDecoder {
            config,
            hasher: BlockHasher::new(),
            scratch: Scratch::default(),
            memory: StreamMemory::default(),
        }
    }

    /// The configuration this decoder was built with.
    pub fn config(&self) -> &DecoderConfig {
        &self.config
    }

    /// Forgets what earlier batches taught (after an engine restart or a cleared rank).
    pub fn reset(&mut self) {
        self.memory = StreamMemory::default();
    }

    /// The block size events must declare (`None`: each event's own).
    pub fn block_size(&self) -> Option<u32> {
        self.config.block_size
    }

    /// Sets the block size events must declare, once it is known (a worker
    /// whose block size was not configured learns it from its stream).
    pub fn set_block_size(&mut self, block_size: Option<u32>) {
        self.config.block_size = block_size;
    }

    /// Decodes one payload.
    pub fn decode(&mut self, payload: &[u8]) -> Result<DecodedBatch, EnvelopeError> {
        let mut r = Reader::new(payload);
        match r.peek_kind() {
            Err(_) => Err(EnvelopeError::Empty),
            Ok(Kind::Array) => self.decode_array_envelope(&mut r),
            Ok(Kind::Map) => self.decode_map_envelope(&mut r),
            Ok(other) => Err(EnvelopeError::NotABatch {
                found: other.name(),
            }),
        }
    }

    fn decode_array_envelope(&mut self, r: &mut Reader<'_>) -> Result<DecodedBatch, EnvelopeError> {
        let len = r.read_array_len().map_err(malformed)?;
        if len < 2 {
            return Err(EnvelopeError::TooShort { len });
        }
        let ts = read_ts(r)?;
        let (mut batch, cut) = self.decode_events(r, ts)?;
        if len >= 3 && !cut {
            if let Some(rank) = read_rank(r)? {
                batch.dp_rank = rank;
            }
        }
        Ok(batch)
    }

    fn decode_map_envelope(&mut self, r: &mut Reader<'_>) -> Result<DecodedBatch, EnvelopeError> {
        let entries = r.read_map_len().map_err(malformed)?;
        let mut ts = None;
        let mut rank = None;
        let mut batch = None;
        for _ in 0..entries {
            let key = r.read_key().map_err(malformed)?;
            match key {
                Some("ts") => ts = read_ts(r)?,
                Some("events") => {
                    let (decoded, cut) = self.decode_events(r, None)?;
                    batch = Some(decoded);
                    if cut {
                        break;
                    }
                }
                Some("data_parallel_rank" | "attn_dp_rank" | "dp_rank") => {
                    rank = read_rank(r)?.or(rank)
                }
                _ => r.skip_value().map_err(malformed)?,
            }
        }
        let mut batch = batch.ok_or(EnvelopeError::MissingEvents)?;
        batch.ts = ts;
        if let Some(rank) = rank {
            batch.dp_rank = rank;
        }
        Ok(batch)
    }

    /// Decodes the `events` array at the reader and leaves the reader after it.
    /// Returns true as well when an event's bytes are cut or corrupt: the reader
    /// is then lost, and `lost_events` says how many declared events it missed.
    fn decode_events(
        &mut self,
        r: &mut Reader<'_>,
        ts: Option<f64>,
    ) -> Result<(DecodedBatch, bool), EnvelopeError> {
        let count = match r.read_array_len() {
            Ok(count) => count,
            Err(ReadError::Type { found, .. }) => {
                return Err(EnvelopeError::EventsNotArray {
                    found: found.name(),
                })
            }
            Err(e) => return Err(malformed(e)),
        };
        // Every event takes at least one byte: never reserve past the payload.
        let mut events = Vec::with_capacity(count.min(r.remaining()));
        let mut lost_events = 0;
        let mut cut = false;
        let mut fields = event::Fields::default();
        for index in 0..count {
            let index = u32::try_from(index).unwrap_or(u32::MAX);
            match event::gather(r, &mut fields) {
                Ok(()) => {
                    let outcome = self.normalize(&fields);
                    events.push(DecodedEvent { index, outcome });
                }
                Err(e) => {
                    let detail = format!("{e}; the rest of the batch cannot be located");
                    events.push(DecodedEvent {
                        index,
                        outcome: Err(Skipped {
                            reason: SkipReason::Malformed,
                            detail,
                        }),
                    });
                    lost_events = u32::try_from(count)
                        .unwrap_or(u32::MAX)
                        .saturating_sub(index + 1);
                    cut = true;
                    break;
                }
            }
        }
        let batch = DecodedBatch {
            ts,
            dp_rank: self.config.registered_rank,
            events,
            lost_events,
        };
        Ok((batch, cut))
    }
}

fn malformed(e: ReadError) -> EnvelopeError {
    EnvelopeError::Malformed {
        detail: e.to_string(),
    }
}

/// Reads the timestamp; a value that is not a number is skipped (kvroute never needs it).
fn read_ts(r: &mut Reader<'_>) -> Result<Option<f64>, EnvelopeError> {
    match r.read_f64() {
        Ok(ts) => Ok(Some(ts)),
        Err(e) if e.is_structural() => Err(malformed(e)),
        Err(_) => {
            r.skip_value().map_err(malformed)?;
            Ok(None)
        }
    }
}

/// Reads the rank: `None` for nil.
fn read_rank(r: &mut Reader<'_>) -> Result<Option<u32>, EnvelopeError> {
    if r.eat_nil() {
        return Ok(None);
    }
    let mut probe = r.clone();
    match probe.read_u32() {
        Ok(rank) => {
            *r = probe;
            Ok(Some(rank))
        }
        Err(e) if e.is_structural() => Err(malformed(e)),
        Err(e) => match r.skip_value() {
            // A wrong type whose own bytes are cut is a cut payload, not a bad rank.
            Err(cut) => Err(malformed(cut)),
            Ok(()) => Err(EnvelopeError::BadRank {
                detail: e.to_string(),
            }),
        },
    }
}
