//! The KV block pool: a fixed number of blocks, a prefix cache by digest, LRU eviction.
//!
//! Invariants (checked by `check_invariants` in tests):
//! * every block is in exactly one state: *in use* (`ref_cnt > 0`, pinned by
//!   running requests, cached or not), *evictable* (unreferenced and cached: in
//!   the LRU), or *free* (unreferenced, not cached);
//! * a digest maps to at most one block, and that block carries the digest;
//! * allocation takes a free block first and evicts only when none is left,
//!   the least recently released evictable block first. Requests release their
//!   blocks tail first, so a chain's leaves are evicted before their parents.

use std::collections::BTreeMap;

use rustc_hash::FxHashMap;

use crate::hashing::Digest32;

/// Index of a block in the pool.
pub(crate) type BlockId = u32;

/// What a cached block is known by.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct CachedKey {
    /// The engine's full digest (prefix-cache key).
    pub digest: Digest32,
    /// The 64 bits the engine publishes for it.
    pub published: u64,
}

#[derive(Debug, Clone, Default)]
struct Block {
    ref_cnt: u32,
    key: Option<CachedKey>,
    /// Release stamp while evictable (its key in `evictable`).
    stamp: u64,
}

/// The pool of one rank.
#[derive(Debug, Clone)]
pub(crate) struct BlockPool {
    blocks: Vec<Block>,
    /// Unreferenced, uncached blocks (a stack, for deterministic reuse).
    free: Vec<BlockId>,
    /// Unreferenced cached blocks by release stamp: the first entry is the LRU.
    evictable: BTreeMap<u64, BlockId>,
    by_digest: FxHashMap<Digest32, BlockId>,
    next_stamp: u64,
}

impl BlockPool {
    /// A pool of `n` free blocks.
    pub fn new(n: usize) -> Self {
        let n = u32::try_from(n).unwrap_or(u32::MAX);
        BlockPool {
            blocks: vec![Block::default(); n as usize],
            free: (0..n).rev().collect(),
            evictable: BTreeMap::new(),
            by_digest: FxHashMap::default(),
            next_stamp: 0,
        }
    }

    /// Total blocks.
    pub fn capacity(&self) -> usize {
        self.blocks.len()
    }

    /// Blocks that an allocation can obtain (free plus evictable).
    pub fn available(&self) -> usize {
        self.free.len() + self.evictable.len()
    }

    /// Blocks pinned by running requests.
    pub fn in_use(&self) -> usize {
        self.capacity() - self.available()
    }

    /// Cached blocks (in use or evictable).
    pub fn cached(&self) -> usize {
        self.by_digest.len()
    }

    /// The block caching `digest`, if any.
    pub fn lookup(&self, digest: &Digest32) -> Option<BlockId> {
        self.by_digest.get(digest).copied()
    }

    /// True when acquiring this block takes it out of the evictable set.
    pub fn is_evictable(&self, id: BlockId) -> bool {
        let b = &self.blocks[id as usize];
        b.ref_cnt == 0 && b.key.is_some()
    }

    /// Pins a cached block for a request (a prefix-cache hit).
    pub fn acquire(&mut self, id: BlockId) {
        let b = &mut self.blocks[id as usize];
        if b.ref_cnt == 0 && b.key.is_some() {
            self.evictable.remove(&b.stamp);
        }
        b.ref_cnt += 1;
    }

    /// Unpins a block; an unreferenced cached block becomes the most recently used evictable one.
    pub fn release(&mut self, id: BlockId) {
        let stamp = self.next_stamp;
        let b = &mut self.blocks[id as usize];
        debug_assert!(b.ref_cnt > 0, "release of an unreferenced block");
        b.ref_cnt = b.ref_cnt.saturating_sub(1);
        if b.ref_cnt == 0 {
            if b.key.is_some() {
                b.stamp = stamp;
                self.next_stamp += 1;
                self.evictable.insert(stamp, id);
            } else {
                self.free.push(id);
            }
        }
    }

    /// A new block for a request (pinned once). Evicts the LRU cached block when
    /// no free block is left and pushes its published hash to `evicted`.
    pub fn allocate(&mut self, evicted: &mut Vec<u64>) -> Option<BlockId> {
        let id = match self.free.pop() {
            Some(id) => id,
            None => {
                let (_, id) = self.evictable.pop_first()?;
                let b = &mut self.blocks[id as usize];
                if let Some(key) = b.key.take() {
                    self.by_digest.remove(&key.digest);
                    evicted.push(key.published);
                }
                id
            }
        };
        self.blocks[id as usize].ref_cnt = 1;
        Some(id)
    }

    /// Caches a full, pinned block under `key`. Fails with the existing block
    /// when another block already caches the same digest.
    pub fn register(&mut self, id: BlockId, key: CachedKey) -> Result<(), BlockId> {
        if let Some(&existing) = self.by_digest.get(&key.digest) {
            return Err(existing);
        }
        self.by_digest.insert(key.digest, id);
        self.blocks[id as usize].key = Some(key);
        Ok(())
    }

    /// Forgets every cached digest (`reset_prefix_cache`): evictable blocks
    /// become free, pinned blocks stay pinned but uncached.
    pub fn clear_cache(&mut self) {
        self.by_digest.clear();
        for b in &mut self.blocks {
            b.key = None;
        }
        let released: Vec<BlockId> = std::mem::take(&mut self.evictable).into_values().collect();
        self.free.extend(released);
    }

    /// Everything back to free (an engine restart).
    pub fn reset(&mut self) {
        *self = BlockPool::new(self.blocks.len());
    }

    /// Panics when a documented invariant is broken (tests only).
    #[cfg(test)]
    pub fn check_invariants(&self) {
        let mut states = vec![0u8; self.blocks.len()];
        for &id in &self.free {
            states[id as usize] += 1;
            assert_eq!(self.blocks[id as usize].ref_cnt, 0);
            assert!(self.blocks[id as usize].key.is_none());
        }
        for (&stamp, &id) in &self.evictable {
            states[id as usize] += 1;
            let b = &self.blocks[id as usize];
            assert_eq!((b.ref_cnt, b.stamp), (0, stamp));
            assert!(b.key.is_some());
        }
        for (i, b) in self.blocks.iter().enumerate() {
            if b.ref_cnt > 0 {
                states[i] += 1;
            }
            if let Some(key) = b.key {
                assert_eq!(self.by_digest.get(&key.digest), Some(&(i as BlockId)));
            }
        }
        assert!(states.iter().all(|&s| s == 1), "a block in 0 or 2 states");
        assert_eq!(
            self.by_digest.len(),
            self.blocks.iter().filter(|b| b.key.is_some()).count()
        );
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn key(n: u8) -> CachedKey {
        CachedKey {
            digest: [n; 32],
            published: u64::from(n),
        }
    }

    #[test]
    fn free_blocks_go_first_then_the_least_recently_released_cached_block() {
        let mut pool = BlockPool::new(3);
        let mut evicted = Vec::new();
        let ids: Vec<BlockId> = (0..3)
            .map(|_| pool.allocate(&mut evicted).expect("free block"))
            .collect();
        for (i, &id) in ids.iter().enumerate() {
            pool.register(id, key(i as u8 + 1)).expect("new digest");
        }
        assert!(pool.allocate(&mut evicted).is_none(), "all pinned");
        // Release tail first: block 3, then 2, then 1 → LRU order 3, 2, 1.
        for &id in ids.iter().rev() {
            pool.release(id);
        }
        pool.check_invariants();
        assert_eq!(pool.available(), 3);
        pool.allocate(&mut evicted).expect("evicts");
        pool.allocate(&mut evicted).expect("evicts");
        assert_eq!(evicted, [3, 2]);
        assert_eq!(pool.lookup(&[1; 32]), Some(ids[0]));
        assert_eq!(pool.lookup(&[3; 32]), None);
        pool.check_invariants();
    }

    #[test]
    fn a_hit_pins_an_evictable_block_and_duplicates_are_refused() {
        let mut pool = BlockPool::new(2);
        let mut evicted = Vec::new();
        let a = pool.allocate(&mut evicted).expect("free");
        pool.register(a, key(9)).expect("new");
        pool.release(a);
        assert!(pool.is_evictable(a));
        pool.acquire(a);
        assert!(!pool.is_evictable(a));
        let b = pool.allocate(&mut evicted).expect("free");
        assert_eq!(pool.register(b, key(9)), Err(a));
        assert!(
            pool.allocate(&mut evicted).is_none(),
            "a is pinned, b in use"
        );
        pool.check_invariants();
    }

    #[test]
    fn clearing_the_cache_frees_evictable_blocks_and_uncaches_pinned_ones() {
        let mut pool = BlockPool::new(2);
        let mut evicted = Vec::new();
        let a = pool.allocate(&mut evicted).expect("free");
        let b = pool.allocate(&mut evicted).expect("free");
        pool.register(a, key(1)).expect("new");
        pool.register(b, key(2)).expect("new");
        pool.release(a);
        pool.clear_cache();
        pool.check_invariants();
        assert_eq!(pool.cached(), 0);
        pool.release(b);
        pool.check_invariants();
        assert_eq!(pool.available(), 2);
        pool.allocate(&mut evicted).expect("free");
        assert!(evicted.is_empty(), "no eviction of cleared blocks");
    }
}
