//! Sessions: a conversation named by its client (`x-session-id`) goes back
//! to the rank its last turn went to, unless the cost says otherwise.
//!
//! The rank that served a conversation holds its history in its cache,
//! including what the index cannot show yet (blocks still in flight, or a
//! prompt routed on load alone because it could not be tokenized). The
//! session's rank is priced with that history as cached ([`prefer_session`]):
//! it is kept when that price is no higher than the best rank's, and left
//! when its queue costs more than the prefill the history saves. No fixed
//! ratio: the same cost that places every request decides.
//!
//! The table is bounded in entries and in time ([`SessionTable`]).

use std::collections::{HashMap, VecDeque};

use crate::index::WorkerRank;

use super::candidates::Scored;
use super::cost::CostWeights;

/// Where a conversation's last turn went.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct SessionEntry {
    /// The rank it went to.
    pub rank: WorkerRank,
    /// Its prompt's tokens (0: unknown): history the rank now caches.
    pub prompt_tokens: u64,
    expires_at_ms: u64,
}

impl SessionEntry {
    /// An entry that never expires: a session's rank and history as its
    /// caller keeps them (tests, and tables of the caller's own).
    pub fn new(rank: WorkerRank, prompt_tokens: u64) -> Self {
        SessionEntry {
            rank,
            prompt_tokens,
            expires_at_ms: u64::MAX,
        }
    }
}

/// Sessions by id, at most `capacity` of them, each forgotten `ttl_ms`
/// after its last turn (or sooner, oldest first, when the table is full).
#[derive(Debug, Clone)]
pub struct SessionTable {
    entries: HashMap<String, SessionEntry>,
    /// (id, expiry) in the order they were last put; stale pairs (an id put
    /// again since) are skipped when they come up.
    order: VecDeque<(String, u64)>,
    capacity: usize,
    ttl_ms: u64,
}

impl SessionTable {
    /// An empty table.
    pub fn new(capacity: usize, ttl_ms: u64) -> Self {
        SessionTable {
            entries: HashMap::new(),
            order: VecDeque::new(),
            capacity: capacity.max(1),
            ttl_ms,
        }
    }

    /// The session `id`, unless it expired.
    pub fn get(&self, id: &str, now_ms: u64) -> Option<SessionEntry> {
        self.entries
            .get(id)
            .filter(|e| e.expires_at_ms > now_ms)
            .copied()
    }

    /// Records that session `id`'s turn of `prompt_tokens` went to `rank`.
    pub fn put(&mut self, id: &str, rank: WorkerRank, prompt_tokens: u64, now_ms: u64) {
        let expires_at_ms = now_ms.saturating_add(self.ttl_ms);
        let entry = SessionEntry {
            rank,
            prompt_tokens,
            expires_at_ms,
        };
        self.entries.insert(id.to_owned(), entry);
        self.order.push_back((id.to_owned(), expires_at_ms));
        self.evict(now_ms);
    }

    /// Sessions remembered.
    pub fn len(&self) -> usize {
        self.entries.len()
    }

    /// Whether none is.
    pub fn is_empty(&self) -> bool {
        self.entries.is_empty()
    }

    /// Forgets expired sessions, then the oldest while over capacity; drops
    /// stale order pairs, so the queue stays within twice the table.
    fn evict(&mut self, now_ms: u64) {
        while let Some((id, expiry)) = self.order.front() {
            let current = self.entries.get(id).map(|e| e.expires_at_ms);
            let stale = current != Some(*expiry);
            let expired = *expiry <= now_ms;
            let over = self.entries.len() > self.capacity;
            let too_long = self.order.len() > 2 * self.capacity;
            if !(stale || expired || over || too_long) {
                break;
            }
            if !stale {
                self.entries.remove(id);
            }
            self.order.pop_front();
        }
    }
}

/// `ordered` (a policy's order over `scored`) with the session's rank first
/// when its cost, with the session's history counted as cached there, is no
/// higher than the first's. A `request_tokens` of 0 (a prompt routed on load
/// alone) counts the whole history as what the rank saves.
pub fn prefer_session(
    scored: &[Scored],
    mut ordered: Vec<usize>,
    session: &SessionEntry,
    request_tokens: u64,
    w: &CostWeights,
) -> Vec<usize> {
    let (Some(&best), Some(pos)) = (
        ordered.first(),
        ordered.iter().position(|&i| scored[i].key == session.rank),
    ) else {
        return ordered;
    };
    if pos == 0 {
        return ordered;
    }
    let s = &scored[ordered[pos]];
    let bs = u64::from(s.block_size.max(1));
    let history = if request_tokens == 0 {
        session.prompt_tokens
    } else {
        session.prompt_tokens.min(request_tokens)
    };
    let shown = u64::from(s.candidate.device_blocks) * bs;
    let unseen_blocks = history.saturating_sub(shown) / bs;
    let c = &s.cost;
    let credit = c.overlap_credit + w.overlap_credit * unseen_blocks as f64;
    let prefill = w.prefill_load_scale * (c.prefill_blocks - credit).max(0.0);
    let total = c.total - c.prefill + prefill;
    if total <= scored[best].cost.total {
        let chosen = ordered.remove(pos);
        ordered.insert(0, chosen);
    }
    ordered
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::event::WorkerFlavor;
    use crate::scheduler::cost::{Candidate, CostBreakdown};

    fn rank(w: u32) -> WorkerRank {
        WorkerRank::new(w, 0)
    }

    #[test]
    fn sessions_expire_and_the_oldest_go_first_when_full() {
        let mut t = SessionTable::new(2, 1_000);
        t.put("a", rank(1), 100, 0);
        t.put("b", rank(2), 100, 10);
        assert_eq!(t.get("a", 500).map(|e| e.rank), Some(rank(1)));
        assert_eq!(t.get("a", 1_000), None, "expired");
        t.put("a", rank(3), 50, 20);
        t.put("c", rank(4), 0, 30);
        assert_eq!(t.len(), 2);
        assert_eq!(t.get("b", 40), None, "the oldest went");
        assert_eq!(
            t.get("a", 40).map(|e| (e.rank, e.prompt_tokens)),
            Some((rank(3), 50))
        );
        for k in 0..100 {
            t.put("a", rank(k), 0, 40 + u64::from(k));
        }
        assert!(t.order.len() <= 4, "stale pairs are dropped");
    }

    fn scored(w: u32, device_blocks: u32, queue: f64, weights: &CostWeights) -> Scored {
        let candidate = Candidate {
            device_blocks,
            ..Candidate::default()
        };
        let mut cost: CostBreakdown = candidate.cost(160, 16, weights);
        cost.requests = queue;
        cost.total += queue;
        Scored {
            worker: w as usize,
            key: rank(w),
            block_size: 16,
            flavor: WorkerFlavor::Vllm,
            speed: 1.0,
            candidate,
            cost,
            overloaded: false,
        }
    }

    #[test]
    fn the_sessions_rank_is_kept_while_its_history_saves_more_than_its_queue_costs() {
        let w = CostWeights::default();
        // Rank 1 looks cold to the index (its history is in flight); rank 0 is idle.
        let fleet = [scored(0, 0, 0.0, &w), scored(1, 0, 5.0, &w)];
        let session = SessionEntry {
            rank: rank(1),
            prompt_tokens: 160,
            expires_at_ms: u64::MAX,
        };
        assert_eq!(
            prefer_session(&fleet, vec![0, 1], &session, 160, &w),
            [1, 0]
        );
        // A queue longer than the whole prefill it saves: it moves.
        let busy = [scored(0, 0, 0.0, &w), scored(1, 0, 1e6, &w)];
        assert_eq!(prefer_session(&busy, vec![0, 1], &session, 160, &w), [0, 1]);
        // A session whose rank is not a candidate changes nothing.
        let gone = SessionEntry {
            rank: rank(7),
            ..session
        };
        assert_eq!(prefer_session(&fleet, vec![0, 1], &gone, 160, &w), [0, 1]);
    }
}
