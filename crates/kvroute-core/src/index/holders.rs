//! Holder lists: which (worker, rank) slots hold a node's block, and on which
//! tiers.
//!
//! A list is sorted by slot; each entry is one `u32`, the slot shifted left by
//! four with the tier mask (device, host, disk, external) in the low bits. Most
//! blocks are held by one rank, so a one-entry list lives inside the node
//! record itself (an entry always has a tier, so it is never 0, and 0 there
//! means no holder); longer lists live in power-of-two size classes of one
//! arena per class, found by a block number, their entries followed by
//! [`PAD`]s to the end of the block, so no length is stored. A node's cost
//! therefore follows the ranks that hold it, never the size of the fleet.

use super::nodes::SlotId;

/// One holder: `slot << TIER_BITS | tier mask`.
pub(super) type Entry = u32;

const TIER_BITS: u32 = 4;
const TIER_MASK: u32 = (1 << TIER_BITS) - 1;

/// Slots an entry can name: an entry leaves a node's holder word its top bit.
pub(super) const MAX_SLOTS: u32 = 1 << (31 - TIER_BITS);

/// The largest size class: lists of up to 2^24 holders.
pub(super) const MAX_CLASS: u8 = 24;

/// An entry for a slot with these tiers.
#[inline]
pub(super) fn entry(slot: SlotId, tiers: u8) -> Entry {
    (slot << TIER_BITS) | (u32::from(tiers) & TIER_MASK)
}

/// The slot an entry names.
#[inline]
pub(super) fn slot_of(entry: Entry) -> SlotId {
    entry >> TIER_BITS
}

/// The tier mask of an entry (bit 0 device … bit 3 external).
#[inline]
pub(super) fn tiers_of(entry: Entry) -> u8 {
    (entry & TIER_MASK) as u8
}

/// An unused entry of a list's block. It sorts after every entry and names
/// no slot ([`slot_of`] gives one beyond [`MAX_SLOTS`]), so a block's entries
/// are its list followed by padding, and searches and merges by slot can
/// read the whole block without knowing the list's length.
pub(super) const PAD: Entry = u32::MAX;

/// Where a node's holder list is. `class` 0 means the list (of at most one
/// entry) is `at` itself, 0 when empty; class `c` means block `at` of the
/// arena whose blocks hold `2^c` entries.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub(super) struct ListRef {
    pub(super) class: u8,
    pub(super) at: u32,
}

/// The position of `slot` in a sorted list, or where it would go.
#[inline]
pub(super) fn search(list: &[Entry], slot: SlotId) -> Result<usize, usize> {
    // Entries sort by slot first, so the slot's entries start at `slot << 4`.
    let i = list.partition_point(|&e| e < slot << TIER_BITS);
    match list.get(i) {
        Some(&e) if slot_of(e) == slot => Ok(i),
        _ => Err(i),
    }
}

/// A list's entries without the padding after them.
#[inline]
pub(super) fn trimmed(list: &[Entry]) -> &[Entry] {
    &list[..list.partition_point(|&e| e != PAD)]
}

#[derive(Debug, Clone, Default)]
struct Class {
    entries: Vec<Entry>,
    free: Vec<u32>,
}

/// The arenas of every size class.
#[derive(Debug, Clone, Default)]
pub(super) struct HolderArena {
    classes: Vec<Class>,
}

fn capacity(class: u8) -> usize {
    if class == 0 {
        1
    } else {
        1 << class
    }
}

impl HolderArena {
    /// The entries of a list: at most one for class 0; for the others the
    /// whole block, its entries followed by [`PAD`]s.
    #[inline]
    pub(super) fn get<'a>(&'a self, list: &'a ListRef) -> &'a [Entry] {
        if list.class == 0 {
            return &std::slice::from_ref(&list.at)[..usize::from(list.at != 0)];
        }
        self.block(*list)
    }

    /// The block of a list kept in an arena (class above 0; empty otherwise):
    /// its entries followed by [`PAD`]s.
    #[inline]
    pub(super) fn block(&self, list: ListRef) -> &[Entry] {
        if list.class == 0 {
            return &[];
        }
        let start = (list.at as usize) << list.class;
        self.classes
            .get(usize::from(list.class))
            .and_then(|c| c.entries.get(start..start + capacity(list.class)))
            .unwrap_or(&[])
    }

    fn block_mut(&mut self, list: &ListRef) -> &mut [Entry] {
        let start = (list.at as usize) << list.class;
        self.classes
            .get_mut(usize::from(list.class))
            .and_then(|c| c.entries.get_mut(start..start + capacity(list.class)))
            .unwrap_or(&mut [])
    }

    /// How many entries a list has (a search: for counts, not hot paths).
    pub(super) fn len(&self, list: &ListRef) -> u32 {
        trimmed(self.get(list)).len() as u32
    }

    /// Whether a list has at least `n` entries, from one read.
    #[inline]
    pub(super) fn holds_at_least(&self, list: &ListRef, n: usize) -> bool {
        n == 0 || self.get(list).get(n - 1).is_some_and(|&e| e != PAD)
    }

    /// Sets entry `i` of a list.
    pub(super) fn set(&mut self, list: &mut ListRef, i: usize, value: Entry) {
        if list.class == 0 {
            if i == 0 && list.at != 0 {
                list.at = value;
            }
        } else if let Some(e) = self.block_mut(list).get_mut(i) {
            *e = value;
        }
    }

    /// Inserts `value` at position `i`; false when the list is at the largest
    /// class, or its class has no block number left.
    pub(super) fn insert(&mut self, list: &mut ListRef, i: usize, value: Entry) -> bool {
        if list.class == 0 && list.at == 0 {
            list.at = value;
            return true;
        }
        let full = self.get(list).last().is_some_and(|&e| e != PAD);
        if full && (list.class == MAX_CLASS || !self.move_to(list, list.class + 1)) {
            return false;
        }
        let block = self.block_mut(list);
        if i >= block.len() {
            return false;
        }
        let last = block.len() - 1;
        block.copy_within(i..last, i + 1);
        block[i] = value;
        true
    }

    /// Removes entry `i`, moving the list to a smaller class when it is a
    /// quarter full, inline when one entry is left.
    pub(super) fn remove(&mut self, list: &mut ListRef, i: usize) {
        if list.class == 0 {
            if i == 0 {
                list.at = 0;
            }
            return;
        }
        let block = self.block_mut(list);
        if i >= block.len() {
            return;
        }
        let last = block.len() - 1;
        block.copy_within(i + 1.., i);
        block[last] = PAD;
        let one_left = block.get(1) == Some(&PAD);
        let quarter_full = block.get(block.len() / 4) == Some(&PAD);
        if one_left {
            self.move_to(list, 0);
        } else if list.class > 1 && quarter_full {
            self.move_to(list, list.class - 1);
        }
    }

    /// Frees a list's block, padded for its next list; the list becomes empty.
    pub(super) fn release(&mut self, list: &mut ListRef) {
        if list.class > 0 {
            self.block_mut(list).fill(PAD);
            if let Some(arena) = self.classes.get_mut(usize::from(list.class)) {
                arena.free.push(list.at);
            }
        }
        *list = ListRef::default();
    }

    /// Moves a list into a block of another class that can hold it; false
    /// (the list unchanged) when that class has no block number left.
    fn move_to(&mut self, list: &mut ListRef, class: u8) -> bool {
        let mut moved = ListRef { class, at: 0 };
        if class > 0 {
            match self.allocate(class) {
                Some(at) => moved.at = at,
                None => return false,
            }
        }
        if class == 0 {
            moved.at = self
                .get(list)
                .first()
                .copied()
                .filter(|&e| e != PAD)
                .unwrap_or(0);
        } else if list.class == 0 {
            let value = list.at;
            if value != 0 {
                self.block_mut(&moved)[0] = value;
            }
        } else {
            // Both blocks hold every entry (a list shrinks a quarter full):
            // copy the smaller block's worth through a small stack buffer.
            let n = capacity(class).min(capacity(list.class));
            let from = (list.at as usize) << list.class;
            let to = (moved.at as usize) << class;
            let (src, dst) = (usize::from(list.class), usize::from(class));
            let mut buf = [0u32; 64];
            for start in (0..n).step_by(buf.len()) {
                let k = (n - start).min(buf.len());
                buf[..k]
                    .copy_from_slice(&self.classes[src].entries[from + start..from + start + k]);
                self.classes[dst].entries[to + start..to + start + k].copy_from_slice(&buf[..k]);
            }
        }
        self.release(list);
        *list = moved;
        true
    }

    /// A padded block of a class; `None` when a node's holder word could not
    /// name it.
    fn allocate(&mut self, class: u8) -> Option<u32> {
        let c = usize::from(class);
        if self.classes.len() <= c {
            self.classes.resize_with(c + 1, Class::default);
        }
        let arena = &mut self.classes[c];
        if let Some(at) = arena.free.pop() {
            return Some(at);
        }
        let block = capacity(class);
        let at = u32::try_from(arena.entries.len() / block)
            .ok()
            .filter(|&at| at < super::nodes::AT_LIMIT)?;
        super::nodes::grow_gently(&mut arena.entries, block);
        arena.entries.resize(arena.entries.len() + block, PAD);
        Some(at)
    }

    /// Heap bytes held, from capacities.
    pub(super) fn heap_bytes(&self) -> usize {
        self.classes
            .iter()
            .map(|c| c.entries.capacity() * 4 + c.free.capacity() * 4)
            .sum::<usize>()
            + self.classes.capacity() * std::mem::size_of::<Class>()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn slots(arena: &HolderArena, list: &ListRef) -> Vec<u32> {
        trimmed(arena.get(list))
            .iter()
            .map(|&e| slot_of(e))
            .collect()
    }

    #[test]
    fn a_list_grows_through_the_classes_and_shrinks_back_inline() {
        let mut arena = HolderArena::default();
        let mut list = ListRef::default();
        for slot in (0..100u32).rev() {
            let at = search(arena.get(&list), slot).expect_err("absent");
            assert!(arena.insert(&mut list, at, entry(slot, 1)));
        }
        assert_eq!(list.class, 7);
        assert_eq!(arena.len(&list), 100);
        assert!(arena.holds_at_least(&list, 100) && !arena.holds_at_least(&list, 101));
        assert_eq!(slots(&arena, &list), (0..100).collect::<Vec<_>>());
        assert_eq!(search(arena.get(&list), 42), Ok(42));
        for slot in 0..99u32 {
            let at = search(arena.get(&list), slot).expect("present");
            arena.remove(&mut list, at);
        }
        assert_eq!(list.class, 0);
        assert_eq!(slots(&arena, &list), vec![99]);
        assert_eq!(tiers_of(arena.get(&list)[0]), 1);
        // Freed blocks are reused, so the arenas stop growing.
        let before = arena.heap_bytes();
        for slot in 0..100u32 {
            if let Err(at) = search(arena.get(&list), slot) {
                arena.insert(&mut list, at, entry(slot, 2));
            }
        }
        assert_eq!(arena.heap_bytes(), before);
    }
}
