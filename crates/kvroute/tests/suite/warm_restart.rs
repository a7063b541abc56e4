//! A router restarted with `--state-dir` comes back with what it knew,
//! beyond what the engines' replay rings still hold, and still notices an
//! engine that restarted while it was away: real `kvroute serve` and
//! `kvroute mocker` processes.

use std::path::PathBuf;
use std::time::{Duration, Instant};

use crate::support::engine::{
    call, completion, counter, engine_match, predicted_on, prompt, rank, settle, Engine, TOKEN,
};
use crate::support::http::count;
use crate::support::*;

/// A fresh directory for one test's state.
fn state_dir(name: &str) -> PathBuf {
    let dir = std::env::temp_dir().join(format!("kvroute-{name}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    dir
}

/// A router following `engine` that keeps its state in `dir`, every second.
fn router(engine: &Engine, dir: &std::path::Path) -> (Proc, String) {
    router_with(engine, dir, 1, &[])
}

/// [`router`] with more arguments, waiting for `ranks` ranks of w0.
fn router_with(
    engine: &Engine,
    dir: &std::path::Path,
    ranks: u64,
    more: &[&str],
) -> (Proc, String) {
    let dir = dir.to_str().expect("utf-8 path");
    let mut extra = vec![
        "--admin-token",
        TOKEN,
        "--state-dir",
        dir,
        "--snapshot-secs",
        "1",
    ];
    extra.extend_from_slice(more);
    let (proc, serve) = spawn_serve_with_env(std::slice::from_ref(&engine.line), &extra, &[]);
    let up = settle(
        30,
        || (0..ranks).all(|r| rank(&serve, "w0", r)["connected"] == true),
        |up| *up,
    );
    assert!(up, "the router never connected to every rank of w0");
    (proc, serve)
}

/// Waits (at most 10 s) until router `serve` has written a snapshot that it
/// began after this call: the second one to complete from now, as the first
/// may have been taken before (`kvroute_state_snapshots_written_total`; the
/// snapshots are written one after the other). None may have failed.
fn await_fresh_snapshot(serve: &str) {
    let written = || count(serve, "kvroute_state_snapshots_written_total");
    let before = written();
    eventually_within(
        "two more state snapshots written (kvroute_state_snapshots_written_total)",
        Duration::from_secs(10),
        || written() >= before + 2,
    );
    assert_eq!(count(serve, "kvroute_state_snapshot_failures_total"), 0);
}

/// Prompts that the router predicts differently from the engine's cache.
fn wrong(serve: &str, engine: &Engine, prompts: &[Vec<u32>]) -> Vec<(usize, u64, u64)> {
    wrong_on(serve, engine, 0, prompts)
}

/// [`wrong`] on one rank: (prompt, predicted, held).
fn wrong_on(
    serve: &str,
    engine: &Engine,
    rank: u64,
    prompts: &[Vec<u32>],
) -> Vec<(usize, u64, u64)> {
    prompts
        .iter()
        .enumerate()
        .map(|(i, t)| {
            (
                i,
                predicted_on(serve, "w0", rank, t),
                engine_match(&engine.http, t, rank),
            )
        })
        .filter(|(_, router, held)| router != held)
        .collect()
}

/// 40 prompts through router A, whose engine's ring keeps 4 batches; A is
/// killed (`kill -9`, after a snapshot) and B starts on A's state: within
/// 3 s B predicts every prompt as the engine holds it, its rank verified
/// live. A router without the state could rebuild only the last 4.
#[test]
fn a_router_restarted_on_its_state_knows_what_the_ring_no_longer_holds() {
    let engine = Engine::start(1, &["--replay-buffer", "4"]);
    let dir = state_dir("warm");
    let (a, serve) = router(&engine, &dir);
    let prompts: Vec<Vec<u32>> = (0..40).map(prompt).collect();
    for tokens in &prompts {
        let r = call(&serve, "POST", "/v1/completions", &completion(tokens));
        assert_eq!(r.status, 200, "{}", r.body);
    }
    let left = settle(10, || wrong(&serve, &engine, &prompts), Vec::is_empty);
    assert!(left.is_empty(), "router A: {left:?}");
    await_fresh_snapshot(&serve);
    drop(a);
    let started = Instant::now();
    let (_b, serve) = router(&engine, &dir);
    let left = settle(3, || wrong(&serve, &engine, &prompts), Vec::is_empty);
    assert!(
        left.is_empty(),
        "router B after {:?}: {left:?}",
        started.elapsed()
    );
    let state = settle(
        3,
        || rank(&serve, "w0", 0)["state"].clone(),
        |s| *s == "live",
    );
    assert_eq!(state, "live");
    assert!(counter(&rank(&serve, "w0", 0), "verifies") >= 1);
    let _ = std::fs::remove_dir_all(&dir);
}

/// The snapshot is one index whatever the shard count: a router whose index
/// has 2 shards of ranks (ranks 0 and 1 of a two-rank engine in different
/// shards) saves it, and one with 3 shards starts on it and predicts every
/// prompt on both ranks as the engine holds it, beyond its 4-batch rings.
#[test]
fn a_snapshot_of_a_sharded_index_restores_into_another_shard_count() {
    let engine = Engine::start(2, &["--replay-buffer", "4"]);
    let dir = state_dir("shards");
    let (a, serve) = router_with(&engine, &dir, 2, &["--index-shards", "2"]);
    let prompts: Vec<Vec<u32>> = (0..40).map(prompt).collect();
    for tokens in &prompts {
        let r = call(&serve, "POST", "/v1/completions", &completion(tokens));
        assert_eq!(r.status, 200, "{}", r.body);
    }
    let all_wrong = |serve: &str| -> Vec<(u64, usize, u64, u64)> {
        (0..2)
            .flat_map(|r| {
                wrong_on(serve, &engine, r, &prompts)
                    .into_iter()
                    .map(move |(i, p, h)| (r, i, p, h))
            })
            .collect()
    };
    let left = settle(10, || all_wrong(&serve), Vec::is_empty);
    assert!(left.is_empty(), "router A: {left:?}");
    let held: u64 = (0..2)
        .map(|r| {
            prompts
                .iter()
                .filter(|t| engine_match(&engine.http, t, r) > 0)
                .count() as u64
        })
        .sum();
    assert!(
        held >= 30,
        "the engine's two ranks hold {held} of 80 prompt-ranks"
    );
    await_fresh_snapshot(&serve);
    drop(a);
    let (_b, serve) = router_with(&engine, &dir, 2, &["--index-shards", "3"]);
    let left = settle(3, || all_wrong(&serve), Vec::is_empty);
    assert!(left.is_empty(), "router B: {left:?}");
    let _ = std::fs::remove_dir_all(&dir);
}

/// The engine restarts while the router is down: the restored state is
/// proven wrong by the first resync, and the rank is cleared.
#[test]
fn restored_state_of_an_engine_that_restarted_meanwhile_is_dropped() {
    let mut engine = Engine::start(1, &[]);
    let dir = state_dir("stale");
    let (a, serve) = router(&engine, &dir);
    let prompts: Vec<Vec<u32>> = (0..3).map(prompt).collect();
    for tokens in &prompts {
        call(&serve, "POST", "/v1/completions", &completion(tokens));
    }
    let left = settle(10, || wrong(&serve, &engine, &prompts), Vec::is_empty);
    assert!(left.is_empty(), "router A: {left:?}");
    await_fresh_snapshot(&serve);
    drop(a);
    engine.kill();
    engine.restart();
    let (_b, serve) = router(&engine, &dir);
    let left = settle(5, || wrong(&serve, &engine, &prompts), Vec::is_empty);
    assert!(
        left.is_empty(),
        "router B kept the old engine's blocks: {left:?}"
    );
    assert!(counter(&rank(&serve, "w0", 0), "engine_restarts") >= 1);
    let _ = std::fs::remove_dir_all(&dir);
}
