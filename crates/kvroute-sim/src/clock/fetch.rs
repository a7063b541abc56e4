//! A request placed with a fetch ([`kvroute_core::scheduler::fetch`]) on
//! the virtual clock: its engine first receives the prefix's blocks from
//! the holder, then runs it with them arrived computed.
//!
//! What is modelled: the transfer of the blocks the source really holds
//! when the request reaches the receiver and the receiver lacks, at the
//! fleet's `transfer_us_per_block` (divided by the engines' speedup, as
//! the mocker divides it), before the request enters the receiver; the
//! receiver then holds the blocks (its cache publishes them, as an
//! engine's stored blocks are) and counts them as received, not as hits
//! nor as computed. What is not: the source's side. A real hand-off asks
//! the holder for a one-token leg (vLLM) or a bootstrap room (SGLang);
//! here the holder's steps are not slowed, nor its blocks pinned.
//!
//! A copy of a hot prefix made ahead of demand
//! ([`kvroute_core::scheduler::replicate`]) travels the same way: the
//! target waits the transfer, then runs a one-token request of the prefix
//! with the blocks arrived computed (its cache holds and publishes them);
//! the copy's output goes nowhere.

use kvroute_mocker::engine::{Handoff, NewRequest, RequestId};
use kvroute_mocker::handoff::transfer_delay;

use super::super::routing::Placement;
use super::{Event, Sim};

/// The bit that marks a copy's id on its target engine (a prefill leg's
/// bit is 1 << 62).
const COPY: u64 = 1 << 61;

/// Whether an engine's request is a copy made ahead of demand.
pub(super) fn is_copy(id: RequestId) -> bool {
    id.0 & COPY != 0
}

impl Sim<'_> {
    /// Request `n`, placed with a fetch, learns what it will receive: the
    /// source's cached prefix beyond the receiver's own. Returns the
    /// transfer's duration in µs (0: nothing to fetch).
    pub(super) fn fetch_delay(&mut self, n: usize) -> u64 {
        let Some(p) = self.requests[n].placement else {
            return 0;
        };
        let Some((source, _)) = p.fetch else {
            return 0;
        };
        let probe = NewRequest {
            prompt: self.requests[n]
                .tokens
                .iter()
                .map(|&t| u64::from(t))
                .collect(),
            output: Vec::new(),
            mm_items: Vec::new(),
            lora_name: None,
        };
        let (Some(src), Some(dst)) = (self.engines.get(source), self.engines.get(p.engine)) else {
            return 0;
        };
        let (held, own) = (
            src.cached_prefix_tokens(&probe),
            dst.cached_prefix_tokens(&probe),
        );
        if held <= own {
            // The source lost the blocks since the router looked: recomputed.
            self.fetch_misses += 1;
            return 0;
        }
        let bs = self.config.engine.block_size.max(1);
        let blocks = held / bs - own / bs;
        self.fetches += 1;
        self.fetched_blocks += blocks as u64;
        self.requests[n].received_tokens = held;
        let (per_block, speedup) = (
            self.config.transfer_us_per_block,
            self.config.engine.timing.speedup,
        );
        transfer_delay(blocks, per_block, speedup).as_micros() as u64
    }
}

impl Sim<'_> {
    /// Request `n`'s placement asks for a copy of its prefix: the blocks
    /// the source really holds beyond the target's go out.
    pub(super) fn start_copy(&mut self, n: usize) {
        let Some((source, target, _)) = self.requests[n].placement.and_then(|p| p.replicate) else {
            return;
        };
        let prompt: Vec<u64> = self.requests[n]
            .tokens
            .iter()
            .map(|&t| u64::from(t))
            .collect();
        let probe = NewRequest {
            prompt,
            output: Vec::new(),
            mm_items: Vec::new(),
            lora_name: None,
        };
        let (Some(src), Some(dst)) = (self.engines.get(source), self.engines.get(target)) else {
            return;
        };
        let (held, own) = (
            src.cached_prefix_tokens(&probe),
            dst.cached_prefix_tokens(&probe),
        );
        let bs = self.config.engine.block_size.max(1);
        if held <= own || held < bs {
            return;
        }
        let blocks = held / bs - own / bs;
        self.replicas.0 += 1;
        self.replicas.1 += blocks as u64;
        // The prefix and one token more, which the target computes.
        let mut prompt = probe.prompt;
        prompt.truncate(held + 1);
        self.copies.insert(n, (target, prompt, held - own));
        let (per_block, speedup) = (
            self.config.transfer_us_per_block,
            self.config.engine.timing.speedup,
        );
        let transfer = transfer_delay(blocks, per_block, speedup).as_micros() as u64;
        let hop = self.config.delays.engine_us;
        self.at(self.now + hop + transfer, Event::ReplicaArrives(n));
    }

    /// The copy of request `n`'s prefix enters its target with the blocks
    /// arrived computed.
    pub(super) fn copy_arrives(&mut self, n: usize) {
        let Some((target, prompt, credit)) = self.copies.remove(&n) else {
            return;
        };
        let received = prompt.len().saturating_sub(1);
        let request = NewRequest {
            prompt,
            output: vec![1],
            mm_items: Vec::new(),
            lora_name: None,
        };
        let handoff = Handoff {
            received_tokens: received,
            hold: false,
        };
        let id = RequestId(n as u64 | COPY);
        if self.engines[target]
            .submit_with(id, request, handoff)
            .is_ok()
        {
            self.replicas.2 += credit as u64;
            if self.stepping[target].is_none() {
                self.start_step(target);
            }
        }
    }
}

impl Sim<'_> {
    /// Request `n`, placed with a fetch on a fleet that runs fetches as
    /// legs: its source gets the one-token leg (its uncached rest computed
    /// there, in its own steps), and the receiver the decode leg after it
    /// ([`super::legs`]). Returns whether it went that way.
    pub(super) fn fetch_by_legs(&mut self, n: usize) -> bool {
        let Some(Placement {
            fetch: Some((source, _)),
            ..
        }) = self.requests[n].placement
        else {
            return false;
        };
        if !self.config.fetch_legs {
            return false;
        }
        self.fetches += 1;
        let r = &mut self.requests[n];
        r.fetch_legs = true;
        // The router charged the receiver; the source's leg is not charged.
        r.prefill = Some(Placement {
            engine: source,
            active_id: u64::MAX,
            predicted_cached: None,
            fetch: None,
            replicate: None,
        });
        self.per_engine[source] += 1;
        self.at(
            self.now + self.config.delays.engine_us,
            Event::SubmitPrefill(n),
        );
        true
    }
}
