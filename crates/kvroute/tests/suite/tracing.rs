//! OpenTelemetry traces end to end: `kvroute serve --otlp-traces-endpoint`
//! in front of mock engines, exporting to an OTLP/gRPC receiver built from
//! the official protos (`tests/otlp/receiver.py`: PyPI's
//! `opentelemetry-proto` over `grpcio`). A client's `traceparent` is
//! continued, the decision is on the request's span, each attempt is a
//! child span whose id the engine receives as its parent, and a P/D
//! request's legs and a migrated stream's move are child spans; the
//! endpoint picker continues the gateway's trace from its ext_proc headers.
//!
//! The Python comes from `KVROUTE_OTLP_PYTHON`, or the virtual environment
//! `scripts/test` makes under `~/.cache/kvroute/otlp`.

use std::io::{BufRead as _, BufReader};
use std::path::PathBuf;
use std::process::{Command, Stdio};
use std::time::Duration;

use serde_json::{json, Value};

use crate::support::http::{request, request_with};
#[cfg(feature = "epp")]
use crate::support::picker::{python as epp_python, script as epp_script, start_picker_with_env};
use crate::support::spans::{self, children, named};
use crate::support::{
    eventually_within, python_with, spawn_this_builds_mocker, start_serve_with_env, Proc,
};

/// The trace every test's client request belongs to, and its caller span.
const TRACE: &str = "4bf92f3577b34da6a3ce929d0e0e4736";
const CALLER: &str = "00f067aa0ba902b7";

/// Exports quickly, so spans arrive while the test waits on them.
const ENV: [(&str, &str); 1] = [("OTEL_BSP_SCHEDULE_DELAY", "50")];

/// A running receiver: its process, its port and the file of spans.
struct Collector {
    _proc: Proc,
    url: String,
    out: PathBuf,
}

impl Collector {
    fn start(name: &str) -> Collector {
        let python = python_with(
            "KVROUTE_OTLP_PYTHON",
            "otlp",
            "opentelemetry-proto grpcio",
            "import grpc; from opentelemetry.proto.collector.trace.v1 import trace_service_pb2_grpc",
        );
        let out =
            std::env::temp_dir().join(format!("kvroute-spans-{name}-{}.jsonl", std::process::id()));
        let _ = std::fs::remove_file(&out);
        let script = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("tests/otlp/receiver.py");
        let mut child = Command::new(python)
            .arg(script)
            .arg("--out")
            .arg(&out)
            .stdout(Stdio::piped())
            .stderr(Stdio::inherit())
            .spawn()
            .expect("the receiver runs");
        let stdout = child.stdout.take().expect("stdout");
        let proc = Proc(child);
        let mut line = String::new();
        BufReader::new(stdout)
            .read_line(&mut line)
            .expect("the receiver prints its port");
        let port = line
            .trim()
            .strip_prefix("listening ")
            .expect("`listening PORT`");
        Collector {
            _proc: proc,
            url: format!("http://127.0.0.1:{port}"),
            out,
        }
    }

    /// The spans of trace `trace`, once `done` holds of them (60 s at most).
    fn trace_until(&self, trace: &str, done: impl Fn(&[Value]) -> bool) -> Vec<Value> {
        spans::trace_until(&self.out, trace, Duration::from_secs(60), done)
    }
}

impl Drop for Collector {
    fn drop(&mut self) {
        let _ = std::fs::remove_file(&self.out);
    }
}

/// The `traceparent`s an engine received (`host:port`).
fn received(engine: &str) -> Vec<String> {
    let reply = request(engine, "GET", "/internal/traceparents", "");
    let seen: Vec<Value> = serde_json::from_str(&reply.body).unwrap_or_default();
    seen.iter()
        .filter_map(|s| s["traceparent"].as_str().map(str::to_owned))
        .collect()
}

/// `host:port` of a `--worker` line.
fn engine_of(line: &str) -> String {
    line.split(',')
        .find_map(|kv| kv.strip_prefix("url=http://"))
        .expect("a url")
        .trim_end_matches('/')
        .to_owned()
}

fn traceparent(trace: &str) -> String {
    format!("00-{trace}-{CALLER}-01")
}

fn chat(stream: bool, words: usize) -> String {
    let content = (0..words)
        .map(|i| format!("word{i}"))
        .collect::<Vec<_>>()
        .join(" ");
    json!({
        "model": "mock-model",
        "messages": [{"role": "user", "content": content}],
        "max_tokens": 8,
        "stream": stream,
    })
    .to_string()
}

#[test]
fn a_request_continues_the_callers_trace_and_the_engine_joins_it() {
    let collector = Collector::start("agg");
    let args = [
        "--workers",
        "2",
        "--port",
        "0",
        "--kv-events-port",
        "0",
        "--replay-port",
        "0",
    ];
    let (_engines, lines) =
        spawn_this_builds_mocker(&[&args[..], &["--speedup", "100"]].concat(), 2);
    let flags = ["--otlp-traces-endpoint", &collector.url];
    let (_serve, serve) = start_serve_with_env(&lines, &flags, &ENV);
    let parent = traceparent(TRACE);
    let headers = [
        ("traceparent", parent.as_str()),
        ("x-kvroute-priority", "3"),
    ];
    let reply = request_with(
        &serve,
        "POST",
        "/v1/chat/completions",
        &headers,
        &chat(false, 40),
    );
    assert_eq!(reply.status, 200, "{}", reply.body);
    let spans = collector.trace_until(TRACE, |s| {
        !named(s, "kvroute.request").is_empty() && !named(s, "kvroute.attempt").is_empty()
    });
    let root = named(&spans, "kvroute.request")[0];
    assert_eq!(root["parent_span_id"], CALLER, "{root}");
    assert_eq!(root["service"], "kvroute");
    let attrs = &root["attributes"];
    assert_eq!(attrs["gen_ai.request.model"], "mock-model", "{root}");
    assert_eq!(attrs["url.path"], "/v1/chat/completions");
    assert_eq!(attrs["http.response.status_code"], 200);
    assert_eq!(attrs["kvroute.policy"], "kv");
    assert_eq!(attrs["kvroute.attempts"], 1);
    for key in [
        "kvroute.worker",
        "kvroute.rank",
        "kvroute.predicted_cached_tokens",
        "kvroute.cost",
        "kvroute.queue_wait_ms",
        "kvroute.tenant",
        "kvroute.priority",
    ] {
        assert!(!attrs[key].is_null(), "no {key} on {root}");
    }
    let attempts = children(&spans, root, "kvroute.attempt");
    assert_eq!(attempts.len(), 1, "{spans:#?}");
    let attempt = attempts[0];
    assert_eq!(
        attempt["attributes"]["kvroute.worker"],
        attrs["kvroute.worker"]
    );
    assert_eq!(attempt["attributes"]["server.address"], "127.0.0.1");
    // The engine's parent is the attempt's span, in the caller's trace.
    let expected = format!(
        "00-{TRACE}-{}-01",
        attempt["span_id"].as_str().unwrap_or_default()
    );
    let sent: Vec<String> = lines.iter().flat_map(|l| received(&engine_of(l))).collect();
    assert_eq!(sent, vec![expected], "the engines received {sent:?}");
}

#[test]
fn a_split_request_traces_both_legs() {
    let collector = Collector::start("pd");
    let (_p, p_line) = super::disagg::engine("vllm", "prefill", "p0");
    let (_d, d_line) = super::disagg::engine("vllm", "decode", "d0");
    let lines = [p_line.clone(), d_line.clone()];
    let flags = [
        "--otlp-traces-endpoint",
        &collector.url,
        "--local-prefill-max-tokens",
        "0",
    ];
    let (_serve, serve) = super::disagg::start_serve_with_env(&lines, &flags, &ENV, &["p0", "d0"]);
    let parent = traceparent(TRACE);
    let headers = [("traceparent", parent.as_str())];
    let reply = request_with(
        &serve,
        "POST",
        "/v1/chat/completions",
        &headers,
        &chat(false, 200),
    );
    assert_eq!(reply.status, 200, "{}", reply.body);
    let spans = collector.trace_until(TRACE, |s| named(s, "kvroute.attempt").len() >= 2);
    let root = named(&spans, "kvroute.request")[0];
    for (leg, line) in [("kvroute.prefill", &p_line), ("kvroute.decode", &d_line)] {
        let legs = children(&spans, root, leg);
        assert_eq!(legs.len(), 1, "{leg}: {spans:#?}");
        let attempts = children(&spans, legs[0], "kvroute.attempt");
        assert_eq!(attempts.len(), 1, "{leg}'s attempt: {spans:#?}");
        let id = attempts[0]["span_id"].as_str().unwrap_or_default();
        let sent = received(&engine_of(line));
        assert_eq!(sent, vec![format!("00-{TRACE}-{id}-01")], "{leg}");
    }
}

#[test]
fn a_migrated_stream_traces_its_move() {
    let collector = Collector::start("migration");
    let base = [
        "--workers",
        "1",
        "--port",
        "0",
        "--kv-events-port",
        "0",
        "--replay-port",
        "0",
    ];
    let (_cutter, cutter) = spawn_this_builds_mocker(
        &[&base[..], &["--speedup", "10", "--cut-streams", "1"]].concat(),
        1,
    );
    let (_healthy, mut lines) =
        spawn_this_builds_mocker(&[&base[..], &["--speedup", "10"]].concat(), 1);
    lines[0] = lines[0].replacen("name=w0,", "name=healthy,", 1);
    lines.push(cutter[0].replacen("name=w0,", "name=cutter,", 1));
    let flags = ["--otlp-traces-endpoint", &collector.url];
    let (_serve, serve) = start_serve_with_env(&lines, &flags, &ENV);
    // Streams, each in a trace of its own, until one was cut and moved.
    eventually_within("a stream migrated", Duration::from_secs(60), || {
        let trace = format!("{:032x}", 0xabc0_0000_u64 + u64::from(fresh()));
        let parent = traceparent(&trace);
        let headers = [("traceparent", parent.as_str())];
        let reply = request_with(
            &serve,
            "POST",
            "/v1/chat/completions",
            &headers,
            &chat(true, 30),
        );
        assert_eq!(reply.status, 200);
        if reply.header("x-kvroute-worker").as_deref() == Some("cutter") {
            let spans =
                collector.trace_until(&trace, |s| !named(s, "kvroute.migration").is_empty());
            let root = named(&spans, "kvroute.request")[0];
            let migration = children(&spans, root, "kvroute.migration");
            assert_eq!(migration.len(), 1, "{spans:#?}");
            assert_eq!(
                migration[0]["attributes"]["kvroute.migrated_from"],
                "cutter"
            );
            let attempts = children(&spans, migration[0], "kvroute.attempt");
            assert_eq!(attempts.len(), 1, "{spans:#?}");
            assert_eq!(attempts[0]["attributes"]["kvroute.worker"], "healthy");
            assert_eq!(migration[0]["attributes"]["kvroute.worker"], "healthy");
            return true;
        }
        false
    });
}

/// A new number each call (each stream's own trace id).
fn fresh() -> u32 {
    use std::sync::atomic::{AtomicU32, Ordering};
    static NEXT: AtomicU32 = AtomicU32::new(1);
    NEXT.fetch_add(1, Ordering::Relaxed)
}

#[cfg(feature = "epp")]
#[test]
fn the_picker_continues_the_gateways_trace() {
    let collector = Collector::start("epp");
    let base = [
        "--workers",
        "2",
        "--port",
        "0",
        "--kv-events-port",
        "0",
        "--replay-port",
        "0",
    ];
    let (_engines, lines) =
        spawn_this_builds_mocker(&[&base[..], &["--speedup", "100"]].concat(), 2);
    let flags = ["--epp-plaintext", "--otlp-traces-endpoint", &collector.url];
    let picker = start_picker_with_env(&lines, &flags, &ENV);
    let body = std::env::temp_dir().join(format!("kvroute-otel-epp-{}.json", std::process::id()));
    std::fs::write(&body, chat(false, 40)).expect("body");
    let header = format!("traceparent: {}", traceparent(TRACE));
    let out = Command::new(epp_python())
        .arg(epp_script())
        .args([
            "process",
            "--target",
            &picker.ext_proc,
            "--path",
            "/v1/chat/completions",
        ])
        .arg("--body")
        .arg(&body)
        .args(["--header", &header])
        .output()
        .expect("the ext_proc client runs");
    let _ = std::fs::remove_file(&body);
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(
        stdout.contains("\"routed\""),
        "{stdout} {}",
        String::from_utf8_lossy(&out.stderr)
    );
    let spans = collector.trace_until(TRACE, |s| !named(s, "kvroute.pick").is_empty());
    let pick = named(&spans, "kvroute.pick")[0];
    assert_eq!(pick["parent_span_id"], CALLER, "{pick}");
    assert!(pick["attributes"]["kvroute.worker"].is_string(), "{pick}");
    assert_eq!(pick["attributes"]["gen_ai.request.model"], "mock-model");
}
