//! Engine restarts and replays the router cannot take on trust (issue 2.3,
//! findings 2 to 4): real `kvroute serve` and `kvroute mocker` processes on
//! 127.0.0.1, an engine killed with SIGKILL and started again on the same
//! ports, and the router's `/query` predictions compared with what the
//! engine itself holds (`/internal/cache_match`).
//!
//! Only the observable interface is used: processes, HTTP, `/workers` JSON
//! and `/metrics` text. Router settings are given as `KVROUTE_*` variables
//! (a build without them ignores them instead of refusing to start, so these
//! tests fail on such a build at their assertions, not at start-up).

use std::net::TcpListener;
use std::time::{Duration, Instant};

use serde_json::{json, Value};

use crate::support::http::{request_with, Reply};
use crate::support::*;

/// The admin token every router of these tests is started with.
pub const TOKEN: &str = "secret";

/// A request with the router's bearer token (ignored by the engines).
pub fn call(host_port: &str, method: &str, path: &str, body: &str) -> Reply {
    let auth = format!("Bearer {TOKEN}");
    request_with(host_port, method, path, &[("Authorization", &auth)], body)
}

/// Prompt `n`: 70 token ids, four full blocks and a partial one, so the
/// engine's `cached_tokens` for it (never the whole prompt) and the router's
/// prediction (full blocks) are both 64 when it is cached. Prompts differ
/// from their first token on.
pub fn prompt(n: u32) -> Vec<u32> {
    (0..70).map(|i| 1_000 + n * 101 + i).collect()
}

/// A `/v1/completions` body for `tokens`, one output token.
pub fn completion(tokens: &[u32]) -> String {
    json!({"model": "mock-model", "prompt": tokens, "max_tokens": 1}).to_string()
}

/// Sends `tokens` straight to an engine (not through the router).
pub fn send_to_engine(engine: &str, tokens: &[u32]) {
    let r = call(engine, "POST", "/v1/completions", &completion(tokens));
    assert_eq!(r.status, 200, "engine {engine}: {}", r.body);
}

/// The prompt tokens of `tokens` that rank `rank` of an engine holds now.
pub fn engine_match(engine: &str, tokens: &[u32], rank: u64) -> u64 {
    let r = call(engine, "POST", "/internal/cache_match", &completion(tokens));
    assert_eq!(r.status, 200, "cache_match on {engine}: {}", r.body);
    r.json()["ranks"]
        .as_array()
        .and_then(|ranks| ranks.iter().find(|x| x["rank"] == rank))
        .and_then(|x| x["matched_tokens"].as_u64())
        .expect("matched_tokens")
}

/// The router's predicted cached tokens of `tokens` on `worker` rank 0.
pub fn predicted(serve: &str, worker: &str, tokens: &[u32]) -> u64 {
    predicted_on(serve, worker, 0, tokens)
}

/// The router's predicted cached tokens of `tokens` on a rank of `worker`.
pub fn predicted_on(serve: &str, worker: &str, rank: u64, tokens: &[u32]) -> u64 {
    let r = call(
        serve,
        "POST",
        "/query",
        &json!({ "token_ids": tokens }).to_string(),
    );
    assert_eq!(r.status, 200, "/query: {}", r.body);
    r.json()["scores"][worker][rank.to_string()]
        .as_u64()
        .unwrap_or(0)
}

/// `worker`'s rank `dp_rank` in `/workers` (`Null` if not listed).
pub fn rank(serve: &str, worker: &str, dp_rank: u64) -> Value {
    let doc = call(serve, "GET", "/workers", "").json();
    doc["workers"]
        .as_array()
        .and_then(|ws| ws.iter().find(|w| w["name"] == worker))
        .and_then(|w| {
            w["ranks"]
                .as_array()?
                .iter()
                .find(|r| r["dp_rank"] == dp_rank)
        })
        .cloned()
        .unwrap_or(Value::Null)
}

/// A counter of a rank in `/workers` (0 when absent).
pub fn counter(rank: &Value, field: &str) -> u64 {
    rank[field].as_u64().unwrap_or(0)
}

/// Polls `probe` every 50 ms until `done` holds of its answer or `secs`
/// pass; returns the last answer (for the caller's assertion message).
pub fn settle<T>(secs: u64, mut probe: impl FnMut() -> T, done: impl Fn(&T) -> bool) -> T {
    let deadline = Instant::now() + Duration::from_secs(secs);
    loop {
        let seen = probe();
        if done(&seen) || Instant::now() >= deadline {
            return seen;
        }
        std::thread::sleep(Duration::from_millis(50));
    }
}

/// A free port `p` with `p + 1 .. p + n` free too, not within `n` of any in `avoid`.
pub fn free_port_run(n: u16, avoid: &[u16]) -> u16 {
    loop {
        let p = free_port();
        let clear = avoid.iter().all(|a| a.abs_diff(p) > n);
        if clear
            && p.checked_add(n).is_some()
            && (1..n).all(|k| TcpListener::bind(("127.0.0.1", p + k)).is_ok())
        {
            return p;
        }
    }
}

/// One mock engine on fixed ports (HTTP, events, replay), so that it can be
/// killed and started again on the same ones, as an engine restart is.
pub struct Engine {
    proc: Option<Proc>,
    args: Vec<String>,
    /// The engine's `--worker` line.
    pub line: String,
    /// The engine's HTTP `host:port`.
    pub http: String,
    /// The KV-event PUB port of rank 0 (rank r: + r).
    pub events: u16,
    /// The replay ROUTER port of rank 0 (rank r: + r).
    pub replay: u16,
}

impl Engine {
    /// An engine with `dp` ranks, 100 times faster than real time, and `extra` flags.
    pub fn start(dp: u16, extra: &[&str]) -> Engine {
        let http = free_port();
        let events = free_port_run(dp, &[http]);
        let replay = free_port_run(dp, &[http, events]);
        let mut args: Vec<String> = [
            "--port",
            &http.to_string(),
            "--kv-events-port",
            &events.to_string(),
            "--replay-port",
            &replay.to_string(),
            "--dp-size",
            &dp.to_string(),
            "--speedup",
            "100",
        ]
        .iter()
        .map(|s| s.to_string())
        .collect();
        args.extend(extra.iter().map(|s| s.to_string()));
        let mut engine = Engine {
            proc: None,
            args,
            line: String::new(),
            http: format!("127.0.0.1:{http}"),
            events,
            replay,
        };
        engine.launch();
        engine
    }

    fn launch(&mut self) {
        let args: Vec<&str> = self.args.iter().map(String::as_str).collect();
        let (proc, mut lines) = spawn_mocker(&args, 1);
        self.proc = Some(proc);
        self.line = lines.remove(0);
    }

    /// `kill -9`, and waits until the process is gone.
    pub fn kill(&mut self) {
        drop(self.proc.take());
    }

    /// Starts the engine again on the same ports (an empty cache, seq from 0).
    pub fn restart(&mut self) {
        assert!(self.proc.is_none(), "kill the engine first");
        self.launch();
    }
}

/// A router following `engine`'s line, with an admin token, `env` settings,
/// every rank connected.
pub fn router_for(engine: &Engine, env: &[(&str, &str)]) -> (Proc, String) {
    let lines = [engine.line.clone()];
    let (proc, serve) = spawn_serve_with_env(&lines, &["--admin-token", TOKEN], env);
    let up = settle(
        30,
        || {
            std::net::TcpStream::connect(&serve).is_ok()
                && rank(&serve, "w0", 0)["connected"] == true
        },
        |up| *up,
    );
    assert!(up, "the router never connected to w0");
    (proc, serve)
}

/// Router prediction and engine match of each named prompt that differ.
fn disagreements(serve: &str, engine: &str, prompts: &[(String, Vec<u32>)]) -> Vec<String> {
    prompts
        .iter()
        .filter_map(|(name, tokens)| {
            let (router, held) = (
                predicted(serve, "w0", tokens),
                engine_match(engine, tokens, 0),
            );
            (router != held).then(|| format!("{name}: router {router}, engine {held}"))
        })
        .collect()
}

/// Polls (at most `secs`) until the router predicts every prompt as the
/// engine holds it; panics with the prompts it still gets wrong.
fn assert_predictions_match(serve: &str, engine: &str, prompts: &[(String, Vec<u32>)], secs: u64) {
    let wrong = settle(
        secs,
        || disagreements(serve, engine, prompts),
        Vec::is_empty,
    );
    assert!(
        wrong.is_empty(),
        "after {secs} s the router's predictions still differ from the engine's cache: {wrong:?}"
    );
}

/// Prompts `range`, named `label n`.
fn named(label: &str, range: std::ops::Range<u32>) -> Vec<(String, Vec<u32>)> {
    range.map(|n| (format!("{label} {n}"), prompt(n))).collect()
}

/// Sends prompts 0..3 to the engine and waits until the router holds them
/// (its `last_seq` is 2: one batch per prompt).
fn three_old_prompts(serve: &str, engine: &Engine) -> Vec<(String, Vec<u32>)> {
    let old = named("old prompt", 0..3);
    for (_, tokens) in &old {
        send_to_engine(&engine.http, tokens);
    }
    assert_predictions_match(serve, &engine.http, &old, 20);
    for (name, tokens) in &old {
        assert_eq!(
            predicted(serve, "w0", tokens),
            64,
            "{name} before the restart"
        );
    }
    old
}

/// The rank's `engine_restarts` after the predictions have been checked.
fn assert_restart_counted(serve: &str) {
    let r = rank(serve, "w0", 0);
    assert!(
        counter(&r, "engine_restarts") >= 1,
        "the restart was not counted: {r}"
    );
}

/// Finding 2: the engine is killed, stays down past the router's reconnect
/// backoff (10 s), and comes back on the same ports publishing 10 new
/// batches (seq 0-9) before the router reconnects. Today's router asks the
/// new engine to replay from seq 3 and applies its batches 3-9 as if they
/// continued the old stream: the old prompts stay predicted, some new ones
/// are missing, and no counter moves. The router must prove continuity:
/// forget the old engine's blocks, index the new ones, count the restart.
#[test]
fn an_engine_restarted_between_reconnects_is_detected_and_reindexed() {
    let mut engine = Engine::start(1, &[]);
    let (_serve, serve) = router_for(&engine, &[]);
    let old = three_old_prompts(&serve, &engine);
    assert_eq!(counter(&rank(&serve, "w0", 0), "last_seq"), 2);
    engine.kill();
    std::thread::sleep(Duration::from_secs(10));
    engine.restart();
    let new = named("new prompt", 100..110);
    for (_, tokens) in &new {
        send_to_engine(&engine.http, tokens);
    }
    let all: Vec<_> = old.into_iter().chain(new).collect();
    assert_predictions_match(&serve, &engine.http, &all, 20);
    assert_restart_counted(&serve);
}

/// An engine, a router verifying every second, three prompts cached and
/// predicted; then the engine killed and started again within 0.3 s.
fn cached_then_restarted_fast() -> (Engine, Proc, String, Vec<(String, Vec<u32>)>) {
    let mut engine = Engine::start(1, &[]);
    let (proc, serve) = router_for(&engine, &[("KVROUTE_VERIFY_SECS", "1")]);
    let old = three_old_prompts(&serve, &engine);
    let killed = Instant::now();
    engine.kill();
    engine.restart();
    let down = killed.elapsed();
    eprintln!("engine down for {down:?}");
    assert!(down < Duration::from_millis(300), "restart took {down:?}");
    (engine, proc, serve, old)
}

/// Finding 3, no traffic: the engine is killed and started again within
/// 0.3 s and then stays quiet. Today the replay of its new, empty ring
/// counts as `replays_ok` and the old blocks stay until the engine publishes
/// again. Within `--verify-secs` (1 here) and a few seconds the router must
/// find out, predict 0 for the old prompts (as the engine) and count it.
#[test]
fn a_fast_engine_restart_with_no_traffic_drops_the_old_blocks() {
    let (engine, _serve, serve, old) = cached_then_restarted_fast();
    assert_predictions_match(&serve, &engine.http, &old, 8);
    assert_restart_counted(&serve);
}

/// Finding 3, with traffic: the engine is killed and started again within
/// 0.3 s and at once given 5 new prompts (seq 0-4 of the new engine, past
/// the old stream's last seq 2). The router must predict the old prompts 0
/// and the new ones as the engine holds them within `--verify-secs` (1) and
/// a few seconds, and count the restart.
#[test]
fn a_fast_engine_restart_with_traffic_reindexes_the_new_engine() {
    let (engine, _serve, serve, old) = cached_then_restarted_fast();
    let new = named("new prompt", 200..205);
    for (_, tokens) in &new {
        send_to_engine(&engine.http, tokens);
    }
    let all: Vec<_> = old.into_iter().chain(new).collect();
    assert_predictions_match(&serve, &engine.http, &all, 8);
    assert_restart_counted(&serve);
}

/// Finding 4: the engine's replay ring (`--replay-buffer 20`) has wrapped
/// (40 batches published) before a router starts. Today the replay that
/// starts at seq 20 instead of 0 counts as `replays_ok`. It must count as
/// `replays_incomplete` and put the rank in state `degraded`; and once
/// requests have been routed (the router learns from the engine's
/// `cached_tokens`), prompts the engine holds from before the ring's start
/// must be predicted as the engine holds them.
#[test]
fn a_replay_from_a_wrapped_ring_is_incomplete_and_degraded() {
    let engine = Engine::start(1, &["--replay-buffer", "20"]);
    let early = named("prompt", 0..40);
    for (_, tokens) in &early {
        send_to_engine(&engine.http, tokens);
    }
    let (_serve, serve) = router_for(&engine, &[]);
    let r = settle(
        20,
        || rank(&serve, "w0", 0),
        |r| {
            counter(r, "replays_ok") + counter(r, "replays_incomplete") >= 1
                && r["state"] != "replaying"
        },
    );
    assert!(
        counter(&r, "replays_incomplete") >= 1,
        "a replay that could not reach seq 0 was not called incomplete: {r}"
    );
    assert_eq!(r["state"], "degraded", "{r}");
    assert!(
        r["state_reason"].is_string(),
        "a degraded rank says why: {r}"
    );
    // Prompts 0-4 were published long before the ring's first batch.
    let lost = &early[..5];
    for (name, tokens) in lost {
        assert_eq!(
            engine_match(&engine.http, tokens, 0),
            64,
            "{name} on the engine"
        );
        let routed = call(&serve, "POST", "/v1/completions", &completion(tokens));
        assert_eq!(routed.status, 200, "{name}: {}", routed.body);
    }
    assert_predictions_match(&serve, &engine.http, lost, 15);
}
