//! A real vLLM engine killed (SIGKILL, every process of it) while it
//! streams an answer: the router continues the stream on the other engine
//! from the token ids generated so far, and the client reads one whole
//! answer.

use std::io::{Read, Write};
use std::net::TcpStream;
use std::sync::mpsc;
use std::time::Duration;

use serde_json::{json, Value};

use super::bed::{bed, tokens, words};
use super::restarts::{kill, restart};
use crate::support::http::{count, dechunk};

/// Tokens the streamed answer asks for: about 7 s of the tiny model on
/// these cores, so the engine is still generating when it is killed.
const MAX_TOKENS: u64 = 3_000;

/// Events the client reads before the engine is killed.
const READ_BEFORE_KILL: usize = 100;

/// POSTs `body` to `path` at `serve` and reads the answer as it comes,
/// telling `progress` the worker serving it (its `x-kvroute-worker`) once
/// `READ_BEFORE_KILL` events have arrived; returns the status line and the
/// whole answer.
fn stream(
    serve: &str,
    path: &str,
    body: &str,
    progress: mpsc::Sender<String>,
) -> (String, Vec<u8>) {
    let mut conn = TcpStream::connect(serve).expect("connect");
    conn.set_read_timeout(Some(Duration::from_secs(300)))
        .expect("timeout");
    let head = format!(
        "POST {path} HTTP/1.1\r\nhost: {serve}\r\ncontent-type: application/json\r\ncontent-length: {}\r\nconnection: close\r\n\r\n",
        body.len()
    );
    conn.write_all(head.as_bytes()).expect("write");
    conn.write_all(body.as_bytes()).expect("write");
    let mut raw = Vec::new();
    let mut buf = [0u8; 16384];
    let mut told = false;
    loop {
        match conn.read(&mut buf) {
            Ok(0) | Err(_) => break,
            Ok(n) => raw.extend_from_slice(&buf[..n]),
        }
        let events = raw.windows(6).filter(|w| w == b"data: ").count();
        if !told && events >= READ_BEFORE_KILL {
            told = true;
            let head = String::from_utf8_lossy(&raw).to_ascii_lowercase();
            let worker = head
                .lines()
                .find_map(|l| l.strip_prefix("x-kvroute-worker: "))
                .unwrap_or_default()
                .trim()
                .to_owned();
            let _ = progress.send(worker);
        }
    }
    let split = raw
        .windows(4)
        .position(|w| w == b"\r\n\r\n")
        .expect("a head");
    let status = String::from_utf8_lossy(&raw[..split])
        .lines()
        .next()
        .unwrap_or_default()
        .to_owned();
    (status, dechunk(&raw[split + 4..]).0)
}

/// What the client read of a stream whose engine was killed, and what the
/// router counted.
struct Killed {
    /// The killed engine.
    victim: String,
    /// The answer's status line.
    status: String,
    /// The answer's body.
    text: String,
    /// Its events (not `[DONE]`).
    events: Vec<Value>,
    /// The router's migrations.
    migrations: u64,
}

impl Killed {
    /// The usage's `completion_tokens`.
    fn completion_tokens(&self) -> Option<u64> {
        let usage = self
            .events
            .iter()
            .rev()
            .find_map(|e| e["usage"].as_object());
        usage.and_then(|u| u["completion_tokens"].as_u64())
    }

    /// Asserts one whole answer under one id, migrated.
    fn assert_whole(&self) {
        let errors: Vec<&Value> = self
            .events
            .iter()
            .filter(|e| e.get("error").is_some())
            .collect();
        assert!(
            self.status.contains(" 200 "),
            "{}: {}",
            self.status,
            self.text
        );
        assert!(
            errors.is_empty(),
            "the client's stream holds an error: {errors:?}"
        );
        assert!(self.text.contains("data: [DONE]"), "{}", self.text);
        assert!(self.migrations >= 1, "the answer was not migrated");
        let ids: Vec<&str> = self
            .events
            .iter()
            .filter_map(|e| e["id"].as_str())
            .collect();
        assert!(ids.windows(2).all(|w| w[0] == w[1]), "one id: {ids:?}");
        assert_eq!(
            self.completion_tokens(),
            Some(MAX_TOKENS),
            "usage counts the whole answer"
        );
        let finish = self
            .events
            .iter()
            .rev()
            .find_map(|e| e["choices"][0]["finish_reason"].as_str());
        assert_eq!(finish, Some("length"));
    }
}

/// Streams `body` to `path` through a router over the bed, kills the
/// engine generating it once the client has read `READ_BEFORE_KILL`
/// events, reads the rest, and restarts the engine.
fn kill_mid_stream(path: &'static str, body: Value) -> Killed {
    // On a loaded machine the engine can finish the whole answer before the
    // kill lands (the client reads behind the engine): that try exercised
    // nothing, and the next one is made.
    for _ in 0..3 {
        let killed = kill_once(path, body.clone());
        let finished_first = killed.migrations == 0
            && killed.completion_tokens() == Some(MAX_TOKENS)
            && !killed.events.iter().any(|e| e.get("error").is_some());
        if !finished_first {
            return killed;
        }
        eprintln!("{path}: the answer was whole before its engine died; trying again");
    }
    panic!("{path}: in three tries the engine always finished before the kill");
}

/// One try of [`kill_mid_stream`].
fn kill_once(path: &'static str, body: Value) -> Killed {
    let (_serial, bed) = bed();
    let (_router, serve) = bed.router_with_tokenizer(&[]);
    let (tx, rx) = mpsc::channel();
    let client = {
        let serve = serve.clone();
        std::thread::spawn(move || stream(&serve, path, &body.to_string(), tx))
    };
    let serving = rx
        .recv_timeout(Duration::from_secs(300))
        .expect("the answer streams");
    let victim = bed.engine(&serving).clone();
    kill(&bed, &victim);
    let (status, raw) = client.join().expect("client");
    let text = String::from_utf8_lossy(&raw).into_owned();
    let events: Vec<Value> = text
        .lines()
        .filter_map(|l| l.strip_prefix("data: "))
        .filter(|d| *d != "[DONE]")
        .map(|d| serde_json::from_str(d).expect("JSON event"))
        .collect();
    let migrations = count(&serve, "kvroute_proxy_migrations_total");
    let stats = crate::support::http::request(&serve, "GET", "/api/stats", "").body;
    let note = stats
        .find("migration 1 from")
        .map(|i| stats[i..].split('"').next().unwrap_or_default().to_owned());
    let killed = Killed {
        victim: victim.name.clone(),
        status,
        text,
        events,
        migrations,
    };
    eprintln!(
        "{path}: {} killed mid-stream: {} events, usage {:?}, {migrations} migration(s) ({note:?})",
        killed.victim,
        killed.events.len(),
        killed.completion_tokens(),
    );
    // Leave the bed as it was for the next test.
    restart(&bed, &victim);
    bed.restarted(&victim);
    killed
}

#[test]
fn a_completion_whose_engine_is_killed_is_finished_token_exact_by_the_other() {
    let body = json!({
        "model": "tiny",
        "prompt": tokens(500, 200),
        "max_tokens": MAX_TOKENS,
        "ignore_eos": true,
        "return_token_ids": true,
        "stream": true,
        "stream_options": {"include_usage": true},
    });
    let killed = kill_mid_stream("/v1/completions", body);
    killed.assert_whole();
    // The continuation's prompt was the first prompt and the generated ids.
    let token_ids: usize = killed
        .events
        .iter()
        .filter_map(|e| e["choices"][0]["token_ids"].as_array())
        .map(Vec::len)
        .sum();
    assert_eq!(token_ids as u64, MAX_TOKENS, "every token id asked for");
}

#[test]
fn a_chat_whose_engine_is_killed_is_continued_by_the_other() {
    let body = json!({
        "model": "tiny",
        "messages": [{"role": "user", "content": words(&tokens(900, 100))}],
        "max_tokens": MAX_TOKENS,
        "ignore_eos": true,
        "stream": true,
        "stream_options": {"include_usage": true},
    });
    let killed = kill_mid_stream("/v1/chat/completions", body);
    killed.assert_whole();
    let roles = killed
        .events
        .iter()
        .filter(|e| e["choices"][0]["delta"]["role"].is_string())
        .count();
    assert_eq!(roles, 1, "one role chunk");
}
