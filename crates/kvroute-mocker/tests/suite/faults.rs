//! Fault flags as a subscriber observes them over ZeroMQ.

use std::time::{Duration, Instant};

use kvroute_core::event::WorkerFlavor;
use kvroute_core::wire::{decode_batch, DecoderConfig, SkipReason};
use kvroute_mocker::ReplayFrames;

use super::common::*;

fn send_requests(fleet: &TestFleet, n: u64) {
    for i in 0..n {
        let prompt: Vec<u64> = (i * 1000..i * 1000 + 20).collect();
        let r = post(fleet.http(0), "/v1/completions", &ids_prompt(&prompt, 1));
        assert_eq!(r.status, 200, "{}", r.text());
    }
}

#[test]
fn drop_every_skips_live_batches_that_replay_still_has() {
    let mut c = config(WorkerFlavor::Vllm);
    c.faults.drop_every = Some(2);
    let fleet = TestFleet::start(c);
    let sub = subscribe(&fleet.events(0, 0));
    send_requests(&fleet, 6);
    let live: Vec<u64> = recv_n(&sub, 3).into_iter().map(|(seq, _)| seq).collect();
    assert_eq!(
        live,
        [0, 2, 4],
        "batches 2, 4, 6 (seq 1, 3, 5) are never sent live"
    );
    // Absence: every batch was published before the requests returned, so
    // one sent live would arrive within milliseconds; 300 ms without one.
    sub.set_rcvtimeo(300).expect("timeout");
    assert!(recv_live(&sub).is_none(), "nothing else arrives");
    let replayed: Vec<u64> = replay(&fleet.replay(0, 0), 0, ReplayFrames::Four)
        .into_iter()
        .map(|(seq, _)| seq)
        .collect();
    assert_eq!(replayed, [0, 1, 2, 3, 4, 5]);
}

#[test]
fn bad_event_every_puts_one_malformed_event_between_good_ones() {
    for flavor in [WorkerFlavor::Vllm, WorkerFlavor::Sglang] {
        let mut c = config(flavor);
        c.faults.bad_event_every = Some(2);
        // A small cache, so later batches also carry removals.
        c.num_gpu_blocks = 4;
        let fleet = TestFleet::start(c);
        let sub = subscribe(&fleet.events(0, 0));
        send_requests(&fleet, 4);
        let live = recv_n(&sub, 4);
        assert_eq!(live.len(), 4);
        for (seq, payload) in &live {
            let config = DecoderConfig {
                block_size: Some(16),
                ..DecoderConfig::default()
            };
            let batch = decode_batch(payload, &config).expect("the envelope stays readable");
            let skipped: Vec<SkipReason> = batch.skipped().map(|(_, s)| s.reason).collect();
            if seq % 2 == 1 {
                assert_eq!(skipped, [SkipReason::InvalidField], "{flavor:?} seq {seq}");
                assert!(batch.decoded().count() >= 1, "good events survive");
            } else {
                assert!(skipped.is_empty());
            }
            assert_eq!(batch.lost_events, 0);
        }
    }
}

#[test]
fn restart_every_resets_seq_and_clears_the_cache() {
    let mut c = config(WorkerFlavor::Vllm);
    c.faults.restart_every = Some(Duration::from_millis(1000));
    let fleet = TestFleet::start(c);
    let prompt: Vec<u64> = (1..=40).collect();
    let first = post(fleet.http(0), "/v1/completions", &ids_prompt(&prompt, 1)).json();
    assert_eq!(cached_tokens(&first), 0);
    // The first restart (1 s after the start): the engine has emptied its
    // cache before it has the publisher count it.
    let deadline = Instant::now() + Duration::from_secs(10);
    while publisher_restarts(&fleet) < 1.0 {
        assert!(
            Instant::now() < deadline,
            "no publisher restart within 10 s of a 1 s --restart-every"
        );
        std::thread::sleep(Duration::from_millis(20));
    }
    let second = post(fleet.http(0), "/v1/completions", &ids_prompt(&prompt, 1)).json();
    assert_eq!(cached_tokens(&second), 0, "the restart emptied the cache");
    // Only the batch published after the restart is retained, numbered 0 again.
    let batches = replay(&fleet.replay(0, 0), 0, ReplayFrames::Four);
    assert_eq!(batches.len(), 1);
    assert_eq!(batches[0].0, 0);
    assert!(publisher_restarts(&fleet) >= 1.0);
}

/// `kvroute_mocker_publisher_restarts_total` of worker 0's rank 0.
fn publisher_restarts(fleet: &TestFleet) -> f64 {
    let metrics = get(fleet.http(0), "/metrics").text();
    metrics
        .lines()
        .find_map(|l| l.strip_prefix("kvroute_mocker_publisher_restarts_total{"))
        .and_then(|l| l.rsplit(' ').next())
        .and_then(|v| v.parse().ok())
        .expect("restart counter")
}
