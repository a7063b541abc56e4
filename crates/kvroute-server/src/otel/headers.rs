//! W3C trace context over HTTP header maps: the parent a request's
//! `traceparent` names, and the `traceparent` an attempt sends on.

use axum::http::{HeaderMap, HeaderName, HeaderValue};
use opentelemetry::propagation::{Extractor, Injector, TextMapPropagator as _};
use opentelemetry::Context;
use opentelemetry_sdk::propagation::TraceContextPropagator;

/// The W3C trace-context headers. A client's go on to the engine as they
/// came while tracing is off (the gateway's trace then reaches the engine
/// past kvroute); while it is on, the attempt's span replaces them.
pub const TRACE_HEADERS: [&str; 2] = ["traceparent", "tracestate"];

/// `name` is one of [`TRACE_HEADERS`].
pub fn is_trace_header(name: &str) -> bool {
    TRACE_HEADERS.contains(&name)
}

struct Reading<'a>(&'a HeaderMap);

impl Extractor for Reading<'_> {
    fn get(&self, key: &str) -> Option<&str> {
        self.0.get(key).and_then(|v| v.to_str().ok())
    }

    fn keys(&self) -> Vec<&str> {
        self.0.keys().map(HeaderName::as_str).collect()
    }
}

struct Writing<'a>(&'a mut HeaderMap);

impl Injector for Writing<'_> {
    fn set(&mut self, key: &str, value: String) {
        let name = HeaderName::from_bytes(key.as_bytes());
        if let (Ok(name), Ok(value)) = (name, HeaderValue::from_str(&value)) {
            self.0.insert(name, value);
        }
    }
}

/// The remote parent `headers` name (an empty context when they name none,
/// or a malformed one: the request then starts its own trace).
pub fn parent(headers: &HeaderMap) -> Context {
    TraceContextPropagator::new().extract(&Reading(headers))
}

/// The `traceparent` (and `tracestate`) naming `cx`'s span as the parent.
pub fn of(cx: &Context) -> HeaderMap {
    let mut headers = HeaderMap::new();
    TraceContextPropagator::new().inject_context(cx, &mut Writing(&mut headers));
    headers
}

#[cfg(test)]
mod tests {
    use super::*;
    use opentelemetry::trace::TraceContextExt as _;

    #[test]
    fn a_traceparent_read_is_the_one_written() {
        let mut headers = HeaderMap::new();
        let sent = "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01";
        headers.insert("traceparent", HeaderValue::from_static(sent));
        let cx = parent(&headers);
        let span = cx.span();
        let read = span.span_context();
        assert_eq!(
            read.trace_id().to_string(),
            "0af7651916cd43dd8448eb211c80319c"
        );
        assert!(read.is_sampled() && read.is_remote());
        let written = of(&cx);
        assert_eq!(
            written.get("traceparent").map(|v| v.as_bytes()),
            Some(sent.as_bytes())
        );
    }

    #[test]
    fn a_malformed_traceparent_names_no_parent() {
        let mut headers = HeaderMap::new();
        headers.insert("traceparent", HeaderValue::from_static("00-zz-01"));
        assert!(!parent(&headers).span().span_context().is_valid());
        assert!(of(&Context::new()).is_empty());
    }
}
