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

#[path = "support/payloads.rs"]
mod payloads;
use payloads::{fixture_payloads, small_events_batch, synthetic_batch, BLOCK_SIZE};

/// The payload of `tests/fixtures/{name}.hex`.
fn fixture_payload(name: &str) -> Vec<u8> {
    fixture_payloads()
        .into_iter()
        .find(|(n, _)| n == name)
        .map(|(_, p)| p)
        .expect("fixture exists")
}

/// Every fixture's name, sorted.
fn fixture_names() -> Vec<String> {
    fixture_payloads().into_iter().map(|(n, _)| n).collect()
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
    /// list per stored, removed or group event, the LoRA name and cache salt a stored
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
                        + u64::from(s.image_items.as_ref().is_some_and(|i| i.capacity() > 0))
                }
                Ok(KvEvent::Removed(_) | KvEvent::Group(_)) => 1,
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
    // Engine samples hold events skipped on purpose (non-attention groups,
    // placeholders), never bad input.
    assert!(
        batch.skipped().all(|(_, s)| !s.reason.is_error()),
        "{name}: no event is bad input"
    );
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
