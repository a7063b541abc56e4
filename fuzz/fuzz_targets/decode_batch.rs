//! Fuzz target: arbitrary bytes through `kvroute_core::wire`.
//!
//! The whole input is one payload, so the fixture payloads are valid seeds
//! as they are (`fuzz/seed_corpus.sh`). It is decoded
//!
//! * by `decode_batch` with three configurations: the production block size 16
//!   without tokens; a block size (1..=64) and `keep_tokens` taken from the
//!   input's first byte; and no block size (trust each event's own) with tokens;
//! * by one `StreamDecoder` fed the input's `0xc1`-separated pieces in turn and
//!   then the whole input. `0xc1` never occurs in valid msgpack, so a
//!   multi-payload input is a plain concatenation of payloads, and state
//!   carried between batches (salts, learned groups, a tiny salt-memory cap)
//!   is fuzzed reproducibly, one input at a time.
//!
//! Besides not panicking, each decode must be self-consistent (every event
//! decoded or skipped, indices from 0, no more events than bytes, lost events
//! only after a malformed one) and deterministic (a second fresh decode gives
//! the same batch), and the stream decoder, once `reset()`, must decode the
//! input exactly as a fresh `decode_batch` does: nothing from earlier inputs
//! may leak into later results.
//!
//! The stream decoder's events are also applied to an index (one rank), and
//! every stored event's chain is looked up: a hybrid model's window and state
//! groups, per-block image keys and TensorRT-LLM's digest tokens all reach
//! the index this way. A match must keep `device ≤ host ≤ any ≤` the query's
//! length, and the image items a store reports must name its kept blocks.
#![no_main]

use kvroute_core::event::KvEvent;
use kvroute_core::hash::sequence_hashes;
use kvroute_core::index::{Index, WorkerRank};
use kvroute_core::wire::{
    decode_batch, DecodedBatch, DecoderConfig, EnvelopeError, SkipReason, StreamDecoder,
};
use libfuzzer_sys::fuzz_target;

/// Applies a batch's events to `index` and looks every stored chain up.
fn index_batch(index: &mut Index, batch: &Result<DecodedBatch, EnvelopeError>) {
    let Ok(batch) = batch else { return };
    let key = WorkerRank::new(0, batch.dp_rank % 4);
    for event in batch.decoded() {
        index.apply(key, event);
        let KvEvent::Stored(s) = event else { continue };
        if let Some(items) = &s.image_items {
            assert!(items.iter().all(|&(b, _)| (b as usize) < s.blocks.len()));
        }
        let locals: Vec<_> = s.blocks.iter().map(|b| b.local).collect();
        let seqs = sequence_hashes(&locals);
        for m in index.find_matches(&seqs) {
            assert!(m.device <= m.host && m.host <= m.any);
            assert!(m.any as usize <= seqs.len());
        }
    }
}

/// Asserts the invariants of one decode and formats its messages (as the shell would log them).
fn check(result: &Result<DecodedBatch, EnvelopeError>, payload: &[u8]) {
    let batch = match result {
        Ok(batch) => batch,
        Err(e) => {
            let _ = e.to_string();
            return;
        }
    };
    assert_eq!(
        batch.decoded().count() + batch.skipped().count(),
        batch.events.len()
    );
    assert!(batch.events.len() <= payload.len());
    for (i, event) in batch.events.iter().enumerate() {
        assert_eq!(event.index as usize, i);
    }
    if batch.lost_events > 0 {
        let last = batch
            .events
            .last()
            .map(|e| e.outcome.as_ref().err().map(|s| s.reason));
        assert_eq!(last, Some(Some(SkipReason::Malformed)));
    }
    for (_, skipped) in batch.skipped() {
        let _ = skipped.to_string();
    }
}

/// Equality that treats a NaN timestamp as equal to itself.
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

fuzz_target!(|data: &[u8]| {
    let first = data.first().copied().unwrap_or(0);
    let configs = [
        DecoderConfig {
            block_size: Some(16),
            ..Default::default()
        },
        DecoderConfig {
            block_size: Some(u32::from(first & 0x3f) + 1),
            keep_tokens: first & 0x40 != 0,
            registered_rank: 3,
            ..Default::default()
        },
        DecoderConfig {
            block_size: None,
            keep_tokens: true,
            ..Default::default()
        },
    ];
    for config in &configs {
        let result = decode_batch(data, config);
        check(&result, data);
        assert!(
            same(&result, &decode_batch(data, config)),
            "decoding is deterministic"
        );
    }

    let stream_config = DecoderConfig {
        block_size: Some(16),
        keep_tokens: true,
        max_salted_blocks: 8,
        ..Default::default()
    };
    let mut stream = StreamDecoder::new(stream_config.clone());
    let mut index = Index::default();
    for piece in data.split(|&b| b == 0xc1) {
        let result = stream.decode(piece);
        check(&result, piece);
        index_batch(&mut index, &result);
    }
    check(&stream.decode(data), data);
    stream.reset();
    let after_reset = stream.decode(data);
    check(&after_reset, data);
    assert!(
        same(&after_reset, &decode_batch(data, &stream_config)),
        "a reset stream decoder decodes like a fresh one"
    );
});
