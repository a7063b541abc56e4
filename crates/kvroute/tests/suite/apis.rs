//! OpenAI's Responses API and Anthropic's Messages API through the router,
//! against mock engines that serve both: requests are routed by their
//! prompt (a repeated system prompt finds its blocks), a
//! `previous_response_id` continuation goes back to the engine that holds
//! the previous response (at any replica), both SSE streams reach the
//! client byte for byte, and every refusal is in its API's error shape.

use std::io::{Read, Write};
use std::net::{TcpListener, TcpStream};
use std::sync::{Arc, Mutex, PoisonError};

use kvroute_loadgen::nats::NatsServer;
use serde_json::{json, Value};

use crate::support::door::Door;
use crate::support::http::{count, dechunk, request, request_with, Reply};
use crate::support::{eventually, spawn_serve_with_env, start_mocker_with, start_serve, Proc};

/// Mock engines that render text with the built-in tokenizer, fast.
fn engines(n: usize) -> (Proc, Vec<String>) {
    start_mocker_with(n, &["--speedup", "50"])
}

/// A long system prompt of group `g` (about 700 tokens).
fn system(g: usize) -> String {
    (0..160)
        .map(|i| format!("rule{g}x{i}"))
        .collect::<Vec<_>>()
        .join(" ")
}

/// Question `q` of a conversation.
fn question(q: usize) -> String {
    format!("question number {q}: what does rule {q} say, briefly?")
}

fn post(serve: &str, path: &str, body: &Value) -> Reply {
    request(serve, "POST", path, &body.to_string())
}

/// The cached tokens an answer of either API reports.
fn cached(doc: &Value) -> u64 {
    let u = &doc["usage"];
    u["input_tokens_details"]["cached_tokens"]
        .as_u64()
        .or_else(|| u["cache_read_input_tokens"].as_u64())
        .unwrap_or(0)
}

/// The most of `messages` (chat form) any rank of the engines at `urls`
/// holds: what a router that knew every cache would get.
fn oracle(urls: &[String], messages: &Value) -> u64 {
    urls.iter()
        .filter_map(|url| {
            let doc = post(url, "/internal/cache_match", &json!({"messages": messages})).json();
            doc["ranks"]
                .as_array()?
                .iter()
                .filter_map(|r| r["matched_tokens"].as_u64())
                .max()
        })
        .max()
        .unwrap_or(0)
}

/// The `host:port` of a `--worker` line's URL.
fn url_of(line: &str) -> String {
    let start = line.find("url=http://").expect("a url") + "url=http://".len();
    let rest = &line[start..];
    rest[..rest.find([',', ' ']).unwrap_or(rest.len())].to_owned()
}

#[test]
fn a_repeated_system_prompt_hits_in_both_apis() {
    let (_mocker, lines) = engines(4);
    let urls: Vec<String> = lines.iter().map(|l| url_of(l)).collect();
    let (_serve, serve) = start_serve(&lines, &["--tokenizer", "builtin"]);
    let (mut got, mut best, mut prompt_tokens) = (0, 0, 0);
    for k in 0..48 {
        let (g, q) = ((k * 5) % 8, k);
        let chat = json!([
            {"role": "system", "content": system(g)},
            {"role": "user", "content": question(q)},
        ]);
        best += oracle(&urls, &chat);
        let reply = if k % 2 == 0 {
            let body = json!({"model": "mock-model", "instructions": system(g),
                "input": question(q), "max_output_tokens": 2});
            post(&serve, "/v1/responses", &body)
        } else {
            let body = json!({"model": "mock-model", "system": system(g), "max_tokens": 2,
                "messages": [{"role": "user", "content": question(q)}]});
            post(&serve, "/v1/messages", &body)
        };
        assert_eq!(reply.status, 200, "{}", reply.body);
        let doc = reply.json();
        got += cached(&doc);
        prompt_tokens += doc["usage"]["input_tokens"].as_u64().unwrap_or(0);
        // The engines' events reach the index before the next request: the
        // router's best match for the conversation is the engines' own.
        let held = oracle(&urls, &chat);
        eventually("the answer's blocks in the router's index", || {
            crate::support::indexed(&serve, &json!({"model": "mock-model", "messages": chat}))
                >= held
        });
    }
    assert!(
        best > prompt_tokens / 2,
        "the workload repeats: {best} of {prompt_tokens}"
    );
    assert!(
        got as f64 >= 0.95 * best as f64,
        "hit {got} cached tokens, the oracle {best}"
    );
    assert!(count(&serve, "kvroute_proxy_load_only_total") == 0);
}

/// The worker `kvroute serve` says answered.
fn routed_by(reply: &Reply) -> String {
    reply.header("x-kvroute-worker").expect("routed")
}

/// One Responses API turn at `serve`: its id, the worker it went to (as
/// `worker` reads it off the answer), and its usage (cached and prompt
/// tokens).
fn respond(
    (serve, worker): (&str, &dyn Fn(&Reply) -> String),
    previous: Option<&str>,
    q: usize,
    stream: bool,
) -> (String, String, (u64, u64)) {
    let mut body = json!({"model": "mock-model", "input": question(q),
        "max_output_tokens": 4, "stream": stream});
    if let Some(p) = previous {
        body["previous_response_id"] = json!(p);
    } else {
        body["instructions"] = json!(system(q));
    }
    let reply = post(serve, "/v1/responses", &body);
    assert_eq!(reply.status, 200, "{}", reply.body);
    let worker = worker(&reply);
    let (id, usage) = if stream {
        let events = sse_events(&reply.body);
        let created = events.iter().find(|e| e["type"] == "response.created");
        let completed = events.iter().find(|e| e["type"] == "response.completed");
        let id = created
            .and_then(|e| e["response"]["id"].as_str())
            .expect("created");
        let response = completed.map_or(Value::Null, |e| e["response"].clone());
        (id.to_owned(), response)
    } else {
        let doc = reply.json();
        (doc["id"].as_str().expect("an id").to_owned(), doc)
    };
    let prompt = usage["usage"]["input_tokens"].as_u64().unwrap_or(0);
    (id, worker, (cached(&usage), prompt))
}

/// The JSON `data:` of each event of an SSE body (chunked or not).
fn sse_events(body: &str) -> Vec<Value> {
    body.lines()
        .filter_map(|l| l.strip_prefix("data: "))
        .filter_map(|d| serde_json::from_str(d).ok())
        .collect()
}

fn a_continuation_goes_back_to_the_engine_that_holds_its_response(door: Door) {
    let (_mocker, lines) = engines(3);
    // Round-robin would send each turn elsewhere; only the response's pin
    // keeps the conversation where the engine can continue it.
    let front = door.start(&lines, &["--policy", "round-robin"], &[]);
    let worker = |r: &Reply| front.worker_of(r);
    let (serve, at) = (
        &front.router,
        (front.addr.as_str(), &worker as &dyn Fn(&Reply) -> String),
    );
    let (mut id, first, (_, mut prompt)) = respond(at, None, 1, false);
    for turn in 0..6 {
        let (next, worker, (hit, tokens)) = respond(at, Some(&id), 10 + turn, turn % 2 == 1);
        assert_eq!(worker, first, "turn {turn} left the conversation's engine");
        assert!(
            hit >= prompt / 16 * 16 && tokens > prompt,
            "turn {turn} recomputed its history: {hit} of {tokens} cached, the last prompt {prompt}"
        );
        (id, prompt) = (next, tokens);
    }
    assert_eq!(count(serve, "kvroute_proxy_continuation_kept_total"), 6);
    // An id no engine wrote: the engine's own 404, answered by the router.
    let body = json!({"model": "mock-model", "input": "hi", "previous_response_id": "resp_nope"});
    let reply = post(&front.addr, "/v1/responses", &body);
    assert_eq!(reply.status, 404, "{}", reply.body);
    assert_eq!(
        reply.json()["error"]["param"],
        "previous_response_id",
        "{}",
        reply.body
    );
}

#[test]
fn a_continuation_goes_back_to_the_engine_that_holds_its_response_over_http() {
    a_continuation_goes_back_to_the_engine_that_holds_its_response(Door::Http);
}

/// The picker reads each response's id off the answer as it passes (its
/// response phase), as the proxy does.
#[cfg(feature = "epp")]
#[test]
fn a_continuation_goes_back_to_the_engine_that_holds_its_response_through_the_picker() {
    a_continuation_goes_back_to_the_engine_that_holds_its_response(Door::Picker);
}

#[test]
fn replicas_share_sessions_and_responses() {
    let nats = NatsServer::start().expect("nats-server starts");
    let (_mocker, lines) = engines(3);
    let replica = |id: &str| {
        let url = nats.url();
        let env = [("KVROUTE_NATS", url.as_str()), ("KVROUTE_REPLICA_ID", id)];
        spawn_serve_with_env(&lines, &["--policy", "round-robin"], &env)
    };
    let routes = |serve: &str| {
        eventually("the replica routes", || {
            post(
                serve,
                "/v1/responses",
                &json!({"model": "mock-model", "input": "x"}),
            )
            .status
                == 200
        });
    };
    // A pins responses before B is started: B learns them when it opens
    // its watch, as well as every pin A makes after.
    let (_a, a) = replica("a");
    routes(&a);
    eventually("A put its first pin", || {
        count(&a, "kvroute_replica_pins_sent_total") >= 1
    });
    let (_b, b) = replica("b");
    routes(&b);
    let pins = || count(&b, "kvroute_replica_pins_received_total");
    let settled = || {
        eventually("B applied every pin A sent so far", || {
            pins() >= count(&a, "kvroute_replica_pins_sent_total")
        })
    };
    settled();
    let before = pins();
    // A response made at A, continued at B, which never saw it: round-robin
    // there would rotate the turns over the three engines.
    let (id, first, _) = respond((&a, &routed_by), None, 3, false);
    eventually("B applied A's response pin", || pins() > before);
    for turn in 0..3 {
        let body = json!({"model": "mock-model", "input": "and?", "previous_response_id": id,
            "max_output_tokens": 2});
        let reply = post(&b, "/v1/responses", &body);
        assert_eq!(reply.status, 200, "turn {turn}: {}", reply.body);
        assert_eq!(
            reply.header("x-kvroute-worker"),
            Some(first.clone()),
            "turn {turn}"
        );
    }
    // A session's turn at A, the next ones at B.
    let turn = |serve: &str| {
        let body = json!({"model": "mock-model", "prompt": question(7), "max_tokens": 1});
        let reply = request_with(
            serve,
            "POST",
            "/v1/completions",
            &[("x-session-id", "shared-conv")],
            &body.to_string(),
        );
        assert_eq!(reply.status, 200, "{}", reply.body);
        reply.header("x-kvroute-worker").expect("routed")
    };
    settled();
    let before = pins();
    let at_a = turn(&a);
    eventually("B applied A's session pin", || pins() > before);
    for k in 0..3 {
        assert_eq!(turn(&b), at_a, "turn {k} at B left the session's rank");
    }
}

/// Each answer the relay passed on, with its request line.
type Recorded = Mutex<Vec<(String, Vec<u8>)>>;

/// An HTTP relay between the router and one engine that keeps the bytes of
/// every answer the engine sent, with its request line (one request per
/// connection).
fn recording_relay(upstream: String) -> (String, Arc<Recorded>) {
    let listener = TcpListener::bind("127.0.0.1:0").expect("bind");
    let addr = listener.local_addr().expect("addr").to_string();
    let answers = Arc::new(Mutex::new(Vec::new()));
    let kept = answers.clone();
    std::thread::spawn(move || {
        for client in listener.incoming().map_while(Result::ok) {
            let (upstream, kept) = (upstream.clone(), kept.clone());
            std::thread::spawn(move || relay_one(client, &upstream, &kept));
        }
    });
    (addr, answers)
}

fn relay_one(mut client: TcpStream, upstream: &str, kept: &Recorded) {
    let mut request = Vec::new();
    let mut buf = [0u8; 8192];
    let head_end = loop {
        let Ok(n) = client.read(&mut buf) else { return };
        if n == 0 {
            return;
        }
        request.extend_from_slice(&buf[..n]);
        if let Some(i) = request.windows(4).position(|w| w == b"\r\n\r\n") {
            break i + 4;
        }
    };
    let head = String::from_utf8_lossy(&request[..head_end]).to_ascii_lowercase();
    let length: usize = head
        .lines()
        .find_map(|l| l.strip_prefix("content-length:"))
        .and_then(|v| v.trim().parse().ok())
        .unwrap_or(0);
    while request.len() < head_end + length {
        let Ok(n) = client.read(&mut buf) else { return };
        if n == 0 {
            return;
        }
        request.extend_from_slice(&buf[..n]);
    }
    // One request per connection: ask the engine to close after it.
    let head: String = String::from_utf8_lossy(&request[..head_end - 2])
        .split_inclusive("\r\n")
        .filter(|l| !l.to_ascii_lowercase().starts_with("connection:"))
        .collect();
    let head = format!("{head}Connection: close\r\n\r\n");
    let mut engine = TcpStream::connect(upstream).expect("engine");
    let _ = engine.write_all(head.as_bytes());
    let _ = engine.write_all(&request[head_end..]);
    let mut answer = Vec::new();
    let _ = engine.read_to_end(&mut answer);
    // Recorded before it is forwarded, so the client cannot finish first.
    let line = head.lines().next().unwrap_or_default().to_owned();
    kept.lock()
        .unwrap_or_else(PoisonError::into_inner)
        .push((line, answer.clone()));
    let _ = client.write_all(&answer);
}

/// The body of a raw HTTP answer, without chunked framing.
fn body_of(raw: &[u8]) -> Vec<u8> {
    let at = raw
        .windows(4)
        .position(|w| w == b"\r\n\r\n")
        .expect("a head")
        + 4;
    let head = String::from_utf8_lossy(&raw[..at]).to_ascii_lowercase();
    if head.contains("transfer-encoding: chunked") {
        dechunk(&raw[at..]).0
    } else {
        raw[at..].to_vec()
    }
}

#[test]
fn both_sse_streams_reach_the_client_byte_for_byte() {
    let (_mocker, lines) = engines(1);
    let (relay, answers) = recording_relay(url_of(&lines[0]));
    let line = lines[0].replacen(&url_of(&lines[0]), &relay, 1);
    let (_serve, serve) = start_serve(&[line], &[]);
    let cases = [
        (
            "/v1/responses",
            json!({"model": "mock-model", "input": question(1),
            "max_output_tokens": 12, "stream": true}),
        ),
        (
            "/v1/messages",
            json!({"model": "mock-model", "max_tokens": 12, "stream": true,
            "messages": [{"role": "user", "content": question(2)}]}),
        ),
    ];
    let mut last = String::new();
    for (path, body) in cases {
        answers
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .clear();
        let mut s = crate::support::http::send(&serve, "POST", path, &body.to_string());
        let mut raw = Vec::new();
        let _ = s.read_to_end(&mut raw);
        let relayed = body_of(&raw);
        let sent: Vec<Vec<u8>> = answers
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .iter()
            .filter(|(line, _)| line.starts_with(&format!("POST {path} ")))
            .map(|(_, answer)| answer.clone())
            .collect();
        assert_eq!(sent.len(), 1, "{path}: one answer from the engine");
        let engine = body_of(&sent[0]);
        assert!(
            engine.len() > 200,
            "{path}: {}",
            String::from_utf8_lossy(&engine)
        );
        assert_eq!(
            String::from_utf8_lossy(&relayed),
            String::from_utf8_lossy(&engine),
            "{path}: the router changed the stream"
        );
        last = String::from_utf8_lossy(&engine).into_owned();
    }
    for event in [
        "message_start",
        "content_block_start",
        "content_block_delta",
        "message_delta",
        "message_stop",
    ] {
        assert!(
            last.contains(&format!("event: {event}")),
            "{event} in {last}"
        );
    }
}

#[test]
fn refusals_are_in_each_apis_error_shape() {
    let (_mocker, lines) = engines(1);
    let (_serve, serve) = start_serve(&lines, &["--max-body-mib", "1"]);
    let anthropic = |reply: &Reply, status: u16, kind: &str| {
        assert_eq!(reply.status, status, "{}", reply.body);
        let doc = reply.json();
        assert_eq!(doc["type"], "error", "{doc}");
        assert_eq!(doc["error"]["type"], kind, "{doc}");
        assert!(
            doc["error"]["message"]
                .as_str()
                .is_some_and(|m| !m.is_empty()),
            "{doc}"
        );
    };
    let messages = |body: &str| request(&serve, "POST", "/v1/messages", body);
    anthropic(&messages("{not json"), 400, "invalid_request_error");
    anthropic(
        &request(&serve, "GET", "/v1/messages", ""),
        405,
        "invalid_request_error",
    );
    anthropic(
        &messages(r#"{"model":"mock-model","messages":[{"role":"user","content":"hi"}]}"#),
        400,
        "invalid_request_error",
    );
    anthropic(
        &messages(r#"{"model":"nope","max_tokens":2,"messages":[{"role":"user","content":"hi"}]}"#),
        404,
        "not_found_error",
    );
    let huge = json!({"model": "mock-model", "max_tokens": 2,
        "messages": [{"role": "user", "content": "x".repeat(1_100_000)}]});
    anthropic(&messages(&huge.to_string()), 413, "request_too_large");
    // The Responses API is OpenAI's: OpenAI's shape.
    let openai = |reply: &Reply, status: u16, code: Value| {
        assert_eq!(reply.status, status, "{}", reply.body);
        let doc = reply.json();
        assert!(doc["error"]["message"].is_string(), "{doc}");
        assert_eq!(doc["error"]["code"], code, "{doc}");
    };
    let responses = |body: &str| request(&serve, "POST", "/v1/responses", body);
    openai(
        &responses(r#"{"model":"mock-model","input":7}"#),
        400,
        json!(400),
    );
    openai(
        &responses(r#"{"model":"nope","input":"hi"}"#),
        404,
        json!("model_not_found"),
    );
}

/// The packages `tests/sdk/clients.py` imports.
const SDK_PACKAGES: &str = "openai anthropic";

#[test]
fn the_official_sdks_parse_the_routers_answers() {
    let python = crate::support::python_with(
        "KVROUTE_SDK_PYTHON",
        "sdk",
        SDK_PACKAGES,
        "import openai, anthropic",
    );
    let (_mocker, lines) = engines(2);
    let (_serve, serve) = start_serve(&lines, &["--tokenizer", "builtin"]);
    let script = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/sdk/clients.py");
    let out = std::process::Command::new(python)
        .arg(script)
        .args([format!("http://{serve}"), "mock-model".to_owned()])
        .output()
        .expect("python runs");
    assert!(
        out.status.success(),
        "the SDKs failed: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    let doc: Value = serde_json::from_slice(&out.stdout).expect("the script's JSON");
    assert!(
        doc["responses"]["text"]
            .as_str()
            .is_some_and(|t| !t.is_empty()),
        "{doc}"
    );
    let stream = &doc["responses_stream"];
    assert_eq!(stream["previous"], doc["responses"]["id"], "{doc}");
    assert!(
        stream["cached"].as_u64() >= Some(256),
        "the continuation hit: {doc}"
    );
    let events: Vec<&str> = stream["events"]
        .as_array()
        .into_iter()
        .flatten()
        .filter_map(Value::as_str)
        .collect();
    assert_eq!(events.first(), Some(&"response.created"), "{doc}");
    assert_eq!(events.last(), Some(&"response.completed"), "{doc}");
    assert!(events.contains(&"response.output_text.delta"), "{doc}");
    assert_eq!(
        doc["openai_error"],
        json!({"status": 404, "code": "model_not_found"})
    );
    assert!(
        doc["messages"]["text"]
            .as_str()
            .is_some_and(|t| !t.is_empty()),
        "{doc}"
    );
    assert!(doc["messages"]["output_tokens"].as_u64() > Some(0), "{doc}");
    let kinds: Vec<&str> = doc["messages_stream"]["events"]
        .as_array()
        .into_iter()
        .flatten()
        .filter_map(Value::as_str)
        .collect();
    assert_eq!(kinds.first(), Some(&"message_start"), "{doc}");
    assert_eq!(kinds.last(), Some(&"message_stop"), "{doc}");
    assert!(
        doc["messages_stream"]["cache_read"].as_u64() >= Some(256),
        "the system prompt hit: {doc}"
    );
    assert_eq!(
        doc["anthropic_error"],
        json!({"status": 404, "type": "not_found_error"})
    );
}
