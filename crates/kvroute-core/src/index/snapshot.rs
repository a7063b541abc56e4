//! `dump` and `restore`: the whole index as a compact, versioned byte snapshot,
//! for restarting a router without waiting for engines to re-announce blocks
//! and for bootstrapping a replica from a warm one.
//!
//! Layout (little-endian): magic `KVRIDX\0\0`, version `u32`, the config, the
//! ranks, then every live node (`seq`, flags, primary engine hash, its holders
//! as a count and `slot << 4 | tier mask` entries), then alias engine hashes,
//! private bindings and approximate deadlines, all keyed by sequence hash so
//! node ids need not survive. Counters are not part of it.
//!
//! Version 1 (before holder lists) wrote a bitmap width after the config and
//! each node's holders as fixed-width device and lower-tier bitmaps; it is
//! still read.

use super::holders;
use super::nodes::SlotId;
use super::{DpRank, Index, IndexConfig, IndexCounters, Slot, WorkerId, WorkerRank, VACANT};

const MAGIC: &[u8; 8] = b"KVRIDX\0\0";
const VERSION: u32 = 2;
/// The bitmap layout, still read.
const VERSION_BITMAPS: u32 = 1;
const NONE: u64 = u64::MAX;

/// Why a snapshot could not be restored.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum SnapshotError {
    /// Not a kvroute index snapshot.
    #[error("not a kvroute index snapshot (bad magic)")]
    BadMagic,
    /// Written by a version this build cannot read.
    #[error("snapshot version {found} is not supported (this build reads versions {VERSION_BITMAPS} and {VERSION})")]
    UnsupportedVersion {
        /// The version found.
        found: u32,
    },
    /// Cut short or inconsistent.
    #[error("snapshot is corrupt: {0}")]
    Corrupt(&'static str),
}

struct Writer(Vec<u8>);

impl Writer {
    fn u8(&mut self, v: u8) {
        self.0.push(v);
    }
    fn u32(&mut self, v: u32) {
        self.0.extend_from_slice(&v.to_le_bytes());
    }
    fn u64(&mut self, v: u64) {
        self.0.extend_from_slice(&v.to_le_bytes());
    }
}

struct Reader<'a> {
    buf: &'a [u8],
}

impl<'a> Reader<'a> {
    fn take(&mut self, n: usize) -> Result<&'a [u8], SnapshotError> {
        if self.buf.len() < n {
            return Err(SnapshotError::Corrupt("cut short"));
        }
        let (head, rest) = self.buf.split_at(n);
        self.buf = rest;
        Ok(head)
    }
    fn u8(&mut self) -> Result<u8, SnapshotError> {
        Ok(self.take(1)?[0])
    }
    fn u32(&mut self) -> Result<u32, SnapshotError> {
        let mut b = [0u8; 4];
        b.copy_from_slice(self.take(4)?);
        Ok(u32::from_le_bytes(b))
    }
    fn u64(&mut self) -> Result<u64, SnapshotError> {
        let mut b = [0u8; 8];
        b.copy_from_slice(self.take(8)?);
        Ok(u64::from_le_bytes(b))
    }
    /// A count of records of at least `min_size` bytes each, checked against what is left.
    fn count(&mut self, min_size: usize) -> Result<usize, SnapshotError> {
        let n = self.u64()?;
        let n = usize::try_from(n).map_err(|_| SnapshotError::Corrupt("count too large"))?;
        if n.saturating_mul(min_size) > self.buf.len() {
            return Err(SnapshotError::Corrupt("count larger than the snapshot"));
        }
        Ok(n)
    }
}

fn opt(v: Option<u64>) -> u64 {
    v.unwrap_or(NONE)
}

fn from_opt(v: u64) -> Option<u64> {
    (v != NONE).then_some(v)
}

impl Index {
    /// The whole index as bytes (see the module docs for the layout).
    pub fn dump(&self) -> Vec<u8> {
        let mut w = Writer(Vec::with_capacity(64 + self.nodes.live() * 25));
        w.0.extend_from_slice(MAGIC);
        w.u32(VERSION);
        w.u64(opt(self.config.default_capacity));
        w.u64(self.config.approx_ttl_ms);
        w.u32(self.slots.len() as u32);
        for slot in &self.slots {
            match slot {
                None => w.u8(0),
                Some(s) => {
                    w.u8(1);
                    w.u32(s.key.worker.0);
                    w.u32(s.key.rank.0);
                    w.u64(opt(s.capacity));
                }
            }
        }
        w.u64(self.nodes.live() as u64);
        for node in self.nodes.live_ids() {
            w.u64(self.nodes.seq(node));
            let ext = self.nodes.primary_ext(node);
            w.u8(u8::from(ext.is_some()));
            if let Some(ext) = ext {
                w.u64(ext);
            }
            w.u32(self.nodes.holder_count(node) as u32);
            self.nodes.holders(node).for_each(|entry| w.u32(entry));
        }
        let aliases: Vec<(u64, u64)> = self
            .nodes
            .aliases()
            .map(|(ext, node)| (ext, self.nodes.seq(node)))
            .collect();
        w.u64(aliases.len() as u64);
        for (ext, seq) in aliases {
            w.u64(ext);
            w.u64(seq);
        }
        let private: Vec<(u32, u64, u64)> = self
            .slots
            .iter()
            .enumerate()
            .filter_map(|(i, s)| s.as_ref().map(|s| (i, s)))
            .flat_map(|(i, s)| {
                s.private_ext
                    .iter()
                    .map(move |(&ext, &(_, seq))| (i as u32, ext, seq))
            })
            .collect();
        w.u64(private.len() as u64);
        for (slot, ext, seq) in private {
            w.u32(slot);
            w.u64(ext);
            w.u64(seq);
        }
        let approx: Vec<(u32, u64, u64)> = self
            .slots
            .iter()
            .enumerate()
            .filter_map(|(i, s)| s.as_ref().map(|s| (i, s)))
            .flat_map(|(i, s)| {
                s.approx_deadline
                    .iter()
                    .map(move |(&node, &deadline)| (i as u32, self.nodes.seq(node), deadline))
            })
            .collect();
        w.u64(approx.len() as u64);
        for (slot, seq, deadline) in approx {
            w.u32(slot);
            w.u64(seq);
            w.u64(deadline);
        }
        w.0
    }

    /// Rebuilds an index from [`Index::dump`] output.
    pub fn restore(bytes: &[u8]) -> Result<Index, SnapshotError> {
        let mut r = Reader { buf: bytes };
        let (config, version, slot_count) = read_header(&mut r)?;
        let mut index = Index::new(config);
        index.restore_ranks(&mut r, slot_count)?;
        match version {
            Version::Bitmaps { words } => index.restore_bitmap_nodes(&mut r, words)?,
            Version::Lists => index.restore_nodes(&mut r)?,
        }
        index.restore_bindings(&mut r)?;
        if !r.buf.is_empty() {
            return Err(SnapshotError::Corrupt("trailing bytes"));
        }
        index.counters = IndexCounters::default();
        Ok(index)
    }

    fn restore_ranks(
        &mut self,
        r: &mut Reader<'_>,
        slot_count: usize,
    ) -> Result<(), SnapshotError> {
        for i in 0..slot_count {
            if r.u8()? == 0 {
                self.slots.push(None);
                self.keys.push(VACANT);
                self.free_slots.push(i as SlotId);
                continue;
            }
            let key = WorkerRank {
                worker: WorkerId(r.u32()?),
                rank: DpRank(r.u32()?),
            };
            let capacity = from_opt(r.u64()?);
            if self.slot_of.insert(key, i as SlotId).is_some() {
                return Err(SnapshotError::Corrupt("a rank appears twice"));
            }
            self.slots.push(Some(Slot::new(key, capacity)));
            self.keys.push(key);
        }
        Ok(())
    }

    fn restore_nodes(&mut self, r: &mut Reader<'_>) -> Result<(), SnapshotError> {
        for _ in 0..r.count(13)? {
            let node = self.restore_node(r)?;
            let count = r.u32()? as usize;
            if count.saturating_mul(4) > r.buf.len() {
                return Err(SnapshotError::Corrupt(
                    "holder count larger than the snapshot",
                ));
            }
            for _ in 0..count {
                let entry = r.u32()?;
                let tiers = holders::tiers_of(entry);
                let slot = holders::slot_of(entry);
                if tiers == 0 {
                    return Err(SnapshotError::Corrupt("a holder on no tier"));
                }
                for (bit, tier) in super::TIERS.iter().enumerate() {
                    if tiers & (1 << bit) != 0 {
                        self.restore_residency(node, slot, *tier)?;
                    }
                }
            }
            if self.nodes.holder_count(node) == 0 {
                return Err(SnapshotError::Corrupt("a node nobody holds"));
            }
        }
        Ok(())
    }

    /// A node's sequence hash, flags and primary engine hash.
    fn restore_node(&mut self, r: &mut Reader<'_>) -> Result<super::NodeId, SnapshotError> {
        let seq = r.u64()?;
        let flags = r.u8()?;
        let ext = if flags & 1 != 0 { Some(r.u64()?) } else { None };
        if self.nodes.find_seq(seq).is_some() {
            return Err(SnapshotError::Corrupt("a node appears twice"));
        }
        let node = self.nodes.insert_seq(seq);
        if let Some(ext) = ext {
            self.nodes.bind_ext(node, ext);
        }
        Ok(node)
    }

    /// Version 1 nodes: holders as a device bitmap and, when flag bit 1 is
    /// set, host, disk and external bitmaps, `words` words each.
    fn restore_bitmap_nodes(
        &mut self,
        r: &mut Reader<'_>,
        words: usize,
    ) -> Result<(), SnapshotError> {
        let node_count = r.count(9 + 8 * words)?;
        let mut bitmaps = vec![0u64; 4 * words];
        for _ in 0..node_count {
            let flags = r.buf.get(8).copied().unwrap_or(0);
            let node = self.restore_node(r)?;
            let present = if flags & 2 != 0 { 4 * words } else { words };
            for (i, word) in bitmaps.iter_mut().enumerate() {
                *word = if i < present { r.u64()? } else { 0 };
            }
            for (tier, bitmap) in super::TIERS.iter().zip(bitmaps.chunks(words)) {
                for (w, &word) in bitmap.iter().enumerate() {
                    let mut bits = word;
                    while bits != 0 {
                        let slot = (w * 64 + bits.trailing_zeros() as usize) as SlotId;
                        bits &= bits - 1;
                        self.restore_residency(node, slot, *tier)?;
                    }
                }
            }
            if self.nodes.holder_count(node) == 0 {
                return Err(SnapshotError::Corrupt("a node nobody holds"));
            }
        }
        Ok(())
    }

    /// Adds one residency of a known rank.
    fn restore_residency(
        &mut self,
        node: super::NodeId,
        slot: SlotId,
        tier: super::Tier,
    ) -> Result<(), SnapshotError> {
        if self
            .slots
            .get(slot as usize)
            .and_then(Option::as_ref)
            .is_none()
        {
            return Err(SnapshotError::Corrupt("a node names an unknown rank"));
        }
        self.add_residency(slot, node, tier);
        Ok(())
    }

    /// Engine-hash aliases, private bindings and approximate deadlines.
    fn restore_bindings(&mut self, r: &mut Reader<'_>) -> Result<(), SnapshotError> {
        for _ in 0..r.count(16)? {
            let (ext, seq) = (r.u64()?, r.u64()?);
            let node = self
                .nodes
                .find_seq(seq)
                .ok_or(SnapshotError::Corrupt("alias of an unknown node"))?;
            self.nodes.bind_ext(node, ext);
        }
        for _ in 0..r.count(20)? {
            let (slot, ext, seq) = (r.u32()?, r.u64()?, r.u64()?);
            let node = self
                .nodes
                .find_seq(seq)
                .ok_or(SnapshotError::Corrupt("binding of an unknown node"))?;
            let s = self
                .slot_mut(slot)
                .ok_or(SnapshotError::Corrupt("binding of an unknown rank"))?;
            s.private_ext.insert(ext, (node, seq));
            s.private_name.insert(node, (ext, seq));
        }
        let mut approx: Vec<(u64, SlotId, super::NodeId)> = Vec::new();
        for _ in 0..r.count(20)? {
            let (slot, seq, deadline) = (r.u32()?, r.u64()?, r.u64()?);
            let node = self
                .nodes
                .find_seq(seq)
                .ok_or(SnapshotError::Corrupt("deadline of an unknown node"))?;
            approx.push((deadline, slot, node));
        }
        approx.sort_unstable();
        for (deadline, slot, node) in approx {
            let s = self
                .slot_mut(slot)
                .ok_or(SnapshotError::Corrupt("deadline of an unknown rank"))?;
            s.approx_deadline.insert(node, deadline);
            s.approx_queue.push_back((deadline, node));
        }
        Ok(())
    }
}

/// Which layout a snapshot's nodes are in.
enum Version {
    /// Version 1: fixed-width bitmaps of `words` words.
    Bitmaps { words: usize },
    /// Version 2: holder lists.
    Lists,
}

/// The snapshot's magic, version and configuration: the index settings, the
/// node layout and the number of rank slots.
fn read_header(r: &mut Reader<'_>) -> Result<(IndexConfig, Version, usize), SnapshotError> {
    if r.take(8).map_err(|_| SnapshotError::BadMagic)? != MAGIC {
        return Err(SnapshotError::BadMagic);
    }
    let found = r.u32()?;
    if found != VERSION && found != VERSION_BITMAPS {
        return Err(SnapshotError::UnsupportedVersion { found });
    }
    let config = IndexConfig {
        default_capacity: from_opt(r.u64()?),
        approx_ttl_ms: r.u64()?,
    };
    let version = if found == VERSION_BITMAPS {
        let words = r.u32()? as usize;
        if words == 0 || words > 1 << 16 {
            return Err(SnapshotError::Corrupt("bitmap width"));
        }
        Version::Bitmaps { words }
    } else {
        Version::Lists
    };
    let slot_count = r.u32()? as usize;
    let most = match version {
        Version::Bitmaps { words } => words * 64,
        Version::Lists => holders::MAX_SLOTS as usize,
    };
    if slot_count > most || slot_count > r.buf.len() {
        return Err(SnapshotError::Corrupt("rank count"));
    }
    Ok((config, version, slot_count))
}
