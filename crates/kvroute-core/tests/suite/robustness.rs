//! Randomized robustness: mutated payloads never make the decoder panic.
//!
//! Every golden fixture plus a few synthetic payloads (built with
//! `super::common::mp` to reach paths the fixtures do not: map envelopes, bin
//! digests, `extra_keys` items, lookahead lists, 16-bit array headers) are
//! mutated [`CASES`] times in total with a deterministic `SplitMix64`: bit flips,
//! overwrites with interesting marker bytes, truncation, insertion, deletion,
//! splicing two payloads, duplicating a slice, and lying length fields. Each
//! mutant is decoded by a fresh `decode_batch`, by one `StreamDecoder` reused
//! across all mutants (so state learned from garbage is exercised too), and by
//! a second reused `StreamDecoder` that is `reset()` before each mutant.
//!
//! A panic fails the test; the offending payload is printed in hex first. On
//! top of not panicking, each decode must be self-consistent: every event is
//! decoded or skipped, indices run 0.., no more events than payload bytes, and
//! `lost_events` only after a `malformed` event. And the reset decoder must
//! decode exactly like the fresh one: nothing an earlier (broken) payload left
//! in the decoder's buffers may reach a later result. `cargo fuzz` (see
//! `docs/fuzzing.md`) explores the same target with coverage feedback.

use std::panic::{catch_unwind, resume_unwind, AssertUnwindSafe};
use std::time::Instant;

use super::common::{fixture_names, fixture_payload, mp};
use kvroute_core::rng::SplitMix64;
use kvroute_core::wire::{
    decode_batch, DecodedBatch, DecoderConfig, EnvelopeError, SkipReason, StreamDecoder,
};

/// Mutated payloads decoded in total (each by three decoders).
const CASES: usize = 120_000;

/// Fixed seed, so a failure reproduces exactly.
const SEED: u64 = 0x6b76_726f_7574_6521;

/// Marker bytes worth planting: nil, reserved, uint64, int64, array32, map32,
/// the largest negative fixint, the largest positive fixint, fixmap/fixarray/fixstr of 0.
const INTERESTING: [u8; 12] = [
    0x00, 0xc0, 0xc1, 0xcf, 0xd3, 0xdd, 0xdf, 0xff, 0x7f, 0x80, 0x90, 0xa0,
];

/// Lengths a lying header may claim.
const HUGE: [u32; 5] = [u32::MAX, 0x8000_0000, 0x7fff_ffff, 0x0001_0000, 0xffff];

/// One entry of a synthetic map event.
fn kv(out: &mut Vec<u8>, key: &str) {
    mp::str(out, key);
}

/// A map envelope of map events: bin digests, negative hashes, `extra_keys`
/// with multimodal items and a salt, lookahead lists, groups, removal, reset.
fn synthetic_map_batch() -> Vec<u8> {
    let mm = "f4ee232804f98597174e7cc5a5c2bd7216c2ef44399c6580db2d79d7a86b7f45";
    let mut out = Vec::new();
    mp::map(&mut out, 3);
    kv(&mut out, "ts");
    mp::f64(&mut out, 1_767_225_600.25);
    kv(&mut out, "attn_dp_rank");
    mp::uint(&mut out, 3);
    kv(&mut out, "events");
    mp::array(&mut out, 5);

    // Stored, vLLM style, digest hashes, extra_keys with an item and the salt.
    mp::map(&mut out, 11);
    kv(&mut out, "type");
    mp::str(&mut out, "BlockStored");
    kv(&mut out, "block_hashes");
    mp::array(&mut out, 2);
    mp::bin(&mut out, &[0xaa; 32]);
    mp::bin(&mut out, &[0xbb; 32]);
    kv(&mut out, "parent_block_hash");
    mp::nil(&mut out);
    kv(&mut out, "token_ids");
    mp::uints(&mut out, &(0..33).map(|i| i * 977).collect::<Vec<u64>>());
    kv(&mut out, "block_size");
    mp::uint(&mut out, 16);
    kv(&mut out, "lora_name");
    mp::str(&mut out, "sql-adapter");
    kv(&mut out, "extra_keys");
    mp::array(&mut out, 2);
    mp::array(&mut out, 3);
    mp::str(&mut out, "sql-adapter");
    mp::array(&mut out, 2);
    mp::str(&mut out, mm);
    mp::uint(&mut out, 0);
    mp::str(&mut out, "tenant-0");
    mp::array(&mut out, 1);
    mp::str(&mut out, mm);
    kv(&mut out, "group_idx");
    mp::uint(&mut out, 1);
    kv(&mut out, "kv_cache_spec_kind");
    mp::str(&mut out, "full_attention");
    kv(&mut out, "lookahead_token_ids");
    mp::array(&mut out, 2);
    mp::uints(&mut out, &[33]);
    mp::uints(&mut out, &[34]);
    kv(&mut out, "medium");
    mp::str(&mut out, "GPU");

    // Stored, SGLang style, negative hashes, explicit salt, wide pad ids, a child.
    mp::map(&mut out, 8);
    kv(&mut out, "type");
    mp::str(&mut out, "BlockStored");
    kv(&mut out, "block_hashes");
    mp::array(&mut out, 1);
    mp::int64(&mut out, -5_416_570_876_986_654_169);
    kv(&mut out, "parent_block_hash");
    mp::bin(&mut out, &[0xbb; 32]);
    kv(&mut out, "token_ids");
    mp::uints(
        &mut out,
        &(0..16).map(|i| (1 << 62) + i * 31).collect::<Vec<u64>>(),
    );
    kv(&mut out, "block_size");
    mp::uint(&mut out, 16);
    kv(&mut out, "cache_salt");
    mp::str(&mut out, "tenant-1");
    kv(&mut out, "locality");
    mp::str(&mut out, "LOCAL");
    kv(&mut out, "medium");
    mp::str(&mut out, "CPU_PINNED");

    // Removed, with a group; a foreign-owned removal; a reset.
    mp::map(&mut out, 4);
    kv(&mut out, "type");
    mp::str(&mut out, "BlockRemoved");
    kv(&mut out, "block_hashes");
    mp::array(&mut out, 1);
    mp::bin(&mut out, &[0xaa; 32]);
    kv(&mut out, "medium");
    mp::str(&mut out, "GPU");
    kv(&mut out, "group_idx");
    mp::uint(&mut out, 1);
    mp::map(&mut out, 3);
    kv(&mut out, "type");
    mp::str(&mut out, "BlockRemoved");
    kv(&mut out, "block_hashes");
    mp::uints(&mut out, &[9]);
    kv(&mut out, "ownership");
    mp::str(&mut out, "lmcache");
    mp::map(&mut out, 1);
    kv(&mut out, "type");
    mp::str(&mut out, "AllBlocksCleared");
    out
}

/// A 3-element envelope of 20 positional events behind a 16-bit array header:
/// EAGLE bigram stores, removals and a reset.
fn synthetic_positional_batch() -> Vec<u8> {
    let mut out = Vec::new();
    mp::array(&mut out, 3);
    mp::uint(&mut out, 1_767_225_600);
    out.push(0xdc);
    out.extend_from_slice(&20u16.to_be_bytes());
    for i in 0..20u64 {
        match i % 4 {
            0 | 1 => {
                mp::array(&mut out, 8);
                mp::str(&mut out, "BlockStored");
                mp::uints(&mut out, &[100 + i]);
                if i == 0 {
                    mp::nil(&mut out);
                } else {
                    mp::uint(&mut out, 99 + i);
                }
                mp::array(&mut out, 4);
                for t in 0..4 {
                    mp::uints(&mut out, &[i * 10 + t, i * 10 + t + 1]);
                }
                mp::uint(&mut out, 4);
                mp::nil(&mut out);
                mp::str(&mut out, "GPU");
                mp::nil(&mut out);
            }
            2 => {
                mp::array(&mut out, 3);
                mp::str(&mut out, "BlockRemoved");
                mp::uints(&mut out, &[100 + i - 1]);
                mp::str(&mut out, "CPU");
            }
            _ => {
                mp::array(&mut out, 1);
                mp::str(&mut out, "AllBlocksCleared");
            }
        }
    }
    mp::uint(&mut out, 0);
    out
}

/// A position in `0..len`, or 0 for an empty buffer.
fn pos(rng: &mut SplitMix64, len: usize) -> usize {
    rng.below(len)
}

/// Replaces the length of the first header at or after `from` with a huge one.
fn lie_about_a_length(rng: &mut SplitMix64, p: &mut Vec<u8>, from: usize) {
    let huge = HUGE[pos(rng, HUGE.len())];
    let Some(at) =
        (from..p.len()).find(|&i| matches!(p[i], 0x80..=0xbf | 0xc4..=0xc6 | 0xd9..=0xdf))
    else {
        return;
    };
    let marker = p[at];
    let set = |width: usize, p: &mut Vec<u8>| {
        let bytes = huge.to_be_bytes();
        for (k, b) in bytes[4 - width..].iter().enumerate() {
            if let Some(slot) = p.get_mut(at + 1 + k) {
                *slot = *b;
            }
        }
    };
    match marker {
        // fix-size headers (fixmap, fixarray, fixstr) become their 32-bit form
        0x80..=0xbf => {
            let wide = match marker {
                0x80..=0x8f => 0xdf,
                0x90..=0x9f => 0xdd,
                _ => 0xdb,
            };
            p.splice(at..=at, std::iter::once(wide).chain(huge.to_be_bytes()));
        }
        0xc4 | 0xd9 => set(1, p),
        0xc5 | 0xda | 0xdc | 0xde => set(2, p),
        _ => set(4, p),
    }
}

/// Applies one random mutation; `other` is a second payload to splice with.
fn mutate(rng: &mut SplitMix64, p: &mut Vec<u8>, other: &[u8]) {
    let len = p.len();
    match rng.below(10) {
        0 => {
            if len > 0 {
                let i = pos(rng, len);
                p[i] ^= 1 << rng.below(8);
            }
        }
        1 => {
            if len > 0 {
                let i = pos(rng, len);
                p[i] = INTERESTING[pos(rng, INTERESTING.len())];
            }
        }
        2 => p.truncate(pos(rng, len + 1)),
        3 => {
            let i = pos(rng, len + 1);
            let b = if rng.below(2) == 0 {
                INTERESTING[pos(rng, INTERESTING.len())]
            } else {
                rng.next_u64() as u8
            };
            p.insert(i, b);
        }
        4 => {
            if len > 0 {
                let i = pos(rng, len);
                let n = (1 + rng.below(8)).min(len - i);
                p.drain(i..i + n);
            }
        }
        5 => {
            let keep = pos(rng, len + 1);
            let from = pos(rng, other.len() + 1);
            p.truncate(keep);
            p.extend_from_slice(&other[from..]);
        }
        6 => {
            if len > 0 {
                let start = pos(rng, len);
                let n = (1 + rng.below(64)).min(len - start);
                let slice = p[start..start + n].to_vec();
                let at = pos(rng, len + 1);
                p.splice(at..at, slice);
            }
        }
        7 => {
            let from = pos(rng, len + 1);
            lie_about_a_length(rng, p, from);
        }
        8 => {
            if len > 0 {
                let i = pos(rng, len);
                p[i] = rng.next_u64() as u8;
            }
        }
        _ => {
            // A run of one interesting byte, as a corrupt frame would have.
            if len > 0 {
                let i = pos(rng, len);
                let n = (1 + rng.below(16)).min(len - i);
                let b = INTERESTING[pos(rng, INTERESTING.len())];
                p[i..i + n].fill(b);
            }
        }
    }
}

/// The invariants every successful decode keeps, whatever the input.
fn check_consistent(batch: &DecodedBatch, payload: &[u8]) {
    assert_eq!(
        batch.decoded().count() + batch.skipped().count(),
        batch.events.len()
    );
    assert!(
        batch.events.len() <= payload.len(),
        "more events than bytes"
    );
    for (i, event) in batch.events.iter().enumerate() {
        assert_eq!(event.index as usize, i, "indices run from 0");
    }
    if batch.lost_events > 0 {
        let last = batch.events.last().expect("a lost tail follows an event");
        assert_eq!(
            last.outcome.as_ref().err().map(|s| s.reason),
            Some(SkipReason::Malformed),
            "events are lost only after a malformed one"
        );
    }
    // Formatting the reasons (what the shell logs) must not panic either.
    for (_, skipped) in batch.skipped() {
        let _ = skipped.to_string();
    }
}

/// Equality of two decodes that treats a NaN timestamp as equal to itself.
fn same(a: &Result<DecodedBatch, EnvelopeError>, b: &Result<DecodedBatch, EnvelopeError>) -> bool {
    match (a, b) {
        (Ok(a), Ok(b)) => {
            a.ts.map(f64::to_bits) == b.ts.map(f64::to_bits)
                && a.dp_rank == b.dp_rank
                && a.events == b.events
                && a.lost_events == b.lost_events
        }
        (Err(a), Err(b)) => a == b,
        _ => false,
    }
}

fn hex(bytes: &[u8]) -> String {
    bytes.iter().map(|b| format!("{b:02x}")).collect()
}

#[test]
fn mutated_payloads_never_panic_and_decode_consistently() {
    let mut seeds: Vec<(String, Vec<u8>)> = fixture_names()
        .into_iter()
        .map(|name| {
            let payload = fixture_payload(&name);
            (name, payload)
        })
        .collect();
    seeds.push(("synthetic_map_batch".into(), synthetic_map_batch()));
    seeds.push((
        "synthetic_positional_batch".into(),
        synthetic_positional_batch(),
    ));

    // The seeds themselves decode: the mutants start from valid input.
    let fresh = DecoderConfig {
        block_size: None,
        keep_tokens: true,
        ..Default::default()
    };
    for (name, payload) in &seeds {
        let batch = decode_batch(payload, &fresh).unwrap_or_else(|e| panic!("seed {name}: {e}"));
        check_consistent(&batch, payload);
        assert_eq!(batch.lost_events, 0, "seed {name}");
    }

    let mut reused = StreamDecoder::new(DecoderConfig {
        block_size: Some(16),
        registered_rank: 1,
        keep_tokens: false,
        max_salted_blocks: 64,
    });
    let mut resettable = StreamDecoder::new(fresh.clone());
    let mut rng = SplitMix64::new(SEED);
    let mut envelope_errors = 0usize;
    let mut events = 0usize;
    let started = Instant::now();
    for case in 0..CASES {
        let (name, seed) = &seeds[case % seeds.len()];
        let other = &seeds[pos(&mut rng, seeds.len())].1;
        let mut payload = seed.clone();
        for _ in 0..1 + rng.below(3) {
            mutate(&mut rng, &mut payload, other);
        }
        let result = catch_unwind(AssertUnwindSafe(|| {
            let once = decode_batch(&payload, &fresh);
            let again = reused.decode(&payload);
            resettable.reset();
            let after_reset = resettable.decode(&payload);
            (once, again, after_reset)
        }));
        let (once, again, after_reset) = match result {
            Ok(outcomes) => outcomes,
            Err(panic) => {
                eprintln!(
                    "case {case} (from {name}) panicked on payload {}",
                    hex(&payload)
                );
                resume_unwind(panic);
            }
        };
        assert!(
            same(&once, &after_reset),
            "case {case} (from {name}): a reset decoder differs from a fresh one on {}",
            hex(&payload)
        );
        for outcome in [&once, &again] {
            match outcome {
                Ok(batch) => {
                    check_consistent(batch, &payload);
                    events += batch.events.len();
                }
                Err(e) => {
                    let _ = e.to_string();
                    envelope_errors += 1;
                }
            }
        }
    }
    println!(
        "robustness: {CASES} mutated payloads from {} seeds, decoded three times each in {:.2?}: \
         {events} events located, {envelope_errors} envelope errors, no panic",
        seeds.len(),
        started.elapsed(),
    );
    const { assert!(CASES >= 100_000) };
}
