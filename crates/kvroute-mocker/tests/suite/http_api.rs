//! The OpenAI-compatible surface: shapes, streaming, errors, metrics, HTTP faults.

use std::time::{Duration, Instant};

use kvroute_core::event::WorkerFlavor;
use serde_json::json;

use super::common::*;

#[test]
fn completions_and_chat_answer_in_openai_shape_and_honour_max_tokens() {
    let fleet = TestFleet::start(config(WorkerFlavor::Vllm));
    let addr = fleet.http(0);
    let r = post(
        addr,
        "/v1/completions",
        &json!({"prompt": "Hello, world", "max_tokens": 7}),
    );
    assert_eq!(r.status, 200);
    let v = r.json();
    assert_eq!(v["object"], "text_completion");
    assert_eq!(v["model"], "mock-model");
    assert_eq!(v["choices"][0]["finish_reason"], "length");
    assert_eq!(v["usage"]["prompt_tokens"], 3);
    assert_eq!(v["usage"]["completion_tokens"], 7);
    assert_eq!(v["usage"]["total_tokens"], 10);
    assert!(!v["choices"][0]["text"].as_str().expect("text").is_empty());

    let chat = json!({
        "messages": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}],
        "max_completion_tokens": 5,
    });
    let v = post(addr, "/v1/chat/completions", &chat).json();
    assert_eq!(v["object"], "chat.completion");
    assert_eq!(v["choices"][0]["message"]["role"], "assistant");
    assert_eq!(v["usage"]["completion_tokens"], 5);
}

#[test]
fn streaming_sends_one_chunk_per_token_then_usage_then_done() {
    let fleet = TestFleet::start(config(WorkerFlavor::Sglang));
    let body = json!({
        "messages": [{"role": "user", "content": "Stream please"}],
        "max_tokens": 4,
        "stream": true,
        "stream_options": {"include_usage": true},
    });
    let r = post(fleet.http(0), "/v1/chat/completions", &body);
    assert_eq!(r.status, 200);
    assert_eq!(r.header("content-type"), Some("text/event-stream"));
    let data = r.sse_data();
    // role, 4 tokens, finish, usage, [DONE]
    assert_eq!(data.len(), 8, "{data:?}");
    assert_eq!(data[7], "[DONE]");
    let chunks: Vec<serde_json::Value> = data[..7]
        .iter()
        .map(|d| serde_json::from_str(d).expect("chunk JSON"))
        .collect();
    assert_eq!(chunks[0]["choices"][0]["delta"]["role"], "assistant");
    assert_eq!(chunks[5]["choices"][0]["finish_reason"], "length");
    assert_eq!(chunks[6]["choices"], json!([]));
    assert_eq!(chunks[6]["usage"]["completion_tokens"], 4);
    let streamed: String = chunks[1..5]
        .iter()
        .map(|c| {
            c["choices"][0]["delta"]["content"]
                .as_str()
                .expect("content")
        })
        .collect();
    // The same request without streaming generates the same text.
    let mut plain = body.clone();
    plain["stream"] = json!(false);
    let v = post(fleet.http(0), "/v1/chat/completions", &plain).json();
    assert_eq!(v["choices"][0]["message"]["content"], streamed.as_str());

    // Without include_usage: no usage chunk, no usage keys.
    let mut no_usage = body;
    no_usage["stream_options"] = json!({"include_usage": false});
    let data = post(fleet.http(0), "/v1/chat/completions", &no_usage).sse_data();
    assert_eq!(data.len(), 7);
    assert!(!data[1].contains("usage"));
}

#[test]
fn malformed_requests_get_4xx_json_errors() {
    let mut c = config(WorkerFlavor::Vllm);
    c.num_gpu_blocks = 4;
    let fleet = TestFleet::start(c);
    let addr = fleet.http(0);
    let cases: Vec<(&str, &str, &[u8], u16)> = vec![
        ("POST", "/v1/completions", b"{not json", 400),
        ("POST", "/v1/completions", b"[1,2]", 400),
        ("POST", "/v1/completions", br#"{"prompt": {"a": 1}}"#, 400),
        ("POST", "/v1/completions", br#"{"prompt": [1, 2.5]}"#, 400),
        ("POST", "/v1/completions", br#"{"prompt": "x", "max_tokens": -3}"#, 400),
        ("POST", "/v1/completions", br#"{"prompt": "x", "model": "other"}"#, 404),
        ("POST", "/v1/completions", br#"{"prompt": "x", "data_parallel_rank": 3}"#, 400),
        // 64 tokens of cache: 60 + 10 cannot fit.
        ("POST", "/v1/completions", br#"{"prompt": [1,2,3,4,5,6,7,8,9,10,11,12,13,14,15,16,17,18,19,20,21,22,23,24,25,26,27,28,29,30,31,32,33,34,35,36,37,38,39,40,41,42,43,44,45,46,47,48,49,50,51,52,53,54,55,56,57,58,59,60], "max_tokens": 10}"#, 400),
        ("POST", "/v1/chat/completions", br#"{"messages": "hi"}"#, 400),
        ("POST", "/v1/chat/completions", br#"{"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "data:image/png;base64,@@"}}]}]}"#, 400),
        ("GET", "/v1/completions", b"", 405),
        ("GET", "/nope", b"", 404),
    ];
    for (method, path, body, status) in cases {
        let body = (!body.is_empty()).then_some(body);
        let r = http(addr, method, path, &[], body);
        assert_eq!(r.status, status, "{method} {path} {}", r.text());
        let v = r.json();
        assert!(
            v["error"]["message"]
                .as_str()
                .is_some_and(|m| !m.is_empty()),
            "{v}"
        );
        assert_eq!(v["error"]["code"], status);
    }
    let r = http(
        addr,
        "POST",
        "/v1/completions",
        &[("X-data-parallel-rank", "abc")],
        Some(br#"{"prompt": "x"}"#),
    );
    assert_eq!(r.status, 400);
    // The server is still fine.
    assert_eq!(get(addr, "/health").status, 200);
}

#[test]
fn models_health_and_metrics() {
    let fleet = TestFleet::start(config(WorkerFlavor::Vllm));
    let addr = fleet.http(0);
    let models = get(addr, "/v1/models").json();
    assert_eq!(models["data"][0]["id"], "mock-model");
    let health = get(addr, "/health");
    assert_eq!((health.status, health.body.len()), (200, 0));
    post(addr, "/v1/completions", &ids_prompt(&[5; 40], 3));
    let metrics = get(addr, "/metrics").text();
    assert!(metrics.contains("# TYPE vllm:num_requests_running gauge"));
    assert!(
        metrics.contains("vllm:generation_tokens_total{model_name=\"mock-model\",engine=\"0\"} 3")
    );
    assert!(metrics.contains("vllm:prompt_tokens_total{model_name=\"mock-model\",engine=\"0\"} 40"));
    assert!(metrics.contains("# TYPE kvroute_mocker_kv_batches_total counter"));
}

/// The classic Prometheus text (what vLLM and SGLang serve) by default:
/// a counter's HELP and TYPE name its `_total` sample, no `# EOF`; and
/// OpenMetrics for a scraper that asks for it.
#[test]
fn metrics_are_classic_prometheus_text_unless_openmetrics_is_asked_for() {
    let mut c = config(WorkerFlavor::Sglang);
    c.dp_size = 2;
    let fleet = TestFleet::start(c);
    let addr = fleet.http(0);
    let headers = [("X-data-parallel-rank", "1")];
    let body = ids_prompt(&[5; 40], 3).to_string();
    let r = http(
        addr,
        "POST",
        "/v1/completions",
        &headers,
        Some(body.as_bytes()),
    );
    assert_eq!(r.status, 200);

    let classic = get(addr, "/metrics");
    assert_eq!(
        classic.header("content-type"),
        Some("text/plain; version=0.0.4; charset=utf-8")
    );
    let text = classic.text();
    assert!(text.contains(concat!(
        "# HELP sglang:prompt_tokens_total Number of prefill tokens processed.\n",
        "# TYPE sglang:prompt_tokens_total counter\n",
        "sglang:prompt_tokens_total{model_name=\"mock-model\",dp_rank=\"0\"} 0\n",
        "sglang:prompt_tokens_total{model_name=\"mock-model\",dp_rank=\"1\"} 40\n",
    )));
    assert!(text.contains(concat!(
        "# HELP sglang:num_running_reqs The number of running requests.\n",
        "# TYPE sglang:num_running_reqs gauge\n",
    )));
    assert!(text.contains("# TYPE kvroute_mocker_cached_blocks gauge\n"));
    assert!(text.contains("# TYPE kvroute_mocker_replays_total counter\n"));
    assert!(!text.contains("# EOF"));
    // Every sample line carries both labels; every family has HELP and TYPE.
    let samples: Vec<&str> = text.lines().filter(|l| !l.starts_with('#')).collect();
    assert_eq!(samples.len(), 14 * 2, "7 SGLang + 7 own metrics, 2 ranks");
    assert!(samples
        .iter()
        .all(|l| l.contains("{model_name=\"mock-model\",dp_rank=\"")));
    assert_eq!(text.matches("# HELP ").count(), 14);

    let openmetrics = http(
        addr,
        "GET",
        "/metrics",
        &[(
            "Accept",
            "application/openmetrics-text;version=1.0.0,text/plain;version=0.0.4;q=0.5",
        )],
        None,
    );
    assert_eq!(
        openmetrics.header("content-type"),
        Some("application/openmetrics-text; version=1.0.0; charset=utf-8")
    );
    let text = openmetrics.text();
    assert!(text.contains(concat!(
        "# HELP sglang:prompt_tokens Number of prefill tokens processed.\n",
        "# TYPE sglang:prompt_tokens counter\n",
        "sglang:prompt_tokens_total{model_name=\"mock-model\",dp_rank=\"0\"} 0\n",
    )));
    assert!(text.ends_with("# EOF\n"));
}

#[test]
fn sglang_server_info_describes_the_event_sockets() {
    let mut c = config(WorkerFlavor::Sglang);
    c.dp_size = 2;
    let fleet = TestFleet::start(c);
    let info = get(fleet.http(0), "/server_info").json();
    let kv = &info["kv_events"];
    assert_eq!(kv["dp_size"], 2);
    assert_eq!(kv["block_size"], 16);
    let port = kv["endpoint_port_base"].as_u64().expect("port");
    assert!(fleet.events(0, 0).ends_with(&format!(":{port}")));
    let vllm = TestFleet::start(config(WorkerFlavor::Vllm));
    assert_eq!(get(vllm.http(0), "/server_info").status, 404);
}

#[test]
fn fail_rate_and_delay_flags_shape_responses() {
    let mut c = config(WorkerFlavor::Vllm);
    c.faults.fail_rate = 1.0;
    c.faults.delay = Duration::from_millis(200);
    let fleet = TestFleet::start(c);
    let started = Instant::now();
    let r = post(fleet.http(0), "/v1/completions", &json!({"prompt": "x"}));
    assert!(started.elapsed() >= Duration::from_millis(200));
    assert_eq!(r.status, 500);
    assert!(r.json()["error"]["message"]
        .as_str()
        .is_some_and(|m| m.contains("fail-rate")));
    // Health is delayed but never failed.
    assert_eq!(get(fleet.http(0), "/health").status, 200);

    let mut c = config(WorkerFlavor::Vllm);
    c.faults.fail_rate = 0.5;
    c.seed = 3;
    let fleet = TestFleet::start(c);
    let statuses: Vec<u16> = (0..40)
        .map(|_| {
            post(
                fleet.http(0),
                "/v1/completions",
                &json!({"prompt": "x", "max_tokens": 1}),
            )
            .status
        })
        .collect();
    let failed = statuses.iter().filter(|&&s| s == 500).count();
    assert!((8..=32).contains(&failed), "{failed} of 40 failed");
    assert!(statuses.iter().all(|&s| s == 200 || s == 500));
}
