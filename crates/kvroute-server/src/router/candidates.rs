//! A request's candidates: the request hashed once per (block size, engine
//! flavour) present in the fleet, each hash set matched against the index
//! once, then every rank of every available worker priced, all by the
//! core's scheduler ([`kvroute_core::scheduler::fleet`]). What is the
//! server's own: the workers' addresses and ingest state beside what
//! routing sees of them, and the request's hashes from its parsed body.

use std::sync::atomic::Ordering;
use std::sync::Arc;

use kvroute_core::event::WorkerFlavor;
use kvroute_core::hash::LocalBlockHash;
use kvroute_core::index::WorkerRank;
use kvroute_core::scheduler::{score, FleetView, Load, Pricing, RequestHashes, Scored};

use super::load::ActiveRanks;
pub use super::target::Target;
use super::Router;
use kvroute_prompt::body::RoutingRequest;

/// A request's candidates, with the workers and hashes they came from.
#[derive(Debug, Clone)]
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
        let doubted = in_doubt(&targets);
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
                trusted: &|key| !doubted.contains(&key),
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

/// The ranks whose blocks are in doubt now (their engine may have restarted
/// since: see `RankStats::in_doubt`); almost always none.
fn in_doubt(targets: &[Target]) -> Vec<WorkerRank> {
    let mut out = Vec::new();
    for t in targets {
        for (rank, stats) in &t.rank_stats {
            if stats.in_doubt.load(Ordering::Relaxed) {
                out.push(WorkerRank {
                    worker: t.route.id,
                    rank: *rank,
                });
            }
        }
    }
    out
}
