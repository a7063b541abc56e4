//! The routing of a simulation: the index, fed by the engines' encoded
//! event batches through the same decoder `kvroute serve` runs, the same
//! request hashing (`kvroute_prompt`'s `RoutingRequest::local_hashes`), the
//! same candidate scoring (`kvroute_core::scheduler::fleet`), the same
//! placement (`kvroute_core::scheduler::Placer`: the policy's order, the
//! dealer, the stickiness, SGLang's tree, and on a fleet of prefill and
//! decode engines the split plan, [`SimRouter::route_split`]) and the same
//! in-flight accounting (`ActiveSequences`, charged with the uncached
//! prefill tokens, released at the first token and at the end). What is
//! its own: it has no queue (a request that finds every rank busy is
//! placed with the thresholds ignored, `WhenAllBusy::PlaceAnyway`) and it
//! may learn per-rank caps ([`super::caps`]). Or the oracle, which reads
//! the engines' true caches. Or a fixed placement of prefix groups
//! ([`Pins`]), which no online router can know in advance: the bound of
//! what a router that keeps every group on one engine can reach.

use std::collections::HashMap;
use std::sync::Arc;

use kvroute_core::event::WorkerFlavor;
use kvroute_core::index::{DpRank, Index, IndexConfig, SharedIndex, WorkerId, WorkerRank};
use kvroute_core::rng::SplitMix64;
use kvroute_core::scheduler::peers::CacheAwareConfig;
use kvroute_core::scheduler::{
    predicted_cached_tokens, score, ActiveSequences, FleetView, Load, PlaceRequest, Placer,
    PlacerConfig, Policy, Pricing, RequestHashes, RouteTarget, Scored, SpeedConfig, SpeedLearner,
    WhenAllBusy, WorkerRole,
};
use kvroute_core::wire::{DecoderConfig, StreamDecoder};
use kvroute_mocker::engine::{Engine, NewRequest};
use kvroute_prompt::body::RoutingRequest;

use super::caps::{CapConfig, CapLearner};

use crate::contender::{Contender, Routing};

mod disagg;

pub use disagg::Split;

/// Where a request went and what the router recorded for it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Placement {
    /// The engine.
    pub engine: usize,
    /// Its id in the router's load table.
    pub active_id: u64,
    /// The cached tokens the router predicted (`None`: the oracle, which
    /// predicts nothing).
    pub predicted_cached: Option<u64>,
    /// The engine to fetch the prefix from first, and the leading blocks
    /// the router saw there (`None`: the engine computes what it lacks).
    pub fetch: Option<(usize, u32)>,
    /// A copy of the prefix to make ahead of demand: from engine, to
    /// engine, leading blocks (`None`: none).
    pub replicate: Option<(usize, usize, u32)>,
}

/// Each request's send time (ms) and its rank's requests in flight then,
/// by its id in the load table.
type SentAt = HashMap<u64, (u64, u64)>;

/// The simulated router.
#[derive(Debug)]
pub struct SimRouter {
    policy: Contender,
    index: SharedIndex,
    decoders: Vec<StreamDecoder>,
    targets: Arc<Vec<RouteTarget>>,
    active: HashMap<WorkerRank, ActiveSequences>,
    oracle_in_flight: Vec<usize>,
    /// The oracle's ties.
    rng: SplitMix64,
    /// The router's placements (unused by the oracle).
    placer: Placer,
    next_id: u64,
    /// Learns the engines' speeds from their decode times (`None`: the
    /// declared speeds stand).
    learner: Option<SpeedLearner<WorkerRank>>,
    /// Requests past their first token: when it came (µs) and the blocks in
    /// flight on their engine then.
    decoding: HashMap<u64, (u64, u64)>,
    /// A fixed placement of prefix groups, in place of the policy.
    pins: Option<Pins>,
    /// Per-rank caps learned from time to first token
    /// ([`Routing::cap_ttft_ms`]), with each request's send time (ms) and
    /// its rank's requests in flight then, until its first token.
    caps: Option<(CapLearner, SentAt)>,
}

/// A request scored against every rank: what the placer orders.
struct Scoring {
    scored: Vec<Scored>,
    hashes: RequestHashes,
}

/// How a router of `routing` places, its draws seeded by `seed`: as
/// `kvroute serve` does, except that a request finding every rank busy is
/// placed anyway (the simulator has no queue).
pub fn placer_config(routing: &Routing, seed: u64) -> PlacerConfig {
    PlacerConfig {
        policy: routing.policy,
        weights: routing.weights,
        temperature: routing.temperature,
        deal_new_prefixes: routing.deal_new_prefixes,
        stickiness: routing.stickiness,
        local_prefill: routing.disagg.local_prefill(),
        tree: CacheAwareConfig::default(),
        when_all_busy: WhenAllBusy::PlaceAnyway,
        seed,
        fetch: routing.fetch,
        replicate: routing.replicate,
    }
}

/// A fixed placement of prefix groups: the `k`-th group to arrive (a group
/// is the requests whose first block has the same tokens) goes to engine
/// `engines[k]`, and every later request of the group follows it. Each
/// group's prefix is then computed once, so the hit rate is the workload's
/// ceiling; what is left to choose is only which groups share an engine.
#[derive(Debug, Clone)]
pub struct Pins {
    engines: Vec<usize>,
    block_tokens: usize,
    groups: HashMap<Vec<u32>, usize>,
}

impl Pins {
    /// Groups in arrival order go to `engines` (groups beyond its length
    /// wrap around to its start).
    pub fn new(engines: Vec<usize>, block_size: u32) -> Self {
        Pins {
            engines,
            block_tokens: block_size.max(1) as usize,
            groups: HashMap::new(),
        }
    }

    /// The engine of the group `tokens` belongs to, among `fleet` engines.
    fn engine_of(&mut self, tokens: &[u32], fleet: usize) -> usize {
        let key = &tokens[..tokens.len().min(self.block_tokens)];
        let next = self.groups.len();
        let k = match self.groups.get(key) {
            Some(&k) => k,
            None => {
                self.groups.insert(key.to_vec(), next);
                next
            }
        };
        let engine = match self.engines.len() {
            0 => k,
            n => self.engines[k % n],
        };
        engine % fleet.max(1)
    }
}

/// The seed of the placer's draws in a simulation of `seed`: `kvroute
/// serve --routing-seed` with it draws as the simulation does, so the two
/// place the same requests on the same fleet state alike.
pub fn placer_seed(seed: u64) -> u64 {
    seed ^ 0x0005_1AE5
}

/// Engine `i`'s key in the index (one rank per engine).
fn key(i: usize) -> WorkerRank {
    WorkerRank::new(i as u32, 0)
}

impl SimRouter {
    /// A router over `engines` engines of `block_size` and `flavor`, told
    /// that engine `i` runs at `speeds[i]` (missing entries: 1), learning
    /// the speeds from the engines' responses when `learn` is set.
    pub fn new(
        policy: Contender,
        engines: usize,
        (block_size, flavor): (u32, WorkerFlavor),
        speeds: &[f64],
        learn: Option<SpeedConfig>,
        seed: u64,
    ) -> Self {
        let targets = (0..engines)
            .map(|i| RouteTarget {
                name: Arc::from(format!("sim{i}").as_str()),
                id: WorkerId(i as u32),
                block_size,
                ranks: vec![DpRank(0)],
                flavor,
                speed: speeds.get(i).copied().unwrap_or(1.0),
                role: kvroute_core::scheduler::WorkerRole::Both,
            })
            .collect();
        let decoders = (0..engines)
            .map(|_| {
                StreamDecoder::new(DecoderConfig {
                    block_size: Some(block_size),
                    ..DecoderConfig::default()
                })
            })
            .collect();
        SimRouter {
            policy,
            index: SharedIndex::new(Index::new(IndexConfig::default())),
            decoders,
            targets: Arc::new(targets),
            active: HashMap::new(),
            oracle_in_flight: vec![0; engines],
            rng: SplitMix64::new(placer_seed(seed)),
            placer: {
                let routing = match policy {
                    Contender::Router(routing) => routing,
                    Contender::Oracle => Routing::new(Policy::Kv),
                };
                Placer::new(placer_config(&routing, placer_seed(seed)))
            },
            next_id: 0,
            learner: learn.map(SpeedLearner::new),
            decoding: HashMap::new(),
            pins: None,
            caps: match policy {
                Contender::Router(Routing {
                    cap_ttft_ms: Some(ms),
                    ..
                }) => Some((
                    CapLearner::new(CapConfig {
                        ttft_target_ms: ms,
                        ..CapConfig::default()
                    }),
                    HashMap::new(),
                )),
                _ => None,
            },
        }
    }

    /// The same router told each engine's role, as `role=` tells `kvroute
    /// serve` (missing entries: both). With prefill and decode engines,
    /// requests go through [`SimRouter::route_split`].
    pub fn with_roles(mut self, roles: &[WorkerRole]) -> Self {
        let targets: Vec<RouteTarget> = self
            .targets
            .iter()
            .enumerate()
            .map(|(i, t)| RouteTarget {
                role: roles.get(i).copied().unwrap_or_default(),
                ..t.clone()
            })
            .collect();
        self.targets = Arc::new(targets);
        self
    }

    /// The same router placing prefix groups by `pins` instead of its policy.
    pub fn pinned(mut self, pins: Pins) -> Self {
        self.pins = Some(pins);
        self
    }

    /// Applies one published batch of engine `engine` (msgpack, as on the wire);
    /// returns the events the decoder skipped.
    pub fn ingest(&mut self, engine: usize, payload: &[u8]) -> u64 {
        let Some(decoder) = self.decoders.get_mut(engine) else {
            return 0;
        };
        let Ok(batch) = decoder.decode(payload) else {
            return 1;
        };
        for event in batch.decoded() {
            self.index.apply(key(engine), event);
        }
        batch.skipped().count() as u64
    }

    /// Chooses the engine for a prompt and records it as in flight there.
    pub fn route(&mut self, tokens: &[u32], now_ms: u64, engines: &[Engine]) -> Placement {
        if let Some(pins) = &mut self.pins {
            let engine = pins.engine_of(tokens, engines.len());
            let id = self.next_id;
            self.next_id += 1;
            return Placement {
                engine,
                active_id: id,
                predicted_cached: None,
                fetch: None,
                replicate: None,
            };
        }
        match self.policy {
            Contender::Oracle => self.route_oracle(tokens, engines),
            Contender::Router(routing) => self.route_scored(tokens, now_ms, routing),
        }
    }

    fn route_scored(&mut self, tokens: &[u32], now_ms: u64, routing: Routing) -> Placement {
        let Scoring { mut scored, hashes } = self.score_request(tokens, &routing);
        if let Some((caps, _)) = &self.caps {
            for s in &mut scored {
                s.overloaded |= caps.at_cap(s.key, s.candidate.active_requests);
            }
        }
        let ask = PlaceRequest {
            tokens: Some(tokens),
            now_ms,
            ..PlaceRequest::default()
        };
        let request_tokens = tokens.len() as u64;
        let ordered = self.placer.order(&scored, &ask);
        let chosen = ordered.order.first().copied().unwrap_or(0);
        let s = &scored[chosen];
        self.placer.record(&ordered, s, request_tokens);
        let in_flight = s.candidate.active_requests + 1;
        let fetch = ordered.fetch.filter(|f| f.receiver == chosen);
        // A fetched prefix arrives computed: the rank prefills the rest.
        let fetched_tokens =
            fetch.map_or(0, |f| u64::from(f.source_blocks) * u64::from(s.block_size));
        let prefill_tokens = s
            .uncached_prefill_tokens(request_tokens)
            .min(request_tokens.saturating_sub(fetched_tokens));
        let id = self.charge(s, &hashes, prefill_tokens, now_ms);
        if routing.policy == Policy::Approx {
            self.record_decision(s, &hashes, now_ms);
        }
        if let Some((_, sent)) = &mut self.caps {
            sent.insert(id, (now_ms, in_flight));
        }
        let blocks = fetch.map_or(0, |f| f.source_blocks);
        let predicted_blocks = s.predicted_cached_blocks().max(blocks);
        Placement {
            engine: s.worker,
            active_id: id,
            predicted_cached: Some(predicted_cached_tokens(
                predicted_blocks,
                s.block_size,
                request_tokens,
            )),
            fetch: fetch.map(|f| (scored[f.source].worker, f.source_blocks)),
            replicate: ordered.replicate.map(|c| {
                let (from, to) = (scored[c.source].worker, scored[c.target].worker);
                (from, to, scored[c.source].candidate.device_blocks)
            }),
        }
    }

    /// Scores every rank for a prompt as the proxy's `candidates` does.
    fn score_request(&self, tokens: &[u32], routing: &Routing) -> Scoring {
        let req = RoutingRequest {
            tokens: Some(tokens.to_vec()),
            ..RoutingRequest::default()
        };
        let targets = self.targets.clone();
        let hashes = RequestHashes::compute(
            &targets,
            &self.index,
            &mut |bs, flavor| req.local_hashes(bs, flavor),
            false,
        );
        let (active, learner) = (&self.active, &self.learner);
        let pricing = Pricing {
            request_tokens: tokens.len() as u64,
            weights: &routing.weights,
            busy: &routing.busy,
        };
        let scored = score(
            &targets,
            &hashes,
            pricing,
            FleetView {
                load: &|k, seqs| Load::of(active.get(&k), seqs),
                available: &|_| true,
                learned_speed: &|k| learner.as_ref()?.speed(k),
                trusted: &|_| true,
            },
        );
        Scoring { scored, hashes }
    }

    /// Charges a request to `s`'s rank with its blocks and `prefill_tokens`
    /// uncached prompt tokens, as the proxy's `attempt::charge_as` does;
    /// returns its id in the load table.
    fn charge(
        &mut self,
        s: &Scored,
        hashes: &RequestHashes,
        prefill_tokens: u64,
        now_ms: u64,
    ) -> u64 {
        let seqs = hashes
            .get(s.block_size, s.flavor)
            .map_or(&[][..], |set| &set.seqs[..]);
        let id = self.next_id;
        self.next_id += 1;
        self.active
            .entry(s.key)
            .or_default()
            .add(id, seqs, prefill_tokens, now_ms);
        id
    }

    /// The `approx` policy's record of a request sent to `s`'s rank.
    fn record_decision(&self, s: &Scored, hashes: &RequestHashes, now_ms: u64) {
        if let Some(set) = hashes.get(s.block_size, s.flavor) {
            self.index
                .record_routing_decision(s.key, &set.locals, now_ms);
        }
    }

    fn route_oracle(&mut self, tokens: &[u32], engines: &[Engine]) -> Placement {
        let probe = NewRequest {
            prompt: tokens.iter().map(|&t| u64::from(t)).collect(),
            output: Vec::new(),
            mm_items: Vec::new(),
            lora_name: None,
        };
        let candidates: Vec<(usize, u32, u64)> = engines
            .iter()
            .enumerate()
            .map(|(i, e)| (i, 0, e.cached_prefix_tokens(&probe) as u64))
            .collect();
        let loads = &self.oracle_in_flight;
        let (engine, _) =
            crate::oracle::choose(&candidates, |w, _| loads[w], &mut self.rng).unwrap_or((0, 0));
        self.oracle_in_flight[engine] += 1;
        let id = self.next_id;
        self.next_id += 1;
        Placement {
            engine,
            active_id: id,
            predicted_cached: None,
            fetch: None,
            replicate: None,
        }
    }

    /// The request's first token reached the router at `now_us`: its
    /// prefill is over.
    pub fn first_token(&mut self, at: Placement, now_us: u64) {
        if let Some((caps, sent)) = &mut self.caps {
            if let Some((sent_ms, in_flight)) = sent.remove(&at.active_id) {
                let ttft_ms = (now_us as f64 / 1e3 - sent_ms as f64).max(0.0);
                caps.observe(key(at.engine), ttft_ms, in_flight);
            }
        }
        if let Some(a) = self.active.get_mut(&key(at.engine)) {
            a.prefill_done(at.active_id);
            if self.learner.is_some() {
                self.decoding
                    .insert(at.active_id, (now_us, a.active_blocks()));
            }
        }
    }

    /// The request ended at `now_us` after `output_tokens` tokens.
    pub fn finished(&mut self, at: Placement, now_us: u64, output_tokens: u64) {
        let decoding = self.decoding.remove(&at.active_id);
        if let Some(a) = self.active.get_mut(&key(at.engine)) {
            if let (Some(learner), Some((first_us, load))) = (&mut self.learner, decoding) {
                let ms = now_us.saturating_sub(first_us) as f64 / 1e3;
                let loads = (load, a.active_blocks());
                learner.observe_response(key(at.engine), loads, ms, output_tokens);
            }
            a.free(at.active_id);
        }
        if self.policy == Contender::Oracle {
            if let Some(n) = self.oracle_in_flight.get_mut(at.engine) {
                *n = n.saturating_sub(1);
            }
        }
    }
}
