//! The index against a naive model, plus the cases the model test might miss.

use std::collections::BTreeMap;

use super::*;
use crate::event::{ExternalHash, StoredBlock};
use crate::hash::{local_block_hashes, namespace_seed, sequence_hashes};

fn wr(worker: u32, rank: u32) -> WorkerRank {
    WorkerRank::new(worker, rank)
}

/// An engine hash that, like a real engine's, is a function of the whole prefix.
fn ext_of(chain: &[u64]) -> u64 {
    chain.iter().fold(0xcbf2_9ce4_8422_2325u64, |h, &l| {
        (h ^ l).wrapping_mul(0x100_0000_01b3)
    })
}

/// A stored event of `(engine hash, local hash)` blocks of 4 tokens.
pub(super) fn stored(parent: Option<u64>, blocks: &[(u64, u64)], tier: Tier) -> KvEvent {
    let blocks = blocks
        .iter()
        .map(|&(e, l)| StoredBlock {
            external: ExternalHash(e),
            local: LocalBlockHash(l),
        })
        .collect();
    KvEvent::Stored(Stored::plain(parent.map(ExternalHash), blocks, tier, 4))
}

fn removed(exts: &[u64], tier: Tier) -> KvEvent {
    KvEvent::Removed(Removed {
        blocks: exts.iter().map(|&e| ExternalHash(e)).collect(),
        tier,
    })
}

/// Stores a chain of locals from the root with prefix-derived engine hashes.
fn store_chain(index: &mut Index, key: WorkerRank, locals: &[u64], tier: Tier) {
    let blocks: Vec<(u64, u64)> = (0..locals.len())
        .map(|i| (ext_of(&locals[..=i]), locals[i]))
        .collect();
    index.apply(key, &stored(None, &blocks, tier));
}

fn locals(values: &[u64]) -> Vec<LocalBlockHash> {
    values.iter().map(|&v| LocalBlockHash(v)).collect()
}

fn matches(index: &Index, query: &[u64]) -> BTreeMap<WorkerRank, (u32, u32, u32)> {
    answer(index.find_matches(&sequence_hashes(&locals(query))))
}

fn shared_matches(index: &SharedIndex, query: &[u64]) -> BTreeMap<WorkerRank, (u32, u32, u32)> {
    answer(index.find_matches(&sequence_hashes(&locals(query))))
}

fn answer(found: Vec<RankMatch>) -> BTreeMap<WorkerRank, (u32, u32, u32)> {
    let mut out = BTreeMap::new();
    for m in found {
        let previous = out.insert(m.worker_rank, (m.device, m.host, m.any));
        assert!(previous.is_none(), "{:?} answered twice", m.worker_rank);
    }
    out
}

fn no_cap() -> IndexConfig {
    IndexConfig {
        default_capacity: None,
        ..IndexConfig::default()
    }
}

#[test]
fn shared_prefixes_across_workers_match_to_each_workers_depth() {
    let mut index = Index::new(no_cap());
    store_chain(&mut index, wr(0, 0), &[1, 2, 3, 4], Tier::Device);
    store_chain(&mut index, wr(1, 0), &[1, 2], Tier::Device);
    store_chain(&mut index, wr(2, 1), &[1, 2, 3], Tier::Device);
    let m = matches(&index, &[1, 2, 3, 4, 5]);
    assert_eq!(m[&wr(0, 0)], (4, 4, 4));
    assert_eq!(m[&wr(1, 0)], (2, 2, 2));
    assert_eq!(m[&wr(2, 1)], (3, 3, 3));
    assert!(
        matches(&index, &[2, 3]).is_empty(),
        "a block only counts after its exact prefix"
    );
}

#[test]
fn branches_share_their_common_prefix_only() {
    let mut index = Index::new(no_cap());
    store_chain(&mut index, wr(0, 0), &[1, 2, 3], Tier::Device);
    // Branch after block 2: parent = the engine hash of [1, 2].
    index.apply(
        wr(1, 0),
        &stored(
            None,
            &[(ext_of(&[1]), 1), (ext_of(&[1, 2]), 2)],
            Tier::Device,
        ),
    );
    index.apply(
        wr(1, 0),
        &stored(
            Some(ext_of(&[1, 2])),
            &[(ext_of(&[1, 2, 9]), 9)],
            Tier::Device,
        ),
    );
    let m = matches(&index, &[1, 2, 9]);
    assert_eq!(m[&wr(0, 0)].0, 2);
    assert_eq!(m[&wr(1, 0)].0, 3);
    assert_eq!(index.stats().nodes, 4);
}

#[test]
fn a_store_under_a_parent_the_worker_lacks_is_dropped() {
    let mut index = Index::new(no_cap());
    store_chain(&mut index, wr(0, 0), &[1, 2], Tier::Device);
    // Worker 1 never stored [1, 2]; its child must not attach to worker 0's chain.
    index.apply(
        wr(1, 0),
        &stored(
            Some(ext_of(&[1, 2])),
            &[(ext_of(&[1, 2, 3]), 3)],
            Tier::Device,
        ),
    );
    assert_eq!(index.counters().parent_missing, 1);
    assert!(!matches(&index, &[1, 2, 3]).contains_key(&wr(1, 0)));
    index.apply(wr(0, 0), &stored(Some(12345), &[(7, 7)], Tier::Device));
    assert_eq!(index.counters().parent_missing, 2);
}

#[test]
fn removal_mid_chain_stops_the_match_there() {
    let mut index = Index::new(no_cap());
    store_chain(&mut index, wr(0, 0), &[1, 2, 3, 4], Tier::Device);
    index.apply(wr(0, 0), &removed(&[ext_of(&[1, 2])], Tier::Device));
    assert_eq!(matches(&index, &[1, 2, 3, 4])[&wr(0, 0)], (1, 1, 1));
    index.apply(wr(0, 0), &removed(&[999], Tier::Device));
    assert_eq!(index.counters().unknown_removals, 1);
}

#[test]
fn duplicate_stores_are_idempotent() {
    let mut index = Index::new(no_cap());
    store_chain(&mut index, wr(0, 0), &[1, 2], Tier::Device);
    let before = index.stats();
    store_chain(&mut index, wr(0, 0), &[1, 2], Tier::Device);
    assert_eq!(index.stats(), before);
    assert_eq!(index.counters().duplicate_blocks, 2);
    index.apply(
        wr(0, 0),
        &removed(&[ext_of(&[1, 2]), ext_of(&[1])], Tier::Device),
    );
    assert_eq!(index.stats().nodes, 0);
    assert_eq!(index.stats().residencies, 0);
}

#[test]
fn tiers_count_cumulatively() {
    let mut index = Index::new(no_cap());
    store_chain(&mut index, wr(0, 0), &[1, 2], Tier::Device);
    index.apply(
        wr(0, 0),
        &stored(
            Some(ext_of(&[1, 2])),
            &[(ext_of(&[1, 2, 3]), 3)],
            Tier::Host,
        ),
    );
    index.apply(
        wr(0, 0),
        &stored(
            Some(ext_of(&[1, 2, 3])),
            &[(ext_of(&[1, 2, 3, 4]), 4)],
            Tier::Disk,
        ),
    );
    assert_eq!(matches(&index, &[1, 2, 3, 4])[&wr(0, 0)], (2, 3, 4));
    // Host-only first block: no device credit but host credit.
    store_chain(&mut index, wr(1, 0), &[1], Tier::Host);
    assert_eq!(matches(&index, &[1, 2])[&wr(1, 0)], (0, 1, 1));
    let stats = index.stats();
    assert_eq!(stats.per_rank[0].1, [2, 1, 1, 0]);
}

#[test]
fn clearing_one_rank_leaves_the_others() {
    let mut index = Index::new(no_cap());
    store_chain(&mut index, wr(0, 0), &[1, 2], Tier::Device);
    store_chain(&mut index, wr(0, 1), &[1, 2], Tier::Device);
    store_chain(&mut index, wr(1, 0), &[1], Tier::Device);
    index.apply(wr(0, 1), &KvEvent::Cleared);
    let m = matches(&index, &[1, 2]);
    assert!(!m.contains_key(&wr(0, 1)));
    assert_eq!(m[&wr(0, 0)].0, 2);
    index.remove_worker(WorkerId(0));
    assert_eq!(
        matches(&index, &[1, 2]).keys().copied().collect::<Vec<_>>(),
        [wr(1, 0)]
    );
    assert_eq!(index.ranks(), [wr(1, 0)]);
}

#[test]
fn lora_and_salt_namespaces_do_not_collide() {
    let tokens: Vec<u32> = (0..32).collect();
    let plain: Vec<u64> = local_block_hashes(&tokens, 16, namespace_seed(None, None), 0)
        .iter()
        .map(|h| h.0)
        .collect();
    let lora: Vec<u64> = local_block_hashes(&tokens, 16, namespace_seed(Some("sql"), None), 0)
        .iter()
        .map(|h| h.0)
        .collect();
    let salted: Vec<u64> =
        local_block_hashes(&tokens, 16, namespace_seed(None, Some("tenant-a")), 0)
            .iter()
            .map(|h| h.0)
            .collect();
    let mut index = Index::new(no_cap());
    store_chain(&mut index, wr(0, 0), &lora, Tier::Device);
    store_chain(&mut index, wr(1, 0), &salted, Tier::Device);
    assert!(matches(&index, &plain).is_empty());
    assert_eq!(
        matches(&index, &lora).keys().copied().collect::<Vec<_>>(),
        [wr(0, 0)]
    );
    assert_eq!(
        matches(&index, &salted).keys().copied().collect::<Vec<_>>(),
        [wr(1, 0)]
    );
}

#[test]
fn approximate_entries_expire_after_the_ttl_and_refresh_when_routed_again() {
    let mut index = Index::new(IndexConfig {
        default_capacity: None,
        approx_ttl_ms: 1_000,
    });
    index.record_routing_decision(wr(3, 0), &locals(&[5, 6, 7]), 10_000);
    assert_eq!(matches(&index, &[5, 6, 7])[&wr(3, 0)].0, 3);
    index.record_routing_decision(wr(3, 0), &locals(&[5, 6]), 10_800);
    index.expire(11_000);
    assert_eq!(
        matches(&index, &[5, 6, 7])[&wr(3, 0)].0,
        2,
        "block 7 expired, 5 and 6 were refreshed"
    );
    index.expire(11_799);
    assert_eq!(matches(&index, &[5, 6, 7])[&wr(3, 0)].0, 2);
    index.expire(11_800);
    assert!(matches(&index, &[5, 6, 7]).is_empty());
    assert_eq!(index.counters().approx_expired, 3);
    assert_eq!(index.stats().nodes, 0);
}

#[test]
fn the_residency_cap_bounds_a_rank_and_counts_what_it_drops() {
    let mut index = Index::new(IndexConfig {
        default_capacity: Some(100),
        ..IndexConfig::default()
    });
    for i in 0..300u64 {
        store_chain(&mut index, wr(0, 0), &[1_000 + i, 2_000 + i], Tier::Device);
    }
    let stats = index.stats();
    assert!(stats.residencies <= 100, "{}", stats.residencies);
    assert_eq!(
        index.counters().evicted_over_capacity,
        600 - stats.residencies
    );
    // Another rank is unaffected by the first one's cap.
    store_chain(&mut index, wr(1, 0), &[1, 2, 3], Tier::Device);
    assert_eq!(matches(&index, &[1, 2, 3])[&wr(1, 0)].0, 3);
    index.set_capacity(wr(1, 0), Some(1));
    assert!(
        index
            .stats()
            .per_rank
            .iter()
            .find(|(k, _)| *k == wr(1, 0))
            .map_or(0, |(_, t)| t[0])
            <= 1
    );
}

#[test]
fn conflicting_engine_hashes_stay_private_to_their_worker() {
    let mut index = Index::new(no_cap());
    // Two workers publish the same engine hash 77 for different blocks.
    index.apply(wr(0, 0), &stored(None, &[(77, 1)], Tier::Device));
    index.apply(wr(1, 0), &stored(None, &[(77, 2)], Tier::Device));
    assert_eq!(index.counters().hash_conflicts, 1);
    index.apply(wr(1, 0), &stored(Some(77), &[(78, 3)], Tier::Device));
    assert_eq!(matches(&index, &[2, 3])[&wr(1, 0)].0, 2);
    index.apply(wr(1, 0), &removed(&[77], Tier::Device));
    assert_eq!(
        matches(&index, &[1])[&wr(0, 0)].0,
        1,
        "worker 0's block is untouched"
    );
    assert!(!matches(&index, &[2]).contains_key(&wr(1, 0)));
}

#[test]
fn an_engine_hash_of_zero_names_its_block_for_parents_removals_and_snapshots() {
    // A record keeps 0 for "no engine hash", so 0 is held as a second name.
    let mut index = Index::new(no_cap());
    index.apply(wr(0, 0), &stored(None, &[(0, 1)], Tier::Device));
    index.apply(wr(1, 0), &stored(None, &[(0, 1)], Tier::Device));
    assert_eq!(index.counters().hash_conflicts, 0);
    index.apply(wr(0, 0), &stored(Some(0), &[(5, 2)], Tier::Device));
    assert_eq!(matches(&index, &[1, 2])[&wr(0, 0)].0, 2);
    assert_eq!(index.counters().parent_missing, 0);
    let restored = Index::restore(&index.dump()).expect("restores");
    assert_eq!(matches(&restored, &[1, 2]), matches(&index, &[1, 2]));
    // Another worker naming another block 0 is a conflict, kept private.
    index.apply(wr(2, 0), &stored(None, &[(0, 9)], Tier::Device));
    assert_eq!(index.counters().hash_conflicts, 1);
    index.apply(wr(0, 0), &removed(&[5, 0], Tier::Device));
    let after = matches(&index, &[1]);
    assert!(!after.contains_key(&wr(0, 0)), "{after:?}");
    assert_eq!(after[&wr(1, 0)].0, 1);
    index.apply(wr(1, 0), &removed(&[0], Tier::Device));
    assert!(matches(&index, &[1]).is_empty());
    assert_eq!(matches(&index, &[9])[&wr(2, 0)].0, 1);
    assert_eq!(index.stats().nodes, 1);
}

#[test]
fn an_engine_hash_resolves_only_within_the_worker_that_published_it() {
    let mut index = Index::new(no_cap());
    let x = 5;
    // w0 stores block x as engine hash 10; w1 stores the same block as 11.
    index.apply(wr(0, 0), &stored(None, &[(10, x)], Tier::Device));
    index.apply(wr(1, 0), &stored(None, &[(11, x)], Tier::Device));
    // w1 stores z as hash 10 under a parent it never published: dropped.
    index.apply(wr(1, 0), &stored(Some(999), &[(10, 6)], Tier::Device));
    assert_eq!(index.counters().parent_missing, 1);
    // w1 removes hash 10, which it never published for x: w1 keeps x.
    index.apply(wr(1, 0), &removed(&[10], Tier::Device));
    let both = matches(&index, &[x]);
    assert_eq!((both[&wr(0, 0)].0, both[&wr(1, 0)].0), (1, 1), "{both:?}");
    assert_eq!(index.counters().unknown_removals, 1);
    // w1 stores y under parent hash 10, which it never published: dropped,
    // not attached under x.
    index.apply(wr(1, 0), &stored(Some(10), &[(12, 7)], Tier::Device));
    assert_eq!(
        matches(&index, &[x, 7]).get(&wr(1, 0)).map(|m| m.0),
        Some(1)
    );
    assert_eq!(index.counters().parent_missing, 2);
    // Each worker's own names still work: w1 under 11, w0 under 10.
    index.apply(wr(1, 0), &stored(Some(11), &[(13, 8)], Tier::Device));
    assert_eq!(matches(&index, &[x, 8])[&wr(1, 0)].0, 2);
    index.apply(wr(0, 0), &removed(&[11], Tier::Device));
    assert_eq!(matches(&index, &[x])[&wr(0, 0)].0, 1, "w0 never named x 11");
    index.apply(wr(0, 0), &removed(&[10], Tier::Device));
    index.apply(wr(1, 0), &removed(&[11], Tier::Device));
    assert!(matches(&index, &[x]).is_empty());
    // A snapshot keeps the private names.
    index.apply(wr(1, 0), &stored(None, &[(11, x)], Tier::Device));
    index.apply(wr(0, 0), &stored(None, &[(10, x)], Tier::Device));
    let mut restored = Index::restore(&index.dump()).expect("restores");
    restored.apply(wr(1, 0), &removed(&[10], Tier::Device));
    assert_eq!(matches(&restored, &[x]).len(), 2, "w1 did not name x 10");
}

#[test]
fn holder_lists_grow_and_shrink_with_the_ranks_that_hold_a_block() {
    let mut index = Index::new(no_cap());
    store_chain(&mut index, wr(0, 0), &[1, 2, 3], Tier::Device);
    store_chain(&mut index, wr(0, 0), &[1, 2, 3, 4], Tier::Host);
    for w in 1..200 {
        store_chain(&mut index, wr(w, 0), &[1, 2], Tier::Device);
    }
    let m = matches(&index, &[1, 2, 3, 4]);
    assert_eq!(m.len(), 200);
    assert_eq!(m[&wr(0, 0)], (3, 4, 4));
    assert_eq!(m[&wr(199, 0)], (2, 2, 2));
    // Every rank but the first and the last drops the shared prefix again.
    for w in 1..199 {
        index.apply(
            wr(w, 0),
            &removed(&[ext_of(&[1]), ext_of(&[1, 2])], Tier::Device),
        );
    }
    let m = matches(&index, &[1, 2, 3, 4]);
    assert_eq!(m.len(), 2);
    assert_eq!(m[&wr(0, 0)], (3, 4, 4));
    assert_eq!(m[&wr(199, 0)], (2, 2, 2));
    // A fleet of many ranks costs a one-rank block no more than before.
    let mut wide = Index::new(no_cap());
    for w in 0..5_000 {
        store_chain(&mut wide, wr(w, 0), &[10_000 + u64::from(w)], Tier::Device);
    }
    let per_node = wide.stats().heap_bytes / wide.stats().nodes;
    assert!(per_node < 64, "{per_node} bytes per one-rank node");
}

/// A fleet wider than the walk's stack space (more than 256 slots, first
/// blocks held by lists of more than 16 ranks) answers as a narrow one.
#[test]
fn a_fleet_wider_than_the_walks_stack_space_answers_exactly() {
    let mut index = Index::new(no_cap());
    let ahead = [0u32, 3, 6, 9, 12];
    for w in 0..600 {
        store_chain(&mut index, wr(w, 0), &[1, 2], Tier::Device);
        if w % 3 == 0 {
            store_chain(&mut index, wr(w, 0), &[1, 2, 3], Tier::Device);
        } else if w % 5 == 0 {
            store_chain(&mut index, wr(w, 0), &[1, 2, 3], Tier::Host);
        }
        if ahead.contains(&w) {
            // Few enough to go on as a list walk after block 3.
            store_chain(&mut index, wr(w, 0), &[1, 2, 3, 4, 5], Tier::Device);
        }
    }
    let m = matches(&index, &[1, 2, 3, 4, 5, 6]);
    assert_eq!(m.len(), 600);
    for w in 0..600 {
        let expected = if ahead.contains(&w) {
            (5, 5, 5)
        } else if w % 3 == 0 {
            (3, 3, 3)
        } else if w % 5 == 0 {
            (2, 3, 3)
        } else {
            (2, 2, 2)
        };
        assert_eq!(m[&wr(w, 0)], expected, "rank {w}");
    }
    // 18 holders stay a list in a fleet this wide (its dense threshold is 22).
    for w in 0..18 {
        let chain: &[u64] = if w % 2 == 0 { &[7, 8, 9] } else { &[7, 8] };
        store_chain(&mut index, wr(w, 0), chain, Tier::Device);
    }
    let m = matches(&index, &[7, 8, 9]);
    assert_eq!(m.len(), 18);
    for w in 0..18 {
        let depth = if w % 2 == 0 { 3 } else { 2 };
        assert_eq!(m[&wr(w, 0)], (depth, depth, depth), "rank {w}");
    }
}

/// An index with every kind of state a snapshot carries: 70 ranks (more
/// than one bitmap word in the version 1 layout), a lower tier, a conflict
/// (private bindings) and an approximate entry.
fn snapshot_fixture() -> Index {
    let mut index = Index::new(IndexConfig {
        default_capacity: Some(1_000),
        approx_ttl_ms: 500,
    });
    for w in 0..70 {
        store_chain(
            &mut index,
            wr(w, w % 2),
            &[1, 2, 3 + u64::from(w % 5)],
            Tier::Device,
        );
    }
    store_chain(&mut index, wr(3, 1), &[1, 2, 4, 8], Tier::Disk);
    index.apply(wr(0, 0), &stored(None, &[(77, 1)], Tier::Device));
    index.apply(wr(1, 1), &stored(None, &[(77, 2)], Tier::Device));
    index.record_routing_decision(wr(90, 0), &locals(&[1, 2, 3]), 100);
    index
}

#[test]
fn a_snapshot_in_the_bitmap_layout_of_version_1_is_still_read() {
    // Written by `snapshot_fixture().dump()` before holder lists (commit 80d4412).
    let old = include_bytes!("testdata/snapshot-v1.bin");
    assert_eq!(u32::from_le_bytes([old[8], old[9], old[10], old[11]]), 1);
    let restored = Index::restore(old).expect("a version 1 snapshot restores");
    let index = snapshot_fixture();
    for query in [&[1u64, 2, 3][..], &[1, 2, 4, 8], &[1, 2, 5], &[2], &[77]] {
        assert_eq!(matches(&index, query), matches(&restored, query));
    }
    assert_eq!(index.stats().per_rank, restored.stats().per_rank);
    assert_eq!(restored.dump(), index.dump());
}

#[test]
fn dump_then_restore_answers_identically() {
    let index = snapshot_fixture();
    let bytes = index.dump();
    let restored = Index::restore(&bytes).expect("restores");
    for query in [&[1u64, 2, 3][..], &[1, 2, 4, 8], &[1, 2, 5], &[2]] {
        assert_eq!(matches(&index, query), matches(&restored, query));
    }
    assert_eq!(index.stats().per_rank, restored.stats().per_rank);
    assert_eq!(
        restored.dump(),
        bytes,
        "a restored index dumps to the same bytes"
    );
    let mut expiring = restored.clone();
    expiring.expire(600);
    assert!(!matches(&expiring, &[1, 2, 3]).contains_key(&wr(90, 0)));

    assert_eq!(
        Index::restore(b"garbage!").err(),
        Some(SnapshotError::BadMagic)
    );
    assert!(matches!(
        Index::restore(&bytes[..bytes.len() - 3]),
        Err(SnapshotError::Corrupt(_))
    ));
    let mut newer = bytes.clone();
    newer[8] = 9;
    assert_eq!(
        Index::restore(&newer).err(),
        Some(SnapshotError::UnsupportedVersion { found: 9 })
    );
}

#[test]
fn long_stores_are_applied_in_chunks_with_the_same_result() {
    let chain: Vec<u64> = (1..=500).collect();
    let blocks: Vec<(u64, u64)> = (0..chain.len())
        .map(|d| (ext_of(&chain[..=d]), chain[d]))
        .collect();
    let shared = SharedIndex::new(Index::new(no_cap()));
    shared.apply(wr(0, 0), &stored(None, &blocks, Tier::Device));
    let mut plain = Index::new(no_cap());
    plain.apply(wr(0, 0), &stored(None, &blocks, Tier::Device));
    assert_eq!(shared_matches(&shared, &chain), matches(&plain, &chain));
    assert_eq!(matches(&plain, &chain)[&wr(0, 0)].0, 500);
}

mod model;

#[cfg(feature = "serde")]
#[test]
fn a_dp_rank_serializes_as_its_plain_integer() {
    let rank = DpRank(3);
    assert_eq!(serde_json::to_string(&rank).expect("serializes"), "3");
    assert_eq!(serde_json::from_str::<DpRank>("3").expect("reads"), rank);
    let packed = rmp_serde::to_vec(&rank).expect("packs");
    assert_eq!(packed, rmp_serde::to_vec(&3u32).expect("packs"));
    assert_eq!(rank.to_string(), "3");
}
