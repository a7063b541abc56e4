//! `POST /internal/cache_match`: the engine's true cache state per rank, read-only,
//! agreeing with the `cached_tokens` a real request then reports.

use std::net::SocketAddr;

use kvroute_core::event::WorkerFlavor;
use serde_json::{json, Value};

use super::common::{config, http, TestFleet};

/// A fleet of one engine with `dp` ranks (simulated time off: requests run in real time).
fn engine(flavor: WorkerFlavor, dp: u16) -> TestFleet {
    TestFleet::start(kvroute_mocker::MockerConfig {
        dp_size: dp,
        ts_source: kvroute_mocker::TsSource::Wall,
        ..config(flavor)
    })
}

/// One POST; the status and the JSON body, which must be sized (not chunked).
fn post(addr: SocketAddr, path: &str, headers: &[(&str, &str)], body: &Value) -> (u16, Value) {
    let bytes = serde_json::to_vec(body).expect("json");
    let r = http(addr, "POST", path, headers, Some(&bytes));
    assert!(
        r.header("transfer-encoding").is_none(),
        "expected a sized body"
    );
    (r.status, r.json())
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
    for flavor in [WorkerFlavor::Vllm, WorkerFlavor::Sglang] {
        let engine = engine(flavor, 2);
        let addr = engine.http(0);
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
    let engine = engine(WorkerFlavor::Vllm, 1);
    let addr = engine.http(0);
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
