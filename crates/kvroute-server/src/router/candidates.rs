//! A request's candidates: the request hashed once per (block size, engine
//! flavour) present in the fleet, each hash set matched against the index
//! once, then every rank of every available worker priced, all by the
//! core's scheduler ([`kvroute_core::scheduler::fleet`]). What is the
//! server's own: the workers' addresses and ingest state beside what
//! routing sees of them, and the request's hashes from its parsed body.

use std::ops::Deref;
use std::sync::atomic::{AtomicU32, Ordering};
use std::sync::Arc;

use kvroute_core::event::WorkerFlavor;
use kvroute_core::hash::LocalBlockHash;
use kvroute_core::index::{DpRank, WorkerRank};
use kvroute_core::scheduler::{
    score, FleetView, Load, Pricing, RequestHashes, RouteTarget, Scored,
};

use super::active::ActiveRanks;
use super::Router;
use crate::ingest::registry::WorkerView;
use crate::ingest::stats::RankStats;
use kvroute_prompt::body::RoutingRequest;

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

/// A request's candidates, with the workers and hashes they came from.
#[derive(Debug)]
pub struct Candidates {
    /// The workers as they were when scoring started.
    pub targets: Arc<Vec<Target>>,
    /// Every rank of every available worker, priced.
    pub scored: Vec<Scored>,
    /// The request's hashes per (block size, flavour).
    pub hashes: RequestHashes,
}

impl Router {
    /// The candidates for a parsed (and tokenized) request, and what `then`
    /// does with them while the loads they were scored on cannot change.
    pub fn candidates_for<R>(
        &self,
        req: &RoutingRequest,
        then: impl FnOnce(&Candidates, &mut ActiveRanks) -> R,
    ) -> (Candidates, R) {
        let request_tokens = req.tokens.as_ref().map_or(0, |t| t.len() as u64);
        self.candidates_then(
            &mut |bs, flavor| req.local_hashes(bs, flavor),
            (request_tokens, req.model.as_deref()),
            !req.images.is_empty(),
            then,
        )
    }

    /// Scores every available rank for a request whose local hashes at a
    /// block size and flavour `locals_at` gives (`flavor_matters`: they
    /// differ by flavour, because the request has images).
    pub fn candidates(
        &self,
        locals_at: &mut dyn FnMut(u32, WorkerFlavor) -> Vec<LocalBlockHash>,
        request_tokens: u64,
        flavor_matters: bool,
    ) -> Candidates {
        self.candidates_then(locals_at, (request_tokens, None), flavor_matters, |_, _| ())
            .0
    }

    /// [`Router::candidates`] among the workers that serve `model` (any
    /// worker without one), then `then` under the same hold of the ranks'
    /// loads: a request charged there is seen by the next one scored.
    fn candidates_then<R>(
        &self,
        locals_at: &mut dyn FnMut(u32, WorkerFlavor) -> Vec<LocalBlockHash>,
        (request_tokens, model): (u64, Option<&str>),
        flavor_matters: bool,
        then: impl FnOnce(&Candidates, &mut ActiveRanks) -> R,
    ) -> (Candidates, R) {
        let targets = self.targets();
        let elsewhere: Vec<&str> = match model {
            Some(m) => targets
                .iter()
                .filter(|t| !self.serves(t, m))
                .map(|t| &*t.name)
                .collect(),
            None => Vec::new(),
        };
        // Index walks first, outside the active-sequence lock.
        let hashes = RequestHashes::compute(&targets, &self.index, locals_at, flavor_matters);
        let learned = self.learned_speeds();
        // Reports older than three scrapes are the engine's past, not its load.
        let reports = self
            .config
            .engine_metrics_every
            .map(|every| (self.reported.latest(), every * 3));
        let report = |key: &WorkerRank| {
            let (reports, max_age) = reports.as_ref()?;
            reports.fresh(key, *max_age)
        };
        let mut ranks = self.active.lock();
        let pricing = Pricing {
            request_tokens,
            weights: &self.config.weights,
            busy: &self.config.busy,
        };
        let scored = score(
            &targets,
            &hashes,
            pricing,
            FleetView {
                load: &|key, seqs| Load::of(ranks.get(&key), seqs).with_report(report(&key)),
                available: &|name| !elsewhere.contains(&name) && self.breakers.available(name),
                learned_speed: &|key| learned.as_ref()?.get(&key).copied(),
            },
        );
        let candidates = Candidates {
            targets,
            scored,
            hashes,
        };
        let r = then(&candidates, &mut ranks);
        (candidates, r)
    }
}
