//! `POST /internal/cache_match`: the engine's true cache state per rank, read-only,
//! agreeing with the `cached_tokens` a real request then reports.

use std::io::{Read, Write};
use std::net::{SocketAddr, TcpStream};
use std::time::Duration;

use kvroute_mocker::{EngineFlavor, Fleet, MockerConfig};
use serde_json::{json, Value};

/// A fleet of one engine with `dp` ranks on ephemeral ports, with its runtime.
struct Engine {
    fleet: Option<Fleet>,
    rt: tokio::runtime::Runtime,
}

impl Engine {
    fn start(flavor: EngineFlavor, dp: u16) -> Self {
        let rt = tokio::runtime::Builder::new_multi_thread()
            .worker_threads(2)
            .enable_all()
            .build()
            .expect("runtime");
        let mut config = MockerConfig {
            flavor,
            port: 0,
            kv_events_port: 0,
            replay_port: 0,
            dp_size: dp,
            num_gpu_blocks: 256,
            block_size: 16,
            ..MockerConfig::default()
        };
        config.timing.speedup = 1000.0;
        let fleet = rt.block_on(Fleet::start(config)).expect("fleet starts");
        Engine {
            fleet: Some(fleet),
            rt,
        }
    }

    fn addr(&self) -> SocketAddr {
        self.fleet.as_ref().expect("running").workers()[0].http_addr
    }
}

impl Drop for Engine {
    fn drop(&mut self) {
        if let Some(fleet) = self.fleet.take() {
            self.rt.block_on(fleet.shutdown());
        }
    }
}

/// One POST with `Connection: close`; returns the status and the JSON body.
fn post(addr: SocketAddr, path: &str, headers: &[(&str, &str)], body: &Value) -> (u16, Value) {
    let body = serde_json::to_vec(body).expect("json");
    let mut stream = TcpStream::connect(addr).expect("connect");
    stream
        .set_read_timeout(Some(Duration::from_secs(20)))
        .expect("timeout");
    let mut head = format!(
        "POST {path} HTTP/1.1\r\nHost: {addr}\r\nConnection: close\r\nContent-Type: application/json\r\nContent-Length: {}\r\n",
        body.len()
    );
    for (k, v) in headers {
        head.push_str(&format!("{k}: {v}\r\n"));
    }
    head.push_str("\r\n");
    stream.write_all(head.as_bytes()).expect("write");
    stream.write_all(&body).expect("write body");
    let mut raw = Vec::new();
    stream.read_to_end(&mut raw).expect("read");
    let split = raw
        .windows(4)
        .position(|w| w == b"\r\n\r\n")
        .expect("header end");
    let head = String::from_utf8_lossy(&raw[..split]).into_owned();
    let status = head
        .split(' ')
        .nth(1)
        .and_then(|s| s.parse().ok())
        .expect("status");
    assert!(
        !head
            .to_ascii_lowercase()
            .contains("transfer-encoding: chunked"),
        "expected a sized body: {head}"
    );
    let value = serde_json::from_slice(&raw[split + 4..]).expect("JSON body");
    (status, value)
}

fn matched(answer: &Value) -> Vec<u64> {
    answer["ranks"]
        .as_array()
        .expect("ranks")
        .iter()
        .map(|r| r["matched_tokens"].as_u64().expect("matched_tokens"))
        .collect()
}

#[test]
fn cache_match_reports_each_rank_and_agrees_with_cached_tokens() {
    for flavor in [EngineFlavor::Vllm, EngineFlavor::Sglang] {
        let engine = Engine::start(flavor, 2);
        let addr = engine.addr();
        let ids: Vec<u64> = (1000..1100).collect();
        let body = json!({"prompt": ids, "max_tokens": 2});

        let (status, answer) = post(addr, "/internal/cache_match", &[], &body);
        assert_eq!(status, 200, "{answer}");
        assert_eq!(answer["prompt_tokens"], 100);
        assert_eq!(answer["ranks"][0]["rank"], 0);
        assert_eq!(answer["ranks"][1]["rank"], 1);
        assert_eq!(matched(&answer), [0, 0]);

        // Run the prompt on rank 1: only rank 1 holds it afterwards.
        let (status, first) = post(
            addr,
            "/v1/completions",
            &[("X-data-parallel-rank", "1")],
            &body,
        );
        assert_eq!(status, 200, "{first}");
        let (_, answer) = post(addr, "/internal/cache_match", &[], &body);
        // Never the whole prompt: 100 tokens at block size 16 → 96.
        assert_eq!(matched(&answer), [0, 96], "{flavor:?}");
        // Asking again changes nothing (read-only).
        let (_, again) = post(addr, "/internal/cache_match", &[], &body);
        assert_eq!(again, answer);

        // The prediction is what the engine then reports.
        let (_, repeat) = post(
            addr,
            "/v1/completions",
            &[("X-data-parallel-rank", "1")],
            &body,
        );
        assert_eq!(
            repeat["usage"]["prompt_tokens_details"]["cached_tokens"],
            96
        );

        // A longer prompt with the same start matches the shared blocks only.
        let longer: Vec<u64> = (1000..1050).chain(5000..5100).collect();
        let (_, answer) = post(
            addr,
            "/internal/cache_match",
            &[],
            &json!({"prompt": longer, "max_tokens": 1, "endpoint": "completions"}),
        );
        assert_eq!(matched(&answer), [0, 48]);
        assert_eq!(answer["prompt_tokens"], 150);
    }
}

#[test]
fn chat_bodies_are_built_as_the_real_request_and_bad_bodies_are_refused() {
    let engine = Engine::start(EngineFlavor::Vllm, 1);
    let addr = engine.addr();
    let words: Vec<String> = (0..60).map(|i| format!("word{i}")).collect();
    let chat = json!({
        "messages": [{"role": "user", "content": words.join(" ")}],
        "max_tokens": 2,
    });
    let (status, before) = post(addr, "/internal/cache_match", &[], &chat);
    assert_eq!(status, 200, "{before}");
    let prompt_tokens = before["prompt_tokens"].as_u64().expect("prompt_tokens");
    assert_eq!(matched(&before), [0]);
    let (_, done) = post(addr, "/v1/chat/completions", &[], &chat);
    assert_eq!(done["usage"]["prompt_tokens"].as_u64(), Some(prompt_tokens));
    let mut explicit = chat.clone();
    explicit["endpoint"] = json!("chat");
    let (_, after) = post(addr, "/internal/cache_match", &[], &explicit);
    assert_eq!(matched(&after), [(prompt_tokens - 1) / 16 * 16]);

    let (status, e) = post(
        addr,
        "/internal/cache_match",
        &[],
        &json!({"prompt": [1, 2], "endpoint": "embeddings"}),
    );
    assert_eq!(status, 400);
    assert!(e["error"]["message"]
        .as_str()
        .expect("message")
        .contains("endpoint"));
    let (status, _) = post(addr, "/internal/cache_match", &[], &json!({"prompt": []}));
    assert_eq!(status, 400);
}
