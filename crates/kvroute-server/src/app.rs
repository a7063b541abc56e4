//! The HTTP application: every route, the state each handler takes, and the
//! limits around them. [`app`] builds it without a socket, so tests drive it
//! with `tower::ServiceExt::oneshot`; [`crate::serve`] puts it on a listener.

use std::sync::Arc;

use axum::extract::{DefaultBodyLimit, FromRef, State};
use axum::http::{header, HeaderMap};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};

use crate::admin::{self, AdminState};
use crate::api;
use crate::metrics::Metrics;
use crate::proxy::{self, Proxy};
use crate::query;

/// Everything the handlers share; each handler takes only its part.
#[derive(Debug, Clone)]
pub struct AppState {
    /// Routing and forwarding.
    pub proxy: Arc<Proxy>,
    /// The worker registry and the admin token.
    pub admin: AdminState,
    /// The metrics registry.
    pub metrics: Arc<Metrics>,
    /// Largest request body accepted, in bytes (larger: 413).
    pub max_body_bytes: usize,
}

impl FromRef<AppState> for Arc<Proxy> {
    fn from_ref(state: &AppState) -> Self {
        state.proxy.clone()
    }
}

impl FromRef<AppState> for AdminState {
    fn from_ref(state: &AppState) -> Self {
        state.admin.clone()
    }
}

impl FromRef<AppState> for Arc<Metrics> {
    fn from_ref(state: &AppState) -> Self {
        state.metrics.clone()
    }
}

/// Every route of `kvroute serve`. Unknown routes, wrong methods and bodies
/// over the limit are answered with OpenAI's error body.
pub fn app(state: AppState) -> axum::Router {
    let limit = state.max_body_bytes;
    axum::Router::new()
        .route("/v1/completions", post(proxy::completions))
        .route("/v1/chat/completions", post(proxy::chat_completions))
        .route("/v1/models", get(proxy::models))
        .route("/query", post(query::query))
        .route("/query_by_hash", post(query::query_by_hash))
        .route("/health", get(admin::health))
        .route("/workers", get(admin::workers))
        .route("/metrics", get(metrics))
        .route("/register", post(admin::register))
        .route("/unregister", post(admin::unregister))
        .fallback(api::not_found)
        .method_not_allowed_fallback(api::method_not_allowed)
        .layer(DefaultBodyLimit::max(limit))
        .with_state(state)
}

/// `GET /metrics`: the Prometheus text format, or OpenMetrics when asked.
async fn metrics(State(metrics): State<Arc<Metrics>>, headers: HeaderMap) -> Response {
    let accept = headers.get(header::ACCEPT).and_then(|v| v.to_str().ok());
    let (content_type, text) = metrics.render(accept);
    ([(header::CONTENT_TYPE, content_type)], text).into_response()
}
