//! One trace from the client through the router to a real vLLM engine:
//! `kvroute serve --otlp-traces-endpoint` and the bed's text engines
//! (`--otlp-traces-endpoint`, started so by `scripts/real-engines`) export
//! to the same OTLP/gRPC receiver (`tests/otlp/receiver.py`, engines.json's
//! `otlp`). A request carrying a client's `traceparent` yields kvroute's
//! `kvroute.request` and `kvroute.attempt` spans and vLLM's own
//! `llm_request` span in the client's trace, vLLM's a child of the attempt,
//! reported by the engine that answered, with the answer's token counts and
//! the request's id.

use std::path::PathBuf;
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use serde_json::{json, Value};

use super::bed::{bed, tokens, usage, words, Bed};
use crate::support::http::request_with;
use crate::support::spans::{children, named, trace_until};

/// The client's span, the parent of kvroute's request span.
const CALLER: &str = "00f067aa0ba902b7";

/// vLLM's span for a request (`SpanKind.SERVER`, 2 in OTLP).
const VLLM_SPAN: &str = "llm_request";
const SERVER: u64 = 2;

/// The bed's trace receiver: its URL and the file its spans go to.
struct Receiver {
    url: String,
    spans: PathBuf,
}

fn receiver(bed: &Bed) -> Receiver {
    let doc: Value = serde_json::from_str(
        &std::fs::read_to_string(&bed.path).expect("engines.json is readable"),
    )
    .expect("engines.json is JSON");
    let otlp = &doc["otlp"];
    let (Some(url), Some(spans)) = (otlp["url"].as_str(), otlp["spans"].as_str()) else {
        panic!(
            "{} names no trace receiver (\"otlp\"): its engines were started without tracing; \
             stop them and start them again with this checkout's `scripts/real-engines start`",
            bed.path.display()
        );
    };
    Receiver {
        url: url.to_owned(),
        spans: PathBuf::from(spans),
    }
}

/// A trace id of this run's own: the receiver's file outlives test runs.
fn fresh_trace() -> String {
    let nanos = SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map(|d| d.as_nanos())
        .unwrap_or_default();
    format!("{:08x}{:024x}", std::process::id(), nanos % (1u128 << 96))
}

#[test]
fn one_trace_holds_the_routers_spans_and_the_engines() {
    let (_guard, bed) = bed();
    let otlp = receiver(&bed);
    let flags = [
        "--tokenizer",
        bed.tokenizer.as_str(),
        "--otlp-traces-endpoint",
        otlp.url.as_str(),
    ];
    let (_router, serve) = bed.router_with_env(&flags, &[("OTEL_BSP_SCHEDULE_DELAY", "50")]);
    let trace = fresh_trace();
    let parent = format!("00-{trace}-{CALLER}-01");
    let id = format!("trace-{trace}");
    let body = json!({
        "model": bed.served,
        "messages": [{"role": "user", "content": words(&tokens(2_000, 100))}],
        "max_tokens": 4,
    });
    let reply = request_with(
        &serve,
        "POST",
        "/v1/chat/completions",
        &[
            ("traceparent", parent.as_str()),
            ("x-request-id", id.as_str()),
        ],
        &body.to_string(),
    );
    assert_eq!(reply.status, 200, "{}", reply.body);
    let worker = reply.header("x-kvroute-worker").expect("routed");
    let answer = reply.json();
    let spans = trace_until(&otlp.spans, &trace, Duration::from_secs(60), |s| {
        !named(s, "kvroute.request").is_empty()
            && !named(s, "kvroute.attempt").is_empty()
            && !named(s, VLLM_SPAN).is_empty()
    });

    // kvroute's: the request continues the client's trace, one attempt under it.
    let root = named(&spans, "kvroute.request")[0];
    assert_eq!(root["parent_span_id"], CALLER, "{root}");
    assert_eq!(root["service"], "kvroute");
    assert_eq!(root["attributes"]["kvroute.worker"], worker.as_str());
    let attempts = children(&spans, root, "kvroute.attempt");
    assert_eq!(attempts.len(), 1, "{spans:#?}");
    let attempt = attempts[0];
    assert_eq!(attempt["attributes"]["kvroute.worker"], worker.as_str());

    // vLLM's: one span, the attempt's child, from the engine that answered.
    let engine = named(&spans, VLLM_SPAN);
    assert_eq!(engine.len(), 1, "{spans:#?}");
    let engine = engine[0];
    assert_eq!(engine["parent_span_id"], attempt["span_id"], "{engine}");
    assert_eq!(engine["service"], "vllm", "{engine}");
    assert_eq!(engine["kind"], SERVER, "{engine}");
    assert_eq!(
        engine["resource"]["service.instance.id"],
        worker.as_str(),
        "{engine}"
    );
    let (prompt_tokens, _) = usage(&answer);
    let attrs = &engine["attributes"];
    assert_eq!(
        attrs["gen_ai.usage.prompt_tokens"], prompt_tokens,
        "{engine}"
    );
    assert_eq!(
        attrs["gen_ai.usage.completion_tokens"], answer["usage"]["completion_tokens"],
        "{engine}"
    );
    assert_eq!(attrs["gen_ai.request.max_tokens"], 4, "{engine}");
    // The request id kvroute passed on (the client's `x-request-id`) is the
    // engine's (vLLM prefixes it: `chatcmpl-<id>`).
    let engine_id = attrs["gen_ai.request.id"].as_str().unwrap_or_default();
    assert!(engine_id.ends_with(&id), "{engine}");
}
