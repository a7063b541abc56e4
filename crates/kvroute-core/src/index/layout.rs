//! Where the index's bytes go, part by part, and the fewest bytes its layout
//! could hold the same contents in: the figures `kvroute bench index` sets
//! beside the floor of any exact index, so that the distance from a memory
//! goal can be split into what this layout wastes and what it must spend.

use super::Index;

/// The index's heap by part, as allocated, with the counts that set the
/// layout's least size.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct IndexLayout {
    /// Nodes in use (distinct block prefixes).
    pub nodes: u64,
    /// (node, rank) pairs: holder entries, each rank once whatever its tiers.
    pub holder_entries: u64,
    /// Node records as allocated, spare and freed records included.
    pub record_bytes: u64,
    /// The tables that find a node by sequence hash or engine hash, the
    /// second names of nodes and the free list.
    pub node_table_bytes: u64,
    /// Holder lists and dense holder sets of nodes held by more than one rank.
    pub holder_list_bytes: u64,
    /// Per-rank bookkeeping: private engine-hash bindings, guesses, slots.
    pub rank_bytes: u64,
}

impl IndexLayout {
    /// The bytes a node's record cannot do without in this layout: its two
    /// 64-bit names (the sequence hash lookups ask for, the engine hash events
    /// name) and one 32-bit holder word (the one holder, or where the list is),
    /// with flags and the list's length assumed packed away.
    pub const RECORD_FIELD_BYTES: u64 = 20;

    /// The bytes of one node reference in a node table: a 32-bit node id
    /// (its spare high bits carrying the hash tag that spares a record read).
    pub const TABLE_REFERENCE_BYTES: u64 = 4;

    /// The bytes of one holder entry in a list: a 32-bit (slot, tiers) word.
    pub const HOLDER_ENTRY_BYTES: u64 = 4;

    /// Every part, as allocated.
    pub fn total_bytes(&self) -> u64 {
        self.record_bytes + self.node_table_bytes + self.holder_list_bytes + self.rank_bytes
    }

    /// What this layout needs besides its two node tables, at the least:
    /// records of [`Self::RECORD_FIELD_BYTES`] with no spare ones, holder
    /// lists of exactly their entries beyond the one the record holds, and
    /// the per-rank bookkeeping as it is.
    pub fn least_bytes_besides_tables(&self) -> u64 {
        let extra_entries = self.holder_entries.saturating_sub(self.nodes);
        self.nodes * Self::RECORD_FIELD_BYTES
            + extra_entries * Self::HOLDER_ENTRY_BYTES
            + self.rank_bytes
    }

    /// The least bytes of this layout with both node tables `fill` full
    /// (a fraction in (0, 1]; 1 is the unreachable case of no free slot).
    pub fn least_bytes(&self, fill: f64) -> f64 {
        let tables = (2 * self.nodes * Self::TABLE_REFERENCE_BYTES) as f64 / fill.clamp(1e-9, 1.0);
        self.least_bytes_besides_tables() as f64 + tables
    }

    /// How full both node tables would have to stay for the whole layout to
    /// fit in `budget` bytes, at its least otherwise; above 1 (or infinite)
    /// when no fill can.
    pub fn table_fill_needed(&self, budget: f64) -> f64 {
        let room = budget - self.least_bytes_besides_tables() as f64;
        let references = (2 * self.nodes * Self::TABLE_REFERENCE_BYTES) as f64;
        if room <= 0.0 {
            return f64::INFINITY;
        }
        references / room
    }
}

impl Index {
    /// The index's heap by part and the counts its layout's least size
    /// follows from. Visits every node: for benchmarks and diagnostics, not
    /// for a metrics scrape.
    pub fn layout(&self) -> IndexLayout {
        let nodes = self.nodes.parts();
        IndexLayout {
            nodes: self.nodes.live() as u64,
            holder_entries: nodes.holder_entries,
            record_bytes: nodes.records,
            node_table_bytes: nodes.tables,
            holder_list_bytes: nodes.lists,
            rank_bytes: self.rank_heap_bytes() as u64,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::event::{ExternalHash, KvEvent, Stored, StoredBlock, Tier};
    use crate::hash::LocalBlockHash;
    use crate::index::WorkerRank;

    fn store(index: &mut Index, rank: u32, blocks: std::ops::Range<u64>) {
        let blocks = blocks
            .map(|i| StoredBlock {
                external: ExternalHash(1_000 + i),
                local: LocalBlockHash(i),
            })
            .collect();
        let stored = Stored::plain(None, blocks, Tier::Device, 16);
        index.apply(WorkerRank::new(rank, 0), &KvEvent::Stored(stored));
    }

    #[test]
    fn the_parts_add_up_and_count_each_holder_once() {
        let mut index = Index::default();
        store(&mut index, 0, 0..100);
        store(&mut index, 1, 0..40);
        // Rank 2 names another block by rank 0's engine hash 1 000: a
        // conflict, kept as a private binding in rank 2's bookkeeping.
        let clash = Stored::plain(
            None,
            vec![StoredBlock {
                external: ExternalHash(1_000),
                local: LocalBlockHash(500),
            }],
            Tier::Device,
            16,
        );
        index.apply(WorkerRank::new(2, 0), &KvEvent::Stored(clash));
        let layout = index.layout();
        assert_eq!(layout.nodes, 101);
        assert_eq!(layout.holder_entries, 141);
        assert!(layout.rank_bytes > 0);
        // The parts, counted one by one, are what the stats count in all.
        assert_eq!(layout.total_bytes(), index.stats().heap_bytes);
        assert!(layout.record_bytes >= 101 * IndexLayout::RECORD_FIELD_BYTES);
        assert!(layout.holder_list_bytes >= 40 * IndexLayout::HOLDER_ENTRY_BYTES);
        // Records at their fields, 40 extra entries, tables at 100 %.
        let least = layout.least_bytes(1.0) - layout.rank_bytes as f64;
        assert_eq!(least, (101 * 20 + 40 * 4 + 2 * 101 * 4) as f64);
    }

    #[test]
    fn the_fill_needed_is_the_references_over_the_room_left() {
        let layout = IndexLayout {
            nodes: 10,
            holder_entries: 15,
            ..IndexLayout::default()
        };
        // 10 × 20 + 5 × 4 = 220 bytes besides the tables; 80 of references.
        assert_eq!(layout.least_bytes_besides_tables(), 220);
        assert_eq!(layout.table_fill_needed(320.0), 0.8);
        assert_eq!(layout.table_fill_needed(300.0), 1.0);
        assert!(layout.table_fill_needed(220.0).is_infinite());
        assert_eq!(layout.least_bytes(0.8), 320.0);
    }
}
