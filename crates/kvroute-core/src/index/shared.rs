//! The index shared by many reader threads and the writers of every rank,
//! split into shards of ranks so that writers of different shards apply in
//! parallel.
//!
//! Each (worker, rank) belongs to one shard, fixed by its ids, and a shard is
//! a whole [`Index`] of its ranks behind its own read-write lock. Everything a
//! rank's events touch (its residencies, its engine-hash bindings, its cap
//! and its guesses) is in its shard, so applying an event locks one shard and
//! never waits for another. A lookup reads every shard in turn and joins the
//! answers; a block held by ranks of several shards has a node in each.
//!
//! Concurrency contract:
//! * events of one rank must be applied in order, by one thread at a time
//!   (the ingestion design); events of different ranks may be applied from
//!   any number of threads;
//! * a lookup sees each write section of a shard whole or not at all, and
//!   each rank's answer comes from one consistent state of that rank; ranks
//!   of different shards may be seen at slightly different moments, as they
//!   would be with one lock taken twice;
//! * writes are short: a stored event of more than
//!   [`SharedIndex::MAX_BLOCKS_PER_WRITE`] blocks is applied in chunks, each
//!   chained to the previous chunk's last block;
//! * writers are polite: after each write section a writer waits (briefly,
//!   bounded) until readers that were waiting for that shard have it;
//! * an engine hash that names different blocks on two workers is counted
//!   as a conflict when both are in one shard (it is kept private to each
//!   worker either way);
//! * [`SharedIndex::frozen`] holds every shard's read lock at once, for a
//!   snapshot that is one moment of the whole index.

use std::hint::spin_loop;
use std::sync::atomic::{AtomicU32, Ordering};
use std::sync::{PoisonError, RwLock, RwLockReadGuard, RwLockWriteGuard};

use super::{Index, IndexConfig, IndexCounters, IndexStats, RankMatch, WorkerId, WorkerRank};
use crate::event::{KvEvent, Removed, Stored};
use crate::hash::{LocalBlockHash, SequenceHash};

/// One shard: an index of some ranks and the readers waiting for it.
#[derive(Debug, Default)]
struct Shard {
    inner: RwLock<Index>,
    waiting_readers: AtomicU32,
}

/// An [`Index`] split into shards of ranks, each behind a read-write lock,
/// with bounded, reader-friendly writes.
#[derive(Debug)]
pub struct SharedIndex {
    config: IndexConfig,
    shards: Box<[Shard]>,
}

impl Default for SharedIndex {
    fn default() -> Self {
        SharedIndex::new(Index::default())
    }
}

/// Spins a reader makes before it sleeps on the lock; a write section is a few
/// microseconds, so most waits end spinning.
const READER_SPINS: u32 = 4_000;

/// Longest a polite writer waits for waiting readers (spin iterations).
const WRITER_COURTESY_SPINS: u32 = 20_000;

/// The most shards an index is split into.
pub const MAX_SHARDS: usize = 64;

impl Shard {
    fn new(index: Index) -> Self {
        Shard {
            inner: RwLock::new(index),
            waiting_readers: AtomicU32::new(0),
        }
    }

    /// Read access. A panic in another holder does not make the shard unreadable.
    fn read(&self) -> RwLockReadGuard<'_, Index> {
        if let Ok(guard) = self.inner.try_read() {
            return guard;
        }
        self.waiting_readers.fetch_add(1, Ordering::AcqRel);
        let mut guard = None;
        for _ in 0..READER_SPINS {
            if let Ok(g) = self.inner.try_read() {
                guard = Some(g);
                break;
            }
            spin_loop();
        }
        let guard =
            guard.unwrap_or_else(|| self.inner.read().unwrap_or_else(PoisonError::into_inner));
        self.waiting_readers.fetch_sub(1, Ordering::AcqRel);
        guard
    }

    fn write(&self) -> RwLockWriteGuard<'_, Index> {
        self.inner.write().unwrap_or_else(PoisonError::into_inner)
    }

    /// One write section, then room for the readers that waited meanwhile.
    fn write_section(&self, f: impl FnOnce(&mut Index)) {
        f(&mut self.write());
        let mut spins = 0;
        while self.waiting_readers.load(Ordering::Acquire) > 0 && spins < WRITER_COURTESY_SPINS {
            spin_loop();
            spins += 1;
        }
    }
}

impl SharedIndex {
    /// Blocks applied under one write lock at most.
    pub const MAX_BLOCKS_PER_WRITE: usize = 16;

    /// Shares an index as one shard.
    pub fn new(index: Index) -> Self {
        SharedIndex::sharded(index, 1)
    }

    /// Shares an index split into `shards` shards of ranks (1 to [`MAX_SHARDS`]).
    pub fn sharded(index: Index, shards: usize) -> Self {
        let count = shards.clamp(1, MAX_SHARDS);
        let config = index.config().clone();
        SharedIndex {
            config,
            shards: split(index, count).into_iter().map(Shard::new).collect(),
        }
    }

    /// The settings every shard has.
    pub fn config(&self) -> &IndexConfig {
        &self.config
    }

    /// How many shards the index is split into.
    pub fn shard_count(&self) -> usize {
        self.shards.len()
    }

    /// The shard a rank belongs to: consecutive workers and ranks spread
    /// evenly, and the same ids always land in the same shard.
    pub fn shard_of(&self, key: WorkerRank) -> usize {
        shard_of(key, self.shards.len())
    }

    fn shard(&self, key: WorkerRank) -> &Shard {
        &self.shards[self.shard_of(key)]
    }

    /// Looks up a request's blocks in every shard (see [`Index::find_matches`]).
    pub fn find_matches(&self, seqs: &[SequenceHash]) -> Vec<RankMatch> {
        let mut shards = self.shards.iter();
        let Some(first) = shards.next() else {
            return Vec::new();
        };
        let mut out = first.read().find_matches(seqs);
        for shard in shards {
            out.extend(shard.read().find_matches(seqs));
        }
        out
    }

    /// Applies one event of a rank, in write sections of bounded length.
    pub fn apply(&self, key: WorkerRank, event: &KvEvent) {
        let shard = self.shard(key);
        match event {
            KvEvent::Stored(stored) if stored.blocks.len() > Self::MAX_BLOCKS_PER_WRITE => {
                let mut parent = stored.parent;
                for chunk in stored.blocks.chunks(Self::MAX_BLOCKS_PER_WRITE) {
                    let part = Stored {
                        parent,
                        blocks: chunk.to_vec(),
                        ..stored.header()
                    };
                    shard.write_section(|index| index.apply(key, &KvEvent::Stored(part)));
                    parent = chunk.last().map(|b| b.external);
                }
            }
            KvEvent::Removed(removed) if removed.blocks.len() > Self::MAX_BLOCKS_PER_WRITE => {
                for chunk in removed.blocks.chunks(Self::MAX_BLOCKS_PER_WRITE) {
                    let part = Removed {
                        blocks: chunk.to_vec(),
                        tier: removed.tier,
                    };
                    shard.write_section(|index| index.apply(key, &KvEvent::Removed(part)));
                }
            }
            other => shard.write_section(|index| index.apply(key, other)),
        }
    }

    /// Drops everything one rank holds (see [`Index::clear_rank`]).
    pub fn clear_rank(&self, key: WorkerRank) {
        self.shard(key).write_section(|index| index.clear_rank(key));
    }

    /// Drops every rank of a worker and forgets them.
    pub fn remove_worker(&self, worker: WorkerId) {
        for shard in self.shards.iter() {
            shard.write_section(|index| index.remove_worker(worker));
        }
    }

    /// Sets a rank's residency cap (see [`Index::set_capacity`]).
    pub fn set_capacity(&self, key: WorkerRank, capacity: Option<u64>) {
        self.shard(key)
            .write_section(|index| index.set_capacity(key, capacity));
    }

    /// Records a routing decision to a rank without events (see
    /// [`Index::record_routing_decision`]).
    pub fn record_routing_decision(&self, key: WorkerRank, locals: &[LocalBlockHash], now_ms: u64) {
        self.shard(key)
            .write_section(|index| index.record_routing_decision(key, locals, now_ms));
    }

    /// What a rank's engine reported holding (see [`Index::learn_cached_prefix`]).
    pub fn learn_cached_prefix(
        &self,
        key: WorkerRank,
        locals: &[LocalBlockHash],
        held: usize,
        now_ms: u64,
    ) {
        self.shard(key)
            .write_section(|index| index.learn_cached_prefix(key, locals, held, now_ms));
    }

    /// Expires approximate residencies whose deadline has passed, in every shard.
    pub fn expire(&self, now_ms: u64) {
        for shard in self.shards.iter() {
            shard.write_section(|index| index.expire(now_ms));
        }
    }

    /// Every shard's state at one moment, read-locked until dropped: writers
    /// wait meanwhile, lookups go on.
    pub fn frozen(&self) -> Frozen<'_> {
        Frozen {
            shards: self.shards.iter().map(Shard::read).collect(),
        }
    }

    /// Sizes, per rank and in total (see [`Frozen::stats`]).
    pub fn stats(&self) -> IndexStats {
        self.frozen().stats()
    }

    /// Cumulative counts of every shard.
    pub fn counters(&self) -> IndexCounters {
        self.frozen().counters()
    }

    /// The ranks the index knows.
    pub fn ranks(&self) -> Vec<WorkerRank> {
        let mut ranks: Vec<WorkerRank> = self
            .frozen()
            .shards
            .iter()
            .flat_map(|s| s.ranks())
            .collect();
        ranks.sort();
        ranks
    }

    /// The whole index as one snapshot (see [`Index::dump`]).
    pub fn dump(&self) -> Vec<u8> {
        self.frozen().dump()
    }

    /// Replaces the whole index (e.g. by one restored from a snapshot),
    /// split into the same number of shards. Every shard is write-locked
    /// until all are replaced, so no lookup sees a mix of old and new.
    pub fn replace(&self, index: Index) {
        let parts = split(index, self.shards.len());
        let mut guards: Vec<RwLockWriteGuard<'_, Index>> =
            self.shards.iter().map(Shard::write).collect();
        for (guard, part) in guards.iter_mut().zip(parts) {
            **guard = part;
        }
    }
}

/// Every shard read-locked at once: see [`SharedIndex::frozen`].
pub struct Frozen<'a> {
    shards: Vec<RwLockReadGuard<'a, Index>>,
}

impl Frozen<'_> {
    /// Sizes, per rank and in total. A block held by ranks of several shards
    /// counts as a node in each.
    pub fn stats(&self) -> IndexStats {
        let mut total = IndexStats {
            nodes: 0,
            residencies: 0,
            per_rank: Vec::new(),
            heap_bytes: 0,
        };
        for shard in &self.shards {
            let stats = shard.stats();
            total.nodes += stats.nodes;
            total.residencies += stats.residencies;
            total.per_rank.extend(stats.per_rank);
            total.heap_bytes += stats.heap_bytes;
        }
        total.per_rank.sort_by_key(|(k, _)| *k);
        total
    }

    /// Cumulative counts of every shard.
    pub fn counters(&self) -> IndexCounters {
        self.shards
            .iter()
            .map(|s| s.counters())
            .fold(IndexCounters::default(), |a, b| a.plus(&b))
    }

    /// The whole index as one snapshot, whatever the shard count.
    pub fn dump(&self) -> Vec<u8> {
        match &self.shards[..] {
            [one] => one.dump(),
            shards => {
                let Some(first) = shards.first() else {
                    return Index::default().dump();
                };
                let mut merged = first.empty_like();
                for shard in shards {
                    shard.copy_ranks_into(&mut merged, |_| true);
                }
                merged.dump()
            }
        }
    }
}

/// The shard of a rank among `count`.
fn shard_of(key: WorkerRank, count: usize) -> usize {
    let n = count.max(1) as u64;
    ((u64::from(key.worker.0) + u64::from(key.rank.0)) % n) as usize
}

/// Splits an index into `count` indexes of its ranks by [`shard_of`].
fn split(index: Index, count: usize) -> Vec<Index> {
    if count <= 1 {
        return vec![index];
    }
    (0..count)
        .map(|i| {
            let mut part = index.empty_like();
            index.copy_ranks_into(&mut part, |key| shard_of(key, count) == i);
            part
        })
        .collect()
}

impl IndexCounters {
    /// The sum of two sets of counts.
    fn plus(&self, other: &IndexCounters) -> IndexCounters {
        IndexCounters {
            stores: self.stores + other.stores,
            blocks_stored: self.blocks_stored + other.blocks_stored,
            duplicate_blocks: self.duplicate_blocks + other.duplicate_blocks,
            parent_missing: self.parent_missing + other.parent_missing,
            blocks_removed: self.blocks_removed + other.blocks_removed,
            unknown_removals: self.unknown_removals + other.unknown_removals,
            clears: self.clears + other.clears,
            evicted_over_capacity: self.evicted_over_capacity + other.evicted_over_capacity,
            hash_conflicts: self.hash_conflicts + other.hash_conflicts,
            approx_expired: self.approx_expired + other.approx_expired,
        }
    }
}

impl Stored {
    /// The event without its blocks and tokens (for splitting it).
    fn header(&self) -> Stored {
        Stored {
            parent: self.parent,
            blocks: Vec::new(),
            tier: self.tier,
            block_size: self.block_size,
            lora_name: self.lora_name.clone(),
            cache_salt: self.cache_salt.clone(),
            lookahead: self.lookahead,
            dropped_blocks: 0,
            token_ids: None,
            image_items: None,
        }
    }
}
