//! One request's candidates: each (worker, rank) it could go to, with what
//! that rank holds of the request, what it is already doing, and the cost.
//!
//! The caller walks its own list of workers (with their addresses and
//! circuit breakers, which the core knows nothing about) and asks
//! [`Scored::rank`] for each rank; the result refers back to the caller's
//! list by position.

use crate::event::WorkerFlavor;
use crate::hash::SequenceHash;
use crate::index::{RankMatch, WorkerRank};

use super::active::ActiveSequences;
use super::cost::{Candidate, CostBreakdown, CostWeights};

/// Busy thresholds: a candidate at or over either is skipped.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct BusyThresholds {
    /// Active prefill tokens.
    pub prefill_tokens: Option<u64>,
    /// Active decode blocks.
    pub decode_blocks: Option<u64>,
    /// Active requests.
    pub requests: Option<u64>,
}

impl BusyThresholds {
    /// Whether a candidate with this load is overloaded.
    pub fn overloaded(&self, c: &Candidate) -> bool {
        self.prefill_tokens
            .is_some_and(|t| c.active_prefill_tokens >= t)
            || self
                .decode_blocks
                .is_some_and(|t| c.active_decode_blocks >= t)
            || self.requests.is_some_and(|t| c.active_requests >= t)
    }
}

/// A rank's load as the cost needs it, for one request.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Load {
    /// Prompt tokens in prefill.
    pub prefill_tokens: u64,
    /// Distinct active blocks.
    pub decode_blocks: u64,
    /// Of the request's blocks, those not active there.
    pub new_blocks: u64,
    /// Leading blocks of the request held by active requests.
    pub active_prefix: u32,
    /// Active requests.
    pub requests: u64,
    /// Blocks of the active requests, counted once per request.
    pub request_blocks: u64,
}

impl Load {
    /// The load of `active` (or of an idle rank) for a request with blocks `seqs`.
    pub fn of(active: Option<&ActiveSequences>, seqs: &[SequenceHash]) -> Load {
        match active {
            None => Load {
                new_blocks: seqs.len() as u64,
                ..Load::default()
            },
            Some(a) => Load {
                prefill_tokens: a.active_prefill_tokens(),
                decode_blocks: a.active_blocks(),
                new_blocks: a.new_blocks(seqs),
                active_prefix: a.active_prefix(seqs),
                requests: a.active_requests(),
                request_blocks: a.request_blocks(),
            },
        }
    }
}

/// A rank's load as its engine reports it (`/metrics`): it counts requests
/// that did not come through this router (other routers, direct clients),
/// which the router's own accounting cannot see.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct EngineReport {
    /// Requests running or waiting there.
    pub requests: u64,
    /// KV blocks in use there, when the engine says its capacity.
    pub kv_blocks: Option<u64>,
}

impl Load {
    /// This load, raised to what the engine reports where it reports more:
    /// requests and blocks the router did not send there are load all the
    /// same. The router's own figures stand where they are higher (the
    /// engine's lag a scrape behind), and without a report.
    pub fn with_report(self, report: Option<&EngineReport>) -> Load {
        let Some(r) = report else {
            return self;
        };
        let outside = r.requests.saturating_sub(self.requests);
        let blocks = r.kv_blocks.unwrap_or(0).max(self.decode_blocks);
        Load {
            requests: self.requests + outside,
            decode_blocks: blocks,
            request_blocks: self.request_blocks + (blocks - self.decode_blocks),
            ..self
        }
    }
}

/// What is being scored: the request's size and the rules that price it.
#[derive(Debug, Clone, Copy)]
pub struct Pricing<'a> {
    /// The request's prompt tokens.
    pub request_tokens: u64,
    /// The cost's weights.
    pub weights: &'a CostWeights,
    /// Ranks at or over these are marked overloaded.
    pub busy: &'a BusyThresholds,
}

/// One (worker, rank) a request could go to.
#[derive(Debug, Clone, PartialEq)]
pub struct Scored {
    /// Position of the worker in the caller's list.
    pub worker: usize,
    /// Index key.
    pub key: WorkerRank,
    /// Tokens per block at this worker.
    pub block_size: u32,
    /// The worker's engine flavour (which hashes of the request it was scored on).
    pub flavor: WorkerFlavor,
    /// The worker's speed against the fleet's reference engine, as declared
    /// (1: the reference; 0.5: half as fast): its cost is the work the
    /// request would take there divided by it.
    pub speed: f64,
    /// Cache and load facts.
    pub candidate: Candidate,
    /// The cost.
    pub cost: CostBreakdown,
    /// Over a busy threshold.
    pub overloaded: bool,
}

impl Scored {
    /// Scores rank `key` of the caller's worker number `worker` (its block
    /// size, flavour and speed), given what the index matched there
    /// (`None`: nothing) and the rank's load.
    pub fn rank(
        worker: usize,
        key: WorkerRank,
        (block_size, flavor, speed): (u32, WorkerFlavor, f64),
        matched: Option<&RankMatch>,
        load: Load,
        pricing: Pricing<'_>,
    ) -> Scored {
        let candidate = Candidate {
            device_blocks: matched.map_or(0, |m| m.device),
            host_blocks: matched.map_or(0, |m| m.host),
            any_blocks: matched.map_or(0, |m| m.any),
            active_prefix_blocks: load.active_prefix,
            active_prefill_tokens: load.prefill_tokens,
            active_decode_blocks: load.decode_blocks,
            new_active_blocks: load.new_blocks,
            active_requests: load.requests,
            active_request_blocks: load.request_blocks,
            request_blocks: seqs_len(pricing.request_tokens, block_size),
        };
        // A speed that is not a positive number is the reference's.
        let speed = if speed.is_finite() && speed > 0.0 {
            speed
        } else {
            1.0
        };
        let mut cost = candidate.cost(pricing.request_tokens, block_size, pricing.weights);
        cost.total /= speed;
        Scored {
            worker,
            key,
            block_size,
            flavor,
            speed,
            cost,
            overloaded: pricing.busy.overloaded(&candidate),
            candidate,
        }
    }

    /// The prompt tokens this candidate still has to compute for a
    /// `request_tokens`-token request: what the request adds to the rank's
    /// prefill load until its first token.
    pub fn uncached_prefill_tokens(&self, request_tokens: u64) -> u64 {
        let cached = u64::from(self.candidate.device_blocks) * u64::from(self.block_size);
        request_tokens.saturating_sub(cached)
    }

    /// The prompt tokens the engine will report cached if this candidate is
    /// chosen for a `prompt_tokens`-token prompt. A vLLM engine caches a
    /// block as it schedules the step that fills it, so a prefix that a
    /// request active there is computing counts, though the index has not
    /// heard of it yet; SGLang's radix tree (and TensorRT-LLM's) takes a
    /// chunk only once it is computed, so there only the index counts.
    pub fn predicted_cached_tokens(&self, prompt_tokens: u64) -> u64 {
        predicted_cached_tokens(
            self.predicted_cached_blocks(),
            self.block_size,
            prompt_tokens,
        )
    }

    /// The leading blocks of the request the engine will find cached if this
    /// candidate is chosen ([`Scored::predicted_cached_tokens`] in blocks).
    pub fn predicted_cached_blocks(&self) -> u32 {
        let c = &self.candidate;
        if self.flavor.caches_when_scheduled() {
            c.device_blocks.max(c.active_prefix_blocks)
        } else {
            c.device_blocks
        }
    }
}

/// Blocks of a `request_tokens`-token request at `block_size`, partial last block included.
fn seqs_len(request_tokens: u64, block_size: u32) -> u64 {
    request_tokens.div_ceil(u64::from(block_size.max(1)))
}

/// The prompt tokens an engine will report as cached if the first
/// `device_blocks` blocks are on its device: engines always compute the last
/// prompt token, so a fully cached prompt reports one block less when its
/// length is a multiple of the block size.
pub fn predicted_cached_tokens(device_blocks: u32, block_size: u32, prompt_tokens: u64) -> u64 {
    let bs = u64::from(block_size.max(1));
    let limit = prompt_tokens.saturating_sub(1) / bs * bs;
    (u64::from(device_blocks) * bs).min(limit)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn predictions_follow_the_engines_last_token_rule() {
        assert_eq!(predicted_cached_tokens(4, 16, 64), 48);
        assert_eq!(predicted_cached_tokens(4, 16, 100), 64);
        assert_eq!(predicted_cached_tokens(0, 16, 100), 0);
    }

    /// A match of `blocks` leading blocks on the device.
    fn held(key: WorkerRank, blocks: u32) -> RankMatch {
        RankMatch {
            worker_rank: key,
            device: blocks,
            host: blocks,
            any: blocks,
        }
    }

    #[test]
    fn a_rank_is_priced_on_its_match_and_load() {
        let weights = CostWeights::DYNAMO;
        let busy = BusyThresholds {
            prefill_tokens: Some(100),
            decode_blocks: None,
            requests: None,
        };
        let pricing = Pricing {
            request_tokens: 64,
            weights: &weights,
            busy: &busy,
        };
        let key = WorkerRank::new(1, 0);
        let hit = held(key, 3);
        let idle = Load {
            new_blocks: 4,
            ..Load::default()
        };
        let s = Scored::rank(
            2,
            key,
            (16, WorkerFlavor::Vllm, 1.0),
            Some(&hit),
            idle,
            pricing,
        );
        assert_eq!((s.worker, s.cost.total, s.overloaded), (2, 5.0, false));
        assert_eq!(s.predicted_cached_tokens(64), 48);
        let loaded = Load {
            prefill_tokens: 100,
            ..idle
        };
        let s = Scored::rank(0, key, (16, WorkerFlavor::Vllm, 1.0), None, loaded, pricing);
        assert!(s.overloaded);
        assert_eq!(s.candidate.device_blocks, 0);
    }

    /// Rank 0 of worker 0 scored with the default weights and no busy
    /// thresholds, for a `request_tokens`-token request.
    fn scored_with(
        request_tokens: u64,
        (flavor, speed): (WorkerFlavor, f64),
        matched: Option<&RankMatch>,
        load: Load,
    ) -> Scored {
        let weights = CostWeights::default();
        scored_under(&weights, request_tokens, (flavor, speed), matched, load)
    }

    /// [`scored_with`] under other weights.
    fn scored_under(
        weights: &CostWeights,
        request_tokens: u64,
        (flavor, speed): (WorkerFlavor, f64),
        matched: Option<&RankMatch>,
        load: Load,
    ) -> Scored {
        let busy = BusyThresholds::default();
        let pricing = Pricing {
            request_tokens,
            weights,
            busy: &busy,
        };
        let key = WorkerRank::new(0, 0);
        Scored::rank(0, key, (16, flavor, speed), matched, load, pricing)
    }

    #[test]
    fn a_slower_worker_costs_as_much_more_as_it_is_slower() {
        let idle = Load {
            new_blocks: 4,
            ..Load::default()
        };
        let at = |speed| scored_with(64, (WorkerFlavor::Vllm, speed), None, idle);
        let (reference, half) = (at(1.0), at(0.5));
        assert!(reference.cost.total > 0.0);
        assert_eq!(half.cost.total, 2.0 * reference.cost.total);
        assert_eq!(
            half.cost.prefill, reference.cost.prefill,
            "the work is the same"
        );
        // Not a positive number: the reference's speed.
        for bad in [0.0, -1.0, f64::NAN, f64::INFINITY] {
            assert_eq!(at(bad).cost.total, reference.cost.total);
        }
    }

    #[test]
    fn the_request_size_moves_a_prompt_off_a_much_slower_holder_only() {
        let idle = Load {
            new_blocks: 8,
            ..Load::default()
        };
        let busy = Load {
            decode_blocks: 40,
            requests: 2,
            request_blocks: 40,
            ..idle
        };
        let hit = held(WorkerRank::new(0, 0), 8);
        let cost = |speed, matched, load| {
            scored_with(128, (WorkerFlavor::Vllm, speed), matched, load)
                .cost
                .total
        };
        // Ranks of one speed: the term adds the same to each, so the
        // holder wins by what it won by without the term.
        let no_size = CostWeights {
            request_size_weight: 0.0,
            ..CostWeights::default()
        };
        let without = |matched, load| {
            let s = scored_under(&no_size, 128, (WorkerFlavor::Vllm, 1.0), matched, load);
            s.cost.total
        };
        let margin = cost(1.0, None, idle) - cost(1.0, Some(&hit), busy);
        assert!(margin > 0.0);
        assert_eq!(margin, without(None, idle) - without(Some(&hit), busy));
        // Half as fast, the holder still wins; a quarter as fast, it does
        // not: the request would decode four times as long there.
        assert!(cost(0.5, Some(&hit), idle) < cost(1.0, None, idle));
        assert!(cost(0.25, Some(&hit), idle) > cost(1.0, None, idle));
    }

    #[test]
    fn a_prefix_in_flight_is_predicted_cached_on_vllm_only() {
        let hit = held(WorkerRank::new(0, 0), 2);
        let computing = Load {
            active_prefix: 5,
            requests: 1,
            ..Load::default()
        };
        let predicted = |flavor, matched| {
            scored_with(100, (flavor, 1.0), matched, computing).predicted_cached_tokens(100)
        };
        // Five leading blocks in flight, two of them announced.
        assert_eq!(predicted(WorkerFlavor::Vllm, Some(&hit)), 80);
        assert_eq!(predicted(WorkerFlavor::Vllm, None), 80);
        assert_eq!(predicted(WorkerFlavor::Sglang, Some(&hit)), 32);
        assert_eq!(predicted(WorkerFlavor::Sglang, None), 0);
    }
}

#[cfg(test)]
mod report_tests {
    use super::*;

    #[test]
    fn an_engine_report_raises_the_load_only_where_it_says_more() {
        let own = Load {
            prefill_tokens: 100,
            decode_blocks: 40,
            new_blocks: 3,
            active_prefix: 1,
            requests: 2,
            request_blocks: 50,
        };
        assert_eq!(own.with_report(None), own);
        let busier = EngineReport {
            requests: 7,
            kv_blocks: Some(90),
        };
        let raised = own.with_report(Some(&busier));
        assert_eq!((raised.requests, raised.decode_blocks), (7, 90));
        assert_eq!(raised.request_blocks, 100, "the outside blocks count once");
        assert_eq!((raised.prefill_tokens, raised.new_blocks), (100, 3));
        // The router's own figures stand where the engine lags behind.
        let behind = EngineReport {
            requests: 1,
            kv_blocks: None,
        };
        assert_eq!(own.with_report(Some(&behind)), own);
    }
}
