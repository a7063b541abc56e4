//! Ingestion at fleet scale and batches for ranks a worker does not have:
//! real `kvroute serve` and `kvroute mocker`
//! processes on 127.0.0.1, observed through `/workers`, `/query`,
//! `/metrics` and `/proc`. Helpers are shared with [`super::restarts`].

use std::collections::BTreeMap;
use std::net::TcpStream;

use serde_json::{json, Value};

use crate::support::engine::{
    call, counter, engine_match, predicted, prompt, rank, send_to_engine, settle, Engine, TOKEN,
};
use crate::support::http::{metric, request_with};
use crate::support::*;

/// Ports no test binds (the suite's own come from the ephemeral range,
/// 32768 and up): the event and replay bases of two dead `dp: 1000` workers.
const DEAD_BASES: [(u16, u16); 2] = [(21_000, 23_000), (25_000, 27_000)];

/// The registration of a worker whose 1000 ranks have nothing listening.
fn dead_worker(name: &str, (events, replay): (u16, u16)) -> String {
    for port in (events..events + 1000).chain(replay..replay + 1000) {
        assert!(
            TcpStream::connect(("127.0.0.1", port)).is_err(),
            "port {port} was meant to be dead"
        );
    }
    json!({
        "name": name,
        "url": "http://127.0.0.1:9",
        "events": format!("tcp://127.0.0.1:{events}"),
        "replay": format!("tcp://127.0.0.1:{replay}"),
        "dp": 1000,
        "block_size": 16,
    })
    .to_string()
}

/// A `--worker` line as a registration body (numbers as numbers).
fn registration_of(line: &str) -> String {
    let fields: serde_json::Map<String, Value> = line
        .split(',')
        .filter_map(|kv| kv.split_once('='))
        .map(|(k, v)| {
            let value = v
                .parse::<u64>()
                .map_or(Value::String(v.to_owned()), Value::from);
            (k.to_owned(), value)
        })
        .collect();
    Value::Object(fields).to_string()
}

/// How many ranks of the workers named `names` are in each `state`
/// (`"<none>"` for a rank without one).
fn states(serve: &str, names: &[&str]) -> BTreeMap<String, usize> {
    let doc = call(serve, "GET", "/workers", "").json();
    let mut tally = BTreeMap::new();
    let workers = doc["workers"].as_array().cloned().unwrap_or_default();
    for w in workers
        .iter()
        .filter(|w| names.iter().any(|n| w["name"] == *n))
    {
        for r in w["ranks"].as_array().into_iter().flatten() {
            let state = r["state"].as_str().unwrap_or("<none>").to_owned();
            *tally.entry(state).or_insert(0) += 1;
        }
    }
    tally
}

/// Registers a worker: `POST /register` (the admin endpoint), or
/// `POST /workers` (the name the ingestion contract uses) if a router has
/// no `/register`.
fn register(serve: &str, body: &str) -> crate::support::http::Reply {
    let r = call(serve, "POST", "/register", body);
    if matches!(r.status, 404 | 405) {
        return call(serve, "POST", "/workers", body);
    }
    r
}

/// The `Threads:` line of `/proc/<pid>/status`.
fn threads_of(pid: u32) -> usize {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).expect("proc status");
    status
        .lines()
        .find_map(|l| l.strip_prefix("Threads:"))
        .and_then(|v| v.trim().parse().ok())
        .expect("a Threads line")
}

/// Two registrations of one worker with `dp: 1000` each, on ports where
/// nothing listens: every accepted rank stays followed (state
/// `disconnected`, not `error`), a genuine engine
/// registered afterwards becomes `live` and is indexed, the router keeps to
/// a fixed set of threads (cores + 8), and a registration beyond
/// `--max-ranks` is refused with 409 and registers nothing.
#[test]
fn two_thousand_dead_ranks_neither_lose_streams_nor_threads() {
    let (serve_proc, serve) = spawn_serve_with_env(
        &[],
        &["--admin-token", TOKEN],
        &[("KVROUTE_MAX_RANKS", "2100")],
    );
    eventually("serve up", || TcpStream::connect(&serve).is_ok());
    let dead = ["dead-a", "dead-b"];
    for (name, bases) in dead.iter().zip(DEAD_BASES) {
        let r = register(&serve, &dead_worker(name, bases));
        assert_eq!(r.status, 200, "registering {name}: {}", r.body);
    }
    let only_disconnected = BTreeMap::from([("disconnected".to_owned(), 2000)]);
    let seen = settle(20, || states(&serve, &dead), |s| *s == only_disconnected);
    assert_eq!(seen, only_disconnected, "the states of the 2000 dead ranks");

    let engine = Engine::start(1, &[]);
    let r = register(&serve, &registration_of(&engine.line));
    assert_eq!(r.status, 200, "registering the engine: {}", r.body);
    let live = settle(20, || rank(&serve, "w0", 0), |r| r["state"] == "live");
    assert_eq!(live["state"], "live", "the genuine engine's rank: {live}");
    let tokens = prompt(7);
    send_to_engine(&engine.http, &tokens);
    let held = engine_match(&engine.http, &tokens, 0);
    assert_eq!(held, 64, "the engine holds the prompt");
    let router = settle(20, || predicted(&serve, "w0", &tokens), |p| *p == held);
    assert_eq!(router, held, "the genuine engine's prompt in the index");

    let cores = std::thread::available_parallelism().map_or(1, |n| n.get());
    let threads = threads_of(serve_proc.0.id());
    eprintln!("router threads with 2001 ranks: {threads} ({cores} cores)");
    assert!(threads <= cores + 8, "{threads} threads on {cores} cores");

    let over = json!({
        "name": "over",
        "url": "http://127.0.0.1:9",
        "events": "tcp://127.0.0.1:29000",
        "replay": "tcp://127.0.0.1:29500",
        "dp": 100,
        "block_size": 16,
    });
    let r = register(&serve, &over.to_string());
    assert_eq!(
        r.status, 409,
        "2101 ranks with --max-ranks 2100: {}",
        r.body
    );
    let message = r.json()["error"]["message"]
        .as_str()
        .unwrap_or("")
        .to_owned();
    assert!(message.contains("--max-ranks"), "{}", r.body);
    assert_eq!(rank(&serve, "over", 0), Value::Null, "nothing registered");
}

/// An engine with four DP ranks, of which only rank 3's sockets are
/// registered, as a worker with one rank; its batches say dp_rank 3. They
/// are counted as foreign (`/workers` and
/// `kvroute_ingest_foreign_rank_batches_total`) and create no index state
/// (no phantom rank that no `/workers` entry shows and nothing clears).
#[test]
fn batches_for_a_rank_the_worker_does_not_have_are_counted_and_dropped() {
    let engine = Engine::start(4, &[]);
    let line = format!(
        "name=w0,url=http://{},events=tcp://127.0.0.1:{},replay=tcp://127.0.0.1:{},dp=1,block_size=16",
        engine.http,
        engine.events + 3,
        engine.replay + 3
    );
    let (_serve, serve) = start_serve(&[line], &[]);
    let rank3 = [("X-data-parallel-rank", "3")];
    for n in 0..3 {
        let r = request_with(
            &engine.http,
            "POST",
            "/v1/completions",
            &rank3,
            &crate::support::engine::completion(&prompt(n)),
        );
        assert_eq!(r.status, 200, "{}", r.body);
        assert_eq!(engine_match(&engine.http, &prompt(n), 3), 64);
    }
    let residencies = || metric(&serve, "kvroute_index_residencies").unwrap_or(0.0);
    let foreign = || counter(&rank(&serve, "w0", 0), "foreign_rank_batches");
    // Whichever the router does with them first: count them, or index them.
    settle(
        20,
        || (foreign(), residencies()),
        |(f, r)| *f > 0 || *r > 0.0,
    );
    assert_eq!(residencies(), 0.0, "index state from rank 3's batches");
    let r = rank(&serve, "w0", 0);
    assert!(counter(&r, "foreign_rank_batches") >= 1, "{r}");
    let total = metric(&serve, "kvroute_ingest_foreign_rank_batches_total");
    assert!(total.is_some_and(|t| t >= 1.0), "metric: {total:?}");
    assert_eq!(residencies(), 0.0, "index state from rank 3's batches");
}
