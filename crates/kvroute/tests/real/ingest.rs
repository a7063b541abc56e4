//! Real vLLM's KV events, through kvroute's ingest: decoded with no error,
//! the block size learned from the stream, and the router's index equal to
//! what each engine stored, by the engine's own replay read by an
//! independent subscriber (`replay.py`), block count and block content.

use serde_json::json;

use super::bed::{bed, decode_errors, tokens, worker, workers};
use crate::support::http::{self, count};

/// 20 prompts of 1,000 tokens (31 whole blocks each; 620 blocks against
/// the two engines' 512) through the router: both engines store and evict.
/// Afterwards the router holds, per engine, the blocks the engine's replay
/// holds, matches each prompt where the engine's own blocks match it, and
/// has decoded every event.
#[test]
fn the_index_holds_what_each_engine_stored_by_its_replay() {
    let (_serial, bed) = bed();
    let (_router, serve) = bed.router_with_tokenizer(&[]);
    for w in bed.workers() {
        assert!(
            !w.contains("block_size"),
            "the block size is the stream's: {w}"
        );
    }
    let prompts: Vec<Vec<u32>> = (0..20).map(|i| tokens(1_000 + i * 1_000, 1_000)).collect();
    // Later prompts share earlier ones' first half: blocks with parents.
    let shared: Vec<Vec<u32>> = (0..4)
        .map(|i| {
            let mut p = prompts[16 + i][..500].to_vec();
            p.extend(tokens(25_000 + i as u32 * 1_000, 500));
            p
        })
        .collect();
    for prompt in prompts.iter().chain(&shared) {
        let body = json!({"model": bed.served, "prompt": prompt, "max_tokens": 1});
        let reply = http::request(&serve, "POST", "/v1/completions", &body.to_string());
        assert_eq!(reply.status, 200, "{}", reply.body);
    }
    let replays = bed.settled(&serve);
    let routed = workers(&serve);
    for (e, r) in bed.engines.iter().zip(&replays) {
        let w = worker(&routed, &e.name);
        assert_eq!(w["block_size"], 32, "{}: learned from the stream", e.name);
        assert_eq!(
            r.block_sizes,
            [32],
            "{}: the engine's events say 32",
            e.name
        );
        assert_eq!(w["ranks"][0]["decode_errors"], 0, "{}", e.name);
        assert!(!r.blocks.is_empty(), "{}: the engine stored blocks", e.name);
    }
    assert_eq!(
        decode_errors(&serve),
        0,
        "kvroute_ingest_decode_errors_total"
    );
    let removed = count(&serve, "kvroute_index_blocks_removed_total");
    assert!(
        removed > 0,
        "the workload overflows the engines' caches: blocks were evicted"
    );
    // Block content: each prompt matches where the engine's blocks match it.
    for prompt in prompts.iter().chain(&shared) {
        let query = json!({"token_ids": prompt});
        let answer = http::request(&serve, "POST", "/query", &query.to_string()).json();
        for (e, r) in bed.engines.iter().zip(&replays) {
            let by_router = answer["workers"]
                .as_array()
                .expect("workers")
                .iter()
                .find(|w| w["name"] == e.name.as_str())
                .and_then(|w| w["matched_tokens"].as_u64())
                .expect("matched_tokens");
            assert_eq!(
                by_router,
                r.matched_tokens(prompt, 32),
                "{}: the router's match of the prompt from {} against the engine's own blocks",
                e.name,
                prompt[0]
            );
        }
    }
    let stored: usize = replays.iter().map(|r| r.blocks.len()).sum();
    eprintln!(
        "real engines: {stored} blocks held ({}), {removed} removed, 0 decode errors, block size 32 learned",
        bed.engines
            .iter()
            .zip(&replays)
            .map(|(e, r)| format!("{} {}", e.name, r.blocks.len()))
            .collect::<Vec<_>>()
            .join(", ")
    );
}
