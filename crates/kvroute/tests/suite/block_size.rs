//! A worker whose block size nobody configured: the router
//! learns it from the engine's first stored event, on real `kvroute serve`
//! and `kvroute mocker` processes.

use serde_json::Value;

use super::restarts::{
    call, engine_match, predicted, prompt, rank, send_to_engine, settle, Engine, TOKEN,
};
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
