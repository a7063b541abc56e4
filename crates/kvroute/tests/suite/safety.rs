//! Exposing kvroute must never open a way into the fleet or a way to take it
//! down: each test is one probe an operator would make, against a real
//! `kvroute serve` in front of real `kvroute mocker` engines.

use std::io::{Read, Write};
use std::net::{TcpListener, TcpStream};
use std::time::{Duration, Instant};

use serde_json::{json, Value};

use crate::support::http::*;
use crate::support::*;

fn field<'a>(line: &'a str, key: &str) -> &'a str {
    line.split(',')
        .find_map(|kv| kv.strip_prefix(&format!("{key}=")))
        .expect("a field of the worker line")
}

fn registration(name: &str, url: &str, events: &str) -> String {
    json!({"name": name, "url": url, "events": events}).to_string()
}

fn with_token(token: &str) -> [(&'static str, String); 1] {
    [("Authorization", format!("Bearer {token}"))]
}

fn post(serve: &str, path: &str, headers: &[(&'static str, String)], body: &str) -> Reply {
    let headers: Vec<(&str, &str)> = headers.iter().map(|(k, v)| (*k, v.as_str())).collect();
    request_with(serve, "POST", path, &headers, body)
}

fn routed_to(serve: &str) -> Option<String> {
    let body = json!({"model": "mock-model", "prompt": [1, 2, 3], "max_tokens": 1});
    request(serve, "POST", "/v1/completions", &body.to_string()).header("x-kvroute-worker")
}

/// Without `--admin-token` the admin API is closed: nobody can register a
/// worker that points anywhere or unregister the real ones (403, naming the
/// flag), and requests still reach the real worker.
#[test]
fn the_admin_api_is_closed_unless_a_token_is_set() {
    let (_mocker, lines) = start_mocker(1, "100");
    let (_serve, serve) = start_serve(&lines, &[]);
    let evil = registration("evil", "http://127.0.0.1:9", "tcp://127.0.0.1:9");
    let r = post(&serve, "/register", &[], &evil);
    assert_eq!(r.status, 403, "{}", r.body);
    let message = r.json()["error"]["message"]
        .as_str()
        .unwrap_or("")
        .to_owned();
    assert!(message.contains("--admin-token"), "{message}");
    let r = post(&serve, "/unregister", &[], r#"{"name":"w0"}"#);
    assert_eq!(r.status, 403);
    assert_eq!(routed_to(&serve).as_deref(), Some("w0"));
}

/// A registration cannot aim the router at arbitrary paths, credentials,
/// schemes, wildcard or disallowed hosts (SSRF): each is refused with 400,
/// while one of the right form is taken; the fleet's addresses need the
/// token too.
#[test]
fn registrations_cannot_aim_the_router_anywhere_else() {
    let (_mocker, lines) = start_mocker(1, "100");
    let token = with_token("secret");
    let (_serve, serve) = start_serve_with_token(
        &lines,
        &[
            "--admin-token",
            "secret",
            "--allow-worker-hosts",
            "127.0.0.1",
        ],
    );
    let events = "tcp://127.0.0.1:9";
    for (url, events) in [
        ("http://127.0.0.1:9/internal/secret?ignore=", events),
        ("http://user:pw@127.0.0.1:9", events),
        ("file:///etc/passwd", events),
        ("http://127.0.0.1:9", "tcp://*:5557"),
        ("http://10.9.9.9:9", events),
        ("http://127.0.0.1:9", "tcp://10.9.9.9:5557"),
    ] {
        let r = post(
            &serve,
            "/register",
            &token,
            &registration("evil", url, events),
        );
        assert_eq!(r.status, 400, "{url} {events}: {}", r.body);
    }
    // A registration of the right form, with the scheme in lower case.
    let lower = [("Authorization", "bearer secret".to_owned())];
    let fine = registration("w9", "http://127.0.0.1:9", events);
    assert_eq!(post(&serve, "/register", &lower, &fine).status, 200);
    // The fleet's addresses need the token too.
    assert_eq!(request(&serve, "GET", "/workers", "").status, 401);
    let q = request(&serve, "POST", "/query", r#"{"token_ids":[1,2,3]}"#);
    assert_eq!(q.status, 401);
    assert_eq!(request(&serve, "GET", "/health", "").status, 200);
    assert_eq!(request(&serve, "GET", "/metrics", "").status, 200);
}

/// `start_serve` for a router whose `/workers` needs `Bearer secret`.
fn start_serve_with_token(lines: &[String], extra: &[&str]) -> (Proc, String) {
    let (proc, serve) = spawn_serve(lines, extra);
    let token = [("Authorization", "Bearer secret")];
    eventually("serve up with every rank connected", || {
        TcpStream::connect(&serve).is_ok() && {
            let doc = request_with(&serve, "GET", "/workers", &token, "").json();
            doc["workers"].as_array().is_some_and(|ws| {
                ws.len() == lines.len() && ws.iter().all(|w| w["ranks"][0]["connected"] == true)
            })
        }
    });
    (proc, serve)
}

#[test]
fn public_introspection_opens_the_listing_but_not_the_admin_api() {
    let (_mocker, lines) = start_mocker(1, "100");
    let (_serve, serve) = start_serve(
        &lines,
        &["--admin-token", "secret", "--public-introspection"],
    );
    assert_eq!(request(&serve, "GET", "/workers", "").status, 200);
    let r = post(&serve, "/unregister", &[], r#"{"name":"w0"}"#);
    assert_eq!(r.status, 401);
}

/// A request with `max_tokens` 99 999 999 999 is refused with 400 (by the
/// router once it knows the engines' context length, by an engine before
/// that) and every engine survives it, so the fleet still serves.
#[test]
fn a_poison_request_is_refused_and_every_engine_survives() {
    let (_mocker, lines) = start_mocker(3, "100");
    let (_serve, serve) = start_serve(&lines, &[]);
    let poison = r#"{"model":"mock-model","prompt":[1,2,3],"max_tokens":99999999999}"#;
    // The router learns each worker's context length from its /v1/models
    // within seconds of starting; until then an engine refuses the poison
    // itself (and survives it), after that the router does.
    let refused_by_router = || {
        let r = request(&serve, "POST", "/v1/completions", poison);
        let message = r.json()["error"]["message"]
            .as_str()
            .unwrap_or("")
            .to_owned();
        r.status == 400 && message.contains("maximum context length")
    };
    eventually("the router refuses the poison itself", refused_by_router);
    for line in &lines {
        let engine = field(line, "url").trim_start_matches("http://");
        // Straight to the engine, and to its cache probe: refused, and alive.
        assert_eq!(
            request(engine, "POST", "/v1/completions", poison).status,
            400
        );
        assert_eq!(
            request(engine, "POST", "/internal/cache_match", poison).status,
            400
        );
        assert_eq!(
            request(engine, "GET", "/health", "").status,
            200,
            "{engine}"
        );
    }
    assert!(routed_to(&serve).is_some(), "the fleet still serves");
}

/// Six concurrent 32 MiB `/query` bodies are refused with 413 and the
/// router's RSS stays under 100 MiB.
#[test]
fn huge_queries_are_refused_and_memory_stays_bounded() {
    let (_mocker, lines) = start_mocker(1, "100");
    let (serve_proc, serve) = start_serve(&lines, &[]);
    // Just under the default body limit of every other route (32 MiB).
    let ids: Vec<String> = (0..4_500_000u32)
        .map(|i| (100_000 + i % 50_000).to_string())
        .collect();
    let body = format!("{{\"token_ids\":[{}]}}", ids.join(","));
    assert!(
        body.len() > 30 << 20 && body.len() < 32 << 20,
        "{}",
        body.len()
    );
    let senders: Vec<_> = (0..6)
        .map(|_| {
            let (serve, body) = (serve.clone(), body.clone());
            std::thread::spawn(move || request(&serve, "POST", "/query", &body).status)
        })
        .collect();
    let statuses: Vec<u16> = senders
        .into_iter()
        .map(|t| t.join().expect("sender"))
        .collect();
    assert!(statuses.iter().all(|&s| s == 413), "{statuses:?}");
    let rss = crate::support::rss(serve_proc.0.id());
    eprintln!(
        "router RSS after six concurrent {} MiB queries: {} MiB",
        body.len() >> 20,
        rss >> 20
    );
    assert!(rss > 0 && rss < 100 << 20, "router RSS {rss} bytes");
}

/// Reads until the peer closes; how long that took (`None`: still open at `limit`).
fn closed_within(mut socket: TcpStream, limit: Duration) -> Option<Duration> {
    let start = Instant::now();
    socket
        .set_read_timeout(Some(Duration::from_millis(100)))
        .expect("timeout");
    let mut buf = [0u8; 1024];
    while start.elapsed() < limit {
        match socket.read(&mut buf) {
            Ok(0) => return Some(start.elapsed()),
            Ok(_) => {}
            Err(e)
                if matches!(
                    e.kind(),
                    std::io::ErrorKind::WouldBlock | std::io::ErrorKind::TimedOut
                ) => {}
            Err(_) => return Some(start.elapsed()),
        }
    }
    None
}

/// `kvroute_http_connections` as the router reports it in answer to a
/// kept-alive `GET /metrics` on `socket` (which stays open), or `None` if
/// the answer has no such line or could not be read.
fn open_connections_on(socket: &mut TcpStream, host_port: &str) -> Option<u64> {
    let ask = format!("GET /metrics HTTP/1.1\r\nHost: {host_port}\r\n\r\n");
    socket.write_all(ask.as_bytes()).ok()?;
    socket
        .set_read_timeout(Some(Duration::from_secs(5)))
        .expect("timeout");
    let mut raw = Vec::new();
    let mut buf = [0u8; 8192];
    let body = loop {
        if let Some(end) = raw.windows(4).position(|w| w == b"\r\n\r\n") {
            let head = String::from_utf8_lossy(&raw[..end]).to_ascii_lowercase();
            let length: usize = head
                .lines()
                .find_map(|l| l.strip_prefix("content-length:"))
                .and_then(|v| v.trim().parse().ok())
                .expect("/metrics answers with a content-length");
            if raw.len() >= end + 4 + length {
                break String::from_utf8_lossy(&raw[end + 4..end + 4 + length]).into_owned();
            }
        }
        match socket.read(&mut buf) {
            Ok(0) | Err(_) => return None,
            Ok(n) => raw.extend_from_slice(&buf[..n]),
        }
    };
    body.lines()
        .find_map(|l| l.strip_prefix("kvroute_http_connections "))
        .and_then(|v| v.trim().parse::<f64>().ok())
        .map(|v| v as u64)
}

/// Idle and slow-header connections are closed after their timeouts, and a
/// connection beyond `--max-connections` is closed at once and counted, so
/// that they cannot make the router unreachable.
#[test]
fn idle_and_slow_connections_are_closed_and_the_count_is_capped() {
    let (_mocker, lines) = start_mocker(1, "100");
    let (_serve, serve) = start_serve(
        &lines,
        &[
            "--header-timeout-secs",
            "1",
            "--idle-timeout-secs",
            "2",
            "--max-connections",
            "8",
        ],
    );
    let opened = Instant::now();
    let idle = TcpStream::connect(&serve).expect("connect");
    let slow = TcpStream::connect(&serve).expect("connect");
    let slow_writer = {
        let mut slow = slow.try_clone().expect("clone");
        std::thread::spawn(move || {
            for b in b"GET /health HTTP/1.1\r\n" {
                if slow.write_all(&[*b]).is_err() {
                    return;
                }
                // Pacing: a slow client's head, a byte every 300 ms.
                std::thread::sleep(Duration::from_millis(300));
            }
        })
    };
    let slow_closed = closed_within(slow, Duration::from_secs(5)).expect("slow header closed");
    eprintln!("slow-header connection closed after {slow_closed:?} (header timeout 1 s)");
    assert!(slow_closed < Duration::from_millis(2500), "{slow_closed:?}");
    closed_within(idle, Duration::from_secs(6)).expect("idle connection closed");
    let idle_closed = opened.elapsed();
    eprintln!("idle connection closed after {idle_closed:?} (idle timeout 2 s)");
    assert!(
        (Duration::from_millis(1500)..Duration::from_millis(4000)).contains(&idle_closed),
        "{idle_closed:?}"
    );
    let _ = slow_writer.join();
    // Eight connections held open: the ninth is closed at once, and counted.
    let mut held: Vec<TcpStream> = (0..8)
        .map(|_| TcpStream::connect(&serve).expect("connect"))
        .collect();
    // All eight taken by the router before the ninth arrives (asked on one
    // of them: a new connection would be the ninth).
    let deadline = Instant::now() + Duration::from_secs(1);
    loop {
        let open = open_connections_on(&mut held[0], &serve);
        if open == Some(8) {
            break;
        }
        assert!(
            Instant::now() < deadline,
            "the router never had the 8 held connections open: {open:?}"
        );
    }
    let extra = TcpStream::connect(&serve).expect("the kernel accepts");
    let refused = closed_within(extra, Duration::from_secs(1)).expect("refused at once");
    assert!(refused < Duration::from_millis(500), "{refused:?}");
    drop(held);
    eventually("the router serves again", || {
        request(&serve, "GET", "/health", "").status == 200
    });
    let text = request(&serve, "GET", "/metrics", "").body;
    assert!(
        text.lines().any(|l| l.starts_with("kvroute_http_connections_refused_total ") && !l.ends_with(" 0")),
        "{text}"
    );
}

/// `/health` answers while 10 MB prompts are being worked on back to back
/// in a fraction of the time one such prompt takes (p99 under half the
/// prompts' median): a probe held up behind a prompt's parsing and hashing
/// would wait about that long. Relative, so a loaded machine slows both.
#[test]
fn a_ten_megabyte_prompt_does_not_hold_up_other_requests() {
    let (_mocker, lines) = start_mocker(1, "100");
    let (_serve, serve) = start_serve(&lines, &[]);
    let ids: Vec<String> = (0..1_500_000u32)
        .map(|i| (100_000 + i % 50_000).to_string())
        .collect();
    let body = format!(
        "{{\"model\":\"mock-model\",\"prompt\":[{}],\"max_tokens\":1}}",
        ids.join(",")
    );
    assert!(body.len() > 10 << 20);
    use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering::Relaxed};
    let stop = std::sync::Arc::new(AtomicBool::new(false));
    let answered = std::sync::Arc::new(AtomicUsize::new(0));
    let load = {
        let (serve, stop, answered) = (serve.clone(), stop.clone(), answered.clone());
        std::thread::spawn(move || {
            let mut took = Vec::new();
            while !stop.load(Relaxed) {
                let start = Instant::now();
                let _ = request(&serve, "POST", "/v1/completions", &body);
                took.push(start.elapsed());
                answered.fetch_add(1, Relaxed);
            }
            took
        })
    };
    // The prompts follow one another from the first answer on.
    eventually("the first 10 MB prompt answered", || {
        answered.load(Relaxed) >= 1
    });
    let before = answered.load(Relaxed);
    let mut latencies: Vec<Duration> = (0..200)
        .map(|_| {
            let start = Instant::now();
            assert_eq!(request(&serve, "GET", "/health", "").status, 200);
            let took = start.elapsed();
            // Pacing: the probes spread over the prompts' processing.
            std::thread::sleep(Duration::from_millis(10));
            took
        })
        .collect();
    // Answered while the probes ran: the prompts overlapped them.
    let during = answered.load(Relaxed) - before;
    stop.store(true, Relaxed);
    let mut prompts = load.join().expect("load");
    prompts.sort();
    let prompt_p50 = prompts[prompts.len() / 2];
    assert!(
        during >= 1,
        "no 10 MB prompt was answered while /health was probed"
    );
    latencies.sort();
    let p99 = latencies[latencies.len() * 99 / 100];
    eprintln!(
        "/health beside {during} 10 MB prompts (p50 {prompt_p50:?} each): p50 {:?}, p99 {p99:?}, max {:?}",
        latencies[latencies.len() / 2],
        latencies[latencies.len() - 1]
    );
    assert!(
        p99 < prompt_p50 / 2,
        "/health p99 {p99:?}, a 10 MB prompt's p50 {prompt_p50:?}"
    );
}

/// A worker that dies mid-stream ends the client's stream with an error
/// event naming the request, then `data: [DONE]`, and a properly ended
/// chunked body.
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

/// Every refusal (413, 404, 405, 400) is an OpenAI error JSON whose code is
/// the status.
#[test]
fn every_refusal_is_openai_error_json() {
    let (_mocker, lines) = start_mocker(1, "100");
    let (_serve, serve) = start_serve(&lines, &["--max-body-mib", "1"]);
    let big = format!(r#"{{"prompt":"{}"}}"#, "x".repeat(2 << 20));
    for (method, path, body) in [
        ("POST", "/v1/completions", big.as_str()),
        ("GET", "/no/such/route", ""),
        ("GET", "/v1/completions", ""),
        ("POST", "/v1/completions", r#"{"prompt":[1],"n":0}"#),
    ] {
        let r = request(&serve, method, path, body);
        assert!((400..500).contains(&r.status), "{path}: {}", r.status);
        let doc: Value = r.json();
        assert_eq!(doc["error"]["code"], r.status, "{path}: {doc}");
        assert!(doc["error"]["message"].is_string(), "{path}: {doc}");
    }
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
