//! Engine restarts and replays the router cannot take on trust: real
//! `kvroute serve` and `kvroute mocker` processes on 127.0.0.1, an engine
//! killed with SIGKILL and started again on the same ports, and the router's
//! `/query` predictions compared with what the engine itself holds
//! (`/internal/cache_match`).
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

/// A free port `p` with `p + 1 .. p + n` free too, not within `n` of any in
/// `avoid`: the base port of an engine with `n` data-parallel ranks, rank r
/// on base + r, which its `--worker` line implies and so must be chosen
/// before the engine starts. Racy as [`free_port`] is: use it for nothing
/// a child could bind as port 0 and report.
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

/// One mock engine that can be killed and started again on the same ports
/// (HTTP, events, replay), as an engine restart is. It first binds what it
/// can as port 0 and reports it (HTTP always; events and replay when it has
/// one rank), and is restarted on the ports it reported.
pub struct Engine {
    proc: Option<Proc>,
    dp: u16,
    extra: Vec<String>,
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
        // Rank r publishes on the base port + r (the line names rank 0's
        // ports only): several ranks need their bases chosen beforehand.
        let (events, replay) = if dp == 1 {
            (0, 0)
        } else {
            let events = free_port_run(dp, &[]);
            (events, free_port_run(dp, &[events]))
        };
        let mut engine = Engine {
            proc: None,
            dp,
            extra: extra.iter().map(|s| s.to_string()).collect(),
            line: String::new(),
            http: "127.0.0.1:0".into(),
            events,
            replay,
        };
        engine.launch();
        engine.http = format!("127.0.0.1:{}", port_of(&engine.line, "url"));
        (engine.events, engine.replay) = (
            port_of(&engine.line, "events"),
            port_of(&engine.line, "replay"),
        );
        engine
    }

    /// Starts the mocker on the engine's ports (0 for those not bound yet)
    /// and keeps its `--worker` line.
    fn launch(&mut self) {
        let http = self.http.rsplit(':').next().unwrap_or("0").to_owned();
        let (events, replay, dp) = (
            self.events.to_string(),
            self.replay.to_string(),
            self.dp.to_string(),
        );
        let mut args = vec![
            "--port",
            &http,
            "--kv-events-port",
            &events,
            "--replay-port",
            &replay,
            "--dp-size",
            &dp,
            "--speedup",
            "100",
        ];
        args.extend(self.extra.iter().map(String::as_str));
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

/// The port of field `key` (`url`, `events`, `replay`) of a `--worker` line.
pub fn port_of(line: &str, key: &str) -> u16 {
    line.split(',')
        .find_map(|kv| kv.strip_prefix(key)?.strip_prefix('='))
        .and_then(|v| v.rsplit(':').next()?.parse().ok())
        .unwrap_or_else(|| panic!("no port for `{key}` in {line}"))
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

/// An engine killed, down until the router's reconnect attempts have backed
/// off to their 2 s cap, and back on the same ports publishing 10 new
/// batches (seq 0-9) between two attempts: the new stream's seq 3-9 look
/// like a continuation of the old one (last seq 2) to a router that only
/// asks for a replay from seq 3. The router proves continuity instead: it
/// forgets the old engine's blocks, indexes the new ones and counts the
/// restart.
#[test]
fn an_engine_restarted_between_reconnects_is_detected_and_reindexed() {
    let mut engine = Engine::start(1, &[]);
    let (_serve, serve) = router_for(&engine, &[]);
    let old = three_old_prompts(&serve, &engine);
    assert_eq!(counter(&rank(&serve, "w0", 0), "last_seq"), 2);
    engine.kill();
    let down = settle(
        10,
        || rank(&serve, "w0", 0)["connected"].clone(),
        |c| *c == false,
    );
    assert_eq!(down, false, "the router never saw the engine go away");
    // Time, not an event: ZeroMQ's reconnect interval doubles from 100 ms
    // to its 2 s cap, its attempts falling 0.1, 0.3, 0.7, 1.5 and 3.1 s
    // after the disconnection, then 5.1 s: a restart just after 3.1 s
    // publishes within that 2 s window, before the router is back.
    std::thread::sleep(Duration::from_millis(3_200));
    engine.restart();
    let new = named("new prompt", 100..110);
    for (_, tokens) in &new {
        send_to_engine(&engine.http, tokens);
    }
    // The case under test: all of it published while the router was away.
    let r = rank(&serve, "w0", 0);
    assert!(
        r["connected"] == false && counter(&r, "last_seq") == 2,
        "the router was back before the engine had published: {r}"
    );
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

/// An engine killed and started again within 0.3 s that then stays quiet:
/// the replay of its new, empty ring is no proof of continuity. Within
/// `--verify-secs` (1 here) and a few seconds the router finds out, predicts
/// 0 for the old prompts (as the engine does) and counts the restart.
#[test]
fn a_fast_engine_restart_with_no_traffic_drops_the_old_blocks() {
    let (engine, _serve, serve, old) = cached_then_restarted_fast();
    assert_predictions_match(&serve, &engine.http, &old, 8);
    assert_restart_counted(&serve);
}

/// An engine killed and started again within 0.3 s and at once given 5 new
/// prompts (seq 0-4 of the new engine, past the old stream's last seq 2):
/// within `--verify-secs` (1) and a few seconds the router predicts the old
/// prompts 0 and the new ones as the engine holds them, and counts the
/// restart.
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

/// An engine whose replay ring (`--replay-buffer 20`) has wrapped (40
/// batches published) before a router starts: the replay that starts at
/// seq 20 instead of 0 counts as `replays_incomplete` and puts the rank in
/// state `degraded`, with a reason; once requests have been routed (the
/// router learns from the engine's `cached_tokens`), prompts the engine
/// holds from before the ring's start are predicted as the engine holds
/// them.
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
