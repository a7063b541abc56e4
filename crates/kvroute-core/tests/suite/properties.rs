//! Property tests of the wire decoder against straightforward references.
//!
//! Events are described by small specs ([`StoredSpec`], [`EventSpec`]), written
//! as msgpack with `super::common::mp` in every shape the decoder accepts, and
//! the decoded events are compared with what the spec implies: token ids folded
//! by `fold_token_id`, local hashes from `hash::local_block_hashes`, engine
//! hashes unchanged whatever their encoding, `dropped_blocks` counting the hashes
//! that had no complete block of tokens. The properties:
//!
//! * a flat `BlockStored` of `u32` ids (0 and `u32::MAX` included), of wider ids,
//!   and of EAGLE bigram pairs decodes to the reference blocks;
//! * tagged arrays, tagged maps in any key order, and the three envelopes
//!   (`[ts, events]`, `[ts, events, rank]`, `{ts, events, attn_dp_rank}`)
//!   all decode to the same events;
//! * one corrupt but well-formed event among good ones is skipped with its own
//!   index and reason, and the good ones decode exactly as without it.
//!
//! Failure persistence is off (no regression files are written into the tree);
//! proptest prints the shrunk input of a failing case.

use super::common::mp;
use kvroute_core::event::{KvEvent, Tier};
use kvroute_core::hash::{local_block_hashes, namespace_seed};
use kvroute_core::rng::{mix, SplitMix64};
use kvroute_core::tokens::fold_token_id;
use kvroute_core::wire::{decode_batch, DecodedBatch, DecoderConfig, SkipReason, Skipped};
use proptest::prelude::*;
use proptest::sample::Index;
use proptest::test_runner::Config;

/// The size range of generated stored events.
#[derive(Debug, Clone, Copy)]
struct Shape {
    /// Block sizes are drawn from `1..=max_block_size`.
    max_block_size: u32,
    /// Complete blocks are drawn from `0..=max_complete` (`1..=` when decodable).
    max_complete: usize,
}

/// Single-event properties: block sizes up to 64, up to 6 complete blocks.
const LARGE: Shape = Shape {
    max_block_size: 64,
    max_complete: 6,
};

/// Multi-event properties, where the shape of each event matters less than
/// their mix (and generating hundreds of ids per event is slow in debug).
const SMALL: Shape = Shape {
    max_block_size: 16,
    max_complete: 3,
};

/// The runner configuration: default case count, no regression files.
fn config() -> Config {
    Config {
        failure_persistence: None,
        ..Config::default()
    }
}

// ---------------------------------------------------------------------------
// Specs
// ---------------------------------------------------------------------------

/// How an integer is written: msgpack lets one value take several widths.
#[derive(Debug, Clone, Copy)]
enum IntWidth {
    /// The smallest encoding (`mp::uint`).
    Minimal,
    /// Always `uint 64` (`0xcf`).
    U64,
    /// `int 64` (`0xd3`) when the value fits, else minimal.
    I64,
}

/// How an engine block hash is written.
#[derive(Debug, Clone, Copy)]
enum HashForm {
    /// An unsigned integer (vLLM).
    Unsigned,
    /// The same 64 bits as a signed `int 64` (SGLang).
    Signed,
    /// A `bin` digest whose last 8 bytes, big-endian, are the hash (vLLM, int hashes off).
    Digest(u8),
}

/// Where a stored event carries its cache salt.
#[derive(Debug, Clone, Copy)]
enum SaltPlace {
    /// A `cache_salt` key (SGLang, map events only).
    Key,
    /// A string in the first block's `extra_keys` entry (vLLM).
    ExtraKeys,
}

/// The `medium` field of an event.
#[derive(Debug, Clone, Copy)]
enum Medium {
    /// Not written at all (nil in the positional layout).
    Absent,
    /// Written as nil.
    Nil,
    /// Written as this string.
    Named(&'static str),
}

impl Medium {
    /// The tier the decoder must report.
    fn tier(self) -> Tier {
        match self {
            Medium::Absent | Medium::Nil | Medium::Named("") => Tier::Device,
            Medium::Named(name) => Tier::from_medium(name).expect("generated mediums are known"),
        }
    }
}

/// One `BlockStored` event.
#[derive(Debug, Clone)]
struct StoredSpec {
    /// The event's (and the worker's) block size.
    block_size: u32,
    /// Ids (flat) or pairs (bigram) the event sends: `complete * block_size + tail`.
    units: usize,
    /// `units + 1` ids with their encodings: a flat event sends the first
    /// `units`, a bigram event the pairs `(ids[i], ids[i + 1])` for `i < units`.
    ids: Vec<(u64, IntWidth)>,
    /// Whether token ids are EAGLE bigram pairs.
    bigram: bool,
    /// Engine hashes of the blocks, distinct, with their encodings.
    hashes: Vec<(u64, HashForm)>,
    /// The parent's engine hash, distinct from `hashes`.
    parent: Option<(u64, HashForm)>,
    /// The LoRA name; `Some("")` counts as absent.
    lora: Option<String>,
    /// When `lora` is `None`: write `lora_name: nil` rather than omit the key.
    lora_nil: bool,
    /// The cache salt; `Some("")` counts as absent.
    salt: Option<String>,
    /// Where the salt is written.
    salt_place: SaltPlace,
    /// The event's medium.
    medium: Medium,
}

impl StoredSpec {
    /// The LoRA name the decoder must report (and hash with).
    fn lora(&self) -> Option<&str> {
        self.lora.as_deref().filter(|s| !s.is_empty())
    }

    /// The salt the decoder must report (and hash with), absent inheritance.
    ///
    /// In `extra_keys` the salt rides on the first block's entry, so an event
    /// without blocks has nowhere to carry it.
    fn salt(&self) -> Option<&str> {
        match self.salt_place {
            SaltPlace::ExtraKeys if self.hashes.is_empty() => None,
            _ => self.salt.as_deref().filter(|s| !s.is_empty()),
        }
    }

    /// The folded ids a reference hashes: `units` of them, or `units + 1` for bigram
    /// (the pairs' first ids plus the last pair's second id).
    fn folded_window(&self) -> Vec<u32> {
        let n = self.units + usize::from(self.bigram);
        self.ids[..n]
            .iter()
            .map(|&(id, _)| fold_token_id(id))
            .collect()
    }
}

/// One event of a batch.
#[derive(Debug, Clone)]
enum EventSpec {
    /// Blocks stored.
    Stored(StoredSpec),
    /// Blocks removed.
    Removed {
        /// Engine hashes of the removed blocks (repeats allowed).
        hashes: Vec<(u64, HashForm)>,
        /// The tier they leave.
        medium: Medium,
    },
    /// The rank's cache was reset.
    Cleared,
}

/// How a batch's envelope is written.
#[derive(Debug, Clone, Copy)]
enum Envelope {
    /// `[ts, events]`: the decoder falls back to the registered rank.
    Pair,
    /// `[ts, events, rank]`.
    Triple(u32),
    /// `{ts, events, attn_dp_rank}`.
    Map(u32),
}

// ---------------------------------------------------------------------------
// Strategies
// ---------------------------------------------------------------------------

/// Token ids that fit in `u32`, the boundaries included.
fn u32_id() -> BoxedStrategy<u64> {
    prop_oneof![
        1 => Just(0u64),
        1 => Just(u64::from(u32::MAX)),
        3 => 0u64..128,
        2 => 128u64..=0xffff,
        4 => 0u64..=u64::from(u32::MAX),
    ]
    .boxed()
}

/// Token ids of any width: mostly `u32`, some above `u32::MAX`.
fn wide_id() -> BoxedStrategy<u64> {
    prop_oneof![
        3 => u32_id(),
        1 => Just(u64::from(u32::MAX) + 1),
        1 => Just(u64::MAX),
        3 => (u64::from(u32::MAX) + 1)..=u64::MAX,
    ]
    .boxed()
}

fn int_width() -> impl Strategy<Value = IntWidth> {
    prop_oneof![
        6 => Just(IntWidth::Minimal),
        1 => Just(IntWidth::U64),
        1 => Just(IntWidth::I64),
    ]
}

fn hash_form() -> impl Strategy<Value = HashForm> {
    prop_oneof![
        Just(HashForm::Unsigned),
        Just(HashForm::Signed),
        (0u8..=24).prop_map(HashForm::Digest),
    ]
}

/// An engine hash and how it is written.
type Hash = (u64, HashForm);

/// `count` distinct hashes plus an optional parent distinct from all of them.
fn hash_chain(count: usize) -> impl Strategy<Value = (Vec<Hash>, Option<Hash>)> {
    (
        any::<u64>(),
        prop::collection::vec(hash_form(), count.max(1)),
        prop::option::of(hash_form()),
    )
        .prop_map(move |(base, forms, parent)| {
            let hashes = (0..count)
                .map(|i| (mix(base.wrapping_add(i as u64)), forms[i]))
                .collect();
            (hashes, parent.map(|form| (mix(base.wrapping_sub(1)), form)))
        })
}

fn name() -> impl Strategy<Value = Option<String>> {
    prop_oneof![
        2 => Just(None),
        1 => Just(Some(String::new())),
        3 => "[a-z][a-z0-9:_-]{0,11}".prop_map(Some),
    ]
}

fn salt_place() -> impl Strategy<Value = SaltPlace> {
    prop_oneof![Just(SaltPlace::Key), Just(SaltPlace::ExtraKeys)]
}

fn medium() -> impl Strategy<Value = Medium> {
    prop_oneof![
        Just(Medium::Absent),
        Just(Medium::Nil),
        Just(Medium::Named("")),
        Just(Medium::Named("GPU")),
        Just(Medium::Named("gpu")),
        Just(Medium::Named("CPU")),
        Just(Medium::Named("CPU_PINNED")),
        Just(Medium::Named("DISK")),
        Just(Medium::Named("EXTERNAL")),
    ]
}

/// A stored event of `shape`: complete blocks and a partial tail.
///
/// `decodable` events have at least one complete block and no more hashes
/// than complete blocks; the others have 0..=complete+2 hashes, so some drop
/// blocks and some have too few tokens for any.
fn stored_spec(
    shape: Shape,
    ids: BoxedStrategy<u64>,
    bigram: BoxedStrategy<bool>,
    decodable: bool,
) -> impl Strategy<Value = StoredSpec> {
    let min_complete = usize::from(decodable);
    (
        1..=shape.max_block_size,
        min_complete..=shape.max_complete,
        any::<Index>(),
        any::<Index>(),
        bigram,
    )
        .prop_flat_map(move |(block_size, complete, tail, hashes, bigram)| {
            let units = complete * block_size as usize + tail.index(block_size as usize);
            let n_hashes = if decodable {
                1 + hashes.index(complete)
            } else {
                hashes.index(complete + 3)
            };
            (
                Just((block_size, units, bigram)),
                prop::collection::vec((ids.clone(), int_width()), units + 1),
                hash_chain(n_hashes),
                (name(), any::<bool>(), name(), salt_place()),
                medium(),
            )
        })
        .prop_map(
            |((block_size, units, bigram), ids, (hashes, parent), namespace, medium)| {
                let (lora, lora_nil, salt, salt_place) = namespace;
                StoredSpec {
                    block_size,
                    units,
                    ids,
                    bigram,
                    hashes,
                    parent,
                    lora,
                    lora_nil,
                    salt,
                    salt_place,
                    medium,
                }
            },
        )
}

/// A stored, removed or cleared event.
fn event_spec(decodable: bool) -> impl Strategy<Value = EventSpec> {
    prop_oneof![
        4 => stored_spec(SMALL, wide_id(), any::<bool>().boxed(), decodable)
            .prop_map(EventSpec::Stored),
        2 => (0usize..6)
            .prop_flat_map(hash_chain)
            .prop_flat_map(|(hashes, _)| (Just(hashes), medium()))
            .prop_map(|(hashes, medium)| EventSpec::Removed { hashes, medium }),
        1 => Just(EventSpec::Cleared),
    ]
}

/// Events of a batch; `links[i]` chains stored event `i` to the previous stored
/// event's last block, so that salt inheritance is exercised too.
fn event_batch(decodable: bool, max: usize) -> impl Strategy<Value = Vec<EventSpec>> {
    prop::collection::vec((event_spec(decodable), any::<bool>()), 1..=max).prop_map(|events| {
        let mut last_stored: Option<u64> = None;
        events
            .into_iter()
            .map(|(mut event, link)| {
                if let EventSpec::Stored(s) = &mut event {
                    if let (true, Some(parent)) = (link, last_stored) {
                        s.parent = Some((parent, HashForm::Unsigned));
                    }
                    if let Some(&(last, _)) = s.hashes.last() {
                        last_stored = Some(last);
                    }
                }
                event
            })
            .collect()
    })
}

// ---------------------------------------------------------------------------
// Writers
// ---------------------------------------------------------------------------

fn write_id(out: &mut Vec<u8>, id: u64, width: IntWidth) {
    match width {
        IntWidth::U64 => {
            out.push(0xcf);
            out.extend_from_slice(&id.to_be_bytes());
        }
        IntWidth::I64 if id <= i64::MAX as u64 => {
            out.push(0xd3);
            out.extend_from_slice(&id.to_be_bytes());
        }
        IntWidth::Minimal | IntWidth::I64 => mp::uint(out, id),
    }
}

fn write_hash(out: &mut Vec<u8>, (hash, form): (u64, HashForm)) {
    match form {
        HashForm::Unsigned => mp::uint(out, hash),
        HashForm::Signed => {
            out.push(0xd3);
            out.extend_from_slice(&hash.to_be_bytes());
        }
        HashForm::Digest(prefix) => {
            let mut digest: Vec<u8> = (0..prefix).map(|i| i.wrapping_mul(37) ^ 0x5a).collect();
            digest.extend_from_slice(&hash.to_be_bytes());
            mp::bin(out, &digest);
        }
    }
}

fn hash_array(hashes: &[(u64, HashForm)]) -> Vec<u8> {
    let mut out = Vec::new();
    mp::array(&mut out, hashes.len());
    for &h in hashes {
        write_hash(&mut out, h);
    }
    out
}

fn string(s: &str) -> Vec<u8> {
    let mut out = Vec::new();
    mp::str(&mut out, s);
    out
}

fn nil() -> Vec<u8> {
    vec![0xc0]
}

fn uint(v: u64) -> Vec<u8> {
    let mut out = Vec::new();
    mp::uint(&mut out, v);
    out
}

fn medium_value(m: Medium) -> Option<Vec<u8>> {
    match m {
        Medium::Absent => None,
        Medium::Nil => Some(nil()),
        Medium::Named(name) => Some(string(name)),
    }
}

/// The `token_ids` value: flat ids or bigram pairs.
fn token_ids(s: &StoredSpec) -> Vec<u8> {
    let mut out = Vec::new();
    mp::array(&mut out, s.units);
    for i in 0..s.units {
        let (id, width) = s.ids[i];
        if s.bigram {
            mp::array(&mut out, 2);
            write_id(&mut out, id, width);
            let (next, width) = s.ids[i + 1];
            write_id(&mut out, next, width);
        } else {
            write_id(&mut out, id, width);
        }
    }
    out
}

/// vLLM `extra_keys`: one entry per block, the LoRA name in each, the salt in the first.
fn extra_keys(s: &StoredSpec) -> Vec<u8> {
    let mut out = Vec::new();
    mp::array(&mut out, s.hashes.len());
    for b in 0..s.hashes.len() {
        let mut items: Vec<&str> = s.lora().into_iter().collect();
        if b == 0 {
            items.extend(s.salt.as_deref());
        }
        if items.is_empty() {
            mp::nil(&mut out);
        } else {
            mp::array(&mut out, items.len());
            for item in items {
                mp::str(&mut out, item);
            }
        }
    }
    out
}

/// The key/value entries of a stored event as a vLLM ≥ 0.24 map, in vLLM's key order.
fn stored_entries(s: &StoredSpec) -> Vec<(&'static str, Vec<u8>)> {
    let mut entries = vec![
        ("type", string("BlockStored")),
        ("block_hashes", hash_array(&s.hashes)),
        (
            "parent_block_hash",
            s.parent.map_or_else(nil, |p| {
                let mut out = Vec::new();
                write_hash(&mut out, p);
                out
            }),
        ),
        ("token_ids", token_ids(s)),
        ("block_size", uint(u64::from(s.block_size))),
        ("lora_id", nil()),
    ];
    if let Some(medium) = medium_value(s.medium) {
        entries.push(("medium", medium));
    }
    match (&s.lora, s.lora_nil) {
        (Some(lora), _) => entries.push(("lora_name", string(lora))),
        (None, true) => entries.push(("lora_name", nil())),
        (None, false) => {}
    }
    match s.salt_place {
        SaltPlace::ExtraKeys => entries.push(("extra_keys", extra_keys(s))),
        SaltPlace::Key => {
            if let Some(salt) = &s.salt {
                entries.push(("cache_salt", string(salt)));
            }
        }
    }
    entries.push(("group_idx", uint(0)));
    entries.push(("kv_cache_spec_kind", string("full_attention")));
    entries
}

fn event_entries(e: &EventSpec) -> Vec<(&'static str, Vec<u8>)> {
    match e {
        EventSpec::Stored(s) => stored_entries(s),
        EventSpec::Removed { hashes, medium } => {
            let mut entries = vec![
                ("type", string("BlockRemoved")),
                ("block_hashes", hash_array(hashes)),
            ];
            entries.extend(medium_value(*medium).map(|m| ("medium", m)));
            entries
        }
        EventSpec::Cleared => vec![("type", string("AllBlocksCleared"))],
    }
}

fn write_map(entries: &[(&str, Vec<u8>)]) -> Vec<u8> {
    let mut out = Vec::new();
    mp::map(&mut out, entries.len());
    for (key, value) in entries {
        mp::str(&mut out, key);
        out.extend_from_slice(value);
    }
    out
}

/// An event as a tagged map; with `shuffle`, its keys in a random order.
fn event_map(e: &EventSpec, shuffle: Option<&mut SplitMix64>) -> Vec<u8> {
    let mut entries = event_entries(e);
    if let Some(rng) = shuffle {
        for i in (1..entries.len()).rev() {
            let j = rng.below(i + 1);
            entries.swap(i, j);
        }
    }
    write_map(&entries)
}

/// An event as a tagged array (vLLM ≤ 0.23 positional layout).
///
/// Stored: `[type, hashes, parent, tokens, block_size, lora_id, medium, lora_name]`,
/// plus `extra_keys` when the salt travels there.
fn event_positional(e: &EventSpec) -> Vec<u8> {
    let mut out = Vec::new();
    match e {
        EventSpec::Stored(s) => {
            let with_extra = matches!(s.salt_place, SaltPlace::ExtraKeys);
            mp::array(&mut out, if with_extra { 9 } else { 8 });
            mp::str(&mut out, "BlockStored");
            out.extend_from_slice(&hash_array(&s.hashes));
            match s.parent {
                Some(p) => write_hash(&mut out, p),
                None => mp::nil(&mut out),
            }
            out.extend_from_slice(&token_ids(s));
            mp::uint(&mut out, u64::from(s.block_size));
            mp::nil(&mut out); // lora_id
            out.extend_from_slice(&medium_value(s.medium).unwrap_or_else(nil));
            match &s.lora {
                Some(lora) => mp::str(&mut out, lora),
                None => mp::nil(&mut out),
            }
            if with_extra {
                out.extend_from_slice(&extra_keys(s));
            }
        }
        EventSpec::Removed { hashes, medium } => {
            mp::array(&mut out, 3);
            mp::str(&mut out, "BlockRemoved");
            out.extend_from_slice(&hash_array(hashes));
            out.extend_from_slice(&medium_value(*medium).unwrap_or_else(nil));
        }
        EventSpec::Cleared => {
            mp::array(&mut out, 1);
            mp::str(&mut out, "AllBlocksCleared");
        }
    }
    out
}

/// A batch payload around already-encoded events.
fn batch(ts: f64, events: &[Vec<u8>], envelope: Envelope) -> Vec<u8> {
    let mut list = Vec::new();
    mp::array(&mut list, events.len());
    for e in events {
        list.extend_from_slice(e);
    }
    let mut out = Vec::new();
    match envelope {
        Envelope::Pair => {
            mp::array(&mut out, 2);
            mp::f64(&mut out, ts);
            out.extend_from_slice(&list);
        }
        Envelope::Triple(rank) => {
            mp::array(&mut out, 3);
            mp::f64(&mut out, ts);
            out.extend_from_slice(&list);
            mp::uint(&mut out, u64::from(rank));
        }
        Envelope::Map(rank) => {
            mp::map(&mut out, 3);
            mp::str(&mut out, "ts");
            mp::f64(&mut out, ts);
            mp::str(&mut out, "events");
            out.extend_from_slice(&list);
            mp::str(&mut out, "attn_dp_rank");
            mp::uint(&mut out, u64::from(rank));
        }
    }
    out
}

// ---------------------------------------------------------------------------
// Checks
// ---------------------------------------------------------------------------

/// The registered rank used by every decode here, distinct from generated ranks
/// often enough to notice a fallback.
const REGISTERED_RANK: u32 = 4_000_000_007;

fn decode(payload: &[u8], block_size: Option<u32>) -> Result<DecodedBatch, TestCaseError> {
    let config = DecoderConfig {
        block_size,
        registered_rank: REGISTERED_RANK,
        keep_tokens: true,
        ..Default::default()
    };
    decode_batch(payload, &config).map_err(|e| TestCaseError::fail(format!("envelope: {e}")))
}

/// Checks one decoded stored event against its spec (with no inherited salt).
fn check_stored(s: &StoredSpec, outcome: &Result<KvEvent, Skipped>) -> Result<(), TestCaseError> {
    let bs = s.block_size as usize;
    let lookahead = usize::from(s.bigram);
    let window = s.folded_window();
    let complete = s.units / bs;
    let kept = s.hashes.len().min(complete);
    if kept == 0 && !s.hashes.is_empty() {
        let reason = outcome.as_ref().err().map(|skipped| skipped.reason);
        prop_assert_eq!(reason, Some(SkipReason::TooFewTokens), "{:?}", outcome);
        return Ok(());
    }
    let stored = match outcome {
        Ok(KvEvent::Stored(stored)) => stored,
        other => {
            return Err(TestCaseError::fail(format!(
                "not a stored event: {other:?}"
            )))
        }
    };
    let seed = namespace_seed(s.lora(), s.salt());
    let reference = local_block_hashes(&window, bs, seed, lookahead);
    prop_assert_eq!(reference.len(), complete, "reference block count");

    let externals: Vec<u64> = stored.blocks.iter().map(|b| b.external.0).collect();
    let expected_externals: Vec<u64> = s.hashes[..kept].iter().map(|h| h.0).collect();
    prop_assert_eq!(externals, expected_externals, "engine hashes");
    let locals: Vec<_> = stored.blocks.iter().map(|b| b.local).collect();
    prop_assert_eq!(&locals[..], &reference[..kept], "local hashes");
    let expected_tokens = if kept == 0 {
        &window[..0]
    } else {
        &window[..kept * bs + lookahead]
    };
    prop_assert_eq!(stored.token_ids.as_deref(), Some(expected_tokens), "tokens");
    prop_assert_eq!(stored.dropped_blocks as usize, s.hashes.len() - kept);
    prop_assert_eq!(stored.parent.map(|p| p.0), s.parent.map(|p| p.0));
    prop_assert_eq!(stored.tier, s.medium.tier());
    prop_assert_eq!(stored.lora_name.as_deref(), s.lora());
    prop_assert_eq!(stored.cache_salt.as_deref(), s.salt());
    let expected_lookahead = u32::from(s.bigram && s.units > 0);
    prop_assert_eq!(stored.lookahead, expected_lookahead);
    Ok(())
}

/// Encodes one stored event as a vLLM map in `[ts, [event], rank]` and checks the decode.
fn check_single_stored(s: &StoredSpec, rank: u32) -> Result<(), TestCaseError> {
    let ts = 1_767_225_600.25;
    let event = write_map(&stored_entries(s));
    let payload = batch(ts, &[event], Envelope::Triple(rank));
    let decoded = decode(&payload, Some(s.block_size))?;
    prop_assert_eq!(decoded.ts, Some(ts));
    prop_assert_eq!(decoded.dp_rank, rank);
    prop_assert_eq!(decoded.lost_events, 0);
    prop_assert_eq!(decoded.events.len(), 1);
    prop_assert_eq!(decoded.events[0].index, 0);
    check_stored(s, &decoded.events[0].outcome)
}

/// One corruption of an otherwise decodable flat stored event.
#[derive(Debug, Clone)]
enum Corruption {
    /// A token id inside a kept block is a negative integer.
    NegativeToken(i64, Index),
    /// One engine hash is a string.
    StringHash(Index),
    /// `block_size` is missing.
    MissingBlockSize,
    /// A token id inside a kept block is a float.
    FloatToken(f64, Index),
    /// `medium` is not a string (an integer, a bool or an array).
    WrongTypeMedium(u8),
    /// The type tag names no known event.
    UnknownType(String),
}

impl Corruption {
    fn reason(&self) -> SkipReason {
        match self {
            Corruption::MissingBlockSize => SkipReason::MissingField,
            Corruption::UnknownType(_) => SkipReason::UnknownType,
            _ => SkipReason::InvalidField,
        }
    }

    /// The corrupted event, as a vLLM map.
    fn apply(&self, s: &StoredSpec) -> Vec<u8> {
        let mut entries = stored_entries(s);
        let set = |entries: &mut Vec<(&'static str, Vec<u8>)>, key: &str, value: Vec<u8>| {
            let entry = entries
                .iter_mut()
                .find(|(k, _)| *k == key)
                .expect("the key is written");
            entry.1 = value;
        };
        // Kept blocks are the first `hashes.len()` (decodable specs have enough tokens).
        let kept_tokens = s.hashes.len() * s.block_size as usize;
        let tokens_with = |at: usize, write: &dyn Fn(&mut Vec<u8>)| {
            let mut out = Vec::new();
            mp::array(&mut out, s.units);
            for (i, &(id, width)) in s.ids[..s.units].iter().enumerate() {
                if i == at {
                    write(&mut out);
                } else {
                    write_id(&mut out, id, width);
                }
            }
            out
        };
        match self {
            Corruption::NegativeToken(v, at) => {
                let tokens = tokens_with(at.index(kept_tokens), &|out| mp::int64(out, *v));
                set(&mut entries, "token_ids", tokens);
            }
            Corruption::FloatToken(v, at) => {
                let tokens = tokens_with(at.index(kept_tokens), &|out| mp::f64(out, *v));
                set(&mut entries, "token_ids", tokens);
            }
            Corruption::StringHash(at) => {
                let bad = at.index(s.hashes.len());
                let mut out = Vec::new();
                mp::array(&mut out, s.hashes.len());
                for (i, &h) in s.hashes.iter().enumerate() {
                    if i == bad {
                        mp::str(&mut out, &h.0.to_string());
                    } else {
                        write_hash(&mut out, h);
                    }
                }
                set(&mut entries, "block_hashes", out);
            }
            Corruption::MissingBlockSize => entries.retain(|(k, _)| *k != "block_size"),
            Corruption::WrongTypeMedium(kind) => {
                let value = match kind % 3 {
                    0 => uint(u64::from(*kind)),
                    1 => vec![0xc3],
                    _ => {
                        let mut out = Vec::new();
                        mp::array(&mut out, 1);
                        mp::str(&mut out, "GPU");
                        out
                    }
                };
                entries.retain(|(k, _)| *k != "medium");
                entries.push(("medium", value));
            }
            Corruption::UnknownType(tag) => set(&mut entries, "type", string(tag)),
        }
        write_map(&entries)
    }
}

fn corruption() -> impl Strategy<Value = Corruption> {
    prop_oneof![
        (i64::MIN..0, any::<Index>()).prop_map(|(v, at)| Corruption::NegativeToken(v, at)),
        (any::<f64>(), any::<Index>()).prop_map(|(v, at)| Corruption::FloatToken(v, at)),
        any::<Index>().prop_map(Corruption::StringHash),
        Just(Corruption::MissingBlockSize),
        any::<u8>().prop_map(Corruption::WrongTypeMedium),
        "[A-Za-z]{0,16}"
            .prop_filter("an unknown tag", |t| {
                !matches!(
                    t.as_str(),
                    "BlockStored" | "BlockRemoved" | "AllBlocksCleared"
                )
            })
            .prop_map(Corruption::UnknownType),
    ]
}

/// Decodes `good` with and without the corrupted `base` inserted at `at` and
/// checks that only the corrupted event differs.
fn check_fault_isolation(
    good: &[EventSpec],
    base: &StoredSpec,
    corruption: &Corruption,
    at: Index,
    rank: u32,
) -> Result<(), TestCaseError> {
    let ts = 1_767_225_600.25;
    let clean_events: Vec<Vec<u8>> = good.iter().map(|e| event_map(e, None)).collect();
    let at = at.index(clean_events.len() + 1);
    let mut dirty_events = clean_events.clone();
    dirty_events.insert(at, corruption.apply(base));

    let clean = decode(&batch(ts, &clean_events, Envelope::Triple(rank)), None)?;
    let dirty = decode(&batch(ts, &dirty_events, Envelope::Triple(rank)), None)?;

    prop_assert_eq!(
        clean.skipped().count(),
        0,
        "good events decode: {:?}",
        clean
    );
    prop_assert_eq!(dirty.events.len(), good.len() + 1);
    prop_assert_eq!(dirty.decoded().count(), good.len());
    prop_assert_eq!(dirty.lost_events, 0);
    prop_assert_eq!(dirty.dp_rank, rank);
    let skipped: Vec<(u32, SkipReason)> = dirty.skipped().map(|(i, s)| (i, s.reason)).collect();
    prop_assert_eq!(skipped, vec![(at as u32, corruption.reason())]);
    let clean_decoded: Vec<&KvEvent> = clean.decoded().collect();
    let dirty_decoded: Vec<&KvEvent> = dirty.decoded().collect();
    prop_assert_eq!(clean_decoded, dirty_decoded);
    for (i, event) in dirty.events.iter().enumerate() {
        prop_assert_eq!(event.index as usize, i);
    }
    Ok(())
}

// ---------------------------------------------------------------------------
// Properties
// ---------------------------------------------------------------------------

proptest! {
    #![proptest_config(config())]

    /// Flat `u32` ids over the whole range: kept tokens are the complete-block
    /// prefix, local hashes match the reference, engine hashes round-trip, and
    /// hashes without a complete block are counted as dropped.
    #[test]
    fn any_u32_token_list_decodes_to_its_complete_blocks_and_reference_hashes(
        s in stored_spec(LARGE, u32_id(), Just(false).boxed(), false),
        rank in any::<u32>(),
    ) {
        check_single_stored(&s, rank)?;
    }

    /// Ids above `u32::MAX` mixed in: kept tokens are the folded ids and local
    /// hashes are the reference over the folded ids.
    #[test]
    fn wide_token_ids_decode_folded_and_hash_like_the_reference(
        s in stored_spec(LARGE, wide_id(), Just(false).boxed(), false),
        rank in any::<u32>(),
    ) {
        check_single_stored(&s, rank)?;
    }

    /// EAGLE bigram pairs: each block hashes its pairs' first ids plus the last
    /// pair's second id, i.e. the reference with a one-token lookahead.
    #[test]
    fn bigram_pairs_hash_like_the_reference_with_one_token_lookahead(
        s in stored_spec(LARGE, wide_id(), Just(true).boxed(), false),
        rank in any::<u32>(),
    ) {
        check_single_stored(&s, rank)?;
    }

    /// Tagged arrays, tagged maps in vLLM's key order and in shuffled orders,
    /// each inside a 2-element, a 3-element and a map envelope: nine payloads,
    /// one list of decoded events.
    #[test]
    fn every_event_and_envelope_encoding_decodes_to_the_same_events(
        mut events in event_batch(false, 6),
        shuffle_seed in any::<u64>(),
        rank in any::<u32>(),
        ts in any::<u32>(),
    ) {
        // The positional layout has no `cache_salt` slot: carry salts in `extra_keys`.
        for event in &mut events {
            if let EventSpec::Stored(s) = event {
                s.salt_place = SaltPlace::ExtraKeys;
            }
        }
        let ts = f64::from(ts) + 0.5;
        let mut rng = SplitMix64::new(shuffle_seed | 1);
        let encodings: [Vec<Vec<u8>>; 3] = [
            events.iter().map(|e| event_map(e, None)).collect(),
            events.iter().map(|e| event_map(e, Some(&mut rng))).collect(),
            events.iter().map(event_positional).collect(),
        ];
        let mut reference = None;
        for (shape, encoded) in encodings.iter().enumerate() {
            for envelope in [Envelope::Pair, Envelope::Triple(rank), Envelope::Map(rank)] {
                let decoded = decode(&batch(ts, encoded, envelope), None)?;
                let expected_rank = match envelope {
                    Envelope::Pair => REGISTERED_RANK,
                    Envelope::Triple(r) | Envelope::Map(r) => r,
                };
                prop_assert_eq!(decoded.dp_rank, expected_rank, "{:?}", envelope);
                prop_assert_eq!(decoded.ts, Some(ts));
                prop_assert_eq!(decoded.lost_events, 0);
                prop_assert_eq!(decoded.events.len(), events.len());
                match &reference {
                    None => reference = Some(decoded.events),
                    Some(first) => prop_assert_eq!(
                        first, &decoded.events, "shape {} in {:?}", shape, envelope
                    ),
                }
            }
        }
        // Stored events without a parent inherit no salt: check them against the spec too.
        let first = reference.expect("nine decodes");
        for (spec, decoded) in events.iter().zip(&first) {
            if let EventSpec::Stored(s) = spec {
                if s.parent.is_none() || s.salt().is_some() {
                    check_stored(s, &decoded.outcome)?;
                }
            }
        }
    }

    /// One corrupt but well-formed event at any position (a negative or a float
    /// token id inside a kept block, a string hash, no `block_size`, a medium
    /// that is not a string, an unknown type) is skipped with its index and
    /// reason; the N good events decode exactly as without it.
    #[test]
    fn a_corrupt_event_is_skipped_alone_and_the_rest_decode_as_without_it(
        good in event_batch(true, 8),
        base in stored_spec(SMALL, u32_id(), Just(false).boxed(), true),
        corruption in corruption(),
        at in any::<Index>(),
        rank in any::<u32>(),
    ) {
        check_fault_isolation(&good, &base, &corruption, at, rank)?;
    }
}

/// Regression (found by the fault-isolation property, fixed in 8faaf36): an
/// event that fails half-way through a block must leave nothing in the
/// decoder's reused `BlockHasher`, on any early return of the hashing loop,
/// whether the next stored event is in the same batch or in the next batch of
/// a reused `StreamDecoder`.
///
/// Before the fix, event 0 of `[0, [bad, good]]` with `bad` =
/// `{"type": "BlockStored", "block_hashes": [1], "token_ids": [5, -1], "block_size": 2}`
/// left token 5 behind, and `good` (`[7]`, block size 1) hashed `[5, 7]`.
/// `{"type": "BlockStored", "block_hashes": [hash], "token_ids": tokens,
/// "block_size": bs}` plus any extra entries.
fn stored(hash: u64, tokens: &dyn Fn(&mut Vec<u8>), bs: u64, extra: &[(&str, Vec<u8>)]) -> Vec<u8> {
    let mut out = Vec::new();
    mp::map(&mut out, 4 + extra.len());
    mp::str(&mut out, "type");
    mp::str(&mut out, "BlockStored");
    mp::str(&mut out, "block_hashes");
    mp::uints(&mut out, &[hash]);
    mp::str(&mut out, "token_ids");
    tokens(&mut out);
    mp::str(&mut out, "block_size");
    mp::uint(&mut out, bs);
    for (key, value) in extra {
        mp::str(&mut out, key);
        out.extend_from_slice(value);
    }
    out
}

/// Stored events that fail half-way through a block, each with what is wrong.
fn events_failing_mid_block() -> [(&'static str, Vec<u8>); 4] {
    let pairs = |pairs: &[(i64, i64)]| {
        let pairs = pairs.to_vec();
        move |out: &mut Vec<u8>| {
            mp::array(out, pairs.len());
            for &(a, b) in &pairs {
                mp::array(out, 2);
                mp::int64(out, a);
                mp::int64(out, b);
            }
        }
    };
    [
        (
            "a negative id after a good one",
            stored(
                1,
                &|out| {
                    mp::array(out, 2);
                    mp::int64(out, 5);
                    mp::int64(out, -1);
                },
                2,
                &[],
            ),
        ),
        (
            "a bigram pair of one id after a good pair",
            stored(
                1,
                &|out| {
                    mp::array(out, 2);
                    mp::uints(out, &[5, 6]);
                    mp::uints(out, &[6]);
                },
                2,
                &[],
            ),
        ),
        (
            "a negative second id in a block's last pair",
            stored(1, &pairs(&[(5, 6), (6, -1)]), 2, &[]),
        ),
        (
            "a lookahead list shorter than the blocks",
            stored(
                1,
                &|out| mp::uints(out, &[5]),
                1,
                &[("lookahead_token_ids", vec![0x90])],
            ),
        ),
    ]
}

#[test]
fn a_skipped_event_leaves_no_tokens_in_the_next_events_hash() {
    use kvroute_core::hash::{local_block_hash, HASH_SEED};
    use kvroute_core::wire::StreamDecoder;

    let bad_events = events_failing_mid_block();
    let good = stored(2, &|out| mp::uints(out, &[7]), 1, &[]);
    let expected = local_block_hash(&[7], HASH_SEED);
    let local_of_last = |batch: &DecodedBatch| match batch.decoded().last() {
        Some(KvEvent::Stored(s)) => s.blocks[0].local,
        other => panic!("expected a stored event, got {other:?}"),
    };

    for (case, bad) in bad_events {
        let one_batch = batch(0.0, &[bad.clone(), good.clone()], Envelope::Pair);
        let decoded = decode_batch(&one_batch, &DecoderConfig::default()).expect("valid envelope");
        let skipped: Vec<_> = decoded.skipped().map(|(i, s)| (i, s.reason)).collect();
        assert_eq!(skipped, [(0, SkipReason::InvalidField)], "{case}");
        assert_eq!(local_of_last(&decoded), expected, "{case}: same batch");

        let mut decoder = StreamDecoder::new(DecoderConfig::default());
        decoder
            .decode(&batch(0.0, &[bad], Envelope::Pair))
            .expect("valid envelope");
        let decoded = decoder
            .decode(&batch(0.0, std::slice::from_ref(&good), Envelope::Pair))
            .expect("valid envelope");
        assert_eq!(
            local_of_last(&decoded),
            expected,
            "{case}: next batch, reused decoder"
        );
    }
}
