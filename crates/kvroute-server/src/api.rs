//! What every endpoint shares: the one error type, answered as OpenAI's
//! error body, and the body extractor that answers its own failures (a body
//! over the size limit, a broken upload) with that error too.

use axum::body::Bytes;
use axum::extract::{FromRequest, Request};
use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};
use axum::Json;
use serde_json::json;

/// An error answered as `{"error": {"message", "type", "param", "code"}}`
/// (OpenAI's shape; `code` is the HTTP status, as vLLM and SGLang send it).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ApiError {
    status: StatusCode,
    kind: &'static str,
    message: String,
}

impl ApiError {
    /// An error with this status, OpenAI `type` and message.
    pub fn new(status: StatusCode, kind: &'static str, message: impl Into<String>) -> Self {
        ApiError {
            status,
            kind,
            message: message.into(),
        }
    }

    /// 400: the request is malformed.
    pub fn bad_request(message: impl Into<String>) -> Self {
        Self::new(StatusCode::BAD_REQUEST, "invalid_request_error", message)
    }

    /// 500: kvroute itself failed.
    pub fn internal(message: impl Into<String>) -> Self {
        Self::new(StatusCode::INTERNAL_SERVER_ERROR, "internal_error", message)
    }

    /// The status.
    pub fn status(&self) -> StatusCode {
        self.status
    }

    /// The message.
    pub fn message(&self) -> &str {
        &self.message
    }

    /// The OpenAI error `type`.
    pub fn kind(&self) -> &'static str {
        self.kind
    }
}

impl IntoResponse for ApiError {
    fn into_response(self) -> Response {
        let body = json!({"error": {
            "message": self.message,
            "type": self.kind,
            "param": null,
            "code": self.status.as_u16(),
        }});
        (self.status, Json(body)).into_response()
    }
}

/// A request body, read up to the server's size limit. A body over the
/// limit is a 413 and a failed read a 400, both as [`ApiError`]s.
#[derive(Debug, Clone)]
pub struct Body(pub Bytes);

impl<S: Send + Sync> FromRequest<S> for Body {
    type Rejection = ApiError;

    async fn from_request(req: Request, state: &S) -> Result<Self, ApiError> {
        match Bytes::from_request(req, state).await {
            Ok(bytes) => Ok(Body(bytes)),
            Err(rejection) => {
                let status = rejection.status();
                let kind = if status == StatusCode::PAYLOAD_TOO_LARGE {
                    "request_too_large"
                } else {
                    "invalid_request_error"
                };
                Err(ApiError::new(status, kind, rejection.body_text()))
            }
        }
    }
}

/// 404 for a path no route serves.
pub async fn not_found() -> ApiError {
    ApiError::new(StatusCode::NOT_FOUND, "not_found", "no such route")
}

/// 405 for a method a route does not take.
pub async fn method_not_allowed() -> ApiError {
    ApiError::new(
        StatusCode::METHOD_NOT_ALLOWED,
        "method_not_allowed",
        "method not allowed on this route",
    )
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
        Some(n) if n > limit as u64 => ApiError::new(
            StatusCode::PAYLOAD_TOO_LARGE,
            "request_too_large",
            format!("the body is {n} bytes; this route takes at most {limit}"),
        )
        .into_response(),
        _ => next.run(request).await,
    }
}
