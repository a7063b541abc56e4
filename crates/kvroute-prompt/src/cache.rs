//! A bounded cache of token ids by text, shared by every request thread.
//!
//! System prompts and earlier chat turns come back request after request; a
//! piece of text between added tokens always has the same ids (see
//! `tokenizer/split.rs`), so they are tokenized once and copied afterwards.
//!
//! * **Bounded by bytes**: an entry weighs its text, its ids (4 bytes each)
//!   and a fixed overhead; the cache never holds more than its capacity. An
//!   entry heavier than a shard's share is simply not kept.
//! * **Eviction**: CLOCK (second chance), an LRU approximation: a hit sets an
//!   entry's reference bit; the clock hand clears set bits and evicts the
//!   first entry whose bit is clear. New entries start clear, so a text seen
//!   once is the first to go.
//! * **Concurrency**: 16 shards, each behind its own mutex, chosen by the
//!   text's hash; a lookup holds one lock for a hash probe and a comparison.
//! * **Exact**: entries are found by hash and then compared by full text, so a
//!   hash collision can never return another text's ids.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard, PoisonError};

use hashbrown::HashTable;
use xxhash_rust::xxh3::xxh3_64_with_seed;

/// Shards of the cache.
const SHARDS: usize = 16;
/// Bytes charged per entry on top of its text and ids (slot, table, `Arc` headers).
const ENTRY_OVERHEAD: usize = 96;

/// Counters of a cache.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct CacheStats {
    /// Lookups answered from the cache.
    pub hits: u64,
    /// Lookups that were not.
    pub misses: u64,
    /// Entries held.
    pub entries: usize,
    /// Bytes charged for them.
    pub bytes: usize,
    /// The most bytes the cache holds.
    pub capacity_bytes: usize,
}

struct Slot {
    hash: u64,
    variant: bool,
    text: Box<str>,
    ids: Arc<[u32]>,
    referenced: bool,
}

fn weight(text_len: usize, ids: usize) -> usize {
    text_len
        .saturating_add(ids.saturating_mul(4))
        .saturating_add(ENTRY_OVERHEAD)
}

#[derive(Default)]
struct Shard {
    /// Slot indices by hash.
    table: HashTable<usize>,
    slots: Vec<Option<Slot>>,
    free: Vec<usize>,
    hand: usize,
    bytes: usize,
}

impl Shard {
    fn find(&self, hash: u64, text: &str, variant: bool) -> Option<usize> {
        let slots = &self.slots;
        self.table
            .find(hash, |&i| {
                slots[i]
                    .as_ref()
                    .is_some_and(|s| s.variant == variant && &*s.text == text)
            })
            .copied()
    }

    fn remove(&mut self, i: usize) {
        let Some(slot) = self.slots.get_mut(i).and_then(Option::take) else {
            return;
        };
        if let Ok(entry) = self.table.find_entry(slot.hash, |&j| j == i) {
            entry.remove();
        }
        self.bytes -= weight(slot.text.len(), slot.ids.len());
        self.free.push(i);
    }

    /// Evicts one entry by the clock; `false` when the shard is empty.
    fn evict_one(&mut self) -> bool {
        let n = self.slots.len();
        // Two sweeps: the first may only clear reference bits.
        for _ in 0..=2 * n {
            let i = self.hand % n.max(1);
            self.hand = i + 1;
            match self.slots.get_mut(i) {
                Some(Some(slot)) if slot.referenced => slot.referenced = false,
                Some(Some(_)) => {
                    self.remove(i);
                    return true;
                }
                _ => {}
            }
        }
        false
    }

    fn insert(&mut self, slot: Slot, budget: usize) {
        let w = weight(slot.text.len(), slot.ids.len());
        while self.bytes + w > budget {
            if !self.evict_one() {
                return;
            }
        }
        let hash = slot.hash;
        let i = match self.free.pop() {
            Some(i) => {
                self.slots[i] = Some(slot);
                i
            }
            None => {
                self.slots.push(Some(slot));
                self.slots.len() - 1
            }
        };
        let Shard { table, slots, .. } = self;
        table.insert_unique(hash, i, |&j| slots[j].as_ref().map_or(0, |s| s.hash));
        self.bytes += w;
    }
}

/// Token ids by (text, variant); `variant` tells apart the two encodings a
/// `Metaspace`-first tokenizer has for the same text (at the start or not).
pub struct SegmentCache {
    shards: Box<[Mutex<Shard>]>,
    /// Capacity of each shard.
    shard_bytes: usize,
    hits: AtomicU64,
    misses: AtomicU64,
}

impl std::fmt::Debug for SegmentCache {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("SegmentCache")
            .field("stats", &self.stats())
            .finish()
    }
}

impl SegmentCache {
    /// An empty cache holding at most `capacity_bytes`.
    pub fn new(capacity_bytes: usize) -> Self {
        SegmentCache {
            shards: (0..SHARDS).map(|_| Mutex::default()).collect(),
            shard_bytes: capacity_bytes / SHARDS,
            hits: AtomicU64::new(0),
            misses: AtomicU64::new(0),
        }
    }

    fn shard(&self, hash: u64) -> MutexGuard<'_, Shard> {
        // The table uses the hash's low bits; pick the shard by the high ones.
        let i = (hash >> 40) as usize % self.shards.len();
        self.shards[i]
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
    }

    fn hash(text: &str, variant: bool) -> u64 {
        xxh3_64_with_seed(text.as_bytes(), u64::from(variant))
    }

    /// The ids stored for `text`, marking the entry as recently used.
    pub fn get(&self, text: &str, variant: bool) -> Option<Arc<[u32]>> {
        let hash = Self::hash(text, variant);
        let found = {
            let mut shard = self.shard(hash);
            shard.find(hash, text, variant).and_then(|i| {
                let slot = shard.slots[i].as_mut()?;
                slot.referenced = true;
                Some(slot.ids.clone())
            })
        };
        let counter = if found.is_some() {
            &self.hits
        } else {
            &self.misses
        };
        counter.fetch_add(1, Ordering::Relaxed);
        found
    }

    /// Stores the ids of `text` (evicting others as needed); a text already
    /// present, or heavier than a shard's share, is left alone.
    pub fn insert(&self, text: &str, variant: bool, ids: &[u32]) {
        if weight(text.len(), ids.len()) > self.shard_bytes {
            return;
        }
        let hash = Self::hash(text, variant);
        let slot = Slot {
            hash,
            variant,
            text: text.into(),
            ids: ids.into(),
            referenced: false,
        };
        let mut shard = self.shard(hash);
        if shard.find(hash, text, variant).is_none() {
            shard.insert(slot, self.shard_bytes);
        }
    }

    /// The counters, summed over the shards.
    pub fn stats(&self) -> CacheStats {
        let mut stats = CacheStats {
            hits: self.hits.load(Ordering::Relaxed),
            misses: self.misses.load(Ordering::Relaxed),
            capacity_bytes: self.shard_bytes * self.shards.len(),
            ..CacheStats::default()
        };
        for shard in self.shards.iter() {
            let shard = shard.lock().unwrap_or_else(PoisonError::into_inner);
            stats.entries += shard.table.len();
            stats.bytes += shard.bytes;
        }
        stats
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    /// The ids the model says a key has: any fixed function of the key.
    fn ids_of(key: u8) -> Vec<u32> {
        (0..u32::from(key % 7))
            .map(|i| i * 31 + u32::from(key))
            .collect()
    }

    fn text_of(key: u8) -> String {
        format!("segment-{key}-").repeat(usize::from(key % 5) + 1)
    }

    #[test]
    fn a_stored_text_is_found_and_another_is_not() {
        let cache = SegmentCache::new(1 << 20);
        assert!(cache.get("hello", false).is_none());
        cache.insert("hello", false, &[1, 2, 3]);
        assert_eq!(cache.get("hello", false).as_deref(), Some(&[1, 2, 3][..]));
        assert!(
            cache.get("hello", true).is_none(),
            "the variant is part of the key"
        );
        assert!(cache.get("hell", false).is_none());
        let stats = cache.stats();
        assert_eq!((stats.hits, stats.misses, stats.entries), (1, 3, 1));
        assert_eq!(stats.bytes, weight(5, 3));
    }

    #[test]
    fn entries_heavier_than_a_shard_are_not_kept() {
        let cache = SegmentCache::new(SHARDS * 200);
        cache.insert(&"x".repeat(500), false, &[1]);
        assert_eq!(cache.stats().entries, 0);
    }

    #[test]
    fn referenced_entries_survive_the_clock_longer_than_unreferenced_ones() {
        // One shard's worth of room for about three entries.
        let cache = SegmentCache {
            shards: vec![Mutex::default()].into_boxed_slice(),
            shard_bytes: 3 * weight(2, 1),
            hits: AtomicU64::new(0),
            misses: AtomicU64::new(0),
        };
        for t in ["aa", "bb", "cc"] {
            cache.insert(t, false, &[7]);
        }
        assert!(cache.get("aa", false).is_some());
        cache.insert("dd", false, &[7]);
        assert!(cache.get("aa", false).is_some(), "used, so kept");
        assert!(
            cache.get("bb", false).is_none(),
            "the oldest unused entry went"
        );
        assert!(cache.get("dd", false).is_some());
    }

    proptest! {
        #[test]
        fn the_cache_never_lies_and_never_exceeds_its_capacity(
            ops in proptest::collection::vec((any::<bool>(), 0u8..40), 1..300),
            capacity in 0usize..6000,
        ) {
            let cache = SegmentCache::new(capacity);
            for (insert, key) in ops {
                let text = text_of(key);
                if insert {
                    cache.insert(&text, key % 2 == 0, &ids_of(key));
                    let fits = weight(text.len(), ids_of(key).len()) <= capacity / SHARDS;
                    prop_assert_eq!(cache.get(&text, key % 2 == 0).is_some(), fits);
                } else if let Some(ids) = cache.get(&text, key % 2 == 0) {
                    prop_assert_eq!(&ids[..], &ids_of(key)[..]);
                }
                let stats = cache.stats();
                prop_assert!(stats.bytes <= capacity);
            }
        }

        #[test]
        fn with_room_for_everything_nothing_is_evicted(
            keys in proptest::collection::vec(0u8..60, 1..200),
        ) {
            let cache = SegmentCache::new(1 << 24);
            for &key in &keys {
                cache.insert(&text_of(key), false, &ids_of(key));
            }
            for &key in &keys {
                let ids = cache.get(&text_of(key), false);
                prop_assert_eq!(ids.as_deref(), Some(&ids_of(key)[..]));
            }
        }
    }
}
