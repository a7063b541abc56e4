use kvroute_core::scheduler::Policy;
use kvroute_mocker::MockerConfig;

use super::*;
use crate::mooncake::{synthesize, SynthesisConfig};
use crate::preset::Preset;
use crate::workload::WorkloadKind;
use kvroute_core::scheduler::policy::DealBy;

fn config(policy: Contender, gpu_blocks: usize) -> SimConfig {
    let mocker = MockerConfig {
        num_gpu_blocks: gpu_blocks,
        ..MockerConfig::default()
    };
    SimConfig {
        engines: 4,
        engine: mocker.engine_config(),
        engine_speeds: Vec::new(),
        worker_speeds: Vec::new(),
        learn_speeds: None,
        policy,
        pins: None,
        delays: Delays::default(),
        seed: 1,
        layout: None,
        transfer_us_per_block: DEFAULT_TRANSFER_US_PER_BLOCK,
        fetch_legs: false,
    }
}

fn kv(policy: Policy) -> Contender {
    Contender::Router(Routing::new(policy))
}

fn preset_load(preset: Preset, requests: usize) -> SimLoad {
    SimLoad {
        workload: preset.workload(1),
        arrival: Arrival::Closed {
            concurrency: preset.concurrency(),
        },
        requests,
    }
}

#[test]
fn every_request_finishes_and_the_index_predicts_what_the_engines_report() {
    let load = preset_load(Preset::Short, 300);
    let r = simulate(&config(kv(Policy::Kv), 256), &load).expect("runs");
    assert_eq!((r.report.requests, r.report.failed), (300, 0));
    assert_eq!(r.per_engine.iter().sum::<u64>(), 300);
    assert_eq!(r.skipped_events, 0);
    let accuracy = r.report.index_accuracy.expect("compared");
    assert!(accuracy > 0.9, "accuracy {accuracy}");
    // A 288-token prompt: a hit prefills 32 tokens in one 17 ms step.
    assert!(r.report.ttft_ms.p50 > 16.0, "{:?}", r.report.ttft_ms);
    assert!(r.report.latency_ms.p50 > r.report.ttft_ms.p50);
    let again = simulate(&config(kv(Policy::Kv), 256), &load).expect("runs");
    assert_eq!(again, r, "the same run twice gives the same figures");
}

#[test]
fn the_cache_aware_policies_beat_round_robin_on_a_fleet_that_cannot_hold_every_prefix() {
    let load = preset_load(Preset::Short, 400);
    let hit = |policy| {
        simulate(&config(policy, 256), &load)
            .expect("runs")
            .report
            .hit_rate
    };
    let (kv, oracle, rr) = (
        hit(kv(Policy::Kv)),
        hit(Contender::Oracle),
        hit(kv(Policy::RoundRobin)),
    );
    assert!(kv > rr + 0.2, "kv {kv} round-robin {rr}");
    assert!(oracle > rr + 0.2, "oracle {oracle} round-robin {rr}");
}

#[test]
fn a_trace_replays_at_its_own_times() {
    let trace = synthesize(&SynthesisConfig {
        requests: 200,
        ..SynthesisConfig::default()
    });
    let last_ms = trace.requests.last().map_or(0, |r| r.timestamp);
    let load = SimLoad {
        workload: WorkloadSpec {
            kind: WorkloadKind::Trace,
            trace: Some(trace),
            ..WorkloadSpec::default()
        },
        arrival: Arrival::Trace,
        requests: 0,
    };
    let r = simulate(&config(kv(Policy::Kv), 16_384), &load).expect("runs");
    assert_eq!((r.report.requests, r.report.failed), (200, 0));
    assert!(r.report.duration_s * 1e3 >= last_ms as f64);
    assert!(r.report.hit_rate > 0.3, "hit {}", r.report.hit_rate);
}

#[test]
fn what_cannot_be_simulated_is_refused() {
    let mut load = preset_load(Preset::Short, 10);
    load.workload.text = true;
    assert!(simulate(&config(kv(Policy::Kv), 256), &load).is_err());
    let images = SimLoad {
        workload: WorkloadSpec {
            kind: WorkloadKind::Images,
            ..WorkloadSpec::default()
        },
        ..preset_load(Preset::Short, 10)
    };
    let e = simulate(&config(kv(Policy::Kv), 256), &images).expect_err("chat prompts");
    assert!(e.to_string().contains("token-id"), "{e}");
    let no_trace = SimLoad {
        arrival: Arrival::Trace,
        ..preset_load(Preset::Short, 10)
    };
    assert!(simulate(&config(kv(Policy::Kv), 256), &no_trace).is_err());
}

#[test]
fn conversations_wait_for_their_previous_turn_and_poisson_arrivals_keep_their_rate() {
    // 16 clients, 4 conversations: at most 4 requests can be in flight, and
    // each turn resends the previous one, so turns after the first hit.
    let turns = SimLoad {
        workload: WorkloadSpec {
            kind: WorkloadKind::MultiTurn,
            groups: 4,
            scale: 0.1,
            max_tokens: 8,
            ..WorkloadSpec::default()
        },
        arrival: Arrival::Closed { concurrency: 16 },
        requests: 64,
    };
    let r = simulate(&config(kv(Policy::Kv), 16_384), &turns).expect("runs");
    assert_eq!((r.report.requests, r.report.failed), (64, 0));
    assert!(r.report.hit_rate > 0.5, "hit {}", r.report.hit_rate);
    let poisson = SimLoad {
        workload: WorkloadSpec {
            kind: WorkloadKind::Random,
            scale: 0.01,
            max_tokens: 4,
            ..WorkloadSpec::default()
        },
        arrival: Arrival::Poisson { rate: 50.0 },
        requests: 500,
    };
    let r = simulate(&config(kv(Policy::RoundRobin), 16_384), &poisson).expect("runs");
    assert_eq!(r.report.requests, 500);
    // 500 arrivals at 50/s take about 10 s.
    assert!(
        (8.0..12.5).contains(&r.report.duration_s),
        "{}",
        r.report.duration_s
    );
    assert_eq!(r.per_engine, vec![125; 4]);
}

/// The hit rate a run of `requests` of `preset` (seed 1) reaches when each
/// group's first request misses and every other hits its whole prefix.
fn ceiling(preset: Preset, requests: usize) -> f64 {
    let workload = crate::workload::Workload::new(&preset.workload(1));
    let (mut groups, mut prompt, mut cacheable) = (std::collections::HashSet::new(), 0, 0);
    for _ in 0..requests {
        let planned = workload.try_next().expect("a request");
        let ids = planned.body["prompt"]
            .as_array()
            .expect("token ids")
            .clone();
        let first_block: Vec<_> = ids.iter().take(16).cloned().collect();
        prompt += ids.len();
        if !groups.insert(format!("{first_block:?}")) {
            cacheable += preset.workload(1).shared_prefix_tokens();
        }
    }
    cacheable as f64 / prompt as f64
}

#[test]
fn pinned_groups_stay_on_their_engine_and_compute_each_prefix_once() {
    let load = preset_load(Preset::Long, 300);
    let pinned = |pins: Vec<usize>| SimConfig {
        pins: Some(pins),
        ..config(kv(Policy::Kv), 2_048)
    };
    let all_on_one = simulate(&pinned(vec![2]), &load).expect("runs");
    assert_eq!(all_on_one.per_engine, vec![0, 0, 300, 0]);
    let dealt = simulate(&pinned(vec![0, 1, 2, 3]), &load).expect("runs");
    assert_eq!(dealt.report.failed, 0);
    let top = ceiling(Preset::Long, 300);
    assert!(
        (top - 0.005..=top + 1e-9).contains(&dealt.report.hit_rate),
        "hit {} ceiling {top}",
        dealt.report.hit_rate
    );
    // One engine serving everything queues what four would run at once.
    assert!(all_on_one.report.latency_ms.p99 > 2.0 * dealt.report.latency_ms.p99);
}

#[test]
fn the_placement_search_keeps_its_best_and_counts_its_runs() {
    use super::bound::{search_pins, PinSearch, Targets};
    let load = preset_load(Preset::Short, 200);
    let base = config(kv(Policy::Kv), 256);
    let least = simulate(&config(kv(Policy::LeastLoaded), 256), &load).expect("runs");
    let rr = simulate(&config(kv(Policy::RoundRobin), 256), &load).expect("runs");
    let targets = Targets::better_of([&least, &rr]);
    let (l, r) = (&least.report, &rr.report);
    assert_eq!(targets.ttft_p99_ms, l.ttft_ms.p99.min(r.ttft_ms.p99));
    assert_eq!(
        targets.latency_p99_ms,
        l.latency_ms.p99.min(r.latency_ms.p99)
    );
    assert!(targets.ratio(&least) >= 1.0 && targets.ratio(&rr) >= 1.0);
    let search = PinSearch {
        groups: 32,
        evaluations: 7,
        min_hit: None,
        seed: 3,
        temperature: 0.05,
    };
    let bound = search_pins(&base, &load, &targets, &search).expect("runs");
    assert_eq!(bound.evaluations, 7);
    assert!(bound.ratio <= bound.start_ratio);
    assert_eq!(bound.pins.len(), 32);
    let again = simulate(
        &SimConfig {
            pins: Some(bound.pins.clone()),
            ..base.clone()
        },
        &load,
    )
    .expect("runs");
    assert_eq!(again, bound.report, "the best placement's run is its own");
    assert!((targets.ratio(&again) - bound.ratio).abs() < 1e-12);
    // A hit-rate floor no placement reaches leaves nothing to keep.
    let unreachable = PinSearch {
        min_hit: Some(1.0),
        ..search
    };
    let none = search_pins(&base, &load, &targets, &unreachable).expect("runs");
    assert!(none.ratio.is_infinite());
}

// Prefill/decode disaggregation.

use crate::preset::PdLayout;

/// A 2:2 fleet of `gpu_blocks` blocks per engine under `name`.
fn pd(name: &str, gpu_blocks: usize) -> SimConfig {
    SimConfig {
        layout: Some(PdLayout::DEFAULT),
        ..config(name.parse().expect("a contender"), gpu_blocks)
    }
}

/// The conversations of `multi-turn`, long enough that a decode engine's
/// cache of the previous turn leaves a short remainder to prefill.
fn conversations(requests: usize) -> SimLoad {
    SimLoad {
        workload: WorkloadSpec {
            kind: WorkloadKind::MultiTurn,
            groups: 8,
            scale: 0.5,
            max_tokens: 16,
            ..WorkloadSpec::default()
        },
        arrival: Arrival::Closed { concurrency: 8 },
        requests,
    }
}

/// Sums engines `range`'s entries of `v`.
fn sum(v: &[u64], range: std::ops::Range<usize>) -> u64 {
    v[range].iter().sum()
}

/// The prefill-side hit rate from the engines' own counters: prompt tokens
/// not computed on the engines that prefill them (here, where every
/// request is split: the prefill engines), over prompt tokens.
fn prefill_engines_hit_rate(r: &SimReport) -> f64 {
    let computed = sum(&r.prefilled_tokens, 0..2);
    let prompt = r.report.prompt_tokens;
    prompt.saturating_sub(computed) as f64 / prompt as f64
}

#[test]
fn a_kv_aware_pd_fleet_prefills_where_prefixes_are_and_beats_round_robin() {
    // 32 groups of 128 blocks: half of them fit one prefill engine.
    let load = preset_load(Preset::Pd, 400);
    let kv = simulate(&pd("kv", 2_048), &load).expect("runs");
    let rr = simulate(&pd("round-robin", 2_048), &load).expect("runs");
    let split = simulate(&pd("kv-split", 2_048), &load).expect("runs");
    for r in [&kv, &rr, &split] {
        assert_eq!((r.report.requests, r.report.failed), (400, 0));
        assert_eq!(r.skipped_events, 0);
        assert_eq!(sum(&r.per_engine, 2..4), 400, "every request decodes once");
    }
    let (kv_pf, rr_pf) = (
        kv.report.prefill_hit_rate.expect("measured"),
        rr.report.prefill_hit_rate.expect("measured"),
    );
    assert!(kv_pf > rr_pf + 0.3, "kv {kv_pf} round-robin {rr_pf}");
    // Every request split, so only where prompts are prefilled differs:
    // the prefill rank by its cache, or in turn.
    let split_pf = split.report.prefill_hit_rate.expect("measured");
    assert!(
        split_pf > rr_pf + 0.3,
        "kv-split {split_pf} round-robin {rr_pf}"
    );
    assert!(split.report.ttft_ms.p50 < rr.report.ttft_ms.p50);
    // Round-robin splits every request (it knows no cache to keep local).
    assert_eq!(sum(&rr.per_engine, 0..2), 400);
    assert!((rr_pf - prefill_engines_hit_rate(&rr)).abs() < 1e-12);
    let (kv_p50, rr_p50) = (kv.report.ttft_ms.p50, rr.report.ttft_ms.p50);
    assert!(
        kv_p50 * 1.5 < rr_p50,
        "TTFT p50: kv {kv_p50} round-robin {rr_p50}"
    );
    assert!(kv.report.tpot_ms.p50 > 0.0);
    let again = simulate(&pd("kv", 2_048), &load).expect("runs");
    assert_eq!(again, kv, "the same run twice gives the same figures");
}

#[test]
fn kv_split_prefills_every_prompt_on_a_prefill_engine() {
    let load = preset_load(Preset::Pd, 200);
    let r = simulate(&pd("kv-split", 2_048), &load).expect("runs");
    assert_eq!((r.report.requests, r.report.failed), (200, 0));
    assert_eq!(sum(&r.per_engine, 0..2), 200, "every request split");
    assert_eq!(sum(&r.per_engine, 2..4), 200);
    // A decode engine computes one token of each request it decodes: the
    // last prompt token, which vLLM computes on both sides.
    assert_eq!(&r.prefilled_tokens[2..], &r.per_engine[2..]);
    let pf = r.report.prefill_hit_rate.expect("measured");
    assert!((pf - prefill_engines_hit_rate(&r)).abs() < 1e-12, "{pf}");
    // The client counts the KV that arrived as cached; the engines do not.
    assert!(
        r.report.hit_rate > 0.99 && pf < 0.95,
        "{} {pf}",
        r.report.hit_rate
    );
    assert!(r.transferred_blocks > 0);
}

#[test]
fn conditional_disaggregation_prefills_later_turns_on_their_decode_engine() {
    let load = conversations(96);
    let kv = simulate(&pd("kv", 16_384), &load).expect("runs");
    let split = simulate(&pd("kv-split", 16_384), &load).expect("runs");
    for r in [&kv, &split] {
        assert_eq!((r.report.requests, r.report.failed), (96, 0));
    }
    // 8 conversations of 8 turns, then new ones: only first turns find
    // too little on a decode engine to keep the prefill local.
    assert_eq!(sum(&kv.per_engine, 0..2), 16, "{:?}", kv.per_engine);
    assert_eq!(sum(&split.per_engine, 0..2), 96);
    assert!(
        sum(&kv.prefilled_tokens, 2..4) > 96 * 16,
        "{:?}",
        kv.prefilled_tokens
    );
    assert!(kv.transferred_blocks < split.transferred_blocks);
    let (kv_p50, split_p50) = (kv.report.ttft_ms.p50, split.report.ttft_ms.p50);
    assert!(
        kv_p50 < split_p50,
        "TTFT p50: kv {kv_p50} kv-split {split_p50}"
    );
}

#[test]
fn aggregated_serves_whole_requests_on_every_engine() {
    let load = preset_load(Preset::Pd, 200);
    let r = simulate(&pd("aggregated", 2_048), &load).expect("runs");
    assert_eq!((r.report.requests, r.report.failed), (200, 0));
    assert_eq!(r.per_engine.iter().sum::<u64>(), 200);
    assert!(r.per_engine.iter().all(|&n| n > 0), "{:?}", r.per_engine);
    assert_eq!(r.transferred_blocks, 0);
    let pf = r.report.prefill_hit_rate.expect("a P/D fleet's run");
    assert!(
        (pf - r.report.hit_rate).abs() < 1e-12,
        "each engine prefills its own"
    );
    let plain = simulate(&config(kv(Policy::Kv), 2_048), &load).expect("runs");
    assert_eq!(
        plain.report.prefill_hit_rate, None,
        "no roles, no prefill side"
    );
}

#[test]
fn what_a_pd_fleet_cannot_be_simulated_with_is_refused() {
    let load = preset_load(Preset::Pd, 10);
    let oracle = SimConfig {
        layout: Some(PdLayout::DEFAULT),
        ..config(Contender::Oracle, 2_048)
    };
    let e = simulate(&oracle, &load).expect_err("no P/D oracle");
    assert!(e.to_string().contains("oracle"), "{e}");
    let three = SimConfig {
        engines: 3,
        ..pd("kv", 2_048)
    };
    assert!(simulate(&three, &load).is_err());
    let pinned = SimConfig {
        pins: Some(vec![0]),
        ..pd("kv", 2_048)
    };
    assert!(simulate(&pinned, &load).is_err());
    let mut sglang = pd("kv", 2_048);
    sglang.engine.flavor = kvroute_core::event::WorkerFlavor::Sglang;
    assert!(simulate(&sglang, &load).is_err());
}

#[test]
fn the_peers_policies_run_on_the_virtual_clock() {
    let load = preset_load(Preset::Short, 400);
    let run = |policy: Contender| simulate(&config(policy, 256), &load).expect("runs");
    let sglang = run("sglang-cache-aware".parse().expect("known"));
    let dynamo = run("dynamo".parse().expect("known"));
    let weights = run("kv-dynamo-weights".parse().expect("known"));
    let rr = run(kv(Policy::RoundRobin));
    assert_eq!(sglang.report.requests, 400);
    // Its tree keeps each group where it went first.
    assert!(
        sglang.report.hit_rate > rr.report.hit_rate + 0.2,
        "sglang {} round-robin {}",
        sglang.report.hit_rate,
        rr.report.hit_rate
    );
    // With Dynamo's defaults its logit orders ranks as kvroute's cost with
    // Dynamo's weights does: the same placements, the same figures.
    assert_eq!(dynamo.per_engine, weights.per_engine);
    assert_eq!(dynamo.report.hit_rate, weights.report.hit_rate);
}

#[test]
fn dealing_new_prefixes_spreads_the_groups_first_requests() {
    let load = preset_load(Preset::Long, 200);
    for by in [DealBy::Prefixes, DealBy::Work] {
        let dealt = Contender::Router(Routing {
            deal_new_prefixes: Some(by),
            ..Routing::new(Policy::Kv)
        });
        let r = simulate(&config(dealt, 2_048), &load).expect("runs");
        assert_eq!((r.report.requests, r.report.failed), (200, 0));
        // Every engine got a share of the 32 groups, and each group stayed put.
        assert!(
            r.per_engine.iter().all(|&n| n > 20),
            "{by:?} {:?}",
            r.per_engine
        );
        assert!(r.report.hit_rate > 0.8, "{by:?} {}", r.report.hit_rate);
    }
}

#[test]
fn caps_learned_from_a_tight_ttft_target_spread_requests_off_busy_holders() {
    let load = preset_load(Preset::Long, 300);
    let run = |cap_ttft_ms: Option<f64>| {
        let routing = Routing {
            cap_ttft_ms,
            ..Routing::new(Policy::Kv)
        };
        simulate(&config(Contender::Router(routing), 2_048), &load).expect("runs")
    };
    let (free, capped) = (run(None), run(Some(40.0)));
    assert_eq!((capped.report.requests, capped.report.failed), (300, 0));
    // Holders at their caps are passed over: groups are recomputed elsewhere.
    assert!(
        capped.report.hit_rate < free.report.hit_rate - 0.05,
        "capped {} free {}",
        capped.report.hit_rate,
        free.report.hit_rate
    );
    // A target no request misses never binds: the same run.
    let loose = run(Some(1e9));
    assert_eq!(loose.per_engine, free.per_engine);
    assert_eq!(loose.report.hit_rate, free.report.hit_rate);
}

#[test]
fn with_the_fetch_lever_busy_holders_hand_their_prefixes_to_cooler_engines() {
    let load = preset_load(Preset::Long, 300);
    let run = |routing: Routing| {
        simulate(&config(Contender::Router(routing), 2_048), &load).expect("runs")
    };
    let (stay, fetch) = (run(Routing::new(Policy::Kv)), run(Routing::fetch()));
    assert_eq!((fetch.report.requests, fetch.report.failed), (300, 0));
    assert_eq!((stay.fetches, stay.fetched_tokens), (0, 0));
    assert!(fetch.fetches > 0 && fetch.fetched_blocks > 0);
    // What the engines received they did not compute, and report as cached.
    assert!(fetch.fetched_tokens >= fetch.fetched_blocks * 16);
    assert!(fetch.report.cached_tokens >= fetch.fetched_tokens);
    // Moving the cache keeps the prefixes' hit rate (fetched counts as not
    // recomputed), where moving the work would lose it.
    assert!(
        fetch.report.hit_rate > stay.report.hit_rate - 0.01,
        "fetch {} stay {}",
        fetch.report.hit_rate,
        stay.report.hit_rate
    );
    let computed = |r: &SimReport| r.prefilled_tokens.iter().sum::<u64>();
    assert_eq!(
        computed(&fetch) + fetch.report.cached_tokens,
        fetch.report.prompt_tokens
    );
    assert!(computed(&fetch) <= computed(&stay) + 300 * 16);
}

#[test]
fn hot_prefixes_are_copied_ahead_of_demand_within_the_budget() {
    let load = preset_load(Preset::Long, 300);
    let routing = Routing {
        replicate: Some(kvroute_core::scheduler::ReplicaConfig {
            hot_for_ms: 200,
            budget_blocks: 256,
        }),
        ..Routing::new(Policy::Kv)
    };
    let r = simulate(&config(Contender::Router(routing), 2_048), &load).expect("runs");
    assert_eq!((r.report.requests, r.report.failed), (300, 0));
    assert!(r.replicas > 0 && r.replicated_blocks > 0, "{r:?}");
    // Copies are no client's fetch.
    assert_eq!((r.fetches, r.fetched_tokens), (0, 0));
}

#[test]
fn a_fetch_by_legs_runs_its_one_token_leg_on_the_holder() {
    let load = preset_load(Preset::Long, 300);
    let config = SimConfig {
        fetch_legs: true,
        ..config(Contender::Router(Routing::fetch()), 2_048)
    };
    let r = simulate(&config, &load).expect("runs");
    assert_eq!((r.report.requests, r.report.failed), (300, 0));
    assert!(r.fetches > 0 && r.fetched_blocks > 0 && r.fetched_tokens > 0);
    // Each fetched request counts on its holder (the leg) and its receiver.
    assert_eq!(r.per_engine.iter().sum::<u64>(), 300 + r.fetches);
    // The hit rate counts what the holder found, not what the receiver got.
    assert!(r.report.cached_tokens >= r.fetched_tokens);
    assert_eq!(r.transferred_blocks, 0);
}
