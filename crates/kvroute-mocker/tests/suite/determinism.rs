//! The same seed and the same requests give byte-identical event payloads.

use kvroute_core::event::WorkerFlavor;
use kvroute_mocker::ReplayFrames;
use serde_json::json;

use super::common::*;

/// Runs a fixed request sequence against a fresh fleet and returns every payload.
fn run(flavor: WorkerFlavor, seed: u64) -> (Vec<(u64, Vec<u8>)>, Vec<String>) {
    let mut c = config(flavor);
    c.seed = seed;
    c.num_gpu_blocks = 12;
    let fleet = TestFleet::start(c);
    let addr = fleet.http(0);
    let mut texts = Vec::new();
    let bodies = [
        json!({"prompt": "A prompt that is long enough to fill a few blocks of sixteen tokens, \
                          with more words, and more words, and yet more words to be sure.",
               "max_tokens": 40}),
        json!({"prompt": (1..=50).collect::<Vec<u64>>(), "max_tokens": 20}),
        json!({"messages": [{"role": "user", "content": "Tell me something."}],
               "max_tokens": 24, "stream": true}),
        json!({"prompt": (1..=70).collect::<Vec<u64>>(), "max_tokens": 30}),
        json!({"prompt": (200..=290).collect::<Vec<u64>>(), "max_tokens": 5}),
    ];
    for body in &bodies {
        let path = if body.get("messages").is_some() {
            "/v1/chat/completions"
        } else {
            "/v1/completions"
        };
        let r = post(addr, path, body);
        assert_eq!(r.status, 200, "{}", r.text());
        texts.push(r.text().replace(|c: char| c.is_ascii_digit(), ""));
    }
    (replay(&fleet.replay(0, 0), 0, ReplayFrames::Four), texts)
}

#[test]
fn same_seed_same_requests_give_byte_identical_payloads() {
    for flavor in [WorkerFlavor::Vllm, WorkerFlavor::Sglang] {
        let (a, text_a) = run(flavor, 7);
        let (b, text_b) = run(flavor, 7);
        assert!(a.len() >= 5, "{flavor:?}: {} batches", a.len());
        assert_eq!(a, b, "{flavor:?}: payloads differ between identical runs");
        assert_eq!(text_a, text_b);
        // Evictions happened (12 blocks), so removals are covered too.
        assert!(all_events(&a, 16).iter().any(|e| e.kind() == "removed"));
        // Another seed generates other tokens, so generated blocks hash differently.
        let (c, _) = run(flavor, 8);
        assert_ne!(a, c, "{flavor:?}: the seed changes nothing");
    }
}

#[test]
fn simulated_timestamps_start_at_the_configured_epoch_and_grow() {
    let (payloads, _) = run(WorkerFlavor::Vllm, 1);
    let ts: Vec<f64> = payloads
        .iter()
        .map(|(_, p)| decode_clean(p, 16).ts.expect("ts"))
        .collect();
    assert!(ts.len() >= 2, "{ts:?}");
    assert!(ts[0] > TS0);
    assert!(ts.windows(2).all(|w| w[0] <= w[1]), "{ts:?}");
}
