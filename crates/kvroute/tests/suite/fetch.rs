//! Moving the cache instead of the work, end to end: `kvroute serve` with
//! `--fetch-us-per-block` in front of two aggregated vLLM mock engines.
//! Once the engine holding a prompt's prefix is loaded, the next request
//! with that prefix runs on the other engine, which receives the prefix
//! from the holder with the engines' own hand-off; a holder that dies
//! or hangs during its leg costs no request (the receiver recomputes).

use std::thread;

use serde_json::{json, Value};

use super::disagg::{auth, prompt, query, start_serve};
use crate::support::http::{count, dechunk, metric_where, request, Reply};
use crate::support::{eventually, spawn_this_builds_mocker, Proc};

/// The router's flags: the simulator's `kv-fetch` contender.
pub(super) const FETCH: [&str; 8] = [
    "--fetch-us-per-block",
    "20",
    "--fetch-margin",
    "1.6",
    "--prefill-load-scale",
    "24",
    "--request-kv-weight",
    "2",
];

/// Loaders sent at most before the holder is busy enough to fetch from.
const MAX_LOADERS: u32 = 24;

/// One aggregated mock engine named `name`, started with `engine_args`
/// (its flavour and any more flags), and its `--worker` line.
pub(super) fn engine_of(name: &str, engine_args: &[&str]) -> (Proc, String) {
    let args = [
        "--workers",
        "1",
        "--port",
        "0",
        "--kv-events-port",
        "0",
        "--replay-port",
        "0",
    ];
    let args: Vec<&str> = args.iter().chain(engine_args).copied().collect();
    let (child, mut lines) = spawn_this_builds_mocker(&args, 1);
    let line = lines.remove(0);
    let renamed = line
        .split(',')
        .map(|kv| match kv.starts_with("name=") {
            true => format!("name={name}"),
            false => kv.to_owned(),
        })
        .collect::<Vec<_>>()
        .join(",");
    (child, renamed)
}

/// The `host:port` of a `--worker` line's engine.
fn addr_of(line: &str) -> String {
    line.split(',')
        .find_map(|kv| kv.strip_prefix("url=http://"))
        .expect("url=")
        .trim_end_matches('/')
        .to_owned()
}

pub(super) fn completion(tokens: &[u32], max_tokens: u32, stream: bool) -> String {
    json!({"model": "mock-model", "prompt": tokens, "max_tokens": max_tokens,
        "stream": stream})
    .to_string()
}

/// The leading blocks `/query` says worker `name` holds of `tokens`.
pub(super) fn held_by(serve: &str, tokens: &[u32], name: &str) -> u64 {
    query(serve, tokens)["workers"]
        .as_array()
        .into_iter()
        .flatten()
        .filter(|w| w["name"] == name)
        .filter_map(|w| w["device_blocks"].as_u64())
        .max()
        .unwrap_or(0)
}

/// Sends streamed requests of `tokens` (`max_tokens` each) through the
/// router, in the background, until `/query` plans a fetch for the next
/// one; returns the plan and the loaders' threads (their replies).
pub(super) fn load_until_fetched(
    serve: &str,
    tokens: &[u32],
    max_tokens: u32,
) -> (Value, Vec<thread::JoinHandle<Reply>>) {
    load_until_planned(serve, tokens, max_tokens, "fetch")
}

/// [`load_until_fetched`] until `/query` shows a `plan` (`fetch` or
/// `replicate`) for the next request.
pub(super) fn load_until_planned(
    serve: &str,
    tokens: &[u32],
    max_tokens: u32,
    plan: &str,
) -> (Value, Vec<thread::JoinHandle<Reply>>) {
    let mut loaders = Vec::new();
    for _ in 0..MAX_LOADERS {
        let plan = query(serve, tokens)[plan].clone();
        if plan.is_object() {
            return (plan, loaders);
        }
        let active = count(serve, "kvroute_active_requests");
        let (serve_at, body) = (serve.to_owned(), completion(tokens, max_tokens, true));
        loaders.push(thread::spawn(move || {
            request(&serve_at, "POST", "/v1/completions", &body)
        }));
        eventually("the loader placed", || {
            count(serve, "kvroute_active_requests") > active
        });
    }
    panic!(
        "no {plan} planned after {MAX_LOADERS} loaders: {}",
        query(serve, tokens)
    );
}

pub(super) fn fetches(serve: &str, outcome: &str) -> u64 {
    let label = format!("outcome=\"{outcome}\"");
    metric_where(serve, "kvroute_proxy_fetches_total", &label).unwrap_or(0.0) as u64
}

/// The fleet: `a` (the holder-to-be) and `b`, the router in front, and
/// `a` holding the prompt's prefix (a request sent to it directly).
fn fleet(tokens: &[u32]) -> (Vec<Proc>, String) {
    fleet_with(tokens, &[])
}

/// [`fleet`] with `serve_extra` flags for the router besides [`FETCH`].
fn fleet_with(tokens: &[u32], serve_extra: &[&str]) -> (Vec<Proc>, String) {
    fleet_of(tokens, &["--engine-flavor", "vllm"], serve_extra)
}

/// [`fleet_with`] of engines started with `engine_args`.
pub(super) fn fleet_of(
    tokens: &[u32],
    engine_args: &[&str],
    serve_extra: &[&str],
) -> (Vec<Proc>, String) {
    let flags: Vec<&str> = FETCH.iter().chain(serve_extra).copied().collect();
    fleet_flagged(tokens, engine_args, &flags)
}

/// The fleet of [`fleet_of`], the router started with `flags` alone.
pub(super) fn fleet_flagged(
    tokens: &[u32],
    engine_args: &[&str],
    flags: &[&str],
) -> (Vec<Proc>, String) {
    let (a, a_line) = engine_of("a", engine_args);
    let (b, b_line) = engine_of("b", engine_args);
    let (serve, addr) = start_serve(&[a_line.clone(), b_line], flags, &["a", "b"]);
    let warm = request(
        &addr_of(&a_line),
        "POST",
        "/v1/completions",
        &completion(tokens, 1, false),
    );
    assert_eq!(warm.status, 200, "{}", warm.body);
    eventually("the index learns a holds the prefix", || {
        held_by(&addr, tokens, "a") >= 19
    });
    (vec![a, b, serve], addr)
}

/// A fetch executed: the receiver answers with the prefix reported
/// cached (it arrived from the holder), the decision says why, and the
/// index then lists the receiver as a holder too.
#[test]
fn a_busy_holders_prefix_is_fetched_by_a_cooler_rank() {
    let tokens = prompt(7);
    let (_procs, serve) = fleet(&tokens);
    // Long enough to keep the holder busy through the test.
    let (plan, loaders) = load_until_fetched(&serve, &tokens, 3_000);
    eprintln!("planned after {} loaders: {plan}", loaders.len());
    assert_eq!(plan["source"]["name"], "a", "{plan}");
    assert_eq!(plan["receiver"]["name"], "b", "{plan}");
    let reason = plan["reason"].as_str().unwrap_or_default();
    assert!(reason.starts_with("fetch: holder busy"), "{plan}");
    let handed_off = fetches(&serve, "handed_off");
    runs_cached_on(&serve, &tokens, "b");
    assert_eq!(fetches(&serve, "handed_off"), handed_off + 1);
    assert_eq!(fetches(&serve, "fell_back"), 0);
    eventually("the index learns b holds the prefix too", || {
        held_by(&serve, &tokens, "b") >= 19
    });
    let decisions = crate::support::http::request_with(
        &serve,
        "GET",
        "/api/stats",
        &[("Authorization", &auth())],
        "",
    )
    .json();
    let shown = decisions["decisions"].to_string();
    assert!(shown.contains("fetch: holder busy"), "{shown}");
}

/// The holder hangs with its leg in flight (stopped: the connection is
/// taken, nothing answers, as a slow transfer's source), then dies
/// (SIGKILL): the request falls back to recomputing on the receiver, and
/// every request, the streams the dead holder was running included (moved
/// on by migration), is answered whole.
#[test]
fn a_holder_that_dies_mid_fetch_costs_no_request() {
    let tokens = prompt(8);
    let (procs, serve) = fleet(&tokens);
    a_holder_dies_mid_fetch(procs, &serve, &tokens);
}

/// A busy holder `a` (the first of `procs`) frozen once the placer plans a
/// fetch off it, its leg sent, then killed: the fetched request falls back
/// to recomputing on `b`, counted, and every request is answered whole
/// (the engines' flavour is the caller's).
pub(super) fn a_holder_dies_mid_fetch(mut procs: Vec<Proc>, serve: &str, tokens: &[u32]) {
    let serve = serve.to_owned();
    let (plan, loaders) = load_until_fetched(&serve, tokens, 600);
    assert_eq!(plan["source"]["name"], "a", "{plan}");
    // Frozen with its load: the next request is placed as `/query` planned.
    let mut holder = procs.remove(0);
    signal("-STOP", holder.0.id());
    let started = count(&serve, "kvroute_proxy_fetches_started_total");
    let (serve_at, body) = (serve.clone(), completion(tokens, 4, false));
    let fetched = thread::spawn(move || request(&serve_at, "POST", "/v1/completions", &body));
    eventually("the holder's leg sent", || {
        count(&serve, "kvroute_proxy_fetches_started_total") > started
    });
    let _ = holder.0.kill();
    let _ = holder.0.wait();
    let reply = fetched.join().expect("the fetched request");
    assert_eq!(reply.status, 200, "{}", reply.body);
    assert_eq!(reply.header("x-kvroute-worker").as_deref(), Some("b"));
    assert_eq!(fetches(&serve, "fell_back"), 1, "the fallback counted");
    assert_eq!(fetches(&serve, "handed_off"), 0);
    for loader in loaders {
        assert_whole("a loader", &loader.join().expect("a loader"));
    }
}

/// Sends a 4-token request of `tokens` through the router: it runs on
/// worker `name` with the prompt's first 19 blocks reported cached.
pub(super) fn runs_cached_on(serve: &str, tokens: &[u32], name: &str) {
    let reply = request(
        serve,
        "POST",
        "/v1/completions",
        &completion(tokens, 4, false),
    );
    assert_eq!(reply.status, 200, "{}", reply.body);
    assert_eq!(reply.header("x-kvroute-worker").as_deref(), Some(name));
    let answer = reply.json();
    let cached = answer["usage"]["prompt_tokens_details"]["cached_tokens"]
        .as_u64()
        .unwrap_or(0);
    assert!(
        cached >= 19 * 16,
        "the prefix was cached on {name}: {answer}"
    );
}

/// A stream's reply ended whole (`[DONE]` last).
pub(super) fn assert_whole(what: &str, reply: &Reply) {
    assert_eq!(reply.status, 200, "{what}: {}", reply.body);
    let (events, _) = dechunk(reply.body.as_bytes());
    let events = String::from_utf8_lossy(&events);
    assert!(
        events.trim_end().ends_with("data: [DONE]"),
        "{what}: {events}"
    );
}

/// A holder that hangs with its leg in flight (stopped, never answering)
/// costs the request no more than `--prefill-timeout-secs`: it falls back
/// to recomputing on the receiver, counted, and the holder's breaker opens.
#[test]
fn a_hung_holder_falls_back_within_the_prefill_timeout() {
    let tokens = prompt(9);
    let (mut procs, serve) = fleet_with(&tokens, &["--prefill-timeout-secs", "1"]);
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

pub(super) fn signal(which: &str, pid: u32) {
    let status = std::process::Command::new("kill")
        .args([which, &pid.to_string()])
        .status()
        .expect("kill runs");
    assert!(status.success(), "kill {which} {pid}");
}
