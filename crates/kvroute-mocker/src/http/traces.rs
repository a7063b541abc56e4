//! The W3C `traceparent` each request arrived with, kept so that tests can
//! see what a router propagated: the last [`KEPT`] requests that carried
//! one, at `GET /internal/traceparents` (JSON, oldest first).

use std::collections::VecDeque;
use std::sync::{Arc, Mutex, PoisonError};

use axum::extract::{Request, State};
use axum::middleware::Next;
use axum::response::{IntoResponse, Json, Response};

/// Requests remembered at most (the oldest forgotten first).
pub const KEPT: usize = 256;

/// One request that carried a `traceparent`.
#[derive(Debug, Clone)]
pub struct Seen {
    /// Its path.
    pub path: String,
    /// Its `traceparent`, as sent.
    pub traceparent: String,
    /// Its `x-request-id`, if any.
    pub request_id: Option<String>,
}

/// The requests seen, shared by the recording layer and the endpoint.
#[derive(Debug, Default)]
pub struct TraceLog(Mutex<VecDeque<Seen>>);

/// Records the request's `traceparent`, if it has one, and goes on.
pub async fn record(State(log): State<Arc<TraceLog>>, request: Request, next: Next) -> Response {
    remember(&log, &request);
    next.run(request).await
}

fn remember(log: &TraceLog, request: &Request) {
    let text = |name: &str| {
        request
            .headers()
            .get(name)
            .and_then(|v| v.to_str().ok())
            .map(str::to_owned)
    };
    let Some(traceparent) = text("traceparent") else {
        return;
    };
    let seen = Seen {
        path: request.uri().path().to_owned(),
        traceparent,
        request_id: text("x-request-id"),
    };
    let mut kept = log.0.lock().unwrap_or_else(PoisonError::into_inner);
    if kept.len() == KEPT {
        kept.pop_front();
    }
    kept.push_back(seen);
}

/// `GET /internal/traceparents`: the requests seen, oldest first.
pub fn answer(log: &TraceLog) -> Response {
    let kept = log.0.lock().unwrap_or_else(PoisonError::into_inner);
    let seen: Vec<serde_json::Value> = kept
        .iter()
        .map(|s| {
            serde_json::json!({
                "path": s.path,
                "traceparent": s.traceparent,
                "request_id": s.request_id,
            })
        })
        .collect();
    Json(seen).into_response()
}
