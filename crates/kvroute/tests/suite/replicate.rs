//! Copies of hot prefixes ahead of demand, end to end: `kvroute serve`
//! with `--replicate-hot-ms` (and no fetches) in front of two aggregated
//! vLLM mock engines. Once the engine holding a prompt's prefix is
//! saturated, the next request of the prefix starts a copy of it to the
//! other engine beside itself, with the engines' own hand-off; the index
//! then lists two holders, and later requests of the prefix find it on
//! the cooler one. A holder that dies during the copy costs no request.

use std::thread;

use super::disagg::{auth, prompt};
use super::fetch::{
    assert_whole, completion, fleet_flagged, held_by, load_until_planned, runs_cached_on, signal,
};
use crate::support::http::{count, metric_where, request, request_with};
use crate::support::{eventually, Proc};

/// The router's flags: copies as soon as the holder is saturated (judged
/// by the fetch rule's defaults, the mock engines' 20 µs per block), the
/// costs of the simulator's `kv-fetch` contender, and no fetches.
const REPLICATE: [&str; 6] = [
    "--replicate-hot-ms",
    "0",
    "--prefill-load-scale",
    "24",
    "--request-kv-weight",
    "2",
];

fn copies(serve: &str, outcome: &str) -> u64 {
    let label = format!("outcome=\"{outcome}\"");
    metric_where(serve, "kvroute_proxy_replications_total", &label).unwrap_or(0.0) as u64
}

/// Two vLLM mock engines, `a` holding the prompt's prefix, the router in
/// front with [`REPLICATE`].
fn fleet(tokens: &[u32]) -> (Vec<Proc>, String) {
    fleet_flagged(tokens, &["--engine-flavor", "vllm"], &REPLICATE)
}

/// The copy planned, made beside the request that found the prefix hot,
/// counted, shown in the decisions ring; the index then lists `b` as a
/// holder, and the next request of the prefix runs on `b` from its cache.
#[test]
fn a_hot_prefix_is_copied_to_a_second_rank_ahead_of_demand() {
    let tokens = prompt(10);
    let (_procs, serve) = fleet(&tokens);
    // Long enough to keep the holder busy through the test.
    let (plan, loaders) = load_until_planned(&serve, &tokens, 3_000, "replicate");
    eprintln!("planned after {} loaders: {plan}", loaders.len());
    assert_eq!(plan["source"]["name"], "a", "{plan}");
    assert_eq!(plan["target"]["name"], "b", "{plan}");
    assert!(plan["blocks"].as_u64().unwrap_or(0) >= 19, "{plan}");
    let reply = request(
        &serve,
        "POST",
        "/v1/completions",
        &completion(&tokens, 4, false),
    );
    assert_eq!(reply.status, 200, "{}", reply.body);
    assert_eq!(count(&serve, "kvroute_proxy_replications_started_total"), 1);
    eventually("the copy made", || copies(&serve, "copied") == 1);
    assert_eq!(copies(&serve, "failed") + copies(&serve, "skipped"), 0);
    eventually("the index learns b holds the prefix too", || {
        held_by(&serve, &tokens, "b") >= 19
    });
    let stats = request_with(
        &serve,
        "GET",
        "/api/stats",
        &[("Authorization", &auth())],
        "",
    );
    let shown = stats.json()["decisions"].to_string();
    assert!(shown.contains("replicate: hot prefix"), "{shown}");
    // The copy serves: the prefix's next request runs on the cooler holder
    // with the copied blocks cached.
    runs_cached_on(&serve, &tokens, "b");
}

/// The holder frozen once a copy is planned (its legs taken, nothing
/// answering), the copy started, then the holder killed: the copy fails,
/// counted, nothing is copied, and every request, the one that started
/// the copy and the streams the dead holder was running (moved on by
/// migration), is answered whole.
#[test]
fn a_holder_that_dies_mid_copy_costs_no_request() {
    let tokens = prompt(11);
    let (mut procs, serve) = fleet(&tokens);
    let (plan, loaders) = load_until_planned(&serve, &tokens, 600, "replicate");
    assert_eq!(plan["source"]["name"], "a", "{plan}");
    let mut holder = procs.remove(0);
    signal("-STOP", holder.0.id());
    let (serve_at, body) = (serve.clone(), completion(&tokens, 4, true));
    let hot = thread::spawn(move || request(&serve_at, "POST", "/v1/completions", &body));
    eventually("the copy started", || {
        count(&serve, "kvroute_proxy_replications_started_total") == 1
    });
    let _ = holder.0.kill();
    let _ = holder.0.wait();
    assert_whole(
        "the request that started the copy",
        &hot.join().expect("it"),
    );
    eventually("the copy counted failed", || copies(&serve, "failed") == 1);
    assert_eq!(copies(&serve, "copied"), 0);
    for loader in loaders {
        assert_whole("a loader", &loader.join().expect("a loader"));
    }
}
