//! The hooks the doors call, each a no-op while tracing is off: the
//! request's span (continuing the caller's `traceparent`), what intake,
//! admission and the decision learned as its attributes, and the child
//! spans of legs, attempts and migrations. Attribute names follow
//! OpenTelemetry's semantic conventions where one exists
//! (`http.request.method`, `url.path`, `gen_ai.request.model`,
//! `server.address`, `http.response.status_code`); kvroute's own are
//! `kvroute.*` (docs/tracing.md).

use std::time::Duration;

use axum::http::HeaderMap;
use opentelemetry::trace::{SpanKind, Status, TraceContextExt as _, Tracer as _};
use opentelemetry::{Context, KeyValue, StringValue, Value};

use super::{headers, tracer};
use crate::router::intake::RoutedRequest;
use crate::router::observe::Decision;

/// Room for every attribute the request's span gets (the ones it starts
/// with, [`requested`]'s, [`queued`]'s, [`decided`]'s and [`answered`]'s),
/// so that the span's list is allocated once.
const REQUEST_ATTRIBUTES: usize = 18;

/// The span of one request arriving at a door (`name`: `kvroute.request`
/// at the HTTP door, `kvroute.pick` at the endpoint picker), the child of
/// the `traceparent` its headers carry; `None` while tracing is off.
pub fn arrived(
    name: &'static str,
    headers: &HeaderMap,
    path: impl Into<StringValue>,
) -> Option<Context> {
    let tracer = tracer()?;
    let parent = headers::parent(headers);
    let mut attributes = Vec::with_capacity(REQUEST_ATTRIBUTES);
    attributes.extend([
        KeyValue::new("http.request.method", "POST"),
        KeyValue::new("url.path", Value::String(path.into())),
    ]);
    let span = tracer
        .span_builder(name)
        .with_kind(SpanKind::Server)
        .with_attributes(attributes)
        .start_with_context(tracer, &parent);
    Some(parent.with_span(span))
}

/// Ends the request's span with the status the client was answered.
pub fn answered(cx: Option<Context>, status: u16) {
    let Some(cx) = cx else { return };
    let span = cx.span();
    span.set_attribute(KeyValue::new(
        "http.response.status_code",
        i64::from(status),
    ));
    if status >= 500 {
        span.set_status(Status::error(format!("answered {status}")));
    }
    span.end();
}

/// Ends the picker's span, with the error it answered, if any.
#[cfg_attr(not(feature = "epp"), allow(dead_code))] // the endpoint picker's
pub fn picked(cx: Option<Context>, error: Option<&str>) {
    let Some(cx) = cx else { return };
    let span = cx.span();
    if let Some(error) = error {
        span.set_status(Status::error(error.to_owned()));
    }
    span.end();
}

/// The current span's context, to carry where the request's work goes on
/// after its door answered (a stream's migration); `None` while off.
pub fn current() -> Option<Context> {
    tracer().map(|_| Context::current())
}

/// Who sent the request and what it asks for, on the request's span.
pub fn requested(req: &RoutedRequest) {
    if tracer().is_none() {
        return;
    }
    let tokens = i64::try_from(req.token_count()).unwrap_or(i64::MAX);
    let mut attributes = vec![
        KeyValue::new("kvroute.tenant", req.tenant.clone()),
        KeyValue::new("kvroute.priority", req.priority),
        KeyValue::new("kvroute.prompt_tokens", tokens),
        KeyValue::new("kvroute.stream", req.body.stream),
    ];
    if let Some(model) = &req.body.model {
        attributes.push(KeyValue::new("gen_ai.request.model", model.clone()));
    }
    // One lock of the span for all of them.
    Context::current().span().set_attributes(attributes);
}

/// How long admission held the request (the overload queue's wait).
pub fn queued(waited: Duration) {
    if tracer().is_none() {
        return;
    }
    let ms = waited.as_secs_f64() * 1e3;
    Context::current()
        .span()
        .set_attribute(KeyValue::new("kvroute.queue_wait_ms", ms));
}

/// The routing decision, on the current span (the request's, or its
/// decode leg's or migration's).
pub fn decided(d: &Decision) {
    if tracer().is_none() {
        return;
    }
    let attempts = i64::try_from(d.retries)
        .unwrap_or(i64::MAX)
        .saturating_add(1);
    let mut attributes = vec![
        KeyValue::new("kvroute.policy", d.policy),
        KeyValue::new("kvroute.attempts", attempts),
    ];
    if let Some(why) = &d.load_only {
        attributes.push(KeyValue::new("kvroute.load_only", why.clone()));
    }
    if let Some(c) = d.candidates.get(d.chosen) {
        let cached = i64::try_from(c.matched_tokens).unwrap_or(i64::MAX);
        attributes.extend([
            KeyValue::new("kvroute.worker", Value::String(c.worker.clone().into())),
            KeyValue::new("kvroute.rank", i64::from(c.dp_rank.0)),
            KeyValue::new("kvroute.predicted_cached_tokens", cached),
            KeyValue::new("kvroute.cost", c.total),
        ]);
    }
    // One lock of the span for all of them.
    Context::current().span().set_attributes(attributes);
}

/// A child span of the current one for a phase of the request's work
/// (`kvroute.prefill`, `kvroute.decode`); `None` while off.
pub fn phase(name: &'static str) -> Option<Context> {
    let tracer = tracer()?;
    let parent = Context::current();
    let span = tracer
        .span_builder(name)
        .with_kind(SpanKind::Internal)
        .start_with_context(tracer, &parent);
    Some(parent.with_span(span))
}

/// The span of one move of a request to another rank, the child of the
/// request's span `parent`.
pub fn migration(parent: &Context, from: &str, tokens: u64, cause: &str) -> Context {
    let Some(tracer) = tracer() else {
        return parent.clone();
    };
    let span = tracer
        .span_builder("kvroute.migration")
        .with_kind(SpanKind::Internal)
        .with_attributes([
            KeyValue::new("kvroute.migrated_from", from.to_owned()),
            KeyValue::new(
                "kvroute.generated_tokens",
                i64::try_from(tokens).unwrap_or(i64::MAX),
            ),
            KeyValue::new("kvroute.migration_cause", cause.to_owned()),
        ])
        .start_with_context(tracer, parent);
    parent.with_span(span)
}

/// One attempt at a worker: a client span, the parent the engine's
/// `traceparent` names.
pub struct Attempt(Context);

impl Attempt {
    /// The span of an attempt at `worker` (at `url`, on `rank`), the
    /// child of the current span; `None` while off.
    pub fn start(worker: &str, url: &str, rank: Option<u32>) -> Option<Attempt> {
        let tracer = tracer()?;
        let parent = Context::current();
        let mut attributes = Vec::with_capacity(6);
        attributes.push(KeyValue::new("kvroute.worker", worker.to_owned()));
        let (host, port) = host_port(url);
        attributes.push(KeyValue::new("server.address", host.to_owned()));
        if let Some(port) = port {
            attributes.push(KeyValue::new("server.port", i64::from(port)));
        }
        if let Some(rank) = rank {
            attributes.push(KeyValue::new("kvroute.rank", i64::from(rank)));
        }
        let span = tracer
            .span_builder("kvroute.attempt")
            .with_kind(SpanKind::Client)
            .with_attributes(attributes)
            .start_with_context(tracer, &parent);
        Some(Attempt(parent.with_span(span)))
    }

    /// The `traceparent` (and `tracestate`) to send the engine.
    pub fn headers(&self) -> HeaderMap {
        headers::of(&self.0)
    }

    /// Ends the attempt: the worker's status, or why there was none.
    pub fn ended(self, outcome: Result<u16, &str>) {
        let span = self.0.span();
        match outcome {
            Ok(status) => {
                let code = KeyValue::new("http.response.status_code", i64::from(status));
                span.set_attribute(code);
                if status >= 500 {
                    span.set_status(Status::error(format!("answered {status}")));
                }
            }
            Err(why) => span.set_status(Status::error(why.to_owned())),
        }
        span.end();
    }
}

/// The host and port of a worker's URL (`http://host:port/...`), read
/// without a full parse (once per attempt while tracing); an IPv6
/// address's brackets kept off the host.
fn host_port(url: &str) -> (&str, Option<u16>) {
    let rest = url.split_once("://").map_or(url, |(_, rest)| rest);
    let authority = rest.split(['/', '?']).next().unwrap_or(rest);
    let authority = authority.rsplit_once('@').map_or(authority, |(_, a)| a);
    let (host, port) = match authority.rsplit_once(':') {
        Some((host, port)) if !port.contains(']') => (host, port.parse().ok()),
        _ => (authority, None),
    };
    (host.trim_start_matches('[').trim_end_matches(']'), port)
}

#[cfg(test)]
mod tests {
    use super::host_port;

    #[test]
    fn a_workers_url_gives_its_host_and_port() {
        assert_eq!(host_port("http://10.0.0.1:8100"), ("10.0.0.1", Some(8100)));
        assert_eq!(host_port("http://w0.ns:80/v1"), ("w0.ns", Some(80)));
        assert_eq!(host_port("http://[::1]:9000/"), ("::1", Some(9000)));
        assert_eq!(host_port("http://[::1]"), ("::1", None));
        assert_eq!(host_port("http://engine"), ("engine", None));
    }
}
