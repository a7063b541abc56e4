//! The HTTP application: every route, the state each handler takes, and the
//! limits around them. [`app`] builds it without a socket, so tests drive it
//! with `tower::ServiceExt::oneshot`; [`crate::serve`] puts it on a listener.

use std::sync::Arc;

use axum::extract::{DefaultBodyLimit, FromRef, State};
use axum::http::{header, HeaderMap};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use axum::Extension;

use crate::admin::{self, AdminState};
use crate::api;
use crate::dashboard;
use crate::metrics::Metrics;
use crate::proxy::{self, Proxy};
use crate::query::{self, QueryLimits};
use crate::router::Router;

/// Everything the handlers share; each handler takes only its part.
#[derive(Debug, Clone)]
pub struct AppState {
    /// The forwarder, and through it the router.
    pub proxy: Arc<Proxy>,
    /// The worker registry and the admin token.
    pub admin: AdminState,
    /// The metrics registry.
    pub metrics: Arc<Metrics>,
    /// Largest request body accepted, in bytes (larger: 413).
    pub max_body_bytes: usize,
    /// Bounds of `/query` and `/query_by_hash`.
    pub query: QueryLimits,
}

impl FromRef<AppState> for Arc<Proxy> {
    fn from_ref(state: &AppState) -> Self {
        state.proxy.clone()
    }
}

impl FromRef<AppState> for Arc<Router> {
    fn from_ref(state: &AppState) -> Self {
        state.proxy.router.clone()
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
    let query_slots = Arc::new(tokio::sync::Semaphore::new(state.query.concurrency.max(1)));
    let query_limit = state.query.max_body_bytes.min(limit);
    // Outermost first: a body that says it is too long is refused before it
    // takes one of the query slots; one that is longer than it says is
    // refused while it is read.
    let rules = state.proxy.router.body_rules(limit);
    let queries = axum::Router::new()
        .route("/query", post(query::query))
        .route("/query_by_hash", post(query::query_by_hash))
        .layer(DefaultBodyLimit::max(query_limit))
        .layer(Extension(rules.with_max_bytes(query_limit)))
        .route_layer(axum::middleware::from_fn_with_state(
            query_slots,
            query::limit_concurrency,
        ))
        .route_layer(axum::middleware::from_fn_with_state(
            query_limit,
            api::refuse_declared_oversize,
        ));
    let introspection = axum::Router::new()
        .merge(queries)
        .route("/workers", get(admin::workers))
        .route("/api/stats", get(dashboard::api_stats))
        .route_layer(axum::middleware::from_fn_with_state(
            state.admin.access.clone(),
            admin::require_introspection,
        ));
    axum::Router::new()
        .route("/v1/completions", post(proxy::completions))
        .route("/v1/chat/completions", post(proxy::chat_completions))
        .route("/generate", post(proxy::generate))
        .route("/v1/responses", post(proxy::responses))
        .route(
            "/v1/messages",
            post(proxy::messages).fallback(anthropic_method_not_allowed),
        )
        .route("/v1/models", get(proxy::models))
        .merge(introspection)
        .route("/health", get(admin::health))
        .route("/dashboard", get(dashboard::page))
        .route("/metrics", get(metrics))
        .route("/register", post(admin::register))
        .route("/unregister", post(admin::unregister))
        .fallback(api::not_found)
        .method_not_allowed_fallback(api::method_not_allowed)
        .layer(DefaultBodyLimit::max(limit))
        .layer(Extension(rules))
        .with_state(state)
}

/// 405 on `/v1/messages`, in Anthropic's error shape as every answer there.
async fn anthropic_method_not_allowed() -> axum::response::Response {
    api::ProxyError::MethodNotAllowed.into_response_in(crate::dialect::Dialect::Anthropic)
}

/// `GET /metrics`: the Prometheus text format, or OpenMetrics when asked.
async fn metrics(State(metrics): State<Arc<Metrics>>, headers: HeaderMap) -> Response {
    let accept = headers.get(header::ACCEPT).and_then(|v| v.to_str().ok());
    let (content_type, text) = metrics.render(accept);
    ([(header::CONTENT_TYPE, content_type)], text).into_response()
}

#[cfg(test)]
mod tests {
    use super::*;
    use axum::body::Body;
    use axum::http::{Method, Request, StatusCode};
    use kvroute_core::index::{Index, IndexConfig, SharedIndex};
    use serde_json::Value;
    use std::time::Duration;
    use tower::ServiceExt as _;

    use crate::ingest::registry::IngestConfig;
    use crate::ingest::registry::Registry;
    use crate::listen::ConnectionMetrics;
    use crate::proxy::ProxyConfig;

    /// The app with no workers and a 1 KiB body limit.
    fn test_app() -> axum::Router {
        let index = Arc::new(SharedIndex::new(Index::new(IndexConfig::default())));
        let registry = Arc::new(
            Registry::new(
                index.clone(),
                IngestConfig::default(),
                Duration::from_secs(30),
            )
            .expect("ingest threads"),
        );
        let router = Router::builder(ProxyConfig::default(), index).build();
        let router = Arc::new(router.expect("a router"));
        let proxy = Arc::new(Proxy::new(router.clone()).expect("client"));
        let metrics = Arc::new(Metrics::new(
            &router.metrics,
            &ConnectionMetrics::default(),
            Vec::new(),
        ));
        app(AppState {
            admin: AdminState {
                registry,
                router,
                access: admin::Access {
                    admin_token: Some("token".into()),
                    public_introspection: false,
                },
                default_block_size: Some(16),
                replica: None,
                series: Default::default(),
            },
            proxy,
            metrics,
            max_body_bytes: 1024,
            query: QueryLimits::default(),
        })
    }

    /// Sends one request through the app; the status and the JSON body.
    async fn call(method: Method, uri: &str, body: impl Into<Body>) -> (StatusCode, Value) {
        let request = Request::builder()
            .method(method)
            .uri(uri)
            .header("content-type", "application/json")
            .header("authorization", "Bearer token")
            .body(body.into())
            .expect("request");
        let response = test_app().oneshot(request).await.expect("infallible");
        let status = response.status();
        let bytes = axum::body::to_bytes(response.into_body(), usize::MAX)
            .await
            .expect("body");
        let json = serde_json::from_slice(&bytes).unwrap_or_else(|_| {
            panic!("not JSON: {}", String::from_utf8_lossy(&bytes));
        });
        (status, json)
    }

    /// The OpenAI error body: every field present, `code` the status.
    fn assert_openai_error(status: StatusCode, body: &Value, kind: &str, says: &str) {
        let error = &body["error"];
        assert_eq!(error["type"], kind, "{body}");
        assert_eq!(error["code"], status.as_u16(), "{body}");
        assert!(error["param"].is_null(), "{body}");
        let message = error["message"].as_str().unwrap_or_default();
        assert!(message.contains(says), "{message:?} should say {says:?}");
    }

    #[tokio::test]
    async fn malformed_json_is_a_400_with_the_openai_error_body() {
        let (status, body) = call(Method::POST, "/v1/completions", "{").await;
        assert_eq!(status, StatusCode::BAD_REQUEST);
        assert_openai_error(status, &body, "invalid_request_error", "invalid JSON");
        let (status, body) = call(Method::POST, "/register", "[1]").await;
        assert_eq!(status, StatusCode::BAD_REQUEST);
        assert_openai_error(status, &body, "invalid_request_error", "JSON object");
    }

    #[tokio::test]
    async fn fields_of_the_wrong_type_are_a_400_naming_the_field() {
        let (status, body) = call(
            Method::POST,
            "/v1/completions",
            r#"{"prompt":[1],"stream":"yes"}"#,
        )
        .await;
        assert_eq!(status, StatusCode::BAD_REQUEST);
        assert_openai_error(status, &body, "invalid_request_error", "`stream`");
        let (status, body) = call(Method::POST, "/v1/chat/completions", r#"{"messages":5}"#).await;
        assert_openai_error(status, &body, "invalid_request_error", "`messages`");
        let (status, body) = call(Method::POST, "/query", r#"{"token_ids":[1,-2]}"#).await;
        assert_openai_error(status, &body, "invalid_request_error", "`token_ids`");
        let (status, body) = call(Method::POST, "/register", r#"{"name":5}"#).await;
        assert_openai_error(status, &body, "invalid_request_error", "give `name`");
    }

    #[tokio::test]
    async fn unknown_routes_and_wrong_methods_answer_in_json() {
        let (status, body) = call(Method::GET, "/v2/nothing", Body::empty()).await;
        assert_eq!(status, StatusCode::NOT_FOUND);
        assert_openai_error(status, &body, "not_found", "no such route");
        let (status, body) = call(Method::GET, "/v1/completions", Body::empty()).await;
        assert_eq!(status, StatusCode::METHOD_NOT_ALLOWED);
        assert_openai_error(status, &body, "method_not_allowed", "method not allowed");
    }

    #[tokio::test]
    async fn a_body_over_the_limit_is_a_413_in_json() {
        let big = format!(r#"{{"prompt":"{}"}}"#, "x".repeat(2048));
        for path in ["/v1/completions", "/query", "/register"] {
            let (status, body) = call(Method::POST, path, big.clone()).await;
            assert_eq!(status, StatusCode::PAYLOAD_TOO_LARGE, "{path}");
            assert_openai_error(status, &body, "request_too_large", "bytes this route takes");
        }
    }

    #[tokio::test]
    async fn a_valid_request_with_no_workers_is_a_503_in_json() {
        let (status, body) = call(Method::POST, "/v1/completions", r#"{"prompt":[1,2]}"#).await;
        assert_eq!(status, StatusCode::SERVICE_UNAVAILABLE);
        assert_openai_error(status, &body, "no_workers", "no worker");
    }
}
