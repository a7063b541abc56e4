//! The cost of sending a request to one (worker, rank), in blocks of work.
//!
//! ```text
//! prefill = w.prefill_load_scale × max(0, (active_prefill_tokens + request_tokens) / block_size
//!                                          − overlap_credit)
//! overlap_credit = w.overlap_credit × device_blocks
//!                + w.host_weight × host_only_blocks + w.disk_weight × disk_only_blocks
//!                + w.active_prefix_weight × in_flight_only_blocks
//! cost = prefill + decode_blocks + w.active_request_weight × active_requests
//!      + w.request_kv_weight × active_request_blocks
//!      + w.request_size_weight × request_blocks
//! ```
//!
//! That is the work the request would take there, in blocks; a worker
//! declared `speed` times as fast as the fleet's reference engine costs the
//! work divided by its speed ([`Scored::rank`](super::Scored::rank)), the
//! time it would take. The last term is the same on every rank for one
//! request, so it moves nothing between ranks of one speed; between ranks of
//! different speeds it is the request's own share of the time: the blocks it
//! holds and reads at every step, for 1/speed as long on a slower rank.
//!
//! `w` are the [`CostWeights`]. `decode_blocks` is what the worker would hold active with this request:
//! its current active blocks plus this request's blocks it does not already
//! have active (blocks shared by requests count once). `in_flight_only_blocks`
//! are leading blocks that a request active there holds but the index does not
//! show yet (the engine has not announced them). `active_request_blocks`
//! counts the blocks of the requests active there once per request: what
//! each decode step reads, so what makes it slow (`decode_blocks` counts
//! shared blocks once: what the requests hold). The defaults
//! ([`CostWeights::default`]) are kvroute's, tuned on a mock fleet: prefill
//! weighs 12, a cached block credits 2, a block in flight 2, a block a decode
//! step reads ¼, a block of the request itself 6. Dynamo's KV
//! router weighs prefill 1, credits a cached block 1 and ignores blocks in
//! flight and the request's size ([`CostWeights::DYNAMO`]), which the
//! example below uses.
//!
//! ```
//! use kvroute_core::scheduler::{Candidate, CostWeights};
//! // 64-token request (4 blocks of 16), 3 blocks cached on device, idle worker.
//! let c = Candidate { device_blocks: 3, host_blocks: 3, any_blocks: 3, new_active_blocks: 4, ..Candidate::default() };
//! let cost = c.cost(64, 16, &CostWeights::DYNAMO);
//! assert_eq!(cost.prefill, 1.0); // 64/16 − 3
//! assert_eq!(cost.decode_blocks, 4.0);
//! assert_eq!(cost.total, 5.0);
//! ```

/// The weights of the cost function (all flags of `kvroute serve`).
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct CostWeights {
    /// Multiplies the prefill term.
    pub prefill_load_scale: f64,
    /// Credit per cached device block.
    pub overlap_credit: f64,
    /// Credit per block found only in host memory.
    pub host_weight: f64,
    /// Credit per block found only on disk or an external pool.
    pub disk_weight: f64,
    /// Cost per request already running on the worker.
    pub active_request_weight: f64,
    /// Credit per leading block held by an active request there (beyond the
    /// device blocks the index knows): 0 ignores prefixes in flight.
    pub active_prefix_weight: f64,
    /// Cost per block the rank's decode steps read for the requests active
    /// there (counted once per request): the decode-load term.
    pub request_kv_weight: f64,
    /// Cost per block of the request itself. Equal on ranks of one speed, it
    /// steers only between ranks of different speeds (declared or learned):
    /// how strongly a faster rank is preferred to a slower one that caches
    /// more of the request.
    pub request_size_weight: f64,
}

impl CostWeights {
    /// Dynamo's KV router defaults: prefill and decode blocks weigh the same,
    /// a cached block saves one block of prefill, and prefixes in flight are
    /// not credited.
    pub const DYNAMO: CostWeights = CostWeights {
        prefill_load_scale: 1.0,
        overlap_credit: 1.0,
        host_weight: 0.75,
        disk_weight: 0.25,
        active_request_weight: 0.0,
        active_prefix_weight: 0.0,
        request_kv_weight: 0.0,
        request_size_weight: 0.0,
    };
}

/// kvroute's defaults, tuned with `kvroute bench sim` on a 4-engine mock
/// fleet (docs/serving.md, "Choosing the weights"): prefill weighs 12× a
/// decode block, a cached block saves 2 blocks of prefill, a prefix that an
/// active request holds counts as cached (2: vLLM caches the blocks a step
/// computes as it schedules them, so a request that follows shares them),
/// each block a decode step would read costs ¼, and each block of the
/// request 6. On the `long` and `short` presets this keeps every prefix where
/// it is cached (hit 0.938 and 0.859 against ceilings of 0.9387 and 0.8604);
/// on fleets of unequal engines the size term moves prefixes off a slow
/// engine when their requests would finish sooner elsewhere.
impl Default for CostWeights {
    fn default() -> Self {
        CostWeights {
            prefill_load_scale: 12.0,
            overlap_credit: 2.0,
            host_weight: 0.75,
            disk_weight: 0.25,
            active_request_weight: 0.0,
            active_prefix_weight: 2.0,
            request_kv_weight: 0.25,
            request_size_weight: 6.0,
        }
    }
}

/// What the scheduler knows about one candidate for one request.
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct Candidate {
    /// Leading blocks of the request cached on the device.
    pub device_blocks: u32,
    /// Leading blocks cached on device or host (≥ `device_blocks`).
    pub host_blocks: u32,
    /// Leading blocks cached on any tier (≥ `host_blocks`).
    pub any_blocks: u32,
    /// Leading blocks held by requests active there: in the cache by the
    /// time this request runs, though the engine may not have said so yet.
    pub active_prefix_blocks: u32,
    /// Prompt tokens of requests still in prefill there.
    pub active_prefill_tokens: u64,
    /// Distinct blocks of the requests active there.
    pub active_decode_blocks: u64,
    /// Of this request's blocks, those not already active there.
    pub new_active_blocks: u64,
    /// Requests active there.
    pub active_requests: u64,
    /// Blocks of the requests active there, counted once per request.
    pub active_request_blocks: u64,
    /// The request's own blocks.
    pub request_blocks: u64,
}

/// A cost and its parts, for `/query` and logs.
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct CostBreakdown {
    /// `(active_prefill_tokens + request_tokens) / block_size`.
    pub prefill_blocks: f64,
    /// Blocks of prefill the caches save.
    pub overlap_credit: f64,
    /// `prefill_load_scale × max(0, prefill_blocks − overlap_credit)`.
    pub prefill: f64,
    /// Blocks active on the worker with this request.
    pub decode_blocks: f64,
    /// `active_request_weight × active_requests`.
    pub requests: f64,
    /// `request_kv_weight × active_request_blocks`.
    pub decode_load: f64,
    /// `request_size_weight × request_blocks`.
    pub size: f64,
    /// The sum.
    pub total: f64,
}

impl Candidate {
    /// The cost of a `request_tokens`-token request.
    pub fn cost(&self, request_tokens: u64, block_size: u32, w: &CostWeights) -> CostBreakdown {
        let bs = f64::from(block_size.max(1));
        let prefill_blocks = (self.active_prefill_tokens + request_tokens) as f64 / bs;
        let host_only = self.host_blocks.saturating_sub(self.device_blocks);
        let lower_only = self.any_blocks.saturating_sub(self.host_blocks);
        let in_flight_only = self.active_prefix_blocks.saturating_sub(self.device_blocks);
        let overlap_credit = w.overlap_credit * f64::from(self.device_blocks)
            + w.host_weight * f64::from(host_only)
            + w.disk_weight * f64::from(lower_only)
            + w.active_prefix_weight * f64::from(in_flight_only);
        let prefill = w.prefill_load_scale * (prefill_blocks - overlap_credit).max(0.0);
        let decode_blocks = (self.active_decode_blocks + self.new_active_blocks) as f64;
        let requests = w.active_request_weight * self.active_requests as f64;
        let decode_load = w.request_kv_weight * self.active_request_blocks as f64;
        let size = w.request_size_weight * self.request_blocks as f64;
        CostBreakdown {
            prefill_blocks,
            overlap_credit,
            prefill,
            decode_blocks,
            requests,
            decode_load,
            size,
            total: prefill + decode_blocks + requests + decode_load + size,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn cached_blocks_lower_the_prefill_cost_by_tier_weight() {
        let w = CostWeights::DYNAMO;
        let cold = Candidate {
            new_active_blocks: 8,
            ..Candidate::default()
        };
        let device = Candidate {
            device_blocks: 8,
            host_blocks: 8,
            any_blocks: 8,
            new_active_blocks: 8,
            ..cold
        };
        let host = Candidate {
            host_blocks: 8,
            any_blocks: 8,
            ..cold
        };
        let disk = Candidate {
            any_blocks: 8,
            ..cold
        };
        let costs: Vec<f64> = [cold, device, host, disk]
            .iter()
            .map(|c| c.cost(128, 16, &w).total)
            .collect();
        assert_eq!(costs, [16.0, 8.0, 10.0, 14.0]);
    }

    #[test]
    fn load_raises_the_cost() {
        let w = CostWeights {
            active_request_weight: 0.5,
            ..CostWeights::DYNAMO
        };
        let busy = Candidate {
            active_prefill_tokens: 320,
            active_decode_blocks: 40,
            active_requests: 4,
            ..Candidate::default()
        };
        let c = busy.cost(64, 16, &w);
        assert_eq!(
            (c.prefill, c.decode_blocks, c.requests, c.total),
            (24.0, 40.0, 2.0, 66.0)
        );
    }

    #[test]
    fn a_prefix_in_flight_counts_as_cached_beyond_the_indexed_blocks() {
        let w = CostWeights {
            prefill_load_scale: 4.0,
            overlap_credit: 2.0,
            active_prefix_weight: 1.0,
            ..CostWeights::DYNAMO
        };
        let idle = Candidate {
            new_active_blocks: 10,
            ..Candidate::default()
        };
        // The same prefix is being prefilled there: 8 of the 10 blocks are
        // active, 2 of them already announced by the engine.
        let computing = Candidate {
            device_blocks: 2,
            host_blocks: 2,
            any_blocks: 2,
            active_prefix_blocks: 8,
            active_prefill_tokens: 96,
            active_decode_blocks: 8,
            new_active_blocks: 2,
            active_requests: 1,
            ..Candidate::default()
        };
        let c = computing.cost(160, 16, &w);
        assert_eq!(c.overlap_credit, 2.0 * 2.0 + 6.0);
        assert_eq!(c.total, 4.0 * (16.0 - 10.0) + 10.0);
        assert!(c.total < idle.cost(160, 16, &w).total);
        let ignored = computing.cost(160, 16, &CostWeights::DYNAMO);
        assert_eq!(ignored.decode_load, 0.0);
        assert_eq!(ignored.overlap_credit, 2.0);
        assert!(ignored.total > idle.cost(160, 16, &CostWeights::DYNAMO).total);
    }

    #[test]
    fn the_decode_load_counts_a_shared_prefix_once_per_request() {
        let w = CostWeights {
            request_kv_weight: 0.5,
            request_size_weight: 0.5,
            ..CostWeights::DYNAMO
        };
        // Three requests of 10 blocks sharing 8: 14 blocks held, 30 read per step.
        let shared = Candidate {
            active_decode_blocks: 14,
            active_request_blocks: 30,
            request_blocks: 10,
            new_active_blocks: 10,
            active_requests: 3,
            ..Candidate::default()
        };
        let c = shared.cost(160, 16, &w);
        assert_eq!((c.decode_blocks, c.decode_load, c.size), (24.0, 15.0, 5.0));
        assert_eq!(c.total, 10.0 + 24.0 + 15.0 + 5.0);
    }
}
