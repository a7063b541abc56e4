//! A worker as routing sees it, with where to send its requests and its
//! ranks' ingest state: what the router's worker list holds, and what
//! candidates are scored against.

use std::ops::Deref;
use std::sync::atomic::{AtomicU32, Ordering};
use std::sync::Arc;

use kvroute_core::index::DpRank;
use kvroute_core::scheduler::RouteTarget;

use crate::ingest::registry::WorkerView;
use crate::ingest::stats::RankStats;

/// A worker as the router sees it: what routing sees of it (reached through
/// [`Deref`]), where to send its requests, and its ranks' ingest state.
#[derive(Debug, Clone)]
pub struct Target {
    /// What routing sees of it.
    pub route: RouteTarget,
    /// HTTP base URL, without a trailing `/`.
    pub url: String,
    /// Its SGLang bootstrap server's port (prefill workers of SGLang
    /// disaggregation; `None`: the engine's default).
    pub bootstrap_port: Option<u16>,
    /// The model its spec names (`model=`), if any.
    pub model: Option<Arc<str>>,
    /// Each rank's shared ingest state, by rank.
    pub rank_stats: Vec<(DpRank, Arc<RankStats>)>,
    /// The worker's block size as its streams learn it (see
    /// [`Target::newly_learned_block_size`]).
    pub shared_block_size: Arc<AtomicU32>,
}

impl Deref for Target {
    type Target = RouteTarget;

    fn deref(&self) -> &RouteTarget {
        &self.route
    }
}

impl AsRef<RouteTarget> for Target {
    fn as_ref(&self) -> &RouteTarget {
        &self.route
    }
}

impl PartialEq for Target {
    fn eq(&self, other: &Self) -> bool {
        let same_stats = self.rank_stats.len() == other.rank_stats.len()
            && self
                .rank_stats
                .iter()
                .zip(&other.rank_stats)
                .all(|(a, b)| a.0 == b.0 && Arc::ptr_eq(&a.1, &b.1));
        self.route == other.route
            && self.url == other.url
            && self.bootstrap_port == other.bootstrap_port
            && self.model == other.model
            && same_stats
    }
}

impl Eq for Target {}

impl Target {
    /// The target for a registered worker; `None` when it has no URL or no
    /// ranks, so nothing could be sent to it.
    pub fn from_view(w: &WorkerView) -> Option<Target> {
        let url = w.url.trim_end_matches('/');
        let mut ranks: Vec<DpRank> = w.ranks.iter().map(|r| r.dp_rank).collect();
        if url.is_empty() || ranks.is_empty() {
            return None;
        }
        ranks.sort_unstable();
        let rank_stats = w
            .ranks
            .iter()
            .map(|r| (r.dp_rank, r.stats.clone()))
            .collect();
        Some(Target {
            route: RouteTarget {
                name: Arc::from(w.name.as_str()),
                id: w.id,
                block_size: w.block_size.unwrap_or(0),
                ranks,
                flavor: w.flavor,
                speed: w.speed,
                role: w.role,
            },
            url: url.to_owned(),
            bootstrap_port: w.bootstrap_port,
            model: w.model.as_deref().map(Arc::from),
            rank_stats,
            shared_block_size: w.shared_block_size.clone(),
        })
    }

    /// The block size the worker's streams learned since this target was
    /// made without one (its spec gave none): until the target has it, the
    /// worker's requests would be hashed at size 0 and match nothing.
    pub fn newly_learned_block_size(&self) -> Option<u32> {
        if self.route.block_size != 0 {
            return None;
        }
        Some(self.shared_block_size.load(Ordering::Relaxed)).filter(|&b| b > 0)
    }

    /// A rank's shared ingest state.
    pub fn stats_of(&self, rank: DpRank) -> Option<&Arc<RankStats>> {
        self.rank_stats
            .iter()
            .find(|(r, _)| *r == rank)
            .map(|(_, s)| s)
    }
}
