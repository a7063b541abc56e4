//! The three API dialects a request can come in, and how each tells a
//! client about a failure: OpenAI's completions and chat (and SGLang's
//! `/generate`), OpenAI's Responses API, and Anthropic's Messages API.
//!
//! A client library reads errors in its own API's shape (the `anthropic`
//! SDK raises `NotFoundError` from `{"type":"error","error":{"type":
//! "not_found_error",…}}`, not from OpenAI's `{"error":{…}}`), and reads a
//! stream's failure as that API's last event: OpenAI chat ends with
//! `data: {"error":…}` and `data: [DONE]`; the Responses and Messages
//! streams end with an `event: error` and have no `[DONE]`.

use axum::response::{IntoResponse, Response};
use axum::Json;
use serde_json::{json, Value};

use crate::api::{ErrorKind, ProxyError};

/// Which API's conventions an answer follows.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub enum Dialect {
    /// OpenAI's completions and chat, and SGLang's `/generate`.
    #[default]
    OpenAi,
    /// OpenAI's Responses API (`/v1/responses`).
    Responses,
    /// Anthropic's Messages API (`/v1/messages`).
    Anthropic,
}

impl ErrorKind {
    /// Anthropic's error `type` for this kind (its documented set: a busy
    /// fleet is `overloaded_error`, anything of kvroute's or the worker's
    /// own is `api_error`).
    pub fn anthropic_type(self) -> &'static str {
        match self {
            ErrorKind::BadRequest
            | ErrorKind::ContextTooLong
            | ErrorKind::MethodNotAllowed
            | ErrorKind::BodyTimeout
            | ErrorKind::Conflict => "invalid_request_error",
            ErrorKind::TooLarge => "request_too_large",
            ErrorKind::Unauthorized => "authentication_error",
            ErrorKind::Forbidden => "permission_error",
            ErrorKind::NotFound | ErrorKind::ModelNotFound => "not_found_error",
            ErrorKind::RateLimited => "rate_limit_error",
            ErrorKind::NoWorkers | ErrorKind::Overloaded | ErrorKind::QueueTimeout => {
                "overloaded_error"
            }
            ErrorKind::UpstreamUnreachable
            | ErrorKind::UpstreamFailed
            | ErrorKind::UpstreamIncomplete
            | ErrorKind::Internal => "api_error",
        }
    }
}

impl ProxyError {
    /// The error body in `dialect`'s shape.
    pub fn body_in(&self, dialect: Dialect) -> Value {
        match dialect {
            Dialect::OpenAi | Dialect::Responses => self.body(),
            Dialect::Anthropic => json!({"type": "error", "error": {
                "type": self.kind().anthropic_type(),
                "message": self.to_string(),
            }}),
        }
    }

    /// The last bytes of an SSE stream this error cut off, in `dialect`'s
    /// shape; `at_boundary`: what was sent so far ends an event.
    pub fn stream_end(&self, dialect: Dialect, at_boundary: bool) -> String {
        let lead = if at_boundary { "" } else { "\n\n" };
        match dialect {
            Dialect::OpenAi => format!("{lead}data: {}\n\ndata: [DONE]\n\n", self.body()),
            Dialect::Responses => {
                let event = json!({
                    "type": "error",
                    "code": self.kind().openai_type(),
                    "message": self.to_string(),
                    "param": null,
                });
                format!("{lead}event: error\ndata: {event}\n\n")
            }
            Dialect::Anthropic => {
                let event = self.body_in(dialect);
                format!("{lead}event: error\ndata: {event}\n\n")
            }
        }
    }

    /// The answer to a request of `dialect`: the status and the body in
    /// its shape.
    pub fn into_response_in(self, dialect: Dialect) -> Response {
        if dialect != Dialect::Anthropic {
            return self.into_response();
        }
        (self.status(), Json(self.body_in(dialect))).into_response()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn anthropic_errors_have_its_shape_and_types() {
        let e = ProxyError::ModelNotFound("gamma".into());
        let body = e.body_in(Dialect::Anthropic);
        assert_eq!(body["type"], "error");
        assert_eq!(body["error"]["type"], "not_found_error");
        assert!(body["error"]["message"]
            .as_str()
            .is_some_and(|m| m.contains("gamma")));
        assert!(body.get("code").is_none());
        let busy = ProxyError::Overloaded("busy".into()).body_in(Dialect::Anthropic);
        assert_eq!(busy["error"]["type"], "overloaded_error");
        let openai = e.body_in(Dialect::Responses);
        assert_eq!(openai["error"]["code"], "model_not_found");
    }

    #[test]
    fn each_dialect_ends_a_stream_its_own_way() {
        let e = ProxyError::internal("cut");
        let chat = e.stream_end(Dialect::OpenAi, true);
        assert!(chat.starts_with("data: {") && chat.ends_with("data: [DONE]\n\n"));
        let responses = e.stream_end(Dialect::Responses, false);
        assert!(
            responses.starts_with("\n\nevent: error\ndata: {\"type\":\"error\",\"code\""),
            "{responses}"
        );
        assert!(!responses.contains("[DONE]"));
        let anthropic = e.stream_end(Dialect::Anthropic, true);
        assert!(
            anthropic.starts_with(
                "event: error\ndata: {\"type\":\"error\",\"error\":{\"type\":\"api_error\""
            ),
            "{anthropic}"
        );
    }
}
