//! OpenAI's Responses API and Anthropic's Messages API: shapes, streams,
//! the prefix cache reached through them, stored conversations, errors.

use kvroute_core::event::WorkerFlavor;
use serde_json::{json, Value};

use super::common::*;

/// A system prompt several blocks long.
fn system_prompt() -> String {
    "You are a careful assistant who answers in one short sentence. ".repeat(6)
}

/// The `(event, data)` pairs of an SSE body with `event:` lines.
fn named_events(r: &HttpResponse) -> Vec<(String, Value)> {
    r.text()
        .split("\n\n")
        .filter(|e| !e.trim().is_empty())
        .map(|e| {
            let (name, data) = e
                .strip_prefix("event: ")
                .and_then(|rest| rest.split_once("\ndata: "))
                .unwrap_or_else(|| panic!("not a named event: {e:?}"));
            let data = serde_json::from_str(data).unwrap_or_else(|_| panic!("data: {data}"));
            (name.to_owned(), data)
        })
        .collect()
}

fn names(events: &[(String, Value)]) -> Vec<&str> {
    events.iter().map(|(n, _)| n.as_str()).collect()
}

#[test]
fn responses_answer_in_openai_shape_and_a_repeated_instruction_hits_the_cache() {
    let fleet = TestFleet::start(config(WorkerFlavor::Vllm));
    let addr = fleet.http(0);
    let body = json!({"model": "mock-model", "instructions": system_prompt(),
        "input": "What is a cache?", "max_output_tokens": 5, "metadata": {"k": "v"}});
    let r = post(addr, "/v1/responses", &body);
    assert_eq!(r.status, 200, "{}", r.text());
    let v = r.json();
    assert!(v["id"].as_str().is_some_and(|id| id.starts_with("resp_")));
    assert_eq!(
        (&v["object"], &v["status"], &v["model"]),
        (
            &json!("response"),
            &json!("completed"),
            &json!("mock-model")
        )
    );
    assert_eq!(v["instructions"], body["instructions"]);
    assert_eq!(v["metadata"], json!({"k": "v"}));
    let message = &v["output"][0];
    assert_eq!(
        (&message["type"], &message["role"]),
        (&json!("message"), &json!("assistant"))
    );
    assert!(message["id"]
        .as_str()
        .is_some_and(|id| id.starts_with("msg_")));
    let part = &message["content"][0];
    assert_eq!(part["type"], "output_text");
    assert!(!part["text"].as_str().expect("text").is_empty());
    let usage = &v["usage"];
    let prompt = usage["input_tokens"].as_u64().expect("input_tokens");
    assert!(prompt > 64, "{usage}");
    assert_eq!(usage["output_tokens"], 5);
    assert_eq!(usage["total_tokens"], prompt + 5);
    assert_eq!(usage["input_tokens_details"]["cached_tokens"], 0);

    let other = json!({"instructions": system_prompt(), "input": "And a block?",
        "max_output_tokens": 2});
    let v = post(addr, "/v1/responses", &other).json();
    let cached = v["usage"]["input_tokens_details"]["cached_tokens"]
        .as_u64()
        .expect("cached_tokens");
    assert!(
        cached >= 64,
        "the shared instructions are cached: {}",
        v["usage"]
    );
}

#[test]
fn responses_stream_typed_events_in_sequence_ending_with_the_usage() {
    let fleet = TestFleet::start(config(WorkerFlavor::Sglang));
    let addr = fleet.http(0);
    let body = json!({"input": [{"role": "user", "content": [{"type": "input_text", "text": "Stream please"}]}],
        "max_output_tokens": 4, "stream": true});
    let r = post(addr, "/v1/responses", &body);
    assert_eq!(r.status, 200);
    assert_eq!(r.header("content-type"), Some("text/event-stream"));
    assert!(!r.text().contains("[DONE]"));
    let events = named_events(&r);
    assert_eq!(
        names(&events),
        [
            "response.created",
            "response.in_progress",
            "response.output_item.added",
            "response.content_part.added",
            "response.output_text.delta",
            "response.output_text.delta",
            "response.output_text.delta",
            "response.output_text.delta",
            "response.output_text.done",
            "response.content_part.done",
            "response.output_item.done",
            "response.completed",
        ]
    );
    for (i, (name, data)) in events.iter().enumerate() {
        assert_eq!(
            (&data["type"], &data["sequence_number"]),
            (&json!(name), &json!(i))
        );
    }
    let streamed: String = events[4..8]
        .iter()
        .map(|(_, d)| d["delta"].as_str().expect("delta"))
        .collect();
    assert_eq!(events[8].1["text"], streamed.as_str());
    let completed = &events[11].1["response"];
    assert_eq!(completed["status"], "completed");
    assert_eq!(
        completed["output"][0]["content"][0]["text"],
        streamed.as_str()
    );
    assert_eq!(completed["usage"]["output_tokens"], 4);
    assert_eq!(events[0].1["response"]["id"], completed["id"]);
    // The same request unstreamed generates the same text.
    let mut plain = body;
    plain["stream"] = json!(false);
    let v = post(addr, "/v1/responses", &plain).json();
    assert_eq!(v["output"][0]["content"][0]["text"], streamed.as_str());
}

#[test]
fn a_continuation_renders_the_stored_conversation_and_hits_the_cache() {
    let fleet = TestFleet::start(config(WorkerFlavor::Vllm));
    let addr = fleet.http(0);
    let first =
        json!({"instructions": "Be brief.", "input": system_prompt(), "max_output_tokens": 3});
    let v = post(addr, "/v1/responses", &first).json();
    let id = v["id"].as_str().expect("id").to_owned();
    let p1 = v["usage"]["input_tokens"].as_u64().expect("input_tokens");
    // Streamed continuations are stored too.
    // The stored conversation holds the first request's instructions (as
    // vLLM's `msg_store` does): the continuation extends that prompt.
    let second = json!({"previous_response_id": id,
        "input": "Say more.", "max_output_tokens": 3, "stream": true});
    let r = post(addr, "/v1/responses", &second);
    assert_eq!(r.status, 200, "{}", r.text());
    let events = named_events(&r);
    let done = &events.last().expect("events").1["response"];
    assert_eq!(done["previous_response_id"], id.as_str());
    let p2 = done["usage"]["input_tokens"]
        .as_u64()
        .expect("input_tokens");
    let cached = done["usage"]["input_tokens_details"]["cached_tokens"]
        .as_u64()
        .expect("cached_tokens");
    assert!(
        p2 > p1 + 3,
        "the stored turn and the answer are rendered: {p1} → {p2}"
    );
    assert!(cached >= p1 / 16 * 16, "{cached} cached of the first {p1}");
    let third = json!({"previous_response_id": done["id"],
        "input": "Once more.", "store": false});
    let v = post(addr, "/v1/responses", &third).json();
    let p3 = v["usage"]["input_tokens"].as_u64().expect("input_tokens");
    let cached = v["usage"]["input_tokens_details"]["cached_tokens"].as_u64();
    assert!(
        cached >= Some(p2 / 16 * 16),
        "{cached:?} cached of the second {p2}"
    );
    // New instructions go before the stored conversation, as vLLM renders them.
    let again = json!({"instructions": "Be brief.", "previous_response_id": done["id"],
        "input": "Once more."});
    let v = post(addr, "/v1/responses", &again).json();
    assert!(v["usage"]["input_tokens"].as_u64() > Some(p3));
    assert_eq!(v["instructions"], "Be brief.");

    // Unknown, or not stored: vLLM's 404.
    let unstored = json!({"input": "x", "store": false, "max_output_tokens": 1});
    let gone = post(addr, "/v1/responses", &unstored).json()["id"].clone();
    for missing in [json!("resp_nope"), gone] {
        let r = post(
            addr,
            "/v1/responses",
            &json!({"previous_response_id": missing, "input": "x"}),
        );
        assert_eq!(r.status, 404, "{}", r.text());
        let e = r.json()["error"].clone();
        assert_eq!(
            e["message"],
            format!(
                "Response with id '{}' not found.",
                missing.as_str().expect("id")
            )
        );
        assert_eq!(
            (&e["type"], &e["param"]),
            (
                &json!("invalid_request_error"),
                &json!("previous_response_id")
            )
        );
    }
    let r = post(addr, "/v1/responses", &json!({"input": 5}));
    assert_eq!(r.status, 400);
    assert!(r.json()["error"]["message"]
        .as_str()
        .is_some_and(|m| m.contains("`input`")));
}

#[test]
fn anthropic_messages_answer_and_stream_in_anthropic_shapes_with_cache_reads() {
    let fleet = TestFleet::start(config(WorkerFlavor::Vllm));
    let addr = fleet.http(0);
    let body = json!({"model": "mock-model", "max_tokens": 4, "system": system_prompt(),
        "messages": [{"role": "user", "content": "Hello"}]});
    let r = post(addr, "/v1/messages", &body);
    assert_eq!(r.status, 200, "{}", r.text());
    let v = r.json();
    assert!(v["id"].as_str().is_some_and(|id| id.starts_with("msg_")));
    assert_eq!(
        (&v["type"], &v["role"]),
        (&json!("message"), &json!("assistant"))
    );
    assert_eq!(
        (&v["stop_reason"], &v["stop_sequence"]),
        (&json!("max_tokens"), &Value::Null)
    );
    assert_eq!(v["content"][0]["type"], "text");
    let text = v["content"][0]["text"].as_str().expect("text").to_owned();
    let usage = &v["usage"];
    assert_eq!(usage["output_tokens"], 4);
    assert_eq!(
        (
            &usage["cache_read_input_tokens"],
            &usage["cache_creation_input_tokens"]
        ),
        (&json!(0), &json!(0))
    );
    let prompt = usage["input_tokens"].as_u64().expect("input_tokens");

    let mut streamed = body.clone();
    streamed["stream"] = json!(true);
    let r = post(addr, "/v1/messages", &streamed);
    assert_eq!(r.status, 200);
    let events = named_events(&r);
    assert_eq!(
        names(&events),
        [
            "message_start",
            "content_block_start",
            "ping",
            "content_block_delta",
            "content_block_delta",
            "content_block_delta",
            "content_block_delta",
            "content_block_stop",
            "message_delta",
            "message_stop",
        ]
    );
    for (name, data) in &events {
        assert_eq!(&data["type"], name);
    }
    let start = &events[0].1["message"];
    assert_eq!(
        (&start["content"], &start["stop_reason"]),
        (&json!([]), &Value::Null)
    );
    assert_eq!(
        start["usage"],
        json!({"input_tokens": prompt, "output_tokens": 0})
    );
    let deltas: String = events[3..7]
        .iter()
        .map(|(_, d)| d["delta"]["text"].as_str().expect("text_delta"))
        .collect();
    assert_eq!(deltas, text, "the same request generates the same text");
    let end = &events[8].1;
    assert_eq!(end["delta"]["stop_reason"], "max_tokens");
    // The repeat is served from the cache: input_tokens counts the rest.
    let cached = end["usage"]["cache_read_input_tokens"]
        .as_u64()
        .expect("cache read");
    assert_eq!(cached, (prompt - 1) / 16 * 16);
    assert_eq!(end["usage"]["input_tokens"], prompt - cached);
    assert_eq!(end["usage"]["output_tokens"], 4);
}

#[test]
fn anthropic_errors_have_anthropics_shape() {
    let fleet = TestFleet::start(config(WorkerFlavor::Vllm));
    let addr = fleet.http(0);
    let user = json!([{"role": "user", "content": "x"}]);
    let cases: Vec<(Vec<u8>, u16, &str)> = vec![
        (b"{not json".to_vec(), 400, "invalid_request_error"),
        (
            json!({"messages": user}).to_string().into_bytes(),
            400,
            "invalid_request_error",
        ),
        (
            json!({"max_tokens": 1, "messages": []})
                .to_string()
                .into_bytes(),
            400,
            "invalid_request_error",
        ),
        (
            json!({"max_tokens": 1, "messages": user, "model": "other"})
                .to_string()
                .into_bytes(),
            404,
            "not_found_error",
        ),
    ];
    for (body, status, kind) in cases {
        let r = http(addr, "POST", "/v1/messages", &[], Some(&body));
        assert_eq!(r.status, status, "{}", r.text());
        let v = r.json();
        assert_eq!(
            (&v["type"], &v["error"]["type"]),
            (&json!("error"), &json!(kind)),
            "{v}"
        );
        assert!(v["error"]["message"]
            .as_str()
            .is_some_and(|m| !m.is_empty()));
    }
}

#[test]
fn cache_match_reads_both_apis_as_their_requests_do() {
    let fleet = TestFleet::start(config(WorkerFlavor::Vllm));
    let addr = fleet.http(0);
    let anthropic = json!({"max_tokens": 2, "system": system_prompt(),
        "messages": [{"role": "user", "content": "Hi"}]});
    let responses = json!({"instructions": system_prompt(), "input": "Hi", "max_output_tokens": 2});
    for (path, endpoint, body) in [
        ("/v1/messages", "messages", &anthropic),
        ("/v1/responses", "responses", &responses),
    ] {
        post(addr, path, body);
        let mut probe = body.clone();
        probe["endpoint"] = json!(endpoint);
        let m = post(addr, "/internal/cache_match", &probe);
        assert_eq!(m.status, 200, "{}", m.text());
        let matched = m.json()["ranks"][0]["matched_tokens"]
            .as_u64()
            .expect("matched");
        let prompt = m.json()["prompt_tokens"].as_u64().expect("prompt_tokens");
        assert_eq!(matched, (prompt - 1) / 16 * 16, "{endpoint}");
    }
    let r = post(
        addr,
        "/internal/cache_match",
        &json!({"endpoint": "nope", "prompt": "x"}),
    );
    assert_eq!(r.status, 400);
}
