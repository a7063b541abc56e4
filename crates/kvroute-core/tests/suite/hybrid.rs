//! Hybrid models end to end, from vLLM-shaped events to the index's
//! matches: a rank is credited only with the prefix vLLM's hybrid
//! coordinator would reuse (the attention chain, capped where a window
//! group lacks the blocks before the prefix's end or a state group lacks
//! the state at it).

use super::common::mp;
use kvroute_core::hash::{local_block_hashes, sequence_hashes, HASH_SEED};
use kvroute_core::index::{Index, RankMatch, WorkerRank};
use kvroute_core::wire::{DecoderConfig, StreamDecoder};

const BS: usize = 4;
const KEY: WorkerRank = WorkerRank::new(1, 0);

fn tokens(blocks: usize) -> Vec<u64> {
    (1..=(blocks * BS) as u64).collect()
}

/// A `BlockStored` of blocks `1..=n` of the chain for `group` of `kind`
/// (engine hash of block i: 100 + i), or of the listed blocks only.
fn stored(group: u64, kind: &str, window: Option<u64>, blocks: &[u64]) -> Vec<u8> {
    let mut e = Vec::new();
    mp::map(&mut e, 8 + usize::from(window.is_some()));
    mp::str(&mut e, "type");
    mp::str(&mut e, "BlockStored");
    mp::str(&mut e, "block_hashes");
    mp::uints(&mut e, &blocks.iter().map(|b| 100 + b).collect::<Vec<_>>());
    mp::str(&mut e, "parent_block_hash");
    match blocks[0] {
        1 => mp::nil(&mut e),
        b => mp::uint(&mut e, 100 + b - 1),
    }
    mp::str(&mut e, "token_ids");
    let all = tokens(*blocks.last().expect("blocks") as usize);
    mp::uints(&mut e, &all[(blocks[0] as usize - 1) * BS..]);
    mp::str(&mut e, "block_size");
    mp::uint(&mut e, BS as u64);
    mp::str(&mut e, "medium");
    mp::str(&mut e, "GPU");
    mp::str(&mut e, "group_idx");
    mp::uint(&mut e, group);
    mp::str(&mut e, "kv_cache_spec_kind");
    mp::str(&mut e, kind);
    if let Some(w) = window {
        mp::str(&mut e, "kv_cache_spec_sliding_window");
        mp::uint(&mut e, w);
    }
    e
}

/// A `BlockRemoved` of `group` (vLLM names only the group on removals).
fn removed(group: u64, blocks: &[u64]) -> Vec<u8> {
    let mut e = Vec::new();
    mp::map(&mut e, 4);
    mp::str(&mut e, "type");
    mp::str(&mut e, "BlockRemoved");
    mp::str(&mut e, "block_hashes");
    mp::uints(&mut e, &blocks.iter().map(|b| 100 + b).collect::<Vec<_>>());
    mp::str(&mut e, "medium");
    mp::str(&mut e, "GPU");
    mp::str(&mut e, "group_idx");
    mp::uint(&mut e, group);
    e
}

fn apply(index: &mut Index, decoder: &mut StreamDecoder, events: &[Vec<u8>]) {
    let mut batch = Vec::new();
    mp::array(&mut batch, 3);
    mp::f64(&mut batch, 1.0);
    mp::array(&mut batch, events.len());
    for e in events {
        batch.extend_from_slice(e);
    }
    mp::uint(&mut batch, 0);
    let decoded = decoder.decode(&batch).expect("batch");
    assert_eq!(decoded.skipped().count(), 0, "{:?}", decoded.events);
    for event in decoded.decoded() {
        index.apply(KEY, event);
    }
}

/// The rank's match for a request sharing the chain's first `shared` blocks
/// and then going elsewhere.
fn matched(index: &Index, shared: usize) -> RankMatch {
    let mut request: Vec<u32> = (1..=(shared * BS) as u32).collect();
    request.extend([9001, 9002, 9003, 9004, 9005]);
    let seqs = sequence_hashes(&local_block_hashes(&request, BS, HASH_SEED, 0));
    let found = index.find_matches(&seqs);
    found
        .into_iter()
        .find(|m| m.worker_rank == KEY)
        .expect("the rank matches")
}

fn decoder() -> StreamDecoder {
    StreamDecoder::new(DecoderConfig {
        block_size: Some(BS as u32),
        ..Default::default()
    })
}

#[test]
fn a_sliding_window_group_caps_a_match_where_its_window_is_missing() {
    let (mut index, mut decoder) = (Index::default(), decoder());
    let all: Vec<u64> = (1..=6).collect();
    // Window 8 tokens at 4-token blocks: the 2 blocks before a prefix's end.
    apply(
        &mut index,
        &mut decoder,
        &[
            stored(0, "full_attention", None, &all),
            stored(1, "sliding_window", Some(8), &all),
        ],
    );
    for shared in 1..=6 {
        assert_eq!(matched(&index, shared).device, shared as u32, "all held");
    }
    // The window group evicts block 3 (freed early, out of the window).
    apply(&mut index, &mut decoder, &[removed(1, &[3])]);
    let expected = [(1, 1), (2, 2), (3, 2), (4, 2), (5, 5), (6, 6)];
    for (shared, credit) in expected {
        let m = matched(&index, shared);
        assert_eq!(
            (m.device, m.host, m.any),
            (credit, credit, credit),
            "prefix {shared}"
        );
    }
}

#[test]
fn a_mamba_group_credits_only_prefixes_ending_at_a_state() {
    let (mut index, mut decoder) = (Index::default(), decoder());
    let all: Vec<u64> = (1..=8).collect();
    // vLLM's align mode keeps the states of the chunk ends only (blocks 4, 8).
    apply(
        &mut index,
        &mut decoder,
        &[
            stored(0, "full_attention", None, &all),
            stored(1, "mamba", None, &[4]),
            stored(1, "mamba", None, &[8]),
        ],
    );
    assert_eq!(matched(&index, 8).device, 8);
    assert_eq!(matched(&index, 6).device, 4, "the state at 4, not 6");
    assert_eq!(matched(&index, 3).device, 0, "no state before 4");
    // A cleared cache forgets the states but the rank stays hybrid: the
    // attention chain alone, stored again, is credited with nothing.
    let mut cleared = Vec::new();
    mp::map(&mut cleared, 1);
    mp::str(&mut cleared, "type");
    mp::str(&mut cleared, "AllBlocksCleared");
    apply(
        &mut index,
        &mut decoder,
        &[cleared, stored(0, "full_attention", None, &all)],
    );
    assert_eq!(matched(&index, 8).device, 0);
}

#[test]
fn a_plain_model_is_not_capped() {
    let (mut index, mut decoder) = (Index::default(), decoder());
    let all: Vec<u64> = (1..=5).collect();
    apply(
        &mut index,
        &mut decoder,
        &[stored(0, "full_attention", None, &all)],
    );
    assert_eq!(matched(&index, 5).device, 5);
    assert_eq!(matched(&index, 3).device, 3);
}
