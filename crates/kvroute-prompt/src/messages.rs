//! Anthropic's Messages API (`POST /v1/messages`): a body read for routing,
//! and its conversion to chat messages, shared with the mock engine.
//!
//! vLLM serves this API by converting the body into an OpenAI chat request
//! and rendering it as `/v1/chat/completions` does; the router
//! ([`parse_messages`]) and kvroute-mocker ([`chat_messages`]) convert here
//! and nowhere else, so both render the same tokens. The conversion follows
//! vLLM's (`vllm/entrypoints/anthropic/serving_messages.py`):
//! * `system`, a string or a list of `text` blocks (joined without a
//!   separator) → the first message, `system`; an empty string or list
//!   adds none;
//! * each message (role `user` or `assistant`) with string content is kept;
//!   with blocks: `text` → a text part (empty ones dropped); `image` → an
//!   `image_url` part, its `source` a `base64` one as a
//!   `data:<media_type>;base64,<data>` URL or a `url` one as its URL (other
//!   sources, e.g. `file`, are skipped); `tool_use` → an entry of the
//!   message's `tool_calls`, `arguments` its `input` written as Python's
//!   `json.dumps` writes it ([`python_json`]); `tool_result` in a user
//!   message → a `tool` message placed before it (`tool_call_id` =
//!   `tool_use_id`, `content` its string or its text blocks joined), in an
//!   assistant message → the text part `Tool result: …`; `thinking` and
//!   every other block type are skipped. A single text part becomes the
//!   string content; a message left with neither content nor tool calls is
//!   dropped.
//!
//! Where vLLM's converter is plainly wrong this one does what the API means
//! (and the mock engine does the same): vLLM takes an image's raw `data`
//! (no `data:` prefix, and nothing for a `url` source), a `tool_result`'s
//! `id` instead of its `tool_use_id`, and Python's `str()` of a list of
//! result blocks.

use serde_json::{json, Map, Value};

use crate::body::{bad, ParseError, RoutingRequest, TextPrompt};
use crate::responses::{client_mm_hashes, flag, object, opt_string, string_at};

/// Reads a `/v1/messages` body: `model`, `max_tokens` (required, as
/// Anthropic requires it), `stream`, the client's `mm_hashes`, and the
/// prompt as chat messages. Streams carry their usage in `message_delta`,
/// so `include_usage` is set.
pub fn parse_messages(body: &[u8]) -> Result<RoutingRequest, ParseError> {
    read(&object(body)?)
}

/// [`parse_messages`] of a body already parsed (the mock engine reads its
/// bodies with this very function).
pub fn read(obj: &Map<String, Value>) -> Result<RoutingRequest, ParseError> {
    let messages = convert(obj)?;
    let max_tokens = match obj.get("max_tokens") {
        None | Some(Value::Null) => return Err(bad("`max_tokens` is required")),
        Some(v) => match v.as_u64() {
            Some(n) if n >= 1 => n,
            _ => return Err(bad("`max_tokens` must be a positive integer")),
        },
    };
    Ok(RoutingRequest {
        model: opt_string(obj, "model")?,
        stream: flag(obj, "stream")?,
        max_tokens: Some(max_tokens),
        mm_hashes: client_mm_hashes(obj),
        include_usage: true,
        text: Some(TextPrompt::Chat(messages)),
        handoff_field: crate::body::handoff_field_in(obj),
        engine_priority: crate::body::priority_value(obj.get("priority"))?,
        ..RoutingRequest::default()
    })
}

/// The chat messages of a Messages body (an object): `system`, then each
/// message converted as the module says.
pub fn chat_messages(body: &Value) -> Result<Value, ParseError> {
    let obj = body
        .as_object()
        .ok_or_else(|| bad("the body must be a JSON object"))?;
    convert(obj)
}

fn convert(obj: &Map<String, Value>) -> Result<Value, ParseError> {
    let mut out = Vec::new();
    match obj.get("system") {
        None | Some(Value::Null) => {}
        Some(Value::String(s)) if s.is_empty() => {}
        Some(Value::String(s)) => out.push(json!({"role": "system", "content": s})),
        Some(Value::Array(blocks)) if blocks.is_empty() => {}
        Some(Value::Array(blocks)) => {
            let mut text = String::new();
            for (i, block) in blocks.iter().enumerate() {
                let at = format!("system[{i}]");
                let b = block_object(block, &at)?;
                if kind(b, &at)? == "text" {
                    text.push_str(&string_at(b, "text", &at)?);
                }
            }
            out.push(json!({"role": "system", "content": text}));
        }
        Some(_) => return Err(bad("`system` must be a string or a list of text blocks")),
    }
    let list = match obj.get("messages") {
        None | Some(Value::Null) => return Err(bad("`messages` is required")),
        Some(Value::Array(list)) if list.is_empty() => {
            return Err(bad("`messages` must not be empty"))
        }
        Some(Value::Array(list)) => list,
        Some(_) => return Err(bad("`messages` must be a list")),
    };
    for (i, m) in list.iter().enumerate() {
        message(m, &format!("messages[{i}]"), &mut out)?;
    }
    if out.is_empty() {
        return Err(bad("`messages` hold nothing to render"));
    }
    Ok(Value::Array(out))
}

/// Appends one message (and the `tool` messages of its results) to `out`.
fn message(m: &Value, at: &str, out: &mut Vec<Value>) -> Result<(), ParseError> {
    let Value::Object(m) = m else {
        return Err(bad(format!("`{at}` must be an object")));
    };
    let role = match m.get("role").and_then(Value::as_str) {
        Some(r @ ("user" | "assistant")) => r,
        _ => return Err(bad(format!("`{at}.role` must be user or assistant"))),
    };
    let blocks = match m.get("content") {
        Some(Value::String(s)) => {
            out.push(json!({"role": role, "content": s}));
            return Ok(());
        }
        Some(Value::Array(blocks)) if blocks.is_empty() => {
            return Err(bad(format!("`{at}.content` must not be empty")))
        }
        Some(Value::Array(blocks)) => blocks,
        _ => {
            return Err(bad(format!(
                "`{at}.content` must be a string or a list of blocks"
            )))
        }
    };
    let mut parts = Vec::new();
    let mut tool_calls = Vec::new();
    for (j, block) in blocks.iter().enumerate() {
        let at = format!("{at}.content[{j}]");
        let b = block_object(block, &at)?;
        match kind(b, &at)? {
            "text" => {
                let text = string_at(b, "text", &at)?;
                if !text.is_empty() {
                    parts.push(json!({"type": "text", "text": text}));
                }
            }
            "image" => parts.extend(image(b, &at)?),
            "tool_use" => tool_calls.push(tool_call(b, &at)?),
            "tool_result" => {
                let id = optional_string(b, "tool_use_id", &at)?;
                let text = tool_result_text(b, &at)?;
                if role == "user" {
                    out.push(json!({"role": "tool", "tool_call_id": id, "content": text}));
                } else {
                    parts.push(json!({"type": "text", "text": format!("Tool result: {text}")}));
                }
            }
            _ => {}
        }
    }
    let mut converted = Map::new();
    converted.insert("role".into(), Value::from(role));
    match parts.as_slice() {
        [] if tool_calls.is_empty() => return Ok(()),
        [] => {}
        [only] if only["type"] == "text" => {
            converted.insert("content".into(), only["text"].clone());
        }
        _ => {
            converted.insert("content".into(), Value::Array(parts));
        }
    }
    if !tool_calls.is_empty() {
        converted.insert("tool_calls".into(), Value::Array(tool_calls));
    }
    out.push(Value::Object(converted));
    Ok(())
}

/// An `image` block's `image_url` part; `None` for sources without a URL.
fn image(b: &Map<String, Value>, at: &str) -> Result<Option<Value>, ParseError> {
    let at = format!("{at}.source");
    let source = block_object(b.get("source").unwrap_or(&Value::Null), &at)?;
    let url = match kind(source, &at)? {
        "base64" => format!(
            "data:{};base64,{}",
            string_at(source, "media_type", &at)?,
            string_at(source, "data", &at)?
        ),
        "url" => string_at(source, "url", &at)?,
        _ => return Ok(None),
    };
    Ok(Some(
        json!({"type": "image_url", "image_url": {"url": url}}),
    ))
}

/// A `tool_use` block as an OpenAI tool call.
fn tool_call(b: &Map<String, Value>, at: &str) -> Result<Value, ParseError> {
    let arguments = match b.get("input") {
        None | Some(Value::Null) => "{}".to_owned(),
        Some(input @ Value::Object(_)) => python_json(input),
        Some(_) => return Err(bad(format!("`{at}.input` must be an object"))),
    };
    Ok(json!({
        "id": optional_string(b, "id", at)?,
        "type": "function",
        "function": {"name": optional_string(b, "name", at)?, "arguments": arguments},
    }))
}

/// A `tool_result` block's content as text: a string, or its text blocks joined.
fn tool_result_text(b: &Map<String, Value>, at: &str) -> Result<String, ParseError> {
    match b.get("content") {
        None | Some(Value::Null) => Ok(String::new()),
        Some(Value::String(s)) => Ok(s.clone()),
        Some(Value::Array(blocks)) => {
            let mut text = String::new();
            for (k, block) in blocks.iter().enumerate() {
                let at = format!("{at}.content[{k}]");
                let inner = block_object(block, &at)?;
                if kind(inner, &at)? == "text" {
                    text.push_str(&string_at(inner, "text", &at)?);
                }
            }
            Ok(text)
        }
        Some(_) => Err(bad(format!(
            "`{at}.content` must be a string or a list of blocks"
        ))),
    }
}

fn block_object<'a>(v: &'a Value, at: &str) -> Result<&'a Map<String, Value>, ParseError> {
    v.as_object()
        .ok_or_else(|| bad(format!("`{at}` must be an object")))
}

fn kind<'a>(b: &'a Map<String, Value>, at: &str) -> Result<&'a str, ParseError> {
    b.get("type")
        .and_then(Value::as_str)
        .ok_or_else(|| bad(format!("`{at}.type` must be a string")))
}

/// A string field that may be absent (then empty, as vLLM fills it).
fn optional_string(b: &Map<String, Value>, key: &str, at: &str) -> Result<String, ParseError> {
    match b.get(key) {
        None | Some(Value::Null) => Ok(String::new()),
        Some(Value::String(s)) => Ok(s.clone()),
        Some(_) => Err(bad(format!("`{at}.{key}` must be a string"))),
    }
}

/// `value` as Python's `json.dumps(value)` writes it with its defaults
/// (`", "` and `": "` separators, every character past ASCII escaped as
/// `\uXXXX`): the `arguments` vLLM gives a converted `tool_use`, so its
/// rendering carries the same text. Floats are written as serde writes them
/// (Python's `repr` differs only in the exponent's form: `1e+16`).
pub fn python_json(value: &Value) -> String {
    let mut out = String::new();
    write_python_json(value, &mut out);
    out
}

fn write_python_json(value: &Value, out: &mut String) {
    match value {
        Value::Null | Value::Bool(_) | Value::Number(_) => out.push_str(&value.to_string()),
        Value::String(s) => write_python_string(s, out),
        Value::Array(items) => {
            out.push('[');
            for (i, item) in items.iter().enumerate() {
                if i > 0 {
                    out.push_str(", ");
                }
                write_python_json(item, out);
            }
            out.push(']');
        }
        Value::Object(map) => {
            out.push('{');
            for (i, (k, v)) in map.iter().enumerate() {
                if i > 0 {
                    out.push_str(", ");
                }
                write_python_string(k, out);
                out.push_str(": ");
                write_python_json(v, out);
            }
            out.push('}');
        }
    }
}

/// A string as `json.dumps` quotes it (`ensure_ascii`): printable ASCII
/// as is, the short escapes, every other UTF-16 unit as `\uxxxx`.
fn write_python_string(s: &str, out: &mut String) {
    out.push('"');
    for c in s.chars() {
        match c {
            '"' => out.push_str("\\\""),
            '\\' => out.push_str("\\\\"),
            '\n' => out.push_str("\\n"),
            '\r' => out.push_str("\\r"),
            '\t' => out.push_str("\\t"),
            '\u{8}' => out.push_str("\\b"),
            '\u{c}' => out.push_str("\\f"),
            ' '..='~' => out.push(c),
            _ => {
                let mut units = [0u16; 2];
                for unit in c.encode_utf16(&mut units) {
                    out.push_str(&format!("\\u{unit:04x}"));
                }
            }
        }
    }
    out.push('"');
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::Prompt;

    fn parse(v: Value) -> Result<RoutingRequest, ParseError> {
        parse_messages(v.to_string().as_bytes())
    }

    fn messages_of(v: Value) -> Value {
        match parse(v).expect("valid").text {
            Some(TextPrompt::Chat(m)) => m,
            other => panic!("not a chat prompt: {other:?}"),
        }
    }

    #[test]
    fn system_and_string_messages_read_as_chat() {
        let r = parse(
            json!({"model": "m", "max_tokens": 9, "stream": true, "system": "Be brief.",
            "messages": [{"role": "user", "content": "Hi"}]}),
        )
        .expect("valid");
        assert_eq!(
            r.text,
            Some(TextPrompt::Chat(json!([
                {"role": "system", "content": "Be brief."},
                {"role": "user", "content": "Hi"},
            ])))
        );
        assert_eq!((r.model.as_deref(), r.max_tokens), (Some("m"), Some(9)));
        assert!(r.stream && r.include_usage && r.previous_response_id.is_none());
        // System blocks are joined; an empty system adds nothing.
        let m = messages_of(json!({"max_tokens": 1, "system": [
            {"type": "text", "text": "a", "cache_control": {"type": "ephemeral"}},
            {"type": "text", "text": "b"}],
            "messages": [{"role": "user", "content": "x"}]}));
        assert_eq!(m[0], json!({"role": "system", "content": "ab"}));
        let m = messages_of(json!({"max_tokens": 1, "system": "",
            "messages": [{"role": "user", "content": "x"}]}));
        assert_eq!(m, json!([{"role": "user", "content": "x"}]));
    }

    #[test]
    fn blocks_become_parts_tool_calls_and_tool_messages() {
        let m = messages_of(json!({"max_tokens": 1, "messages": [
            {"role": "user", "content": [
                {"type": "text", "text": "look"},
                {"type": "text", "text": ""},
                {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": "aGVsbG8="}},
                {"type": "image", "source": {"type": "url", "url": "https://x.invalid/a.png"}},
                {"type": "image", "source": {"type": "file", "file_id": "f"}},
            ]},
            {"role": "assistant", "content": [
                {"type": "thinking", "thinking": "hmm", "signature": "s"},
                {"type": "text", "text": "calling"},
                {"type": "tool_use", "id": "toolu_1", "name": "get", "input": {"city": "Tromsø", "n": [1, 2.5]}},
            ]},
            {"role": "user", "content": [
                {"type": "tool_result", "tool_use_id": "toolu_1", "content": [{"type": "text", "text": "rain"}]},
                {"type": "tool_result", "tool_use_id": "toolu_2", "content": "sun"},
            ]},
            {"role": "user", "content": [{"type": "text", "text": "thanks"}]},
        ]}));
        assert_eq!(
            m,
            json!([
                {"role": "user", "content": [
                    {"type": "text", "text": "look"},
                    {"type": "image_url", "image_url": {"url": "data:image/png;base64,aGVsbG8="}},
                    {"type": "image_url", "image_url": {"url": "https://x.invalid/a.png"}},
                ]},
                {"role": "assistant", "content": "calling", "tool_calls": [{"id": "toolu_1",
                    "type": "function", "function": {"name": "get",
                    "arguments": "{\"city\": \"Troms\\u00f8\", \"n\": [1, 2.5]}"}}]},
                {"role": "tool", "tool_call_id": "toolu_1", "content": "rain"},
                {"role": "tool", "tool_call_id": "toolu_2", "content": "sun"},
                {"role": "user", "content": "thanks"},
            ])
        );
        assert_eq!(Prompt::chat(Some(&m)).expect("renders").image_count(), 2);
        let m = messages_of(json!({"max_tokens": 1, "messages": [
            {"role": "assistant", "content": [{"type": "tool_result", "content": "x"},
                                              {"type": "tool_use", "name": "f"}]},
        ]}));
        assert_eq!(
            m,
            json!([{"role": "assistant", "content": "Tool result: x", "tool_calls": [
                {"id": "", "type": "function", "function": {"name": "f", "arguments": "{}"}}]}])
        );
    }

    #[test]
    fn python_json_writes_as_json_dumps_does() {
        let v = json!({"b": [1, -2, 0.5, true, null], "a": "q\"\\\n\t\u{7f}é😀", "e": {}, "l": []});
        assert_eq!(
            python_json(&v),
            r#"{"b": [1, -2, 0.5, true, null], "a": "q\"\\\n\t\u007f\u00e9\ud83d\ude00", "e": {}, "l": []}"#
        );
    }

    #[test]
    fn malformed_bodies_name_the_field() {
        let user = json!([{"role": "user", "content": "x"}]);
        for (body, field) in [
            (json!([1]), "must be a JSON object"),
            (json!({"messages": user}), "`max_tokens` is required"),
            (
                json!({"messages": user, "max_tokens": 0}),
                "`max_tokens` must be",
            ),
            (
                json!({"messages": user, "max_tokens": "1"}),
                "`max_tokens` must be",
            ),
            (json!({"max_tokens": 1}), "`messages` is required"),
            (
                json!({"max_tokens": 1, "messages": []}),
                "`messages` must not be empty",
            ),
            (
                json!({"max_tokens": 1, "messages": {}}),
                "`messages` must be a list",
            ),
            (
                json!({"max_tokens": 1, "messages": user, "system": 3}),
                "`system` must be",
            ),
            (
                json!({"max_tokens": 1, "messages": user, "system": [1]}),
                "`system[0]` must be",
            ),
            (
                json!({"max_tokens": 1, "messages": user, "system": [{"type": "text"}]}),
                "`system[0].text`",
            ),
            (
                json!({"max_tokens": 1, "messages": user, "model": 1}),
                "`model` must be",
            ),
            (
                json!({"max_tokens": 1, "messages": user, "stream": 1}),
                "`stream` must be",
            ),
            (
                json!({"max_tokens": 1, "messages": [1]}),
                "`messages[0]` must be an object",
            ),
            (
                json!({"max_tokens": 1, "messages": [{"role": "system", "content": "x"}]}),
                "`messages[0].role`",
            ),
            (
                json!({"max_tokens": 1, "messages": [{"role": "user"}]}),
                "`messages[0].content` must be",
            ),
            (
                json!({"max_tokens": 1, "messages": [{"role": "user", "content": []}]}),
                "must not be empty",
            ),
            (
                json!({"max_tokens": 1, "messages": [{"role": "user", "content": [{}]}]}),
                "`messages[0].content[0].type`",
            ),
            (
                json!({"max_tokens": 1, "messages": [{"role": "user", "content": [{"type": "image"}]}]}),
                "`messages[0].content[0].source` must be an object",
            ),
            (
                json!({"max_tokens": 1, "messages": [{"role": "user", "content": [{"type": "image", "source": {"type": "base64", "data": "x"}}]}]}),
                "`messages[0].content[0].source.media_type` must be",
            ),
            (
                json!({"max_tokens": 1, "messages": [{"role": "assistant", "content": [{"type": "tool_use", "input": 1}]}]}),
                "`messages[0].content[0].input` must be an object",
            ),
            (
                json!({"max_tokens": 1, "messages": [{"role": "user", "content": [{"type": "tool_result", "content": 1}]}]}),
                "`messages[0].content[0].content` must be",
            ),
            (
                json!({"max_tokens": 1, "messages": [{"role": "user", "content": [{"type": "thinking"}]}]}),
                "hold nothing to render",
            ),
        ] {
            let e = parse(body.clone()).expect_err(field);
            assert!(e.0.contains(field), "{e:?} for {body}");
        }
        assert!(parse_messages(b"{")
            .expect_err("bad")
            .0
            .contains("invalid JSON"));
        assert!(chat_messages(&json!(1)).is_err());
    }
}
