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

use kvroute_mocker::engine::NewRequest;
use kvroute_mocker::handoff::transfer_delay;

use super::Sim;

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
