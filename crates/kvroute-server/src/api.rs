//! What every endpoint shares: the one error type, [`ProxyError`], answered
//! as OpenAI's error body (the body extractor, `bodies::Body`, answers its
//! own failures with it too).

use std::sync::Arc;

use axum::extract::Request;
use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};
use axum::Json;
use serde_json::{json, Value};

/// What an error is, without its details: the bounded set that gives each
/// [`ProxyError`] its HTTP status, OpenAI `type` and metric label, and that
/// the retry rule (`proxy::outcome`) names as the client's error.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum ErrorKind {
    /// The request is malformed.
    BadRequest,
    /// The prompt and `max_tokens` do not fit the worker's context.
    ContextTooLong,
    /// The body is over the route's size limit.
    TooLarge,
    /// The body did not arrive in time (slower than the body-read rule).
    BodyTimeout,
    /// The admin bearer token is missing or wrong.
    Unauthorized,
    /// The admin API is disabled.
    Forbidden,
    /// No such route, or no such worker.
    NotFound,
    /// The route does not take this method.
    MethodNotAllowed,
    /// The change conflicts with the fleet (a worker registered twice).
    Conflict,
    /// Too many queries at once, or (a completion request) its tenant is
    /// the most over its share of the full overload queue.
    RateLimited,
    /// No worker can be routed to (none registered, or all failing).
    NoWorkers,
    /// No worker serves the model the request names.
    ModelNotFound,
    /// Every rank is over its busy thresholds and the queue is full or off.
    Overloaded,
    /// Every rank stayed over its busy thresholds for the whole queue wait.
    QueueTimeout,
    /// No worker took the request: each candidate was unreachable or refused it.
    UpstreamUnreachable,
    /// A worker took the request and failed before answering.
    UpstreamFailed,
    /// A worker answered and cut its answer off.
    UpstreamIncomplete,
    /// kvroute itself failed.
    Internal,
}

impl ErrorKind {
    /// The kinds a completion request can be answered with: the label
    /// values of `kvroute_proxy_errors_total`, each exported from the start.
    pub const PROXY: [ErrorKind; 13] = [
        ErrorKind::BadRequest,
        ErrorKind::ContextTooLong,
        ErrorKind::TooLarge,
        ErrorKind::BodyTimeout,
        ErrorKind::NoWorkers,
        ErrorKind::ModelNotFound,
        ErrorKind::RateLimited,
        ErrorKind::Overloaded,
        ErrorKind::QueueTimeout,
        ErrorKind::UpstreamUnreachable,
        ErrorKind::UpstreamFailed,
        ErrorKind::UpstreamIncomplete,
        ErrorKind::Internal,
    ];

    /// The HTTP status the client gets.
    pub fn status(self) -> StatusCode {
        match self {
            ErrorKind::BadRequest | ErrorKind::ContextTooLong => StatusCode::BAD_REQUEST,
            ErrorKind::TooLarge => StatusCode::PAYLOAD_TOO_LARGE,
            ErrorKind::BodyTimeout => StatusCode::REQUEST_TIMEOUT,
            ErrorKind::Unauthorized => StatusCode::UNAUTHORIZED,
            ErrorKind::Forbidden => StatusCode::FORBIDDEN,
            ErrorKind::NotFound | ErrorKind::ModelNotFound => StatusCode::NOT_FOUND,
            ErrorKind::MethodNotAllowed => StatusCode::METHOD_NOT_ALLOWED,
            ErrorKind::Conflict => StatusCode::CONFLICT,
            ErrorKind::RateLimited => StatusCode::TOO_MANY_REQUESTS,
            ErrorKind::NoWorkers | ErrorKind::Overloaded | ErrorKind::QueueTimeout => {
                StatusCode::SERVICE_UNAVAILABLE
            }
            ErrorKind::UpstreamUnreachable
            | ErrorKind::UpstreamFailed
            | ErrorKind::UpstreamIncomplete => StatusCode::BAD_GATEWAY,
            ErrorKind::Internal => StatusCode::INTERNAL_SERVER_ERROR,
        }
    }

    /// The OpenAI error `type`: OpenAI's own where it has one (a context
    /// overflow is an `invalid_request_error` there too), so that clients
    /// keyed on it keep working.
    pub fn openai_type(self) -> &'static str {
        match self {
            ErrorKind::BadRequest | ErrorKind::ContextTooLong | ErrorKind::ModelNotFound => {
                "invalid_request_error"
            }
            ErrorKind::TooLarge => "request_too_large",
            ErrorKind::BodyTimeout => "request_timeout",
            ErrorKind::RateLimited => "rate_limit_exceeded",
            ErrorKind::Overloaded | ErrorKind::QueueTimeout => "overloaded",
            ErrorKind::Internal => "internal_error",
            other => other.label(),
        }
    }

    /// The `kind` label of `kvroute_proxy_errors_total`.
    pub fn label(self) -> &'static str {
        match self {
            ErrorKind::BadRequest => "bad_request",
            ErrorKind::ContextTooLong => "context_too_long",
            ErrorKind::TooLarge => "too_large",
            ErrorKind::BodyTimeout => "body_timeout",
            ErrorKind::Unauthorized => "unauthorized",
            ErrorKind::Forbidden => "forbidden",
            ErrorKind::NotFound => "not_found",
            ErrorKind::MethodNotAllowed => "method_not_allowed",
            ErrorKind::Conflict => "conflict",
            ErrorKind::RateLimited => "rate_limited",
            ErrorKind::NoWorkers => "no_workers",
            ErrorKind::ModelNotFound => "model_not_found",
            ErrorKind::Overloaded => "overloaded",
            ErrorKind::QueueTimeout => "queue_timeout",
            ErrorKind::UpstreamUnreachable => "upstream_unreachable",
            ErrorKind::UpstreamFailed => "upstream_failed",
            ErrorKind::UpstreamIncomplete => "upstream_incomplete",
            ErrorKind::Internal => "internal",
        }
    }
}

/// The label of `kvroute_proxy_errors_total`: `{kind="…"}`.
impl prometheus_client::encoding::EncodeLabelSet for ErrorKind {
    fn encode(
        &self,
        encoder: &mut prometheus_client::encoding::LabelSetEncoder,
    ) -> Result<(), std::fmt::Error> {
        use prometheus_client::encoding::EncodeLabel as _;
        ("kind", self.label()).encode(encoder.encode_label())
    }
}

/// Every failure kvroute answers a request with, answered as
/// `{"error": {"message", "type", "param", "code"}}` (OpenAI's shape; `code`
/// is the HTTP status, as vLLM and SGLang send it). The message is the
/// `Display` text; status, `type` and metric label come from its
/// [`ErrorKind`].
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum ProxyError {
    /// 400: the request is malformed.
    #[error("{0}")]
    BadRequest(String),
    /// 400: the request does not fit the worker's context length.
    #[error("{0}")]
    ContextTooLong(String),
    /// 413: the body is over the route's limit.
    #[error("{0}")]
    TooLarge(String),
    /// 408: the body did not arrive in time.
    #[error("{0}")]
    BodyTimeout(String),
    /// 401: the admin bearer token is missing or wrong.
    #[error("a valid admin bearer token is required")]
    Unauthorized,
    /// 403: the admin API is disabled.
    #[error(
        "the admin API is disabled: start kvroute serve with --admin-token \
         (or KVROUTE_ADMIN_TOKEN) to register and unregister workers"
    )]
    AdminDisabled,
    /// 404: no such route, or no such worker.
    #[error("{0}")]
    NotFound(String),
    /// 405: the route does not take this method.
    #[error("method not allowed on this route")]
    MethodNotAllowed,
    /// 409: the change conflicts with the fleet.
    #[error("{0}")]
    Conflict(String),
    /// 429: too many queries at once.
    #[error("{0}")]
    RateLimited(String),
    /// 503: no worker can be routed to.
    #[error("no worker is available (none registered, or all failing)")]
    NoWorkers,
    /// 404: no worker serves the model named.
    #[error("The model `{0}` does not exist or you do not have access to it.")]
    ModelNotFound(String),
    /// 404: the `previous_response_id` of a Responses API continuation is
    /// not a response this client may continue (unknown, expired, or
    /// another's): the engine's own answer to an unknown id, so that the
    /// two cannot be told apart.
    #[error("Response with id '{0}' not found.")]
    ResponseNotFound(String),
    /// 503: every rank is busy and the request could not wait.
    #[error("{0}")]
    Overloaded(String),
    /// 503: every rank stayed busy for the whole wait in the queue.
    #[error("{0}")]
    QueueTimeout(String),
    /// 502: no worker took the request (the last candidate's error).
    #[error("no worker answered: {0}")]
    UpstreamUnreachable(String),
    /// 502: a worker took the request and failed before answering.
    #[error(
        "worker `{worker}` failed request {request_id} after receiving it ({detail}); \
         it was not sent to another worker"
    )]
    UpstreamFailed {
        /// The worker.
        worker: Arc<str>,
        /// The request's id.
        request_id: String,
        /// What went wrong.
        detail: String,
    },
    /// 502 (or, in a stream under way, its last event): a worker cut its
    /// answer off after the head.
    #[error(
        "worker `{worker}` cut off its answer to request {request_id} ({detail}); \
         it was not sent to another worker"
    )]
    UpstreamIncomplete {
        /// The worker.
        worker: Arc<str>,
        /// The request's id.
        request_id: String,
        /// What went wrong.
        detail: String,
    },
    /// 500: kvroute itself failed.
    #[error("{0}")]
    Internal(String),
}

impl ProxyError {
    /// 400: the request is malformed.
    pub fn bad_request(message: impl Into<String>) -> Self {
        ProxyError::BadRequest(message.into())
    }

    /// 500: kvroute itself failed.
    pub fn internal(message: impl Into<String>) -> Self {
        ProxyError::Internal(message.into())
    }

    /// The error for a request `worker` took and then lost, of the `kind`
    /// the retry rule gave: [`ErrorKind::UpstreamIncomplete`] when its
    /// answer was cut off, [`ErrorKind::UpstreamFailed`] otherwise.
    pub fn lost(kind: ErrorKind, worker: &Arc<str>, request_id: &str, detail: String) -> Self {
        let (worker, request_id) = (worker.clone(), request_id.to_owned());
        if kind == ErrorKind::UpstreamIncomplete {
            ProxyError::UpstreamIncomplete {
                worker,
                request_id,
                detail,
            }
        } else {
            ProxyError::UpstreamFailed {
                worker,
                request_id,
                detail,
            }
        }
    }

    /// What it is: its status, `type` and metric label.
    pub fn kind(&self) -> ErrorKind {
        match self {
            ProxyError::BadRequest(_) => ErrorKind::BadRequest,
            ProxyError::ContextTooLong(_) => ErrorKind::ContextTooLong,
            ProxyError::TooLarge(_) => ErrorKind::TooLarge,
            ProxyError::BodyTimeout(_) => ErrorKind::BodyTimeout,
            ProxyError::Unauthorized => ErrorKind::Unauthorized,
            ProxyError::AdminDisabled => ErrorKind::Forbidden,
            ProxyError::NotFound(_) => ErrorKind::NotFound,
            ProxyError::MethodNotAllowed => ErrorKind::MethodNotAllowed,
            ProxyError::Conflict(_) => ErrorKind::Conflict,
            ProxyError::RateLimited(_) => ErrorKind::RateLimited,
            ProxyError::NoWorkers => ErrorKind::NoWorkers,
            ProxyError::ModelNotFound(_) => ErrorKind::ModelNotFound,
            ProxyError::ResponseNotFound(_) => ErrorKind::NotFound,
            ProxyError::Overloaded(_) => ErrorKind::Overloaded,
            ProxyError::QueueTimeout(_) => ErrorKind::QueueTimeout,
            ProxyError::UpstreamUnreachable(_) => ErrorKind::UpstreamUnreachable,
            ProxyError::UpstreamFailed { .. } => ErrorKind::UpstreamFailed,
            ProxyError::UpstreamIncomplete { .. } => ErrorKind::UpstreamIncomplete,
            ProxyError::Internal(_) => ErrorKind::Internal,
        }
    }

    /// The status.
    pub fn status(&self) -> StatusCode {
        self.kind().status()
    }

    /// The message.
    pub fn message(&self) -> String {
        self.to_string()
    }

    /// The OpenAI error body (also sent as a stream's last event).
    pub fn body(&self) -> Value {
        if let ProxyError::ModelNotFound(_) = self {
            // OpenAI's own answer, which clients key on by its code.
            return json!({"error": {
                "message": self.to_string(),
                "type": "invalid_request_error",
                "param": "model",
                "code": "model_not_found",
            }});
        }
        if let ProxyError::ResponseNotFound(_) = self {
            // vLLM's answer to an unknown `previous_response_id`.
            return json!({"error": {
                "message": self.to_string(),
                "type": "invalid_request_error",
                "param": "previous_response_id",
                "code": 404,
            }});
        }
        json!({"error": {
            "message": self.to_string(),
            "type": self.kind().openai_type(),
            "param": null,
            "code": self.status().as_u16(),
        }})
    }
}

/// An error and its causes, as `error: cause: cause`: the detail of an
/// upstream failure (reqwest's own text leaves out, for one, why a body
/// could not be read).
pub fn error_chain(e: &dyn std::error::Error) -> String {
    let mut text = e.to_string();
    let mut source = e.source();
    while let Some(cause) = source {
        text.push_str(": ");
        text.push_str(&cause.to_string());
        source = cause.source();
    }
    text
}

impl IntoResponse for ProxyError {
    fn into_response(self) -> Response {
        (self.status(), Json(self.body())).into_response()
    }
}

/// 404 for a path no route serves.
pub async fn not_found() -> ProxyError {
    ProxyError::NotFound("no such route".to_owned())
}

/// 405 for a method a route does not take.
pub async fn method_not_allowed() -> ProxyError {
    ProxyError::MethodNotAllowed
}

/// 413 at once for a request whose `Content-Length` is over `limit`, before
/// its body is read or it waits for anything.
pub async fn refuse_declared_oversize(
    axum::extract::State(limit): axum::extract::State<usize>,
    request: Request,
    next: axum::middleware::Next,
) -> Response {
    let declared = request
        .headers()
        .get(axum::http::header::CONTENT_LENGTH)
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.parse::<u64>().ok());
    match declared {
        Some(n) if n > limit as u64 => ProxyError::TooLarge(format!(
            "the body is {n} bytes; this route takes at most {limit}"
        ))
        .into_response(),
        _ => next.run(request).await,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_error_has_the_openai_shape_with_its_status_as_code() {
        let worker: Arc<str> = Arc::from("w1");
        let errors = [
            (
                ProxyError::bad_request("`n` must be 1"),
                400,
                "invalid_request_error",
            ),
            (
                ProxyError::ContextTooLong("too long".into()),
                400,
                "invalid_request_error",
            ),
            (ProxyError::TooLarge("big".into()), 413, "request_too_large"),
            (ProxyError::Unauthorized, 401, "unauthorized"),
            (ProxyError::AdminDisabled, 403, "forbidden"),
            (
                ProxyError::NotFound("no such route".into()),
                404,
                "not_found",
            ),
            (ProxyError::MethodNotAllowed, 405, "method_not_allowed"),
            (ProxyError::Conflict("taken".into()), 409, "conflict"),
            (
                ProxyError::RateLimited("busy".into()),
                429,
                "rate_limit_exceeded",
            ),
            (ProxyError::NoWorkers, 503, "no_workers"),
            (ProxyError::Overloaded("busy".into()), 503, "overloaded"),
            (ProxyError::QueueTimeout("waited".into()), 503, "overloaded"),
            (
                ProxyError::UpstreamUnreachable("refused".into()),
                502,
                "upstream_unreachable",
            ),
            (
                ProxyError::lost(ErrorKind::UpstreamFailed, &worker, "r-1", "reset".into()),
                502,
                "upstream_failed",
            ),
            (
                ProxyError::lost(ErrorKind::UpstreamIncomplete, &worker, "r-1", "eof".into()),
                502,
                "upstream_incomplete",
            ),
            (ProxyError::internal("bug"), 500, "internal_error"),
        ];
        let mut labels: Vec<&str> = Vec::new();
        for (error, status, kind) in errors {
            let body = error.body();
            assert_eq!(body["error"]["code"], status, "{body}");
            assert_eq!(body["error"]["type"], kind, "{body}");
            assert!(body["error"]["param"].is_null(), "{body}");
            assert_eq!(body["error"]["message"], error.to_string(), "{body}");
            assert_eq!(error.status().as_u16(), status);
            labels.push(error.kind().label());
        }
        // No such model: OpenAI's own answer.
        let missing = ProxyError::ModelNotFound("m".into());
        assert_eq!(missing.status().as_u16(), 404);
        assert_eq!(
            missing.body(),
            json!({"error": {"message": "The model `m` does not exist or you do not have access to it.",
                "type": "invalid_request_error", "param": "model", "code": "model_not_found"}})
        );
        labels.push(missing.kind().label());
        // Every kind has its own label.
        let n = labels.len();
        labels.sort_unstable();
        labels.dedup();
        assert_eq!(labels.len(), n);
    }

    #[test]
    fn an_upstream_failure_names_the_worker_and_the_request() {
        let worker: Arc<str> = Arc::from("w1");
        for kind in [ErrorKind::UpstreamFailed, ErrorKind::UpstreamIncomplete] {
            let e = ProxyError::lost(kind, &worker, "kvroute-42", "eof".into());
            assert_eq!(e.kind(), kind);
            let message = e.to_string();
            assert!(
                message.contains("`w1`") && message.contains("kvroute-42"),
                "{message}"
            );
            assert!(message.contains("not sent to another worker"), "{message}");
        }
    }
}
