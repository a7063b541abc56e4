//! Moving the cache instead of the work: when the rank holding a request's
//! prefix is the cheapest place to *compute* it but not the cheapest place
//! to *run* it (its queue and decode load cost more than moving the
//! blocks), the request runs on a cooler rank that first receives the
//! prefix's blocks from the holder, with the engines' own hand-off (the
//! one a prefill/decode fleet uses between its two legs).
//!
//! Three ways to serve a request whose prefix rank `H` holds, priced in the
//! cost's units (blocks of work, [`super::cost`]):
//!
//! * **stay**: on `H`, at its cost (waiting behind its load);
//! * **recompute**: on another rank `R`, at `R`'s cost (its own cache only);
//! * **fetch**: on `R` with `H`'s blocks credited as cached there, plus
//!   `block_cost` per block moved:
//!
//! ```text
//! fetch(R) = cost(R with device_blocks = H's) / speed(R) + block_cost × (H's − R's blocks)
//! block_cost = prefill_load_scale × transfer_us_per_block / prefill_us_per_block
//! ```
//!
//! `block_cost` is the transfer's time in the prefill term's units: a
//! block moved costs the share of a block's prefill that its transfer
//! takes. With the mock engine's 20 µs per block and its prefill of about
//! 243 µs per 16-token block, a moved block costs 1/12 of a computed one.
//! The cheapest fetch wins when it is below the chosen rank's cost divided
//! by `margin` and below recomputing on its receiver. Pure: the caller executes the hand-off, and falls
//! back to recomputing on `R` if it fails.

use super::candidates::Scored;
use super::cost::{Candidate, CostWeights};
use crate::index::WorkerRank;

/// Modelled microseconds of prefill per 16-token block on the reference
/// engine (`kvroute mocker`'s default timing: 15.18 µs per token).
pub const DEFAULT_PREFILL_US_PER_BLOCK: f64 = 243.0;

/// The mock engines' modelled transfer per block, in microseconds
/// (`kvroute mocker --transfer-us-per-block`'s default).
pub const DEFAULT_TRANSFER_US_PER_BLOCK: f64 = 20.0;

/// When a request fetches its prefix instead of waiting or recomputing.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct FetchConfig {
    /// Microseconds to move one block between two engines (measured, or the
    /// engines' `--transfer-us-per-block`).
    pub transfer_us_per_block: f64,
    /// Microseconds of prefill per block on the reference engine: what a
    /// block moved is priced against.
    pub prefill_us_per_block: f64,
    /// How much dearer the chosen rank must be than the fetch (1: any
    /// cheaper fetch is taken; above: only clearly cheaper ones).
    pub margin: f64,
    /// Fewest blocks worth a hand-off: below, the receiver recomputes them.
    pub min_blocks: u32,
}

impl Default for FetchConfig {
    /// The mock engines' transfer (20 µs per block) against their prefill,
    /// any cheaper fetch taken, from 4 blocks up.
    fn default() -> Self {
        FetchConfig {
            transfer_us_per_block: DEFAULT_TRANSFER_US_PER_BLOCK,
            prefill_us_per_block: DEFAULT_PREFILL_US_PER_BLOCK,
            margin: 1.0,
            min_blocks: 4,
        }
    }
}

impl FetchConfig {
    /// The cost of moving one block, in the cost's units under `w`.
    pub fn block_cost(&self, w: &CostWeights) -> f64 {
        let per = self.prefill_us_per_block.max(f64::MIN_POSITIVE);
        w.prefill_load_scale * self.transfer_us_per_block.max(0.0) / per
    }
}

/// Why a request's prefix moves.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum FetchReason {
    /// The holder was chosen, but its load costs more than moving the
    /// blocks to a cooler rank: fetched instead of waited for.
    HolderBusy,
    /// The policy left the holder to recompute elsewhere; fetching the
    /// blocks there is cheaper than recomputing them.
    CheaperThanRecompute,
}

impl FetchReason {
    /// The reason's name in `/query` and the decisions ring.
    pub fn as_str(self) -> &'static str {
        match self {
            FetchReason::HolderBusy => "fetch: holder busy",
            FetchReason::CheaperThanRecompute => "fetch: cheaper than recompute",
        }
    }
}

/// A decision to run a request on `receiver` with `blocks` leading blocks
/// moved from `source`.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Fetch {
    /// The receiver's position in the scored candidates.
    pub receiver: usize,
    /// The source's (the holder's) position in the scored candidates.
    pub source: usize,
    /// The source's key: where the hand-off's first leg goes.
    pub source_key: WorkerRank,
    /// The leading blocks the source holds (on device).
    pub source_blocks: u32,
    /// Blocks moved: the source's less the receiver's own.
    pub blocks: u32,
    /// The fetch's cost (receiver with the blocks, plus the transfer).
    pub cost: f64,
    /// The cost of the rank the policy chose (what the fetch beat).
    pub instead: f64,
    /// Why.
    pub reason: FetchReason,
}

/// The fetch to make for a request the policy placed on `scored[first]`,
/// if one is cheaper (see the module docs); `eligible` are the positions
/// it may go to. `None`: the policy's choice stands.
pub fn plan_fetch(
    scored: &[Scored],
    eligible: &[usize],
    first: usize,
    request_tokens: u64,
    (w, config): (&CostWeights, &FetchConfig),
) -> Option<Fetch> {
    let chosen = scored.get(first)?;
    // The holder: the most blocks on device, the cheapest of equals.
    let source = *eligible
        .iter()
        .filter(|&&i| i < scored.len())
        .min_by(|&&a, &&b| {
            let (x, y) = (&scored[a], &scored[b]);
            y.candidate
                .device_blocks
                .cmp(&x.candidate.device_blocks)
                .then(x.cost.total.total_cmp(&y.cost.total))
        })?;
    let holder = &scored[source];
    let held = holder.candidate.device_blocks;
    let block_cost = config.block_cost(w);
    let (receiver, blocks, cost) = eligible
        .iter()
        .filter(|&&i| i != source && i < scored.len() && !scored[i].overloaded)
        .filter(|&&i| scored[i].block_size == holder.block_size)
        .filter_map(|&i| {
            let s = &scored[i];
            let blocks = held.checked_sub(s.candidate.device_blocks)?;
            let cost = with_blocks(s, held, request_tokens, w) + block_cost * f64::from(blocks);
            // Recomputing there may be cheaper still (its own cache covers the prefill).
            (blocks >= config.min_blocks.max(1) && cost < s.cost.total).then_some((i, blocks, cost))
        })
        .min_by(|a, b| a.2.total_cmp(&b.2))?;
    let instead = chosen.cost.total;
    if cost * config.margin.max(1.0) >= instead {
        return None;
    }
    let reason = if first == source {
        FetchReason::HolderBusy
    } else {
        FetchReason::CheaperThanRecompute
    };
    Some(Fetch {
        receiver,
        source,
        source_key: holder.key,
        source_blocks: held,
        blocks,
        cost,
        instead,
        reason,
    })
}

/// `s`'s cost (divided by its speed) with `held` leading blocks on its device.
fn with_blocks(s: &Scored, held: u32, request_tokens: u64, w: &CostWeights) -> f64 {
    let c = &s.candidate;
    let moved = Candidate {
        device_blocks: c.device_blocks.max(held),
        host_blocks: c.host_blocks.max(held),
        any_blocks: c.any_blocks.max(held),
        ..*c
    };
    moved.cost(request_tokens, s.block_size, w).total / s.speed
}

#[cfg(test)]
mod tests;
