//! The node store's hash tables: node ids found by a 64-bit hash of a key
//! that lives in the node's record, with Robin Hood linear probing.
//!
//! Why not `hashbrown`: its tables are a power of two of buckets at most
//! 7/8 full, so after each doubling they are 7/16 full and on average
//! hold about 8.2 bytes per 4-byte id (bucket plus control byte). This table
//! keeps one 4-byte id and one byte per slot, grows by a quarter (so it is
//! 70 % to 88 % full, about 6.3 bytes an id), and its slot count is any
//! number, the home slot being the hash scaled to it. (Growing by an
//! eighth at up to 92 % saves another half byte an id, but applies from
//! empty were slower still, 0.8–1.2 M block-ops/s against 1.1–1.5 M at
//! 128 × 1 M on one busy machine: each growth re-lays every id, and Robin
//! Hood runs get long above 90 %. See `docs/performance.md`.)
//!
//! The byte holds the slot's displacement from its home and three bits of
//! its hash. Robin Hood ordering keeps every run of slots sorted by home,
//! so the displacement alone tells where a slot's id belongs: a search
//! stops at the first slot displaced less than the key would be, only ids
//! whose home and tag bits are the key's are compared (a record read each),
//! and a removal shifts the run after it back by one without reading any
//! record. A displacement too large for its bits (at these loads, in
//! practice only under hashes chosen to collide) is saturated and then
//! read from the record's hash instead: such a run costs record reads,
//! never memory.
//!
//! Growing re-lays every id, which needs every key's hash: the caller
//! passes them in id order ([`IdTable::regrow`]), so the records are read
//! once, in sequence, rather than once per slot in hash order.

use super::nodes::NodeId;

/// A slot's byte when empty.
const EMPTY: u8 = 0;
/// The displacement bits of a slot's byte: the displacement plus one.
const DISP_MASK: u8 = 0x1f;
/// The displacement bits of a displacement too large to hold.
const SATURATED: u8 = DISP_MASK;
/// The tag bits: three bits of the hash the home is not made of.
const TAG_SHIFT: u32 = 5;

/// The table grows when more than `LOAD_NUM / LOAD_DEN` of its slots are used.
const LOAD_NUM: usize = 22;
const LOAD_DEN: usize = 25;

/// Slots added when the table grows: a quarter, and at least a few.
fn grown(slots: usize) -> usize {
    slots + (slots / 4).max(16)
}

/// Node ids by the hash of their key.
#[derive(Debug, Clone, Default)]
pub(super) struct IdTable {
    ids: Vec<NodeId>,
    /// Per slot: 0 when empty, else the id's tag bits and its displacement
    /// from its home plus one ([`SATURATED`] when too large to hold; then
    /// computed).
    disp: Vec<u8>,
    len: usize,
}

/// The home slot of a hash among `slots` (which must not be 0): its high bits.
#[inline]
fn home(hash: u64, slots: usize) -> usize {
    ((u128::from(hash) * slots as u128) >> 64) as usize
}

/// The tag bits of a hash, in place in a slot's byte: its low bits.
#[inline]
fn tag(hash: u64) -> u8 {
    ((hash & 7) as u8) << TAG_SHIFT
}

/// A slot's byte for displacement `dist` and tag bits `tag`.
#[inline]
fn slot_byte(dist: usize, tag: u8) -> u8 {
    tag | u8::try_from(dist + 1).map_or(SATURATED, |d| d.min(SATURATED))
}

impl IdTable {
    /// Ids held.
    #[cfg(test)]
    pub(super) fn len(&self) -> usize {
        self.len
    }

    /// Slots allocated (every one of them is heap).
    #[cfg(test)]
    pub(super) fn slots(&self) -> usize {
        self.ids.len()
    }

    /// Heap bytes held, from capacities.
    pub(super) fn heap_bytes(&self) -> usize {
        self.ids.capacity() * std::mem::size_of::<NodeId>() + self.disp.capacity()
    }

    /// The displacement of slot `pos`, which is in use; `hash_of` gives an
    /// id's hash when the byte is saturated.
    #[inline]
    fn displacement(&self, pos: usize, hash_of: &impl Fn(NodeId) -> u64) -> usize {
        let d = self.disp[pos] & DISP_MASK;
        if d != SATURATED {
            return usize::from(d) - 1;
        }
        let slots = self.ids.len();
        let h = home(hash_of(self.ids[pos]), slots);
        (pos + slots - h) % slots
    }

    /// The id whose key has `hash` and that `is_key` accepts (the caller
    /// compares the key in the record).
    #[inline]
    pub(super) fn find(
        &self,
        hash: u64,
        is_key: impl Fn(NodeId) -> bool,
        hash_of: impl Fn(NodeId) -> u64,
    ) -> Option<NodeId> {
        let slots = self.ids.len();
        if slots == 0 {
            return None;
        }
        let (mut pos, tag) = (home(hash, slots), tag(hash));
        for dist in 0..slots {
            let byte = self.disp[pos];
            if byte == EMPTY {
                return None;
            }
            let d = self.displacement(pos, &hash_of);
            if d < dist {
                // Robin Hood order: the key would have been placed here.
                return None;
            }
            if d == dist && byte & !DISP_MASK == tag && is_key(self.ids[pos]) {
                return Some(self.ids[pos]);
            }
            pos = if pos + 1 == slots { 0 } else { pos + 1 };
        }
        None
    }

    /// Adds `id` under `hash`; the caller has checked that its key is not
    /// in the table. `hash_of` gives any held id's hash (for growing).
    pub(super) fn insert(&mut self, hash: u64, id: NodeId, hash_of: impl Fn(NodeId) -> u64) {
        if self.is_full() {
            self.grow(&hash_of);
        }
        self.place(hash, id, &hash_of);
        self.len += 1;
    }

    /// True when the next insertion grows the table: the caller may
    /// [`IdTable::regrow`] it first, from its records in order.
    #[inline]
    pub(super) fn is_full(&self) -> bool {
        (self.len + 1) * LOAD_DEN > self.ids.len() * LOAD_NUM
    }

    /// Re-lays the table a quarter larger with exactly the ids it holds,
    /// given with their hashes (in any order; in id order the caller reads
    /// its records in sequence). `hash_of` as for [`IdTable::insert`].
    pub(super) fn regrow(
        &mut self,
        entries: impl Iterator<Item = (u64, NodeId)>,
        hash_of: impl Fn(NodeId) -> u64,
    ) {
        let slots = grown(self.ids.len());
        self.ids = vec![0; slots];
        self.disp = vec![EMPTY; slots];
        self.len = 0;
        for (hash, id) in entries {
            if self.is_full() {
                // More entries than the table held: grow again rather than fill up.
                self.grow(&hash_of);
            }
            self.place(hash, id, &hash_of);
            self.len += 1;
        }
    }

    /// Robin Hood insertion into a table with room.
    fn place(&mut self, hash: u64, id: NodeId, hash_of: &impl Fn(NodeId) -> u64) {
        let slots = self.ids.len();
        let (mut pos, mut carry, mut dist) = (home(hash, slots), id, 0usize);
        let mut carry_tag = tag(hash);
        loop {
            let byte = self.disp[pos];
            if byte == EMPTY {
                self.ids[pos] = carry;
                self.disp[pos] = slot_byte(dist, carry_tag);
                return;
            }
            let d = self.displacement(pos, hash_of);
            if d < dist {
                // The richer entry moves on; the poorer one takes its slot.
                std::mem::swap(&mut self.ids[pos], &mut carry);
                self.disp[pos] = slot_byte(dist, carry_tag);
                carry_tag = byte & !DISP_MASK;
                dist = d;
            }
            pos = if pos + 1 == slots { 0 } else { pos + 1 };
            dist += 1;
        }
    }

    /// Removes `id`, held under `hash`; false when it is not there.
    pub(super) fn remove(
        &mut self,
        hash: u64,
        id: NodeId,
        hash_of: impl Fn(NodeId) -> u64,
    ) -> bool {
        let Some(mut pos) = self.position(hash, id, &hash_of) else {
            return false;
        };
        let slots = self.ids.len();
        // Shift the rest of the run back by one slot, nearer its homes.
        loop {
            let next = if pos + 1 == slots { 0 } else { pos + 1 };
            if self.disp[next] == EMPTY {
                break;
            }
            let d = self.displacement(next, &hash_of);
            if d == 0 {
                break;
            }
            self.ids[pos] = self.ids[next];
            self.disp[pos] = slot_byte(d - 1, self.disp[next] & !DISP_MASK);
            pos = next;
        }
        self.disp[pos] = EMPTY;
        self.ids[pos] = 0;
        self.len -= 1;
        true
    }

    /// The slot of `id`, held under `hash`.
    fn position(&self, hash: u64, id: NodeId, hash_of: &impl Fn(NodeId) -> u64) -> Option<usize> {
        let slots = self.ids.len();
        if slots == 0 {
            return None;
        }
        let mut pos = home(hash, slots);
        for dist in 0..slots {
            if self.disp[pos] == EMPTY || self.displacement(pos, hash_of) < dist {
                return None;
            }
            if self.ids[pos] == id {
                return Some(pos);
            }
            pos = if pos + 1 == slots { 0 } else { pos + 1 };
        }
        None
    }

    /// Re-lays the table a quarter larger (at least 16 slots more).
    fn grow(&mut self, hash_of: &impl Fn(NodeId) -> u64) {
        let old_ids = std::mem::take(&mut self.ids);
        let old_disp = std::mem::take(&mut self.disp);
        let slots = grown(old_ids.len());
        self.ids = vec![0; slots];
        self.disp = vec![EMPTY; slots];
        for (&id, &d) in old_ids.iter().zip(&old_disp) {
            if d != EMPTY {
                self.place(hash_of(id), id, hash_of);
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use std::collections::BTreeSet;

    use super::*;

    /// Keys by id, as the records hold them; `hash` is the table's hash of a key.
    struct Keys {
        keys: Vec<u64>,
        hash: fn(u64) -> u64,
    }

    impl Keys {
        fn hash_of(&self) -> impl Fn(NodeId) -> u64 + '_ {
            |id| (self.hash)(self.keys[id as usize])
        }
        fn find(&self, table: &IdTable, key: u64) -> Option<NodeId> {
            table.find(
                (self.hash)(key),
                |id| self.keys[id as usize] == key,
                self.hash_of(),
            )
        }
    }

    fn mixed(key: u64) -> u64 {
        key.wrapping_mul(0x9e37_79b9_7f4a_7c15).rotate_left(29) ^ key
    }

    /// Keys whose hashes all share a few homes: long runs, saturated bytes.
    fn colliding(key: u64) -> u64 {
        (key % 3) << 62
    }

    fn churn(hash: fn(u64) -> u64, n: u64) {
        let mut keys = Keys {
            keys: Vec::new(),
            hash,
        };
        let mut table = IdTable::default();
        let mut present = BTreeSet::new();
        for i in 0..n {
            let id = keys.keys.len() as NodeId;
            keys.keys.push(i * 7 + 1);
            table.insert(hash(i * 7 + 1), id, keys.hash_of());
            present.insert(id);
            // Remove every third id inserted so far, in a scattered order.
            if i % 3 == 2 {
                let gone = ((i * 2_654_435_761) % (i + 1)) as NodeId;
                let key = keys.keys[gone as usize];
                let removed = table.remove(hash(key), gone, keys.hash_of());
                assert_eq!(removed, present.remove(&gone));
            }
        }
        assert_eq!(table.len(), present.len());
        for (id, &key) in keys.keys.iter().enumerate() {
            let expect = present.contains(&(id as NodeId)).then_some(id as NodeId);
            assert_eq!(keys.find(&table, key), expect, "key {key}");
        }
        assert_eq!(keys.find(&table, 0), None);
        assert_eq!(keys.find(&table, u64::MAX), None);
        // Grown by quarters: never much more than the load asks for.
        assert!(
            table.slots() <= present.len().max(100) * 2,
            "{}",
            table.slots()
        );
    }

    #[test]
    fn ids_are_found_until_removed_under_churn() {
        churn(mixed, 20_000);
    }

    #[test]
    fn a_table_regrown_from_its_entries_answers_as_before() {
        let keys = Keys {
            keys: (0..5_000u64).map(|k| k * 13).collect(),
            hash: mixed,
        };
        let mut table = IdTable::default();
        for id in 0..5_000u32 {
            if table.is_full() {
                let entries = (0..id).map(|i| (mixed(keys.keys[i as usize]), i));
                table.regrow(entries, keys.hash_of());
            }
            table.insert(mixed(keys.keys[id as usize]), id, keys.hash_of());
        }
        assert_eq!(table.len(), 5_000);
        for (id, &key) in keys.keys.iter().enumerate() {
            assert_eq!(keys.find(&table, key), Some(id as NodeId));
        }
        assert_eq!(keys.find(&table, 1), None);
    }

    #[test]
    fn hashes_chosen_to_collide_still_answer_exactly() {
        churn(colliding, 2_000);
    }

    #[test]
    fn the_table_stays_between_seventy_and_eighty_eight_percent_full_as_it_grows() {
        let keys = Keys {
            keys: (0..100_000u64).collect(),
            hash: mixed,
        };
        let mut table = IdTable::default();
        let mut loads = Vec::new();
        for id in 0..100_000u32 {
            table.insert(mixed(u64::from(id)), id, keys.hash_of());
            if id >= 1_000 {
                loads.push(table.len() as f64 / table.slots() as f64);
            }
        }
        let low = loads.iter().copied().fold(1.0, f64::min);
        let high = loads.iter().copied().fold(0.0, f64::max);
        assert!(low > 0.7 && high <= 0.88, "{low} {high}");
        assert_eq!(table.heap_bytes(), table.slots() * 5);
    }
}
