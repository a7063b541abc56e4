//! The prefix cache as a client and a router see it: cached_tokens, eviction, reset.

use kvroute_core::event::KvEvent;
use kvroute_core::event::WorkerFlavor;
use kvroute_mocker::ReplayFrames;
use serde_json::json;

use super::common::*;

#[test]
fn cached_tokens_are_exact_on_repeated_and_shared_prompts() {
    for flavor in [WorkerFlavor::Vllm, WorkerFlavor::Sglang] {
        let fleet = TestFleet::start(config(flavor));
        let addr = fleet.http(0);
        let prompt: Vec<u64> = (1..=100).collect();
        let first = post(addr, "/v1/completions", &ids_prompt(&prompt, 4)).json();
        assert_eq!(cached_tokens(&first), 0);
        assert_eq!(first["usage"]["prompt_tokens"], 100);
        assert_eq!(first["usage"]["completion_tokens"], 4);
        // (100 - 1) / 16 = 6 full blocks can be served: 96 tokens.
        let again = post(addr, "/v1/completions", &ids_prompt(&prompt, 4)).json();
        assert_eq!(cached_tokens(&again), 96, "{flavor:?}");
        // Shares the first 40 tokens: 2 full blocks.
        let other: Vec<u64> = (1..=40).chain(500..560).collect();
        let shared = post(addr, "/v1/completions", &ids_prompt(&other, 1)).json();
        assert_eq!(cached_tokens(&shared), 32, "{flavor:?}");
        // Streaming reports it too, in the usage chunk.
        let mut body = ids_prompt(&prompt, 2);
        body["stream"] = json!(true);
        body["stream_options"] = json!({"include_usage": true});
        let r = post(addr, "/v1/completions", &body);
        let data = r.sse_data();
        let usage: serde_json::Value =
            serde_json::from_str(&data[data.len() - 2]).expect("usage chunk");
        assert_eq!(cached_tokens(&usage), 96);
    }
}

#[test]
fn text_prompts_hit_the_cache_through_the_builtin_tokenizer() {
    let fleet = TestFleet::start(config(WorkerFlavor::Vllm));
    let text = "The quick brown fox jumps over the lazy dog. ".repeat(8);
    let body = json!({"prompt": text, "max_tokens": 3});
    let first = post(fleet.http(0), "/v1/completions", &body).json();
    let prompt_tokens = first["usage"]["prompt_tokens"].as_u64().expect("count");
    let again = post(fleet.http(0), "/v1/completions", &body).json();
    assert_eq!(cached_tokens(&again), (prompt_tokens - 1) / 16 * 16);
    assert_eq!(first["choices"][0]["text"], again["choices"][0]["text"]);
}

#[test]
fn eviction_under_pressure_removes_exactly_the_evicted_blocks() {
    let mut c = config(WorkerFlavor::Vllm);
    c.num_gpu_blocks = 8;
    let fleet = TestFleet::start(c);
    let addr = fleet.http(0);
    let a: Vec<u64> = (1..=64).collect();
    assert_eq!(
        post(addr, "/v1/completions", &ids_prompt(&a, 1)).status,
        200
    );
    // 100 new tokens need 7 blocks: the 4 free ones and 3 of a's 4 cached blocks.
    let b: Vec<u64> = (1000..1100).collect();
    assert_eq!(
        post(addr, "/v1/completions", &ids_prompt(&b, 1)).status,
        200
    );

    let payloads = replay(&fleet.replay(0, 0), 0, ReplayFrames::Four);
    let events = all_events(&payloads, 16);
    let a_hashes = engine_chain(WorkerFlavor::Vllm, &a, 16);
    let b_hashes = engine_chain(WorkerFlavor::Vllm, &b, 16);
    let mut stored = Vec::new();
    let mut removed = Vec::new();
    for e in &events {
        match e {
            KvEvent::Stored(s) => stored.extend(s.blocks.iter().map(|b| b.external.0)),
            KvEvent::Removed(r) => {
                assert_eq!(r.blocks.len(), 1, "vLLM: one BlockRemoved per hash");
                removed.push(r.blocks[0].0);
            }
            KvEvent::Cleared | KvEvent::Group(_) => panic!("unexpected {e:?}"),
        }
    }
    let expected_stored: Vec<u64> = a_hashes.iter().chain(&b_hashes).copied().collect();
    assert_eq!(stored, expected_stored);
    // Least recently used first; a's blocks were released tail first.
    assert_eq!(removed, [a_hashes[3], a_hashes[2], a_hashes[1]]);
    // a's first block survived: asking for a again hits exactly one block.
    let again = post(addr, "/v1/completions", &ids_prompt(&a, 1)).json();
    assert_eq!(cached_tokens(&again), 16);
}

#[test]
fn sglang_eviction_coalesces_removals_of_one_step() {
    let mut c = config(WorkerFlavor::Sglang);
    c.num_gpu_blocks = 8;
    let fleet = TestFleet::start(c);
    let addr = fleet.http(0);
    let a: Vec<u64> = (1..=64).collect();
    let b: Vec<u64> = (1000..1100).collect();
    post(addr, "/v1/completions", &ids_prompt(&a, 1));
    post(addr, "/v1/completions", &ids_prompt(&b, 1));
    let payloads = replay(&fleet.replay(0, 0), 0, ReplayFrames::Four);
    let removals: Vec<Vec<u64>> = all_events(&payloads, 16)
        .into_iter()
        .filter_map(|e| match e {
            KvEvent::Removed(r) => Some(r.blocks.iter().map(|h| h.0).collect()),
            _ => None,
        })
        .collect();
    let a_hashes = engine_chain(WorkerFlavor::Sglang, &a, 16);
    assert_eq!(removals, [vec![a_hashes[3], a_hashes[2], a_hashes[1]]]);
}

#[test]
fn reset_prefix_cache_publishes_all_blocks_cleared_and_forgets_everything() {
    let fleet = TestFleet::start(config(WorkerFlavor::Vllm));
    let addr = fleet.http(0);
    let prompt: Vec<u64> = (1..=40).collect();
    post(addr, "/v1/completions", &ids_prompt(&prompt, 1));
    let r = post(addr, "/reset_prefix_cache", &json!({}));
    assert_eq!(r.status, 200);
    let again = post(addr, "/v1/completions", &ids_prompt(&prompt, 1)).json();
    assert_eq!(cached_tokens(&again), 0);
    let payloads = replay(&fleet.replay(0, 0), 0, ReplayFrames::Four);
    let kinds: Vec<&str> = all_events(&payloads, 16).iter().map(|e| e.kind()).collect();
    assert_eq!(kinds, ["stored", "cleared", "stored"]);
}
