//! Payload builders shared by the allocation tests and the decoder benchmark
//! (included with `#[path]`): a msgpack writer choosing msgspec's markers, a
//! deterministic generator, vLLM-shaped synthetic batches and the fixtures.
#![allow(dead_code)]

use std::path::PathBuf;

use kvroute_core::rng::SplitMix64;

/// The core's msgpack writer, which chooses the same markers as msgspec.
pub use kvroute_core::wire::write as mp;

/// A realistic text token id below 152000, in a mix of msgpack widths:
/// ~10 % fixint, ~5 % uint8, ~40 % uint16, ~45 % uint32.
pub fn token_id(rng: &mut SplitMix64) -> u64 {
    let below = |rng: &mut SplitMix64, n: u64| rng.next_u64() % n;
    match below(rng, 100) {
        0..=9 => below(rng, 128),
        10..=14 => 128 + below(rng, 128),
        15..=54 => 256 + below(rng, 65_536 - 256),
        _ => 65_536 + below(rng, 152_000 - 65_536),
    }
}

/// Block size of the synthetic workloads and of every decoder (the samples' too).
pub const BLOCK_SIZE: usize = 16;

/// Writes one vLLM 0.33.0 `BlockStored` map, as msgspec encodes it (map16 header,
/// fields in declaration order, defaults omitted, hashes as `uint64`).
pub fn write_vllm_stored(
    out: &mut Vec<u8>,
    rng: &mut SplitMix64,
    hashes: &[u64],
    parent: Option<u64>,
) {
    mp::map16(out, 11);
    mp::str(out, "type");
    mp::str(out, "BlockStored");
    mp::str(out, "block_hashes");
    mp::array(out, hashes.len());
    for &h in hashes {
        mp::uint64(out, h);
    }
    mp::str(out, "parent_block_hash");
    match parent {
        Some(p) => mp::uint64(out, p),
        None => mp::nil(out),
    }
    mp::str(out, "token_ids");
    mp::array(out, hashes.len() * BLOCK_SIZE);
    for _ in 0..hashes.len() * BLOCK_SIZE {
        mp::uint(out, token_id(rng));
    }
    mp::str(out, "block_size");
    mp::uint(out, BLOCK_SIZE as u64);
    mp::str(out, "lora_id");
    mp::nil(out);
    mp::str(out, "medium");
    mp::str(out, "GPU");
    mp::str(out, "lora_name");
    mp::nil(out);
    mp::str(out, "extra_keys");
    mp::array(out, hashes.len());
    for _ in hashes {
        mp::nil(out);
    }
    mp::str(out, "group_idx");
    mp::uint(out, 0);
    mp::str(out, "kv_cache_spec_kind");
    mp::str(out, "full_attention");
}

/// Writes one vLLM 0.33.0 GPU `BlockRemoved` map (one hash, as the block pool emits it).
pub fn write_vllm_removed(out: &mut Vec<u8>, hash: u64) {
    mp::map(out, 4);
    mp::str(out, "type");
    mp::str(out, "BlockRemoved");
    mp::str(out, "block_hashes");
    mp::array(out, 1);
    mp::uint64(out, hash);
    mp::str(out, "medium");
    mp::str(out, "GPU");
    mp::str(out, "group_idx");
    mp::uint(out, 0);
}

/// Writes the batch envelope `[ts, [events…], 0]` header (the events follow).
pub fn write_envelope(out: &mut Vec<u8>, events: usize) {
    mp::array(out, 3);
    mp::f64(out, 1_767_225_600.25);
    mp::array(out, events);
}

/// `[ts, [BlockStored of 1000 blocks × 16 u32 token ids], 0]`.
pub fn synthetic_batch() -> Vec<u8> {
    let mut rng = SplitMix64::new(0x9e37_79b9_7f4a_7c15);
    let hashes: Vec<u64> = (0..1000).map(|_| rng.next_u64()).collect();
    let mut out = Vec::new();
    write_envelope(&mut out, 1);
    write_vllm_stored(&mut out, &mut rng, &hashes, None);
    mp::uint(&mut out, 0);
    out
}

/// `[ts, [64 × (BlockStored of 4 blocks, BlockRemoved of 1 hash)], 0]`: stores
/// alternate between starting a chain and extending the previous one; each
/// removal evicts a block stored earlier.
pub fn small_events_batch() -> Vec<u8> {
    let mut rng = SplitMix64::new(0xd1b5_4a32_d192_ed03);
    let mut out = Vec::new();
    write_envelope(&mut out, 128);
    let mut stored: Vec<u64> = Vec::new();
    for i in 0..64 {
        let hashes: Vec<u64> = (0..4).map(|_| rng.next_u64()).collect();
        let parent = if i % 2 == 1 {
            stored.last().copied()
        } else {
            None
        };
        write_vllm_stored(&mut out, &mut rng, &hashes, parent);
        stored.extend_from_slice(&hashes);
        let victim = stored[rng.below(stored.len())];
        write_vllm_removed(&mut out, victim);
    }
    mp::uint(&mut out, 0);
    out
}

/// Parses lowercase hex (no separators) into bytes.
pub fn parse_hex(text: &str) -> Vec<u8> {
    let text = text.trim();
    assert!(text.len().is_multiple_of(2), "odd hex length");
    (0..text.len())
        .step_by(2)
        .map(|i| u8::from_str_radix(&text[i..i + 2], 16).expect("hex digit"))
        .collect()
}

/// Every golden payload, `(name, bytes)`, sorted by name.
pub fn fixture_payloads() -> Vec<(String, Vec<u8>)> {
    let dir = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures");
    let mut out: Vec<(String, Vec<u8>)> = std::fs::read_dir(&dir)
        .expect("fixtures directory is readable")
        .filter_map(Result::ok)
        .filter_map(|entry| {
            let name = entry.file_name().to_str()?.strip_suffix(".hex")?.to_owned();
            let text = std::fs::read_to_string(entry.path()).expect("fixture is readable");
            let line = text
                .lines()
                .find(|l| !l.starts_with('#'))
                .expect("fixture has a payload line");
            Some((name, parse_hex(line)))
        })
        .collect();
    out.sort();
    assert!(!out.is_empty(), "no fixtures in {}", dir.display());
    out
}
