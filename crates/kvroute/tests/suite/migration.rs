//! Migration: a request whose engine dies under it is finished by another
//! rank, and the client reads one whole answer; a long answer that runs
//! out of `--request-timeout-secs` is not a failing worker.

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use serde_json::{json, Value};

use crate::support::http::{self, count, dechunk, metric};
use crate::support::{
    eventually, eventually_within, polled_until, spawn_this_builds_mocker, start_serve, Proc,
};

/// `workers` mock engines with `extra` flags, run by this build's binary
/// whatever `KVROUTE_TEST_BIN` says (the router is under test; the
/// engines' `--cut-streams` and `continue_final_message` are this build's).
fn engines_with(workers: usize, extra: &[&str]) -> (Proc, Vec<String>) {
    let n = workers.to_string();
    let mut args = vec!["--workers", &n, "--port", "0"];
    args.extend_from_slice(&["--kv-events-port", "0", "--replay-port", "0"]);
    args.extend_from_slice(extra);
    spawn_this_builds_mocker(&args, workers)
}

/// Tokens each request asks for.
const MAX_TOKENS: u64 = 64;

/// What a client read of one streamed answer.
#[derive(Debug, Default)]
struct Read {
    status: u16,
    pieces: u64,
    completion_tokens: Option<u64>,
    finish: Option<String>,
    done: bool,
    error: Option<String>,
    ids: Vec<String>,
}

impl Read {
    /// The answer is whole: every token asked for, finished, one id, no error.
    fn whole(&self) -> Result<(), String> {
        let complete = self.status == 200
            && self.error.is_none()
            && self.done
            && self.finish.as_deref() == Some("length")
            && self.completion_tokens == Some(MAX_TOKENS)
            && self.pieces == MAX_TOKENS;
        let one_id = self.ids.windows(2).all(|w| w[0] == w[1]);
        (complete && one_id)
            .then_some(())
            .ok_or_else(|| format!("{self:?}"))
    }
}

/// Reads a streamed chat answer as a client does, event by event.
fn read_stream(raw: &http::Reply) -> Read {
    let (body, _) = dechunk(raw.body.as_bytes());
    let text = String::from_utf8_lossy(&body).into_owned();
    let mut read = Read {
        status: raw.status,
        ..Read::default()
    };
    for data in text.lines().filter_map(|l| l.strip_prefix("data: ")) {
        if data == "[DONE]" {
            read.done = true;
            continue;
        }
        let Ok(doc) = serde_json::from_str::<Value>(data) else {
            read.error = Some(format!("not JSON: {data}"));
            continue;
        };
        if let Some(e) = doc.get("error") {
            read.error = Some(e.to_string());
        }
        if let Some(id) = doc["id"].as_str() {
            read.ids.push(id.to_owned());
        }
        let choice = &doc["choices"][0];
        let piece = choice["delta"]["content"]
            .as_str()
            .or(choice["text"].as_str());
        if piece.is_some_and(|c| !c.is_empty()) {
            read.pieces += 1;
        }
        if let Some(f) = choice["finish_reason"].as_str() {
            read.finish = Some(f.to_owned());
        }
        if let Some(c) = doc["usage"]["completion_tokens"].as_u64() {
            read.completion_tokens = Some(c);
        }
    }
    read
}

/// One streamed chat of its own (no shared prefix, so load spreads it).
fn chat(i: usize) -> String {
    json!({
        "model": "mock-model",
        "messages": [{"role": "user", "content": format!("request {i}: tell me about the number {i} in detail")}],
        "max_tokens": MAX_TOKENS,
        "stream": true,
        "stream_options": {"include_usage": true},
    })
    .to_string()
}

/// Four engines, each its own process (so one can die alone).
fn four_engines() -> (Vec<Option<Proc>>, Vec<String>) {
    let mut procs = Vec::new();
    let mut lines = Vec::new();
    for k in 0..4 {
        let (proc, line) = engines_with(1, &["--speedup", "10"]);
        procs.push(Some(proc));
        // Every process names its one engine `w0`; the router needs four names.
        lines.push(line[0].replacen("name=w0,", &format!("name=w{k},"), 1));
    }
    (procs, lines)
}

/// `total` streamed chats, `in_flight` at a time; once some are being
/// served by `victim`'s engine, that engine is killed (SIGKILL).
fn run_with_a_death(total: usize, in_flight: usize) -> (Vec<Read>, (Proc, String), bool) {
    let (mut engines, lines) = four_engines();
    let (serve_proc, serve) = start_serve(&lines, &[]);
    let next = Arc::new(AtomicUsize::new(0));
    let reads = Arc::new(Mutex::new(Vec::new()));
    let clients: Vec<_> = (0..in_flight)
        .map(|_| {
            let (next, reads, serve) = (next.clone(), reads.clone(), serve.clone());
            std::thread::spawn(move || loop {
                let i = next.fetch_add(1, Ordering::Relaxed);
                if i >= total {
                    return;
                }
                let reply = http::request(&serve, "POST", "/v1/chat/completions", &chat(i));
                reads.lock().expect("lock").push(read_stream(&reply));
            })
        })
        .collect();
    // Kill the first engine while it is streaming answers.
    let victim = http_of(&lines[0]);
    eventually_within(
        "the first engine streaming answers",
        Duration::from_secs(60),
        || running(&victim) >= 2,
    );
    drop(engines[0].take());
    // The continuations' decisions, while the ring still holds them.
    let shown = polled_until(Duration::from_secs(10), || {
        http::request(&serve, "GET", "/api/stats", "")
            .body
            .contains("migration 1 from")
    });
    for client in clients {
        client.join().expect("client");
    }
    let reads = std::mem::take(&mut *reads.lock().expect("lock"));
    (reads, (serve_proc, serve), shown)
}

/// An engine's `host:port` from its `--worker` line.
fn http_of(line: &str) -> String {
    let url = line
        .split(',')
        .find_map(|kv| kv.strip_prefix("url="))
        .expect("url");
    url.trim_start_matches("http://").to_owned()
}

/// Requests an engine is running now (its own `/metrics`).
fn running(engine: &str) -> u64 {
    metric(engine, "vllm:num_requests_running").unwrap_or(0.0) as u64
}

#[test]
fn streams_survive_the_death_of_their_engine() {
    for trial in 1..=3 {
        let (reads, (_serve_proc, serve), shown) = run_with_a_death(300, 16);
        assert_eq!(reads.len(), 300, "trial {trial}");
        let broken: Vec<String> = reads.iter().filter_map(|r| r.whole().err()).collect();
        let migrations = count(&serve, "kvroute_proxy_migrations_total");
        eprintln!(
            "trial {trial}: {} of 300 answers not whole, {migrations} migrations",
            reads.iter().filter(|r| r.whole().is_err()).count()
        );
        assert!(
            broken.is_empty(),
            "trial {trial}: {} of 300 answers not whole ({migrations} migrations): {:?}",
            broken.len(),
            &broken[..broken.len().min(3)]
        );
        assert!(
            migrations >= 1,
            "trial {trial}: the engine was killed while streaming, yet nothing migrated"
        );
        assert!(
            shown,
            "trial {trial}: the decisions ring shows the continuation's migration"
        );
        let failed = count(&serve, "kvroute_proxy_migrations_failed_total");
        assert_eq!(failed, 0, "trial {trial}");
    }
}

#[test]
fn a_client_that_opts_out_gets_the_error_instead() {
    let (mut engines, lines) = four_engines();
    let (_serve_proc, serve) = start_serve(&lines, &[]);
    let next = Arc::new(AtomicUsize::new(0));
    let cut = Arc::new(AtomicUsize::new(0));
    let clients: Vec<_> = (0..16)
        .map(|_| {
            let (next, cut, serve) = (next.clone(), cut.clone(), serve.clone());
            std::thread::spawn(move || loop {
                let i = next.fetch_add(1, Ordering::Relaxed);
                if i >= 200 {
                    return;
                }
                let opt_out = [("x-kvroute-migrate", "0")];
                let path = "/v1/chat/completions";
                let reply = http::request_with(&serve, "POST", path, &opt_out, &chat(i));
                if read_stream(&reply).whole().is_err() {
                    cut.fetch_add(1, Ordering::Relaxed);
                }
            })
        })
        .collect();
    let victim = http_of(&lines[0]);
    eventually("the first engine streaming answers", || {
        running(&victim) >= 2
    });
    drop(engines[0].take());
    for client in clients {
        client.join().expect("client");
    }
    assert!(
        cut.load(Ordering::Relaxed) >= 1,
        "opted out, the streams cut by the death stay cut"
    );
    assert_eq!(count(&serve, "kvroute_proxy_migrations_total"), 0);
}

#[test]
fn a_long_answer_that_runs_out_of_time_does_not_open_its_breaker() {
    // One slow engine: 2 000 tokens take far longer than the 2 s allowed.
    let (_engine, lines) = engines_with(1, &["--speedup", "1"]);
    let (_serve_proc, serve) = start_serve(&lines, &["--request-timeout-secs", "2"]);
    let long = json!({"model": "mock-model", "prompt": "a long story", "max_tokens": 2000, "stream": true});
    let reply = http::request(&serve, "POST", "/v1/completions", &long.to_string());
    let read = String::from_utf8_lossy(&dechunk(reply.body.as_bytes()).0).into_owned();
    assert!(
        read.contains("upstream_incomplete"),
        "cut at the timeout: {read}"
    );
    assert_eq!(
        count(&serve, "kvroute_proxy_migrations_total"),
        0,
        "never migrated"
    );
    // The worker was working: the next requests are served, not refused.
    let short = json!({"model": "mock-model", "prompt": "hello", "max_tokens": 2});
    for _ in 0..5 {
        let r = http::request(&serve, "POST", "/v1/completions", &short.to_string());
        assert_eq!(r.status, 200, "{}", r.body);
    }
}

/// One streamed completion of its own.
fn completion(i: usize) -> String {
    json!({
        "model": "mock-model",
        "prompt": format!("completion {i}: the story of the number {i} goes"),
        "max_tokens": MAX_TOKENS,
        "stream": true,
        "stream_options": {"include_usage": true},
    })
    .to_string()
}

#[test]
fn streams_cut_by_an_engine_are_finished_elsewhere() {
    // One engine cuts every streamed answer half-way (its connection closes
    // mid-body, as when it dies) and stays up, so its breaker's half-open
    // probes are cut too; three engines are healthy.
    let (_cutter, cutter) = engines_with(1, &["--speedup", "10", "--cut-streams", "1"]);
    let (_healthy, mut lines) = engines_with(3, &["--speedup", "10"]);
    lines.push(cutter[0].replacen("name=w0,", "name=cutter,", 1));
    let (_serve_proc, serve) = start_serve(&lines, &[]);
    let next = Arc::new(AtomicUsize::new(0));
    let broken = Arc::new(Mutex::new(Vec::new()));
    let clients: Vec<_> = (0..8)
        .map(|_| {
            let (next, broken, serve) = (next.clone(), broken.clone(), serve.clone());
            std::thread::spawn(move || loop {
                let i = next.fetch_add(1, Ordering::Relaxed);
                if i >= 200 {
                    return;
                }
                let (path, body) = if i % 2 == 0 {
                    ("/v1/chat/completions", chat(i))
                } else {
                    ("/v1/completions", completion(i))
                };
                let read = read_stream(&http::request(&serve, "POST", path, &body));
                if let Err(e) = read.whole() {
                    broken.lock().expect("lock").push(format!("{path}: {e}"));
                }
            })
        })
        .collect();
    for client in clients {
        client.join().expect("client");
    }
    let broken = std::mem::take(&mut *broken.lock().expect("lock"));
    let migrations = count(&serve, "kvroute_proxy_migrations_total");
    eprintln!(
        "200 streams, {migrations} migrations, {} not whole",
        broken.len()
    );
    assert!(broken.is_empty(), "{broken:?}");
    assert!(migrations >= 1, "the cutting engine served nothing");
}
