//! Each rank's load as this router put it there: the active requests of
//! every (worker, rank) behind one lock, which scoring reads and admission
//! charges in one hold.

use std::collections::HashMap;
use std::sync::{Mutex, MutexGuard, PoisonError};

use kvroute_core::index::WorkerRank;
use kvroute_core::scheduler::ActiveSequences;

/// Each rank's active requests.
pub type ActiveRanks = HashMap<WorkerRank, ActiveSequences>;

/// The active requests of every rank, behind one lock: a request is scored
/// against every rank's load and charged to its choice in one hold of it.
#[derive(Debug, Default)]
pub struct ActiveTable {
    ranks: Mutex<ActiveRanks>,
}

impl ActiveTable {
    pub(super) fn lock(&self) -> MutexGuard<'_, ActiveRanks> {
        self.ranks.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// Drops requests started more than `max_ms` before `now_ms`.
    pub fn expire(&self, now_ms: u64, max_ms: u64) {
        for a in self.lock().values_mut() {
            a.expire(now_ms, max_ms);
        }
    }

    /// (rank, requests, prefill tokens, decode blocks) of every rank seen.
    pub fn snapshot(&self) -> Vec<(WorkerRank, u64, u64, u64)> {
        let mut rows: Vec<_> = self
            .lock()
            .iter()
            .map(|(k, a)| {
                (
                    *k,
                    a.active_requests(),
                    a.active_prefill_tokens(),
                    a.active_blocks(),
                )
            })
            .collect();
        rows.sort_unstable();
        rows
    }
}
