//! Payload builders shared by the allocation tests and the decoder benchmark
//! (included with `#[path]`): a msgpack writer choosing msgspec's markers, a
//! deterministic generator, vLLM-shaped synthetic batches and the fixtures.
#![allow(dead_code)]

use std::path::PathBuf;

/// A minimal msgpack writer, choosing the same markers as msgspec.
pub mod mp {
    /// An array header (fixarray, array16 or array32).
    pub fn array(out: &mut Vec<u8>, len: usize) {
        if len < 16 {
            out.push(0x90 | len as u8);
        } else if let Ok(len) = u16::try_from(len) {
            out.push(0xdc);
            out.extend_from_slice(&len.to_be_bytes());
        } else {
            out.push(0xdd);
            out.extend_from_slice(&(len as u32).to_be_bytes());
        }
    }

    /// A fixmap header (at most 15 entries).
    pub fn fixmap(out: &mut Vec<u8>, len: u8) {
        assert!(len < 16, "fixmap holds at most 15 entries");
        out.push(0x80 | len);
    }

    /// A map16 header (msgspec's header for structs with 16 fields or more).
    pub fn map16(out: &mut Vec<u8>, len: u16) {
        out.push(0xde);
        out.extend_from_slice(&len.to_be_bytes());
    }

    /// A string (fixstr or str8).
    pub fn str(out: &mut Vec<u8>, s: &str) {
        let b = s.as_bytes();
        if b.len() < 32 {
            out.push(0xa0 | b.len() as u8);
        } else {
            out.push(0xd9);
            out.push(u8::try_from(b.len()).expect("short string"));
        }
        out.extend_from_slice(b);
    }

    /// A non-negative integer in its smallest encoding.
    pub fn uint(out: &mut Vec<u8>, v: u64) {
        if v < 128 {
            out.push(v as u8);
        } else if let Ok(v) = u8::try_from(v) {
            out.extend_from_slice(&[0xcc, v]);
        } else if let Ok(v) = u16::try_from(v) {
            out.push(0xcd);
            out.extend_from_slice(&v.to_be_bytes());
        } else if let Ok(v) = u32::try_from(v) {
            out.push(0xce);
            out.extend_from_slice(&v.to_be_bytes());
        } else {
            uint64(out, v);
        }
    }

    /// A `uint64` (marker `0xcf`) whatever the value.
    pub fn uint64(out: &mut Vec<u8>, v: u64) {
        out.push(0xcf);
        out.extend_from_slice(&v.to_be_bytes());
    }

    /// Nil.
    pub fn nil(out: &mut Vec<u8>) {
        out.push(0xc0);
    }

    /// A float64.
    pub fn f64(out: &mut Vec<u8>, v: f64) {
        out.push(0xcb);
        out.extend_from_slice(&v.to_be_bytes());
    }
}

/// A small deterministic generator (xorshift64*).
pub struct Rng(pub u64);

impl Rng {
    /// The next 64 random bits.
    pub fn next_u64(&mut self) -> u64 {
        let mut x = self.0;
        x ^= x >> 12;
        x ^= x << 25;
        x ^= x >> 27;
        self.0 = x;
        x.wrapping_mul(0x2545_f491_4f6c_dd1d)
    }

    /// A value in `0..n` (`n > 0`).
    pub fn below(&mut self, n: u64) -> u64 {
        self.next_u64() % n
    }

    /// A realistic text token id below 152000, in a mix of msgpack widths:
    /// ~10 % fixint, ~5 % uint8, ~40 % uint16, ~45 % uint32.
    pub fn token_id(&mut self) -> u64 {
        match self.below(100) {
            0..=9 => self.below(128),
            10..=14 => 128 + self.below(128),
            15..=54 => 256 + self.below(65_536 - 256),
            _ => 65_536 + self.below(152_000 - 65_536),
        }
    }
}

/// Block size of the synthetic workloads and of every decoder (the samples' too).
pub const BLOCK_SIZE: usize = 16;

/// Writes one vLLM 0.33.0 `BlockStored` map, as msgspec encodes it (map16 header,
/// fields in declaration order, defaults omitted, hashes as `uint64`).
pub fn write_vllm_stored(out: &mut Vec<u8>, rng: &mut Rng, hashes: &[u64], parent: Option<u64>) {
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
        mp::uint(out, rng.token_id());
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
    mp::fixmap(out, 4);
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
    let mut rng = Rng(0x9e37_79b9_7f4a_7c15);
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
    let mut rng = Rng(0xd1b5_4a32_d192_ed03);
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
        let victim = stored[rng.below(stored.len() as u64) as usize];
        write_vllm_removed(&mut out, victim);
    }
    mp::uint(&mut out, 0);
    out
}

/// Parses lowercase hex (no separators) into bytes.
pub fn parse_hex(text: &str) -> Vec<u8> {
    let text = text.trim();
    assert!(text.len() % 2 == 0, "odd hex length");
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
