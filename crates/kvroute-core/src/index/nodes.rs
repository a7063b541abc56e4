//! The node store: one record per distinct block prefix, found by its
//! sequence hash or by any engine hash bound to it.
//!
//! Records live in one flat `Vec<u64>` with a fixed stride, `[seq, ext, meta,
//! device bitmap…]`, so a lookup step reads one record, usually one cache line.
//! The two hash tables hold only 4-byte node ids (the keys are in the records),
//! which keeps an entry at about 5 bytes. Each (worker, rank) is one bit in the
//! bitmaps; blocks on host, disk or external tiers get a side record of three
//! more bitmaps, allocated only for nodes that have such blocks.

use hashbrown::HashTable;
use rustc_hash::FxHashMap;

use crate::event::Tier;

/// Index of a node record.
pub(super) type NodeId = u32;

/// Index of a (worker, rank) bit.
pub(super) type SlotId = u32;

const SEQ: usize = 0;
const EXT: usize = 1;
const META: usize = 2;
const HEADER: usize = 3;

const NO_LOWER: u64 = u32::MAX as u64;
const LOWER_MASK: u64 = u32::MAX as u64;
const OCC_SHIFT: u32 = 32;
const OCC_MASK: u64 = (1 << 29) - 1;
const LIVE: u64 = 1 << 61;
const HAS_ALIAS: u64 = 1 << 62;
const HAS_EXT: u64 = 1 << 63;

/// A well-mixed 64-bit hash of a key, for hashbrown's bucket and tag bits.
/// Engine hashes can be small or structured (test ids, other engines), so they
/// are mixed rather than used as they are.
#[inline]
fn mix(key: u64) -> u64 {
    let product = (key as u128).wrapping_mul(0x9e37_79b9_7f4a_7c15);
    (product as u64) ^ ((product >> 64) as u64)
}

/// What binding an engine hash to a node did.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum Bind {
    /// The hash is the node's shared name (now or already).
    Primary,
    /// The hash is a second name of the node (now or already); the caller
    /// keeps it private to the rank that published it.
    Alias,
    /// The hash already names another node; the caller keeps a private binding.
    Conflict,
}

/// Block-prefix nodes with their residency bitmaps.
#[derive(Debug, Clone)]
pub(super) struct NodeStore {
    words: usize,
    stride: usize,
    records: Vec<u64>,
    free: Vec<NodeId>,
    live: usize,
    by_seq: HashTable<NodeId>,
    by_ext: HashTable<NodeId>,
    aliases: FxHashMap<u64, NodeId>,
    lower: Vec<u64>,
    lower_free: Vec<u32>,
}

impl NodeStore {
    pub(super) fn new(words: usize) -> Self {
        let words = words.max(1);
        NodeStore {
            words,
            stride: HEADER + words,
            records: Vec::new(),
            free: Vec::new(),
            live: 0,
            by_seq: HashTable::new(),
            by_ext: HashTable::new(),
            aliases: FxHashMap::default(),
            lower: Vec::new(),
            lower_free: Vec::new(),
        }
    }

    /// Bitmap words per tier.
    pub(super) fn words(&self) -> usize {
        self.words
    }

    /// Nodes in use.
    pub(super) fn live(&self) -> usize {
        self.live
    }

    /// One past the highest node id ever allocated.
    pub(super) fn capacity(&self) -> usize {
        self.records.len() / self.stride
    }

    #[inline]
    fn base(&self, node: NodeId) -> usize {
        node as usize * self.stride
    }

    #[inline]
    fn meta(&self, node: NodeId) -> u64 {
        self.records[self.base(node) + META]
    }

    #[inline]
    fn set_meta(&mut self, node: NodeId, meta: u64) {
        let base = self.base(node);
        self.records[base + META] = meta;
    }

    pub(super) fn is_live(&self, node: NodeId) -> bool {
        (node as usize) < self.capacity() && self.meta(node) & LIVE != 0
    }

    pub(super) fn seq(&self, node: NodeId) -> u64 {
        self.records[self.base(node) + SEQ]
    }

    /// The node's first bound engine hash, if any.
    pub(super) fn primary_ext(&self, node: NodeId) -> Option<u64> {
        let base = self.base(node);
        (self.records[base + META] & HAS_EXT != 0).then(|| self.records[base + EXT])
    }

    /// The device bitmap.
    #[inline]
    pub(super) fn device(&self, node: NodeId) -> &[u64] {
        let base = self.base(node) + HEADER;
        &self.records[base..base + self.words]
    }

    /// The host, disk and external bitmaps, back to back, when the node has any.
    #[inline]
    pub(super) fn lower(&self, node: NodeId) -> Option<&[u64]> {
        let index = self.meta(node) & LOWER_MASK;
        (index != NO_LOWER).then(|| {
            let start = index as usize * 3 * self.words;
            &self.lower[start..start + 3 * self.words]
        })
    }

    #[inline]
    pub(super) fn find_seq(&self, seq: u64) -> Option<NodeId> {
        let records = &self.records;
        let stride = self.stride;
        self.by_seq
            .find(mix(seq), |&id| records[id as usize * stride + SEQ] == seq)
            .copied()
    }

    /// The node an engine hash names, if any.
    /// The node whose shared name (first engine hash) `ext` is.
    pub(super) fn find_primary(&self, ext: u64) -> Option<NodeId> {
        let records = &self.records;
        let stride = self.stride;
        self.by_ext
            .find(mix(ext), |&id| records[id as usize * stride + EXT] == ext)
            .copied()
    }

    /// The node of a sequence hash, created empty when new.
    pub(super) fn insert_seq(&mut self, seq: u64) -> NodeId {
        // The id a new node would get; the table learns it before its record
        // is written, which is safe because inserting into a vacant entry
        // never rehashes (`entry` reserves room first).
        let next = match self.free.last() {
            Some(&id) => id,
            None => NodeId::try_from(self.capacity()).unwrap_or(NodeId::MAX),
        };
        let records = &self.records;
        let stride = self.stride;
        let entry = self.by_seq.entry(
            mix(seq),
            |&id| records[id as usize * stride + SEQ] == seq,
            |&id| mix(records[id as usize * stride + SEQ]),
        );
        match entry {
            hashbrown::hash_table::Entry::Occupied(e) => return *e.get(),
            hashbrown::hash_table::Entry::Vacant(v) => {
                v.insert(next);
            }
        }
        if self.free.last() == Some(&next) {
            self.free.pop();
        } else {
            grow_gently(&mut self.records, self.stride);
            self.records.resize(self.records.len() + self.stride, 0);
        }
        let base = self.base(next);
        self.records[base + SEQ] = seq;
        self.records[base + EXT] = 0;
        self.records[base + META] = LIVE | NO_LOWER;
        self.live += 1;
        next
    }

    /// Makes `ext` name `node`.
    pub(super) fn bind_ext(&mut self, node: NodeId, ext: u64) -> Bind {
        let has_primary = self.meta(node) & HAS_EXT != 0;
        let records = &self.records;
        let stride = self.stride;
        let entry = self.by_ext.entry(
            mix(ext),
            |&id| records[id as usize * stride + EXT] == ext,
            |&id| mix(records[id as usize * stride + EXT]),
        );
        match entry {
            hashbrown::hash_table::Entry::Occupied(e) => {
                return if *e.get() == node {
                    Bind::Primary
                } else {
                    Bind::Conflict
                };
            }
            hashbrown::hash_table::Entry::Vacant(v) => {
                if let Some(&existing) = self.aliases.get(&ext) {
                    return if existing == node {
                        Bind::Alias
                    } else {
                        Bind::Conflict
                    };
                }
                if !has_primary {
                    v.insert(node);
                }
            }
        }
        let meta = self.meta(node);
        if has_primary {
            self.aliases.insert(ext, node);
            self.set_meta(node, meta | HAS_ALIAS);
            Bind::Alias
        } else {
            let base = self.base(node);
            self.records[base + EXT] = ext;
            self.set_meta(node, meta | HAS_EXT);
            Bind::Primary
        }
    }

    /// Residents of the node, counted over (slot, tier) pairs.
    pub(super) fn occupancy(&self, node: NodeId) -> u64 {
        (self.meta(node) >> OCC_SHIFT) & OCC_MASK
    }

    fn add_occupancy(&mut self, node: NodeId, delta: i64) {
        let meta = self.meta(node);
        let occ = ((meta >> OCC_SHIFT) & OCC_MASK) as i64 + delta;
        let occ = (occ.max(0) as u64) & OCC_MASK;
        self.set_meta(node, (meta & !(OCC_MASK << OCC_SHIFT)) | (occ << OCC_SHIFT));
    }

    /// The word index and bit of a slot.
    #[inline]
    fn bit(slot: SlotId) -> (usize, u64) {
        (slot as usize / 64, 1u64 << (slot % 64))
    }

    /// The tier mask (bit 0 device … bit 3 external) of a slot on a node.
    pub(super) fn tiers_of(&self, node: NodeId, slot: SlotId) -> u8 {
        if !self.is_live(node) {
            return 0;
        }
        let (word, bit) = Self::bit(slot);
        let mut mask = u8::from(self.device(node)[word] & bit != 0);
        if let Some(lower) = self.lower(node) {
            for t in 0..3 {
                if lower[t * self.words + word] & bit != 0 {
                    mask |= 2 << t;
                }
            }
        }
        mask
    }

    /// Sets a slot's bit for a tier; true when it was not set before.
    pub(super) fn set(&mut self, node: NodeId, slot: SlotId, tier: Tier) -> bool {
        let (word, bit) = Self::bit(slot);
        let index = match tier_index(tier) {
            None => self.base(node) + HEADER + word,
            Some(t) => {
                let lower = self.ensure_lower(node);
                lower * 3 * self.words + t * self.words + word
            }
        };
        let store = if tier == Tier::Device {
            &mut self.records
        } else {
            &mut self.lower
        };
        let newly = store[index] & bit == 0;
        store[index] |= bit;
        if newly {
            self.add_occupancy(node, 1);
        }
        newly
    }

    /// Clears a slot's bit for a tier; true when it was set.
    pub(super) fn clear(&mut self, node: NodeId, slot: SlotId, tier: Tier) -> bool {
        if !self.is_live(node) {
            return false;
        }
        let (word, bit) = Self::bit(slot);
        let was = match tier_index(tier) {
            None => {
                let index = self.base(node) + HEADER + word;
                let was = self.records[index] & bit != 0;
                self.records[index] &= !bit;
                was
            }
            Some(t) => {
                let lower = self.meta(node) & LOWER_MASK;
                if lower == NO_LOWER {
                    return false;
                }
                let index = lower as usize * 3 * self.words + t * self.words + word;
                let was = self.lower[index] & bit != 0;
                self.lower[index] &= !bit;
                if was {
                    self.release_lower_if_empty(node);
                }
                was
            }
        };
        if was {
            self.add_occupancy(node, -1);
        }
        was
    }

    fn ensure_lower(&mut self, node: NodeId) -> usize {
        let meta = self.meta(node);
        let index = meta & LOWER_MASK;
        if index != NO_LOWER {
            return index as usize;
        }
        let span = 3 * self.words;
        let index = match self.lower_free.pop() {
            Some(i) => i as usize,
            None => {
                let i = self.lower.len() / span;
                grow_gently(&mut self.lower, span);
                self.lower.resize(self.lower.len() + span, 0);
                i
            }
        };
        self.set_meta(node, (meta & !LOWER_MASK) | index as u64);
        index
    }

    fn release_lower_if_empty(&mut self, node: NodeId) {
        let meta = self.meta(node);
        let index = meta & LOWER_MASK;
        if index == NO_LOWER {
            return;
        }
        let span = 3 * self.words;
        let start = index as usize * span;
        if self.lower[start..start + span].iter().all(|&w| w == 0) {
            self.lower_free.push(index as u32);
            self.set_meta(node, (meta & !LOWER_MASK) | NO_LOWER);
        }
    }

    /// Frees a node nobody holds any more.
    pub(super) fn free_if_empty(&mut self, node: NodeId) -> bool {
        if !self.is_live(node) || self.occupancy(node) != 0 {
            return false;
        }
        let seq = self.seq(node);
        if let Ok(entry) = self.by_seq.find_entry(mix(seq), |&id| id == node) {
            entry.remove();
        }
        let meta = self.meta(node);
        if meta & HAS_EXT != 0 {
            let ext = self.records[self.base(node) + EXT];
            if let Ok(entry) = self.by_ext.find_entry(mix(ext), |&id| id == node) {
                entry.remove();
            }
        }
        if meta & HAS_ALIAS != 0 {
            self.aliases.retain(|_, &mut id| id != node);
        }
        let lower = meta & LOWER_MASK;
        if lower != NO_LOWER {
            let span = 3 * self.words;
            let start = lower as usize * span;
            self.lower[start..start + span].fill(0);
            self.lower_free.push(lower as u32);
        }
        let base = self.base(node);
        self.records[base..base + self.stride].fill(0);
        self.records[base + META] = NO_LOWER;
        self.free.push(node);
        self.live -= 1;
        true
    }

    /// Live node ids, in id order.
    pub(super) fn live_ids(&self) -> impl Iterator<Item = NodeId> + '_ {
        (0..self.capacity()).filter_map(move |i| {
            let id = i as NodeId;
            self.is_live(id).then_some(id)
        })
    }

    /// Extra engine hashes naming nodes (beyond each node's primary).
    pub(super) fn aliases(&self) -> impl Iterator<Item = (u64, NodeId)> + '_ {
        self.aliases.iter().map(|(&ext, &id)| (ext, id))
    }

    /// Grows every bitmap to `words` words (more slots than bits).
    pub(super) fn widen(&mut self, words: usize) {
        if words <= self.words {
            return;
        }
        let old = self.words;
        let new_stride = HEADER + words;
        let count = self.capacity();
        let mut records = vec![0u64; count * new_stride];
        for i in 0..count {
            let from = i * self.stride;
            let to = i * new_stride;
            records[to..to + HEADER + old]
                .copy_from_slice(&self.records[from..from + HEADER + old]);
        }
        let lower_count = self.lower.len() / (3 * old);
        let mut lower = vec![0u64; lower_count * 3 * words];
        for i in 0..lower_count {
            for t in 0..3 {
                let from = i * 3 * old + t * old;
                let to = i * 3 * words + t * words;
                lower[to..to + old].copy_from_slice(&self.lower[from..from + old]);
            }
        }
        self.records = records;
        self.lower = lower;
        self.words = words;
        self.stride = new_stride;
    }

    /// Heap bytes held, from capacities.
    pub(super) fn heap_bytes(&self) -> usize {
        let table = |cap: usize| cap * (std::mem::size_of::<NodeId>() + 1);
        self.records.capacity() * 8
            + self.free.capacity() * 4
            + table(self.by_seq.capacity())
            + table(self.by_ext.capacity())
            + self.aliases.capacity() * (8 + 4 + 1)
            + self.lower.capacity() * 8
            + self.lower_free.capacity() * 4
    }
}

/// Makes room for `more` words, growing by an eighth rather than doubling: the
/// arenas are the index's largest allocations, and doubling would leave up to
/// half of them unused. (Large reallocations are remapped, not copied.)
fn grow_gently(arena: &mut Vec<u64>, more: usize) {
    if arena.len() + more > arena.capacity() {
        arena.reserve_exact((arena.len() / 8).max(more * 1024));
    }
}

/// Position of a lower tier in a node's side record; `None` for the device.
#[inline]
fn tier_index(tier: Tier) -> Option<usize> {
    match tier {
        Tier::Device => None,
        Tier::Host => Some(0),
        Tier::Disk => Some(1),
        Tier::External => Some(2),
    }
}
