//! Hybrid models: the residency of a rank's window and state groups, and the
//! cap it puts on the rank's matches.
//!
//! The index keeps a hybrid model's attention chain like any other. Its
//! other groups ([`GroupBlocks`]) are kept here by engine hash (a group
//! block's hash is the attention chain's hash at the same boundary), with
//! their tiers. A lookup's match of k blocks then counts only as far as the
//! longest prefix every group accepts (vLLM's `HybridKVCacheCoordinator`,
//! iterated to a fixed point): a window group needs its `blocks` blocks
//! ending at the prefix's end (all of them for a shorter prefix), a state
//! group its state there. Each count (device, device or host, any tier) is
//! capped with the groups' residency on the same tiers. Ranks without such
//! groups pay nothing.

use rustc_hash::FxHashMap;

use crate::event::{GroupBlocks, GroupRule, Tier};

/// A tier's bit in a residency mask (bit 0 device, 1 host, 2 disk, 3 external).
fn tier_bit(tier: Tier) -> u8 {
    match tier {
        Tier::Device => 1,
        Tier::Host => 2,
        Tier::Disk => 4,
        Tier::External => 8,
    }
}

/// Residency masks a count accepts: device; device or host; any tier.
pub(super) const DEVICE_MASK: u8 = 1;
pub(super) const HOST_MASK: u8 = 3;
pub(super) const ANY_MASK: u8 = 15;

#[derive(Debug, Clone)]
struct Group {
    id: u32,
    rule: GroupRule,
    /// Engine hash → the tiers the group holds that block on.
    resident: FxHashMap<u64, u8>,
}

/// One rank's window and state groups.
#[derive(Debug, Clone, Default)]
pub(super) struct Hybrid {
    groups: Vec<Group>,
}

impl Hybrid {
    /// Applies a group's store or eviction; stores past `capacity` entries
    /// are not kept (a missing entry only ever lowers a match).
    pub(super) fn apply(&mut self, e: &GroupBlocks, capacity: Option<u64>) {
        let at = match self.groups.iter().position(|g| g.id == e.group) {
            Some(at) => at,
            None => {
                self.groups.push(Group {
                    id: e.group,
                    rule: e.rule,
                    resident: FxHashMap::default(),
                });
                self.groups.len() - 1
            }
        };
        let group = &mut self.groups[at];
        group.rule = e.rule;
        let bit = tier_bit(e.tier);
        for block in &e.blocks {
            if e.stored {
                let full = capacity.is_some_and(|c| group.resident.len() as u64 >= c);
                if full && !group.resident.contains_key(&block.0) {
                    continue;
                }
                *group.resident.entry(block.0).or_default() |= bit;
            } else if let Some(mask) = group.resident.get_mut(&block.0) {
                *mask &= !bit;
                if *mask == 0 {
                    group.resident.remove(&block.0);
                }
            }
        }
    }

    /// Forgets every group's residency (the rank's cache was cleared).
    pub(super) fn clear(&mut self) {
        for g in &mut self.groups {
            g.resident.clear();
        }
    }

    /// Entries kept.
    #[cfg(test)]
    fn entries(&self) -> u64 {
        self.groups.iter().map(|g| g.resident.len() as u64).sum()
    }

    /// The longest prefix of at most `k` blocks every group accepts on the
    /// tiers of `mask`; `exts[i]` is the engine hash this rank names block
    /// `i` of the request by (`None`: unnamed, accepted by no group).
    pub(super) fn cap(&self, exts: &[Option<u64>], k: u32, mask: u8) -> u32 {
        let mut k = k.min(exts.len() as u32);
        loop {
            let capped = self
                .groups
                .iter()
                .map(|g| g.longest(exts, k, mask))
                .min()
                .unwrap_or(k);
            if capped == k {
                return k;
            }
            k = capped;
        }
    }
}

impl Group {
    fn holds(&self, ext: Option<u64>, mask: u8) -> bool {
        ext.and_then(|e| self.resident.get(&e))
            .is_some_and(|&tiers| tiers & mask != 0)
    }

    /// The longest prefix of at most `k` blocks this group accepts.
    fn longest(&self, exts: &[Option<u64>], k: u32, mask: u8) -> u32 {
        match self.rule {
            GroupRule::State => (1..=k)
                .rev()
                .find(|&end| self.holds(exts[end as usize - 1], mask))
                .unwrap_or(0),
            GroupRule::Window { blocks, stride } => {
                let stride = stride.max(1);
                // Group block j ends at attention block (j + 1) · stride.
                let group_blocks = k / stride;
                let mut run = 0u32;
                let mut best = 0u32;
                for j in 0..group_blocks {
                    let end = (j + 1) * stride;
                    run = if self.holds(exts[end as usize - 1], mask) {
                        run + 1
                    } else {
                        0
                    };
                    // The window's blocks end here, or every block from the start.
                    if run >= blocks.min(j + 1) {
                        best = end;
                    }
                }
                best
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::event::ExternalHash;

    fn stored(group: u32, rule: GroupRule, hashes: &[u64], tier: Tier) -> GroupBlocks {
        GroupBlocks {
            group,
            rule,
            blocks: hashes.iter().map(|&h| ExternalHash(h)).collect(),
            tier,
            stored: true,
        }
    }

    fn exts(n: u64) -> Vec<Option<u64>> {
        (1..=n).map(Some).collect()
    }

    #[test]
    fn a_window_group_accepts_prefixes_whose_window_it_holds() {
        let rule = GroupRule::Window {
            blocks: 2,
            stride: 1,
        };
        let mut h = Hybrid::default();
        // Blocks 1..=6 of the chain; the group holds 1, 2, 4, 5 (3 and 6 evicted).
        h.apply(&stored(1, rule, &[1, 2, 4, 5], Tier::Device), None);
        let e = exts(6);
        assert_eq!(h.cap(&e, 6, ANY_MASK), 5, "blocks 4, 5 end the window at 5");
        assert_eq!(
            h.cap(&e, 4, ANY_MASK),
            2,
            "block 3 is missing under 3 and 4"
        );
        assert_eq!(
            h.cap(&e, 1, ANY_MASK),
            1,
            "a short prefix needs all its blocks"
        );
        assert_eq!(h.cap(&e, 0, ANY_MASK), 0);
    }

    #[test]
    fn a_state_group_accepts_only_where_it_holds_a_state() {
        let mut h = Hybrid::default();
        h.apply(&stored(2, GroupRule::State, &[4, 8], Tier::Device), None);
        let e = exts(10);
        assert_eq!(h.cap(&e, 10, ANY_MASK), 8);
        assert_eq!(h.cap(&e, 7, ANY_MASK), 4);
        assert_eq!(h.cap(&e, 3, ANY_MASK), 0);
        // An evicted state no longer counts; a host copy counts for host and any.
        h.apply(
            &GroupBlocks {
                stored: false,
                ..stored(2, GroupRule::State, &[8], Tier::Device)
            },
            None,
        );
        h.apply(&stored(2, GroupRule::State, &[8], Tier::Host), None);
        assert_eq!(h.cap(&e, 10, DEVICE_MASK), 4);
        assert_eq!(h.cap(&e, 10, HOST_MASK), 8);
    }

    #[test]
    fn several_groups_meet_at_a_prefix_every_one_accepts() {
        let mut h = Hybrid::default();
        let window = GroupRule::Window {
            blocks: 2,
            stride: 1,
        };
        h.apply(&stored(1, window, &[1, 2, 3, 5, 6], Tier::Device), None);
        h.apply(&stored(2, GroupRule::State, &[3, 6], Tier::Device), None);
        // State at 6, window ends at 6: 6; below that, state at 3 and window at 3.
        assert_eq!(h.cap(&exts(6), 6, ANY_MASK), 6);
        assert_eq!(h.cap(&exts(6), 5, ANY_MASK), 3);
        // A stride-2 window: group blocks end at 2, 4, 6.
        let mut h = Hybrid::default();
        let wide = GroupRule::Window {
            blocks: 1,
            stride: 2,
        };
        h.apply(&stored(1, wide, &[2, 6], Tier::Device), None);
        assert_eq!(h.cap(&exts(7), 7, ANY_MASK), 6);
        assert_eq!(h.cap(&exts(7), 5, ANY_MASK), 2);
        h.clear();
        assert_eq!(h.cap(&exts(7), 7, ANY_MASK), 0);
        assert_eq!(h.entries(), 0);
    }

    #[test]
    fn a_full_group_keeps_what_it_has_and_takes_no_more() {
        let mut h = Hybrid::default();
        h.apply(
            &stored(2, GroupRule::State, &[1, 2, 3], Tier::Device),
            Some(2),
        );
        assert_eq!(h.entries(), 2);
        assert_eq!(h.cap(&exts(3), 3, ANY_MASK), 2);
    }
}
