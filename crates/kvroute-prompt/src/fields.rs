//! The prompt fields of an OpenAI request, as JSON values, into segments.
//!
//! Each function takes the value of one field as the caller already has it
//! (`None`: the field is absent), so a caller that scanned the body itself
//! never has it parsed twice. Parsing is by hand over `serde_json::Value` so
//! that every malformed field gets an error naming it, and nothing panics on
//! input.

use serde_json::Value;

use crate::error::PromptError;
use crate::prompt::{Segment, SpecialToken};

/// Client token ids: each an integer from 0 to 2^63-1.
pub fn token_ids(items: &[Value], field: &str) -> Result<Vec<u64>, PromptError> {
    items
        .iter()
        .enumerate()
        .map(|(i, v)| match v.as_u64() {
            Some(id) if id <= i64::MAX as u64 => Ok(id),
            _ => Err(PromptError::invalid(
                format!("{field}[{i}]"),
                "a token id (an integer from 0 to 2^63-1)",
            )),
        })
        .collect()
}

/// The segments of a `/v1/completions` `prompt`: a string, token ids, or a
/// one-element array of either.
pub fn completion_segments(prompt: Option<&Value>) -> Result<Vec<Segment>, PromptError> {
    let prompt = prompt.ok_or_else(|| PromptError::Missing {
        field: "prompt".into(),
    })?;
    let empty = || PromptError::Empty {
        field: "prompt".into(),
    };
    let segment = match prompt {
        Value::String(s) => Segment::Text(s.clone()),
        Value::Array(items) => match items.as_slice() {
            [] => return Err(empty()),
            [Value::String(s)] => Segment::Text(s.clone()),
            [Value::Array(ids)] => Segment::Tokens(token_ids(ids, "prompt[0]")?),
            [Value::Number(_), ..] => Segment::Tokens(token_ids(items, "prompt")?),
            [Value::String(_) | Value::Array(_), ..] => return Err(PromptError::Batched),
            _ => {
                return Err(PromptError::invalid(
                    "prompt",
                    "a string, an array of token ids, or a one-element array of either",
                ))
            }
        },
        _ => {
            return Err(PromptError::invalid(
                "prompt",
                "a string or an array of token ids",
            ))
        }
    };
    if matches!(&segment, Segment::Text(s) if s.is_empty()) {
        return Err(empty());
    }
    Ok(vec![segment])
}

/// The segments of `/v1/chat/completions` `messages` in the ChatML layout:
/// per message `<|im_start|>`, `"{role}\n"`, the content (text and image
/// parts), `<|im_end|>`, `"\n"`; then `<|im_start|>`, `"assistant\n"`.
pub fn chat_segments(messages: Option<&Value>) -> Result<Vec<Segment>, PromptError> {
    let messages = match messages {
        Some(Value::Array(m)) if !m.is_empty() => m,
        Some(Value::Array(_)) => {
            return Err(PromptError::Empty {
                field: "messages".into(),
            })
        }
        Some(_) => return Err(PromptError::invalid("messages", "an array")),
        None => {
            return Err(PromptError::Missing {
                field: "messages".into(),
            })
        }
    };
    let mut segments = Vec::new();
    for (i, message) in messages.iter().enumerate() {
        let Value::Object(m) = message else {
            return Err(PromptError::invalid(format!("messages[{i}]"), "an object"));
        };
        let role = match m.get("role") {
            Some(Value::String(r)) if !r.is_empty() => r,
            _ => {
                return Err(PromptError::invalid(
                    format!("messages[{i}].role"),
                    "a non-empty string",
                ))
            }
        };
        segments.push(Segment::Special(SpecialToken::ImStart));
        segments.push(Segment::Text(format!("{role}\n")));
        match m.get("content") {
            None | Some(Value::Null) => {}
            Some(Value::String(text)) => segments.push(Segment::Text(text.clone())),
            Some(Value::Array(parts)) => {
                for (j, part) in parts.iter().enumerate() {
                    segments.push(content_part(part, i, j)?);
                }
            }
            Some(_) => {
                return Err(PromptError::invalid(
                    format!("messages[{i}].content"),
                    "a string or an array of parts",
                ))
            }
        }
        segments.push(Segment::Special(SpecialToken::ImEnd));
        segments.push(Segment::Text("\n".into()));
    }
    segments.push(Segment::Special(SpecialToken::ImStart));
    segments.push(Segment::Text("assistant\n".into()));
    Ok(segments)
}

/// The URL of an `image_url` or `video_url` part: `key: url | {"url": url}`.
fn media_url(
    p: &serde_json::Map<String, Value>,
    key: &str,
    at: &dyn Fn() -> String,
) -> Result<String, PromptError> {
    match p.get(key) {
        Some(Value::String(u)) => Ok(u.clone()),
        Some(Value::Object(o)) => match o.get("url") {
            Some(Value::String(u)) => Ok(u.clone()),
            _ => Err(PromptError::invalid(
                format!("{}.{key}.url", at()),
                "a string",
            )),
        },
        _ => Err(PromptError::Missing {
            field: format!("{}.{key}", at()),
        }),
    }
}

/// One content part: `{"type": "text", "text"}`, or `{"type": "image_url",
/// "image_url": url | {"url"}}` and its video form `video_url`.
fn content_part(part: &Value, i: usize, j: usize) -> Result<Segment, PromptError> {
    let at = || format!("messages[{i}].content[{j}]");
    let Value::Object(p) = part else {
        return Err(PromptError::invalid(at(), "an object"));
    };
    match p.get("type").and_then(Value::as_str) {
        Some("text") => match p.get("text") {
            Some(Value::String(t)) => Ok(Segment::Text(t.clone())),
            _ => Err(PromptError::invalid(format!("{}.text", at()), "a string")),
        },
        Some("image_url") => media_url(p, "image_url", &at).map(Segment::Image),
        Some("video_url") => media_url(p, "video_url", &at).map(Segment::Video),
        Some(other) => Err(PromptError::UnsupportedPart {
            field: format!("{}.type", at()),
            kind: other.to_owned(),
        }),
        None => Err(PromptError::invalid(format!("{}.type", at()), "a string")),
    }
}

/// The messages as a model's chat template takes them (each content one
/// string), or `None` when a part is not text (then the ChatML layout is
/// used). Call it on messages [`chat_segments`] accepted.
pub fn template_messages(messages: &Value) -> Option<Value> {
    let messages = messages.as_array()?;
    let mut out = Vec::with_capacity(messages.len());
    for m in messages {
        let content = match m.get("content") {
            None | Some(Value::Null) => String::new(),
            Some(Value::String(s)) => s.clone(),
            Some(Value::Array(parts)) => {
                let mut text = String::new();
                for p in parts {
                    if p.get("type").and_then(Value::as_str) != Some("text") {
                        return None;
                    }
                    text.push_str(p.get("text")?.as_str()?);
                }
                text
            }
            Some(_) => return None,
        };
        let mut message = m.as_object()?.clone();
        message.insert("content".into(), Value::String(content));
        out.push(Value::Object(message));
    }
    Some(Value::Array(out))
}

/// `mm_hashes`: one entry per image, an integer or hex (the first 16 digits
/// of a longer digest); `null` or absent: `None`.
pub fn mm_hashes(value: Option<&Value>) -> Result<Option<Vec<u64>>, PromptError> {
    match value {
        None | Some(Value::Null) => Ok(None),
        Some(Value::Array(items)) => items
            .iter()
            .enumerate()
            .map(|(i, v)| {
                mm_hash(v).ok_or_else(|| {
                    PromptError::invalid(
                        format!("mm_hashes[{i}]"),
                        "an unsigned 64-bit integer or a hex string",
                    )
                })
            })
            .collect::<Result<Vec<u64>, PromptError>>()
            .map(Some),
        Some(_) => Err(PromptError::invalid("mm_hashes", "an array")),
    }
}

/// One `mm_hashes` entry.
fn mm_hash(v: &Value) -> Option<u64> {
    match v {
        Value::Number(n) => n.as_u64(),
        Value::String(s) => {
            let digits = s.strip_prefix("0x").unwrap_or(s);
            let head = digits.get(..digits.len().min(16))?;
            if head.is_empty() || !head.bytes().all(|b| b.is_ascii_hexdigit()) {
                return None;
            }
            u64::from_str_radix(head, 16).ok()
        }
        _ => None,
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn err(r: Result<Vec<Segment>, PromptError>) -> String {
        r.expect_err("invalid").to_string()
    }

    #[test]
    fn completion_prompts_in_every_accepted_shape() {
        let text = |s: &str| vec![Segment::Text(s.into())];
        assert_eq!(
            completion_segments(Some(&json!("hi"))).expect("ok"),
            text("hi")
        );
        assert_eq!(
            completion_segments(Some(&json!(["x"]))).expect("ok"),
            text("x")
        );
        assert_eq!(
            completion_segments(Some(&json!([1, 2, 3]))).expect("ok"),
            [Segment::Tokens(vec![1, 2, 3])]
        );
        assert_eq!(
            completion_segments(Some(&json!([[7, 8]]))).expect("ok"),
            [Segment::Tokens(vec![7, 8])]
        );
    }

    #[test]
    fn malformed_prompts_name_the_field() {
        assert_eq!(err(completion_segments(None)), "`prompt` is required");
        assert_eq!(
            err(completion_segments(Some(&json!("")))),
            "`prompt` is empty"
        );
        assert_eq!(
            err(completion_segments(Some(&json!([])))),
            "`prompt` is empty"
        );
        assert!(err(completion_segments(Some(&json!(["a", "b"])))).contains("batched"));
        assert!(err(completion_segments(Some(&json!([1, -2])))).starts_with("`prompt[1]`"));
        assert!(err(completion_segments(Some(&json!([[1, 1.5]])))).starts_with("`prompt[0][1]`"));
        assert!(err(completion_segments(Some(&json!(null)))).contains("a string or an array"));
        assert!(err(completion_segments(Some(&json!([true])))).contains("one-element"));
        assert_eq!(err(chat_segments(None)), "`messages` is required");
        assert_eq!(err(chat_segments(Some(&json!([])))), "`messages` is empty");
        assert_eq!(
            err(chat_segments(Some(&json!({})))),
            "`messages` must be an array"
        );
        assert_eq!(
            err(chat_segments(Some(&json!([{"content": "x"}])))),
            "`messages[0].role` must be a non-empty string"
        );
        assert_eq!(
            err(chat_segments(Some(&json!([{"role": "u", "content": 3}])))),
            "`messages[0].content` must be a string or an array of parts"
        );
        let part = |p: Value| err(chat_segments(Some(&json!([{"role": "u", "content": [p]}]))));
        assert_eq!(part(json!(1)), "`messages[0].content[0]` must be an object");
        assert_eq!(
            part(json!({})),
            "`messages[0].content[0].type` must be a string"
        );
        assert_eq!(
            part(json!({"type": "text"})),
            "`messages[0].content[0].text` must be a string"
        );
        assert_eq!(
            part(json!({"type": "image_url"})),
            "`messages[0].content[0].image_url` is required"
        );
        assert_eq!(
            part(json!({"type": "image_url", "image_url": {}})),
            "`messages[0].content[0].image_url.url` must be a string"
        );
        assert!(part(json!({"type": "input_audio"})).contains("not supported"));
    }

    #[test]
    fn template_messages_join_text_parts_and_refuse_images() {
        let messages = json!([
            {"role": "system", "content": null},
            {"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]},
        ]);
        assert_eq!(
            template_messages(&messages),
            Some(json!([{"role": "system", "content": ""}, {"role": "user", "content": "ab"}]))
        );
        let with_image =
            json!([{"role": "user", "content": [{"type": "image_url", "image_url": "x"}]}]);
        assert_eq!(template_messages(&with_image), None);
    }

    #[test]
    fn mm_hashes_are_integers_or_hex_prefixes() {
        assert_eq!(mm_hashes(None).expect("absent"), None);
        assert_eq!(mm_hashes(Some(&json!(null))).expect("null"), None);
        assert_eq!(
            mm_hashes(Some(&json!([
                255,
                "00000000000000ff",
                "0xff",
                "00000000000000ffabcd"
            ])))
            .expect("valid"),
            Some(vec![255, 255, 255, 255])
        );
        for bad in [json!([-1]), json!(["zz"]), json!([""]), json!([1.5])] {
            let e = mm_hashes(Some(&bad)).expect_err("invalid").to_string();
            assert!(e.starts_with("`mm_hashes[0]` must be"), "{e}");
        }
        let e = mm_hashes(Some(&json!({}))).expect_err("not an array");
        assert_eq!(e.to_string(), "`mm_hashes` must be an array");
    }
}
