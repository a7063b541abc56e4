//! Replication of hot prefixes: a prefix whose holder stays saturated for
//! longer than a bound is copied, ahead of demand, to a second rank (the
//! engines' own hand-off, as a fetch moves it), so that later requests of
//! the prefix split between two holders instead of queueing on one.
//!
//! The holder is *saturated* for a request when moving the prefix would be
//! cheaper than running there ([`super::fetch::plan_fetch`] plans a fetch
//! off it, whether or not the fetch is then made). A prefix saturated at
//! every request for `hot_for_ms` is copied to the rank the fetch would
//! choose, unless that rank's budget of replicated blocks is spent. A
//! replica is counted against its rank's budget until the rank no longer
//! shows the prefix (its cache evicted it): the budget bounds what copies
//! may take from a rank's own prefixes. Pure: the caller makes the copy.

use std::collections::HashMap;
use std::hash::{DefaultHasher, Hash, Hasher};

use super::candidates::Scored;
use super::fetch::Fetch;
use crate::index::WorkerRank;

/// When a hot prefix is copied to a second rank.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ReplicaConfig {
    /// How long a prefix's holder must stay saturated, in ms.
    pub hot_for_ms: u64,
    /// Replicated blocks a rank may hold at once.
    pub budget_blocks: u64,
}

impl Default for ReplicaConfig {
    /// Saturated for 2 s; 256 blocks per rank (one `long` prefix of 128
    /// blocks twice over).
    fn default() -> Self {
        ReplicaConfig {
            hot_for_ms: 2_000,
            budget_blocks: 256,
        }
    }
}

/// A copy to make: `blocks` leading blocks of the request's prefix from
/// `source` to `target` (positions in the scored candidates).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Replicate {
    /// The holder's position.
    pub source: usize,
    /// The receiver's position.
    pub target: usize,
    /// The target's key: whose budget the copy is charged to.
    pub target_key: WorkerRank,
    /// Leading blocks copied (the holder's less the target's own).
    pub blocks: u32,
}

/// The prefixes seen hot and the replicas made (see the module docs).
#[derive(Debug, Clone, Default)]
pub struct Replicator {
    config: ReplicaConfig,
    /// Since when (ms) each prefix's holder has been saturated.
    hot_since: HashMap<u64, u64>,
    /// Replicas made: (prefix, rank) → blocks.
    replicas: HashMap<(u64, WorkerRank), u32>,
    /// Replicated blocks each rank holds.
    spent: HashMap<WorkerRank, u64>,
}

/// The key of a prompt's prefix: its first `block_size` tokens (a group of
/// requests sharing a first block shares a holder).
pub fn prefix_key(tokens: &[u32], block_size: u32) -> u64 {
    let n = tokens.len().min(block_size.max(1) as usize);
    let mut h = DefaultHasher::new();
    tokens[..n].hash(&mut h);
    h.finish()
}

impl Replicator {
    /// A replicator with nothing hot and no replica.
    pub fn new(config: ReplicaConfig) -> Self {
        Replicator {
            config,
            ..Replicator::default()
        }
    }

    /// Replicated blocks `rank` holds now.
    pub fn spent(&self, rank: WorkerRank) -> u64 {
        self.spent.get(&rank).copied().unwrap_or(0)
    }

    /// One request of prefix `key` at `now_ms`: `fetch` is what the fetch
    /// rule planned off its holder (`None`: the holder is fine). Returns the copy to make, if the
    /// prefix has been hot long enough and the target has budget left; replicas the ranks no longer
    /// show are released first.
    pub fn observe(
        &mut self,
        key: u64,
        scored: &[Scored],
        fetch: Option<&Fetch>,
        now_ms: u64,
    ) -> Option<Replicate> {
        self.release_evicted(key, scored);
        let Some(f) = fetch else {
            self.hot_since.remove(&key);
            return None;
        };
        self.hot_since.entry(key).or_insert(now_ms);
        let copy = self.due(key, scored, f, now_ms)?;
        *self.spent.entry(copy.target_key).or_insert(0) += u64::from(copy.blocks);
        self.replicas.insert((key, copy.target_key), copy.blocks);
        // Hot again only if the two holders saturate in turn.
        self.hot_since.remove(&key);
        Some(copy)
    }

    /// The copy [`Replicator::observe`] would make for the same request,
    /// nothing recorded (what `/query` shows).
    pub fn preview(
        &self,
        key: u64,
        scored: &[Scored],
        fetch: Option<&Fetch>,
        now_ms: u64,
    ) -> Option<Replicate> {
        self.due(key, scored, fetch?, now_ms)
    }

    /// The copy of `fetch`'s blocks due now: the prefix hot for long
    /// enough (since now when it was not hot yet) and the target's budget
    /// not spent.
    fn due(&self, key: u64, scored: &[Scored], f: &Fetch, now_ms: u64) -> Option<Replicate> {
        let since = self.hot_since.get(&key).copied().unwrap_or(now_ms);
        if now_ms.saturating_sub(since) < self.config.hot_for_ms {
            return None;
        }
        let target = scored.get(f.receiver)?;
        if self.spent(target.key) + u64::from(f.blocks) > self.config.budget_blocks {
            return None;
        }
        Some(Replicate {
            source: f.source,
            target: f.receiver,
            target_key: target.key,
            blocks: f.blocks,
        })
    }

    /// Releases the budget of prefix `key`'s replicas on ranks that show
    /// less than half of the blocks copied there.
    fn release_evicted(&mut self, key: u64, scored: &[Scored]) {
        for s in scored {
            let Some(&blocks) = self.replicas.get(&(key, s.key)) else {
                continue;
            };
            if s.candidate.device_blocks * 2 < blocks {
                self.replicas.remove(&(key, s.key));
                if let Some(spent) = self.spent.get_mut(&s.key) {
                    *spent = spent.saturating_sub(u64::from(blocks));
                }
            }
        }
    }
}

#[cfg(test)]
mod tests;
