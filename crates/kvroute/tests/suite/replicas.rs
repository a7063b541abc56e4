//! Router replicas over a real `nats-server -js`: a replica that starts
//! fresh resumes from its peer's snapshot beyond what the engines' rings
//! hold, replicas see each other's requests in flight and forget a dead
//! peer's, and neither a replica killed with `kill -9` nor NATS going away
//! costs a client request behind a retrying balancer. Real `kvroute serve`,
//! `kvroute mocker` and `kvroute bench` processes.
//!
//! The replica settings go in as `KVROUTE_NATS` / `KVROUTE_REPLICA_ID`,
//! which a build without replicas ignores: against such a build these tests
//! fail on what they assert, not on a refused flag.

use std::process::Stdio;
use std::time::{Duration, Instant};

use kvroute_loadgen::nats::NatsServer;
use serde_json::Value;

use crate::support::engine::{call, completion, predicted, prompt, rank, settle, Engine, TOKEN};
use crate::support::*;

/// A replica named `id` following `lines`, sharing state over `nats`.
fn replica(lines: &[String], nats: &NatsServer, id: &str, extra: &[&str]) -> (Proc, String) {
    let url = nats.url();
    let env = [("KVROUTE_NATS", url.as_str()), ("KVROUTE_REPLICA_ID", id)];
    let mut flags = vec!["--admin-token", TOKEN];
    flags.extend_from_slice(extra);
    let (proc, serve) = spawn_serve_with_env(lines, &flags, &env);
    let up = settle(
        30,
        || {
            std::net::TcpStream::connect(&serve).is_ok()
                && call(&serve, "GET", "/workers", "").json()["workers"]
                    .as_array()
                    .is_some_and(|w| {
                        w.len() == lines.len()
                            && w.iter().all(|w| {
                                w["ranks"].as_array().is_some_and(|r| {
                                    !r.is_empty() && r.iter().all(|r| r["connected"] == true)
                                })
                            })
                    })
        },
        |up| *up,
    );
    assert!(up, "replica {id} never connected to its engines");
    (proc, serve)
}

/// The replica section of `/workers`.
fn sync(serve: &str) -> Value {
    call(serve, "GET", "/workers", "").json()["replicas"].clone()
}

/// Requests in flight at `serve`, over every rank (its own and its peers').
fn in_flight(serve: &str) -> f64 {
    let text = call(serve, "GET", "/metrics", "").body;
    text.lines()
        .filter(|l| l.starts_with("kvroute_active_requests{"))
        .filter_map(|l| l.rsplit(' ').next()?.parse::<f64>().ok())
        .sum()
}

/// 40 prompts through replica A, whose engine's ring keeps 4 batches; then
/// replica B starts with nothing of its own: within 3 s it predicts every
/// prompt exactly as A does (it asked A for a fresh snapshot, loaded it
/// from the object store and resumed the rank from its sequence number).
/// Without the snapshot B could rebuild only the ring's last 4 batches.
#[test]
fn a_fresh_replica_resumes_from_its_peers_snapshot_beyond_the_ring() {
    let nats = NatsServer::start().expect("nats-server starts");
    let engine = Engine::start(1, &["--replay-buffer", "4"]);
    let lines = [engine.line.clone()];
    let (_a, a) = replica(&lines, &nats, "a", &[]);
    let prompts: Vec<Vec<u32>> = (0..40).map(prompt).collect();
    for tokens in &prompts {
        let r = call(&a, "POST", "/v1/completions", &completion(tokens));
        assert_eq!(r.status, 200, "{}", r.body);
    }
    let at_a = |t: &Vec<u32>| predicted(&a, "w0", t);
    let held = settle(
        10,
        || prompts.iter().map(at_a).collect::<Vec<_>>(),
        |p| p.iter().all(|&n| n >= 64),
    );
    assert!(held.iter().all(|&n| n >= 64), "replica A: {held:?}");
    let started = Instant::now();
    let (_b, b) = replica(&lines, &nats, "b", &[]);
    let differ = || {
        prompts
            .iter()
            .enumerate()
            .filter(|(_, t)| predicted(&b, "w0", t) != at_a(t))
            .map(|(i, _)| i)
            .collect::<Vec<_>>()
    };
    let left = settle(3, differ, Vec::is_empty);
    assert!(
        left.is_empty(),
        "replica B after {:?} predicts differently from A for prompts {left:?}",
        started.elapsed()
    );
    assert_eq!(rank(&b, "w0", 0)["state"], "live");
}

/// A long request routed by A is in B's load within a second, leaves it
/// when it ends, and when A is killed with requests in flight B forgets
/// them after A's silence (3.5 s) instead of keeping them until they expire.
#[test]
fn replicas_share_requests_in_flight_and_forget_a_dead_peers() {
    let nats = NatsServer::start().expect("nats-server starts");
    let (_fleet, lines) = start_mocker(2, "1");
    let (a_proc, a) = replica(&lines, &nats, "a", &[]);
    let (_b, b) = replica(&lines, &nats, "b", &[]);
    let peers_heard = settle(
        5,
        || sync(&b)["peers"].as_array().map_or(0, Vec::len),
        |n| *n == 1,
    );
    assert_eq!(peers_heard, 1, "B never heard A: {}", sync(&b));
    let long = serde_json::json!({"prompt": prompt(1), "max_tokens": 150}).to_string();
    let sender = {
        let (a, body) = (a.clone(), long.clone());
        std::thread::spawn(move || call(&a, "POST", "/v1/completions", &body).status)
    };
    let seen = settle(2, || in_flight(&b), |n| *n >= 1.0);
    assert_eq!(seen, 1.0, "B does not see A's request in flight");
    assert_eq!(sender.join().expect("sender"), 200);
    let after = settle(2, || in_flight(&b), |n| *n == 0.0);
    assert_eq!(after, 0.0, "B kept A's finished request");
    for n in 0..2 {
        let (a, body) = (
            a.clone(),
            serde_json::json!({"prompt": prompt(10 + n), "max_tokens": 2000}).to_string(),
        );
        std::thread::spawn(move || call(&a, "POST", "/v1/completions", &body));
    }
    let seen = settle(2, || in_flight(&b), |n| *n >= 2.0);
    assert_eq!(seen, 2.0, "B does not see A's two requests");
    drop(a_proc);
    let killed = Instant::now();
    let after = settle(8, || in_flight(&b), |n| *n == 0.0);
    assert_eq!(after, 0.0, "B kept a dead peer's requests");
    assert!(
        killed.elapsed() >= Duration::from_secs(3),
        "forgotten before the silence ran out"
    );
    let expired = crate::support::http::metric(&b, "kvroute_replica_peers_expired_total");
    assert_eq!(expired, Some(1.0));
}

/// Two replicas learning speeds (`--learn-speeds`), a fleet of three
/// engines and one at an eighth of their speed, and every request through
/// replica A: replica B, which relays none, learns the slow engine's speed
/// from A's observations, and prices it as A does.
#[test]
fn a_replica_learns_speeds_from_the_responses_its_peer_relays() {
    let nats = NatsServer::start().expect("nats-server starts");
    let (_fast, mut lines) = start_mocker_with(3, &["--num-gpu-blocks", "2048", "--speedup", "4"]);
    let (_slow, slow) = start_mocker_with(1, &["--num-gpu-blocks", "2048", "--speedup", "0.5"]);
    lines.push(slow[0].replacen("name=w0", "name=slow", 1));
    let (_a, a) = replica(&lines, &nats, "a", &["--learn-speeds"]);
    let (_b, b) = replica(&lines, &nats, "b", &["--learn-speeds"]);
    let peers_heard = settle(
        5,
        || sync(&b)["peers"].as_array().map_or(0, Vec::len),
        |n| *n == 1,
    );
    assert_eq!(peers_heard, 1, "B never heard A: {}", sync(&b));
    super::routing::bench_long(&a, 400);
    let metric = |serve: &str, name: &str| crate::support::http::metric(serve, name).unwrap_or(0.0);
    let sent = metric(&a, "kvroute_replica_speed_observations_sent_total");
    assert!(sent >= 300.0, "A shared {sent} observations");
    let received = settle(
        3,
        || metric(&b, "kvroute_replica_speed_observations_received_total"),
        |n| *n >= sent,
    );
    assert_eq!(received, sent, "B fed its learner what A sent");
    let learned = |serve: &str| {
        let doc = call(serve, "GET", "/workers", "").json();
        let slow = doc["workers"]
            .as_array()
            .and_then(|ws| ws.iter().find(|w| w["name"] == "slow").cloned());
        slow.and_then(|w| w["ranks"][0]["learned_speed"].as_f64())
    };
    let (at_a, at_b) = (
        learned(&a).expect("A learned"),
        learned(&b).expect("B learned"),
    );
    assert!(at_a < 0.5, "A learned the slow engine at {at_a}");
    // The same observations, B's with their times to the microsecond.
    assert!((at_b / at_a - 1.0).abs() < 0.02, "A {at_a}, B {at_b}");
    assert_eq!(metric(&b, "kvroute_proxy_requests_total"), 0.0);
}

/// `kvroute bench` over both replicas as a balancer that retries requests
/// no replica began to answer, for `secs` seconds, asking for whole
/// answers (a stream a dying replica was relaying cannot be retried by any
/// balancer once its first token reached the client).
fn bench(urls: &[&str], secs: &str) -> std::process::Child {
    let urls: Vec<String> = urls.iter().map(|u| format!("http://{u}")).collect();
    kvroute()
        .args([
            "bench",
            "--url",
            &urls.join(","),
            "--requests",
            "0",
            "--duration-secs",
            secs,
            "--no-stream",
        ])
        .args([
            "--concurrency",
            "8",
            "--scale",
            "0.05",
            "--max-tokens",
            "8",
            "--json",
            "--no-progress",
        ])
        .stdout(Stdio::piped())
        .stderr(Stdio::null())
        .spawn()
        .expect("kvroute bench runs")
}

/// Completion requests `serve` has received (`kvroute_proxy_requests_total`).
fn requests(serve: &str) -> u64 {
    crate::support::http::count(serve, "kvroute_proxy_requests_total")
}

/// Waits (at most 15 s) until each of `serves` has received 10 requests
/// more than `before` says it had: the bench's load is flowing through it.
fn await_load(serves: &[&str], before: &[u64]) {
    for (serve, before) in serves.iter().zip(before) {
        eventually_within(
            &format!("10 requests of the bench through {serve}"),
            Duration::from_secs(15),
            || requests(serve) >= before + 10,
        );
    }
}

/// The bench's report of its one policy.
fn report(child: std::process::Child) -> Value {
    let out = child.wait_with_output().expect("bench ends");
    assert!(out.status.success(), "bench failed");
    let doc: Value = serde_json::from_slice(&out.stdout).expect("bench JSON");
    doc["policies"]
        .as_object()
        .and_then(|p| p.values().next().cloned())
        .expect("one policy")
}

/// Under load through both replicas: NATS killed and restarted, then one
/// replica killed with `kill -9`. No client request fails; the replicas
/// count the outage, reconnect and hear each other again.
#[test]
fn neither_nats_nor_a_replica_going_away_fails_a_request() {
    let mut nats = NatsServer::start().expect("nats-server starts");
    let (_fleet, lines) = start_mocker(4, "100");
    let (a_proc, a) = replica(&lines, &nats, "a", &[]);
    let (_b, b) = replica(&lines, &nats, "b", &[]);
    let load = bench(&[&a, &b], "5");
    await_load(&[&a, &b], &[0, 0]);
    nats.kill().expect("nats killed");
    for serve in [&a, &b] {
        let seen = settle(5, || sync(serve), |s| s["connected"] == false);
        assert_eq!(
            seen["connected"], false,
            "{serve} did not notice the outage within 5 s: {seen}"
        );
    }
    nats.restart().expect("nats restarts");
    let r = report(load);
    assert_eq!(r["failed"], 0, "NATS outage: {r}");
    assert!(r["requests"].as_u64().unwrap_or(0) > 50, "{r}");
    for serve in [&a, &b] {
        let back = settle(
            10,
            || sync(serve),
            |s| s["connected"] == true && s["peers"].as_array().map_or(0, Vec::len) == 1,
        );
        assert_eq!(back["connected"], true, "{serve}: {back}");
        assert!(
            back["outages"].as_u64().unwrap_or(0) >= 1,
            "{serve}: {back}"
        );
        assert_eq!(
            back["peers"].as_array().map_or(0, Vec::len),
            1,
            "{serve} lost its peer: {back}"
        );
        let gauge = crate::support::http::metric(serve, "kvroute_replica_nats_connected");
        assert_eq!(gauge, Some(1.0));
    }
    let before = requests(&a);
    let load = bench(&[&a, &b], "4");
    await_load(&[&a], &[before]);
    drop(a_proc);
    let r = report(load);
    assert_eq!(r["failed"], 0, "replica killed: {r}");
    assert!(
        r["retried"].as_u64().unwrap_or(0) >= 1,
        "nothing went to the dead replica: {r}"
    );
}

/// `kvroute bench restore` starts routers on a saved index from each
/// source and checks each came back with every residency.
#[test]
fn bench_restore_times_a_start_from_the_state_dir_and_from_nats() {
    let out = kvroute()
        .args([
            "bench",
            "restore",
            "--residencies",
            "20000",
            "--workers",
            "8",
        ])
        .args(["--runs", "1", "--json"])
        .stderr(Stdio::null())
        .output()
        .expect("kvroute bench restore runs");
    assert!(out.status.success(), "bench restore failed");
    let doc: Value = serde_json::from_slice(&out.stdout).expect("JSON");
    assert!(doc["residencies"].as_u64().unwrap_or(0) >= 20_000, "{doc}");
    for source in ["state_dir", "nats_with_a_live_peer", "nats_from_the_bucket"] {
        let ms = doc[source]["ready_ms_median"].as_f64().unwrap_or(0.0);
        assert!(ms > 0.0, "{source}: {doc}");
    }
}
