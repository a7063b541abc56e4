use super::*;
use crate::event::WorkerFlavor;

/// Worker `w`'s rank for a `blocks`-block request (16 tokens each), with
/// `cached` leading blocks on device, `active` requests of `blocks` blocks
/// decoding there, priced with `w`.
fn rank(i: usize, cached: u32, active: u64, blocks: u64, w: &CostWeights) -> Scored {
    let candidate = Candidate {
        device_blocks: cached,
        host_blocks: cached,
        any_blocks: cached,
        active_decode_blocks: active * blocks,
        new_active_blocks: blocks,
        active_requests: active,
        active_request_blocks: active * blocks,
        request_blocks: blocks,
        ..Candidate::default()
    };
    Scored {
        worker: i,
        key: WorkerRank::new(i as u32, 0),
        block_size: 16,
        flavor: WorkerFlavor::Vllm,
        speed: 1.0,
        cost: candidate.cost(blocks * 16, 16, w),
        candidate,
        overloaded: false,
    }
}

fn plan(scored: &[Scored], first: usize, config: &FetchConfig) -> Option<Fetch> {
    let w = CostWeights::default();
    let all: Vec<usize> = (0..scored.len()).collect();
    let tokens = scored
        .first()
        .map_or(0, |s| s.candidate.request_blocks * 16);
    plan_fetch(scored, &all, first, tokens, (&w, config))
}

#[test]
fn the_default_block_cost_is_the_transfer_share_of_a_prefill_block() {
    let w = CostWeights::default();
    let c = FetchConfig::default();
    assert!((c.block_cost(&w) - 12.0 * 20.0 / 243.0).abs() < 1e-12);
    let free = FetchConfig {
        transfer_us_per_block: -5.0,
        ..c
    };
    assert_eq!(free.block_cost(&w), 0.0);
}

#[test]
fn a_busy_holder_sends_the_request_to_a_cool_rank_with_its_blocks() {
    let w = CostWeights::default();
    // Rank 0 holds 60 of 64 blocks and decodes 20 such requests; rank 1 is idle.
    let scored = [rank(0, 60, 20, 64, &w), rank(1, 0, 0, 64, &w)];
    let f = plan(&scored, 0, &FetchConfig::default()).expect("a fetch");
    assert_eq!((f.receiver, f.source, f.blocks), (1, 0, 60));
    assert_eq!(f.reason, FetchReason::HolderBusy);
    assert!(f.cost < f.instead);
    assert!(
        f.cost < scored[1].cost.total,
        "cheaper than recomputing there"
    );
    assert_eq!(f.reason.as_str(), "fetch: holder busy");
}

#[test]
fn an_idle_holder_keeps_its_request() {
    let w = CostWeights::default();
    let scored = [rank(0, 60, 0, 64, &w), rank(1, 0, 0, 64, &w)];
    assert_eq!(plan(&scored, 0, &FetchConfig::default()), None);
    // And equally loaded ranks: moving the blocks only adds the transfer.
    let scored = [rank(0, 60, 5, 64, &w), rank(1, 0, 5, 64, &w)];
    assert_eq!(plan(&scored, 0, &FetchConfig::default()), None);
}

#[test]
fn a_dear_transfer_or_a_wide_margin_keeps_the_holder() {
    let w = CostWeights::default();
    let scored = [rank(0, 60, 20, 64, &w), rank(1, 0, 0, 64, &w)];
    let dear = FetchConfig {
        transfer_us_per_block: 100_000.0,
        ..FetchConfig::default()
    };
    assert_eq!(plan(&scored, 0, &dear), None);
    let f = plan(&scored, 0, &FetchConfig::default()).expect("a fetch");
    let wide = FetchConfig {
        margin: f.instead / f.cost + 0.01,
        ..FetchConfig::default()
    };
    assert_eq!(plan(&scored, 0, &wide), None);
}

#[test]
fn the_cheapest_receiver_wins_and_busy_or_short_ones_are_skipped() {
    let w = CostWeights::default();
    let mut scored = vec![
        rank(0, 60, 20, 64, &w),
        rank(1, 0, 4, 64, &w),
        rank(2, 0, 1, 64, &w),
        rank(3, 58, 30, 64, &w),
    ];
    // Rank 3 lacks only 2 blocks: below the fewest worth a hand-off.
    scored[2].overloaded = true;
    let f = plan(&scored, 0, &FetchConfig::default()).expect("a fetch");
    assert_eq!(f.receiver, 1);
    let config = FetchConfig {
        min_blocks: 61,
        ..FetchConfig::default()
    };
    assert_eq!(plan(&scored, 0, &config), None, "too few blocks to move");
}

#[test]
fn a_recompute_elsewhere_becomes_a_fetch() {
    let w = CostWeights::default();
    let scored = [rank(0, 60, 40, 64, &w), rank(1, 0, 0, 64, &w)];
    // The policy chose rank 1 to recompute; fetching is cheaper there.
    let f = plan(&scored, 1, &FetchConfig::default()).expect("a fetch");
    assert_eq!(
        (f.receiver, f.reason),
        (1, FetchReason::CheaperThanRecompute)
    );
}

#[test]
fn nothing_held_nothing_fetched() {
    let w = CostWeights::default();
    let scored = [rank(0, 0, 20, 64, &w), rank(1, 0, 0, 64, &w)];
    assert_eq!(plan(&scored, 0, &FetchConfig::default()), None);
    assert_eq!(plan(&[], 0, &FetchConfig::default()), None);
}

#[test]
fn a_fetch_never_costs_more_than_staying_or_recomputing() {
    // Property over a grid of loads and holdings: whatever is planned beats
    // the chosen rank by the margin and the receiver's own recompute.
    let w = CostWeights::default();
    let config = FetchConfig::default();
    for held in [0u32, 8, 32, 63] {
        for load0 in [0u64, 3, 12, 40] {
            for load1 in [0u64, 3, 12, 40] {
                for cached1 in [0u32, 4, 30, 40] {
                    let scored = [
                        rank(0, held, load0, 64, &w),
                        rank(1, cached1, load1, 64, &w),
                    ];
                    for first in 0..2 {
                        let Some(f) = plan(&scored, first, &config) else {
                            continue;
                        };
                        assert!(f.cost * config.margin < scored[first].cost.total);
                        assert!(f.cost <= scored[f.receiver].cost.total);
                        assert!(
                            scored[f.source].candidate.device_blocks
                                > scored[f.receiver].candidate.device_blocks
                        );
                    }
                }
            }
        }
    }
}
