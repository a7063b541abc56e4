//! Dynamo's KV router, re-implemented from its rules as a baseline
//! (`--policy dynamo`).
//!
//! Follows `ai-dynamo/dynamo`: `lib/kv-router/src/scheduling/selector/default.rs`
//! (`DefaultWorkerScorer::worker_logit`, `pick_default_worker`) and
//! `lib/kv-router/src/sequences/` (its active-sequence accounting), as of
//! mid-2026, and the earlier `lib/llm/src/kv_router/scheduler.rs` /
//! `sequence.rs` whose documented formula it keeps:
//!
//! ```text
//! prefill_blocks = (active_prefill_tokens + ISL − overlap_blocks × block_size) / block_size
//! decode_blocks  = active_blocks + the request's blocks not active there
//! logit          = overlap_score_weight × prefill_blocks + decode_blocks
//! ```
//!
//! (the current code writes it `prefill_load_scale × max(0, (active + ISL)/bs
//! − credit × overlap) + decode_blocks`; with the defaults, scale 1 and
//! credit 1, and no host or disk tier, the two are the same number).
//!
//! * The lowest logit wins, ties broken at random, when `router_temperature`
//!   is 0 (the default); above 0 the worker is drawn with
//!   `p_i ∝ exp(−(c_i − c_min) / ((c_max − c_min) × T))` ([`super::super::pick`],
//!   which kvroute's own policy shares).
//! * **Active-sequence accounting** (Dynamo's `ActiveSequences`, the same
//!   rules as kvroute's [`ActiveSequences`]): a request is added when
//!   routed with its blocks' sequence hashes and `ISL − overlap × block_size`
//!   prefill tokens; its prefill tokens leave at its first token
//!   (`MarkPrefillCompleted`); its blocks at its end (`Free`). A block held
//!   by several requests counts once (`router_assume_kv_reuse`).
//! * Not modelled: busy thresholds and the router queue (both off by
//!   default), lower-tier credits (no host or disk tier here), the
//!   per-request overrides.
//!
//! What it leaves out against kvroute's cost: no credit for a prefix that a
//! request in flight is computing, no decode-read term, prefill and decode
//! blocks weigh the same.

use crate::hash::SequenceHash;

use super::super::active::ActiveSequences;
use super::super::candidates::Scored;

/// Dynamo's settings (its flags of the same names).
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct DynamoConfig {
    /// Weight of the prefill blocks against the decode blocks
    /// (`--router-kv-overlap-score-weight`, now `--router-prefill-load-scale`).
    pub overlap_score_weight: f64,
}

impl Default for DynamoConfig {
    fn default() -> Self {
        DynamoConfig {
            overlap_score_weight: 1.0,
        }
    }
}

/// What Dynamo's logit reads of one worker for one request.
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct DynamoInputs {
    /// The request's prompt tokens (ISL).
    pub isl_tokens: u64,
    /// Tokens per block.
    pub block_size: u32,
    /// Leading blocks of the request the worker caches (from KV events).
    pub overlap_blocks: u32,
    /// Prefill tokens of the requests in prefill there.
    pub active_prefill_tokens: u64,
    /// Distinct blocks of the requests active there.
    pub active_blocks: u64,
    /// The request's blocks not already active there.
    pub new_blocks: u64,
}

impl DynamoInputs {
    /// The inputs of a candidate kvroute scored: the same facts (index
    /// overlap on the device, the router's active-sequence state).
    pub fn of(s: &Scored) -> DynamoInputs {
        let c = &s.candidate;
        let bs = f64::from(s.block_size.max(1));
        // `cost.prefill_blocks` is `(active_prefill_tokens + ISL) / block_size`.
        let total = (s.cost.prefill_blocks * bs).round().max(0.0) as u64;
        DynamoInputs {
            isl_tokens: total.saturating_sub(c.active_prefill_tokens),
            block_size: s.block_size,
            overlap_blocks: c.device_blocks,
            active_prefill_tokens: c.active_prefill_tokens,
            active_blocks: c.active_decode_blocks,
            new_blocks: c.new_active_blocks,
        }
    }

    /// The inputs from a worker's active sequences (`None`: idle) for a
    /// request of `isl_tokens` tokens with blocks `seqs`, of which the
    /// worker caches the first `overlap_blocks`.
    pub fn from_active(
        active: Option<&ActiveSequences>,
        seqs: &[SequenceHash],
        (isl_tokens, block_size, overlap_blocks): (u64, u32, u32),
    ) -> DynamoInputs {
        DynamoInputs {
            isl_tokens,
            block_size,
            overlap_blocks,
            active_prefill_tokens: active.map_or(0, ActiveSequences::active_prefill_tokens),
            active_blocks: active.map_or(0, ActiveSequences::active_blocks),
            new_blocks: active.map_or(seqs.len() as u64, |a| a.new_blocks(seqs)),
        }
    }

    /// The prompt tokens the worker would compute: what Dynamo charges to
    /// its prefill load when the request is routed there.
    pub fn new_tokens(&self) -> u64 {
        self.isl_tokens
            .saturating_sub(u64::from(self.overlap_blocks) * u64::from(self.block_size))
    }
}

/// Dynamo's logit (lower is better) for one worker.
pub fn logit(config: &DynamoConfig, i: &DynamoInputs) -> f64 {
    let bs = f64::from(i.block_size.max(1));
    let prefill_blocks = (i.active_prefill_tokens + i.new_tokens()) as f64 / bs;
    let decode_blocks = (i.active_blocks + i.new_blocks) as f64;
    config.overlap_score_weight * prefill_blocks + decode_blocks
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::scheduler::pick;

    fn inputs(overlap: u32, prefill: u64, active: u64, new: u64) -> DynamoInputs {
        DynamoInputs {
            isl_tokens: 128,
            block_size: 16,
            overlap_blocks: overlap,
            active_prefill_tokens: prefill,
            active_blocks: active,
            new_blocks: new,
        }
    }

    #[test]
    fn the_logit_is_weighted_prefill_blocks_plus_decode_blocks() {
        let c = DynamoConfig::default();
        // 128 tokens, 6 of 8 blocks cached, 32 tokens in prefill, 10 active, 2 new.
        let i = inputs(6, 32, 10, 2);
        assert_eq!(i.new_tokens(), 32);
        assert_eq!(logit(&c, &i), (32.0 + 32.0) / 16.0 + 12.0);
        let heavy = DynamoConfig {
            overlap_score_weight: 3.0,
        };
        assert_eq!(logit(&heavy, &i), 3.0 * 4.0 + 12.0);
        // A cold idle worker: 8 blocks to prefill, 8 to hold.
        assert_eq!(logit(&c, &inputs(0, 0, 0, 8)), 16.0);
    }

    #[test]
    fn temperature_zero_takes_the_lowest_logit_with_random_ties() {
        let c = DynamoConfig::default();
        let logits: Vec<f64> = [inputs(0, 0, 0, 8), inputs(8, 0, 20, 0), inputs(0, 0, 0, 8)]
            .iter()
            .map(|i| logit(&c, i))
            .collect();
        assert_eq!(logits, [16.0, 20.0, 16.0]);
        assert_eq!(pick(&logits, 0.0, 0.2), Some(0));
        assert_eq!(pick(&logits, 0.0, 0.8), Some(2));
        // Above 0 the dearer worker is drawn too, less often.
        let drawn: Vec<usize> = (0..100)
            .filter_map(|k| pick(&logits, 1.0, f64::from(k) / 100.0))
            .collect();
        let dear = drawn.iter().filter(|&&w| w == 1).count();
        assert!(dear > 0 && dear < 34, "{dear}");
    }

    #[test]
    fn the_active_accounting_follows_add_first_token_and_free() {
        let (a, b, c, d) = (
            SequenceHash(1),
            SequenceHash(2),
            SequenceHash(3),
            SequenceHash(4),
        );
        let mut w = ActiveSequences::new();
        // Request 1: 4 blocks, 1 cached: 48 tokens to prefill.
        let r1 = DynamoInputs::from_active(Some(&w), &[a, b, c, d], (64, 16, 1));
        assert_eq!((r1.new_blocks, r1.new_tokens()), (4, 48));
        w.add(1, &[a, b, c, d], r1.new_tokens(), 0);
        // Request 2 shares 2 blocks: they count once.
        let r2 = DynamoInputs::from_active(Some(&w), &[a, b], (32, 16, 2));
        assert_eq!((r2.active_blocks, r2.new_blocks), (4, 0));
        assert_eq!(r2.active_prefill_tokens, 48);
        assert_eq!(logit(&DynamoConfig::default(), &r2), 48.0 / 16.0 + 4.0);
        w.add(2, &[a, b], r2.new_tokens(), 0);
        // First token of request 1: its prefill leaves, its blocks stay.
        w.prefill_done(1);
        assert_eq!((w.active_prefill_tokens(), w.active_blocks()), (0, 4));
        // End of request 1: the blocks only it held leave.
        w.free(1);
        assert_eq!(w.active_blocks(), 2);
        w.free(2);
        assert_eq!((w.active_blocks(), w.active_requests()), (0, 0));
        let idle = DynamoInputs::from_active(None, &[a, b, c], (48, 16, 0));
        assert_eq!((idle.active_blocks, idle.new_blocks), (0, 3));
    }
}
