//! A request scored against a whole fleet: the workers as routing sees them
//! ([`RouteTarget`]), the request hashed once per (block size, engine
//! flavour) present among them and each hash set matched against the index
//! once ([`RequestHashes`]), then every rank of every available worker
//! priced ([`score`]) on what the router knows of its ranks ([`FleetView`]).
//!
//! `kvroute serve` and the simulator both score through here. Each keeps
//! its own list of workers (the server's also has their addresses and
//! ingest state) and passes it as anything that is an
//! [`AsRef<RouteTarget>`]; a [`Scored`] refers back to that list by position.

use std::sync::Arc;

use crate::event::WorkerFlavor;
use crate::hash::{sequence_hashes, LocalBlockHash, SequenceHash};
use crate::index::{DpRank, RankMatch, SharedIndex, WorkerId, WorkerRank};

use super::candidates::{Load, Pricing, Scored};
use super::disagg::WorkerRole;

/// A worker as routing sees it: what its ranks are and how to price them.
#[derive(Debug, Clone, PartialEq)]
pub struct RouteTarget {
    /// Name (shared with metric labels and breakers without copying).
    pub name: Arc<str>,
    /// Index id.
    pub id: WorkerId,
    /// Tokens per block; 0 while it is still to be learned from the
    /// worker's stream (the request then hashes to no blocks for it, and it
    /// is priced on load alone).
    pub block_size: u32,
    /// Its data-parallel ranks, ascending.
    pub ranks: Vec<DpRank>,
    /// Its engine flavour: how it lays out images, so which request hashes apply.
    pub flavor: WorkerFlavor,
    /// Its declared speed against the fleet's reference engine (1: the reference).
    pub speed: f64,
    /// What it does in a disaggregated fleet (aggregated engines: both).
    pub role: WorkerRole,
}

impl AsRef<RouteTarget> for RouteTarget {
    fn as_ref(&self) -> &RouteTarget {
        self
    }
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
    pub fn compute<T: AsRef<RouteTarget>>(
        targets: &[T],
        index: &SharedIndex,
        locals_at: &mut dyn FnMut(u32, WorkerFlavor) -> Vec<LocalBlockHash>,
        flavor_matters: bool,
    ) -> Self {
        let mut hashes = RequestHashes {
            flavor_matters,
            sets: Vec::new(),
        };
        for t in targets.iter().map(AsRef::as_ref) {
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

/// What scoring reads of the router's view of the fleet, rank by rank: the
/// caller's own state (loads, breakers, learned speeds) behind closures.
#[derive(Clone, Copy)]
pub struct FleetView<'a> {
    /// A rank's load, given the request's blocks.
    pub load: &'a dyn Fn(WorkerRank, &[SequenceHash]) -> Load,
    /// Whether a worker (by name) takes requests now.
    pub available: &'a dyn Fn(&str) -> bool,
    /// A rank's learned speed, which stands in for its worker's declared one.
    pub learned_speed: &'a dyn Fn(WorkerRank) -> Option<f64>,
    /// Whether a rank's indexed blocks count: not while they may be a dead
    /// engine's, whose restarted successor on the same ports holds none
    /// (a rank scored as holding nothing is predicted a miss).
    pub trusted: &'a dyn Fn(WorkerRank) -> bool,
}

/// One scored candidate per rank of every worker in `targets` that is
/// available, priced on its flavour's hashes, its load and its speed.
pub fn score<T: AsRef<RouteTarget>>(
    targets: &[T],
    hashes: &RequestHashes,
    pricing: Pricing<'_>,
    view: FleetView<'_>,
) -> Vec<Scored> {
    let mut out = Vec::new();
    for (i, t) in targets.iter().map(AsRef::as_ref).enumerate() {
        if !(view.available)(&t.name) {
            continue;
        }
        let Some(set) = hashes.get(t.block_size, t.flavor) else {
            continue;
        };
        for &rank in &t.ranks {
            let key = WorkerRank { worker: t.id, rank };
            let matched = set
                .matches
                .iter()
                .find(|m| m.worker_rank == key)
                .filter(|_| (view.trusted)(key));
            let load = (view.load)(key, &set.seqs);
            let speed = (view.learned_speed)(key).unwrap_or(t.speed);
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

#[cfg(test)]
mod tests {
    use super::*;
    use crate::hash::{local_block_hashes, namespace_seed, HASH_SEED};
    use crate::index::{Index, IndexConfig};
    use crate::multimodal::{prompt_local_hashes, ImageIdentity, ImageSpan};
    use crate::scheduler::{order, ActiveSequences, BusyThresholds, CostWeights, Policy};

    fn targets() -> Vec<RouteTarget> {
        vec![
            RouteTarget {
                name: Arc::from("w0"),
                id: WorkerId(0),
                block_size: 4,
                ranks: vec![DpRank(0)],
                flavor: WorkerFlavor::Vllm,
                speed: 1.0,
                role: WorkerRole::Both,
            },
            RouteTarget {
                name: Arc::from("w1"),
                id: WorkerId(1),
                block_size: 4,
                ranks: vec![DpRank(0), DpRank(1)],
                flavor: WorkerFlavor::Vllm,
                speed: 1.0,
                role: WorkerRole::Both,
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
        let images = [ImageSpan {
            start: 4,
            len: 8,
            identity: ImageIdentity::from_hash(42),
        }];
        let seed = namespace_seed(None, None);
        let mut mixed = targets();
        mixed[1].flavor = WorkerFlavor::Sglang;
        let mut asked = Vec::new();
        let hashes = RequestHashes::compute(
            &mixed,
            &empty_index(),
            &mut |bs, f| {
                asked.push((bs, f));
                prompt_local_hashes(&tokens, &images, f, bs as usize, seed)
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
        let (vllm, sglang) = (
            hashes.get(4, WorkerFlavor::Vllm).expect("hashed"),
            hashes.get(4, WorkerFlavor::Sglang).expect("hashed"),
        );
        assert_eq!(vllm.locals.len(), 3);
        assert_eq!(
            vllm.locals[0], sglang.locals[0],
            "the text block is the same"
        );
        assert_ne!(
            vllm.locals[1..],
            sglang.locals[1..],
            "the image blocks differ"
        );
        // Without images one set serves both flavours.
        let text = RequestHashes::compute(
            &mixed,
            &empty_index(),
            &mut |bs, _| local_block_hashes(&tokens, bs as usize, HASH_SEED, 0),
            false,
        );
        assert_eq!(
            text.get(4, WorkerFlavor::Vllm),
            text.get(4, WorkerFlavor::Sglang)
        );
    }

    #[test]
    fn candidates_take_cache_hits_and_load_into_account() {
        let locals = local_block_hashes(&(0..16).collect::<Vec<_>>(), 4, HASH_SEED, 0);
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
            FleetView {
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
    ) -> FleetView<'a> {
        FleetView {
            load,
            available,
            learned_speed: &|_| None,
            trusted: &|_| true,
        }
    }
}
