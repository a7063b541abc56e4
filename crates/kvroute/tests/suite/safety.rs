//! Exposing kvroute must never open a way into the fleet or a way to take it
//! down: each test is one probe an operator would make, against a real
//! `kvroute serve` in front of real `kvroute mocker` engines.

use std::io::{Read, Write};
use std::net::TcpStream;
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
