//! A worker whose block size nobody configured: the router
//! learns it from the engine's first stored event, on real `kvroute serve`
//! and `kvroute mocker` processes.

use serde_json::Value;

use crate::support::engine::{
    call, completion, engine_match, predicted, prompt, rank, send_to_engine, settle, Engine, TOKEN,
};
use crate::support::http::{count, metric};
use crate::support::*;

/// `w0`'s `block_size` as `/workers` shows it.
fn block_size(serve: &str) -> Value {
    call(serve, "GET", "/workers", "").json()["workers"][0]["block_size"].clone()
}

/// The engine runs 32-token blocks and its `--worker` line says nothing of
/// them, nor does the router's `--block-size`: `/workers` shows `null` until
/// the first stored event, then 32, and predictions equal the engine's cache.
#[test]
fn a_worker_without_a_block_size_learns_it_from_its_stream() {
    let engine = Engine::start(1, &["--block-size", "32"]);
    let line = engine.line.replace(",block_size=32", "");
    assert!(!line.contains("block_size"), "{line}");
    let (_serve, serve) = spawn_serve_with_env(&[line], &["--admin-token", TOKEN], &[]);
    let up = settle(30, || rank(&serve, "w0", 0)["connected"] == true, |up| *up);
    assert!(up, "the router never connected to w0");
    assert_eq!(block_size(&serve), Value::Null);
    let tokens = prompt(7);
    send_to_engine(&engine.http, &tokens);
    let learned = settle(10, || block_size(&serve), |b| *b == 32);
    assert_eq!(learned, 32, "the block size of the engine's events");
    let held = engine_match(&engine.http, &tokens, 0);
    assert_eq!(held, 64, "two blocks of 32 of the 70-token prompt");
    let router = settle(10, || predicted(&serve, "w0", &tokens), |p| *p == held);
    assert_eq!(router, held);
    assert_eq!(rank(&serve, "w0", 0)["state"], "live");
}

/// The first proxied request after the stream taught the block size is
/// hashed at it: routing takes the learned size at once, not at its next
/// once-a-second refresh of the workers (until then every request was
/// hashed at size 0, matched nothing and was predicted 0 — the first
/// second after a router starts, seen in front of real vLLM engines).
#[test]
fn the_first_request_after_the_block_size_is_learned_is_predicted() {
    let engine = Engine::start(1, &["--block-size", "32"]);
    let tokens = prompt(11);
    // The engine holds the prompt before the router starts: the router
    // learns 32 from the replay of that history.
    send_to_engine(&engine.http, &tokens);
    let line = engine.line.replace(",block_size=32", "");
    let (_serve, serve) = spawn_serve_with_env(&[line], &["--admin-token", TOKEN], &[]);
    let learned = settle(30, || block_size(&serve), |b| *b == 32);
    assert_eq!(learned, 32, "learned from the replayed history");
    // At once: through the router, the prompt the engine holds.
    let reply = call(&serve, "POST", "/v1/completions", &completion(&tokens));
    assert_eq!(reply.status, 200, "{}", reply.body);
    let cached = reply.json()["usage"]["prompt_tokens_details"]["cached_tokens"].as_u64();
    assert_eq!(cached, Some(64), "the engine held two blocks of 32");
    let compared = settle(
        10,
        || count(&serve, "kvroute_accuracy_comparisons_total"),
        |n| *n == 1,
    );
    assert_eq!(compared, 1);
    assert_eq!(
        metric(&serve, "kvroute_quality_predicted_cached_tokens_total"),
        Some(64.0),
        "the router predicted what the engine had cached"
    );
}
