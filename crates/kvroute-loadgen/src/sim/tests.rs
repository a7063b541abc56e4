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
