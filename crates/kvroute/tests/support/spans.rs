//! The spans an OTLP/gRPC receiver (`tests/otlp/receiver.py`) wrote to its
//! file, one JSON object a line: read, picked by trace, waited on. The
//! tracing tests start a receiver each; the real-engine bed runs one that
//! its vLLM engines export to.

use std::path::Path;
use std::time::Duration;

use serde_json::Value;

use super::polled_until;

/// Every span in `file` so far (none when it does not exist yet).
pub fn read(file: &Path) -> Vec<Value> {
    let text = std::fs::read_to_string(file).unwrap_or_default();
    text.lines()
        .filter_map(|l| serde_json::from_str(l).ok())
        .collect()
}

/// The spans of trace `trace` in `file`, once `done` holds of them; fails
/// the test, showing what did arrive, when it does not within `limit`.
pub fn trace_until(
    file: &Path,
    trace: &str,
    limit: Duration,
    done: impl Fn(&[Value]) -> bool,
) -> Vec<Value> {
    let mut spans = Vec::new();
    let arrived = polled_until(limit, || {
        spans = read(file)
            .into_iter()
            .filter(|s| s["trace_id"] == trace)
            .collect();
        done(&spans)
    });
    assert!(
        arrived,
        "the spans of trace {trace} never arrived in {}: {spans:#?}",
        file.display()
    );
    spans
}

/// The spans named `name`.
pub fn named<'a>(spans: &'a [Value], name: &str) -> Vec<&'a Value> {
    spans.iter().filter(|s| s["name"] == name).collect()
}

/// The spans named `name` whose parent is `parent`.
pub fn children<'a>(spans: &'a [Value], parent: &Value, name: &str) -> Vec<&'a Value> {
    spans
        .iter()
        .filter(|s| s["name"] == name && s["parent_span_id"] == parent["span_id"])
        .collect()
}
