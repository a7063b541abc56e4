//! A router restarted with `--state-dir` comes back with what it knew,
//! beyond what the engines' replay rings still hold, and still notices an
//! engine that restarted while it was away: real `kvroute serve` and
//! `kvroute mocker` processes.

use std::path::PathBuf;
use std::time::{Duration, Instant};

use super::restarts::{
    call, completion, counter, engine_match, predicted, prompt, rank, settle, Engine, TOKEN,
};
use crate::support::*;

/// A fresh directory for one test's state.
fn state_dir(name: &str) -> PathBuf {
    let dir = std::env::temp_dir().join(format!("kvroute-{name}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    dir
}

/// A router following `engine` that keeps its state in `dir`, every second.
fn router(engine: &Engine, dir: &std::path::Path) -> (Proc, String) {
    let dir = dir.to_str().expect("utf-8 path");
    let extra = [
        "--admin-token",
        TOKEN,
        "--state-dir",
        dir,
        "--snapshot-secs",
        "1",
    ];
    let (proc, serve) = spawn_serve_with_env(std::slice::from_ref(&engine.line), &extra, &[]);
    let up = settle(30, || rank(&serve, "w0", 0)["connected"] == true, |up| *up);
    assert!(up, "the router never connected to w0");
    (proc, serve)
}

/// Prompts that the router predicts differently from the engine's cache.
fn wrong(serve: &str, engine: &Engine, prompts: &[Vec<u32>]) -> Vec<(usize, u64, u64)> {
    prompts
        .iter()
        .enumerate()
        .map(|(i, t)| {
            (
                i,
                predicted(serve, "w0", t),
                engine_match(&engine.http, t, 0),
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
    std::thread::sleep(Duration::from_millis(2_500));
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
    std::thread::sleep(Duration::from_millis(2_500));
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
