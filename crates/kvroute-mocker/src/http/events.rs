//! What the Responses and Anthropic endpoints share: SSE events with an
//! `event:` line, a stream driven by the engine's updates, the collected
//! text of a non-streamed answer, and unique ids.

use std::collections::VecDeque;
use std::convert::Infallible;
use std::time::{SystemTime, UNIX_EPOCH};

use axum::body::{Body, Bytes};
use axum::http::{header, HeaderValue};
use axum::response::Response;
use serde_json::Value;
use tokio::sync::mpsc;

use super::ApiError;
use crate::engine::{Update, Usage};
use crate::filler::FillerToken;

/// The events a streamed answer writes as its request runs.
pub(super) trait EventWriter: Send + 'static {
    /// After one generated piece of text.
    fn token(&mut self, text: &str, out: &mut VecDeque<Bytes>);
    /// At the end, with the request's usage.
    fn finish(&mut self, usage: &Usage, out: &mut VecDeque<Bytes>);
    /// When the request failed after the stream began.
    fn fail(&mut self, error: &ApiError, out: &mut VecDeque<Bytes>);
}

/// One SSE event: `event: <name>`, `data: <json>`.
pub(super) fn event(name: &str, data: &Value) -> Bytes {
    Bytes::from(format!("event: {name}\ndata: {data}\n\n"))
}

struct StreamState<W> {
    writer: W,
    filler: Vec<FillerToken>,
    updates: mpsc::UnboundedReceiver<Update>,
    pending: VecDeque<Bytes>,
    done: bool,
}

/// An SSE response: `first`, then what `writer` writes for each update.
pub(super) fn event_stream<W: EventWriter>(
    first: VecDeque<Bytes>,
    writer: W,
    filler: Vec<FillerToken>,
    updates: mpsc::UnboundedReceiver<Update>,
) -> Response {
    let state = StreamState {
        writer,
        filler,
        updates,
        pending: first,
        done: false,
    };
    let stream = futures_util::stream::unfold(state, |mut s| async move {
        loop {
            if let Some(bytes) = s.pending.pop_front() {
                return Some((Ok::<Bytes, Infallible>(bytes), s));
            }
            if s.done {
                return None;
            }
            match s.updates.recv().await {
                Some(Update::Token(i)) => {
                    let text = s.filler.get(i).map_or("", |t| t.text.as_str());
                    s.writer.token(text, &mut s.pending);
                }
                Some(Update::Finished(usage)) => {
                    s.writer.finish(&usage, &mut s.pending);
                    s.done = true;
                }
                Some(Update::Failed(message)) => {
                    s.writer
                        .fail(&ApiError::unavailable(message), &mut s.pending);
                    s.done = true;
                }
                None => {
                    let e = ApiError::unavailable("the engine is shutting down");
                    s.writer.fail(&e, &mut s.pending);
                    s.done = true;
                }
            }
        }
    });
    sse_response(Body::from_stream(stream))
}

/// The whole generated text and the usage, once the request finished.
pub(super) async fn collect(
    filler: &[FillerToken],
    updates: &mut mpsc::UnboundedReceiver<Update>,
) -> Result<(String, Usage), ApiError> {
    let mut text = String::new();
    while let Some(update) = updates.recv().await {
        match update {
            Update::Token(i) => {
                if let Some(t) = filler.get(i) {
                    text.push_str(&t.text);
                }
            }
            Update::Finished(usage) => return Ok((text, usage)),
            Update::Failed(message) => return Err(ApiError::unavailable(message)),
        }
    }
    Err(ApiError::unavailable("the engine is shutting down"))
}

/// `prefix` and 32 hex digits, unique across engines and restarts: a hash
/// of the engine's name, its answer number `n` and the time.
pub(super) fn unique_id(prefix: &str, engine: &str, n: u64) -> String {
    let nanos = SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| d.as_nanos());
    let mut seed = Vec::with_capacity(engine.len() + 24);
    seed.extend_from_slice(engine.as_bytes());
    seed.extend_from_slice(&n.to_le_bytes());
    seed.extend_from_slice(&nanos.to_le_bytes());
    format!("{prefix}{:032x}", xxhash_rust::xxh3::xxh3_128(&seed))
}

/// An SSE answer streaming `body` (`text/event-stream`, not cached).
pub(super) fn sse_response(body: Body) -> Response {
    let mut response = Response::new(body);
    let headers = response.headers_mut();
    headers.insert(
        header::CONTENT_TYPE,
        HeaderValue::from_static("text/event-stream"),
    );
    headers.insert(header::CACHE_CONTROL, HeaderValue::from_static("no-cache"));
    response
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ids_are_prefixed_hex_and_differ_by_engine_and_number() {
        let a = unique_id("resp_", "w0", 1);
        assert!(a.starts_with("resp_") && a.len() == 5 + 32, "{a}");
        assert!(a[5..].bytes().all(|b| b.is_ascii_hexdigit()));
        assert_ne!(a, unique_id("resp_", "w1", 1));
        assert_ne!(a, unique_id("resp_", "w0", 2));
    }

    #[test]
    fn events_name_their_type_before_the_data() {
        let e = event("ping", &serde_json::json!({"type": "ping"}));
        assert_eq!(&e[..], b"event: ping\ndata: {\"type\":\"ping\"}\n\n");
    }
}
