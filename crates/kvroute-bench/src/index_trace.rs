//! `kvroute bench index --trace FILE`: the index replaying a Mooncake-format
//! trace over a simulated fleet, as Dynamo's indexer benchmark does.
//!
//! Each request goes to the worker that holds the longest run of its leading
//! blocks (ties to a seeded coin), as a KV-aware router places it; that
//! worker stores the blocks it lacks under the last one it holds, and when
//! its cache of `blocks_per_worker` blocks is full it evicts least recently
//! used blocks, tails before heads (a request touches its blocks from the
//! last to the first). Engine hashes are the trace's hash ids. The events
//! are generated first; the timed parts are applying them to an empty index
//! and then looking up every request's blocks.

use std::collections::BTreeMap;
use std::time::Instant;

use kvroute_core::event::{ExternalHash, KvEvent, Removed, Stored, StoredBlock, Tier};
use kvroute_core::hash::{sequence_hashes, LocalBlockHash, SequenceHash};
use kvroute_core::index::{Index, IndexConfig, WorkerRank};
use kvroute_core::rng::{mix, SplitMix64};
use rustc_hash::FxHashMap;
use serde_json::{json, Value};

use crate::error::{Error, Result};
use crate::mooncake::{Trace, TRACE_BLOCK_TOKENS};
use crate::stats;

/// How the trace is replayed.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct TraceReplayConfig {
    /// Simulated workers (one rank each).
    pub workers: u32,
    /// Blocks each worker's cache holds.
    pub blocks_per_worker: u64,
    /// Seed of the ties between workers.
    pub seed: u64,
}

/// One simulated worker's cache: block → last use, and last use → block.
#[derive(Debug, Default)]
struct Cache {
    used: FxHashMap<u64, u64>,
    by_use: BTreeMap<u64, u64>,
}

impl Cache {
    fn touch(&mut self, block: u64, now: u64) {
        if let Some(old) = self.used.insert(block, now) {
            self.by_use.remove(&old);
        }
        self.by_use.insert(now, block);
    }

    fn evict_to(&mut self, capacity: u64) -> Vec<u64> {
        let mut gone = Vec::new();
        while self.used.len() as u64 > capacity {
            let Some((_, block)) = self.by_use.pop_first() else {
                break;
            };
            self.used.remove(&block);
            gone.push(block);
        }
        gone
    }

    /// Leading blocks of `ids` held.
    fn depth(&self, ids: &[u64]) -> usize {
        ids.iter().take_while(|b| self.used.contains_key(b)).count()
    }
}

/// A trace block's local hash: any fixed function of its id.
fn local(id: u64) -> LocalBlockHash {
    LocalBlockHash(mix(id ^ 0x6D6F_6F6E))
}

fn stored(parent: Option<u64>, ids: &[u64]) -> KvEvent {
    let blocks = ids
        .iter()
        .map(|&id| StoredBlock {
            external: ExternalHash(id),
            local: local(id),
        })
        .collect();
    KvEvent::Stored(Stored::plain(
        parent.map(ExternalHash),
        blocks,
        Tier::Device,
        TRACE_BLOCK_TOKENS as u32,
    ))
}

/// The fleet's events for the whole trace, with their block operations.
fn events(trace: &Trace, config: &TraceReplayConfig) -> (Vec<(WorkerRank, KvEvent)>, u64) {
    let mut caches: Vec<Cache> = (0..config.workers).map(|_| Cache::default()).collect();
    let mut rng = SplitMix64::new(config.seed);
    let mut out = Vec::new();
    let (mut ops, mut clock) = (0u64, 0u64);
    for r in trace.requests.iter() {
        let depths: Vec<usize> = caches.iter().map(|c| c.depth(&r.hash_ids)).collect();
        let best = depths.iter().copied().max().unwrap_or(0);
        let tied: Vec<usize> = (0..caches.len()).filter(|&w| depths[w] == best).collect();
        let w = tied[rng.below(tied.len())];
        let key = WorkerRank::new(w as u32, 0);
        if best < r.hash_ids.len() {
            let parent = best.checked_sub(1).map(|i| r.hash_ids[i]);
            out.push((key, stored(parent, &r.hash_ids[best..])));
            ops += (r.hash_ids.len() - best) as u64;
        }
        for &id in r.hash_ids.iter().rev() {
            clock += 1;
            caches[w].touch(id, clock);
        }
        let gone = caches[w].evict_to(config.blocks_per_worker);
        if !gone.is_empty() {
            ops += gone.len() as u64;
            let blocks = gone.into_iter().map(ExternalHash).collect();
            out.push((
                key,
                KvEvent::Removed(Removed {
                    blocks,
                    tier: Tier::Device,
                }),
            ));
        }
    }
    (out, ops)
}

/// Replays the trace: the figures as one JSON object.
pub fn replay(trace: &Trace, config: &TraceReplayConfig) -> Result<Value> {
    if config.workers == 0 || config.blocks_per_worker == 0 {
        return Err(Error::Invalid(
            "a trace replay needs workers and blocks per worker".into(),
        ));
    }
    eprintln!(
        "[bench index] replaying {} ({} requests) over {} workers of {} blocks",
        trace.name,
        trace.requests.len(),
        config.workers,
        config.blocks_per_worker
    );
    let (events, ops) = events(trace, config);
    let mut rates = Vec::new();
    let mut index = Index::new(IndexConfig::default());
    for _ in 0..3 {
        let mut fresh = Index::new(IndexConfig {
            default_capacity: None,
            ..IndexConfig::default()
        });
        let start = Instant::now();
        for (key, event) in &events {
            fresh.apply(*key, event);
        }
        rates.push(ops as f64 / start.elapsed().as_secs_f64());
        index = fresh;
    }
    let queries: Vec<Vec<SequenceHash>> = trace
        .requests
        .iter()
        .map(|r| sequence_hashes(&r.hash_ids.iter().map(|&id| local(id)).collect::<Vec<_>>()))
        .collect();
    let mut micros = Vec::with_capacity(queries.len());
    let mut matched = 0u64;
    for q in &queries {
        let start = Instant::now();
        let best = index.find_matches(q).iter().map(|m| m.device).max();
        micros.push(start.elapsed().as_nanos() as f64 / 1_000.0);
        matched += u64::from(best.unwrap_or(0));
    }
    let micros = stats::sorted(micros);
    let residencies = index.stats().residencies;
    Ok(json!({
        "trace": trace.name,
        "requests": trace.requests.len(),
        "workers": config.workers,
        "blocks_per_worker": config.blocks_per_worker,
        "events": events.len(),
        "block_ops": ops,
        "residencies": residencies,
        "apply_block_ops_per_s": stats::median(&stats::sorted(rates)).round(),
        "mean_query_blocks": queries.iter().map(Vec::len).sum::<usize>() as f64 / queries.len().max(1) as f64,
        "mean_matched_device_blocks": matched as f64 / queries.len().max(1) as f64,
        "lookup_p50_us": stats::percentile(&micros, 0.50),
        "lookup_p99_us": stats::percentile(&micros, 0.99),
        "lookup_max_us": stats::max(&micros),
    }))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::mooncake::{synthesize, SynthesisConfig};

    #[test]
    fn a_replay_holds_at_most_the_fleets_blocks_and_finds_the_reuse() {
        let trace = synthesize(&SynthesisConfig {
            requests: 400,
            ..SynthesisConfig::default()
        });
        let config = TraceReplayConfig {
            workers: 8,
            blocks_per_worker: 40,
            seed: 1,
        };
        let report = replay(&trace, &config).expect("replays");
        let residencies = report["residencies"].as_u64().expect("residencies");
        assert!(residencies > 0 && residencies <= 8 * 40, "{report}");
        assert!(
            report["mean_matched_device_blocks"].as_f64() > Some(0.5),
            "{report}"
        );
        assert!(report["apply_block_ops_per_s"].as_f64() > Some(0.0));
        // The events are the same for the same trace and seed.
        assert_eq!(events(&trace, &config).1, events(&trace, &config).1);
        assert!(replay(
            &trace,
            &TraceReplayConfig {
                workers: 0,
                ..config
            }
        )
        .is_err());
    }
}
