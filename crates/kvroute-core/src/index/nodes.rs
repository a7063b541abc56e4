//! The node store: one record per distinct block prefix, found by its
//! sequence hash or by any engine hash bound to it.
//!
//! A record is 20 bytes, `{seq, ext, holder}`, whatever the size of the
//! fleet: the ranks holding the block are a sorted holder list (see
//! [`super::holders`]), inline when one rank holds it. The holder word is that
//! one entry, or where the list or dense set is; a list's length is where its
//! block's entries end (padding follows them), a dense set keeps its own, a
//! free record has a reserved word and a node with no engine hash has `ext`
//! 0, so no flags word is needed. The two hash tables hold only 4-byte node
//! ids (the keys are in the records).

use hashbrown::HashTable;
use rustc_hash::FxHashMap;

use super::dense::{DenseArena, DenseView};
use super::holders::{self, Entry, HolderArena, ListRef};
use crate::event::Tier;

/// Index of a node record.
pub(super) type NodeId = u32;

/// Index of a (worker, rank) slot.
pub(super) type SlotId = u32;

/// The holder word's top bit: the rest is a list's class and block, not one
/// holder entry (which, tiers never being empty, is never 0).
const LIST: u32 = 1 << 31;
const CLASS_SHIFT: u32 = 26;
const CLASS_MASK: u32 = 0x1f;
/// The block-number bits of a list's holder word: blocks beyond are refused.
pub(super) const AT_LIMIT: u32 = 1 << CLASS_SHIFT;
/// The class of a dense holder set (a bitmap block of [`DenseArena`]).
const DENSE: u8 = 31;
/// The holder word of a free record (a dense set's block number that is
/// never allocated).
const FREE: u32 = u32::MAX;

/// One node: its sequence hash, its shared engine hash (0 for none) and its
/// holder word. Packed to 4-byte alignment: 20 bytes, not 24.
#[derive(Debug, Clone, Copy)]
#[repr(C, packed(4))]
struct Record {
    seq: u64,
    ext: u64,
    holder: u32,
}

const _: () = assert!(std::mem::size_of::<Record>() == 20);

impl Default for Record {
    /// A free record.
    fn default() -> Self {
        Record {
            seq: 0,
            ext: 0,
            holder: FREE,
        }
    }
}

impl Record {
    #[inline]
    fn is_live(&self) -> bool {
        self.holder != FREE
    }

    /// The shared engine hash, when the node has one.
    #[inline]
    fn primary(&self) -> Option<u64> {
        let ext = self.ext;
        (ext != 0).then_some(ext)
    }
}

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

/// Block-prefix nodes with their holder lists.
#[derive(Debug, Clone, Default)]
pub(super) struct NodeStore {
    records: Vec<Record>,
    /// One bit per record: it has second names in `aliases`.
    has_alias: Vec<u64>,
    free: Vec<NodeId>,
    live: usize,
    by_seq: HashTable<NodeId>,
    by_ext: HashTable<NodeId>,
    aliases: FxHashMap<u64, NodeId>,
    holders: HolderArena,
    dense: DenseArena,
}

/// The ranks holding a node: a sorted list, or bitmaps when many do.
#[derive(Debug, Clone, Copy)]
pub(super) enum Holders<'a> {
    /// Entries sorted by slot, possibly followed by [`holders::PAD`]s (which
    /// sort last and name no slot: searches and merges by slot may read
    /// them; anything that counts or lists entries trims them first).
    List(&'a [Entry]),
    /// One bit per slot and tier.
    Dense(DenseView<'a>),
}

impl Holders<'_> {
    /// The tier mask of a slot.
    #[inline]
    pub(super) fn tiers_of(&self, slot: SlotId) -> u8 {
        match self {
            Holders::List(list) => {
                holders::search(list, slot).map_or(0, |i| holders::tiers_of(list[i]))
            }
            Holders::Dense(d) => d.tiers_of(slot),
        }
    }

    /// Every holder as a list entry, in slot order.
    pub(super) fn for_each(&self, mut f: impl FnMut(Entry)) {
        match self {
            Holders::List(list) => holders::trimmed(list).iter().for_each(|&e| f(e)),
            Holders::Dense(d) => d.for_each(f),
        }
    }

    /// The same ranks on the same tiers (compared as stored: a list and a
    /// dense set are never the same).
    #[inline]
    pub(super) fn same_as(&self, other: &Holders<'_>) -> bool {
        match (self, other) {
            // One holder is the common case: compared inline, not by memcmp.
            (Holders::List([a]), Holders::List([b])) => a == b,
            (Holders::List(a), Holders::List(b)) => a == b,
            (Holders::Dense(a), Holders::Dense(b)) => {
                same_words(a.device, b.device)
                    && match (a.lower, b.lower) {
                        (None, None) => true,
                        (Some(a), Some(b)) => a == b,
                        _ => false,
                    }
            }
            _ => false,
        }
    }
}

/// Equal bitmaps, compared word by word in line: at the fleet sizes where
/// blocks are dense sets they are a few words, fewer than a call to
/// `memcmp` costs.
#[inline]
fn same_words(a: &[u64], b: &[u64]) -> bool {
    a.len() == b.len() && a.iter().zip(b).all(|(x, y)| x == y)
}

impl NodeStore {
    /// Nodes in use.
    pub(super) fn live(&self) -> usize {
        self.live
    }

    /// One past the highest node id ever allocated.
    pub(super) fn capacity(&self) -> usize {
        self.records.len()
    }

    #[inline]
    fn record(&self, node: NodeId) -> Record {
        self.records.get(node as usize).copied().unwrap_or_default()
    }

    pub(super) fn is_live(&self, node: NodeId) -> bool {
        self.record(node).is_live()
    }

    pub(super) fn seq(&self, node: NodeId) -> u64 {
        self.record(node).seq
    }

    /// The node's first bound engine hash, if any.
    pub(super) fn primary_ext(&self, node: NodeId) -> Option<u64> {
        self.record(node).primary()
    }

    /// Where the holders of a record with this holder word are. A free
    /// record's word reads as an empty inline list.
    #[inline]
    fn list_of(holder: u32) -> ListRef {
        if holder & LIST == 0 {
            return ListRef {
                class: 0,
                at: holder,
            };
        }
        if holder == FREE {
            return ListRef::default();
        }
        ListRef {
            class: ((holder >> CLASS_SHIFT) & CLASS_MASK) as u8,
            at: holder & (AT_LIMIT - 1),
        }
    }

    /// Stores where a node's holders are.
    #[inline]
    fn set_list(&mut self, node: NodeId, list: ListRef) {
        let holder = match list.class {
            0 => list.at,
            class => LIST | (u32::from(class) << CLASS_SHIFT) | list.at,
        };
        if let Some(r) = self.records.get_mut(node as usize) {
            r.holder = holder;
        }
    }

    /// How many ranks hold a list (a count: not for hot paths).
    fn len_of(&self, list: &ListRef) -> u32 {
        match list.class {
            DENSE => self.dense.len(list.at),
            _ => self.holders.len(list),
        }
    }

    /// The ranks holding the node, with their tiers. Inlined always: the
    /// walk calls it once a block, and as a call it cost 20 instructions.
    #[inline(always)]
    pub(super) fn holders(&self, node: NodeId) -> Holders<'_> {
        let Some(r) = self.records.get(node as usize) else {
            return Holders::List(&[]);
        };
        if r.holder & LIST == 0 {
            // One holder or none, in the record: the common case, kept small
            // enough to inline into the walk.
            let len = usize::from(r.holder != 0);
            return Holders::List(&std::slice::from_ref(&r.holder)[..len]);
        }
        self.listed_holders(r.holder)
    }

    /// The holders of a node whose holder word names a list or dense set.
    #[inline]
    fn listed_holders(&self, holder: u32) -> Holders<'_> {
        match Self::list_of(holder) {
            list if list.class == DENSE => Holders::Dense(self.dense.view(list.at)),
            list => Holders::List(self.holders.block(list)),
        }
    }

    /// Bitmap words per tier of dense holder sets.
    pub(super) fn dense_words(&self) -> usize {
        self.dense.words()
    }

    /// Makes dense holder sets `words` words wide (more slots than bits).
    pub(super) fn widen(&mut self, words: usize) {
        self.dense.widen(words);
    }

    /// Holders beyond which a list becomes a dense set: where the bitmap is
    /// no larger than the list.
    fn dense_threshold(&self) -> u32 {
        (2 * (self.dense.words() as u32 + 1)).max(16)
    }

    #[inline]
    pub(super) fn find_seq(&self, seq: u64) -> Option<NodeId> {
        let records = &self.records;
        self.by_seq
            .find(mix(seq), |&id| records[id as usize].seq == seq)
            .copied()
    }

    /// `node` when it is the live node of `seq`: a guess checked with one
    /// record read, no table probe. Exact: a live record with `seq` is its node.
    #[inline]
    pub(super) fn seq_at(&self, node: NodeId, seq: u64) -> Option<NodeId> {
        let r = self.records.get(node as usize)?;
        (r.seq == seq && r.is_live()).then_some(node)
    }

    /// [`NodeStore::insert_seq`], looking first in the record after `near`:
    /// a chain stored by one event gets consecutive ids, so a block stored
    /// again (a shared prefix, a duplicate) is usually the record after its
    /// parent's, already in cache, and no table probe is needed. Exact
    /// either way: a live record with `seq` is its node.
    pub(super) fn insert_seq_near(&mut self, seq: u64, near: Option<NodeId>) -> NodeId {
        if let Some(next) = near.and_then(|n| n.checked_add(1)) {
            if let Some(r) = self.records.get(next as usize) {
                if r.seq == seq && r.is_live() {
                    return next;
                }
            }
        }
        self.insert_seq(seq)
    }

    /// The node whose shared name is `ext`, looked for first in the records
    /// on either side of `near` (a removal's blocks are usually one chain's).
    /// Exact either way: shared names are unique among live nodes.
    pub(super) fn find_primary_near(&self, ext: u64, near: Option<NodeId>) -> Option<NodeId> {
        if let Some(n) = near {
            for id in [n.checked_add(1), n.checked_sub(1)].into_iter().flatten() {
                if let Some(r) = self.records.get(id as usize) {
                    if r.ext == ext && ext != 0 && r.is_live() {
                        return Some(id);
                    }
                }
            }
        }
        self.find_primary(ext)
    }

    /// The node whose shared name (first engine hash) `ext` is.
    pub(super) fn find_primary(&self, ext: u64) -> Option<NodeId> {
        if ext == 0 {
            return None;
        }
        let records = &self.records;
        self.by_ext
            .find(mix(ext), |&id| records[id as usize].ext == ext)
            .copied()
    }

    /// The node of a sequence hash, created empty when new.
    pub(super) fn insert_seq(&mut self, seq: u64) -> NodeId {
        // The id a new node would get; the table learns it before its record
        // is written, which is safe because inserting into a vacant entry
        // never rehashes (`entry` reserves room first).
        let next = match self.free.last() {
            Some(&id) => id,
            None => NodeId::try_from(self.records.len()).unwrap_or(NodeId::MAX),
        };
        let records = &self.records;
        let entry = self.by_seq.entry(
            mix(seq),
            |&id| records[id as usize].seq == seq,
            |&id| mix(records[id as usize].seq),
        );
        match entry {
            hashbrown::hash_table::Entry::Occupied(e) => return *e.get(),
            hashbrown::hash_table::Entry::Vacant(v) => {
                v.insert(next);
            }
        }
        let record = Record {
            seq,
            ext: 0,
            holder: 0,
        };
        if self.free.last() == Some(&next) {
            self.free.pop();
            self.records[next as usize] = record;
        } else {
            grow_gently(&mut self.records, 1);
            self.records.push(record);
            let words = self.records.len().div_ceil(64);
            if self.has_alias.len() < words {
                grow_gently(&mut self.has_alias, 1);
                self.has_alias.push(0);
            }
        }
        self.live += 1;
        next
    }

    /// Makes `ext` name `node`.
    pub(super) fn bind_ext(&mut self, node: NodeId, ext: u64) -> Bind {
        let record = self.record(node);
        let has_primary = record.primary().is_some();
        // 0 means "no engine hash" in a record, so a hash of 0 is only ever
        // a second name, kept private to the ranks that use it.
        let second = has_primary || ext == 0;
        if has_primary && record.ext == ext {
            // Already the shared name: the table says so too, no need to probe it.
            return Bind::Primary;
        }
        let records = &self.records;
        let entry = self.by_ext.entry(
            mix(ext),
            |&id| records[id as usize].ext == ext,
            |&id| mix(records[id as usize].ext),
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
                if !second {
                    v.insert(node);
                }
            }
        }
        let Some(record) = self.records.get_mut(node as usize) else {
            return Bind::Conflict;
        };
        if second {
            self.aliases.insert(ext, node);
            if let Some(word) = self.has_alias.get_mut(node as usize / 64) {
                *word |= 1 << (node % 64);
            }
            Bind::Alias
        } else {
            record.ext = ext;
            Bind::Primary
        }
    }

    /// Ranks holding the node, on any tier.
    pub(super) fn holder_count(&self, node: NodeId) -> usize {
        self.len_of(&Self::list_of(self.record(node).holder)) as usize
    }

    /// The tier mask (bit 0 device … bit 3 external) of a slot on a node.
    pub(super) fn tiers_of(&self, node: NodeId, slot: SlotId) -> u8 {
        self.holders(node).tiers_of(slot)
    }

    /// Sets a slot's bit for a tier; true when it was not set before.
    pub(super) fn set(&mut self, node: NodeId, slot: SlotId, tier: Tier) -> bool {
        let bit = tier_bit(tier);
        let Some(record) = self.records.get(node as usize).copied() else {
            return false;
        };
        if !record.is_live() || slot >= holders::MAX_SLOTS {
            return false;
        }
        let mut list = Self::list_of(record.holder);
        if list.class == 0 && (list.at == 0 || holders::slot_of(list.at) == slot) {
            // One holder or none, kept in the record: the common case.
            let tiers = if list.at == 0 {
                0
            } else {
                holders::tiers_of(list.at)
            };
            if tiers & bit != 0 {
                return false;
            }
            list.at = holders::entry(slot, tiers | bit);
        } else if list.class == DENSE {
            if slot as usize >= self.dense.words() * 64 {
                return false;
            }
            let before = self.dense.set(list.at, slot, bit);
            if before & bit != 0 {
                return false;
            }
            if before == 0 {
                self.dense.set_len(list.at, self.dense.len(list.at) + 1);
            }
        } else {
            let entries = self.holders.get(&list);
            match holders::search(entries, slot) {
                Ok(i) => {
                    let e = entries[i];
                    if holders::tiers_of(e) & bit != 0 {
                        return false;
                    }
                    self.holders.set(&mut list, i, e | u32::from(bit));
                }
                Err(i) => {
                    let threshold = self.dense_threshold() as usize;
                    if self.holders.holds_at_least(&list, threshold) && self.make_dense(&mut list) {
                        self.dense.set(list.at, slot, bit);
                        self.dense.set_len(list.at, self.dense.len(list.at) + 1);
                    } else if !self.holders.insert(&mut list, i, holders::entry(slot, bit)) {
                        return false;
                    }
                }
            }
        }
        self.set_list(node, list);
        true
    }

    /// Clears a slot's bit for a tier; true when it was set.
    pub(super) fn clear(&mut self, node: NodeId, slot: SlotId, tier: Tier) -> bool {
        let bit = tier_bit(tier);
        let Some(record) = self.records.get(node as usize).copied() else {
            return false;
        };
        if !record.is_live() {
            return false;
        }
        let mut list = Self::list_of(record.holder);
        if list.class == DENSE {
            let before = self.dense.clear(list.at, slot, bit);
            if before & bit == 0 {
                return false;
            }
            if before == bit {
                let len = self.dense.len(list.at).saturating_sub(1);
                self.dense.set_len(list.at, len);
                if len < self.dense_threshold() / 4 {
                    self.make_list(&mut list);
                }
            }
        } else {
            let entries = self.holders.get(&list);
            let Ok(i) = holders::search(entries, slot) else {
                return false;
            };
            let e = entries[i];
            if holders::tiers_of(e) & bit == 0 {
                return false;
            }
            if holders::tiers_of(e) == bit {
                self.holders.remove(&mut list, i);
            } else {
                self.holders.set(&mut list, i, e & !u32::from(bit));
            }
        }
        self.set_list(node, list);
        true
    }

    /// Moves a list into a new dense set; false when the set cannot hold
    /// every entry's slot (the list is left as it was).
    fn make_dense(&mut self, list: &mut ListRef) -> bool {
        let bits = self.dense.words() * 64;
        let entries = holders::trimmed(self.holders.get(list));
        if entries
            .iter()
            .any(|&e| holders::slot_of(e) as usize >= bits)
            || bits == 0
        {
            return false;
        }
        let Some(at) = self.dense.allocate() else {
            return false;
        };
        let entries = holders::trimmed(self.holders.get(list));
        let len = entries.len() as u32;
        for &e in entries {
            self.dense
                .set(at, holders::slot_of(e), holders::tiers_of(e));
        }
        self.dense.set_len(at, len);
        self.holders.release(list);
        *list = ListRef { class: DENSE, at };
        true
    }

    /// Moves a dense set back into a list.
    fn make_list(&mut self, list: &mut ListRef) {
        let mut entries = Vec::with_capacity(self.dense.len(list.at) as usize);
        self.dense.view(list.at).for_each(|e| entries.push(e));
        self.dense.release(list.at);
        let mut fresh = ListRef::default();
        for (i, e) in entries.into_iter().enumerate() {
            self.holders.insert(&mut fresh, i, e);
        }
        *list = fresh;
    }

    /// Frees a node nobody holds any more.
    pub(super) fn free_if_empty(&mut self, node: NodeId) -> bool {
        let record = self.record(node);
        // Lists and dense sets are never empty (one left moves inline, a
        // dense set turns into a list well before), so any holder word but 0
        // has holders, and a word of 0 has no block to free.
        if !record.is_live() || record.holder != 0 {
            return false;
        }
        if let Ok(entry) = self.by_seq.find_entry(mix(record.seq), |&id| id == node) {
            entry.remove();
        }
        if let Some(ext) = record.primary() {
            if let Ok(entry) = self.by_ext.find_entry(mix(ext), |&id| id == node) {
                entry.remove();
            }
        }
        if let Some(word) = self.has_alias.get_mut(node as usize / 64) {
            if *word & (1 << (node % 64)) != 0 {
                *word &= !(1 << (node % 64));
                self.aliases.retain(|_, &mut id| id != node);
            }
        }
        self.records[node as usize] = Record::default();
        self.free.push(node);
        self.live -= 1;
        true
    }

    /// Live node ids, in id order.
    pub(super) fn live_ids(&self) -> impl Iterator<Item = NodeId> + '_ {
        self.records
            .iter()
            .enumerate()
            .filter(|(_, r)| r.is_live())
            .map(|(i, _)| i as NodeId)
    }

    /// Extra engine hashes naming nodes (beyond each node's primary).
    pub(super) fn aliases(&self) -> impl Iterator<Item = (u64, NodeId)> + '_ {
        self.aliases.iter().map(|(&ext, &id)| (ext, id))
    }

    /// Bytes by part, as allocated, and the holder entries of live nodes.
    pub(super) fn parts(&self) -> NodeParts {
        let holder_entries = self
            .records
            .iter()
            .filter(|r| r.is_live())
            .map(|r| u64::from(self.len_of(&Self::list_of(r.holder))))
            .sum();
        NodeParts {
            records: (self.records.capacity() * std::mem::size_of::<Record>()) as u64,
            tables: self.table_bytes() as u64,
            lists: (self.holders.heap_bytes() + self.dense.heap_bytes()) as u64,
            holder_entries,
        }
    }

    /// Heap bytes of the node tables, second names and the free list.
    fn table_bytes(&self) -> usize {
        self.free.capacity() * 4
            + self.has_alias.capacity() * 8
            + map_heap_bytes::<NodeId, ()>(self.by_seq.capacity())
            + map_heap_bytes::<NodeId, ()>(self.by_ext.capacity())
            + map_heap_bytes::<u64, NodeId>(self.aliases.capacity())
    }

    /// Heap bytes held, from capacities.
    pub(super) fn heap_bytes(&self) -> usize {
        self.records.capacity() * std::mem::size_of::<Record>()
            + self.table_bytes()
            + self.holders.heap_bytes()
            + self.dense.heap_bytes()
    }
}

/// The node store's bytes by part (see [`NodeStore::parts`]).
pub(super) struct NodeParts {
    /// Records, spare capacity included.
    pub(super) records: u64,
    /// Both node tables, second names and the free list.
    pub(super) tables: u64,
    /// Holder lists and dense sets.
    pub(super) lists: u64,
    /// (node, rank) holder entries of live nodes.
    pub(super) holder_entries: u64,
}

/// Heap bytes of a hashbrown table (or a `std` map, which is one) of
/// `capacity` entries as allocated: a power of two of buckets at most 7/8
/// full, each an entry and a control byte, plus one group of control bytes.
/// Counting the entries alone under-reports by about 2 B per residency.
pub(super) fn map_heap_bytes<K, V>(capacity: usize) -> usize {
    if capacity == 0 {
        return 0;
    }
    let buckets = (capacity * 8 / 7).next_power_of_two().max(4);
    buckets * (std::mem::size_of::<(K, V)>() + 1) + 16
}

/// Makes room for `more` items, growing by an eighth rather than doubling: the
/// arenas are the index's largest allocations, and doubling would leave up to
/// half of them unused. (Large reallocations are remapped, not copied.)
pub(super) fn grow_gently<T>(arena: &mut Vec<T>, more: usize) {
    if arena.len() + more > arena.capacity() {
        arena.reserve_exact((arena.len() / 8).max(more * 64));
    }
}

/// A tier's bit in a holder entry.
#[inline]
fn tier_bit(tier: Tier) -> u8 {
    match tier {
        Tier::Device => 1,
        Tier::Host => 2,
        Tier::Disk => 4,
        Tier::External => 8,
    }
}
