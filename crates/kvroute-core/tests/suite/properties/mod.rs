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

mod checks;
mod writers;

use checks::*;
use writers::*;

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
