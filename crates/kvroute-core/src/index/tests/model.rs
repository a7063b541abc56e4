//! The index against a naive model: random operations applied to an
//! index, to one split into shards and to the model, with every lookup
//! compared; and writers and readers on many threads.

use std::collections::{BTreeMap, HashMap};

use proptest::prelude::*;

use super::*;

/// The naive model: per rank, the set of prefixes held (per tier) and what
/// each engine hash names.
#[derive(Default, Debug)]
struct Model {
    ranks: HashMap<WorkerRank, RankModel>,
}

#[derive(Default, Debug)]
struct RankModel {
    held: HashMap<Vec<u64>, u8>,
    by_ext: HashMap<u64, Vec<u64>>,
}

fn tier_bit(tier: Tier) -> u8 {
    1 << tier_slot(tier)
}

impl Model {
    fn apply(&mut self, key: WorkerRank, event: &KvEvent) {
        match event {
            KvEvent::Stored(s) => {
                let rank = self.ranks.entry(key).or_default();
                let mut chain = match s.parent {
                    None => Vec::new(),
                    Some(p) => match rank.by_ext.get(&p.0) {
                        Some(chain) if rank.held.get(chain).copied().unwrap_or(0) != 0 => {
                            chain.clone()
                        }
                        _ => return,
                    },
                };
                for b in &s.blocks {
                    chain.push(b.local.0);
                    *rank.held.entry(chain.clone()).or_default() |= tier_bit(s.tier);
                    rank.by_ext.insert(b.external.0, chain.clone());
                }
            }
            KvEvent::Removed(r) => {
                let Some(rank) = self.ranks.get_mut(&key) else {
                    return;
                };
                for ext in &r.blocks {
                    let Some(chain) = rank.by_ext.get(&ext.0).cloned() else {
                        continue;
                    };
                    if let Some(tiers) = rank.held.get_mut(&chain) {
                        *tiers &= !tier_bit(r.tier);
                        if *tiers == 0 {
                            rank.held.remove(&chain);
                            rank.by_ext.remove(&ext.0);
                        }
                    }
                }
            }
            KvEvent::Cleared => {
                self.ranks.remove(&key);
            }
            // The model has no hybrid groups (the generators make none).
            KvEvent::Group(_) => {}
        }
    }

    fn find(&self, query: &[u64]) -> BTreeMap<WorkerRank, (u32, u32, u32)> {
        let mut out = BTreeMap::new();
        for (&key, rank) in &self.ranks {
            let depth = |mask: u8| {
                (0..query.len())
                    .take_while(|&i| rank.held.get(&query[..=i]).is_some_and(|t| t & mask != 0))
                    .count() as u32
            };
            let m = (depth(0b0001), depth(0b0011), depth(0b1111));
            if m.2 > 0 {
                out.insert(key, m);
            }
        }
        out
    }
}

#[derive(Debug, Clone)]
enum Op {
    /// Store `len` blocks on rank `rank` under the `parent`-th chain it holds (or the root).
    Store {
        rank: u8,
        parent: Option<u8>,
        locals: Vec<u8>,
        tier: u8,
    },
    /// Store under an engine hash nobody published.
    StoreOrphan {
        rank: u8,
    },
    Remove {
        rank: u8,
        pick: u8,
        tier: u8,
    },
    Clear {
        rank: u8,
    },
    RemoveWorker {
        worker: u8,
    },
    Lookup {
        rank: u8,
        pick: u8,
        extra: Vec<u8>,
    },
}

/// Ops over `ranks` ranks (two per worker).
fn op(ranks: u8) -> impl Strategy<Value = Op> {
    op_mix(ranks, 5, 1)
}

/// [`op`] with `stores` in 15 + stores − 5 ops stores and `clears` clears
/// (and as many worker removals).
fn op_mix(ranks: u8, stores: u32, clears: u32) -> impl Strategy<Value = Op> {
    prop_oneof![
        stores => (0u8..ranks, proptest::option::of(any::<u8>()), proptest::collection::vec(0u8..4, 1..5), 0u8..4)
            .prop_map(|(rank, parent, locals, tier)| Op::Store { rank, parent, locals, tier }),
        1 => (0u8..ranks).prop_map(|rank| Op::StoreOrphan { rank }),
        3 => (0u8..ranks, any::<u8>(), 0u8..4).prop_map(|(rank, pick, tier)| Op::Remove { rank, pick, tier }),
        clears => (0u8..ranks).prop_map(|rank| Op::Clear { rank }),
        clears => (0u8..ranks / 2).prop_map(|worker| Op::RemoveWorker { worker }),
        4 => (0u8..ranks, any::<u8>(), proptest::collection::vec(0u8..4, 0..3))
            .prop_map(|(rank, pick, extra)| Op::Lookup { rank, pick, extra }),
    ]
}

fn key_of(rank: u8) -> WorkerRank {
    wr(u32::from(rank / 2), u32::from(rank % 2))
}

/// The `pick`-th chain a rank holds in the model, in a stable order.
fn held_chain(model: &Model, rank: u8, pick: u8) -> Option<Vec<u64>> {
    let r = model.ranks.get(&key_of(rank))?;
    let mut chains: Vec<&Vec<u64>> = r.held.keys().collect();
    chains.sort();
    (!chains.is_empty()).then(|| chains[pick as usize % chains.len()].clone())
}

/// Turns an op into an event (or a lookup) using the model's current state.
fn event_for(model: &Model, op: &Op) -> Option<(WorkerRank, KvEvent)> {
    let tier = |t: u8| TIERS[t as usize % 4];
    match op {
        Op::Store {
            rank,
            parent,
            locals,
            tier: t,
        } => {
            let mut chain = match parent {
                None => Vec::new(),
                Some(p) => held_chain(model, *rank, *p).unwrap_or_default(),
            };
            let parent_ext = (!chain.is_empty()).then(|| ext_of(&chain));
            let blocks: Vec<(u64, u64)> = locals
                .iter()
                .map(|&l| {
                    chain.push(u64::from(l) + 1);
                    (ext_of(&chain), u64::from(l) + 1)
                })
                .collect();
            Some((key_of(*rank), stored(parent_ext, &blocks, tier(*t))))
        }
        Op::StoreOrphan { rank } => Some((
            key_of(*rank),
            stored(Some(0xdead), &[(ext_of(&[9, 9]), 9)], Tier::Device),
        )),
        Op::Remove {
            rank,
            pick,
            tier: t,
        } => {
            let ext = held_chain(model, *rank, *pick).map_or(0xbeef, |c| ext_of(&c));
            Some((key_of(*rank), removed(&[ext], tier(*t))))
        }
        Op::Clear { rank } => Some((key_of(*rank), KvEvent::Cleared)),
        _ => None,
    }
}

fn query_for(model: &Model, rank: u8, pick: u8, extra: &[u8]) -> Vec<u64> {
    let mut q = held_chain(model, rank, pick).unwrap_or_default();
    q.extend(extra.iter().map(|&l| u64::from(l) + 1));
    q
}

/// Applies `ops` to an index, to an index split into shards and to the
/// naive model, checking every lookup and, at the end, every chain held, the
/// totals and the snapshots.
fn check_against_model(ops: &[Op]) -> Result<(), TestCaseError> {
    let mut index = Index::new(no_cap());
    // The same events through an index split into shards of ranks.
    let sharded = SharedIndex::sharded(Index::new(no_cap()), 3);
    let mut model = Model::default();
    for op in ops {
        match op {
            Op::RemoveWorker { worker } => {
                index.remove_worker(WorkerId(u32::from(*worker)));
                sharded.remove_worker(WorkerId(u32::from(*worker)));
                model
                    .ranks
                    .retain(|k, _| k.worker != WorkerId(u32::from(*worker)));
            }
            Op::Lookup { rank, pick, extra } => {
                let q = query_for(&model, *rank, *pick, extra);
                prop_assert_eq!(matches(&index, &q), model.find(&q), "query {:?}", q);
                prop_assert_eq!(
                    shared_matches(&sharded, &q),
                    model.find(&q),
                    "sharded {:?}",
                    q
                );
            }
            _ => {
                if let Some((key, event)) = event_for(&model, op) {
                    index.apply(key, &event);
                    sharded.apply(key, &event);
                    model.apply(key, &event);
                }
            }
        }
    }
    prop_assert_eq!(sharded.stats().residencies, index.stats().residencies);
    // Conflicts are seen between ranks of one shard only.
    let without_conflicts = |c: IndexCounters| IndexCounters {
        hash_conflicts: 0,
        ..c
    };
    prop_assert_eq!(
        without_conflicts(sharded.counters()),
        without_conflicts(index.counters())
    );
    // The shards merge into one snapshot, which splits again into two.
    let merged = Index::restore(&sharded.dump()).expect("a merged snapshot restores");
    let resplit = SharedIndex::sharded(merged.clone(), 2);
    for rank in model.ranks.values() {
        for chain in rank.held.keys() {
            prop_assert_eq!(matches(&merged, chain), model.find(chain));
            prop_assert_eq!(shared_matches(&resplit, chain), model.find(chain));
        }
    }
    // Every chain any rank holds, and the totals, agree at the end.
    let residencies: usize = model
        .ranks
        .values()
        .map(|r| {
            r.held
                .values()
                .map(|t| t.count_ones() as usize)
                .sum::<usize>()
        })
        .sum();
    prop_assert_eq!(index.stats().residencies as usize, residencies);
    for rank in model.ranks.values() {
        for chain in rank.held.keys() {
            prop_assert_eq!(matches(&index, chain), model.find(chain));
        }
    }
    let restored = Index::restore(&index.dump()).expect("restores");
    for rank in model.ranks.values() {
        for chain in rank.held.keys() {
            prop_assert_eq!(matches(&restored, chain), model.find(chain));
        }
    }
    Ok(())
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 256, failure_persistence: None, ..ProptestConfig::default() })]

    #[test]
    fn every_lookup_agrees_with_the_naive_model(ops in proptest::collection::vec(op(6), 1..120)) {
        check_against_model(&ops)?;
    }
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 48, failure_persistence: None, ..ProptestConfig::default() })]

    /// Enough ranks on few short chains that blocks are held by more than
    /// the dense threshold (16), so lists become bitmaps and back.
    #[test]
    fn every_lookup_agrees_with_the_naive_model_when_many_ranks_share_blocks(
        ops in proptest::collection::vec(op_mix(40, 12, 1), 300..600)
    ) {
        // Then all ranks but two leave, so the bitmaps become lists again.
        let mut ops = ops;
        for rank in 2..40 {
            ops.push(Op::Clear { rank });
            ops.push(Op::Lookup { rank: rank % 2, pick: rank, extra: vec![1] });
        }
        check_against_model(&ops)?;
    }
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 16, failure_persistence: None, ..ProptestConfig::default() })]

    /// The same over 150 ranks: dense sets three words wide, so a bitmap
    /// walk's result rows span words.
    #[test]
    fn every_lookup_agrees_with_the_naive_model_when_dense_sets_span_words(
        ops in proptest::collection::vec(op_mix(150, 12, 1), 1200..1600)
    ) {
        check_against_model(&ops)?;
    }
}

#[test]
fn concurrent_writers_and_readers_end_equal_to_the_model() {
    // Two shards, and each writer's ranks in both: writers meet in each shard.
    let shared = SharedIndex::sharded(Index::new(no_cap()), 2);
    // Each writer owns its ranks, as ingestion does; readers look up all the time.
    let scripts: Vec<Vec<(WorkerRank, KvEvent)>> = (0..2u32)
        .map(|w| {
            let mut events = Vec::new();
            for i in 0..400u64 {
                let chain: Vec<u64> = (0..(1 + i % 70))
                    .map(|d| (d * 7 + i % 3) % 11 + 1)
                    .collect();
                let blocks: Vec<(u64, u64)> = (0..chain.len())
                    .map(|d| (ext_of(&chain[..=d]), chain[d]))
                    .collect();
                let key = wr(w, (i % 2) as u32);
                events.push((key, stored(None, &blocks, Tier::Device)));
                if i % 5 == 0 {
                    events.push((key, removed(&[blocks[blocks.len() / 2].0], Tier::Device)));
                }
                if i % 97 == 0 {
                    events.push((key, KvEvent::Cleared));
                }
            }
            events
        })
        .collect();
    std::thread::scope(|scope| {
        for script in &scripts {
            let shared = &shared;
            scope.spawn(move || {
                for (key, event) in script {
                    shared.apply(*key, event);
                }
            });
        }
        for _ in 0..2 {
            let shared = &shared;
            scope.spawn(move || {
                for i in 0..3_000u64 {
                    let q: Vec<u64> = (0..(1 + i % 70))
                        .map(|d| (d * 7 + i % 3) % 11 + 1)
                        .collect();
                    for m in shared.find_matches(&sequence_hashes(&locals(&q))) {
                        assert!(
                            m.device as usize <= q.len() && m.device <= m.host && m.host <= m.any
                        );
                    }
                }
            });
        }
    });
    let mut model = Model::default();
    for script in &scripts {
        for (key, event) in script {
            model.apply(*key, event);
        }
    }
    for rank in model.ranks.values() {
        for chain in rank.held.keys() {
            assert_eq!(shared_matches(&shared, chain), model.find(chain));
        }
    }
}
