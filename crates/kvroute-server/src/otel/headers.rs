//! W3C trace context over HTTP header maps: the parent a request's
//! `traceparent` names, and the `traceparent` an attempt sends on.

use axum::http::{HeaderMap, HeaderName, HeaderValue};
use opentelemetry::propagation::{Extractor, TextMapPropagator as _};
use opentelemetry::trace::{TraceContextExt as _, TraceFlags};
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

/// The remote parent `headers` name (an empty context when they name none,
/// or a malformed one: the request then starts its own trace).
pub fn parent(headers: &HeaderMap) -> Context {
    TraceContextPropagator::new().extract(&Reading(headers))
}

/// The `traceparent` (and `tracestate`) naming `cx`'s span as the parent,
/// as W3C trace context writes them (version 00, the sampled flag); none
/// for a context without a valid span. Written here rather than through
/// the SDK's propagator, which formats through a `String` per field: this
/// runs once per attempt. An empty `tracestate` is not sent.
pub fn of(cx: &Context) -> HeaderMap {
    let span = cx.span();
    let context = span.span_context();
    let mut headers = HeaderMap::new();
    if !context.is_valid() {
        return headers;
    }
    let mut line = [0u8; 55];
    line[..3].copy_from_slice(b"00-");
    hex(&context.trace_id().to_bytes(), &mut line[3..35]);
    line[35] = b'-';
    hex(&context.span_id().to_bytes(), &mut line[36..52]);
    line[52] = b'-';
    hex(
        &[(context.trace_flags() & TraceFlags::SAMPLED).to_u8()],
        &mut line[53..],
    );
    if let Ok(value) = HeaderValue::from_bytes(&line) {
        headers.insert(HeaderName::from_static("traceparent"), value);
    }
    let state = context.trace_state().header();
    if !state.is_empty() {
        if let Ok(value) = HeaderValue::from_str(&state) {
            headers.insert(HeaderName::from_static("tracestate"), value);
        }
    }
    headers
}

/// `bytes` as lower-case hex into `out` (twice as long).
fn hex(bytes: &[u8], out: &mut [u8]) {
    const DIGITS: &[u8; 16] = b"0123456789abcdef";
    for (byte, pair) in bytes.iter().zip(out.chunks_exact_mut(2)) {
        pair[0] = DIGITS[usize::from(byte >> 4)];
        pair[1] = DIGITS[usize::from(byte & 0xf)];
    }
}

#[cfg(test)]
mod tests {
    use super::*;

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

    /// The headers written here are the SDK propagator's, byte for byte.
    #[test]
    fn the_headers_written_are_the_propagators() {
        use opentelemetry::propagation::Injector;
        use opentelemetry::trace::{SpanContext, SpanId, TraceId, TraceState};
        struct Map(std::collections::HashMap<String, String>);
        impl Injector for Map {
            fn set(&mut self, key: &str, value: String) {
                self.0.insert(key.to_owned(), value);
            }
        }
        let states = [
            TraceState::NONE,
            TraceState::from_key_value([("k", "v"), ("a", "b")]).expect("a trace state"),
        ];
        for (i, state) in states.into_iter().enumerate() {
            for flags in [
                TraceFlags::SAMPLED,
                TraceFlags::default(),
                TraceFlags::new(0xff),
            ] {
                let trace =
                    TraceId::from(0x0af7_6519_16cd_43dd_8448_eb21_1c80_319c_u128 + i as u128);
                let span = SpanId::from(0x00f0_6b71_6920_3331_u64 << i);
                let sc = SpanContext::new(trace, span, flags, true, state.clone());
                let cx = Context::new().with_remote_span_context(sc);
                let mut expected = Map(Default::default());
                TraceContextPropagator::new().inject_context(&cx, &mut expected);
                // An empty `tracestate` is not sent (the SDK sends it empty).
                expected.0.retain(|_, value| !value.is_empty());
                let written = of(&cx);
                assert_eq!(written.len(), expected.0.len());
                for (key, value) in &expected.0 {
                    assert_eq!(
                        written.get(key).map(|v| v.as_bytes()),
                        Some(value.as_bytes())
                    );
                }
            }
        }
    }

    #[test]
    fn a_malformed_traceparent_names_no_parent() {
        let mut headers = HeaderMap::new();
        headers.insert("traceparent", HeaderValue::from_static("00-zz-01"));
        assert!(!parent(&headers).span().span_context().is_valid());
        assert!(of(&Context::new()).is_empty());
    }
}
