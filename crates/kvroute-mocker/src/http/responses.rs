//! OpenAI's Responses API, `POST /v1/responses`, as vLLM serves it: the body
//! converted into chat messages by [`kvroute_prompt::responses`] (the
//! router's own conversion), then rendered, cached, run and counted exactly
//! as a `/v1/chat/completions` request; the answer is a `response` object,
//! or (`stream: true`) its typed events, `event: <type>` and `data: <json>`
//! with a `sequence_number` from 0, ending with `response.completed` (no
//! `[DONE]`).
//!
//! * `max_output_tokens` (default 16), `stream`, `model` (the served model
//!   or a LoRA adapter), and the fields a chat body shares (`mm_hashes`,
//!   `data_parallel_rank`, disaggregation fields) are read; `instructions`,
//!   `previous_response_id`, `metadata`, `temperature` and `top_p` are
//!   echoed in the answer.
//! * `store` (default true): the answered conversation (every message of
//!   the prompt, its `instructions` included, as vLLM's `msg_store` keeps
//!   them, then the answer) is kept in the
//!   engine's [`ResponseStore`](super::ResponseStore) under the response
//!   id. A request naming it as `previous_response_id` renders its own
//!   `instructions`, the stored conversation, then its `input`, so its
//!   prompt extends the previous one and hits this engine's prefix cache
//!   (the router sends it to this engine). An unknown id is a 404 in vLLM's
//!   words (`Response with id '…' not found.`, type
//!   `invalid_request_error`, `param: previous_response_id`).
//! * `usage.input_tokens` counts the whole prompt, cached tokens included
//!   (as OpenAI counts them), with `input_tokens_details.cached_tokens`.
//!   The mock generates the whole budget and answers `status: completed`.

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
use super::openai::{self, ParsedRequest, DEFAULT_MAX_TOKENS};
use super::response_store::Stored;
use super::{unix_now, ApiError, EngineState};
use crate::engine::Usage;
use kvroute_prompt::responses::Conversation;

fn bad(message: impl Into<String>) -> ApiError {
    ApiError::bad_request(message)
}

/// What a Responses request needs besides the chat request it runs as.
#[derive(Debug, Clone, PartialEq)]
pub(super) struct Turn {
    /// The prompt's messages (instructions, stored history, this input),
    /// to store with the answer appended.
    conversation: Vec<Value>,
    /// Its estimated size in bytes (the bodies it came from).
    bytes: usize,
    /// `store`.
    store: bool,
    /// The request fields the answer repeats, by name.
    echo: Map<String, Value>,
}

/// Reads a Responses body (`body_len` bytes): the chat request to run, and
/// the turn; a `previous_response_id` is looked up in the engine's store.
pub(super) fn parse(
    state: &EngineState,
    body_len: usize,
    obj: Map<String, Value>,
) -> Result<(ParsedRequest, Turn), ApiError> {
    let conversation = Conversation::read(&obj).map_err(|e| bad(e.0))?;
    let stream = flag(&obj, "stream", false)?;
    let store = flag(&obj, "store", true)?;
    let max_tokens = match obj.get("max_output_tokens") {
        None | Some(Value::Null) => DEFAULT_MAX_TOKENS,
        Some(v) => v
            .as_u64()
            .filter(|&n| n >= 1)
            .and_then(|n| usize::try_from(n).ok())
            .ok_or_else(|| bad("`max_output_tokens` must be a positive integer"))?,
    };
    let (history, history_bytes) = match obj.get("previous_response_id") {
        None | Some(Value::Null) => (None, 0),
        Some(Value::String(id)) => {
            let stored = state.responses.get(id).ok_or_else(|| {
                ApiError::new(
                    StatusCode::NOT_FOUND,
                    "invalid_request_error",
                    format!("Response with id '{id}' not found."),
                )
                .with_param("previous_response_id")
            })?;
            (Some(stored.messages), stored.bytes)
        }
        Some(_) => return Err(bad("`previous_response_id` must be a string")),
    };
    let history = history.as_deref().unwrap_or(&[]);
    let messages = conversation.messages(history);
    if messages.is_empty() {
        return Err(bad("`input` holds no message to render"));
    }
    let mut echo = Map::new();
    for key in ["instructions", "previous_response_id", "metadata"] {
        echo.insert(key.into(), obj.get(key).cloned().unwrap_or(Value::Null));
    }
    for key in ["temperature", "top_p"] {
        let value = obj.get(key).filter(|v| v.is_number());
        echo.insert(key.into(), value.cloned().unwrap_or(json!(1.0)));
    }
    echo.insert("max_output_tokens".into(), json!(max_tokens));
    echo.insert("store".into(), json!(store));
    // As vLLM's `msg_store`: the whole prompt's messages, this request's
    // instructions included, so a continuation extends this prompt.
    let turn = Turn {
        conversation: messages.clone(),
        bytes: history_bytes.saturating_add(body_len),
        store,
        echo,
    };
    let parsed = openai::converted_chat(obj, &Value::Array(messages), max_tokens, stream)?;
    Ok((parsed, turn))
}

fn flag(obj: &Map<String, Value>, key: &str, default: bool) -> Result<bool, ApiError> {
    match obj.get(key) {
        None | Some(Value::Null) => Ok(default),
        Some(Value::Bool(b)) => Ok(*b),
        Some(_) => Err(bad(format!("`{key}` must be a boolean"))),
    }
}

/// `POST /v1/responses`.
pub(super) async fn create(
    State(state): State<Arc<EngineState>>,
    headers: HeaderMap,
    body: Result<Bytes, BytesRejection>,
) -> Response {
    respond(state, headers, body)
        .await
        .unwrap_or_else(IntoResponse::into_response)
}

async fn respond(
    state: Arc<EngineState>,
    headers: HeaderMap,
    body: Result<Bytes, BytesRejection>,
) -> Result<Response, ApiError> {
    let (body, value) = super::json_body(body)?;
    let Value::Object(obj) = value else {
        return Err(bad("the body must be a JSON object"));
    };
    let (parsed, turn) = parse(&state, body.len(), obj)?;
    let mut run = super::admit(&state, &headers, parsed).await?;
    let id = events::unique_id("resp_", &state.name, run.n);
    let answer = Answer {
        message_id: events::unique_id("msg_", &state.name, run.n),
        id,
        created: unix_now(),
        model: state.model.clone(),
        echo: turn.echo.clone(),
    };
    if run.parsed.stream {
        let mut writer = Writer {
            answer,
            sequence: 0,
            text: String::new(),
            state: state.clone(),
            turn,
        };
        let mut first = VecDeque::new();
        writer.start(&mut first);
        return Ok(events::event_stream(first, writer, run.filler, run.updates));
    }
    let (text, usage) = events::collect(&run.filler, &mut run.updates).await?;
    keep(&state, &answer.id, turn, &text);
    let mut body = answer.response(
        "completed",
        vec![answer.message("completed", Some(&text))],
        Some(&usage),
    );
    if let Some(params) = run.leg.transfer_params(&state, run.rank, run.id).await {
        body["kv_transfer_params"] = params;
    }
    Ok(Json(body).into_response())
}

/// Stores the answered conversation under the response id, unless `store: false`.
fn keep(state: &EngineState, id: &str, turn: Turn, text: &str) {
    if !turn.store {
        return;
    }
    let mut messages = turn.conversation;
    messages.push(json!({"role": "assistant", "content": text}));
    let stored = Stored {
        messages: messages.into(),
        bytes: turn.bytes.saturating_add(text.len()),
    };
    state.responses.insert(id.to_owned(), stored);
}

/// The `usage` object of a response.
pub fn usage_json(u: &Usage) -> Value {
    json!({
        "input_tokens": u.prompt_tokens,
        "input_tokens_details": {"cached_tokens": u.cached_tokens},
        "output_tokens": u.completion_tokens,
        "output_tokens_details": {"reasoning_tokens": 0},
        "total_tokens": u.prompt_tokens + u.completion_tokens,
    })
}

/// Identity of one answer: what its body and its events share.
#[derive(Debug, Clone)]
struct Answer {
    id: String,
    message_id: String,
    created: u64,
    model: String,
    echo: Map<String, Value>,
}

impl Answer {
    /// The `response` object.
    fn response(&self, status: &str, output: Vec<Value>, usage: Option<&Usage>) -> Value {
        let mut body = json!({
            "id": self.id,
            "object": "response",
            "created_at": self.created,
            "model": self.model,
            "status": status,
            "output": output,
            "usage": usage.map(usage_json),
            "error": null,
            "incomplete_details": null,
            "parallel_tool_calls": true,
            "tool_choice": "auto",
            "tools": [],
            "text": {"format": {"type": "text"}},
            "background": false,
            "truncation": "disabled",
            "reasoning": null,
            "user": null,
        });
        if let Value::Object(map) = &mut body {
            for (k, v) in &self.echo {
                let v = if k == "metadata" && v.is_null() {
                    json!({})
                } else {
                    v.clone()
                };
                map.insert(k.clone(), v);
            }
        }
        body
    }

    /// The output message item; `None`: no content yet.
    fn message(&self, status: &str, text: Option<&str>) -> Value {
        let content: Vec<Value> = text.iter().map(|t| output_text(t)).collect();
        json!({
            "type": "message",
            "id": self.message_id,
            "status": status,
            "role": "assistant",
            "content": content,
        })
    }
}

fn output_text(text: &str) -> Value {
    json!({"type": "output_text", "text": text, "annotations": []})
}

/// The events of a streamed answer.
struct Writer {
    answer: Answer,
    sequence: u64,
    text: String,
    state: Arc<EngineState>,
    turn: Turn,
}

impl Writer {
    /// Appends the event `kind` with its `sequence_number` and `fields`.
    fn push(&mut self, out: &mut VecDeque<Bytes>, kind: &str, fields: Value) {
        let mut data = Map::new();
        data.insert("type".into(), Value::from(kind));
        data.insert("sequence_number".into(), json!(self.sequence));
        if let Value::Object(fields) = fields {
            data.extend(fields);
        }
        self.sequence += 1;
        out.push_back(events::event(kind, &Value::Object(data)));
    }

    /// Where the text goes: the message's first content part.
    fn part_fields(&self) -> Value {
        json!({"item_id": self.answer.message_id, "output_index": 0, "content_index": 0})
    }

    /// The events before the first token.
    fn start(&mut self, out: &mut VecDeque<Bytes>) {
        let response = self.answer.response("in_progress", Vec::new(), None);
        self.push(out, "response.created", json!({"response": response}));
        self.push(out, "response.in_progress", json!({"response": response}));
        let item = self.answer.message("in_progress", None);
        let added = json!({"output_index": 0, "item": item});
        self.push(out, "response.output_item.added", added);
        let mut fields = self.part_fields();
        fields["part"] = output_text("");
        self.push(out, "response.content_part.added", fields);
    }
}

impl EventWriter for Writer {
    fn token(&mut self, text: &str, out: &mut VecDeque<Bytes>) {
        self.text.push_str(text);
        let mut fields = self.part_fields();
        fields["delta"] = Value::from(text);
        fields["logprobs"] = json!([]);
        self.push(out, "response.output_text.delta", fields);
    }

    fn finish(&mut self, usage: &Usage, out: &mut VecDeque<Bytes>) {
        let text = std::mem::take(&mut self.text);
        let mut fields = self.part_fields();
        fields["text"] = Value::from(text.as_str());
        fields["logprobs"] = json!([]);
        self.push(out, "response.output_text.done", fields);
        let mut fields = self.part_fields();
        fields["part"] = output_text(&text);
        self.push(out, "response.content_part.done", fields);
        let item = self.answer.message("completed", Some(&text));
        let done = json!({"output_index": 0, "item": item});
        self.push(out, "response.output_item.done", done);
        let response = self.answer.response("completed", vec![item], Some(usage));
        self.push(out, "response.completed", json!({"response": response}));
        let turn = std::mem::replace(&mut self.turn, empty_turn());
        keep(&self.state, &self.answer.id, turn, &text);
    }

    fn fail(&mut self, error: &ApiError, out: &mut VecDeque<Bytes>) {
        let fields = json!({"code": null, "message": error.message(), "param": null});
        self.push(out, "error", fields);
    }
}

fn empty_turn() -> Turn {
    Turn {
        conversation: Vec::new(),
        bytes: 0,
        store: false,
        echo: Map::new(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn answer() -> Answer {
        let mut echo = Map::new();
        echo.insert("instructions".into(), json!("Be brief."));
        echo.insert("metadata".into(), Value::Null);
        Answer {
            id: "resp_1".into(),
            message_id: "msg_1".into(),
            created: 7,
            model: "m".into(),
            echo,
        }
    }

    #[test]
    fn a_response_carries_its_output_usage_and_echoes() {
        let a = answer();
        let usage = Usage {
            prompt_tokens: 40,
            completion_tokens: 3,
            cached_tokens: 32,
        };
        let body = a.response(
            "completed",
            vec![a.message("completed", Some("abc"))],
            Some(&usage),
        );
        assert_eq!(body["object"], "response");
        assert_eq!(body["status"], "completed");
        assert_eq!(body["instructions"], "Be brief.");
        assert_eq!(body["metadata"], json!({}));
        assert_eq!(
            body["output"],
            json!([{"type": "message", "id": "msg_1", "status": "completed", "role": "assistant",
                "content": [{"type": "output_text", "text": "abc", "annotations": []}]}])
        );
        assert_eq!(
            body["usage"],
            json!({"input_tokens": 40, "input_tokens_details": {"cached_tokens": 32},
                "output_tokens": 3, "output_tokens_details": {"reasoning_tokens": 0},
                "total_tokens": 43})
        );
        let pending = a.response("in_progress", Vec::new(), None);
        assert_eq!(
            (pending["usage"].clone(), pending["output"].clone()),
            (Value::Null, json!([]))
        );
    }
}
