//! OpenAI's Responses API (`POST /v1/responses`): a body read for routing,
//! and its conversion to chat messages, shared with the mock engine.
//!
//! Engines serve this API by turning the body into chat `messages` and
//! rendering them through the model's chat template exactly as
//! `/v1/chat/completions` does. The router ([`parse_responses`]) and
//! kvroute-mocker ([`Conversation`]) convert here and nowhere else, so a
//! repeated `instructions` renders to the same tokens on both sides and hits
//! the cache.
//!
//! The conversion, item by item:
//! * `instructions` (a string) → the first message, `system`;
//! * `input` a string → one `user` message; a list of items:
//!   * a message (`"type": "message"`, or no `type`) with role `user`,
//!     `system`, `developer` (→ `system`) or `assistant`, its content a
//!     string or parts: `input_text`, `output_text` and `refusal` → `text`
//!     parts; `input_image` with an `image_url` (a URL or a data URL) → an
//!     `image_url` part. An `input_image` given only by `file_id` and parts of
//!     other types (`input_file`, `input_audio`, …) hold nothing the router
//!     can render: they are skipped, so the prompt is routed on the rest;
//!   * `function_call` → an `assistant` message with one `tool_calls` entry
//!     (`id` = `call_id`, `arguments` as given), as vLLM converts it;
//!   * `function_call_output` → a `tool` message (`tool_call_id` = `call_id`,
//!     `content` = `output`);
//!   * `reasoning`, `item_reference` and every other item type are not part
//!     of the rendered prompt: skipped.
//!
//! `previous_response_id` continues a stored conversation that only the
//! engine which produced that response holds: the router renders the new
//! turn alone and sends it to that engine ([`RoutingRequest::previous_response_id`]);
//! the engine renders `instructions` (of the new request only, as OpenAI
//! does), then the stored conversation, then the new `input`
//! ([`Conversation::messages`]).

use serde_json::{json, Map, Value};

use crate::body::{bad, ParseError, RoutingRequest, TextPrompt};

/// Reads a `/v1/responses` body: `model`, `stream`, `max_output_tokens`,
/// `previous_response_id`, the client's `mm_hashes`, and the prompt as chat
/// messages. Responses streams always end with their usage
/// (`response.completed`), so `include_usage` is set.
pub fn parse_responses(body: &[u8]) -> Result<RoutingRequest, ParseError> {
    let obj = object(body)?;
    let conversation = Conversation::read(&obj)?;
    let previous_response_id = opt_string(&obj, "previous_response_id")?;
    let messages = conversation.messages(&[]);
    if messages.is_empty() && previous_response_id.is_none() {
        return Err(bad("`input` holds no message to render"));
    }
    Ok(RoutingRequest {
        model: opt_string(&obj, "model")?,
        stream: flag(&obj, "stream")?,
        max_tokens: positive(&obj, "max_output_tokens")?,
        mm_hashes: client_mm_hashes(&obj),
        include_usage: true,
        // A continuation with no new message renders only on its engine.
        text: (!messages.is_empty()).then(|| TextPrompt::Chat(Value::Array(messages))),
        previous_response_id,
        handoff_field: crate::body::handoff_field_in(&obj),
        engine_priority: crate::body::priority_value(obj.get("priority"))?,
        ..RoutingRequest::default()
    })
}

/// The chat messages of a Responses body (an object) without a stored
/// conversation: `instructions`, then `input`.
pub fn chat_messages(body: &Value) -> Result<Value, ParseError> {
    let obj = body
        .as_object()
        .ok_or_else(|| bad("the body must be a JSON object"))?;
    Ok(Value::Array(Conversation::read(obj)?.messages(&[])))
}

/// A Responses request's prompt as chat messages, split where a
/// continuation inserts the stored conversation.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Conversation {
    /// `instructions` as a `system` message, if given.
    pub instructions: Option<Value>,
    /// The `input` items as chat messages, in order.
    pub input: Vec<Value>,
}

impl Conversation {
    /// Reads `instructions` and `input` of a body; every error names the
    /// field (`input[2].content[0].image_url`).
    pub fn read(body: &Map<String, Value>) -> Result<Self, ParseError> {
        let instructions = match body.get("instructions") {
            None | Some(Value::Null) => None,
            Some(Value::String(s)) => Some(json!({"role": "system", "content": s})),
            Some(_) => return Err(bad("`instructions` must be a string")),
        };
        let input = match body.get("input") {
            None | Some(Value::Null) => Vec::new(),
            Some(Value::String(s)) => vec![json!({"role": "user", "content": s})],
            Some(Value::Array(items)) => {
                let mut messages = Vec::with_capacity(items.len());
                for (i, item) in items.iter().enumerate() {
                    if let Some(m) = item_message(item, &format!("input[{i}]"))? {
                        messages.push(m);
                    }
                }
                messages
            }
            Some(_) => return Err(bad("`input` must be a string or a list of items")),
        };
        Ok(Conversation {
            instructions,
            input,
        })
    }

    /// The messages to render: the instructions, then `history` (a stored
    /// conversation, without its own instructions), then the input.
    pub fn messages(&self, history: &[Value]) -> Vec<Value> {
        let mut out = Vec::with_capacity(1 + history.len() + self.input.len());
        out.extend(self.instructions.iter().cloned());
        out.extend(history.iter().cloned());
        out.extend(self.input.iter().cloned());
        out
    }
}

/// One `input` item as a chat message; `None` for items not rendered.
fn item_message(item: &Value, at: &str) -> Result<Option<Value>, ParseError> {
    let Value::Object(o) = item else {
        return Err(bad(format!("`{at}` must be an object")));
    };
    match o.get("type") {
        None | Some(Value::Null) => message(o, at).map(Some),
        Some(Value::String(kind)) => match kind.as_str() {
            "message" => message(o, at).map(Some),
            "function_call" => {
                let call = json!({
                    "id": string_at(o, "call_id", at)?,
                    "type": "function",
                    "function": {
                        "name": string_at(o, "name", at)?,
                        "arguments": string_at(o, "arguments", at)?,
                    },
                });
                Ok(Some(json!({"role": "assistant", "tool_calls": [call]})))
            }
            "function_call_output" => {
                let call_id = string_at(o, "call_id", at)?;
                let content = match o.get("output") {
                    Some(Value::String(s)) => Value::String(s.clone()),
                    Some(Value::Array(parts)) => parts_of(parts, &format!("{at}.output"))?,
                    _ => {
                        return Err(bad(format!(
                            "`{at}.output` must be a string or a list of parts"
                        )))
                    }
                };
                Ok(Some(
                    json!({"role": "tool", "content": content, "tool_call_id": call_id}),
                ))
            }
            _ => Ok(None),
        },
        Some(_) => Err(bad(format!("`{at}.type` must be a string"))),
    }
}

/// A message item: its role (`developer` read as `system`) and content.
fn message(o: &Map<String, Value>, at: &str) -> Result<Value, ParseError> {
    let role = match o.get("role").and_then(Value::as_str) {
        Some(r @ ("user" | "system" | "assistant")) => r,
        Some("developer") => "system",
        _ => {
            return Err(bad(format!(
                "`{at}.role` must be one of user, system, developer, assistant"
            )))
        }
    };
    let content = match o.get("content") {
        Some(Value::String(s)) => Value::String(s.clone()),
        Some(Value::Array(parts)) => parts_of(parts, &format!("{at}.content"))?,
        _ => {
            return Err(bad(format!(
                "`{at}.content` must be a string or a list of parts"
            )))
        }
    };
    Ok(json!({"role": role, "content": content}))
}

/// Content parts as chat parts; parts that hold nothing renderable are skipped.
fn parts_of(parts: &[Value], at: &str) -> Result<Value, ParseError> {
    let mut out = Vec::with_capacity(parts.len());
    for (j, part) in parts.iter().enumerate() {
        let at = format!("{at}[{j}]");
        let Value::Object(p) = part else {
            return Err(bad(format!("`{at}` must be an object")));
        };
        let kind = p
            .get("type")
            .and_then(Value::as_str)
            .ok_or_else(|| bad(format!("`{at}.type` must be a string")))?;
        match kind {
            "input_text" | "output_text" => {
                out.push(json!({"type": "text", "text": string_at(p, "text", &at)?}));
            }
            "refusal" => out.push(json!({"type": "text", "text": string_at(p, "refusal", &at)?})),
            "input_image" => match p.get("image_url") {
                Some(Value::String(url)) => {
                    out.push(json!({"type": "image_url", "image_url": {"url": url}}));
                }
                None | Some(Value::Null) if p.get("file_id").is_some_and(Value::is_string) => {}
                _ => return Err(bad(format!("`{at}.image_url` must be a string"))),
            },
            _ => {}
        }
    }
    Ok(Value::Array(out))
}

/// The body as a JSON object.
pub(crate) fn object(body: &[u8]) -> Result<Map<String, Value>, ParseError> {
    match serde_json::from_slice(body) {
        Ok(Value::Object(obj)) => Ok(obj),
        Ok(_) => Err(bad("the body must be a JSON object")),
        Err(e) => Err(bad(format!("invalid JSON body: {e}"))),
    }
}

/// A string field of an item, named in the error as `{at}.{key}`.
pub(crate) fn string_at(o: &Map<String, Value>, key: &str, at: &str) -> Result<String, ParseError> {
    match o.get(key) {
        Some(Value::String(s)) => Ok(s.clone()),
        _ => Err(bad(format!("`{at}.{key}` must be a string"))),
    }
}

/// An optional top-level string (`null` is absent).
pub(crate) fn opt_string(
    obj: &Map<String, Value>,
    key: &str,
) -> Result<Option<String>, ParseError> {
    match obj.get(key) {
        None | Some(Value::Null) => Ok(None),
        Some(Value::String(s)) => Ok(Some(s.clone())),
        Some(_) => Err(bad(format!("`{key}` must be a string"))),
    }
}

/// An optional top-level boolean (absent or `null`: false).
pub(crate) fn flag(obj: &Map<String, Value>, key: &str) -> Result<bool, ParseError> {
    match obj.get(key) {
        None | Some(Value::Null) => Ok(false),
        Some(Value::Bool(b)) => Ok(*b),
        Some(_) => Err(bad(format!("`{key}` must be a boolean"))),
    }
}

/// An optional top-level integer of at least 1.
pub(crate) fn positive(obj: &Map<String, Value>, key: &str) -> Result<Option<u64>, ParseError> {
    match obj.get(key) {
        None | Some(Value::Null) => Ok(None),
        Some(v) => match v.as_u64() {
            Some(n) if n >= 1 => Ok(Some(n)),
            _ => Err(bad(format!("`{key}` must be a positive integer"))),
        },
    }
}

/// The client's own `mm_hashes`, read leniently (the engine validates them).
pub(crate) fn client_mm_hashes(obj: &Map<String, Value>) -> Option<Value> {
    obj.get("mm_hashes").filter(|v| !v.is_null()).cloned()
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::Prompt;

    fn parse(v: Value) -> Result<RoutingRequest, ParseError> {
        parse_responses(v.to_string().as_bytes())
    }

    fn messages_of(v: Value) -> Value {
        match parse(v).expect("valid").text {
            Some(TextPrompt::Chat(m)) => m,
            other => panic!("not a chat prompt: {other:?}"),
        }
    }

    #[test]
    fn a_string_input_with_instructions_is_a_system_and_a_user_message() {
        let r = parse(
            json!({"model": "m", "instructions": "Be brief.", "input": "Hi",
            "stream": true, "max_output_tokens": 7}),
        )
        .expect("valid");
        assert_eq!(
            r.text,
            Some(TextPrompt::Chat(json!([
                {"role": "system", "content": "Be brief."},
                {"role": "user", "content": "Hi"},
            ])))
        );
        assert_eq!(r.model.as_deref(), Some("m"));
        assert!(r.stream && r.include_usage);
        assert_eq!(r.max_tokens, Some(7));
        assert_eq!(r.previous_response_id, None);
        let plain = parse(json!({"input": "Hi"})).expect("valid");
        assert!(!plain.stream && plain.include_usage && plain.max_tokens.is_none());
    }

    #[test]
    fn message_items_keep_their_roles_and_parts() {
        let m = messages_of(json!({"input": [
            {"role": "developer", "content": "rules"},
            {"type": "message", "role": "user", "content": [
                {"type": "input_text", "text": "look"},
                {"type": "input_image", "image_url": "data:image/png;base64,aGVsbG8=", "detail": "auto"},
                {"type": "input_image", "file_id": "file-1"},
                {"type": "input_file", "file_id": "file-2"},
            ]},
            {"type": "message", "role": "assistant", "id": "msg_1", "status": "completed",
             "content": [{"type": "output_text", "text": "seen", "annotations": []},
                         {"type": "refusal", "refusal": "no"}]},
        ]}));
        assert_eq!(
            m,
            json!([
                {"role": "system", "content": "rules"},
                {"role": "user", "content": [
                    {"type": "text", "text": "look"},
                    {"type": "image_url", "image_url": {"url": "data:image/png;base64,aGVsbG8="}},
                ]},
                {"role": "assistant", "content": [
                    {"type": "text", "text": "seen"}, {"type": "text", "text": "no"},
                ]},
            ])
        );
        // What routing reads renders as a chat does.
        let p = Prompt::chat(Some(&m)).expect("renders");
        assert_eq!(p.image_count(), 1);
    }

    #[test]
    fn function_calls_become_tool_calls_and_outputs_tool_messages() {
        let m = messages_of(json!({"input": [
            {"role": "user", "content": "weather?"},
            {"type": "reasoning", "id": "rs_1", "summary": []},
            {"type": "function_call", "call_id": "call_1", "name": "get", "arguments": "{\"city\":\"Oslo\"}"},
            {"type": "function_call_output", "call_id": "call_1", "output": "rain"},
            {"type": "function_call_output", "call_id": "call_2",
             "output": [{"type": "input_text", "text": "sun"}]},
            {"type": "item_reference", "id": "x"},
        ]}));
        assert_eq!(
            m,
            json!([
                {"role": "user", "content": "weather?"},
                {"role": "assistant", "tool_calls": [{"id": "call_1", "type": "function",
                    "function": {"name": "get", "arguments": "{\"city\":\"Oslo\"}"}}]},
                {"role": "tool", "content": "rain", "tool_call_id": "call_1"},
                {"role": "tool", "content": [{"type": "text", "text": "sun"}], "tool_call_id": "call_2"},
            ])
        );
        assert!(Prompt::chat(Some(&m)).is_ok());
    }

    #[test]
    fn a_continuation_names_its_previous_response() {
        let r =
            parse(json!({"previous_response_id": "resp_1", "input": "and then?"})).expect("valid");
        assert_eq!(r.previous_response_id.as_deref(), Some("resp_1"));
        assert!(r.text.is_some());
        // Nothing new to render: routed by the previous response alone.
        let r = parse(json!({"previous_response_id": "resp_1", "input": []})).expect("valid");
        assert_eq!(r.text, None);
        // The engine inserts the stored conversation after the new instructions.
        let body = json!({"instructions": "new", "input": "q2"});
        let c = Conversation::read(body.as_object().expect("object")).expect("valid");
        let history = [
            json!({"role": "user", "content": "q1"}),
            json!({"role": "assistant", "content": "a1"}),
        ];
        assert_eq!(
            Value::Array(c.messages(&history)),
            json!([
                {"role": "system", "content": "new"},
                {"role": "user", "content": "q1"},
                {"role": "assistant", "content": "a1"},
                {"role": "user", "content": "q2"},
            ])
        );
        assert_eq!(
            chat_messages(&body).expect("valid"),
            json!([{"role": "system", "content": "new"}, {"role": "user", "content": "q2"}])
        );
    }

    #[test]
    fn client_mm_hashes_are_noticed() {
        let r = parse(json!({"input": "x", "mm_hashes": [1]})).expect("valid");
        assert_eq!(r.mm_hashes, Some(json!([1])));
        let r = parse(json!({"input": "x", "mm_hashes": null})).expect("valid");
        assert_eq!(r.mm_hashes, None);
    }

    #[test]
    fn malformed_bodies_name_the_field() {
        for (body, field) in [
            (json!([1]), "must be a JSON object"),
            (json!({}), "`input` holds no message"),
            (json!({"input": []}), "`input` holds no message"),
            (json!({"input": 3}), "`input` must be"),
            (
                json!({"input": "x", "instructions": 1}),
                "`instructions` must be",
            ),
            (json!({"input": "x", "model": 1}), "`model` must be"),
            (json!({"input": "x", "stream": "yes"}), "`stream` must be"),
            (
                json!({"input": "x", "max_output_tokens": 0}),
                "`max_output_tokens` must be",
            ),
            (
                json!({"input": "x", "max_output_tokens": "9"}),
                "`max_output_tokens` must be",
            ),
            (
                json!({"input": "x", "previous_response_id": 5}),
                "`previous_response_id` must be",
            ),
            (json!({"input": [1]}), "`input[0]` must be an object"),
            (json!({"input": [{"type": 1}]}), "`input[0].type` must be"),
            (
                json!({"input": [{"role": "tool", "content": "x"}]}),
                "`input[0].role` must be",
            ),
            (
                json!({"input": [{"role": "user"}]}),
                "`input[0].content` must be",
            ),
            (
                json!({"input": [{"role": "user", "content": [1]}]}),
                "`input[0].content[0]` must be",
            ),
            (
                json!({"input": [{"role": "user", "content": [{}]}]}),
                "`input[0].content[0].type`",
            ),
            (
                json!({"input": [{"role": "user", "content": [{"type": "input_text"}]}]}),
                "`input[0].content[0].text` must be",
            ),
            (
                json!({"input": [{"role": "user", "content": [{"type": "input_image"}]}]}),
                "`input[0].content[0].image_url` must be",
            ),
            (
                json!({"input": [{"type": "function_call", "name": "f", "arguments": "{}"}]}),
                "`input[0].call_id` must be",
            ),
            (
                json!({"input": [{"type": "function_call", "call_id": "c", "name": "f", "arguments": {}}]}),
                "`input[0].arguments` must be",
            ),
            (
                json!({"input": [{"type": "function_call_output", "call_id": "c"}]}),
                "`input[0].output` must be",
            ),
        ] {
            let e = parse(body.clone()).expect_err(field);
            assert!(e.0.contains(field), "{e:?} for {body}");
        }
        assert!(parse_responses(b"{")
            .expect_err("bad")
            .0
            .contains("invalid JSON"));
        assert!(chat_messages(&json!("x")).is_err());
    }
}
