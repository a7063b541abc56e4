//! Moving the cache between SGLang workers, end to end: `kvroute serve`
//! with `--fetch-us-per-block` in front of two aggregated SGLang mock
//! engines that are both ends of a bootstrap hand-off (`--kv-both`, each
//! declaring its bootstrap server with `bootstrap_port=`). The busy holder
//! is the bootstrap source, the cooler receiver reads the prefix from it;
//! a holder that hangs or dies during its leg costs no request.

use super::disagg::{auth, prompt};
use super::fetch::{
    a_holder_dies_mid_fetch, completion, fetches, fleet_of, held_by, load_until_fetched, signal,
};
use crate::support::eventually;
use crate::support::http::{metric_where, request, request_with};

/// The engines' flags: SGLang, both ends of a hand-off, bootstrap rooms on
/// an ephemeral port (named in their `--worker` lines).
const SGLANG: [&str; 5] = [
    "--engine-flavor",
    "sglang",
    "--kv-both",
    "--bootstrap-port",
    "0",
];

/// A fetch between SGLang workers: the receiver answers with the prefix
/// reported cached (it arrived from the holder's bootstrap room), the
/// blocks are counted, the decision says why, and the index then lists
/// the receiver as a holder too.
#[test]
fn a_busy_sglang_holders_prefix_is_fetched_by_a_cooler_rank() {
    let tokens = prompt(17);
    let (_procs, serve) = fleet_of(&tokens, &SGLANG, &[]);
    let (plan, _loaders) = load_until_fetched(&serve, &tokens, 3_000);
    assert_eq!(plan["source"]["name"], "a", "{plan}");
    assert_eq!(plan["receiver"]["name"], "b", "{plan}");
    let handed_off = fetches(&serve, "handed_off");
    let reply = request(
        &serve,
        "POST",
        "/v1/completions",
        &completion(&tokens, 4, false),
    );
    assert_eq!(reply.status, 200, "{}", reply.body);
    assert_eq!(reply.header("x-kvroute-worker").as_deref(), Some("b"));
    let answer = reply.json();
    let cached = answer["usage"]["prompt_tokens_details"]["cached_tokens"]
        .as_u64()
        .unwrap_or(0);
    assert!(cached >= 19 * 16, "the prefix arrived cached: {answer}");
    assert_eq!(answer["usage"]["completion_tokens"], 4, "{answer}");
    assert_eq!(fetches(&serve, "handed_off"), handed_off + 1);
    assert_eq!(fetches(&serve, "fell_back"), 0);
    let blocks = metric_where(&serve, "kvroute_proxy_fetched_blocks_total", "").unwrap_or(0.0);
    assert!(blocks >= 19.0, "the planned blocks counted: {blocks}");
    eventually("the index learns b holds the prefix too", || {
        held_by(&serve, &tokens, "b") >= 19
    });
    let stats = request_with(
        &serve,
        "GET",
        "/api/stats",
        &[("Authorization", &auth())],
        "",
    )
    .json();
    let shown = stats["decisions"].to_string();
    assert!(shown.contains("fetch: holder busy"), "{shown}");
}

/// The holder hangs with both legs in flight (stopped: the receiver waits
/// on its bootstrap room, nothing answers), then dies (SIGKILL): the
/// request falls back to recomputing on the receiver, and every request,
/// the streams the dead holder was running included, is answered whole.
#[test]
fn an_sglang_holder_that_dies_mid_fetch_costs_no_request() {
    let tokens = prompt(18);
    let (procs, serve) = fleet_of(&tokens, &SGLANG, &[]);
    a_holder_dies_mid_fetch(procs, &serve, &tokens);
}

/// A holder that hangs with its leg in flight costs the request no more
/// than `--prefill-timeout-secs`: the receiver's leg is dropped and the
/// request recomputed there, counted.
#[test]
fn a_hung_sglang_holder_falls_back_within_the_prefill_timeout() {
    let tokens = prompt(19);
    let serve_extra = ["--prefill-timeout-secs", "1"];
    let (mut procs, serve) = fleet_of(&tokens, &SGLANG, &serve_extra);
    let (plan, _loaders) = load_until_fetched(&serve, &tokens, 600);
    assert_eq!(plan["source"]["name"], "a", "{plan}");
    let holder = procs.remove(0);
    signal("-STOP", holder.0.id());
    let reply = request(
        &serve,
        "POST",
        "/v1/completions",
        &completion(&tokens, 4, false),
    );
    signal("-CONT", holder.0.id());
    assert_eq!(reply.status, 200, "{}", reply.body);
    assert_eq!(reply.header("x-kvroute-worker").as_deref(), Some("b"));
    assert_eq!(fetches(&serve, "fell_back"), 1, "the fallback counted");
    assert_eq!(fetches(&serve, "handed_off"), 0);
}
