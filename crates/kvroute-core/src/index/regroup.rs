//! Moving ranks between indexes: splitting one index into shards of ranks,
//! and merging shards back into one (for a snapshot, which is one index
//! whatever the shard count that wrote or reads it).
//!
//! A rank's state moves whole: its residencies on every tier, its cap, its
//! private engine-hash bindings and its approximate deadlines. Where the
//! target names a block by another shared engine hash than the source did,
//! the ranks that used the source's name keep it as a private binding, so
//! every rank resolves exactly the names it resolved before.

use super::holders;
use super::nodes::{Bind, NodeId, SlotId};
use super::{Index, Slot, WorkerRank, TIERS};

impl Index {
    /// An empty index with the same settings.
    pub(super) fn empty_like(&self) -> Index {
        Index::new(self.config.clone())
    }

    /// Copies every rank `keep` accepts, with all its state, into `to`.
    /// The ranks must not be in `to` already.
    pub(super) fn copy_ranks_into(&self, to: &mut Index, keep: impl Fn(WorkerRank) -> bool) {
        let slot_map = self.map_slots(to, keep);
        let mut node_map: Vec<Option<NodeId>> = vec![None; self.nodes.capacity()];
        let mut list: Vec<holders::Entry> = Vec::new();
        for node in self.nodes.live_ids() {
            list.clear();
            self.nodes.holders(node).for_each(|e| list.push(e));
            let copied = |e: &holders::Entry| mapped(&slot_map, holders::slot_of(*e)).is_some();
            if !list.iter().any(copied) {
                continue;
            }
            let seq = self.nodes.seq(node);
            let target = to.nodes.insert_seq(seq);
            node_map[node as usize] = Some(target);
            let bind = self
                .nodes
                .primary_ext(node)
                .map(|ext| (ext, to.nodes.bind_ext(target, ext)));
            for &e in &list {
                let (from_slot, tiers) = (holders::slot_of(e), holders::tiers_of(e));
                let Some(t) = mapped(&slot_map, from_slot) else {
                    continue;
                };
                for (bit, tier) in TIERS.iter().enumerate() {
                    if tiers & (1 << bit) != 0 {
                        to.add_residency(t, target, *tier);
                    }
                }
                // The rank named the block by the source's shared name; if
                // that is not the target's, it becomes the rank's own.
                if let Some((ext, _)) = bind.filter(|(_, b)| *b != Bind::Primary) {
                    let named_otherwise = self
                        .slot_ref(from_slot)
                        .is_some_and(|s| s.private_name.contains_key(&node));
                    if !named_otherwise {
                        to.bind_private(t, target, seq, ext);
                    }
                }
            }
        }
        for (ext, node) in self.nodes.aliases() {
            if let Some(target) = node_map.get(node as usize).copied().flatten() {
                to.nodes.bind_ext(target, ext);
            }
        }
        self.copy_slot_state(to, &slot_map, &node_map);
    }

    /// Registers the kept ranks in `to`, with their caps; source slot → target slot.
    fn map_slots(&self, to: &mut Index, keep: impl Fn(WorkerRank) -> bool) -> Vec<Option<SlotId>> {
        self.slots
            .iter()
            .map(|s| {
                let s = s.as_ref().filter(|s| keep(s.key))?;
                let t = to.slot(s.key);
                if let Some(target) = to.slot_mut(t) {
                    target.capacity = s.capacity;
                }
                Some(t)
            })
            .collect()
    }

    /// Private bindings and approximate deadlines of the copied ranks.
    fn copy_slot_state(
        &self,
        to: &mut Index,
        slot_map: &[Option<SlotId>],
        node_map: &[Option<NodeId>],
    ) {
        let target_of = |node: NodeId| node_map.get(node as usize).copied().flatten();
        for (from, s) in self.slots.iter().enumerate() {
            let (Some(s), Some(t)) = (s, mapped(slot_map, from as SlotId)) else {
                continue;
            };
            for (&ext, &(node, seq)) in &s.private_ext {
                if let Some(target) = target_of(node) {
                    to.bind_private(t, target, seq, ext);
                }
            }
            let mut approx: Vec<(u64, NodeId)> = s
                .approx_deadline
                .iter()
                .filter_map(|(&node, &deadline)| Some((deadline, target_of(node)?)))
                .collect();
            approx.sort_unstable();
            if let Some(target) = to.slot_mut(t) {
                for (deadline, node) in approx {
                    target.approx_deadline.insert(node, deadline);
                    target.approx_queue.push_back((deadline, node));
                }
            }
        }
    }

    fn slot_ref(&self, slot: SlotId) -> Option<&Slot> {
        self.slots.get(slot as usize).and_then(Option::as_ref)
    }
}

fn mapped(slot_map: &[Option<SlotId>], slot: SlotId) -> Option<SlotId> {
    slot_map.get(slot as usize).copied().flatten()
}
