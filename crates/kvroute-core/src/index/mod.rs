//! The prefix index: which (worker, rank) holds which blocks, on which tier.
//!
//! Fed by decoded [`KvEvent`]s, it answers one question fast: for a request's
//! local block hashes, how many *leading* blocks does each (worker, rank) hold
//! on its device, and how many counting host and disk copies too?
//!
//! Design (see `docs/architecture.md` for the measurements behind it):
//! * a block is identified by its **sequence hash**, the chain of local hashes
//!   from the first block to it, so one hash-table probe finds the node for
//!   "this block after exactly this prefix", and a lookup is a walk of probes;
//! * each node holds a sorted list of the (worker, rank)s that hold it, with
//!   their tiers, inline when one rank does; a node costs what its holders
//!   cost, whatever the size of the fleet, and a lookup step over a block
//!   held by the same ranks as the previous one costs one comparison;
//! * engine hashes map to nodes so that parents and removals, which name blocks
//!   only by engine hash, resolve. Engines hash deterministically (the same
//!   prefix gets the same engine hash on every worker of a deployment), so the
//!   map is shared by all workers: a node's first engine hash is its shared
//!   name. A worker that names a block otherwise (another hash for the same
//!   block, or a hash another worker uses for another block, the latter
//!   counted as a conflict) gets a private binding, and an engine hash
//!   resolves only within the worker that published it: a worker's parents
//!   and removals never reach a block through another worker's name for it.
//!
//! Guarantees: a match never extends past a block the worker does not hold
//! (prefix semantics: a worker's match stops at its first missing block); a
//! store whose parent the worker does not hold is dropped whole, never
//! attached elsewhere; duplicate stores and removals of unknown blocks change
//! nothing. Memory is bounded per (worker, rank) by a residency cap. A
//! hybrid model's rank is credited only with the prefix its window and state
//! groups accept too (`hybrid`).
//!
//! The index is single-writer: `&mut self` applies events, `&self` answers
//! lookups. [`SharedIndex`] splits it into shards of ranks for many reader
//! threads and parallel writers.

mod dense;
mod feedback;
mod holders;
mod hybrid;
mod layout;
mod nodes;
mod regroup;
mod shared;
mod snapshot;
mod walk;

use std::collections::VecDeque;

use rustc_hash::FxHashMap;

use crate::event::{GroupBlocks, KvEvent, Removed, Stored, Tier};
use crate::hash::{next_sequence_hash, LocalBlockHash, SequenceHash};
use nodes::{map_heap_bytes, Bind, NodeId, NodeStore, SlotId};

pub use layout::IndexLayout;
pub use shared::{Frozen, SharedIndex, MAX_SHARDS};
pub use snapshot::SnapshotError;

/// A worker, as numbered by the registry that owns worker names.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct WorkerId(pub u32);

/// A data-parallel rank within one worker (0 for a worker without data
/// parallelism): typed so that it cannot be mixed up with a worker id, a
/// count or a sequence number on its way from the registry to the proxy.
/// It goes out (headers, bodies, labels, JSON) as the plain integer.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord, Default)]
#[cfg_attr(
    feature = "serde",
    derive(serde::Serialize, serde::Deserialize),
    serde(transparent)
)]
pub struct DpRank(pub u32);

impl std::fmt::Display for DpRank {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        self.0.fmt(f)
    }
}

/// One data-parallel rank of a worker: the unit that caches blocks.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct WorkerRank {
    /// The worker.
    pub worker: WorkerId,
    /// Its data-parallel rank.
    pub rank: DpRank,
}

impl WorkerRank {
    /// Rank `rank` of worker `worker`, from plain numbers (tests, tables).
    pub const fn new(worker: u32, rank: u32) -> Self {
        WorkerRank {
            worker: WorkerId(worker),
            rank: DpRank(rank),
        }
    }
}

/// Index settings.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct IndexConfig {
    /// Residencies kept per (worker, rank) unless [`Index::set_capacity`] says
    /// otherwise; `None` for no bound. Exceeding it means removals were lost:
    /// the index then drops arbitrary residencies of that rank down to 90 % of it.
    pub default_capacity: Option<u64>,
    /// How long an approximate (routing-decision) entry lives, in milliseconds.
    pub approx_ttl_ms: u64,
}

impl Default for IndexConfig {
    fn default() -> Self {
        IndexConfig {
            default_capacity: Some(4 << 20),
            approx_ttl_ms: 120_000,
        }
    }
}

/// What one (worker, rank) holds of a query's leading blocks.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct RankMatch {
    /// The worker rank.
    pub worker_rank: WorkerRank,
    /// Leading blocks held on the device.
    pub device: u32,
    /// Leading blocks held on the device or in host memory.
    pub host: u32,
    /// Leading blocks held on any tier (device, host, disk or external).
    pub any: u32,
}

/// Cumulative counts of what the index did, for metrics.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct IndexCounters {
    /// Stored events applied.
    pub stores: u64,
    /// Residencies added by stores.
    pub blocks_stored: u64,
    /// Blocks stored again where the rank already held them (idempotent).
    pub duplicate_blocks: u64,
    /// Stored events dropped because the rank does not hold their parent.
    pub parent_missing: u64,
    /// Residencies removed by removal events.
    pub blocks_removed: u64,
    /// Removal hashes naming a block the rank does not hold.
    pub unknown_removals: u64,
    /// Ranks cleared (events, `clear_rank`, `remove_worker`).
    pub clears: u64,
    /// Residencies dropped to keep a rank under its cap.
    pub evicted_over_capacity: u64,
    /// Engine hashes that named different blocks on different workers.
    pub hash_conflicts: u64,
    /// Approximate residencies that expired.
    pub approx_expired: u64,
}

/// The size of the index.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct IndexStats {
    /// Distinct block prefixes held by at least one rank.
    pub nodes: u64,
    /// (block, rank, tier) residencies.
    pub residencies: u64,
    /// Residencies per rank and tier (device, host, disk, external).
    pub per_rank: Vec<(WorkerRank, [u64; 4])>,
    /// Heap bytes held by the index's tables, from their capacities.
    pub heap_bytes: u64,
}

/// One (worker, rank)'s bookkeeping.
#[derive(Debug, Clone)]
struct Slot {
    key: WorkerRank,
    capacity: Option<u64>,
    per_tier: [u64; 4],
    /// Engine hashes this rank names a block by that are not the block's
    /// shared name: engine hash → (node, sequence hash).
    private_ext: FxHashMap<u64, (NodeId, u64)>,
    /// The same bindings by node: node → (engine hash, sequence hash). A
    /// node here is not named by its shared engine hash for this rank.
    private_name: FxHashMap<NodeId, (u64, u64)>,
    /// Approximate residencies: deadline per node, and deadlines in order.
    approx_deadline: FxHashMap<NodeId, u64>,
    approx_queue: VecDeque<(u64, NodeId)>,
    /// Where the next over-capacity sweep starts.
    sweep_cursor: NodeId,
    /// A hybrid model's window and state groups, once it has published any.
    hybrid: Option<Box<hybrid::Hybrid>>,
}

impl Slot {
    fn new(key: WorkerRank, capacity: Option<u64>) -> Self {
        Slot {
            key,
            capacity,
            per_tier: [0; 4],
            private_ext: FxHashMap::default(),
            private_name: FxHashMap::default(),
            approx_deadline: FxHashMap::default(),
            approx_queue: VecDeque::new(),
            sweep_cursor: 0,
            hybrid: None,
        }
    }

    fn residencies(&self) -> u64 {
        self.per_tier.iter().sum()
    }
}

fn tier_slot(tier: Tier) -> usize {
    match tier {
        Tier::Device => 0,
        Tier::Host => 1,
        Tier::Disk => 2,
        Tier::External => 3,
    }
}

const TIERS: [Tier; 4] = [Tier::Device, Tier::Host, Tier::Disk, Tier::External];

/// The name of a free slot: no rank has it.
const VACANT: WorkerRank = WorkerRank::new(u32::MAX, u32::MAX);

/// The prefix index. See the module docs for its design and guarantees.
#[derive(Debug, Clone)]
pub struct Index {
    config: IndexConfig,
    nodes: NodeStore,
    slot_of: FxHashMap<WorkerRank, SlotId>,
    slots: Vec<Option<Slot>>,
    /// The rank of each slot in use, beside `slots`: a lookup names every
    /// rank it returns, and these are a few cache lines, the slots many
    /// ([`VACANT`] for a free slot).
    keys: Vec<WorkerRank>,
    free_slots: Vec<SlotId>,
    counters: IndexCounters,
    /// Ranks with window or state groups: lookups cap only when there are some.
    hybrid_ranks: usize,
}

impl Default for Index {
    fn default() -> Self {
        Index::new(IndexConfig::default())
    }
}

impl Index {
    /// An empty index.
    pub fn new(config: IndexConfig) -> Self {
        Index {
            config,
            nodes: NodeStore::default(),
            slot_of: FxHashMap::default(),
            slots: Vec::new(),
            keys: Vec::new(),
            free_slots: Vec::new(),
            counters: IndexCounters::default(),
            hybrid_ranks: 0,
        }
    }

    /// The settings.
    pub fn config(&self) -> &IndexConfig {
        &self.config
    }

    /// Cumulative counts since creation.
    pub fn counters(&self) -> IndexCounters {
        self.counters
    }

    /// The slot of a rank, registering it on first sight.
    fn slot(&mut self, key: WorkerRank) -> SlotId {
        if let Some(&slot) = self.slot_of.get(&key) {
            return slot;
        }
        let slot = self.occupy_slot(key, self.config.default_capacity);
        let words_needed = (slot as usize / 64) + 1;
        if words_needed > self.nodes.dense_words() {
            // Double, so registering many ranks re-lays the dense sets O(log n) times.
            self.nodes
                .widen(words_needed.max(self.nodes.dense_words() * 2));
        }
        self.slot_of.insert(key, slot);
        slot
    }

    /// A free slot (or a new one) given to `key`.
    fn occupy_slot(&mut self, key: WorkerRank, capacity: Option<u64>) -> SlotId {
        match self.free_slots.pop() {
            Some(slot) => {
                self.slots[slot as usize] = Some(Slot::new(key, capacity));
                self.keys[slot as usize] = key;
                slot
            }
            None => {
                self.slots.push(Some(Slot::new(key, capacity)));
                self.keys.push(key);
                SlotId::try_from(self.slots.len() - 1).unwrap_or(SlotId::MAX)
            }
        }
    }

    /// Frees a slot for reuse.
    fn vacate_slot(&mut self, slot: SlotId) {
        if let Some(s) = self.slots.get_mut(slot as usize) {
            if s.as_ref().is_some_and(|s| s.hybrid.is_some()) {
                self.hybrid_ranks -= 1;
            }
            *s = None;
            self.keys[slot as usize] = VACANT;
            self.free_slots.push(slot);
        }
    }

    fn slot_mut(&mut self, slot: SlotId) -> Option<&mut Slot> {
        self.slots.get_mut(slot as usize).and_then(Option::as_mut)
    }

    /// Sets a rank's residency cap (e.g. its engine's block capacity once known).
    pub fn set_capacity(&mut self, key: WorkerRank, capacity: Option<u64>) {
        let slot = self.slot(key);
        if let Some(s) = self.slot_mut(slot) {
            s.capacity = capacity;
        }
        self.enforce_capacity(slot);
    }

    /// Applies one event of one rank. Events of one rank must come in order.
    pub fn apply(&mut self, key: WorkerRank, event: &KvEvent) {
        match event {
            KvEvent::Stored(stored) => self.store(key, stored),
            KvEvent::Removed(removed) => self.remove(key, removed),
            KvEvent::Cleared => self.clear_rank(key),
            KvEvent::Group(group) => self.apply_group(key, group),
        }
    }

    /// A hybrid model's window or state group stored or evicted blocks.
    fn apply_group(&mut self, key: WorkerRank, group: &GroupBlocks) {
        let slot = self.slot(key);
        let Some(s) = self.slot_mut(slot) else { return };
        let created = s.hybrid.is_none();
        let capacity = s.capacity;
        s.hybrid
            .get_or_insert_with(Box::default)
            .apply(group, capacity);
        if created {
            self.hybrid_ranks += 1;
        }
    }

    /// The node an engine hash names for this rank: its private binding, or
    /// the node whose shared name it is, unless this rank names that node
    /// otherwise. Another rank's name for a block never resolves here.
    /// `near`: a node the block is likely next to (see [`NodeStore::find_primary_near`]).
    fn resolve_ext(&self, slot: SlotId, ext: u64, near: Option<NodeId>) -> Option<NodeId> {
        // Private bindings are rare: most ranks have none to look in.
        let s = self
            .slots
            .get(slot as usize)
            .and_then(Option::as_ref)
            .filter(|s| !s.private_ext.is_empty());
        let same_block =
            |node: NodeId, seq: u64| self.nodes.is_live(node) && self.nodes.seq(node) == seq;
        if let Some(&(node, seq)) = s.and_then(|s| s.private_ext.get(&ext)) {
            // A private binding holds while its node still is the same block.
            return same_block(node, seq).then_some(node);
        }
        // Second names resolve through their rank's private binding above,
        // never through the shared aliases.
        let node = self.nodes.find_primary_near(ext, near)?;
        match s.and_then(|s| s.private_name.get(&node)) {
            Some(&(_, seq)) if same_block(node, seq) => None,
            _ => Some(node),
        }
    }

    /// Records that this rank names `node` (the block `seq`) by `ext`, which
    /// is not the node's shared name.
    fn bind_private(&mut self, slot: SlotId, node: NodeId, seq: u64, ext: u64) {
        if let Some(s) = self.slot_mut(slot) {
            if let Some((old, _)) = s.private_name.insert(node, (ext, seq)) {
                if old != ext {
                    s.private_ext.remove(&old);
                }
            }
            s.private_ext.insert(ext, (node, seq));
        }
    }

    /// Forgets this rank's private name `ext`, if it has one.
    fn unbind_private(&mut self, slot: SlotId, ext: u64) {
        if let Some(s) = self.slot_mut(slot).filter(|s| !s.private_ext.is_empty()) {
            if let Some((node, _)) = s.private_ext.remove(&ext) {
                s.private_name.remove(&node);
            }
        }
    }

    fn store(&mut self, key: WorkerRank, stored: &Stored) {
        let slot = self.slot(key);
        self.counters.stores += 1;
        let mut prev: Option<u64> = None;
        let mut prev_node: Option<NodeId> = None;
        if let Some(parent) = stored.parent {
            match self.resolve_ext(slot, parent.0, None) {
                Some(node) if self.nodes.tiers_of(node, slot) != 0 => {
                    prev = Some(self.nodes.seq(node));
                    prev_node = Some(node);
                }
                _ => {
                    self.counters.parent_missing += 1;
                    return;
                }
            }
        }
        for block in &stored.blocks {
            let seq = match prev {
                None => block.local.0,
                Some(p) => next_sequence_hash(SequenceHash(p), block.local).0,
            };
            let node = self.nodes.insert_seq_near(seq, prev_node);
            let ext = block.external.0;
            let bind = self.nodes.bind_ext(node, ext);
            if bind != Bind::Primary {
                if bind == Bind::Conflict && self.resolve_ext(slot, ext, None) != Some(node) {
                    self.counters.hash_conflicts += 1;
                }
                self.bind_private(slot, node, seq, ext);
            }
            self.add_residency(slot, node, stored.tier);
            if let Some(s) = self
                .slot_mut(slot)
                .filter(|s| !s.approx_deadline.is_empty())
            {
                // The engine's own word replaces a guess: it no longer expires.
                s.approx_deadline.remove(&node);
            }
            prev = Some(seq);
            prev_node = Some(node);
        }
        self.enforce_capacity(slot);
    }

    fn add_residency(&mut self, slot: SlotId, node: NodeId, tier: Tier) {
        if self.nodes.set(node, slot, tier) {
            self.counters.blocks_stored += 1;
            if let Some(s) = self.slot_mut(slot) {
                s.per_tier[tier_slot(tier)] += 1;
            }
        } else {
            self.counters.duplicate_blocks += 1;
        }
    }

    /// Drops a residency; frees the node when nobody holds it any more.
    fn drop_residency(&mut self, slot: SlotId, node: NodeId, tier: Tier) -> bool {
        if !self.nodes.clear(node, slot, tier) {
            return false;
        }
        if let Some(s) = self.slot_mut(slot) {
            let count = &mut s.per_tier[tier_slot(tier)];
            *count = count.saturating_sub(1);
        }
        self.nodes.free_if_empty(node);
        true
    }

    fn remove(&mut self, key: WorkerRank, removed: &Removed) {
        let Some(&slot) = self.slot_of.get(&key) else {
            self.counters.unknown_removals += removed.blocks.len() as u64;
            return;
        };
        // A removal's blocks are mostly one chain's, whose nodes sit side by side.
        let mut near: Option<NodeId> = None;
        for ext in &removed.blocks {
            let node = self.resolve_ext(slot, ext.0, near);
            near = node.or(near);
            let dropped = match node {
                Some(node) => self.drop_residency(slot, node, removed.tier),
                None => false,
            };
            if dropped {
                self.counters.blocks_removed += 1;
                self.unbind_private(slot, ext.0);
            } else {
                self.counters.unknown_removals += 1;
            }
        }
    }

    /// Drops everything one rank holds (its engine reset its cache, or its state
    /// can no longer be trusted).
    pub fn clear_rank(&mut self, key: WorkerRank) {
        let Some(&slot) = self.slot_of.get(&key) else {
            return;
        };
        self.counters.clears += 1;
        let nodes: Vec<NodeId> = self
            .nodes
            .live_ids()
            .filter(|&n| self.nodes.tiers_of(n, slot) != 0)
            .collect();
        for node in nodes {
            for tier in TIERS {
                self.drop_residency(slot, node, tier);
            }
        }
        if let Some(s) = self.slot_mut(slot) {
            let mut fresh = Slot::new(s.key, s.capacity);
            // A hybrid model stays one: its groups keep their rules, not their blocks.
            fresh.hybrid = s.hybrid.take().map(|mut h| {
                h.clear();
                h
            });
            *s = fresh;
        }
    }

    /// Drops every rank of a worker and forgets them.
    pub fn remove_worker(&mut self, worker: WorkerId) {
        let keys: Vec<WorkerRank> = self
            .slot_of
            .keys()
            .filter(|k| k.worker == worker)
            .copied()
            .collect();
        for key in keys {
            self.clear_rank(key);
            if let Some(slot) = self.slot_of.remove(&key) {
                self.vacate_slot(slot);
            }
        }
    }

    /// The ranks the index knows.
    pub fn ranks(&self) -> Vec<WorkerRank> {
        let mut keys: Vec<WorkerRank> = self.slot_of.keys().copied().collect();
        keys.sort();
        keys
    }

    /// Drops arbitrary residencies of a rank over its cap, down to 90 % of it.
    fn enforce_capacity(&mut self, slot: SlotId) {
        let Some(s) = self.slots.get(slot as usize).and_then(Option::as_ref) else {
            return;
        };
        let Some(cap) = s.capacity else { return };
        if s.residencies() <= cap {
            return;
        }
        let target = cap - cap / 10;
        let capacity = self.nodes.capacity() as NodeId;
        let mut cursor = s.sweep_cursor;
        let mut visited: NodeId = 0;
        while visited < capacity {
            let resident = self.slots[slot as usize]
                .as_ref()
                .map_or(0, Slot::residencies);
            if resident <= target {
                break;
            }
            if cursor >= capacity {
                cursor = 0;
            }
            if self.nodes.is_live(cursor) && self.nodes.tiers_of(cursor, slot) != 0 {
                for tier in TIERS {
                    if self.drop_residency(slot, cursor, tier) {
                        self.counters.evicted_over_capacity += 1;
                    }
                }
                if let Some(s) = self.slot_mut(slot) {
                    s.approx_deadline.remove(&cursor);
                }
            }
            cursor += 1;
            visited += 1;
        }
        if let Some(s) = self.slot_mut(slot) {
            s.sweep_cursor = cursor;
        }
    }

    /// For each rank holding at least the first block on some tier: how many
    /// leading blocks of a request it holds on the device, on device or
    /// host, and on any tier. Ranks are returned in slot order. The request
    /// is given as its blocks' sequence hashes
    /// ([`crate::hash::sequence_hashes`]), which the router computes once for
    /// its in-flight accounting and every shard's lookup then shares.
    pub fn find_matches(&self, seqs: &[SequenceHash]) -> Vec<RankMatch> {
        let mut matches = walk::find_matches(&self.nodes, seqs, |slot| {
            self.keys.get(slot as usize).copied()
        });
        if self.hybrid_ranks > 0 {
            for m in &mut matches {
                self.cap_hybrid(m, seqs);
            }
        }
        matches
    }

    /// Caps a hybrid rank's match to the prefixes its window and state
    /// groups accept (see `hybrid`).
    fn cap_hybrid(&self, m: &mut RankMatch, seqs: &[SequenceHash]) {
        let Some(&slot) = self.slot_of.get(&m.worker_rank) else {
            return;
        };
        let Some(s) = self.slots.get(slot as usize).and_then(Option::as_ref) else {
            return;
        };
        let Some(groups) = s.hybrid.as_deref() else {
            return;
        };
        // The engine hash this rank names each matched block by.
        let exts: Vec<Option<u64>> = seqs
            .iter()
            .take(m.any as usize)
            .map(|seq| {
                let node = self.nodes.find_seq(seq.0)?;
                match s.private_name.get(&node) {
                    Some(&(ext, bound)) if bound == seq.0 => Some(ext),
                    _ => self.nodes.primary_ext(node),
                }
            })
            .collect();
        m.device = groups.cap(&exts, m.device, hybrid::DEVICE_MASK);
        m.host = groups.cap(&exts, m.host, hybrid::HOST_MASK).max(m.device);
        m.any = groups.cap(&exts, m.any, hybrid::ANY_MASK).max(m.host);
    }

    /// Records that a request with these local hashes was routed to a rank of
    /// an engine that publishes no events: its blocks are assumed cached on
    /// the device for `approx_ttl_ms`, refreshed each time they are routed again.
    pub fn record_routing_decision(
        &mut self,
        key: WorkerRank,
        locals: &[LocalBlockHash],
        now_ms: u64,
    ) {
        let slot = self.slot(key);
        self.expire_slot(slot, now_ms);
        let deadline = now_ms.saturating_add(self.config.approx_ttl_ms);
        let mut prev: Option<u64> = None;
        for local in locals {
            let seq = match prev {
                None => local.0,
                Some(p) => next_sequence_hash(SequenceHash(p), *local).0,
            };
            let node = self.nodes.insert_seq(seq);
            self.add_residency(slot, node, Tier::Device);
            if let Some(s) = self.slot_mut(slot) {
                s.approx_deadline.insert(node, deadline);
                s.approx_queue.push_back((deadline, node));
            }
            prev = Some(seq);
        }
        self.enforce_capacity(slot);
    }

    /// Expires approximate residencies whose deadline has passed.
    pub fn expire(&mut self, now_ms: u64) {
        for slot in 0..self.slots.len() {
            self.expire_slot(slot as SlotId, now_ms);
        }
    }

    fn expire_slot(&mut self, slot: SlotId, now_ms: u64) {
        loop {
            let Some(s) = self.slot_mut(slot) else { return };
            let Some(&(deadline, node)) = s.approx_queue.front() else {
                return;
            };
            if deadline > now_ms {
                return;
            }
            s.approx_queue.pop_front();
            if s.approx_deadline.get(&node) != Some(&deadline) {
                continue; // refreshed since, or already gone
            }
            s.approx_deadline.remove(&node);
            if self.drop_residency(slot, node, Tier::Device) {
                self.counters.approx_expired += 1;
            }
        }
    }

    /// Sizes, per rank and in total.
    pub fn stats(&self) -> IndexStats {
        let mut per_rank: Vec<(WorkerRank, [u64; 4])> = self
            .slots
            .iter()
            .flatten()
            .map(|s| (s.key, s.per_tier))
            .collect();
        per_rank.sort_by_key(|(k, _)| *k);
        let residencies = per_rank.iter().map(|(_, t)| t.iter().sum::<u64>()).sum();
        IndexStats {
            nodes: self.nodes.live() as u64,
            residencies,
            per_rank,
            heap_bytes: (self.nodes.heap_bytes() + self.rank_heap_bytes()) as u64,
        }
    }

    /// Heap bytes of the per-rank bookkeeping (private bindings, guesses).
    fn rank_heap_bytes(&self) -> usize {
        self.slots
            .iter()
            .flatten()
            .map(|s| {
                map_heap_bytes::<u64, (NodeId, u64)>(s.private_ext.capacity())
                    + map_heap_bytes::<NodeId, (u64, u64)>(s.private_name.capacity())
                    + map_heap_bytes::<NodeId, u64>(s.approx_deadline.capacity())
                    + s.approx_queue.capacity() * std::mem::size_of::<(u64, NodeId)>()
            })
            .sum()
    }
}

#[cfg(test)]
mod tests;
