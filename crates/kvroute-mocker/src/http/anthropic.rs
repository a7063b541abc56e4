//! Anthropic's Messages API, `POST /v1/messages`, as vLLM serves it: the
//! body converted into chat messages by [`kvroute_prompt::messages`] (the
//! router's own conversion), then rendered, cached, run and counted exactly
//! as a `/v1/chat/completions` request; answered with a `message`, or
//! (`stream: true`) Anthropic's events: `message_start`,
//! `content_block_start`, `ping`, one `content_block_delta` per generated
//! piece, `content_block_stop`, `message_delta`, `message_stop`.
//!
//! Usage follows vLLM's (vllm-project/vllm#40912) and Anthropic's contract
//! (`input_tokens` + `cache_read_input_tokens` +
//! `cache_creation_input_tokens` is the whole prompt): `input_tokens` counts
//! the prompt tokens not served from the prefix cache,
//! `cache_read_input_tokens` those that were, and
//! `cache_creation_input_tokens` is 0 (an engine's prefix cache has no
//! separate write). A stream's `message_start` comes before the engine has
//! scheduled the request, so it carries the whole prompt as `input_tokens`
//! and no cache fields (as vLLM when the cache is not known yet); its
//! `message_delta` carries all four.
//!
//! Every error of this route has Anthropic's shape,
//! `{"type": "error", "error": {"type", "message"}}`.

use std::collections::VecDeque;
use std::sync::Arc;

use axum::body::Bytes;
use axum::extract::rejection::BytesRejection;
use axum::extract::State;
use axum::http::{HeaderMap, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::Json;
use serde_json::{json, Map, Value};

use super::events::{self, EventWriter};
use super::openai::{self, ParsedRequest};
use super::{ApiError, EngineState, ErrorShape};
use crate::engine::Usage;
use kvroute_prompt::body::TextPrompt;

/// Anthropic's error `type` for an HTTP status.
pub fn error_type(status: StatusCode) -> &'static str {
    match status.as_u16() {
        401 => "authentication_error",
        403 => "permission_error",
        404 => "not_found_error",
        413 => "request_too_large",
        429 => "rate_limit_error",
        503 | 529 => "overloaded_error",
        400..=499 => "invalid_request_error",
        _ => "api_error",
    }
}

/// Reads a Messages body: the chat request it runs as.
pub(super) fn parse(obj: Map<String, Value>) -> Result<ParsedRequest, ApiError> {
    let read = kvroute_prompt::messages::read(&obj).map_err(|e| ApiError::bad_request(e.0))?;
    let Some(TextPrompt::Chat(messages)) = read.text else {
        return Err(ApiError::internal("the Messages reader gave no messages"));
    };
    let max_tokens = read
        .max_tokens
        .and_then(|n| usize::try_from(n).ok())
        .ok_or_else(|| ApiError::bad_request("`max_tokens` is too large"))?;
    openai::converted_chat(obj, &messages, max_tokens, read.stream)
}

/// `POST /v1/messages`.
pub(super) async fn create(
    State(state): State<Arc<EngineState>>,
    headers: HeaderMap,
    body: Result<Bytes, BytesRejection>,
) -> Response {
    respond(state, headers, body)
        .await
        .unwrap_or_else(|e| e.with_shape(ErrorShape::Anthropic).into_response())
}

async fn respond(
    state: Arc<EngineState>,
    headers: HeaderMap,
    body: Result<Bytes, BytesRejection>,
) -> Result<Response, ApiError> {
    let (_, value) = super::json_body(body)?;
    let Value::Object(obj) = value else {
        return Err(ApiError::bad_request("the body must be a JSON object"));
    };
    let parsed = parse(obj)?;
    let mut run = super::admit(&state, &headers, parsed).await?;
    let answer = Answer {
        id: events::unique_id("msg_", &state.name, run.n),
        model: state.model.clone(),
        max_tokens: run.parsed.max_tokens,
    };
    if run.parsed.stream {
        let mut first = VecDeque::new();
        let mut start = answer.message(Vec::new(), None, None);
        start["usage"] = json!({"input_tokens": run.prompt_tokens, "output_tokens": 0});
        first.push_back(events::event(
            "message_start",
            &json!({"type": "message_start", "message": start}),
        ));
        let block = json!({"type": "content_block_start", "index": 0,
            "content_block": {"type": "text", "text": ""}});
        first.push_back(events::event("content_block_start", &block));
        first.push_back(events::event("ping", &json!({"type": "ping"})));
        let writer = Writer { answer };
        return Ok(events::event_stream(first, writer, run.filler, run.updates));
    }
    let (text, usage) = events::collect(&run.filler, &mut run.updates).await?;
    let content = vec![json!({"type": "text", "text": text})];
    let mut body = answer.message(content, Some(answer.stop_reason(&usage)), Some(&usage));
    if let Some(params) = run.leg.transfer_params(&state, run.rank, run.id).await {
        body["kv_transfer_params"] = params;
    }
    Ok(Json(body).into_response())
}

/// The `usage` object, split by the prefix cache as the module says.
pub fn usage_json(u: &Usage) -> Value {
    json!({
        "input_tokens": u.prompt_tokens.saturating_sub(u.cached_tokens),
        "output_tokens": u.completion_tokens,
        "cache_read_input_tokens": u.cached_tokens,
        "cache_creation_input_tokens": 0,
    })
}

/// Identity of one answer.
#[derive(Debug, Clone)]
struct Answer {
    id: String,
    model: String,
    max_tokens: usize,
}

impl Answer {
    /// The `message` object.
    fn message(&self, content: Vec<Value>, stop: Option<&str>, usage: Option<&Usage>) -> Value {
        json!({
            "id": self.id,
            "type": "message",
            "role": "assistant",
            "model": self.model,
            "content": content,
            "stop_reason": stop,
            "stop_sequence": null,
            "usage": usage.map(usage_json),
        })
    }

    /// `max_tokens` when the whole budget was generated, else `end_turn`.
    fn stop_reason(&self, usage: &Usage) -> &'static str {
        if usage.completion_tokens >= self.max_tokens {
            "max_tokens"
        } else {
            "end_turn"
        }
    }
}

/// The events of a streamed answer after its start.
struct Writer {
    answer: Answer,
}

impl EventWriter for Writer {
    fn token(&mut self, text: &str, out: &mut VecDeque<Bytes>) {
        let delta = json!({"type": "content_block_delta", "index": 0,
            "delta": {"type": "text_delta", "text": text}});
        out.push_back(events::event("content_block_delta", &delta));
    }

    fn finish(&mut self, usage: &Usage, out: &mut VecDeque<Bytes>) {
        let stop = json!({"type": "content_block_stop", "index": 0});
        out.push_back(events::event("content_block_stop", &stop));
        let delta = json!({
            "type": "message_delta",
            "delta": {"stop_reason": self.answer.stop_reason(usage), "stop_sequence": null},
            "usage": usage_json(usage),
        });
        out.push_back(events::event("message_delta", &delta));
        out.push_back(events::event(
            "message_stop",
            &json!({"type": "message_stop"}),
        ));
    }

    fn fail(&mut self, error: &ApiError, out: &mut VecDeque<Bytes>) {
        let body = error.clone().with_shape(ErrorShape::Anthropic).body();
        out.push_back(events::event("error", &body));
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn usage_splits_the_prompt_by_the_cache() {
        let usage = Usage {
            prompt_tokens: 40,
            completion_tokens: 3,
            cached_tokens: 32,
        };
        assert_eq!(
            usage_json(&usage),
            json!({"input_tokens": 8, "output_tokens": 3, "cache_read_input_tokens": 32,
                "cache_creation_input_tokens": 0})
        );
        let a = Answer {
            id: "msg_1".into(),
            model: "m".into(),
            max_tokens: 3,
        };
        assert_eq!(a.stop_reason(&usage), "max_tokens");
        let short = Usage {
            completion_tokens: 1,
            ..usage
        };
        assert_eq!(a.stop_reason(&short), "end_turn");
    }

    #[test]
    fn errors_take_anthropics_types() {
        assert_eq!(error_type(StatusCode::BAD_REQUEST), "invalid_request_error");
        assert_eq!(error_type(StatusCode::NOT_FOUND), "not_found_error");
        assert_eq!(
            error_type(StatusCode::PAYLOAD_TOO_LARGE),
            "request_too_large"
        );
        assert_eq!(
            error_type(StatusCode::SERVICE_UNAVAILABLE),
            "overloaded_error"
        );
        assert_eq!(error_type(StatusCode::INTERNAL_SERVER_ERROR), "api_error");
        let e = ApiError::bad_request("no").with_shape(ErrorShape::Anthropic);
        assert_eq!(
            e.body(),
            json!({"type": "error", "error": {"type": "invalid_request_error", "message": "no"}})
        );
    }
}
