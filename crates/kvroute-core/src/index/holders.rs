//! Holder lists: which (worker, rank) slots hold a node's block, and on which
//! tiers.
//!
//! A list is sorted by slot; each entry is one `u32`, the slot shifted left by
//! four with the tier mask (device, host, disk, external) in the low bits. Most
//! blocks are held by one rank, so a one-entry list lives inside the node
//! record itself; longer lists live in power-of-two size classes of one arena
//! per class, found by a 32-bit block number. A node's cost therefore follows
//! the ranks that hold it, never the size of the fleet.

use super::nodes::SlotId;

/// One holder: `slot << TIER_BITS | tier mask`.
pub(super) type Entry = u32;

const TIER_BITS: u32 = 4;
const TIER_MASK: u32 = (1 << TIER_BITS) - 1;

/// Slots an entry can name.
pub(super) const MAX_SLOTS: u32 = 1 << (32 - TIER_BITS);

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

/// Where a node's holder list is. `class` 0 means the list (of at most one
/// entry) is `at` itself; class `c` means block `at` of the arena whose
/// blocks hold `2^c` entries.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub(super) struct ListRef {
    pub(super) class: u8,
    pub(super) len: u32,
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
    /// The entries of a list.
    #[inline]
    pub(super) fn get<'a>(&'a self, list: &'a ListRef) -> &'a [Entry] {
        if list.class == 0 {
            return &std::slice::from_ref(&list.at)[..list.len as usize];
        }
        self.block(*list)
    }

    /// The entries of a list kept in an arena (class above 0; empty otherwise).
    #[inline]
    pub(super) fn block(&self, list: ListRef) -> &[Entry] {
        if list.class == 0 {
            return &[];
        }
        let start = (list.at as usize) << list.class;
        self.classes
            .get(usize::from(list.class))
            .and_then(|c| c.entries.get(start..start + list.len as usize))
            .unwrap_or(&[])
    }

    fn get_mut<'a>(&'a mut self, list: &'a mut ListRef) -> &'a mut [Entry] {
        if list.class == 0 {
            return &mut std::slice::from_mut(&mut list.at)[..list.len as usize];
        }
        let start = (list.at as usize) << list.class;
        let end = start + list.len as usize;
        &mut self.classes[usize::from(list.class)].entries[start..end]
    }

    /// Sets entry `i` of a list.
    pub(super) fn set(&mut self, list: &mut ListRef, i: usize, value: Entry) {
        if let Some(e) = self.get_mut(list).get_mut(i) {
            *e = value;
        }
    }

    /// Inserts `value` at position `i`; false when the list is at the largest class.
    pub(super) fn insert(&mut self, list: &mut ListRef, i: usize, value: Entry) -> bool {
        let len = list.len as usize;
        if len == capacity(list.class) {
            if list.class == MAX_CLASS {
                return false;
            }
            self.move_to(list, list.class + 1);
        }
        list.len += 1;
        let entries = self.get_mut(list);
        entries.copy_within(i..len, i + 1);
        entries[i] = value;
        true
    }

    /// Removes entry `i`, moving the list to a smaller class when it is a quarter full.
    pub(super) fn remove(&mut self, list: &mut ListRef, i: usize) {
        let len = list.len as usize;
        if i >= len {
            return;
        }
        self.get_mut(list).copy_within(i + 1..len, i);
        list.len -= 1;
        let len = list.len as usize;
        if list.class > 0 && len <= 1 {
            self.move_to(list, 0);
        } else if list.class > 1 && len <= capacity(list.class) / 4 {
            self.move_to(list, list.class - 1);
        }
    }

    /// Frees a list's block; the list becomes empty.
    pub(super) fn release(&mut self, list: &mut ListRef) {
        if list.class > 0 {
            self.classes[usize::from(list.class)].free.push(list.at);
        }
        *list = ListRef::default();
    }

    /// Moves a list into a block of another class that can hold it.
    fn move_to(&mut self, list: &mut ListRef, class: u8) {
        let len = list.len as usize;
        let mut moved = ListRef {
            class,
            len: list.len,
            at: 0,
        };
        if class > 0 {
            moved.at = self.allocate(class);
        }
        if list.class == 0 || class == 0 {
            let value = self.get(list).first().copied().unwrap_or(0);
            if class == 0 {
                moved.at = value;
            } else if len > 0 {
                self.get_mut(&mut moved)[0] = value;
            }
        } else {
            let from = (list.at as usize) << list.class;
            let to = (moved.at as usize) << class;
            let (src, dst) = (usize::from(list.class), usize::from(class));
            // Two arenas: copy through a small stack buffer in chunks.
            let mut buf = [0u32; 64];
            for start in (0..len).step_by(buf.len()) {
                let n = (len - start).min(buf.len());
                buf[..n]
                    .copy_from_slice(&self.classes[src].entries[from + start..from + start + n]);
                self.classes[dst].entries[to + start..to + start + n].copy_from_slice(&buf[..n]);
            }
        }
        let mut old = *list;
        old.len = 0;
        self.release(&mut old);
        *list = moved;
    }

    fn allocate(&mut self, class: u8) -> u32 {
        let c = usize::from(class);
        if self.classes.len() <= c {
            self.classes.resize_with(c + 1, Class::default);
        }
        let arena = &mut self.classes[c];
        if let Some(at) = arena.free.pop() {
            return at;
        }
        let block = capacity(class);
        let at = arena.entries.len() / block;
        super::nodes::grow_gently(&mut arena.entries, block);
        arena.entries.resize(arena.entries.len() + block, 0);
        u32::try_from(at).unwrap_or(u32::MAX)
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
        arena.get(list).iter().map(|&e| slot_of(e)).collect()
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
