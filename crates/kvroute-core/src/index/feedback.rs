//! What the engines' own answers teach the index: a response's
//! `cached_tokens` says how many of a request's leading blocks the engine
//! held. Where the rank's event history is incomplete (a replay ring that no
//! longer reached back), that is the only way to learn the blocks it lost.
//!
//! What is learned is a guess: it is kept as an approximate residency that
//! expires after `approx_ttl_ms` unless an event confirms it (a real store
//! removes the deadline), and a later answer that contradicts it removes it.
//! Residencies that came from events are never removed by an answer: a
//! lower count may only mean that a newer store is still on its way.

use super::{Index, SlotId, WorkerRank};
use crate::event::Tier;
use crate::hash::{sequence_hashes, LocalBlockHash};

impl Index {
    /// The engine of rank `key` reported holding the request's first
    /// `held` blocks (`locals` are the request's blocks). Those the rank is
    /// not known to hold are added on the device as guesses; guesses beyond
    /// `held` are dropped.
    pub fn learn_cached_prefix(
        &mut self,
        key: WorkerRank,
        locals: &[LocalBlockHash],
        held: usize,
        now_ms: u64,
    ) {
        let slot = self.slot(key);
        let deadline = now_ms.saturating_add(self.config.approx_ttl_ms);
        for (i, seq) in sequence_hashes(locals).into_iter().map(|s| s.0).enumerate() {
            if i >= held {
                self.forget_guess(slot, seq);
                continue;
            }
            let node = self.nodes.insert_seq(seq);
            if self.nodes.tiers_of(node, slot) != 0 {
                continue;
            }
            self.add_residency(slot, node, Tier::Device);
            if let Some(s) = self.slot_mut(slot) {
                s.approx_deadline.insert(node, deadline);
                s.approx_queue.push_back((deadline, node));
            }
        }
        self.enforce_capacity(slot);
    }

    /// Drops the guess that the rank holds block `seq`, if it is one.
    fn forget_guess(&mut self, slot: SlotId, seq: u64) {
        let Some(node) = self.nodes.find_seq(seq) else {
            return;
        };
        let guessed = self
            .slot_mut(slot)
            .is_some_and(|s| s.approx_deadline.remove(&node).is_some());
        if guessed {
            self.drop_residency(slot, node, Tier::Device);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::index::{DpRank, IndexConfig, WorkerId};

    fn key() -> WorkerRank {
        WorkerRank {
            worker: WorkerId(0),
            rank: DpRank(0),
        }
    }

    fn depth(index: &Index, locals: &[LocalBlockHash]) -> u32 {
        index
            .find_matches(&sequence_hashes(locals))
            .first()
            .map_or(0, |m| m.device)
    }

    #[test]
    fn reported_blocks_are_guessed_confirmed_by_events_and_dropped_when_contradicted() {
        let mut index = Index::new(IndexConfig::default());
        let locals: Vec<LocalBlockHash> = (1..=4).map(LocalBlockHash).collect();
        index.learn_cached_prefix(key(), &locals, 3, 0);
        assert_eq!(depth(&index, &locals), 3);
        // The engine stores block 1 for real: no longer a guess.
        let stored = crate::index::tests::stored(None, &[(77, locals[0].0)], Tier::Device);
        index.apply(key(), &stored);
        // A later answer says it holds only one block: guesses 2 and 3 go.
        index.learn_cached_prefix(key(), &locals, 1, 10);
        assert_eq!(depth(&index, &locals), 1);
        // Nothing expires but guesses; block 1 came from an event.
        index.learn_cached_prefix(key(), &locals, 0, 20);
        assert_eq!(depth(&index, &locals), 1);
        index.learn_cached_prefix(key(), &locals, 2, 30);
        index.expire(30 + index.config().approx_ttl_ms);
        assert_eq!(depth(&index, &locals), 1, "the guess of block 2 expired");
    }
}
