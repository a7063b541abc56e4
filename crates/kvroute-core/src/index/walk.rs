//! The lookup walk: follows a request's blocks through the node store and
//! records, for every rank that held the first block, where its match stops
//! on the device, on device or host, and on any tier.
//!
//! Two walks give the same answers: when few ranks hold the first block, the
//! ranks still matching are a sorted list merged with each block's holders;
//! when many do (the first block's holders are a dense set), they are
//! bitmaps, and a step is a few word-wide operations per 64 slots.

use super::dense::DenseView;
use super::holders::{self, Entry};
use super::nodes::{Holders, NodeId, NodeStore, SlotId};
use super::{RankMatch, WorkerRank, VACANT};
use crate::hash::SequenceHash;

/// Blocks probed ahead of the walk: the probes are independent memory loads,
/// so the processor overlaps their cache misses.
const PROBE_AHEAD: usize = 8;

/// Tier groups a match is counted in: device, device or host, any tier.
const DEVICE: u8 = 1;
const HOST: u8 = 2;
const ANY: u8 = 4;

/// The groups each tier mask keeps alive (bit 0 device, bit 1 host, bits 2
/// and 3 disk and external).
const GROUPS: [u8; 16] = {
    let mut table = [0u8; 16];
    let mut tiers = 1;
    while tiers < 16 {
        let mut g = ANY;
        if tiers & 1 != 0 {
            g |= DEVICE;
        }
        if tiers & 3 != 0 {
            g |= HOST;
        }
        table[tiers] = g;
        tiers += 1;
    }
    table
};

/// The groups a holder's tier mask keeps alive.
#[inline]
fn groups(tiers: u8) -> u8 {
    GROUPS[usize::from(tiers & 15)]
}

/// Holder lists longer than this many times the ranks still matching are
/// searched rather than scanned.
const SCAN_RATIO: usize = 4;

/// A rank still matching: its result row, its slot and its live groups.
#[derive(Clone, Copy, Default)]
struct Active {
    row: u32,
    slot: SlotId,
    groups: u8,
}

/// The first `len` elements of `stack`, or of `heap` grown to `len` when
/// `stack` is shorter: a walk's working arrays live on the lookup's stack at
/// the fleet sizes most lookups see (allocating and freeing them cost 4 % of
/// a lookup's instructions).
fn stack_or_heap<'a, T: Copy + Default>(
    stack: &'a mut [T],
    heap: &'a mut Vec<T>,
    len: usize,
) -> &'a mut [T] {
    if len <= stack.len() {
        &mut stack[..len]
    } else {
        heap.resize(len, T::default());
        heap
    }
}

/// Ranks still matching that a list walk keeps on the stack: a list walk
/// starts from a holder list, which grows no longer than the dense threshold
/// (16 at fleets of up to 448 slots), or from a bitmap walk below
/// [`SPARSE_BELOW`].
const ACTIVE_INLINE: usize = 16;
const _: () = assert!(SPARSE_BELOW as usize <= ACTIVE_INLINE);

/// One lookup in progress.
struct Walk<'a> {
    /// The ranks still matching are the first `len`.
    active: &'a mut [Active],
    len: usize,
    out: Vec<RankMatch>,
}

impl<'a> Walk<'a> {
    /// Starts from the holders of the first block.
    fn new(
        first: &[Entry],
        key_of: impl Fn(SlotId) -> Option<WorkerRank>,
        active: &'a mut [Active],
    ) -> Self {
        let mut out = Vec::with_capacity(first.len());
        let mut len = 0;
        for (row, &e) in first.iter().enumerate() {
            let slot = holders::slot_of(e);
            let worker_rank = key_of(slot).unwrap_or(VACANT);
            let groups = groups(holders::tiers_of(e));
            if groups != 0 {
                if let Some(a) = active.get_mut(len) {
                    *a = Active {
                        row: row as u32,
                        slot,
                        groups,
                    };
                    len += 1;
                }
            }
            out.push(RankMatch {
                worker_rank,
                device: 0,
                host: 0,
                any: 0,
            });
        }
        Walk { active, len, out }
    }

    /// Keeps the groups of each rank still matching that the block's
    /// holders keep; `tiers_of` is asked for each rank's tier mask in slot
    /// order. Groups that stop, stop at `depth`.
    fn retain(&mut self, depth: u32, mut tiers_of: impl FnMut(SlotId) -> u8) {
        let mut kept_len = 0usize;
        let len = self.len.min(self.active.len());
        for i in 0..len {
            let a = self.active[i];
            let kept = a.groups & groups(tiers_of(a.slot));
            if kept != a.groups {
                record(&mut self.out, a.row, a.groups & !kept, depth);
            }
            if kept != 0 {
                self.active[kept_len] = Active { groups: kept, ..a };
                kept_len += 1;
            }
        }
        self.len = kept_len;
    }

    /// Advances by one block, held by `list` (empty: by nobody), after
    /// `depth` matched blocks.
    fn step_list(&mut self, list: &[Entry], depth: u32) {
        let search = list.len() > SCAN_RATIO * self.len;
        let mut j = 0usize;
        // Both lists are sorted by slot: each rank's entry is found from `j` on.
        self.retain(depth, |slot| {
            if search {
                let rest = list.get(j..).unwrap_or(&[]);
                j += holders::search(rest, slot).unwrap_or_else(|i| i);
            } else {
                while j < list.len() && holders::slot_of(list[j]) < slot {
                    j += 1;
                }
            }
            match list.get(j) {
                Some(&e) if holders::slot_of(e) == slot => holders::tiers_of(e),
                _ => 0,
            }
        });
    }
}

impl Stepper for Walk<'_> {
    fn step(&mut self, holders: &Holders<'_>, depth: u32) {
        match holders {
            Holders::List(list) => self.step_list(list, depth),
            Holders::Dense(dense) => self.retain(depth, |slot| dense.tiers_of(slot)),
        }
    }

    fn is_done(&self) -> bool {
        self.len == 0
    }

    fn finish(mut self, depth: u32) -> Vec<RankMatch> {
        for a in self.active.iter().take(self.len) {
            record(&mut self.out, a.row, a.groups, depth);
        }
        self.out
    }
}

/// A walk in progress, advanced block by block by [`drive`].
trait Stepper {
    /// Advances by one block with these holders, after `depth` matched
    /// blocks: groups of ranks that do not hold it stop at `depth`.
    fn step(&mut self, holders: &Holders<'_>, depth: u32);
    /// No rank matches any more.
    fn is_done(&self) -> bool;
    /// The answer: ranks still matching hold all `depth` blocks walked.
    fn finish(self, depth: u32) -> Vec<RankMatch>;
}

/// Sets the match length of `groups` of a result row to `depth`.
#[inline]
fn record(out: &mut [RankMatch], row: u32, groups: u8, depth: u32) {
    if let Some(m) = out.get_mut(row as usize) {
        // Selects rather than branches: which groups stop is unpredictable.
        let pick = |group: u8, old: u32| if groups & group != 0 { depth } else { old };
        m.device = pick(DEVICE, m.device);
        m.host = pick(HOST, m.host);
        m.any = pick(ANY, m.any);
    }
}

/// For each rank holding the first block of `seqs` on some tier: how many
/// leading blocks it holds on the device, on device or host, and on any tier,
/// in slot order.
pub(super) fn find_matches(
    nodes: &NodeStore,
    seqs: &[SequenceHash],
    key_of: impl Fn(SlotId) -> Option<WorkerRank>,
) -> Vec<RankMatch> {
    let Some(first) = seqs.first() else {
        return Vec::new();
    };
    let Some(node) = nodes.find_seq(first.0) else {
        return Vec::new();
    };
    let holders = nodes.holders(node);
    let mut active = [Active::default(); ACTIVE_INLINE];
    let mut words = [0u64; BUF_INLINE];
    let (mut active_heap, mut words_heap) = (Vec::new(), Vec::new());
    let walk = match holders {
        Holders::List(list) => {
            let list = holders::trimmed(list);
            let active = stack_or_heap(&mut active, &mut active_heap, list.len());
            Walker::Sparse(Walk::new(list, key_of, active))
        }
        Holders::Dense(dense) => {
            let buf = stack_or_heap(&mut words, &mut words_heap, PARTS * dense.device.len());
            Walker::Dense(DenseWalk::new(&dense, key_of, buf, &mut active))
        }
    };
    drive(nodes, seqs, (node, holders), walk)
}

/// Ranks still matching below which a bitmap walk goes on as a list walk,
/// whose steps cost what its ranks cost rather than the fleet's width.
const SPARSE_BELOW: u32 = 16;

/// A walk in either form; a bitmap walk becomes a list walk once few ranks
/// still match.
enum Walker<'a> {
    Sparse(Walk<'a>),
    Dense(DenseWalk<'a>),
}

impl Stepper for Walker<'_> {
    fn step(&mut self, holders: &Holders<'_>, depth: u32) {
        match self {
            Walker::Sparse(walk) => walk.step(holders, depth),
            Walker::Dense(walk) => {
                walk.step(holders, depth);
                if walk.population() < SPARSE_BELOW {
                    if let Some(sparse) = walk.take_sparse() {
                        *self = Walker::Sparse(sparse);
                    }
                }
            }
        }
    }

    fn is_done(&self) -> bool {
        match self {
            Walker::Sparse(walk) => walk.is_done(),
            Walker::Dense(walk) => walk.is_done(),
        }
    }

    fn finish(self, depth: u32) -> Vec<RankMatch> {
        match self {
            Walker::Sparse(walk) => walk.finish(depth),
            Walker::Dense(walk) => walk.finish(depth),
        }
    }
}

/// Walks the blocks after the first, which is node `first` with these holders.
fn drive<S: Stepper>(
    nodes: &NodeStore,
    seqs: &[SequenceHash],
    (first, holders): (NodeId, Holders<'_>),
    mut walk: S,
) -> Vec<RankMatch> {
    let mut prev = holders;
    let mut depth: u32 = 1;
    // A chain stored by one event gets consecutive ids, so block `d` is
    // guessed to be node `origin + d`. A right guess costs one record read
    // and no table probe. The guesses of a chunk come from the chunk before
    // it, not from each other, and the wrong ones' probes follow them: the
    // loads of a chunk stay independent, and the processor overlaps their
    // cache misses (guessing from the block just found would chain them).
    let mut origin = first;
    'walk: for chunk in seqs.get(1..).unwrap_or(&[]).chunks(PROBE_AHEAD) {
        if walk.is_done() {
            break;
        }
        let mut ids: [Option<NodeId>; PROBE_AHEAD] = [None; PROBE_AHEAD];
        for (i, (id, seq)) in ids.iter_mut().zip(chunk).enumerate() {
            *id = nodes.seq_at(origin.wrapping_add(depth + i as u32), seq.0);
        }
        for (id, seq) in ids.iter_mut().zip(chunk) {
            if id.is_none() {
                *id = nodes.find_seq(seq.0);
                // A block not stored ends the walk: the blocks after it
                // need no probe.
                if id.is_none() {
                    break;
                }
            }
        }
        if let Some((i, found)) = (0..chunk.len()).rev().find_map(|i| Some((i, ids[i]?))) {
            origin = found.wrapping_sub(depth + i as u32);
        }
        for id in &ids[..chunk.len()] {
            let Some(id) = *id else {
                walk.step(&Holders::List(&[]), depth);
                break 'walk;
            };
            let holders = nodes.holders(id);
            // A run of blocks held by the same ranks on the same tiers (most
            // of a chain) changes nothing: the step is idempotent.
            if !holders.same_as(&prev) {
                walk.step(&holders, depth);
                if walk.is_done() {
                    break 'walk;
                }
                prev = holders;
            }
            depth += 1;
        }
    }
    walk.finish(depth)
}

/// The walk over bitmaps: per tier group, one bit per slot still matching.
struct DenseWalk<'a> {
    words: usize,
    /// The walk's bitmaps, `words` words each, back to back: the parts
    /// [`ACTIVE`] to [`SCRATCH`].
    buf: &'a mut [u64],
    /// Slots still matching on any tier.
    population: u32,
    out: Vec<RankMatch>,
    /// The stack space of the list walk this one becomes.
    spare: &'a mut [Active],
}

// The parts of a [`DenseWalk`]'s buffer, each `words` words.
/// The device, device-or-host and any-tier groups still matching (three parts).
const ACTIVE: usize = 0;
/// The slots that matched the first block: the result rows, in slot order.
const ROWS: usize = 3;
/// The result rows before each word of [`ROWS`].
const ROW_BASE: usize = 4;
/// The held bitmaps of a block whose holders are a list (three parts).
const SCRATCH: usize = 5;
/// Parts in all.
const PARTS: usize = 8;
/// Buffer words a bitmap walk keeps on the stack: all its parts at fleets of
/// up to 256 slots.
const BUF_INLINE: usize = PARTS * 4;

impl<'a> DenseWalk<'a> {
    /// Word `w` of part `part`.
    #[inline]
    fn word(&self, part: usize, w: usize) -> u64 {
        self.buf.get(part * self.words + w).copied().unwrap_or(0)
    }

    /// Sets word `w` of part `part`.
    #[inline]
    fn set(&mut self, part: usize, w: usize, value: u64) {
        if let Some(word) = self.buf.get_mut(part * self.words + w) {
            *word = value;
        }
    }

    /// Word `w` of the device, device-or-host and any-tier groups.
    #[inline]
    fn active_words(&self, w: usize) -> [u64; 3] {
        [ACTIVE, ACTIVE + 1, ACTIVE + 2].map(|p| self.word(p, w))
    }

    /// Starts from the first block's dense set, with space for its bitmaps
    /// ([`PARTS`] × its words) and for the list walk it may become.
    fn new(
        first: &DenseView<'_>,
        key_of: impl Fn(SlotId) -> Option<WorkerRank>,
        buf: &'a mut [u64],
        spare: &'a mut [Active],
    ) -> Self {
        let words = first.device.len();
        let mut walk = DenseWalk {
            words,
            buf,
            population: 0,
            out: Vec::new(),
            spare,
        };
        let mut base = 0u32;
        for w in 0..words {
            let [device, host, rest] = held_words(first, w);
            let any = device | host | rest;
            walk.set(ACTIVE, w, device);
            walk.set(ACTIVE + 1, w, device | host);
            walk.set(ACTIVE + 2, w, any);
            walk.set(ROWS, w, any);
            walk.set(ROW_BASE, w, u64::from(base));
            base += any.count_ones();
        }
        walk.population = base;
        walk.out.reserve(base as usize);
        for w in 0..words {
            for_each_bit(walk.word(ROWS, w), |bit| {
                let slot = (w * 64) as SlotId + bit;
                let worker_rank = key_of(slot).unwrap_or(VACANT);
                walk.out.push(RankMatch {
                    worker_rank,
                    device: 0,
                    host: 0,
                    any: 0,
                });
            });
        }
        walk
    }

    /// Records `depth` as the match length of each group for the slots of
    /// word `w` that stop in it (`stopped`: device, host and any-tier bits),
    /// and counts the slots that stop matching altogether.
    fn record_stops(&mut self, w: usize, stopped: [u64; 3], depth: u32) {
        let [device, host, any] = stopped;
        let all = device | host | any;
        if all == 0 {
            return;
        }
        self.population -= any.count_ones();
        let (rows, row_base) = (self.word(ROWS, w), self.word(ROW_BASE, w) as u32);
        if device == any && host == any && any == rows {
            // Every slot of the word stops in every group (a shared prefix
            // ends): its rows are consecutive.
            let start = row_base as usize;
            let end = start + any.count_ones() as usize;
            for m in self.out.get_mut(start..end).unwrap_or(&mut []) {
                (m.device, m.host, m.any) = (depth, depth, depth);
            }
            return;
        }
        // A slot's row is the word's base plus the result rows before it:
        // counted once up to the first stopped slot, then kept as a running
        // count (most stops are of every slot at once, at a chain's end).
        let below = all & all.wrapping_neg();
        let mut row = row_base + (rows & (below - 1)).count_ones();
        let mut rows = rows & !(below - 1);
        let last = 63 - all.leading_zeros();
        // A slot that stops in every group it was matching in (it held the
        // previous block on the device) is one store, without sorting out groups.
        let uniform = device == any && host == any;
        while rows != 0 {
            let bit = rows.trailing_zeros();
            if bit > last {
                break;
            }
            if uniform {
                if (any >> bit) & 1 != 0 {
                    if let Some(m) = self.out.get_mut(row as usize) {
                        (m.device, m.host, m.any) = (depth, depth, depth);
                    }
                }
                rows &= rows - 1;
                row += 1;
                continue;
            }
            let groups = groups_at(bit, stopped);
            if groups != 0 {
                record(&mut self.out, row, groups, depth);
            }
            rows &= rows - 1;
            row += 1;
        }
    }

    /// Ranks still matching on any tier.
    fn population(&self) -> u32 {
        self.population
    }

    /// The same walk as a list of the ranks still matching (the result rows
    /// move over as they are); none when they outnumber the list's space.
    fn take_sparse(&mut self) -> Option<Walk<'a>> {
        if self.population as usize > self.spare.len() {
            return None;
        }
        let words = self.words;
        let active = std::mem::take(&mut self.spare);
        let mut len = 0;
        for w in 0..words {
            let [device, host, any] = self.active_words(w);
            if any == 0 {
                continue;
            }
            let (base, rows) = (self.word(ROW_BASE, w) as u32, self.word(ROWS, w));
            // Only the slots still matching are visited (fewer than
            // [`SPARSE_BELOW`]); a slot's row counts the rows below it.
            for_each_bit(any, |bit| {
                if let Some(a) = active.get_mut(len) {
                    *a = Active {
                        row: base + (rows & ((1u64 << bit) - 1)).count_ones(),
                        slot: (w * 64) as SlotId + bit,
                        groups: groups_at(bit, [device, host, any]),
                    };
                    len += 1;
                }
            });
        }
        Some(Walk {
            active,
            len,
            out: std::mem::take(&mut self.out),
        })
    }

    /// Applies one word's held bits (device, host, lower) to the active groups.
    fn step_word(&mut self, w: usize, [device, host, rest]: [u64; 3], depth: u32) {
        let held = [device, device | host, device | host | rest];
        let mut stopped = [0u64; 3];
        for (g, held) in held.into_iter().enumerate() {
            let word = self.word(ACTIVE + g, w);
            stopped[g] = word & !held;
            self.set(ACTIVE + g, w, word & held);
        }
        self.record_stops(w, stopped, depth);
    }
}

/// The groups whose word has bit `bit` set, of device, host and any-tier words.
#[inline]
fn groups_at(bit: u32, [device, host, any]: [u64; 3]) -> u8 {
    let at = |word: u64, group: u8| (((word >> bit) & 1) as u8) * group;
    at(device, DEVICE) | at(host, HOST) | at(any, ANY)
}

/// Calls `f` with the index of each set bit of `word`, lowest first.
#[inline]
fn for_each_bit(mut word: u64, mut f: impl FnMut(u32)) {
    while word != 0 {
        f(word.trailing_zeros());
        word &= word - 1;
    }
}

/// Word `w` of a dense set's device, host and other-tier bitmaps.
#[inline]
fn held_words(dense: &DenseView<'_>, w: usize) -> [u64; 3] {
    let words = dense.device.len();
    let device = dense.device.get(w).copied().unwrap_or(0);
    match dense.lower {
        Some(l) => [device, l[w], l[words + w] | l[2 * words + w]],
        None => [device, 0, 0],
    }
}

impl Stepper for DenseWalk<'_> {
    fn step(&mut self, holders: &Holders<'_>, depth: u32) {
        let words = self.words;
        match holders {
            Holders::Dense(dense) => {
                for w in 0..words {
                    self.step_word(w, held_words(dense, w), depth);
                }
            }
            Holders::List(list) => {
                // A list is short (below the dense threshold): spread it into bitmaps.
                if let Some(scratch) = self.buf.get_mut(SCRATCH * words..) {
                    scratch.fill(0);
                }
                for &e in *list {
                    let (slot, tiers) = (holders::slot_of(e) as usize, holders::tiers_of(e));
                    let (w, bit) = (slot / 64, 1u64 << (slot % 64));
                    if w < words {
                        let g = groups(tiers);
                        for (i, group) in [DEVICE, HOST, ANY].into_iter().enumerate() {
                            if g & group != 0 {
                                let held = self.word(SCRATCH + i, w);
                                self.set(SCRATCH + i, w, held | bit);
                            }
                        }
                    }
                }
                for w in 0..words {
                    let held = [SCRATCH, SCRATCH + 1, SCRATCH + 2].map(|p| self.word(p, w));
                    self.step_word(w, held, depth);
                }
            }
        }
    }

    fn is_done(&self) -> bool {
        // The any-tier group holds every slot of the other two.
        self.population == 0
    }

    fn finish(mut self, depth: u32) -> Vec<RankMatch> {
        let words = self.words;
        for w in 0..words {
            let still = self.active_words(w);
            self.record_stops(w, still, depth);
        }
        self.out
    }
}
