//! KV-aware routing against round-robin on real vLLM engines, on a workload
//! larger than one engine's cache (the bed's engines hold 256 blocks of 32
//! tokens each): the engines' own `cached_tokens`, summed, are higher when
//! the router sends each prefix where it is cached.

use kvroute_core::rng::SplitMix64;
use serde_json::json;

use super::bed::{bed, decode_errors, tokens, usage, Bed};
use crate::support::http;

/// Prefix groups, their size, and requests per group: 12 × 1,024 tokens
/// (384 blocks) do not fit one engine's 256 blocks, and do fit two.
const GROUPS: u32 = 12;
const PREFIX: usize = 1_024;
const PER_GROUP: u32 = 5;

/// The requests in a seeded order: a group's prefix and a unique question.
fn workload() -> Vec<Vec<u32>> {
    let mut order: Vec<(u32, u32)> = (0..GROUPS)
        .flat_map(|g| (0..PER_GROUP).map(move |k| (g, k)))
        .collect();
    let mut rng = SplitMix64::new(45);
    for i in (1..order.len()).rev() {
        order.swap(i, rng.below(i + 1));
    }
    order
        .into_iter()
        .map(|(g, k)| {
            let mut prompt = tokens(1_000 + g * 1_100, PREFIX);
            prompt.extend(tokens(15_000 + (g * PER_GROUP + k) * 64, 48));
            prompt
        })
        .collect()
}

/// (cached tokens, prompt tokens) of the workload under `policy`, from a
/// fresh router over freshly emptied engines.
fn run(bed: &Bed, policy: &str) -> (u64, u64) {
    bed.reset();
    let (_router, serve) = bed.router_with_tokenizer(&["--policy", policy]);
    let mut cached = 0;
    let mut prompt = 0;
    for p in workload() {
        let body = json!({"model": bed.served, "prompt": p, "max_tokens": 1});
        let reply = http::request(&serve, "POST", "/v1/completions", &body.to_string());
        assert_eq!(reply.status, 200, "{policy}: {}", reply.body);
        let (p, c) = usage(&reply.json());
        prompt += p;
        cached += c;
    }
    assert_eq!(decode_errors(&serve), 0, "{policy}");
    (cached, prompt)
}

#[test]
fn kv_routing_caches_more_than_round_robin_on_a_workload_over_one_engines_cache() {
    let (_serial, bed) = bed();
    let (kv, prompt) = run(&bed, "kv");
    let (rr, prompt_rr) = run(&bed, "round-robin");
    assert_eq!(prompt, prompt_rr, "the same workload");
    let rate = |c: u64| c as f64 / prompt as f64;
    eprintln!(
        "kv vs round-robin on 2 real engines ({GROUPS} groups of {PREFIX} tokens, {} requests): \
         cached {kv} vs {rr} of {prompt} prompt tokens (hit rate {:.3} vs {:.3})",
        GROUPS * PER_GROUP,
        rate(kv),
        rate(rr)
    );
    assert!(kv > rr, "kv cached {kv} tokens, round-robin {rr}");
}
