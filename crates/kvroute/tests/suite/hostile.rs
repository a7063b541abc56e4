//! Hostile clients and workers against the real router: fields only the
//! router may set, bodies built to cost memory, bodies that never finish,
//! and a worker that answers without end. Each leaves the router's memory
//! under a stated bound (its high-water mark, `VmHWM`, so no peak between
//! two samples is missed) and every other client served.

use std::io::{Read, Write};
use std::net::{TcpListener, TcpStream};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;

use serde_json::{json, Value};

use super::disagg;
use crate::support::http::{connect, read_reply, request, Reply};
use crate::support::{
    assert_peak_rss_under, eventually, free_port, spawn_serve_with_env, start_mocker, Proc,
};

/// The bound on the router's resident memory under every attack here
/// (the default limits; a debug build's 35 MiB start included).
const RSS_BOUND: u64 = 256 << 20;

/// A listener that records whether anyone connected to it: where a hostile
/// hand-off field would point an engine.
fn trap() -> (String, Arc<AtomicBool>) {
    let listener = TcpListener::bind("127.0.0.1:0").expect("bind");
    let port = listener.local_addr().expect("addr").port();
    let hit = Arc::new(AtomicBool::new(false));
    let flag = hit.clone();
    std::thread::spawn(move || {
        for stream in listener.incoming().flatten() {
            flag.store(true, Ordering::SeqCst);
            drop(stream);
        }
    });
    (port.to_string(), hit)
}

/// A client's `kv_transfer_params` never reach an engine: not on the
/// split path, and not when the decode rank prefills the prompt itself
/// (where they used to be forwarded as sent, and a vLLM decode engine read
/// KV from wherever they pointed). The same for SGLang's bootstrap fields
/// and on every API.
#[test]
fn a_client_cannot_send_prefill_decode_hand_off_fields() {
    let (_procs, serve) = disagg::fleet("vllm", &[]);
    let tokens = disagg::prompt(31);
    // Split once: the decode engine then holds the prompt, and a repeat
    // is prefilled there (the path that forwarded the body as sent).
    assert_eq!(disagg::complete(&serve, &tokens, false).status, 200);
    eventually("the decode rank holds the prompt", || {
        disagg::query(&serve, &tokens)["disagg"]["prefill_locally"] == true
    });
    let (port, hit) = trap();
    let hostile = json!({"do_remote_prefill": true, "remote_engine_id": "evil",
        "remote_request_id": "r", "remote_host": "127.0.0.1", "remote_port": port.parse::<u16>().expect("port"),
        "remote_block_ids": [[1, 2, 3]]});
    let body = json!({"model": "mock-model", "prompt": tokens, "max_tokens": 4,
        "kv_transfer_params": hostile});
    let reply = request(&serve, "POST", "/v1/completions", &body.to_string());
    assert_eq!(reply.status, 400, "{}", reply.body);
    assert!(reply.body.contains("kv_transfer_params"), "{}", reply.body);
    let chat = json!({"model": "mock-model", "max_tokens": 4,
        "messages": [{"role": "user", "content": "hello"}], "bootstrap_host": "127.0.0.1"});
    let generate = json!({"input_ids": tokens, "bootstrap_room": 7, "bootstrap_port": port});
    let messages = json!({"model": "mock-model", "max_tokens": 4,
        "messages": [{"role": "user", "content": "hi"}], "kv_transfer_params": {}});
    let responses = json!({"model": "mock-model", "input": "hi", "bootstrap_port": 1});
    for (path, body) in [
        ("/v1/chat/completions", chat),
        ("/generate", generate),
        ("/v1/messages", messages),
        ("/v1/responses", responses),
    ] {
        let reply = request(&serve, "POST", path, &body.to_string());
        assert_eq!(reply.status, 400, "{path}: {}", reply.body);
        assert!(reply.body.contains("hand-offs"), "{path}: {}", reply.body);
    }
    // A field set to null is absent, as engines read it.
    let plain = json!({"model": "mock-model", "prompt": tokens, "max_tokens": 4,
        "kv_transfer_params": null});
    let reply = request(&serve, "POST", "/v1/completions", &plain.to_string());
    assert_eq!(reply.status, 200, "{}", reply.body);
    assert!(
        !hit.load(Ordering::SeqCst),
        "an engine connected where the client pointed it"
    );
}

/// Two mock engines and the router (with the built-in tokenizer, so text is
/// rendered and tokenized), `extra` flags and `env` settings (settings this
/// suite adds are given as variables, which an older build ignores, so the
/// suite shows the older build failing rather than refusing a flag).
fn router(extra: &[&str], env: &[(&str, &str)]) -> (Proc, Proc, String) {
    let (mocker, lines) = start_mocker(2, "50");
    let mut args = vec!["--tokenizer", "builtin"];
    args.extend_from_slice(extra);
    let (serve_proc, serve) = spawn_serve_with_env(&lines, &args, env);
    eventually("the router answers", || {
        TcpStream::connect(&serve).is_ok() && request(&serve, "GET", "/health", "").status == 200
    });
    eventually("every engine's stream connected", || {
        let doc = request(&serve, "GET", "/workers", "").json();
        let ranks: Vec<Value> = doc["workers"]
            .as_array()
            .into_iter()
            .flatten()
            .flat_map(|w| w["ranks"].as_array().cloned().unwrap_or_default())
            .collect();
        ranks.len() == lines.len() && ranks.iter().all(|r| r["connected"] == true)
    });
    (mocker, serve_proc, serve)
}

/// A small completion any honest client would send.
fn ordinary(serve: &str) -> Reply {
    let body = json!({"model": "mock-model", "prompt": "Hello there", "max_tokens": 2});
    request(serve, "POST", "/v1/completions", &body.to_string())
}

/// Runs `attack` on threads while an honest client keeps sending ordinary
/// requests, every one of which must be served; returns the attack's
/// results once they are all in.
fn under_attack<T: Send + 'static>(
    serve: &str,
    attack: Vec<Box<dyn FnOnce() -> T + Send>>,
) -> Vec<T> {
    let threads: Vec<_> = attack.into_iter().map(std::thread::spawn).collect();
    let mut served = 0;
    while threads.iter().any(|t| !t.is_finished()) || served == 0 {
        let reply = ordinary(serve);
        assert_eq!(
            reply.status, 200,
            "an honest client during the attack: {}",
            reply.body
        );
        served += 1;
    }
    threads
        .into_iter()
        .map(|t| t.join().expect("an attacking thread"))
        .collect()
}

/// Prompts of hundreds of thousands of messages or items, and a text
/// prompt of millions of words, sent at once to every API: each is refused
/// as longer than any context before it is built (one such body alone used
/// to take the router to 0.9 to 1 GB), the router's memory stays under the
/// bound, and an honest client is served throughout.
#[test]
fn huge_prompts_are_refused_before_they_are_built_and_memory_stays_bounded() {
    let (_mocker, serve_proc, serve) = router(&[], &[]);
    let items: Vec<Value> = (0..550_000)
        .map(|_| json!({"role": "user", "content": "x"}))
        .collect();
    let responses =
        json!({"model": "mock-model", "input": items, "max_output_tokens": 8}).to_string();
    let messages: Vec<Value> = (0..400_000)
        .map(|_| json!({"role": "user", "content": "hello there"}))
        .collect();
    let chat = json!({"model": "mock-model", "messages": messages, "max_tokens": 8}).to_string();
    let anthropic = chat.clone();
    let words: Vec<String> = (0..3_000_000).map(|i| format!("w{}", i % 1_000)).collect();
    let text =
        json!({"model": "mock-model", "prompt": words.join(" "), "max_tokens": 8}).to_string();
    let bodies = [
        ("/v1/responses", responses.clone()),
        ("/v1/responses", responses),
        ("/v1/chat/completions", chat.clone()),
        ("/v1/chat/completions", chat),
        ("/v1/messages", anthropic),
        ("/v1/completions", text.clone()),
        ("/v1/completions", text),
    ];
    let attack: Vec<Box<dyn FnOnce() -> Reply + Send>> = bodies
        .into_iter()
        .map(|(path, body)| {
            let serve = serve.clone();
            Box::new(move || request(&serve, "POST", path, &body))
                as Box<dyn FnOnce() -> Reply + Send>
        })
        .collect();
    for reply in under_attack(&serve, attack) {
        assert_eq!(reply.status, 400, "{}", reply.body);
        assert!(
            reply.body.contains("maximum context length"),
            "{}",
            reply.body
        );
    }
    assert_peak_rss_under(
        serve_proc.0.id(),
        RSS_BOUND,
        "under seven huge prompts at once",
    );
}

/// A socket that sent a request's head and `sent` bytes of a body it says
/// is `declared` bytes long, and then nothing.
fn stalled_body(serve: &str, declared: usize, sent: usize) -> TcpStream {
    let mut s = connect(serve);
    let _ = write!(
        s,
        "POST /v1/completions HTTP/1.1\r\nHost: {serve}\r\nContent-Type: application/json\r\nContent-Length: {declared}\r\n\r\n{{\"prompt\":\""
    );
    let chunk = vec![b'a'; 1 << 20];
    let mut left = sent;
    while left > 0 {
        let n = left.min(chunk.len());
        if s.write_all(&chunk[..n]).is_err() {
            break;
        }
        left -= n;
    }
    s
}

/// Twelve clients each send 25 MB of a 31 MB body and stall: the router
/// holds none of them past its memory budget (they used to take it past
/// 1 GB at 40), each is answered (503 while others hold the budget, 408
/// once it stalled too long), and honest clients are served meanwhile.
#[test]
fn stalled_large_bodies_cannot_hold_the_routers_memory() {
    // Two seconds from the head, with no credit for what arrived.
    let env = [
        ("KVROUTE_BODY_TIMEOUT_SECS", "2"),
        ("KVROUTE_BODY_MIN_RATE_KIB", "1000000"),
    ];
    let (_mocker, serve_proc, serve) = router(&[], &env);
    let attack: Vec<Box<dyn FnOnce() -> Reply + Send>> = (0..12)
        .map(|_| {
            let serve = serve.clone();
            Box::new(move || read_reply(stalled_body(&serve, 31 << 20, 25 << 20)))
                as Box<dyn FnOnce() -> Reply + Send>
        })
        .collect();
    for reply in under_attack(&serve, attack) {
        assert!(
            [408, 503].contains(&reply.status),
            "{} {}",
            reply.status,
            reply.body
        );
    }
    assert_peak_rss_under(
        serve_proc.0.id(),
        RSS_BOUND,
        "under twelve stalled 25 MB bodies",
    );
}

/// Clients that send a valid head and one byte of the body, then nothing,
/// are answered 408 and closed once the body-read allowance passes: they
/// no longer hold the router's connections (30 such sockets used to lock a
/// `--max-connections 30` router out for as long as they trickled).
#[test]
fn a_body_that_never_arrives_is_cut_off_and_frees_its_connection() {
    let env = [("KVROUTE_BODY_TIMEOUT_SECS", "1")];
    // Room for the six stalled clients and the helpers' own requests,
    // whose connections may not be counted closed yet.
    let (_mocker, _serve_proc, serve) = router(&["--max-connections", "8"], &env);
    let stalled: Vec<TcpStream> = (0..6).map(|_| stalled_body(&serve, 100_000, 1)).collect();
    let replies: Vec<Reply> = stalled.into_iter().map(read_reply).collect();
    for reply in &replies {
        assert_eq!(reply.status, 408, "{}", reply.body);
        assert!(reply.body.contains("--body-timeout-secs"), "{}", reply.body);
    }
    eventually("an honest client is served again", || {
        ordinary(&serve).status == 200
    });
}

/// A "prefill worker" answering its leg with a 64 MiB `kv_transfer_params`,
/// chunked and never announced: the router reads at most `--max-answer-mib`
/// of it, fails the request with a 502 naming the bound, and never sends the
/// object on to the decode engine (it used to read 400 MB answers whole and
/// forward them, 2.7 GB for three requests).
#[test]
fn a_prefill_workers_endless_answer_is_cut_at_the_bound() {
    let listener = TcpListener::bind("127.0.0.1:0").expect("bind");
    let url = format!("http://{}", listener.local_addr().expect("addr"));
    std::thread::spawn(move || {
        for mut stream in listener.incoming().flatten() {
            std::thread::spawn(move || {
                let mut head = [0u8; 65536];
                let _ = stream.read(&mut head);
                let _ = stream.write_all(
                    b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nTransfer-Encoding: chunked\r\n\r\n",
                );
                let start = b"{\"kv_transfer_params\":{\"do_remote_prefill\":true,\"pad\":\"";
                let _ = write!(stream, "{:x}\r\n", start.len());
                let _ = stream.write_all(start);
                let pad = vec![b'p'; 1 << 20];
                for _ in 0..64 {
                    let sent = write!(stream, "\r\n{:x}\r\n", pad.len())
                        .and_then(|()| stream.write_all(&pad));
                    if sent.is_err() {
                        return;
                    }
                }
                let _ = stream.write_all(b"\r\n3\r\n\"}}\r\n0\r\n\r\n");
            });
        }
    });
    let (_d, d_line) = disagg::engine("vllm", "decode", "d0");
    let events = format!("tcp://127.0.0.1:{}", free_port());
    // Its spec names its model: its /v1/models answer (64 MiB too) is refused.
    let p_line = format!(
        "name=p0,url={url},events={events},dp=1,block_size=16,role=prefill,model=mock-model"
    );
    let (serve_proc, serve) = disagg::start_serve_with_env(
        &[p_line, d_line],
        &["--local-prefill-max-tokens", "0"],
        &[("KVROUTE_MAX_ANSWER_MIB", "4")],
        &["d0"],
    );
    let attack: Vec<Box<dyn FnOnce() -> Reply + Send>> = (0..3)
        .map(|i| {
            let serve = serve.clone();
            Box::new(move || disagg::complete(&serve, &disagg::prompt(40 + i), false))
                as Box<dyn FnOnce() -> Reply + Send>
        })
        .collect();
    let threads: Vec<_> = attack.into_iter().map(std::thread::spawn).collect();
    for t in threads {
        let reply = t.join().expect("a client");
        assert_eq!(reply.status, 502, "{}", reply.body);
        assert!(reply.body.contains("--max-answer-mib"), "{}", reply.body);
    }
    assert_peak_rss_under(
        serve_proc.0.id(),
        128 << 20,
        "after three endless prefill answers",
    );
}

/// The body's own `priority` (vLLM's and SGLang's scheduling priority) is
/// held to what the client may ask for, as `x-priority` is: an untrusted
/// client may lower its priority, never raise it over the default (the
/// engine would otherwise serve it first, whatever the router's queue did).
#[test]
fn a_client_cannot_jump_the_engines_queue_with_the_body_priority() {
    let (_mocker, _serve_proc, serve) = router(&[], &[]);
    let ask = |priority: Value| {
        let body = json!({"model": "mock-model", "prompt": "Hello there", "max_tokens": 2,
            "priority": priority});
        request(&serve, "POST", "/v1/completions", &body.to_string())
    };
    let raised = ask(json!(-1_000_000));
    assert_eq!(raised.status, 400, "{}", raised.body);
    assert!(raised.body.contains("`priority`"), "{}", raised.body);
    assert_eq!(ask(json!("first")).status, 400);
    assert_eq!(
        ask(json!(5)).status,
        200,
        "lowering one's own priority is allowed"
    );
    assert_eq!(ask(Value::Null).status, 200);
}
