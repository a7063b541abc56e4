//! Prefill/decode fleets whose engines die or hang under traffic: real
//! mock-engine processes killed (`SIGKILL`: every connection refused from
//! then on) or stopped (`SIGSTOP`: connections accepted, never answered),
//! the router under test in front of them.
//!
//! A leg refused before any work goes to the next worker of its pool, so a
//! dead worker costs no client its request, not even the breaker's
//! half-open probes; a hung prefill engine is a 502 within
//! `--prefill-timeout-secs`, and its breaker keeps the next requests away.

use std::time::{Duration, Instant};

use serde_json::json;

use super::disagg::{auth, engine, prompt, start_serve};
use crate::support::http::{count, dechunk, request, request_with, Reply};
use crate::support::Proc;

/// Refused attempts the dead worker must have cost before a run ends: the
/// failure that opened its breaker, then at least three half-open probes.
const REFUSALS: u64 = 4;

/// A generous bound on a run's wall-clock time: reached only when the
/// router never sends the dead worker its probes.
const RUN_LIMIT: Duration = Duration::from_secs(180);

/// A split completion of a prompt of its own (`seed`), streamed every
/// other time, 8 tokens.
fn split_request(serve: &str, seed: u32) -> Reply {
    let stream = seed.is_multiple_of(2);
    let body = json!({"model": "mock-model", "prompt": prompt(seed), "max_tokens": 8,
        "stream": stream});
    request(serve, "POST", "/v1/completions", &body.to_string())
}

/// Whether a reply is a whole success: 200 and, for a stream, its `[DONE]`.
fn served(reply: &Reply) -> bool {
    if reply.status != 200 {
        return false;
    }
    if !reply.headers.contains("text/event-stream") {
        return true;
    }
    let (events, _) = dechunk(reply.body.as_bytes());
    String::from_utf8_lossy(&events)
        .trim_end()
        .ends_with("data: [DONE]")
}

/// What a run of requests against a fleet with a dead worker came to.
struct Run {
    /// Requests sent.
    sent: u32,
    /// Those not served whole: status and body.
    lost: Vec<(u16, String)>,
    /// The workers that answered the served ones.
    answered_by: Vec<String>,
}

impl Run {
    /// Prints what was lost after `what` and asserts that nothing was.
    fn assert_none_lost(&self, what: &str) {
        let lost = self.lost.len();
        eprintln!("{what}: {lost} of {} requests lost", self.sent);
        assert!(
            self.lost.is_empty(),
            "lost {lost} of {}: {:?}",
            self.sent,
            self.lost
        );
    }
}

/// Sends split requests one after another (prompts from `seed` on) until
/// the router has counted [`REFUSALS`] upstream errors, that is until the
/// dead worker has refused its first attempt and its breaker's half-open
/// probes; bounded by [`RUN_LIMIT`] only as a deadline.
fn requests_until_refused(serve: &str, seed: u32) -> Run {
    let (errors_before, started) = (
        count(serve, "kvroute_proxy_upstream_errors_total"),
        Instant::now(),
    );
    let mut run = Run {
        sent: 0,
        lost: Vec::new(),
        answered_by: Vec::new(),
    };
    loop {
        let refused = count(serve, "kvroute_proxy_upstream_errors_total") - errors_before;
        if refused >= REFUSALS {
            return run;
        }
        if started.elapsed() >= RUN_LIMIT {
            panic!(
                "only {refused} refused attempts after {} requests in {RUN_LIMIT:?}; \
                 first lost {:?}; workers: {}",
                run.sent,
                run.lost.first(),
                workers(serve)
            );
        }
        let reply = split_request(serve, seed + run.sent);
        run.sent += 1;
        if served(&reply) {
            run.answered_by
                .push(reply.header("x-kvroute-worker").unwrap_or_default());
        } else {
            run.lost.push((reply.status, reply.body));
        }
    }
}

/// The router's `/workers`, for a failure's message.
fn workers(serve: &str) -> String {
    request_with(serve, "GET", "/workers", &[("Authorization", &auth())], "").body
}

/// Ends a mock engine's process (SIGKILL): every connection to it is
/// refused from then on.
fn kill(engine: &mut Proc) {
    let _ = engine.0.kill();
    let _ = engine.0.wait();
}

/// A router flag set for these fleets: every request split, a breaker that
/// opens at the first failure and half-opens after a second, so its probes
/// come often.
const PROBING: [&str; 6] = [
    "--local-prefill-max-tokens",
    "0",
    "--breaker-failures",
    "1",
    "--breaker-open-secs",
    "1",
];

/// Probe 1b: a vLLM decode engine killed beside a healthy one. Its
/// refused decode legs (the first, and one at every half-open probe) go
/// to the other decode worker with the prefill's `kv_transfer_params`:
/// no request is lost.
#[test]
fn a_dead_vllm_decode_worker_costs_no_request_and_its_probes_none() {
    let (_p, p_line) = engine("vllm", "prefill", "p0");
    let (_d0, d0_line) = engine("vllm", "decode", "d0");
    let (mut d1, d1_line) = engine("vllm", "decode", "d1");
    let (_serve, serve) = start_serve(&[p_line, d0_line, d1_line], &PROBING, &["p0", "d0", "d1"]);
    for seed in 0..4 {
        let reply = split_request(&serve, 100 + seed);
        assert!(served(&reply), "{}: {}", reply.status, reply.body);
    }
    kill(&mut d1);
    let run = requests_until_refused(&serve, 200);
    run.assert_none_lost("dead vLLM decode worker");
    assert!(
        run.answered_by.iter().all(|w| w == "d0"),
        "{:?}",
        run.answered_by
    );
    assert!(count(&serve, "kvroute_proxy_retries_total") >= REFUSALS);
}

/// The same for SGLang, whose two legs go at once: a dead decode worker's
/// refusal sends both legs again, in new rooms, with the other decode
/// worker.
#[test]
fn a_dead_sglang_decode_worker_costs_no_request() {
    let (_p, p_line) = engine("sglang", "prefill", "p0");
    let (_d0, d0_line) = engine("sglang", "decode", "d0");
    let (mut d1, d1_line) = engine("sglang", "decode", "d1");
    let (_serve, serve) = start_serve(&[p_line, d0_line, d1_line], &PROBING, &["p0", "d0", "d1"]);
    kill(&mut d1);
    let run = requests_until_refused(&serve, 300);
    run.assert_none_lost("dead SGLang decode worker");
    assert!(
        run.answered_by.iter().all(|w| w == "d0"),
        "{:?}",
        run.answered_by
    );
}

/// A dead SGLang prefill engine (connection refused): both legs go again
/// with the next prefill worker's bootstrap server, and no request is
/// lost, at the failure or at any half-open probe.
#[test]
fn a_refused_sglang_prefill_sends_both_legs_to_the_next_prefill_worker() {
    let (mut p0, p0_line) = engine("sglang", "prefill", "p0");
    let (_p1, p1_line) = engine("sglang", "prefill", "p1");
    let (_d, d_line) = engine("sglang", "decode", "d0");
    let (_serve, serve) = start_serve(&[p0_line, p1_line, d_line], &PROBING, &["p0", "p1", "d0"]);
    for seed in 0..4 {
        let reply = split_request(&serve, 400 + seed);
        assert!(served(&reply), "{}: {}", reply.status, reply.body);
    }
    kill(&mut p0);
    let run = requests_until_refused(&serve, 500);
    run.assert_none_lost("dead SGLang prefill worker");
    assert!(count(&serve, "kvroute_proxy_retries_total") >= REFUSALS);
}

/// A process stopped with SIGSTOP until dropped (then SIGCONT): its
/// sockets accept connections and nothing answers.
struct Stopped(u32);

impl Stopped {
    fn new(engine: &Proc) -> Stopped {
        let pid = engine.0.id();
        signal("-STOP", pid);
        Stopped(pid)
    }
}

impl Drop for Stopped {
    fn drop(&mut self) {
        signal("-CONT", self.0);
    }
}

fn signal(which: &str, pid: u32) {
    let status = std::process::Command::new("kill")
        .args([which, &pid.to_string()])
        .status()
        .expect("kill runs");
    assert!(status.success(), "kill {which} {pid}");
}

/// Probe 1g: a hung SGLang prefill engine (stopped) is a 502 naming the
/// prefill timeout, well before `--request-timeout-secs`, instead of
/// holding the client; its breaker opens, and the requests after it go to
/// the other prefill worker.
#[test]
fn a_hung_sglang_prefill_is_a_502_within_the_prefill_timeout_and_is_avoided_after() {
    let (p0, p0_line) = engine("sglang", "prefill", "p0");
    let (_p1, p1_line) = engine("sglang", "prefill", "p1");
    let (_d, d_line) = engine("sglang", "decode", "d0");
    let flags = [
        "--local-prefill-max-tokens",
        "0",
        "--prefill-timeout-secs",
        "2",
        "--breaker-open-secs",
        "600",
    ];
    let (_serve, serve) = start_serve(&[p0_line, p1_line, d_line], &flags, &["p0", "p1", "d0"]);
    let _stopped = Stopped::new(&p0);
    // Each request is placed on p0 or p1 (equal costs, a random draw) until
    // one reaches the hung p0. The client waits at most 30 s for an answer.
    let mut failed = None;
    let mut seed = 600;
    while failed.is_none() {
        assert!(seed < 640, "no request reached the hung prefill worker");
        let started = Instant::now();
        let reply = split_request(&serve, seed);
        seed += 1;
        if !served(&reply) {
            failed = Some((reply, started.elapsed()));
        }
    }
    let Some((reply, took)) = failed else {
        unreachable!("the loop ends with a failure")
    };
    eprintln!(
        "hung SGLang prefill: status {} after {took:?}: {}",
        reply.status, reply.body
    );
    assert_eq!(
        reply.status, 502,
        "no answer from the router in 30 s: {}",
        reply.body
    );
    assert!(
        reply.body.contains("no prefill answer within 2 s"),
        "{}",
        reply.body
    );
    // Its breaker is open: every request after it is served, by p1.
    for seed in 700..706 {
        let reply = split_request(&serve, seed);
        assert!(served(&reply), "{}: {}", reply.status, reply.body);
    }
    assert_eq!(count(&serve, "kvroute_proxy_upstream_errors_total"), 1);
}
