//! One mock engine under test control, and what a test asks of it and of
//! the router in front of it: an engine started on ports a restart can
//! reuse, killed with SIGKILL and started again; prompts sent straight to
//! it; what it holds (`/internal/cache_match`) against what the router
//! predicts (`/query`); a rank's `/workers` counters.

use std::net::TcpListener;
use std::time::{Duration, Instant};

use serde_json::{json, Value};

use super::http::{request_with, Reply};
use super::*;

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
