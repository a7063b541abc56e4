//! The forwarder: sends each request the router admitted to its worker
//! and relays the answer — the HTTP front door of `kvroute serve`. What
//! decides where a request goes is the router's ([`crate::router`], shared
//! with the endpoint picker); what is here is only the sending:
//!
//! 1. the handlers take a body at each API's path, and the router's intake
//!    reads it ([`crate::router::intake`]);
//! 2. the router admits it (a place in the load of its first candidate, or
//!    a wait in the overload queue);
//! 3. [`attempt`] sends it to the first candidate, then the next only when
//!    the worker did no work (the retry rule of [`outcome`]: a connection
//!    error, a 503 or 429), skipping workers whose circuit breaker is
//!    open; [`rewrite`] adds the rank, image hashes or `include_usage` to
//!    the body on the way; a disaggregated fleet's two legs are
//!    [`disagg`]'s ([`handoff`] for the engines' hand-off fields, [`merge`]
//!    for SGLang's prompt log-probabilities), and [`fetch`] runs the same
//!    legs between two aggregated workers when the placer moves a prefix,
//!    [`replicate`] beside the request when it copies a hot one;
//! 4. [`relay`] passes the answer back (streams chunk by chunk, whole
//!    answers read within [`answer`]'s bound) and settles the prediction;
//!    how the answer ends (whole, or cut off) is what the worker's breaker
//!    records.

pub mod answer;
pub mod attempt;
pub mod disagg;
pub mod fetch;
pub mod handoff;
pub mod merge;
pub mod migrate;
pub mod outcome;
pub mod relay;
pub mod replicate;
pub mod rewrite;
pub mod send;

use std::sync::Arc;
use std::time::Instant;

use axum::extract::State;
use axum::http::{HeaderMap, HeaderValue};
use axum::response::{IntoResponse, Response};

use crate::api::ProxyError;
use crate::bodies::Body;
use crate::router::candidates::Target;
use crate::router::split::splits;
use crate::router::{admission, intake, Endpoint, Router, LARGE_BODY, REQUEST_ID};

pub use crate::router::config::ProxyConfig;
pub use crate::router::sessions::SessionConfig;
pub use crate::router::tenants::{key_digest, PriorityRange, TenantConfig, MAX_TENANT};

/// The forwarder: the router it sends for, and the client it sends with.
#[derive(Debug)]
pub struct Proxy {
    /// The decision state, shared with the endpoint picker.
    pub router: Arc<Router>,
    client: reqwest::Client,
    /// Places for copies ahead of demand ([`replicate::MAX_IN_FLIGHT`]).
    copies: Arc<tokio::sync::Semaphore>,
}

impl Proxy {
    /// A forwarder for `router`, its client pooled per worker.
    pub fn new(router: Arc<Router>) -> Result<Self, reqwest::Error> {
        let client = reqwest::Client::builder()
            .connect_timeout(router.config().connect_timeout)
            .pool_max_idle_per_host(256)
            .build()?;
        let copies = Arc::new(tokio::sync::Semaphore::new(replicate::MAX_IN_FLIGHT));
        Ok(Proxy {
            router,
            client,
            copies,
        })
    }
}

/// `POST /v1/responses`: OpenAI's Responses API.
pub async fn responses(
    State(proxy): State<Arc<Proxy>>,
    headers: HeaderMap,
    body: Result<Body, ProxyError>,
) -> Response {
    handle(proxy, headers, body, Endpoint::Responses).await
}

/// `POST /v1/messages`: Anthropic's Messages API.
pub async fn messages(
    State(proxy): State<Arc<Proxy>>,
    headers: HeaderMap,
    body: Result<Body, ProxyError>,
) -> Response {
    handle(proxy, headers, body, Endpoint::Messages).await
}

/// `POST /generate`: SGLang's native endpoint, for SGLang workers.
pub async fn generate(
    State(proxy): State<Arc<Proxy>>,
    headers: HeaderMap,
    body: Result<Body, ProxyError>,
) -> Response {
    handle(proxy, headers, body, Endpoint::Generate).await
}

/// `POST /v1/completions`.
pub async fn completions(
    State(proxy): State<Arc<Proxy>>,
    headers: HeaderMap,
    body: Result<Body, ProxyError>,
) -> Response {
    handle(proxy, headers, body, Endpoint::Completions).await
}

/// `POST /v1/chat/completions`.
pub async fn chat_completions(
    State(proxy): State<Arc<Proxy>>,
    headers: HeaderMap,
    body: Result<Body, ProxyError>,
) -> Response {
    handle(proxy, headers, body, Endpoint::Chat).await
}

/// Answers one completion request; every error kvroute answers it with is
/// counted here, once.
async fn handle(
    proxy: Arc<Proxy>,
    headers: HeaderMap,
    body: Result<Body, ProxyError>,
    endpoint: Endpoint,
) -> Response {
    let arrived = Instant::now();
    proxy.router.metrics.requests.inc();
    let request_id = proxy.router.request_id(&headers);
    let traced = crate::otel::spans::arrived("kvroute.request", &headers, endpoint.path());
    let routed = match body {
        Ok(Body(body, share)) => {
            let request = (request_id.as_str(), arrived);
            // Pinned where it is made: `within` then holds a pointer to
            // it, not a moved copy of this large future.
            let routing =
                std::pin::pin!(route(&proxy, &headers, (&body, share), endpoint, request));
            crate::otel::within(traced.clone(), routing).await
        }
        Err(e) => Err(e),
    };
    let mut response = routed.unwrap_or_else(|e| {
        proxy.router.metrics.answered(e.kind());
        // Refused by the queue for its tenant's share, or for the memory
        // bodies hold: worth a retry in a second.
        let shed = matches!(
            e.kind(),
            crate::api::ErrorKind::RateLimited | crate::api::ErrorKind::Overloaded
        );
        let mut response = e.into_response_in(endpoint.dialect());
        if shed {
            let retry = HeaderValue::from_static("1");
            response
                .headers_mut()
                .insert(axum::http::header::RETRY_AFTER, retry);
        }
        response
    });
    if let Ok(id) = HeaderValue::from_str(&request_id) {
        response.headers_mut().insert(REQUEST_ID, id);
    }
    crate::otel::spans::answered(traced, response.status().as_u16());
    response
}

async fn route(
    proxy: &Arc<Proxy>,
    headers: &HeaderMap,
    (body, share): (&axum::body::Bytes, crate::budget::Share),
    endpoint: Endpoint,
    (request_id, arrived): (&str, Instant),
) -> Result<Response, ProxyError> {
    let arrival = intake::Arrival {
        headers,
        body,
        endpoint: Some(endpoint),
    };
    let (req, _share) = intake::prepare(&proxy.router, arrival, share).await?;
    crate::otel::spans::requested(&req);
    let req = Arc::new(req);
    let large = body.len() > LARGE_BODY;
    let request = attempt::Request {
        req: &req,
        headers,
        body,
        endpoint,
        request_id,
        large,
        arrived,
        disagg: None,
    };
    let router = &proxy.router;
    let admitted = if splits(&router.targets()) {
        if endpoint.splits() {
            return disagg::route(proxy, &req, request).await;
        }
        let decodes: admission::Eligible = Some(Arc::new(|t: &Target| t.route.role.decodes()));
        admission::admit_among(router, &req, large, decodes).await?
    } else {
        let mut admitted = admission::admit(router, &req, large).await?;
        if let Some(fetch) = admitted.take_fetch() {
            return fetch::route(proxy, admitted, fetch, request).await;
        }
        if let Some((copy, candidates)) = admitted.take_replicate() {
            replicate::spawn(proxy, copy, candidates, &request);
            let why = replicate::explain(candidates, &copy);
            let request = attempt::Request {
                disagg: Some(&why),
                ..request
            };
            return attempt::forward(proxy, admitted, request).await;
        }
        admitted
    };
    attempt::forward(proxy, admitted, request).await
}

/// `GET /v1/models`: the union of the workers' models as last learned
/// (`router::models`), never asked of the workers while the client waits.
pub async fn models(State(proxy): State<Arc<Proxy>>) -> Response {
    let json = HeaderValue::from_static("application/json");
    (
        [(axum::http::header::CONTENT_TYPE, json)],
        proxy.router.models_answer(),
    )
        .into_response()
}
