use super::*;
use crate::event::WorkerFlavor;
use crate::scheduler::{Candidate, CostBreakdown, CostWeights, RouteTarget, WorkerRole};

/// Worker `w`'s one rank at cost `total`, caching `cached` of a request's
/// `blocks` blocks (16 tokens each).
fn rank(w: usize, total: f64, cached: u32, blocks: u64) -> Scored {
    Scored {
        worker: w,
        key: WorkerRank::new(w as u32, 0),
        block_size: 16,
        flavor: WorkerFlavor::Vllm,
        speed: 1.0,
        candidate: Candidate {
            device_blocks: cached,
            request_blocks: blocks,
            ..Candidate::default()
        },
        cost: CostBreakdown {
            total,
            decode_blocks: total,
            ..CostBreakdown::default()
        },
        overloaded: false,
    }
}

fn busy(mut s: Scored) -> Scored {
    s.overloaded = true;
    s
}

fn placer(policy: Policy) -> Placer {
    Placer::new(PlacerConfig::new(policy))
}

fn tokens(n: usize) -> Vec<u32> {
    (0..n as u32).collect()
}

#[test]
fn a_new_prefix_is_dealt_and_a_held_one_stays_on_its_holder_within_the_margin() {
    let mut p = placer(Policy::Kv);
    let prompt = tokens(160);
    let req = PlaceRequest {
        tokens: Some(&prompt),
        ..PlaceRequest::default()
    };
    // Nobody holds it: dealt to the first of the equally dealt, not the cheapest.
    let cold = [rank(0, 5.0, 0, 10), rank(1, 1.0, 0, 10)];
    let first = p.order(&cold, &req);
    assert_eq!(first.order, [0, 1]);
    assert_eq!(first.dealt, Some(cold[0].key));
    p.record(&first, &cold[0], 160);
    assert_eq!(p.dealt_to(cold[0].key), Some(160));
    // The next new prefix goes to the rank dealt less.
    let second = p.order(&cold, &req);
    assert_eq!((second.order[0], second.dealt), (1, Some(cold[1].key)));
    // Held: rank 0 holds 8 of 10 blocks at 1.9 × the cheapest: it keeps it.
    let held = [rank(0, 1.9, 8, 10), rank(1, 1.0, 0, 10)];
    let kept = p.order(&held, &req);
    assert_eq!((kept.order.as_slice(), kept.dealt), (&[0, 1][..], None));
    // Over the margin, the cheapest takes it.
    let dear = [rank(0, 2.1, 8, 10), rank(1, 1.0, 0, 10)];
    assert_eq!(p.order(&dear, &req).order, [1, 0]);
}

#[test]
fn the_trees_choice_comes_first_then_the_rest_by_cost() {
    let mut p = placer(Policy::SglangCacheAware);
    let prompt = tokens(64);
    let req = PlaceRequest {
        tokens: Some(&prompt),
        ..PlaceRequest::default()
    };
    let fleet = [rank(0, 3.0, 0, 4), rank(1, 1.0, 0, 4), rank(2, 2.0, 0, 4)];
    // An empty tree: the smallest tenant, the first one.
    let first = p.order(&fleet, &req).order;
    assert_eq!(first, [0, 1, 2]);
    // The same prompt again: it matched where the tree put it.
    assert_eq!(p.order(&fleet, &req).order[0], 0);
    // A text prompt is keyed by its characters when it has no tokens.
    let text = || "héllo".chars().map(u32::from).collect();
    let by_text = PlaceRequest {
        text_symbols: Some(&text),
        ..PlaceRequest::default()
    };
    assert_eq!(p.order(&fleet, &by_text).order.len(), 3);
}

/// Worker `w`'s one rank priced as the cost prices a cold 160-token
/// request, plus `queue`.
fn priced(w: usize, queue: f64) -> Scored {
    let candidate = Candidate {
        request_blocks: 10,
        ..Candidate::default()
    };
    let mut cost = candidate.cost(160, 16, &CostWeights::default());
    cost.requests = queue;
    cost.total += queue;
    Scored {
        candidate,
        cost,
        ..rank(w, 0.0, 0, 10)
    }
}

#[test]
fn a_session_stays_while_its_history_pays_and_a_continuation_always() {
    let mut config = PlacerConfig::new(Policy::Kv);
    config.deal_new_prefixes = None;
    let mut p = Placer::new(config);
    // Rank 1 holds the session's history, unseen by the index, behind a queue.
    let fleet = [priced(0, 0.0), priced(1, 5.0)];
    let prompt = tokens(160);
    let session = SessionEntry::new(fleet[1].key, 160);
    let req = PlaceRequest {
        tokens: Some(&prompt),
        session: Some(session),
        ..PlaceRequest::default()
    };
    assert_eq!(p.order(&fleet, &PlaceRequest::default()).order, [0, 1]);
    let kept = p.order(&fleet, &req);
    assert_eq!((kept.order[0], kept.session), (1, Preference::Kept));
    // A queue dearer than the prefill its history saves: it moves.
    let busy = [priced(0, 0.0), priced(1, 1e6)];
    let moved = p.order(&busy, &req);
    assert_eq!((moved.order[0], moved.session), (0, Preference::Moved));
    let none = p.order(&fleet, &PlaceRequest::default());
    assert_eq!(none.session, Preference::None);
    // A continuation goes to its rank whatever it costs.
    let dear = [rank(0, 1.0, 0, 10), rank(1, 1e9, 0, 10)];
    let cont = PlaceRequest {
        continuation: Some(dear[1].key),
        ..PlaceRequest::default()
    };
    let continued = p.order(&dear, &cont);
    assert_eq!(
        (continued.order[0], continued.continuation),
        (1, Preference::Kept)
    );
    let gone = PlaceRequest {
        continuation: Some(WorkerRank::new(9, 0)),
        ..PlaceRequest::default()
    };
    assert_eq!(p.order(&dear, &gone).continuation, Preference::Moved);
}

#[test]
fn only_eligible_candidates_are_ordered_and_positions_stay_the_callers() {
    let mut p = placer(Policy::Kv);
    let fleet = [rank(0, 1.0, 0, 4), rank(1, 3.0, 0, 4), rank(2, 2.0, 0, 4)];
    let odd = |s: &Scored| s.worker != 1;
    let req = PlaceRequest {
        eligible: Some(&odd),
        ..PlaceRequest::default()
    };
    let ordered = p.order(&fleet, &req);
    assert_eq!(ordered.among, 2);
    assert!(!ordered.order.contains(&1));
    assert_eq!(ordered.order.len(), 2);
}

#[test]
fn every_rank_busy_waits_or_is_placed_with_the_thresholds_ignored() {
    let fleet = [busy(rank(0, 2.0, 0, 4)), busy(rank(1, 1.0, 0, 4))];
    let mut waits = placer(Policy::RoundRobin);
    let waited = waits.order(&fleet, &PlaceRequest::default());
    assert!(waited.order.is_empty());
    assert_eq!(waited.among, 2);
    let mut config = PlacerConfig::new(Policy::Kv);
    config.when_all_busy = WhenAllBusy::PlaceAnyway;
    config.deal_new_prefixes = None;
    let mut anyway = Placer::new(config);
    assert_eq!(anyway.order(&fleet, &PlaceRequest::default()).order, [1, 0]);
}

#[test]
fn placers_of_one_seed_decide_alike_and_each_decision_takes_a_turn() {
    let fleet: Vec<Scored> = (0..5).map(|w| rank(w, 1.0, 0, 4)).collect();
    let mut config = PlacerConfig::new(Policy::Random);
    config.seed = 42;
    let (mut a, mut b) = (Placer::new(config.clone()), Placer::new(config));
    let firsts: Vec<usize> = (0..32)
        .map(|_| a.order(&fleet, &PlaceRequest::default()).order[0])
        .collect();
    let again: Vec<usize> = (0..32)
        .map(|_| b.order(&fleet, &PlaceRequest::default()).order[0])
        .collect();
    assert_eq!(firsts, again);
    assert!(firsts.iter().any(|&f| f != firsts[0]), "{firsts:?}");
    let mut rr = placer(Policy::RoundRobin);
    let turns: Vec<usize> = (0..6)
        .map(|_| rr.order(&fleet, &PlaceRequest::default()).order[0])
        .collect();
    assert_eq!(turns, [0, 1, 2, 3, 4, 0]);
    assert_eq!(rr.draw().turn, 6);
}

#[test]
fn a_preview_changes_nothing() {
    let mut p = placer(Policy::Kv);
    let cold = [rank(0, 5.0, 0, 10), rank(1, 1.0, 0, 10)];
    assert_eq!(
        p.preview(&cold, 0.0),
        [0, 1],
        "dealt, as a request would be"
    );
    assert_eq!(p.dealt_to(cold[0].key), Some(0));
    let ordered = p.order(&cold, &PlaceRequest::default());
    assert_eq!(ordered.order[0], 0);
}

/// Two prefill workers and a decode worker, of `flavor`.
fn fleet(flavor: WorkerFlavor) -> Vec<RouteTarget> {
    let roles = [WorkerRole::Prefill, WorkerRole::Prefill, WorkerRole::Decode];
    roles
        .into_iter()
        .enumerate()
        .map(|(i, role)| RouteTarget {
            name: std::sync::Arc::from(format!("w{i}").as_str()),
            id: crate::index::WorkerId(i as u32),
            block_size: 16,
            ranks: vec![crate::index::DpRank(0)],
            flavor,
            speed: 1.0,
            role,
        })
        .collect()
}

#[test]
fn a_split_prefill_stays_on_its_holder_as_an_aggregated_request_does() {
    let mut p = placer(Policy::Kv);
    let fleet = fleet(WorkerFlavor::Vllm);
    // Prefill worker 0 holds 8 of 10 blocks at 1.5 × worker 1's cost.
    let scored = [
        rank(0, 1.5, 8, 10),
        rank(1, 1.0, 0, 10),
        rank(2, 1.0, 0, 10),
    ];
    let plan = p.plan_split(&scored, &fleet, Some(10_000)).expect("a plan");
    assert_eq!(plan.decode, 2);
    assert!(!plan.cost.local);
    assert_eq!(plan.prefill, [0, 1]);
    // Without the stickiness the cheapest prefill worker goes first.
    let mut config = PlacerConfig::new(Policy::Kv);
    config.stickiness = 0.0;
    let plan = Placer::new(config).plan_split(&scored, &fleet, Some(10_000));
    assert_eq!(plan.expect("a plan").prefill, [1, 0]);
}

#[test]
fn a_decode_rank_caching_most_of_the_prompt_prefills_it_itself() {
    let mut p = placer(Policy::Kv);
    let vllm = fleet(WorkerFlavor::Vllm);
    let scored = [
        rank(0, 1.0, 0, 10),
        rank(1, 1.0, 0, 10),
        rank(2, 1.0, 9, 10),
    ];
    let plan = p.plan_split(&scored, &vllm, Some(160)).expect("a plan");
    assert!(plan.cost.local && plan.prefill.is_empty());
    // SGLang decode engines never do; nor do the load-only policies.
    let sglang = fleet(WorkerFlavor::Sglang);
    let plan = p.plan_split(&scored, &sglang, Some(160)).expect("a plan");
    assert!(!plan.cost.local && plan.prefill.len() == 2);
    assert_eq!(plan.rule, LocalPrefillRule::NEVER);
    let plan = placer(Policy::RoundRobin).plan_split(&scored, &vllm, Some(160));
    assert!(!plan.expect("a plan").cost.local);
}

#[test]
fn an_sglang_decode_rank_without_a_free_prefill_worker_is_no_plan() {
    let mut scored = [
        busy(rank(0, 1.0, 0, 10)),
        busy(rank(1, 1.0, 0, 10)),
        rank(2, 1.0, 0, 10),
    ];
    scored[2].flavor = WorkerFlavor::Sglang;
    let sglang = fleet(WorkerFlavor::Sglang);
    assert_eq!(
        placer(Policy::Kv).plan_split(&scored, &sglang, Some(160)),
        None
    );
    let mut config = PlacerConfig::new(Policy::Kv);
    config.when_all_busy = WhenAllBusy::PlaceAnyway;
    let plan = Placer::new(config).plan_split(&scored, &sglang, Some(160));
    assert_eq!(plan.expect("placed anyway").prefill.len(), 2);
    // vLLM decode ranks prefill themselves when no prefill worker is free.
    scored[2].flavor = WorkerFlavor::Vllm;
    let vllm = fleet(WorkerFlavor::Vllm);
    let plan = placer(Policy::Kv).plan_split(&scored, &vllm, Some(160));
    assert!(plan.expect("a plan").prefill.is_empty());
}

/// Rank `i` priced for real: `cached` of 64 blocks on device, `active`
/// requests of 64 blocks decoding there.
fn loaded(i: usize, cached: u32, active: u64) -> Scored {
    let candidate = Candidate {
        device_blocks: cached,
        host_blocks: cached,
        any_blocks: cached,
        active_decode_blocks: active * 64,
        new_active_blocks: 64,
        active_requests: active,
        active_request_blocks: active * 64,
        request_blocks: 64,
        ..Candidate::default()
    };
    Scored {
        cost: candidate.cost(64 * 16, 16, &CostWeights::default()),
        candidate,
        ..rank(i, 0.0, cached, 64)
    }
}

fn fetching() -> Placer {
    Placer::new(PlacerConfig {
        fetch: Some(crate::scheduler::FetchConfig::default()),
        ..PlacerConfig::new(Policy::Kv)
    })
}

#[test]
fn under_kv_with_fetch_a_busy_holders_request_runs_cooler_with_its_blocks() {
    let prompt = tokens(64 * 16);
    let req = PlaceRequest {
        tokens: Some(&prompt),
        ..PlaceRequest::default()
    };
    // Rank 0 holds 60 blocks and decodes 6 requests, within the stickiness
    // margin of idle rank 1: the holder keeps it without the fetch...
    let scored = [loaded(0, 60, 6), loaded(1, 0, 0)];
    let held = placer(Policy::Kv).order(&scored, &req);
    assert_eq!((held.order[0], held.fetch), (0, None));
    // ...and with it, rank 1 runs it, fetching the 60 blocks from rank 0.
    let moved = fetching().order(&scored, &req);
    assert_eq!(moved.order, [1, 0]);
    let f = moved.fetch.expect("a fetch");
    assert_eq!((f.source, f.source_key, f.blocks), (0, scored[0].key, 60));
    // An idle holder keeps its request.
    let idle = [loaded(0, 60, 0), loaded(1, 0, 0)];
    assert_eq!(fetching().order(&idle, &req).fetch, None);
    // Other policies never fetch.
    let mut rr = Placer::new(PlacerConfig {
        fetch: Some(crate::scheduler::FetchConfig::default()),
        ..PlacerConfig::new(Policy::RoundRobin)
    });
    assert_eq!(rr.order(&scored, &req).fetch, None);
}

#[test]
fn a_session_kept_on_the_holder_cancels_the_fetch() {
    let prompt = tokens(64 * 16);
    let scored = [loaded(0, 60, 6), loaded(1, 0, 0)];
    let req = PlaceRequest {
        tokens: Some(&prompt),
        continuation: Some(scored[0].key),
        ..PlaceRequest::default()
    };
    let ordered = fetching().order(&scored, &req);
    assert_eq!((ordered.order[0], ordered.fetch), (0, None));
}

#[test]
fn a_hot_prefix_is_copied_ahead_of_demand_when_fetches_are_off() {
    let mut p = Placer::new(PlacerConfig {
        replicate: Some(crate::scheduler::ReplicaConfig {
            hot_for_ms: 100,
            budget_blocks: 256,
        }),
        ..PlacerConfig::new(Policy::Kv)
    });
    let prompt = tokens(64 * 16);
    let at = |now_ms| PlaceRequest {
        tokens: Some(&prompt),
        now_ms,
        ..PlaceRequest::default()
    };
    let scored = [loaded(0, 60, 6), loaded(1, 0, 0)];
    // The holder keeps its requests; it is saturated from the first.
    let first = p.order(&scored, &at(0));
    assert_eq!(
        (first.order[0], first.fetch, first.replicate),
        (0, None, None)
    );
    let later = p.order(&scored, &at(100));
    assert_eq!((later.order[0], later.fetch), (0, None));
    let copy = later.replicate.expect("a copy");
    assert_eq!((copy.source, copy.target, copy.blocks), (0, 1, 60));
}
