//! A request's candidates: the request hashed once per (block size, engine
//! flavour) present in the fleet, each hash set matched against the index
//! once, then every rank of every available worker priced by the core's
//! scheduler.

use std::sync::Arc;

use kvroute_core::event::WorkerFlavor;
use kvroute_core::hash::{namespace_seed, sequence_hashes, LocalBlockHash, SequenceHash};
use kvroute_core::index::{RankMatch, SharedIndex, WorkerId, WorkerRank};
use kvroute_core::multimodal::prompt_local_hashes;
use kvroute_core::scheduler::{Load, Pricing, Scored};

use super::active::ActiveRanks;
use super::Proxy;
use crate::ingest::registry::WorkerView;
use crate::ingest::stats::RankStats;
use kvroute_prompt::body::RoutingRequest;

/// A worker as routing sees it.
#[derive(Debug, Clone)]
pub struct Target {
    /// Name (shared with metric labels and breakers without copying).
    pub name: Arc<str>,
    /// Index id.
    pub id: WorkerId,
    /// HTTP base URL, without a trailing `/`.
    pub url: String,
    /// Tokens per block; 0 while it is still to be learned from the
    /// worker's stream (the request then hashes to no blocks for it, and it
    /// is priced on load alone).
    pub block_size: u32,
    /// Its data-parallel ranks, ascending.
    pub ranks: Vec<u32>,
    /// Its engine flavour: how it lays out images, so which request hashes apply.
    pub flavor: WorkerFlavor,
    /// Its declared speed against the fleet's reference engine (1: the reference).
    pub speed: f64,
    /// Each rank's shared ingest state, by rank.
    pub rank_stats: Vec<(u32, Arc<RankStats>)>,
}

impl PartialEq for Target {
    fn eq(&self, other: &Self) -> bool {
        let same_stats = self.rank_stats.len() == other.rank_stats.len()
            && self
                .rank_stats
                .iter()
                .zip(&other.rank_stats)
                .all(|(a, b)| a.0 == b.0 && Arc::ptr_eq(&a.1, &b.1));
        self.name == other.name
            && self.id == other.id
            && self.url == other.url
            && self.block_size == other.block_size
            && self.ranks == other.ranks
            && self.flavor == other.flavor
            && self.speed == other.speed
            && same_stats
    }
}

impl Eq for Target {}

impl Target {
    /// The target for a registered worker; `None` when it has no URL or no
    /// ranks, so nothing could be sent to it.
    pub fn from_view(w: &WorkerView) -> Option<Target> {
        let url = w.url.trim_end_matches('/');
        let mut ranks: Vec<u32> = w.ranks.iter().map(|r| r.dp_rank).collect();
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
            name: Arc::from(w.name.as_str()),
            id: w.id,
            url: url.to_owned(),
            block_size: w.block_size.unwrap_or(0),
            ranks,
            flavor: w.flavor,
            speed: w.speed,
            rank_stats,
        })
    }

    /// A rank's shared ingest state.
    pub fn stats_of(&self, rank: u32) -> Option<&Arc<RankStats>> {
        self.rank_stats
            .iter()
            .find(|(r, _)| *r == rank)
            .map(|(_, s)| s)
    }
}

/// The local block hashes of a request at `block_size`, as a worker of
/// `flavor` publishes them (the flavour matters only for prompts with images:
/// SGLang's folded wide pads, or vLLM's item hashes on overlapping blocks).
pub fn request_hashes(
    req: &RoutingRequest,
    block_size: u32,
    flavor: WorkerFlavor,
) -> Vec<LocalBlockHash> {
    let Some(tokens) = &req.tokens else {
        return Vec::new();
    };
    let seed = namespace_seed(req.lora_name.as_deref(), req.cache_salt.as_deref());
    prompt_local_hashes(tokens, &req.images, flavor, block_size as usize, seed)
}

/// A request's hashes at one block size for one engine flavour, and what
/// the index holds of them.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct MatchedHashes {
    /// Tokens per block.
    pub block_size: u32,
    /// The flavour the hashes are for.
    pub flavor: WorkerFlavor,
    /// Local block hashes.
    pub locals: Vec<LocalBlockHash>,
    /// Their sequence hashes.
    pub seqs: Vec<SequenceHash>,
    /// Leading blocks each rank holds.
    pub matches: Vec<RankMatch>,
}

/// A request's [`MatchedHashes`] for every (block size, flavour) of a fleet.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct RequestHashes {
    /// Whether flavours hash differently (the request has images); if not,
    /// one set serves every flavour.
    flavor_matters: bool,
    sets: Vec<MatchedHashes>,
}

impl RequestHashes {
    /// Hashes the request once per distinct (block size, flavour) among
    /// `targets` with `locals_at` and matches each set against `index`.
    pub fn compute(
        targets: &[Target],
        index: &SharedIndex,
        locals_at: &mut dyn FnMut(u32, WorkerFlavor) -> Vec<LocalBlockHash>,
        flavor_matters: bool,
    ) -> Self {
        let mut hashes = RequestHashes {
            flavor_matters,
            sets: Vec::new(),
        };
        for t in targets {
            if hashes.get(t.block_size, t.flavor).is_some() {
                continue;
            }
            let flavor = hashes.key(t.flavor);
            let locals = locals_at(t.block_size, flavor);
            let seqs = sequence_hashes(&locals);
            let matches = index.find_matches(&seqs);
            hashes.sets.push(MatchedHashes {
                block_size: t.block_size,
                flavor,
                locals,
                seqs,
                matches,
            });
        }
        hashes
    }

    /// Hash sets given directly (tests, and callers that hashed already).
    pub fn from_sets(flavor_matters: bool, sets: Vec<MatchedHashes>) -> Self {
        RequestHashes {
            flavor_matters,
            sets,
        }
    }

    fn key(&self, flavor: WorkerFlavor) -> WorkerFlavor {
        if self.flavor_matters {
            flavor
        } else {
            WorkerFlavor::Vllm
        }
    }

    /// The set for a worker of this block size and flavour, if computed.
    pub fn get(&self, block_size: u32, flavor: WorkerFlavor) -> Option<&MatchedHashes> {
        let flavor = self.key(flavor);
        self.sets
            .iter()
            .find(|s| s.block_size == block_size && s.flavor == flavor)
    }
}

/// What scoring reads of the router's state, rank by rank.
#[derive(Clone, Copy)]
pub struct RankState<'a> {
    /// A rank's load, given the request's blocks.
    pub load: &'a dyn Fn(WorkerRank, &[SequenceHash]) -> Load,
    /// Whether a worker (by name) takes requests now.
    pub available: &'a dyn Fn(&str) -> bool,
    /// A rank's learned speed, which stands in for its worker's declared one.
    pub learned_speed: &'a dyn Fn(WorkerRank) -> Option<f64>,
}

/// One scored candidate per rank of every worker in `targets` that is
/// available, priced on its flavour's hashes, its load and its speed.
pub fn score(
    targets: &[Target],
    hashes: &RequestHashes,
    pricing: Pricing<'_>,
    state: RankState<'_>,
) -> Vec<Scored> {
    let mut out = Vec::new();
    for (i, t) in targets.iter().enumerate() {
        if !(state.available)(&t.name) {
            continue;
        }
        let Some(set) = hashes.get(t.block_size, t.flavor) else {
            continue;
        };
        for &rank in &t.ranks {
            let key = WorkerRank { worker: t.id, rank };
            let matched = set.matches.iter().find(|m| m.worker_rank == key);
            let load = (state.load)(key, &set.seqs);
            let speed = (state.learned_speed)(key).unwrap_or(t.speed);
            out.push(Scored::rank(
                i,
                key,
                (t.block_size, t.flavor, speed),
                matched,
                load,
                pricing,
            ));
        }
    }
    out
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

impl Proxy {
    /// The candidates for a parsed (and tokenized) request, and what `then`
    /// does with them while the loads they were scored on cannot change.
    pub fn candidates_for<R>(
        &self,
        req: &RoutingRequest,
        then: impl FnOnce(&Candidates, &mut ActiveRanks) -> R,
    ) -> (Candidates, R) {
        let request_tokens = req.tokens.as_ref().map_or(0, |t| t.len() as u64);
        self.candidates_then(
            &mut |bs, flavor| request_hashes(req, bs, flavor),
            request_tokens,
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
        self.candidates_then(locals_at, request_tokens, flavor_matters, |_, _| ())
            .0
    }

    /// [`Proxy::candidates`], then `then` under the same hold of the ranks'
    /// loads: a request charged there is seen by the next one scored.
    fn candidates_then<R>(
        &self,
        locals_at: &mut dyn FnMut(u32, WorkerFlavor) -> Vec<LocalBlockHash>,
        request_tokens: u64,
        flavor_matters: bool,
        then: impl FnOnce(&Candidates, &mut ActiveRanks) -> R,
    ) -> (Candidates, R) {
        let targets = self.targets();
        // Index walks first, outside the active-sequence lock.
        let hashes = RequestHashes::compute(&targets, &self.index, locals_at, flavor_matters);
        let learned = self.learned_speeds();
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
            RankState {
                load: &|key, seqs| Load::of(ranks.get(&key), seqs),
                available: &|name| self.breakers.available(name),
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

#[cfg(test)]
mod tests {
    use super::*;
    use kvroute_core::hash::{local_block_hashes, HASH_SEED};
    use kvroute_core::index::{Index, IndexConfig};
    use kvroute_core::multimodal::{ImageIdentity, ImageSpan};
    use kvroute_core::scheduler::{order, ActiveSequences, BusyThresholds, CostWeights, Policy};

    fn targets() -> Vec<Target> {
        vec![
            Target {
                name: Arc::from("w0"),
                id: WorkerId(0),
                url: "http://a".into(),
                block_size: 4,
                ranks: vec![0],
                flavor: WorkerFlavor::Vllm,
                speed: 1.0,
                rank_stats: Vec::new(),
            },
            Target {
                name: Arc::from("w1"),
                id: WorkerId(1),
                url: "http://b".into(),
                block_size: 4,
                ranks: vec![0, 1],
                flavor: WorkerFlavor::Vllm,
                speed: 1.0,
                rank_stats: Vec::new(),
            },
        ]
    }

    fn empty_index() -> SharedIndex {
        SharedIndex::new(Index::new(IndexConfig::default()))
    }

    #[test]
    fn image_requests_hash_per_flavour_and_each_target_is_scored_on_its_own() {
        let mut tokens: Vec<u32> = (0..4).collect();
        tokens.extend([151_655; 8]);
        let req = RoutingRequest {
            tokens: Some(tokens.clone()),
            images: vec![ImageSpan {
                start: 4,
                len: 8,
                identity: ImageIdentity::from_hash(42),
            }],
            ..RoutingRequest::default()
        };
        let vllm = request_hashes(&req, 4, WorkerFlavor::Vllm);
        let sglang = request_hashes(&req, 4, WorkerFlavor::Sglang);
        assert_eq!(vllm.len(), 3);
        assert_eq!(vllm[0], sglang[0], "the text block is the same");
        assert_ne!(vllm[1..], sglang[1..], "the image blocks differ");
        assert_ne!(vllm[1], local_block_hashes(&tokens, 4, HASH_SEED, 0)[1]);
        let mut mixed = targets();
        mixed[1].flavor = WorkerFlavor::Sglang;
        let mut asked = Vec::new();
        let hashes = RequestHashes::compute(
            &mixed,
            &empty_index(),
            &mut |bs, f| {
                asked.push((bs, f));
                request_hashes(&req, bs, f)
            },
            true,
        );
        let scored = score(
            &mixed,
            &hashes,
            pricing(12, &CostWeights::default(), &BusyThresholds::default()),
            ranks(&|_, s| Load::of(None, s), &|_| true),
        );
        assert_eq!(asked, [(4, WorkerFlavor::Vllm), (4, WorkerFlavor::Sglang)]);
        assert_eq!(scored[2].flavor, WorkerFlavor::Sglang);
    }

    #[test]
    fn candidates_take_cache_hits_and_load_into_account() {
        let req = RoutingRequest {
            tokens: Some((0..16).collect()),
            ..RoutingRequest::default()
        };
        let locals = request_hashes(&req, 4, WorkerFlavor::Vllm);
        assert_eq!(
            locals,
            local_block_hashes(&(0..16).collect::<Vec<_>>(), 4, HASH_SEED, 0)
        );
        let seqs = sequence_hashes(&locals);
        let hit = RankMatch {
            worker_rank: WorkerRank::new(1, 1),
            device: 3,
            host: 3,
            any: 3,
        };
        let set = |matches| MatchedHashes {
            block_size: 4,
            flavor: WorkerFlavor::Vllm,
            locals: locals.clone(),
            seqs: seqs.clone(),
            matches,
        };
        let mut busy_rank = ActiveSequences::new();
        busy_rank.add(9, &seqs, 100, 0);
        let busy = BusyThresholds {
            prefill_tokens: Some(100),
            decode_blocks: None,
            requests: None,
        };
        let scored = score(
            &targets(),
            &RequestHashes::from_sets(false, vec![set(vec![hit])]),
            pricing(16, &CostWeights::DYNAMO, &busy),
            ranks(
                &|k, s| Load::of((k == WorkerRank::new(0, 0)).then_some(&busy_rank), s),
                &|_| true,
            ),
        );
        assert_eq!(scored.len(), 3);
        // w0: (100 + 16)/4 = 29 prefill, 4 active blocks, none new.
        assert_eq!((scored[0].cost.total, scored[0].overloaded), (33.0, true));
        // w1 rank 0: cold, 4 + 4.
        assert_eq!(scored[1].cost.total, 8.0);
        // w1 rank 1: 3 blocks cached, 1 + 4.
        assert_eq!(scored[2].cost.total, 5.0);
        assert_eq!(order(&scored, Policy::Kv, 0.0, 0.5, 0), vec![2, 1]);
        assert_eq!(order(&scored, Policy::RoundRobin, 0.0, 0.5, 1), vec![2, 1]);
        let all_busy: Vec<Scored> = scored
            .iter()
            .cloned()
            .map(|mut s| {
                s.overloaded = true;
                s
            })
            .collect();
        assert!(order(&all_busy, Policy::Kv, 0.0, 0.5, 0).is_empty());
        let without_w1 = score(
            &targets(),
            &RequestHashes::from_sets(false, vec![set(Vec::new())]),
            pricing(16, &CostWeights::default(), &BusyThresholds::default()),
            ranks(&|_, s| Load::of(None, s), &|n| n != "w1"),
        );
        assert_eq!(without_w1.len(), 1);
        // A learned speed stands in for the declared one, rank by rank.
        let half = |k: WorkerRank| (k == WorkerRank::new(1, 1)).then_some(0.5);
        let learned = score(
            &targets(),
            &RequestHashes::from_sets(false, vec![set(vec![hit])]),
            pricing(16, &CostWeights::DYNAMO, &BusyThresholds::default()),
            RankState {
                learned_speed: &half,
                ..ranks(&|_, s| Load::of(None, s), &|_| true)
            },
        );
        assert_eq!(learned[2].speed, 0.5);
        assert_eq!(learned[2].cost.total, 10.0);
        assert_eq!((learned[1].speed, learned[1].cost.total), (1.0, 8.0));
    }

    fn pricing<'a>(
        request_tokens: u64,
        weights: &'a CostWeights,
        busy: &'a BusyThresholds,
    ) -> Pricing<'a> {
        Pricing {
            request_tokens,
            weights,
            busy,
        }
    }

    /// Loads and availability as given, and no learned speeds.
    fn ranks<'a>(
        load: &'a dyn Fn(WorkerRank, &[SequenceHash]) -> Load,
        available: &'a dyn Fn(&str) -> bool,
    ) -> RankState<'a> {
        RankState {
            load,
            available,
            learned_speed: &|_| None,
        }
    }
}
