//! Dense holder sets: blocks held by many ranks (a popular system prompt)
//! keep one bit per slot instead of a list, so their size and the cost of a
//! lookup step over them follow the fleet's width in words, not the number
//! of holders. A block is the device bitmap plus, only when some rank holds
//! the block on a lower tier, a side block of host, disk and external bitmaps.

use super::holders::{self, Entry};
use super::nodes::SlotId;

/// A block's header word: the lower block's index in its low half
/// (`NO_LOWER`: none), the set's holder count in its high half.
const NO_LOWER: u64 = u32::MAX as u64;
const LOWER_MASK: u64 = u32::MAX as u64;

/// The lower block's index a header names, if any.
#[inline]
fn lower_of(header: u64) -> Option<usize> {
    let lower = header & LOWER_MASK;
    (lower != NO_LOWER).then_some(lower as usize)
}

/// The bitmaps of one dense set.
#[derive(Debug, Clone, Copy)]
pub(super) struct DenseView<'a> {
    /// One bit per slot holding the block on the device.
    pub(super) device: &'a [u64],
    /// Host, disk and external bitmaps back to back, when any is non-empty.
    pub(super) lower: Option<&'a [u64]>,
}

impl DenseView<'_> {
    /// The tier mask of a slot (bit 0 device … bit 3 external).
    #[inline]
    pub(super) fn tiers_of(&self, slot: SlotId) -> u8 {
        let (w, bit) = (slot as usize / 64, 1u64 << (slot % 64));
        let words = self.device.len();
        let mut tiers = u8::from(self.device.get(w).is_some_and(|&x| x & bit != 0));
        if let Some(lower) = self.lower {
            for t in 0..3 {
                if lower.get(t * words + w).is_some_and(|&x| x & bit != 0) {
                    tiers |= 2 << t;
                }
            }
        }
        tiers
    }

    /// Every holder as a list entry, in slot order.
    pub(super) fn for_each(&self, mut f: impl FnMut(Entry)) {
        let words = self.device.len();
        for w in 0..words {
            let mut any = self.device[w];
            if let Some(lower) = self.lower {
                any |= lower[w] | lower[words + w] | lower[2 * words + w];
            }
            while any != 0 {
                let slot = (w * 64) as SlotId + any.trailing_zeros();
                any &= any - 1;
                f(holders::entry(slot, self.tiers_of(slot)));
            }
        }
    }
}

/// The arena of dense sets, all `words` words wide.
#[derive(Debug, Clone, Default)]
pub(super) struct DenseArena {
    words: usize,
    /// Blocks of `1 + words`: the header (lower block, holder count), then the device bitmap.
    blocks: Vec<u64>,
    free: Vec<u32>,
    lower: Vec<u64>,
    lower_free: Vec<u32>,
}

impl DenseArena {
    /// Bitmap words per tier.
    pub(super) fn words(&self) -> usize {
        self.words
    }

    fn stride(&self) -> usize {
        1 + self.words
    }

    /// A new, empty set; `None` when a node's holder word could not name it.
    pub(super) fn allocate(&mut self) -> Option<u32> {
        if let Some(at) = self.free.pop() {
            return Some(at);
        }
        let stride = self.stride();
        let at = u32::try_from(self.blocks.len() / stride)
            .ok()
            .filter(|&at| at < super::nodes::AT_LIMIT - 1)?;
        super::nodes::grow_gently(&mut self.blocks, stride);
        self.blocks.resize(self.blocks.len() + stride, 0);
        self.blocks[at as usize * stride] = NO_LOWER;
        Some(at)
    }

    /// Ranks in a set, as last stored by [`DenseArena::set_len`].
    #[inline]
    pub(super) fn len(&self, at: u32) -> u32 {
        self.blocks
            .get(at as usize * self.stride())
            .map_or(0, |&header| (header >> 32) as u32)
    }

    /// Stores the number of ranks in a set.
    pub(super) fn set_len(&mut self, at: u32, len: u32) {
        let start = at as usize * self.stride();
        if let Some(header) = self.blocks.get_mut(start) {
            *header = (*header & LOWER_MASK) | (u64::from(len) << 32);
        }
    }

    /// Frees a set.
    pub(super) fn release(&mut self, at: u32) {
        let start = at as usize * self.stride();
        let Some(block) = self.blocks.get_mut(start..start + 1 + self.words) else {
            return;
        };
        let lower = lower_of(block[0]);
        block.fill(0);
        block[0] = NO_LOWER;
        if let Some(lower) = lower {
            let span = 3 * self.words;
            let from = lower * span;
            self.lower[from..from + span].fill(0);
            self.lower_free.push(lower as u32);
        }
        self.free.push(at);
    }

    /// The bitmaps of a set.
    #[inline]
    pub(super) fn view(&self, at: u32) -> DenseView<'_> {
        let start = at as usize * self.stride();
        let Some(block) = self.blocks.get(start..start + 1 + self.words) else {
            return DenseView {
                device: &[],
                lower: None,
            };
        };
        let lower = lower_of(block[0]).map(|lower| {
            let span = 3 * self.words;
            &self.lower[lower * span..(lower + 1) * span]
        });
        DenseView {
            device: &block[1..],
            lower,
        }
    }

    /// Sets a slot's tier bit (`bits`: one bit of a tier mask); returns the
    /// slot's tier mask before.
    pub(super) fn set(&mut self, at: u32, slot: SlotId, bits: u8) -> u8 {
        let before = self.view(at).tiers_of(slot);
        let (w, bit) = (slot as usize / 64, 1u64 << (slot % 64));
        if w >= self.words {
            return before;
        }
        let start = at as usize * self.stride();
        if bits & 1 != 0 {
            self.blocks[start + 1 + w] |= bit;
        }
        for t in 0..3 {
            if bits & (2 << t) != 0 {
                let lower = self.ensure_lower(at);
                self.lower[lower * 3 * self.words + t * self.words + w] |= bit;
            }
        }
        before
    }

    /// Clears a slot's tier bits; returns the slot's tier mask before.
    pub(super) fn clear(&mut self, at: u32, slot: SlotId, bits: u8) -> u8 {
        let before = self.view(at).tiers_of(slot);
        let (w, bit) = (slot as usize / 64, 1u64 << (slot % 64));
        if before & bits == 0 || w >= self.words {
            return before;
        }
        let start = at as usize * self.stride();
        if bits & 1 != 0 {
            self.blocks[start + 1 + w] &= !bit;
        }
        let header = self.blocks[start];
        if let Some(lower) = lower_of(header).filter(|_| bits & 0b1110 != 0) {
            let span = 3 * self.words;
            let from = lower * span;
            for t in 0..3 {
                if bits & (2 << t) != 0 {
                    self.lower[from + t * self.words + w] &= !bit;
                }
            }
            if self.lower[from..from + span].iter().all(|&x| x == 0) {
                self.lower_free.push(lower as u32);
                self.blocks[start] = (header & !LOWER_MASK) | NO_LOWER;
            }
        }
        before
    }

    fn ensure_lower(&mut self, at: u32) -> usize {
        let start = at as usize * self.stride();
        let header = self.blocks[start];
        if let Some(lower) = lower_of(header) {
            return lower;
        }
        let span = 3 * self.words;
        let index = match self.lower_free.pop() {
            Some(i) => i as usize,
            None => {
                let i = self.lower.len() / span;
                super::nodes::grow_gently(&mut self.lower, span);
                self.lower.resize(self.lower.len() + span, 0);
                i
            }
        };
        self.blocks[start] = (header & !LOWER_MASK) | index as u64;
        index
    }

    /// Makes every set `words` words wide (more slots than bits).
    pub(super) fn widen(&mut self, words: usize) {
        if words <= self.words {
            return;
        }
        let old = self.words;
        let count = if old == 0 {
            0
        } else {
            self.blocks.len() / (1 + old)
        };
        let mut blocks = vec![0u64; count * (1 + words)];
        for i in 0..count {
            let (from, to) = (i * (1 + old), i * (1 + words));
            blocks[to..to + 1 + old].copy_from_slice(&self.blocks[from..from + 1 + old]);
        }
        let lower_count = if old == 0 {
            0
        } else {
            self.lower.len() / (3 * old)
        };
        let mut lower = vec![0u64; lower_count * 3 * words];
        for i in 0..lower_count {
            for t in 0..3 {
                let (from, to) = (i * 3 * old + t * old, i * 3 * words + t * words);
                lower[to..to + old].copy_from_slice(&self.lower[from..from + old]);
            }
        }
        self.blocks = blocks;
        self.lower = lower;
        self.words = words;
    }

    /// Heap bytes held, from capacities.
    pub(super) fn heap_bytes(&self) -> usize {
        (self.blocks.capacity() + self.lower.capacity()) * 8
            + (self.free.capacity() + self.lower_free.capacity()) * 4
    }
}
