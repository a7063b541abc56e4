//! Exposing kvroute must never open a way into the fleet or a way to take it
//! down: each test is one finding of an operator probe, reproduced against a
//! real `kvroute serve` in front of real `kvroute mocker` engines.

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

/// Finding 1: without `--admin-token`, anyone could register a worker that
/// points anywhere and unregister the real ones.
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

/// Finding 1: a registered URL with a path and query made the router call
/// arbitrary paths with clients' credentials (SSRF).
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

/// Finding 2: one request with `max_tokens` 99 999 999 999 killed every
/// engine in turn (the mocker allocated for it; the router retried it on the
/// next worker, and the next).
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

/// RSS of a process, in bytes.
fn rss(pid: u32) -> u64 {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).unwrap_or_default();
    status
        .lines()
        .find_map(|l| l.strip_prefix("VmRSS:"))
        .and_then(|v| v.trim().trim_end_matches("kB").trim().parse::<u64>().ok())
        .map_or(0, |kb| kb * 1024)
}

/// Finding 3: six concurrent 32 MiB `/query` bodies took the router to 1 GB
/// and held up every other request.
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
    let rss = rss(serve_proc.0.id());
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

/// Finding 4: idle and slow-header connections stayed open for a minute and
/// more, and enough of them made the router unreachable.
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
    let held: Vec<TcpStream> = (0..8)
        .map(|_| TcpStream::connect(&serve).expect("connect"))
        .collect();
    std::thread::sleep(Duration::from_millis(200));
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

/// Finding 3: while a huge body was being worked on, `/health` took 0.55 s.
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
    let stop = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
    let load = {
        let (serve, stop) = (serve.clone(), stop.clone());
        std::thread::spawn(move || {
            let mut sent = 0;
            while !stop.load(std::sync::atomic::Ordering::Relaxed) {
                let _ = request(&serve, "POST", "/v1/completions", &body);
                sent += 1;
            }
            sent
        })
    };
    std::thread::sleep(Duration::from_millis(300));
    let mut latencies: Vec<Duration> = (0..200)
        .map(|_| {
            let start = Instant::now();
            assert_eq!(request(&serve, "GET", "/health", "").status, 200);
            let took = start.elapsed();
            std::thread::sleep(Duration::from_millis(10));
            took
        })
        .collect();
    stop.store(true, std::sync::atomic::Ordering::Relaxed);
    let sent = load.join().expect("load");
    assert!(
        sent >= 2,
        "the large prompts overlapped the probes ({sent} sent)"
    );
    latencies.sort();
    let p99 = latencies[latencies.len() * 99 / 100];
    eprintln!(
        "/health beside {sent} 10 MB prompts: p50 {:?}, p99 {p99:?}, max {:?}",
        latencies[latencies.len() / 2],
        latencies[latencies.len() - 1]
    );
    assert!(p99 < Duration::from_millis(20), "/health p99 {p99:?}");
}

/// Finding 5: a worker that died mid-stream cut the client's stream without
/// telling it why.
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
    let text = String::from_utf8_lossy(&seen);
    let tail = &text[text.len().saturating_sub(600)..];
    assert!(tail.contains("data: {\"error\""), "{tail}");
    assert!(
        tail.contains("x-request-id") || tail.contains("request kvroute-"),
        "{tail}"
    );
    assert!(
        tail.trim_end().ends_with("data: [DONE]") || tail.contains("data: [DONE]"),
        "{tail}"
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

/// Finding 2: the router treated a connection the worker dropped after
/// taking the request as retryable, and spread the request to the next
/// workers.
#[test]
fn a_request_a_worker_took_and_dropped_is_not_sent_to_another() {
    let (_mocker, lines) = start_mocker(1, "100");
    let (fake, taken) = dropping_worker();
    let dead_events = format!("tcp://127.0.0.1:{}", free_port());
    let fake_line = format!("name=fake,url=http://{fake},events={dead_events},dp=1,block_size=16");
    let (_serve, serve) = spawn_serve(
        &[lines[0].clone(), fake_line],
        &["--policy", "round-robin", "--breaker-failures", "5"],
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

/// Finding 5: a 413 was plain text.
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
