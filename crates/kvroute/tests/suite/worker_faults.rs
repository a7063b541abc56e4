//! A worker that fails a request it took must cost the client as little as
//! possible: a stream cut off ends with an error event, a whole answer cut
//! off is a 502, the worker's breaker opens, the request is never sent on
//! blindly, and with migration on it is continued elsewhere. Each test runs
//! a real `kvroute serve` in front of workers that fail on purpose.

use std::io::{Read, Write};
use std::net::{TcpListener, TcpStream};
use std::time::Duration;

use serde_json::{json, Value};

use crate::support::http::*;
use crate::support::*;

#[test]
fn a_worker_dying_mid_stream_ends_the_stream_with_an_error_event() {
    let (mocker, lines) = start_mocker(1, "0.5");
    let (_serve, serve) = start_serve(&lines, &[]);
    let body =
        json!({"model": "mock-model", "prompt": [5, 6, 7], "max_tokens": 2000, "stream": true});
    let mut socket = send(&serve, "POST", "/v1/completions", &body.to_string());
    let mut seen = Vec::new();
    let mut buf = [0u8; 4096];
    while !String::from_utf8_lossy(&seen).contains("data: {") {
        let n = socket.read(&mut buf).expect("read");
        assert!(n > 0, "the stream ended early");
        seen.extend_from_slice(&buf[..n]);
    }
    drop(mocker);
    let _ = socket.read_to_end(&mut seen);
    let split = seen
        .windows(4)
        .position(|w| w == b"\r\n\r\n")
        .expect("a response head");
    let head = String::from_utf8_lossy(&seen[..split]).into_owned();
    let lower = head.to_ascii_lowercase();
    assert!(lower.starts_with("http/1.1 200"), "{head}");
    assert!(lower.contains("transfer-encoding: chunked"), "{head}");
    let id = head
        .lines()
        .find_map(|l| {
            let (name, value) = l.split_once(':')?;
            name.eq_ignore_ascii_case("x-request-id")
                .then(|| value.trim())
        })
        .expect("an x-request-id header");
    let (body, ended) = dechunk(&seen[split + 4..]);
    let body = String::from_utf8_lossy(&body).into_owned();
    assert!(ended, "the chunked body has no last chunk: {body}");
    // Tokens (at least one was read before the kill), the error, [DONE]: nothing after.
    assert!(body.ends_with("data: [DONE]\n\n"), "{body}");
    let events: Vec<&str> = body.split("\n\n").filter(|e| !e.is_empty()).collect();
    let [tokens @ .., error, done] = events.as_slice() else {
        panic!("fewer than two events: {body}");
    };
    assert_eq!(*done, "data: [DONE]", "{body}");
    assert!(
        !tokens.is_empty(),
        "no token event before the error: {body}"
    );
    for token in tokens {
        assert!(
            token.starts_with("data: {\"") && !token.contains("\"error\""),
            "a token event before the error: {token}"
        );
    }
    let error: Value = serde_json::from_str(
        error
            .strip_prefix("data: ")
            .unwrap_or_else(|| panic!("an SSE data event: {error}")),
    )
    .unwrap_or_else(|e| panic!("the error event is JSON ({e}): {error}"));
    assert_eq!(error["error"]["code"], 502, "{error}");
    let message = error["error"]["message"].as_str().unwrap_or_default();
    assert!(
        message.contains(id),
        "the error names request {id}: {error}"
    );
}

/// An HTTP "worker" that reads one request and then drops the connection;
/// counts the completions it took (the router also asks for `/v1/models`).
fn dropping_worker() -> (String, std::sync::Arc<std::sync::atomic::AtomicUsize>) {
    let listener = TcpListener::bind("127.0.0.1:0").expect("bind");
    let addr = listener.local_addr().expect("addr").to_string();
    let taken = std::sync::Arc::new(std::sync::atomic::AtomicUsize::new(0));
    let count = taken.clone();
    std::thread::spawn(move || {
        for stream in listener.incoming() {
            let Ok(mut stream) = stream else { continue };
            let mut buf = [0u8; 65536];
            let _ = stream.set_read_timeout(Some(Duration::from_millis(200)));
            if matches!(stream.read(&mut buf), Ok(n) if buf[..n].starts_with(b"POST /v1/completions"))
            {
                count.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
            }
            drop(stream);
        }
    });
    (addr, taken)
}

/// With migration off (`--migration-limit 0`), a request a worker took and
/// then dropped the connection on is not sent to another worker: the client
/// gets a 502 naming the request, and the worker's breaker opens at once.
#[test]
fn a_request_a_worker_took_and_dropped_is_not_sent_to_another() {
    let (_mocker, lines) = start_mocker(1, "100");
    let (fake, taken) = dropping_worker();
    let dead_events = format!("tcp://127.0.0.1:{}", free_port());
    // It answers no `/v1/models`: its spec names the model it serves.
    let fake_line = format!(
        "name=fake,url=http://{fake},events={dead_events},dp=1,block_size=16,model=mock-model"
    );
    let (_serve, serve) = spawn_serve(
        &[lines[0].clone(), fake_line],
        &[
            "--policy",
            "round-robin",
            "--breaker-failures",
            "5",
            "--migration-limit",
            "0",
        ],
    );
    eventually("serve answers", || {
        request(&serve, "GET", "/health", "").status == 200
    });
    let body = json!({"model": "mock-model", "prompt": [9, 9, 9], "max_tokens": 1}).to_string();
    let replies: Vec<Reply> = (0..2)
        .map(|_| request(&serve, "POST", "/v1/completions", &body))
        .collect();
    let failed: Vec<&Reply> = replies.iter().filter(|r| r.status != 200).collect();
    assert_eq!(
        failed.len(),
        1,
        "{:?}",
        replies.iter().map(|r| r.status).collect::<Vec<_>>()
    );
    let failed = failed[0];
    assert_eq!(failed.status, 502, "{}", failed.body);
    let id = failed.header("x-request-id").expect("a request id");
    let message = failed.json()["error"]["message"]
        .as_str()
        .unwrap_or("")
        .to_owned();
    assert!(
        message.contains(&id) && message.contains("not sent to another worker"),
        "{message}"
    );
    assert_eq!(taken.load(std::sync::atomic::Ordering::SeqCst), 1);
    // Its breaker opened at once: the next requests all go to the engine.
    for _ in 0..4 {
        let r = request(&serve, "POST", "/v1/completions", &body);
        assert_eq!(r.status, 200, "{}", r.body);
        assert_eq!(r.header("x-kvroute-worker").as_deref(), Some("w0"));
    }
    assert_eq!(taken.load(std::sync::atomic::Ordering::SeqCst), 1);
}

/// Reads one HTTP request from `stream` to the end of its body (so that
/// closing the socket afterwards is a clean FIN, not a reset); `None` if the
/// peer closed or stalled first.
fn read_whole_request(stream: &mut TcpStream) -> Option<Vec<u8>> {
    let _ = stream.set_read_timeout(Some(Duration::from_secs(2)));
    let mut raw = Vec::new();
    let mut buf = [0u8; 65536];
    loop {
        if let Some(end) = raw.windows(4).position(|w| w == b"\r\n\r\n") {
            let head = String::from_utf8_lossy(&raw[..end]).to_ascii_lowercase();
            let length: usize = head
                .lines()
                .find_map(|l| l.strip_prefix("content-length:"))
                .and_then(|v| v.trim().parse().ok())
                .unwrap_or(0);
            if raw.len() >= end + 4 + length {
                return Some(raw);
            }
        }
        match stream.read(&mut buf) {
            Ok(0) | Err(_) => return None,
            Ok(n) => raw.extend_from_slice(&buf[..n]),
        }
    }
}

/// How many completions a fake worker took.
type Taken = std::sync::Arc<std::sync::atomic::AtomicUsize>;

/// The head and the first part of an answer that [`cutting_worker`] cuts
/// off: JSON with a `content-length` larger than what follows, or (`sse`) a
/// chunked event stream whose first event is followed by no last chunk.
fn cut_answer(sse: bool) -> String {
    if sse {
        let event = "data: {\"id\":\"cmpl-cut\",\"choices\":[{\"index\":0,\"text\":\"a\"}]}\n\n";
        format!(
            "HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\ntransfer-encoding: chunked\r\n\r\n{:x}\r\n{event}\r\n",
            event.len()
        )
    } else {
        let part = r#"{"id":"cmpl-cut","object":"text_completion","choices":[{"index":0,"te"#;
        format!(
            "HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ncontent-length: {}\r\n\r\n{part}",
            part.len() + 400
        )
    }
}

/// An HTTP "worker" that takes a completion, answers `200 OK` and the first
/// part of its answer ([`cut_answer`]), and closes the connection: an answer
/// cut off after its head. Counts the completions it took (other requests,
/// such as `/v1/models`, are dropped unanswered).
fn cutting_worker(sse: bool) -> (String, Taken) {
    let listener = TcpListener::bind("127.0.0.1:0").expect("bind");
    let addr = listener.local_addr().expect("addr").to_string();
    let taken = std::sync::Arc::new(std::sync::atomic::AtomicUsize::new(0));
    let count = taken.clone();
    std::thread::spawn(move || {
        for stream in listener.incoming() {
            let Ok(mut stream) = stream else { continue };
            let Some(request) = read_whole_request(&mut stream) else {
                continue;
            };
            if !request.starts_with(b"POST /v1/completions") {
                continue;
            }
            count.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
            let _ = stream.write_all(cut_answer(sse).as_bytes());
            let _ = stream.flush();
            // Let the router read the head and start on the body, then close.
            std::thread::sleep(Duration::from_millis(100));
            let _ = stream.shutdown(std::net::Shutdown::Both);
        }
    });
    (addr, taken)
}

/// A router in front of a mocker engine `w0` and a [`cutting_worker`]
/// `fake`, taking turns (round-robin) while neither's breaker is open.
fn serve_with_cutting_worker(sse: bool, extra: &[&str]) -> (Proc, Proc, String, Taken) {
    let (mocker, lines) = start_mocker(1, "100");
    let (fake, taken) = cutting_worker(sse);
    let dead_events = format!("tcp://127.0.0.1:{}", free_port());
    // It answers no `/v1/models`: its spec names the model it serves.
    let fake_line = format!(
        "name=fake,url=http://{fake},events={dead_events},dp=1,block_size=16,model=mock-model"
    );
    let mut flags = vec!["--policy", "round-robin", "--breaker-failures", "5"];
    flags.extend_from_slice(extra);
    let (serve_proc, serve) = spawn_serve(&[lines[0].clone(), fake_line], &flags);
    eventually("serve answers", || {
        request(&serve, "GET", "/health", "").status == 200
    });
    (mocker, serve_proc, serve, taken)
}

/// After a worker took a request and cut its answer off, the next requests
/// all go to the engine (its breaker opened at once), and it is counted as
/// one upstream failure, not as a completed request (`completed` were).
fn assert_breaker_open_and_counted(
    serve: &str,
    taken: &std::sync::atomic::AtomicUsize,
    completed: u64,
) {
    let body = json!({"model": "mock-model", "prompt": [9, 9, 9], "max_tokens": 1}).to_string();
    for i in 0..4 {
        let r = request(serve, "POST", "/v1/completions", &body);
        assert_eq!(r.status, 200, "request {i} after the cut: {}", r.body);
        assert_eq!(
            r.header("x-kvroute-worker").as_deref(),
            Some("w0"),
            "request {i} after the cut"
        );
    }
    assert_eq!(taken.load(std::sync::atomic::Ordering::SeqCst), 1);
    assert_eq!(count(serve, "kvroute_proxy_upstream_errors_total"), 1);
    let incomplete = metric_where(
        serve,
        "kvroute_proxy_errors_total",
        "kind=\"upstream_incomplete\"",
    );
    assert_eq!(incomplete, Some(1.0));
    assert_eq!(
        count(serve, "kvroute_proxy_request_seconds_count"),
        completed + 4
    );
}

/// With migration off, a worker that answers 200 and then cuts its body
/// off: the client gets a 502 naming its request, the request goes to no other worker, the
/// worker's breaker opens, and the answer counts as an upstream failure,
/// not a success.
#[test]
fn an_answer_a_worker_cut_off_is_a_502_and_opens_its_breaker() {
    let (_mocker, _serve, serve, taken) =
        serve_with_cutting_worker(false, &["--migration-limit", "0"]);
    let body = json!({"model": "mock-model", "prompt": [9, 9, 9], "max_tokens": 1}).to_string();
    let replies: Vec<Reply> = (0..2)
        .map(|_| request(&serve, "POST", "/v1/completions", &body))
        .collect();
    let statuses: Vec<u16> = replies.iter().map(|r| r.status).collect();
    let failed: Vec<&Reply> = replies.iter().filter(|r| r.status != 200).collect();
    assert_eq!(failed.len(), 1, "{statuses:?}");
    let failed = failed[0];
    assert_eq!(failed.status, 502, "{}", failed.body);
    // Taken once, and not sent on to the engine.
    assert_eq!(taken.load(std::sync::atomic::Ordering::SeqCst), 1);
    assert_breaker_open_and_counted(&serve, &taken, 1);
    // The client was told, in OpenAI's error shape, naming its request.
    let id = failed.header("x-request-id").expect("a request id");
    let doc = failed.json();
    assert_eq!(doc["error"]["code"], 502, "{doc}");
    assert_eq!(doc["error"]["type"], "upstream_incomplete", "{doc}");
    let message = doc["error"]["message"].as_str().unwrap_or("").to_owned();
    assert!(
        message.contains(&id) && message.contains("not sent to another worker"),
        "{message}"
    );
}

/// With migration off, a worker that cuts its stream off after the first
/// event: the client's stream ends with an `upstream_incomplete` error event naming its request
/// and `[DONE]`, and the worker is treated as for a cut-off body (breaker
/// open, one upstream failure).
#[test]
fn a_stream_a_worker_cut_off_ends_with_an_error_event_and_opens_its_breaker() {
    let (_mocker, _serve, serve, taken) =
        serve_with_cutting_worker(true, &["--migration-limit", "0"]);
    let body = json!({"model": "mock-model", "prompt": [9, 9, 9], "max_tokens": 1, "stream": true})
        .to_string();
    let replies: Vec<Reply> = (0..2)
        .map(|_| request(&serve, "POST", "/v1/completions", &body))
        .collect();
    let cut: Vec<&Reply> = replies
        .iter()
        .filter(|r| r.header("x-kvroute-worker").as_deref() == Some("fake"))
        .collect();
    let bodies: Vec<&str> = replies.iter().map(|r| r.body.as_str()).collect();
    assert_eq!(cut.len(), 1, "{bodies:?}");
    let cut = cut[0];
    let id = cut.header("x-request-id").expect("a request id");
    assert!(cut.body.contains("\"cmpl-cut\""), "{}", cut.body);
    let error = cut.body.find("data: {\"error\"").expect("an error event");
    let tail = &cut.body[error..];
    assert!(tail.contains("\"type\":\"upstream_incomplete\""), "{tail}");
    assert!(tail.contains(&id), "{tail}");
    assert!(tail.contains("data: [DONE]"), "{tail}");
    assert_eq!(taken.load(std::sync::atomic::Ordering::SeqCst), 1);
    assert_breaker_open_and_counted(&serve, &taken, 1);
}

/// With migration on (the default), each way a worker can fail a request it
/// took — the connection dropped before an answer, a whole answer cut off,
/// a stream cut off after its first token — ends in one whole answer from
/// the other worker: the request migrated once, the failing worker's
/// breaker open.
#[test]
fn requests_a_worker_took_and_failed_are_migrated_to_another() {
    // Dropped before an answer: asked again whole.
    let (_mocker, lines) = start_mocker(1, "100");
    let (fake, taken) = dropping_worker();
    let dead_events = format!("tcp://127.0.0.1:{}", free_port());
    let fake_line = format!(
        "name=fake,url=http://{fake},events={dead_events},dp=1,block_size=16,model=mock-model"
    );
    let flags = ["--policy", "round-robin", "--breaker-failures", "5"];
    let (_serve, serve) = spawn_serve(&[lines[0].clone(), fake_line], &flags);
    eventually("serve answers", || {
        request(&serve, "GET", "/health", "").status == 200
    });
    let body = json!({"model": "mock-model", "prompt": [9, 9, 9], "max_tokens": 4}).to_string();
    for _ in 0..2 {
        let r = request(&serve, "POST", "/v1/completions", &body);
        assert_eq!(r.status, 200, "{}", r.body);
        assert_eq!(r.header("x-kvroute-worker").as_deref(), Some("w0"));
    }
    assert_eq!(taken.load(std::sync::atomic::Ordering::SeqCst), 1);
    assert_eq!(count(&serve, "kvroute_proxy_migrations_total"), 1);

    // A whole answer cut off: asked again whole.
    let (_mocker, _serve, serve, taken) = serve_with_cutting_worker(false, &[]);
    let body = json!({"model": "mock-model", "prompt": [9, 9, 9], "max_tokens": 4}).to_string();
    for _ in 0..2 {
        let r = request(&serve, "POST", "/v1/completions", &body);
        assert_eq!(r.status, 200, "{}", r.body);
        assert_eq!(r.header("x-kvroute-worker").as_deref(), Some("w0"));
        assert_eq!(r.json()["usage"]["completion_tokens"], 4, "{}", r.body);
    }
    assert_eq!(taken.load(std::sync::atomic::Ordering::SeqCst), 1);
    assert_eq!(count(&serve, "kvroute_proxy_migrations_total"), 1);

    // A stream, continued from its first token under the same id (a text
    // prompt: the fake sends no token ids, so an id prompt could not be
    // continued).
    let (_mocker, _serve, serve, taken) = serve_with_cutting_worker(true, &[]);
    let body = json!({
        "model": "mock-model", "prompt": "once upon a time", "max_tokens": 4, "stream": true,
        "stream_options": {"include_usage": true},
    })
    .to_string();
    let replies: Vec<Reply> = (0..2)
        .map(|_| request(&serve, "POST", "/v1/completions", &body))
        .collect();
    let cut = replies
        .iter()
        .find(|r| r.header("x-kvroute-worker").as_deref() == Some("fake"))
        .expect("one stream began on the cutting worker");
    let (raw, _) = crate::support::http::dechunk(cut.body.as_bytes());
    let events: Vec<Value> = String::from_utf8_lossy(&raw)
        .lines()
        .filter_map(|l| l.strip_prefix("data: "))
        .filter(|d| *d != "[DONE]")
        .map(|d| serde_json::from_str(d).expect("JSON event"))
        .collect();
    assert!(
        events.iter().all(|e| e.get("error").is_none()),
        "{events:?}"
    );
    assert!(events.iter().all(|e| e["id"] == "cmpl-cut"), "{events:?}");
    let pieces = events
        .iter()
        .filter(|e| {
            e["choices"][0]["text"]
                .as_str()
                .is_some_and(|t| !t.is_empty())
        })
        .count();
    assert_eq!(pieces, 4, "{events:?}");
    let usage = events.iter().rev().find_map(|e| e["usage"].as_object());
    assert_eq!(
        usage.map(|u| u["completion_tokens"].clone()),
        Some(json!(4))
    );
    assert_eq!(taken.load(std::sync::atomic::Ordering::SeqCst), 1);
    assert_eq!(count(&serve, "kvroute_proxy_migrations_total"), 1);
}
