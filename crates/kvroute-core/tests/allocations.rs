//! Steady-state allocations of the wire decoder, counted by a global allocator.
//!
//! A [`StreamDecoder`] that has decoded a payload once has grown its scratch
//! buffers; decoding the same shape again must then allocate only what it
//! returns: the batch's event list and, per stored or removed event, its block
//! list. On the `u32` token path that is at most one allocation per event plus
//! one per batch. Stored events that carry a LoRA name or a cache salt also own
//! those strings, and a salt new to the stream is remembered (one shared copy)
//! for the child stores that inherit it. Run with `-- --nocapture` to see the
//! measured figures.
//!
//! The allocator counts per thread (a const-initialized thread-local), so the
//! test harness's parallel threads do not disturb each other's counts.
#![allow(unsafe_code)]

use std::path::PathBuf;

use kvroute_core::event::KvEvent;
use kvroute_core::wire::{DecodedBatch, DecoderConfig, StreamDecoder};

#[path = "support/counting_alloc.rs"]
mod counting_alloc;
use counting_alloc::{count_allocations, CountingAlloc};

/// This test binary's allocator.
#[global_allocator]
static GLOBAL: CountingAlloc = CountingAlloc;

// ---------------------------------------------------------------------------
// Payloads
// ---------------------------------------------------------------------------

/// The payload of `tests/fixtures/{name}.hex` (line 1 a `#` comment, line 2 hex).
fn fixture_payload(name: &str) -> Vec<u8> {
    let path = PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("tests/fixtures")
        .join(format!("{name}.hex"));
    let text = std::fs::read_to_string(&path).expect("fixture is readable");
    let hex = text
        .lines()
        .find(|l| !l.starts_with('#'))
        .expect("fixture has a payload line")
        .trim();
    assert!(hex.len() % 2 == 0, "odd hex length in {name}");
    (0..hex.len())
        .step_by(2)
        .map(|i| u8::from_str_radix(&hex[i..i + 2], 16).expect("hex digit"))
        .collect()
}

/// Every fixture's name, sorted.
fn fixture_names() -> Vec<String> {
    let dir = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures");
    let mut names: Vec<String> = std::fs::read_dir(dir)
        .expect("fixtures directory is readable")
        .filter_map(Result::ok)
        .filter_map(|e| {
            e.file_name()
                .to_str()
                .and_then(|n| n.strip_suffix(".hex"))
                .map(str::to_owned)
        })
        .collect();
    names.sort();
    names
}

/// A minimal msgpack writer, choosing the same markers as msgspec.
mod mp {
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

    /// A fixstr (shorter than 32 bytes).
    pub fn str(out: &mut Vec<u8>, s: &str) {
        assert!(s.len() < 32, "fixstr only");
        out.push(0xa0 | s.len() as u8);
        out.extend_from_slice(s.as_bytes());
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
}

/// A small deterministic generator (xorshift64*).
struct Rng(u64);

impl Rng {
    /// The next 64 random bits.
    fn next_u64(&mut self) -> u64 {
        let mut x = self.0;
        x ^= x >> 12;
        x ^= x << 25;
        x ^= x >> 27;
        self.0 = x;
        x.wrapping_mul(0x2545_f491_4f6c_dd1d)
    }

    /// A value in `0..n` (`n > 0`).
    fn below(&mut self, n: u64) -> u64 {
        self.next_u64() % n
    }

    /// A text token id below 152000, in a mix of fixint, uint8, uint16 and uint32.
    fn token_id(&mut self) -> u64 {
        match self.below(100) {
            0..=9 => self.below(128),
            10..=14 => 128 + self.below(128),
            15..=54 => 256 + self.below(65_536 - 256),
            _ => 65_536 + self.below(152_000 - 65_536),
        }
    }
}

/// Block size of the synthetic payloads and of the decoders under test.
const BLOCK_SIZE: usize = 16;

/// One vLLM 0.33.0 `BlockStored` map (msgspec's map16 header, declaration order).
fn write_vllm_stored(out: &mut Vec<u8>, rng: &mut Rng, hashes: &[u64], parent: Option<u64>) {
    out.extend_from_slice(&[0xde, 0x00, 11]);
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
        None => out.push(0xc0),
    }
    mp::str(out, "token_ids");
    mp::array(out, hashes.len() * BLOCK_SIZE);
    for _ in 0..hashes.len() * BLOCK_SIZE {
        mp::uint(out, rng.token_id());
    }
    mp::str(out, "block_size");
    mp::uint(out, BLOCK_SIZE as u64);
    mp::str(out, "lora_id");
    out.push(0xc0);
    mp::str(out, "medium");
    mp::str(out, "GPU");
    mp::str(out, "lora_name");
    out.push(0xc0);
    mp::str(out, "extra_keys");
    mp::array(out, hashes.len());
    out.extend(hashes.iter().map(|_| 0xc0));
    mp::str(out, "group_idx");
    mp::uint(out, 0);
    mp::str(out, "kv_cache_spec_kind");
    mp::str(out, "full_attention");
}

/// The batch header `[ts (float64), [` followed by `events` events.
fn write_envelope(out: &mut Vec<u8>, events: usize) {
    out.push(0x93);
    out.push(0xcb);
    out.extend_from_slice(&1_767_225_600.25f64.to_be_bytes());
    mp::array(out, events);
}

/// `[ts, [BlockStored of 1000 blocks × 16 u32 token ids], 0]`.
fn synthetic_batch() -> Vec<u8> {
    let mut rng = Rng(0x9e37_79b9_7f4a_7c15);
    let hashes: Vec<u64> = (0..1000).map(|_| rng.next_u64()).collect();
    let mut out = Vec::new();
    write_envelope(&mut out, 1);
    write_vllm_stored(&mut out, &mut rng, &hashes, None);
    mp::uint(&mut out, 0);
    out
}

/// `[ts, [64 × (BlockStored of 4 blocks, BlockRemoved of 1 hash)], 0]`.
fn small_events_batch() -> Vec<u8> {
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
        out.push(0x84);
        mp::str(&mut out, "type");
        mp::str(&mut out, "BlockRemoved");
        mp::str(&mut out, "block_hashes");
        mp::array(&mut out, 1);
        mp::uint64(&mut out, victim);
        mp::str(&mut out, "medium");
        mp::str(&mut out, "GPU");
        mp::str(&mut out, "group_idx");
        mp::uint(&mut out, 0);
    }
    mp::uint(&mut out, 0);
    out
}

// ---------------------------------------------------------------------------
// Measurement
// ---------------------------------------------------------------------------

/// One steady-state decode: its batch and what it allocated.
struct Measured {
    /// The decoded batch.
    batch: DecodedBatch,
    /// Allocations of the measured `decode` call.
    allocations: u64,
}

impl Measured {
    /// Events in the batch.
    fn events(&self) -> u64 {
        self.batch.events.len() as u64
    }

    /// What the decoder may allocate for this batch: the event list, one block
    /// list per stored or removed event, the LoRA name and cache salt a stored
    /// event owns (plus the shared copy of the salt the stream remembers for
    /// child stores, when it is not remembered yet), and the detail string of a
    /// skipped event.
    fn allowed_allocations(&self) -> u64 {
        let per_event: u64 = self
            .batch
            .events
            .iter()
            .map(|e| match &e.outcome {
                Ok(KvEvent::Stored(s)) => {
                    1 + u64::from(s.lora_name.is_some())
                        + 2 * u64::from(s.cache_salt.is_some())
                        + u64::from(s.token_ids.is_some())
                }
                Ok(KvEvent::Removed(_)) => 1,
                Ok(KvEvent::Cleared) => 0,
                Err(_) => 1,
            })
            .sum();
        1 + per_event
    }
}

/// Decodes `payload` once to warm a [`StreamDecoder`] up, then counts the
/// allocations of a second `decode` of the same payload, and prints them.
fn steady_state(name: &str, payload: &[u8]) -> Measured {
    let mut decoder = StreamDecoder::new(DecoderConfig {
        block_size: Some(BLOCK_SIZE as u32),
        ..DecoderConfig::default()
    });
    drop(decoder.decode(payload).expect("warm-up decode"));
    let (batch, allocations) = count_allocations(|| decoder.decode(payload));
    let batch = batch.expect("payload decodes");
    assert_eq!(batch.skipped().count(), 0, "{name}: no event is skipped");
    let measured = Measured { batch, allocations };
    let events = measured.events();
    println!(
        "{name}: {allocations} allocation(s) for {events} event(s): {:.3} per event, \
         {:.3} per event besides the batch's event list",
        allocations as f64 / events as f64,
        allocations.saturating_sub(1) as f64 / events as f64,
    );
    measured
}

/// Asserts the `u32`-path bound: at most one allocation per event, plus the batch's list.
fn assert_at_most_one_per_event(name: &str, payload: &[u8]) {
    let m = steady_state(name, payload);
    assert!(
        m.allocations <= m.events() + 1,
        "{name}: {} allocations for {} events (bound: events + 1)",
        m.allocations,
        m.events(),
    );
}

#[test]
fn the_counter_sees_this_threads_allocations() {
    let (v, n) = count_allocations(|| Vec::<u64>::with_capacity(8));
    drop(v);
    assert_eq!(n, 1);
    let (s, n) = count_allocations(|| {
        let mut s = String::with_capacity(1);
        s.push_str("grows past its first capacity");
        s
    });
    drop(s);
    assert_eq!(n, 2, "one allocation and one reallocation");
}

#[test]
fn synthetic_1000_block_u32_batch_allocates_at_most_one_per_event() {
    assert_at_most_one_per_event("synthetic_1000x16", &synthetic_batch());
}

#[test]
fn small_events_batch_allocates_at_most_one_per_event() {
    assert_at_most_one_per_event("small_events", &small_events_batch());
}

#[test]
fn vllm_text_chain_allocates_at_most_one_per_event() {
    let name = "vllm_0.33.0_text_chain";
    assert_at_most_one_per_event(name, &fixture_payload(name));
}

#[test]
fn sglang_text_chain_allocates_at_most_one_per_event() {
    let name = "sglang_0.5.23_text_chain";
    assert_at_most_one_per_event(name, &fixture_payload(name));
}

#[test]
fn sglang_wide_pad_ids_allocate_no_token_list() {
    // The ~62-bit pad ids are folded on the fly like any other id: no extra
    // allocation for the wide path either.
    let name = "sglang_0.5.23_wide_mm_pad";
    assert_at_most_one_per_event(name, &fixture_payload(name));
}

#[test]
fn every_fixture_allocates_only_what_it_returns() {
    for name in fixture_names() {
        let m = steady_state(&name, &fixture_payload(&name));
        assert!(
            m.allocations <= m.allowed_allocations(),
            "{name}: {} allocations, but the batch accounts for only {}",
            m.allocations,
            m.allowed_allocations(),
        );
    }
}
