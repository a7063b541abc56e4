//! Hand-built payloads for the cases the golden samples do not cover: the u32
//! boundary, bad events among good ones, every envelope shape, hash encodings,
//! filters, and envelope errors.

use super::common::mp;
use kvroute_core::event::{ExternalHash, KvEvent, Stored, Tier};
use kvroute_core::hash::{local_block_hashes, namespace_seed, HASH_SEED};
use kvroute_core::tokens::fold_token_id;
use kvroute_core::wire::{
    decode_batch, DecodedBatch, DecoderConfig, EnvelopeError, SkipReason, StreamDecoder,
};

/// Writes one msgpack value.
type Writer<'a> = &'a dyn Fn(&mut Vec<u8>);

fn config(block_size: u32) -> DecoderConfig {
    DecoderConfig {
        block_size: Some(block_size),
        keep_tokens: true,
        ..Default::default()
    }
}

/// A map `BlockStored` with the given extra entries after the required ones.
fn stored_map(
    out: &mut Vec<u8>,
    hashes: &[u64],
    parent: Option<u64>,
    tokens: &[u64],
    block_size: u64,
    extra: &[(&str, Writer<'_>)],
) {
    mp::map(out, 5 + extra.len());
    mp::str(out, "type");
    mp::str(out, "BlockStored");
    mp::str(out, "block_hashes");
    mp::uints(out, hashes);
    mp::str(out, "parent_block_hash");
    match parent {
        Some(p) => mp::uint(out, p),
        None => mp::nil(out),
    }
    mp::str(out, "token_ids");
    mp::uints(out, tokens);
    mp::str(out, "block_size");
    mp::uint(out, block_size);
    for (key, write) in extra {
        mp::str(out, key);
        write(out);
    }
}

fn removed_map(out: &mut Vec<u8>, hashes: &[u64]) {
    mp::map(out, 2);
    mp::str(out, "type");
    mp::str(out, "BlockRemoved");
    mp::str(out, "block_hashes");
    mp::uints(out, hashes);
}

/// `[ts, [events...], rank]` around pre-encoded events.
fn batch(events: &[Vec<u8>], rank: Option<u64>) -> Vec<u8> {
    let mut out = Vec::new();
    mp::array(&mut out, 3);
    mp::f64(&mut out, 1.5);
    mp::array(&mut out, events.len());
    for e in events {
        out.extend_from_slice(e);
    }
    match rank {
        Some(r) => mp::uint(&mut out, r),
        None => mp::nil(&mut out),
    }
    out
}

fn one_stored(hashes: &[u64], tokens: &[u64], block_size: u64) -> Vec<u8> {
    let mut e = Vec::new();
    stored_map(&mut e, hashes, None, tokens, block_size, &[]);
    e
}

fn stored(batch: &DecodedBatch, i: usize) -> &Stored {
    match &batch.events[i].outcome {
        Ok(KvEvent::Stored(s)) => s,
        other => panic!("event {i} is {other:?}"),
    }
}

fn skip_reason(batch: &DecodedBatch, i: usize) -> SkipReason {
    match &batch.events[i].outcome {
        Err(s) => s.reason,
        other => panic!("event {i} decoded: {other:?}"),
    }
}

fn locals(s: &Stored) -> Vec<u64> {
    s.blocks.iter().map(|b| b.local.0).collect()
}

fn reference(tokens: &[u32], bs: usize, lookahead: usize) -> Vec<u64> {
    local_block_hashes(tokens, bs, HASH_SEED, lookahead)
        .iter()
        .map(|h| h.0)
        .collect()
}

#[test]
fn ids_on_both_sides_of_the_u32_boundary_fold_exactly() {
    let wide = [
        u32::MAX as u64,
        u32::MAX as u64 + 1,
        (1 << 62) + 1_000_000,
        7,
    ];
    let payload = batch(&[one_stored(&[1], &wide, 4)], Some(0));
    let b = decode_batch(&payload, &config(4)).expect("envelope");
    let s = stored(&b, 0);
    let folded = [u32::MAX, 1_000_000, 2_000_000, 7];
    assert_eq!(s.token_ids.as_deref(), Some(&folded[..]));
    assert_eq!(locals(s), reference(&folded, 4, 0));
}

#[test]
fn u32_ids_hash_byte_identically_to_the_unfolded_computation() {
    let tokens: Vec<u64> = vec![
        0,
        1,
        127,
        128,
        255,
        256,
        65535,
        65536,
        151655,
        u32::MAX as u64,
        3,
        9,
    ];
    let payload = batch(&[one_stored(&[10, 11, 12], &tokens, 4)], Some(0));
    let b = decode_batch(&payload, &config(4)).expect("envelope");
    let raw: Vec<u32> = tokens.iter().map(|&t| t as u32).collect();
    assert_eq!(locals(stored(&b, 0)), reference(&raw, 4, 0));
}

#[test]
fn a_wide_id_inside_a_bigram_is_folded() {
    // Raw ids 1, W, 3, 4, 5 as pairs (1,W), (W,3), (3,4), (4,5); block size 4 pairs.
    let w = (1u64 << 62) + 1_000_123;
    let raw = [1, w, 3, 4, 5];
    let mut e = Vec::new();
    mp::map(&mut e, 4);
    mp::str(&mut e, "type");
    mp::str(&mut e, "BlockStored");
    mp::str(&mut e, "block_hashes");
    mp::uints(&mut e, &[42]);
    mp::str(&mut e, "token_ids");
    mp::array(&mut e, 4);
    for pair in raw.windows(2) {
        mp::uints(&mut e, pair);
    }
    mp::str(&mut e, "block_size");
    mp::uint(&mut e, 4);
    let b = decode_batch(&batch(&[e], None), &config(4)).expect("envelope");
    let s = stored(&b, 0);
    let folded: Vec<u32> = raw.iter().map(|&t| fold_token_id(t)).collect();
    assert_eq!(s.token_ids.as_deref(), Some(&folded[..]));
    assert_eq!(s.lookahead, 1);
    assert_eq!(locals(s), reference(&folded, 4, 1));
}

#[test]
fn one_bad_event_between_two_good_ones_costs_only_itself() {
    let good1 = one_stored(&[1], &[1, 2, 3, 4], 4);
    let mut bad = Vec::new();
    // A negative token id.
    mp::map(&mut bad, 4);
    mp::str(&mut bad, "type");
    mp::str(&mut bad, "BlockStored");
    mp::str(&mut bad, "block_hashes");
    mp::uints(&mut bad, &[2]);
    mp::str(&mut bad, "token_ids");
    mp::array(&mut bad, 4);
    for t in [5i64, -6, 7, 8] {
        mp::int64(&mut bad, t);
    }
    mp::str(&mut bad, "block_size");
    mp::uint(&mut bad, 4);
    let mut good2 = Vec::new();
    removed_map(&mut good2, &[1]);
    let b = decode_batch(&batch(&[good1, bad, good2], Some(3)), &config(4)).expect("envelope");
    assert_eq!(b.dp_rank, 3);
    assert_eq!(b.events.len(), 3);
    assert_eq!(locals(stored(&b, 0)), reference(&[1, 2, 3, 4], 4, 0));
    assert_eq!(skip_reason(&b, 1), SkipReason::InvalidField);
    let detail = &b.events[1].outcome.as_ref().expect_err("skipped").detail;
    assert!(detail.contains("token_ids[1]"), "{detail}");
    assert_eq!(
        b.events[2].outcome,
        Ok(KvEvent::Removed(kvroute_core::event::Removed {
            blocks: vec![ExternalHash(1)],
            tier: Tier::Device
        }))
    );
    assert_eq!(b.skipped().count(), 1);
}

#[test]
fn map_and_two_element_envelopes_give_the_same_events() {
    let event = one_stored(&[5, 6], &[1, 2, 3, 4, 5, 6, 7, 8], 4);
    let three =
        decode_batch(&batch(std::slice::from_ref(&event), Some(2)), &config(4)).expect("3-element");

    let mut two = Vec::new();
    mp::array(&mut two, 2);
    mp::f64(&mut two, 1.5);
    mp::array(&mut two, 1);
    two.extend_from_slice(&event);
    let two = decode_batch(
        &two,
        &DecoderConfig {
            registered_rank: 2,
            ..config(4)
        },
    )
    .expect("2-element");

    let mut map = Vec::new();
    mp::map(&mut map, 3);
    mp::str(&mut map, "attn_dp_rank");
    mp::uint(&mut map, 2);
    mp::str(&mut map, "events");
    mp::array(&mut map, 1);
    map.extend_from_slice(&event);
    mp::str(&mut map, "ts");
    mp::f64(&mut map, 1.5);
    let map = decode_batch(&map, &config(4)).expect("map");

    assert_eq!(three, two);
    assert_eq!(three, map);
    assert_eq!(map.dp_rank, 2);
}

#[test]
fn trailing_fields_are_ignored_everywhere() {
    // Array event with slots past the known ones, envelope with a 4th element.
    let mut e = Vec::new();
    mp::array(&mut e, 16);
    mp::str(&mut e, "BlockStored");
    mp::uints(&mut e, &[9]);
    mp::nil(&mut e);
    mp::uints(&mut e, &[1, 2, 3, 4]);
    mp::uint(&mut e, 4);
    mp::nil(&mut e); // lora_id
    mp::str(&mut e, "CPU"); // medium
    mp::nil(&mut e); // lora_name
    mp::nil(&mut e); // extra_keys
    mp::uint(&mut e, 0); // group_idx
    mp::str(&mut e, "full_attention");
    mp::nil(&mut e); // sliding window
    mp::nil(&mut e); // locality
    mp::nil(&mut e); // ownership
    mp::str(&mut e, "future field");
    mp::uints(&mut e, &[1, 2, 3]);
    let mut payload = Vec::new();
    mp::array(&mut payload, 4);
    mp::f64(&mut payload, 1.0);
    mp::array(&mut payload, 1);
    payload.extend_from_slice(&e);
    mp::uint(&mut payload, 1);
    mp::str(&mut payload, "extra");
    let b = decode_batch(&payload, &config(4)).expect("envelope");
    let s = stored(&b, 0);
    assert_eq!(s.tier, Tier::Host);
    assert_eq!(b.dp_rank, 1);
    // Unknown keys in a map event are skipped too.
    let mut m = Vec::new();
    stored_map(
        &mut m,
        &[9],
        None,
        &[1, 2, 3, 4],
        4,
        &[
            ("session_id", &|o: &mut Vec<u8>| mp::str(o, "s")),
            ("future", &|o: &mut Vec<u8>| mp::uints(o, &[1, 2])),
        ],
    );
    let b2 = decode_batch(&batch(&[m], Some(1)), &config(4)).expect("envelope");
    assert_eq!(locals(stored(&b2, 0)), locals(s));
}

#[test]
fn hashes_decode_from_unsigned_negative_and_bin() {
    let mut e = Vec::new();
    mp::map(&mut e, 5);
    mp::str(&mut e, "type");
    mp::str(&mut e, "BlockStored");
    mp::str(&mut e, "block_hashes");
    mp::array(&mut e, 4);
    mp::uint(&mut e, u64::MAX - 1);
    mp::int64(&mut e, -3488128144981237669);
    let digest32: Vec<u8> = (0u8..32).collect();
    mp::bin(&mut e, &digest32);
    let digest16: Vec<u8> = (100u8..116).collect();
    mp::bin(&mut e, &digest16);
    mp::str(&mut e, "parent_block_hash");
    mp::int64(&mut e, -1);
    mp::str(&mut e, "token_ids");
    mp::uints(&mut e, &(0..16).collect::<Vec<u64>>());
    mp::str(&mut e, "block_size");
    mp::uint(&mut e, 4);
    let b = decode_batch(&batch(&[e], Some(0)), &config(4)).expect("envelope");
    let s = stored(&b, 0);
    let externals: Vec<u64> = s.blocks.iter().map(|b| b.external.0).collect();
    assert_eq!(
        externals,
        [
            u64::MAX - 1,
            (-3488128144981237669i64) as u64,
            u64::from_be_bytes([24, 25, 26, 27, 28, 29, 30, 31]),
            u64::from_be_bytes([108, 109, 110, 111, 112, 113, 114, 115]),
        ]
    );
    assert_eq!(s.parent, Some(ExternalHash(u64::MAX)));
}

#[test]
fn unknown_types_are_skipped_and_counted() {
    let mut e = Vec::new();
    mp::map(&mut e, 1);
    mp::str(&mut e, "type");
    mp::str(&mut e, "BlockUpdated");
    let mut not_event = Vec::new();
    mp::uint(&mut not_event, 5);
    let b = decode_batch(
        &batch(&[e, not_event, one_stored(&[1], &[1, 2, 3, 4], 4)], None),
        &config(4),
    )
    .expect("envelope");
    assert_eq!(skip_reason(&b, 0), SkipReason::UnknownType);
    assert!(!SkipReason::UnknownType.is_error());
    assert_eq!(skip_reason(&b, 1), SkipReason::NotAnEvent);
    assert_eq!(b.decoded().count(), 1);
}

#[test]
fn empty_token_lists() {
    // No blocks at all: a harmless empty store.
    let b = decode_batch(&batch(&[one_stored(&[], &[], 4)], None), &config(4)).expect("envelope");
    assert!(stored(&b, 0).blocks.is_empty());
    // Blocks without tokens: skipped, not hashed from nothing.
    let b =
        decode_batch(&batch(&[one_stored(&[1, 2], &[], 4)], None), &config(4)).expect("envelope");
    assert_eq!(skip_reason(&b, 0), SkipReason::TooFewTokens);
}

#[test]
fn short_token_lists_keep_the_complete_blocks() {
    let b = decode_batch(
        &batch(&[one_stored(&[1, 2, 3], &[1, 2, 3, 4, 5, 6, 7], 4)], None),
        &config(4),
    )
    .expect("envelope");
    let s = stored(&b, 0);
    assert_eq!(s.blocks.len(), 1);
    assert_eq!(s.dropped_blocks, 2);
}

#[test]
fn a_block_size_mismatch_stops_the_event() {
    let b = decode_batch(
        &batch(&[one_stored(&[1], &[1, 2, 3, 4], 4)], None),
        &config(16),
    )
    .expect("envelope");
    assert_eq!(skip_reason(&b, 0), SkipReason::BlockSizeMismatch);
    // Without a configured block size the event's own is trusted.
    let b = decode_batch(
        &batch(&[one_stored(&[1], &[1, 2, 3, 4], 4)], None),
        &DecoderConfig::default(),
    )
    .expect("envelope");
    assert_eq!(stored(&b, 0).blocks.len(), 1);
}

#[test]
fn placement_filters_drop_what_is_not_this_workers_attention_cache() {
    let cases: [(&str, Writer<'_>, SkipReason); 5] = [
        ("medium", &|o| mp::str(o, "FS"), SkipReason::UnknownMedium),
        ("locality", &|o| mp::str(o, "PEER"), SkipReason::NonLocal),
        (
            "ownership",
            &|o| mp::str(o, "kvcr"),
            SkipReason::ForeignOwnership,
        ),
        (
            "kv_cache_spec_kind",
            &|o| mp::str(o, "cross_attention"),
            SkipReason::NonAttentionGroup,
        ),
        ("group_idx", &|o| mp::uint(o, 3), SkipReason::UnlearnedGroup),
    ];
    for (key, value, reason) in cases {
        let mut e = Vec::new();
        stored_map(&mut e, &[1], None, &[1, 2, 3, 4], 4, &[(key, value)]);
        let b = decode_batch(&batch(&[e], None), &config(4)).expect("envelope");
        assert_eq!(skip_reason(&b, 0), reason, "{key}");
    }
    // A group learned as attention passes later without its kind.
    let mut decoder = StreamDecoder::new(config(4));
    let mut learn = Vec::new();
    stored_map(
        &mut learn,
        &[1],
        None,
        &[1, 2, 3, 4],
        4,
        &[
            ("group_idx", &|o| mp::uint(o, 2)),
            ("kv_cache_spec_kind", &|o| mp::str(o, "full_attention")),
        ],
    );
    let mut later = Vec::new();
    stored_map(
        &mut later,
        &[2],
        Some(1),
        &[5, 6, 7, 8],
        4,
        &[("group_idx", &|o| mp::uint(o, 2))],
    );
    let b = decoder
        .decode(&batch(&[learn, later], None))
        .expect("envelope");
    assert_eq!(b.decoded().count(), 2);
}

#[test]
fn a_store_that_repeats_a_hash_or_names_its_parent_is_rejected() {
    let b = decode_batch(
        &batch(&[one_stored(&[1, 1], &[1, 2, 3, 4, 5, 6, 7, 8], 4)], None),
        &config(4),
    )
    .expect("envelope");
    assert_eq!(skip_reason(&b, 0), SkipReason::RepeatedHash);
    let mut e = Vec::new();
    stored_map(&mut e, &[1], Some(1), &[1, 2, 3, 4], 4, &[]);
    let b = decode_batch(&batch(&[e], None), &config(4)).expect("envelope");
    assert_eq!(skip_reason(&b, 0), SkipReason::RepeatedHash);
}

#[test]
fn a_vllm_child_store_inherits_its_parents_salt() {
    let lora = |o: &mut Vec<u8>| mp::nil(o);
    let salted_keys = |o: &mut Vec<u8>| {
        mp::array(o, 1);
        mp::array(o, 1);
        mp::str(o, "tenant-a");
    };
    let mut first = Vec::new();
    stored_map(
        &mut first,
        &[100],
        None,
        &[1, 2, 3, 4],
        4,
        &[("lora_name", &lora), ("extra_keys", &salted_keys)],
    );
    let mut child = Vec::new();
    stored_map(
        &mut child,
        &[101],
        Some(100),
        &[5, 6, 7, 8],
        4,
        &[("extra_keys", &|o: &mut Vec<u8>| {
            mp::array(o, 1);
            mp::nil(o);
        })],
    );
    let mut decoder = StreamDecoder::new(config(4));
    let b = decoder
        .decode(&batch(&[first, child.clone()], None))
        .expect("envelope");
    let seed = namespace_seed(None, Some("tenant-a"));
    let expected: Vec<u64> = local_block_hashes(&[1, 2, 3, 4, 5, 6, 7, 8], 4, seed, 0)
        .iter()
        .map(|h| h.0)
        .collect();
    assert_eq!(locals(stored(&b, 0)), expected[..1]);
    assert_eq!(locals(stored(&b, 1)), expected[1..]);
    assert_eq!(stored(&b, 1).cache_salt.as_deref(), Some("tenant-a"));
    // Once the parent is removed the child can no longer inherit.
    let mut remove = Vec::new();
    removed_map(&mut remove, &[100, 101]);
    decoder.decode(&batch(&[remove], None)).expect("envelope");
    let b = decoder.decode(&batch(&[child], None)).expect("envelope");
    assert_eq!(stored(&b, 0).cache_salt, None);
}

#[test]
fn envelope_errors_are_clear() {
    let cfg = config(4);
    assert_eq!(decode_batch(&[], &cfg), Err(EnvelopeError::Empty));
    assert!(matches!(
        decode_batch(&[0x05], &cfg),
        Err(EnvelopeError::NotABatch { found: "integer" })
    ));
    assert!(matches!(
        decode_batch(&[0x91, 0x01], &cfg),
        Err(EnvelopeError::TooShort { len: 1 })
    ));
    assert!(matches!(
        decode_batch(&[0x92, 0x01, 0x02], &cfg),
        Err(EnvelopeError::EventsNotArray { .. })
    ));
    assert!(matches!(
        decode_batch(&[0x93, 0x01, 0x90, 0xff], &cfg),
        Err(EnvelopeError::BadRank { .. })
    ));
    assert!(matches!(
        decode_batch(&[0x81, 0xa2, b't', b's', 0x01], &cfg),
        Err(EnvelopeError::MissingEvents)
    ));
    let message = decode_batch(&[0x93, 0x01, 0x90, 0xa5], &cfg)
        .expect_err("cut")
        .to_string();
    assert!(message.contains("malformed"), "{message}");
}

#[test]
fn a_payload_cut_mid_event_keeps_the_events_before_it() {
    let good = one_stored(&[1], &[1, 2, 3, 4], 4);
    let good_len = good.len();
    let full = batch(&[good.clone(), good.clone(), good], Some(1));
    let cut = &full[..full.len() - 8];
    let b = decode_batch(cut, &config(4)).expect("envelope header is readable");
    assert_eq!(b.decoded().count(), 2);
    assert_eq!(skip_reason(&b, 2), SkipReason::Malformed);
    assert_eq!(b.lost_events, 0);
    // Cut inside the second event: the third is declared but unreachable.
    let cut = &full[..full.len() - 1 - good_len - 5];
    let b = decode_batch(cut, &config(4)).expect("envelope header is readable");
    assert_eq!(b.decoded().count(), 1);
    assert_eq!(b.lost_events, 1);
    // The rank sits after the events: with the batch cut it falls back to the registered one.
    assert_eq!(b.dp_rank, 0);
}

#[test]
fn a_bad_token_mid_block_does_not_leak_into_the_next_events_hashes() {
    let mut bad = Vec::new();
    mp::map(&mut bad, 4);
    mp::str(&mut bad, "type");
    mp::str(&mut bad, "BlockStored");
    mp::str(&mut bad, "block_hashes");
    mp::uints(&mut bad, &[1]);
    mp::str(&mut bad, "token_ids");
    mp::array(&mut bad, 4);
    mp::uint(&mut bad, 1);
    mp::uint(&mut bad, 2);
    mp::str(&mut bad, "three");
    mp::uint(&mut bad, 4);
    mp::str(&mut bad, "block_size");
    mp::uint(&mut bad, 4);
    let good = one_stored(&[2], &[5, 6, 7, 8], 4);
    let mut decoder = StreamDecoder::new(config(4));
    let b = decoder
        .decode(&batch(&[bad, good], None))
        .expect("envelope");
    assert_eq!(skip_reason(&b, 0), SkipReason::InvalidField);
    assert_eq!(locals(stored(&b, 1)), reference(&[5, 6, 7, 8], 4, 0));
}
