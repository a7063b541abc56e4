//! The registry's part in `--state-dir`: a consistent snapshot of the
//! workers, their ranks' resume points and the index, and the way back from
//! one (see `crate::state`).

use std::sync::atomic::Ordering;
use std::sync::PoisonError;

use kvroute_core::index::WorkerId;
use tracing::{info, warn};

use super::{Registry, ResumePoint};
use crate::ingest::spec::{RankEndpoints, WorkerSpec};
use crate::state::{SavedRank, SavedWorker, Snapshot, StateError};

/// Where a restored rank resumes: only if the snapshot knew the same rank
/// at the same endpoints.
pub(super) fn resume_point(saved: &SavedWorker, endpoints: &RankEndpoints) -> Option<ResumePoint> {
    let same = saved.spec.ranks.iter().any(|e| e == endpoints);
    let rank = saved.ranks.iter().find(|r| r.rank == endpoints.rank.0)?;
    rank.at.filter(|_| same)
}

impl Registry {
    /// The workers, where each rank's stream stands, and the index, as one
    /// consistent picture. The index is read-locked meanwhile: streams wait
    /// to apply (so nothing moves under the dump), lookups go on.
    pub fn snapshot(&self) -> Snapshot {
        let workers = self.lock();
        let index = self.index.frozen();
        let saved = workers
            .values()
            .map(|w| SavedWorker {
                id: w.id.0,
                spec: w.spec.clone(),
                block_size: Some(w.block_size.load(Ordering::Relaxed)).filter(|&b| b > 0),
                ranks: w
                    .ranks
                    .iter()
                    .map(|r| SavedRank {
                        rank: r.endpoints.rank.0,
                        at: r.stats.resume_point(),
                    })
                    .collect(),
            })
            .collect();
        Snapshot {
            workers: saved,
            index: index.dump(),
        }
    }

    /// Starts from a snapshot: its index becomes the index, and its workers
    /// are remembered, to resume their streams when they register again
    /// ([`Registry::register_saved`] registers those no flag names). Only
    /// before any worker is registered.
    pub fn restore(&self, snapshot: &Snapshot) -> Result<(), StateError> {
        let index = snapshot.index()?;
        self.index.replace(index);
        let mut saved = self.saved.lock().unwrap_or_else(PoisonError::into_inner);
        let mut next = self.next_id.lock().unwrap_or_else(PoisonError::into_inner);
        for w in &snapshot.workers {
            *next = (*next).max(w.id.saturating_add(1));
            saved.insert(w.spec.name.clone(), w.clone());
        }
        info!(
            workers = saved.len(),
            "state restored; streams resume once their engines confirm it"
        );
        Ok(())
    }

    /// The snapshot's record of a worker about to register, if it is the
    /// same worker (same URL, compatible block size); a record that no
    /// longer fits loses its blocks.
    pub(super) fn take_saved(&self, spec: &WorkerSpec) -> Option<SavedWorker> {
        let saved = self
            .saved
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .remove(&spec.name)?;
        let sizes_agree = match (spec.block_size, saved.block_size) {
            (Some(a), Some(b)) => a == b,
            _ => true,
        };
        if saved.spec.url == spec.url && sizes_agree {
            return Some(saved);
        }
        warn!(worker = %spec.name, "registered again with another URL or block size: its restored blocks are dropped");
        self.index.remove_worker(WorkerId(saved.id));
        None
    }

    /// Registers again the snapshot's workers that no flag or file named
    /// (those registered over HTTP); one that cannot be loses its blocks.
    pub fn register_saved(&self) {
        let left: Vec<SavedWorker> = {
            let saved = self.saved.lock().unwrap_or_else(PoisonError::into_inner);
            saved.values().cloned().collect()
        };
        for w in left {
            let name = w.spec.name.clone();
            if let Err(e) = self.register(w.spec.clone()) {
                warn!(worker = %name, error = %e, "a restored worker could not register again; its blocks are dropped");
                let forgotten = self
                    .saved
                    .lock()
                    .unwrap_or_else(PoisonError::into_inner)
                    .remove(&name);
                if let Some(w) = forgotten {
                    self.index.remove_worker(WorkerId(w.id));
                }
            }
        }
    }
}
