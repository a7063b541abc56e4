//! A fixed decode workload for counting instructions, which stay the same from
//! run to run where wall time on a shared machine does not:
//!
//! ```sh
//! cargo build --release -p kvroute-core --example decode_ops
//! valgrind --tool=callgrind target/release/examples/decode_ops synthetic 0    # setup only
//! valgrind --tool=callgrind target/release/examples/decode_ops synthetic 100  # setup, then 100 decodes
//! ```
//!
//! Decodes the decoder bench's `synthetic` (one vLLM 0.33 `BlockStored` of
//! 1000 blocks × 16 `u32` token ids) or `small` (64 four-block stores and 64
//! single-hash removals) batch `N` times with one reused [`StreamDecoder`], as
//! `decode/kvroute/…` of `benches/decode.rs` does. The difference between the
//! two runs, over `N`, is the cost of one decode.

use std::hint::black_box;

use kvroute_core::wire::{DecoderConfig, StreamDecoder};

#[path = "../tests/support/payloads.rs"]
mod payloads;
use payloads::{small_events_batch, synthetic_batch, BLOCK_SIZE};

fn main() {
    let mut args = std::env::args().skip(1);
    let payload = match args.next().as_deref() {
        Some("small") => small_events_batch(),
        _ => synthetic_batch(),
    };
    let runs: u64 = args.next().and_then(|a| a.parse().ok()).unwrap_or(0);
    let mut decoder = StreamDecoder::new(DecoderConfig {
        block_size: Some(BLOCK_SIZE as u32),
        ..DecoderConfig::default()
    });
    let mut events = 0;
    for _ in 0..runs {
        if let Ok(batch) = decoder.decode(black_box(&payload)) {
            events += black_box(batch).events.len();
        }
    }
    println!("{runs} decodes, {events} events");
}
