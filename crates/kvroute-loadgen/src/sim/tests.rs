use kvroute_core::scheduler::Policy;
use kvroute_mocker::MockerConfig;

use super::*;
use crate::mooncake::{synthesize, SynthesisConfig};
use crate::preset::Preset;
use crate::workload::WorkloadKind;

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
