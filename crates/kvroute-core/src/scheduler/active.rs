//! What each (worker, rank) is doing right now, as seen by this router:
//! requests it sent there that are still in prefill or decoding.
//!
//! A request is added when routed, marked prefilled at its first token, and
//! freed at its end; entries older than the expiry are dropped, so a lost
//! completion cannot inflate a worker's load forever. Blocks are counted once
//! per worker however many requests share them (a shared system prompt is
//! held once in the engine's cache).

use std::collections::HashMap;

use rustc_hash::FxHashMap;

use crate::hash::SequenceHash;

#[derive(Debug, Clone)]
struct Request {
    blocks: Vec<SequenceHash>,
    prefill_tokens: u64,
    prefilling: bool,
    started_ms: u64,
}

/// One active request, as [`ActiveSequences::requests`] lists it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ActiveRequest<'a> {
    /// Its id.
    pub id: u64,
    /// Its blocks' sequence hashes.
    pub blocks: &'a [SequenceHash],
    /// The prompt tokens it had to prefill.
    pub prefill_tokens: u64,
    /// Still in prefill.
    pub prefilling: bool,
    /// When it was added.
    pub started_ms: u64,
}

/// The active requests of one (worker, rank).
#[derive(Debug, Clone, Default)]
pub struct ActiveSequences {
    requests: HashMap<u64, Request>,
    block_refs: FxHashMap<SequenceHash, u32>,
    prefill_tokens: u64,
    request_blocks: u64,
}

impl ActiveSequences {
    /// No requests.
    pub fn new() -> Self {
        Self::default()
    }

    /// Records a routed request: its blocks' sequence hashes and the prompt
    /// tokens it still has to prefill (the uncached part).
    pub fn add(&mut self, id: u64, blocks: &[SequenceHash], prefill_tokens: u64, now_ms: u64) {
        self.free(id);
        for b in blocks {
            *self.block_refs.entry(*b).or_insert(0) += 1;
        }
        self.prefill_tokens += prefill_tokens;
        self.request_blocks += blocks.len() as u64;
        self.requests.insert(
            id,
            Request {
                blocks: blocks.to_vec(),
                prefill_tokens,
                prefilling: true,
                started_ms: now_ms,
            },
        );
    }

    /// The request produced its first token: its prefill no longer loads the worker.
    pub fn prefill_done(&mut self, id: u64) {
        if let Some(r) = self.requests.get_mut(&id) {
            if r.prefilling {
                r.prefilling = false;
                self.prefill_tokens -= r.prefill_tokens;
            }
        }
    }

    /// The request ended (or failed).
    pub fn free(&mut self, id: u64) {
        let Some(r) = self.requests.remove(&id) else {
            return;
        };
        if r.prefilling {
            self.prefill_tokens -= r.prefill_tokens;
        }
        self.request_blocks -= r.blocks.len() as u64;
        for b in &r.blocks {
            if let Some(count) = self.block_refs.get_mut(b) {
                *count -= 1;
                if *count == 0 {
                    self.block_refs.remove(b);
                }
            }
        }
    }

    /// Drops requests started more than `max_age_ms` ago; returns how many.
    pub fn expire(&mut self, now_ms: u64, max_age_ms: u64) -> usize {
        let stale: Vec<u64> = self
            .requests
            .iter()
            .filter(|(_, r)| now_ms.saturating_sub(r.started_ms) > max_age_ms)
            .map(|(&id, _)| id)
            .collect();
        for id in &stale {
            self.free(*id);
        }
        stale.len()
    }

    /// Frees every request whose id `drop` accepts (a peer router's
    /// requests when it died); returns how many.
    pub fn free_where(&mut self, drop: impl Fn(u64) -> bool) -> usize {
        let gone: Vec<u64> = self
            .requests
            .keys()
            .copied()
            .filter(|&id| drop(id))
            .collect();
        for id in &gone {
            self.free(*id);
        }
        gone.len()
    }

    /// Every active request, in no particular order: what another router
    /// needs to rebuild this router's share of the load.
    pub fn requests(&self) -> impl Iterator<Item = ActiveRequest<'_>> {
        self.requests.iter().map(|(&id, r)| ActiveRequest {
            id,
            blocks: &r.blocks,
            prefill_tokens: r.prefill_tokens,
            prefilling: r.prefilling,
            started_ms: r.started_ms,
        })
    }

    /// Prompt tokens still in prefill.
    pub fn active_prefill_tokens(&self) -> u64 {
        self.prefill_tokens
    }

    /// Distinct blocks held by active requests.
    pub fn active_blocks(&self) -> u64 {
        self.block_refs.len() as u64
    }

    /// Blocks of the active requests counted once per request: what a
    /// decode step reads (a prefix shared by n requests counts n times).
    pub fn request_blocks(&self) -> u64 {
        self.request_blocks
    }

    /// Active requests.
    pub fn active_requests(&self) -> u64 {
        self.requests.len() as u64
    }

    /// How many leading `blocks` an active request here already holds: a
    /// prefix the worker is computing or has just computed, which the index
    /// learns of only when the engine's event arrives.
    pub fn active_prefix(&self, blocks: &[SequenceHash]) -> u32 {
        blocks
            .iter()
            .take_while(|b| self.block_refs.contains_key(b))
            .count() as u32
    }

    /// Of `blocks`, how many are not already active here.
    pub fn new_blocks(&self, blocks: &[SequenceHash]) -> u64 {
        blocks
            .iter()
            .filter(|b| !self.block_refs.contains_key(b))
            .count() as u64
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn hashes(values: &[u64]) -> Vec<SequenceHash> {
        values.iter().map(|&v| SequenceHash(v)).collect()
    }

    #[test]
    fn shared_blocks_count_once_and_load_follows_the_lifecycle() {
        let mut a = ActiveSequences::new();
        a.add(1, &hashes(&[10, 11, 12]), 48, 0);
        a.add(2, &hashes(&[10, 11, 20]), 16, 0);
        assert_eq!(
            (
                a.active_blocks(),
                a.active_prefill_tokens(),
                a.active_requests()
            ),
            (4, 64, 2)
        );
        assert_eq!(a.new_blocks(&hashes(&[10, 30])), 1);
        assert_eq!(a.active_prefix(&hashes(&[10, 11, 30, 12])), 2);
        assert_eq!(a.active_prefix(&hashes(&[30, 10])), 0);
        assert_eq!(a.request_blocks(), 6);
        a.prefill_done(1);
        a.prefill_done(1);
        assert_eq!(a.active_prefill_tokens(), 16);
        a.free(2);
        assert_eq!(
            (
                a.active_blocks(),
                a.active_prefill_tokens(),
                a.active_requests()
            ),
            (3, 0, 1)
        );
        a.free(1);
        a.free(1);
        assert_eq!((a.active_blocks(), a.active_requests()), (0, 0));
        assert_eq!(a.request_blocks(), 0);
    }

    #[test]
    fn requests_are_listed_and_freed_by_id() {
        let mut a = ActiveSequences::new();
        a.add(1, &hashes(&[10, 11]), 32, 5);
        a.add(1 << 40 | 1, &hashes(&[10, 12]), 16, 6);
        a.prefill_done(1);
        let mut listed: Vec<(u64, usize, bool)> = a
            .requests()
            .map(|r| (r.id, r.blocks.len(), r.prefilling))
            .collect();
        listed.sort_unstable();
        assert_eq!(listed, vec![(1, 2, false), (1 << 40 | 1, 2, true)]);
        assert_eq!(a.free_where(|id| id >> 40 == 1), 1);
        assert_eq!(
            (
                a.active_requests(),
                a.active_blocks(),
                a.active_prefill_tokens()
            ),
            (1, 2, 0)
        );
    }

    #[test]
    fn stuck_requests_expire() {
        let mut a = ActiveSequences::new();
        a.add(1, &hashes(&[1]), 10, 0);
        a.add(2, &hashes(&[2]), 10, 250_000);
        assert_eq!(a.expire(301_000, 300_000), 1);
        assert_eq!((a.active_requests(), a.active_prefill_tokens()), (1, 10));
    }
}
