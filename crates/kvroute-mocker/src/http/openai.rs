//! OpenAI request bodies in, validated engine requests out; response bodies back.
//!
//! Parsing is by hand over `serde_json::Value` so that every malformed body
//! gets a 400 naming the offending field, and nothing panics on input.

use serde_json::{json, Map, Value};

use crate::engine::{MmPlacement, NewRequest, Usage};
use crate::multimodal::{sglang_padding, ImageIdentity, ImageSpan, ImageTokenRule};
use crate::tokenizer::{FillerToken, Tokenizer};
use kvroute_core::event::WorkerFlavor;

use super::ApiError;

/// `max_tokens` when the request gives none (both endpoints).
pub const DEFAULT_MAX_TOKENS: usize = 16;

/// Which endpoint a request came in on.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Endpoint {
    /// `/v1/completions`.
    Completions,
    /// `/v1/chat/completions`.
    Chat,
}

/// A piece of a rendered prompt.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Segment {
    /// Text for the tokenizer.
    Text(String),
    /// Token ids given by the client.
    Tokens(Vec<u64>),
    /// A chat-template special token.
    Special(SpecialToken),
    /// An image by URL.
    Image(String),
}

/// The chat template's special tokens.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum SpecialToken {
    /// `<|im_start|>`.
    ImStart,
    /// `<|im_end|>`.
    ImEnd,
}

/// A request body after validation.
#[derive(Debug, Clone, PartialEq)]
pub struct ParsedRequest {
    /// The endpoint.
    pub endpoint: Endpoint,
    /// The prompt, rendered (chat template applied).
    pub segments: Vec<Segment>,
    /// Tokens to generate.
    pub max_tokens: usize,
    /// SSE streaming.
    pub stream: bool,
    /// `stream_options.include_usage`.
    pub include_usage: bool,
    /// Client-supplied image hashes, one per image in order.
    pub mm_hashes: Option<Vec<u64>>,
    /// `data_parallel_rank` from the body.
    pub dp_rank: Option<u32>,
    /// The `model` field, when present.
    pub model: Option<String>,
    /// Chat messages as a model's chat template takes them (`role` and
    /// string `content`), when every part is text; `None` for completions
    /// and chats with images.
    pub template_messages: Option<Value>,
}

fn bad(message: impl Into<String>) -> ApiError {
    ApiError::bad_request(message)
}

fn field_u64(value: &Value, field: &str) -> Result<u64, ApiError> {
    value
        .as_u64()
        .ok_or_else(|| bad(format!("`{field}` must be a non-negative integer")))
}

fn token_ids(items: &[Value], field: &str) -> Result<Vec<u64>, ApiError> {
    items
        .iter()
        .enumerate()
        .map(|(i, v)| match v.as_u64() {
            Some(id) if id <= i64::MAX as u64 => Ok(id),
            _ => Err(bad(format!(
                "`{field}[{i}]` must be a token id (an integer from 0 to 2^63-1)"
            ))),
        })
        .collect()
}

/// Parses and validates a request body.
pub fn parse(endpoint: Endpoint, body: &[u8]) -> Result<ParsedRequest, ApiError> {
    let value: Value = serde_json::from_slice(body)
        .map_err(|e| bad(format!("the body is not valid JSON: {e}")))?;
    let Value::Object(obj) = value else {
        return Err(bad("the body must be a JSON object"));
    };
    let segments = match endpoint {
        Endpoint::Completions => completion_prompt(&obj)?,
        Endpoint::Chat => chat_prompt(&obj)?,
    };
    let template_messages = match endpoint {
        Endpoint::Completions => None,
        Endpoint::Chat => text_messages(&obj),
    };
    let max_tokens = max_tokens(&obj, endpoint)?;
    match obj.get("n") {
        None | Some(Value::Null) => {}
        Some(n) if n.as_u64() == Some(1) => {}
        Some(_) => return Err(bad("`n` must be 1: the mocker returns one choice")),
    }
    let stream = match obj.get("stream") {
        None | Some(Value::Null) => false,
        Some(Value::Bool(b)) => *b,
        Some(_) => return Err(bad("`stream` must be a boolean")),
    };
    let include_usage = match obj.get("stream_options") {
        None | Some(Value::Null) => false,
        Some(Value::Object(o)) => match o.get("include_usage") {
            None | Some(Value::Null) => false,
            Some(Value::Bool(b)) => *b,
            Some(_) => return Err(bad("`stream_options.include_usage` must be a boolean")),
        },
        Some(_) => return Err(bad("`stream_options` must be an object")),
    };
    let mm_hashes = match obj.get("mm_hashes") {
        None | Some(Value::Null) => None,
        Some(Value::Array(items)) => Some(
            items
                .iter()
                .enumerate()
                .map(|(i, v)| {
                    mm_hash(v).ok_or_else(|| {
                        bad(format!(
                            "`mm_hashes[{i}]` must be an unsigned 64-bit integer or a hex string"
                        ))
                    })
                })
                .collect::<Result<Vec<u64>, ApiError>>()?,
        ),
        Some(_) => return Err(bad("`mm_hashes` must be an array")),
    };
    let dp_rank = match obj.get("data_parallel_rank") {
        None | Some(Value::Null) => None,
        Some(v) => Some(
            u32::try_from(field_u64(v, "data_parallel_rank")?)
                .map_err(|_| bad("`data_parallel_rank` is out of range"))?,
        ),
    };
    let model = match obj.get("model") {
        None | Some(Value::Null) => None,
        Some(Value::String(s)) => Some(s.clone()),
        Some(_) => return Err(bad("`model` must be a string")),
    };
    Ok(ParsedRequest {
        endpoint,
        segments,
        max_tokens,
        stream,
        include_usage,
        mm_hashes,
        dp_rank,
        model,
        template_messages,
    })
}

/// An `mm_hashes` entry: an integer, or hex (the first 16 digits of a longer digest).
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

fn max_tokens(obj: &Map<String, Value>, endpoint: Endpoint) -> Result<usize, ApiError> {
    let keys: &[&str] = match endpoint {
        Endpoint::Completions => &["max_tokens"],
        Endpoint::Chat => &["max_completion_tokens", "max_tokens"],
    };
    for &key in keys {
        match obj.get(key) {
            None | Some(Value::Null) => continue,
            Some(v) => {
                let n = field_u64(v, key)?;
                if n == 0 {
                    return Err(bad(format!("`{key}` must be at least 1")));
                }
                return usize::try_from(n).map_err(|_| bad(format!("`{key}` is too large")));
            }
        }
    }
    Ok(DEFAULT_MAX_TOKENS)
}

fn completion_prompt(obj: &Map<String, Value>) -> Result<Vec<Segment>, ApiError> {
    let prompt = obj
        .get("prompt")
        .ok_or_else(|| bad("`prompt` is required"))?;
    let segment = match prompt {
        Value::String(s) => Segment::Text(s.clone()),
        Value::Array(items) => match items.as_slice() {
            [] => return Err(bad("`prompt` is empty")),
            [Value::String(s)] => Segment::Text(s.clone()),
            [Value::Array(ids)] => Segment::Tokens(token_ids(ids, "prompt[0]")?),
            [Value::Number(_), ..] => Segment::Tokens(token_ids(items, "prompt")?),
            [Value::String(_) | Value::Array(_), ..] => {
                return Err(bad(
                    "batched prompts are not supported: send one prompt per request",
                ))
            }
            _ => {
                return Err(bad(
                    "`prompt` must be a string, an array of token ids, or a one-element array of either",
                ))
            }
        },
        _ => return Err(bad("`prompt` must be a string or an array of token ids")),
    };
    if matches!(&segment, Segment::Text(s) if s.is_empty()) {
        return Err(bad("`prompt` is empty"));
    }
    Ok(vec![segment])
}

fn chat_prompt(obj: &Map<String, Value>) -> Result<Vec<Segment>, ApiError> {
    let messages = match obj.get("messages") {
        Some(Value::Array(m)) if !m.is_empty() => m,
        Some(Value::Array(_)) => return Err(bad("`messages` is empty")),
        Some(_) => return Err(bad("`messages` must be an array")),
        None => return Err(bad("`messages` is required")),
    };
    let mut segments = Vec::new();
    for (i, message) in messages.iter().enumerate() {
        let Value::Object(m) = message else {
            return Err(bad(format!("`messages[{i}]` must be an object")));
        };
        let role = match m.get("role") {
            Some(Value::String(r)) if !r.is_empty() => r,
            _ => {
                return Err(bad(format!(
                    "`messages[{i}].role` must be a non-empty string"
                )))
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
                return Err(bad(format!(
                    "`messages[{i}].content` must be a string or an array of parts"
                )))
            }
        }
        segments.push(Segment::Special(SpecialToken::ImEnd));
        segments.push(Segment::Text("\n".into()));
    }
    segments.push(Segment::Special(SpecialToken::ImStart));
    segments.push(Segment::Text("assistant\n".into()));
    Ok(segments)
}

/// The (already validated) messages with each content as one string, or
/// `None` when a part is not text.
fn text_messages(obj: &Map<String, Value>) -> Option<Value> {
    let messages = obj.get("messages")?.as_array()?;
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

fn content_part(part: &Value, i: usize, j: usize) -> Result<Segment, ApiError> {
    let at = || format!("messages[{i}].content[{j}]");
    let Value::Object(p) = part else {
        return Err(bad(format!("`{}` must be an object", at())));
    };
    match p.get("type").and_then(Value::as_str) {
        Some("text") => match p.get("text") {
            Some(Value::String(t)) => Ok(Segment::Text(t.clone())),
            _ => Err(bad(format!("`{}.text` must be a string", at()))),
        },
        Some("image_url") => {
            let url = match p.get("image_url") {
                Some(Value::String(u)) => u,
                Some(Value::Object(o)) => match o.get("url") {
                    Some(Value::String(u)) => u,
                    _ => return Err(bad(format!("`{}.image_url.url` must be a string", at()))),
                },
                _ => return Err(bad(format!("`{}.image_url` is required", at()))),
            };
            Ok(Segment::Image(url.clone()))
        }
        Some(other) => Err(bad(format!(
            "`{}.type` {other:?} is not supported (text and image_url are)",
            at()
        ))),
        None => Err(bad(format!("`{}.type` must be a string", at()))),
    }
}

/// What the engine side needs to build prompts.
#[derive(Debug, Clone, Copy)]
pub struct PromptSettings {
    /// Pads (SGLang) or placeholders (vLLM).
    pub flavor: WorkerFlavor,
    /// Positions each image takes.
    pub mm_tokens_per_image: usize,
    /// Seed of the filler.
    pub seed: u64,
}

/// A prompt laid out the flavour-neutral way: token ids with the image
/// placeholder id in every image position, and the images' spans.
///
/// The engine ([`build`]) and the router's request side (`kvroute serve
/// --tokenizer`) both start from this, so their token ids agree.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct NeutralPrompt {
    /// Token ids; image positions hold the tokenizer's image placeholder id.
    pub tokens: Vec<u64>,
    /// The images, in order, with the identity rule applied (client hash or URL).
    pub images: Vec<ImageSpan>,
}

/// Tokenizes a parsed request's prompt: text through the tokenizer, chat
/// specials, client token ids as given, and each image as vision start,
/// `rule` placeholder positions, vision end.
pub fn layout(
    parsed: &ParsedRequest,
    tokenizer: &Tokenizer,
    rule: ImageTokenRule,
) -> Result<NeutralPrompt, ApiError> {
    let specials = tokenizer.specials();
    let images = parsed
        .segments
        .iter()
        .filter(|s| matches!(s, Segment::Image(_)))
        .count();
    if let Some(hashes) = &parsed.mm_hashes {
        if images > 0 && hashes.len() != images {
            return Err(bad(format!(
                "`mm_hashes` has {} entries for {images} image(s)",
                hashes.len()
            )));
        }
    }
    if let (Some(template), Some(messages)) = (tokenizer.chat_template(), &parsed.template_messages)
    {
        let text = template
            .render(messages, true)
            .map_err(|e| bad(e.to_string()))?;
        let tokens = tokenizer
            .encode(&text)
            .map_err(|e| ApiError::internal(e.to_string()))?;
        if tokens.is_empty() {
            return Err(bad("the prompt has no tokens"));
        }
        return Ok(NeutralPrompt {
            tokens,
            images: Vec::new(),
        });
    }
    let mut prompt: Vec<u64> = Vec::new();
    let mut spans = Vec::new();
    for segment in &parsed.segments {
        match segment {
            Segment::Text(text) => prompt.extend(
                tokenizer
                    .encode(text)
                    .map_err(|e| ApiError::internal(e.to_string()))?,
            ),
            Segment::Tokens(ids) => prompt.extend_from_slice(ids),
            Segment::Special(SpecialToken::ImStart) => prompt.push(specials.im_start),
            Segment::Special(SpecialToken::ImEnd) => prompt.push(specials.im_end),
            Segment::Image(url) => {
                let image_index = spans.len();
                let client_hash = parsed
                    .mm_hashes
                    .as_ref()
                    .and_then(|h| h.get(image_index))
                    .copied();
                let identity = ImageIdentity::resolve(client_hash, url)
                    .map_err(|e| bad(format!("image {image_index}: {e}")))?;
                let len = rule.tokens_for(parsed.model.as_deref(), &identity);
                prompt.push(specials.vision_start);
                let start = prompt.len();
                prompt.extend(std::iter::repeat_n(specials.image_pad, len));
                spans.push(ImageSpan {
                    start,
                    len,
                    identity,
                });
                prompt.push(specials.vision_end);
            }
        }
    }
    if prompt.is_empty() {
        return Err(bad("the prompt has no tokens"));
    }
    Ok(NeutralPrompt {
        tokens: prompt,
        images: spans,
    })
}

/// Tokenizes a parsed request into the engine request and its planned output.
pub fn build(
    parsed: &ParsedRequest,
    tokenizer: &Tokenizer,
    settings: PromptSettings,
) -> Result<(NewRequest, Vec<FillerToken>), ApiError> {
    let NeutralPrompt {
        tokens: mut prompt,
        images,
    } = layout(
        parsed,
        tokenizer,
        ImageTokenRule::fixed(settings.mm_tokens_per_image),
    )?;
    let mut mm_items = Vec::new();
    for image in images {
        match settings.flavor {
            WorkerFlavor::Sglang => {
                let end = image.start + image.len;
                if let Some(span) = prompt.get_mut(image.start..end) {
                    for (slot, pad) in span
                        .iter_mut()
                        .zip(sglang_padding(image.identity.hash, image.len))
                    {
                        *slot = pad;
                    }
                }
            }
            WorkerFlavor::Vllm => mm_items.push(MmPlacement {
                start: image.start,
                len: image.len,
                identifier: image.identity.identifier,
            }),
        }
    }
    let filler = tokenizer.filler(settings.seed, &prompt, parsed.max_tokens);
    let request = NewRequest {
        prompt,
        output: filler.iter().map(|f| f.id).collect(),
        mm_items,
    };
    Ok((request, filler))
}

/// The `usage` object, with `prompt_tokens_details.cached_tokens`.
pub fn usage_json(u: &Usage) -> Value {
    json!({
        "prompt_tokens": u.prompt_tokens,
        "completion_tokens": u.completion_tokens,
        "total_tokens": u.prompt_tokens + u.completion_tokens,
        "prompt_tokens_details": {"cached_tokens": u.cached_tokens},
    })
}

/// Identity of one response: ids and names shared by its chunks.
#[derive(Debug, Clone)]
pub struct ResponseMeta {
    /// `cmpl-…` or `chatcmpl-…`.
    pub id: String,
    /// Unix seconds.
    pub created: u64,
    /// The served model name.
    pub model: String,
    /// The endpoint.
    pub endpoint: Endpoint,
}

impl ResponseMeta {
    /// The non-streaming response body.
    pub fn full(&self, text: &str, usage: &Usage) -> Value {
        let choice = match self.endpoint {
            Endpoint::Completions => json!({
                "index": 0, "text": text, "logprobs": null, "finish_reason": "length",
            }),
            Endpoint::Chat => json!({
                "index": 0,
                "message": {"role": "assistant", "content": text},
                "logprobs": null,
                "finish_reason": "length",
            }),
        };
        json!({
            "id": self.id,
            "object": self.object(false),
            "created": self.created,
            "model": self.model,
            "choices": [choice],
            "usage": usage_json(usage),
        })
    }

    /// One streaming chunk: a text piece, the role (chat), or the finish marker.
    pub fn chunk(&self, piece: ChunkPiece<'_>, include_usage: bool) -> Value {
        let (text, finish, role) = match piece {
            ChunkPiece::Role => ("", Value::Null, true),
            ChunkPiece::Text(t) => (t, Value::Null, false),
            ChunkPiece::Finish => ("", Value::from("length"), false),
        };
        let choice = match self.endpoint {
            Endpoint::Completions => json!({
                "index": 0, "text": text, "logprobs": null, "finish_reason": finish,
            }),
            Endpoint::Chat => {
                let delta = if role {
                    json!({"role": "assistant", "content": ""})
                } else if matches!(piece, ChunkPiece::Finish) {
                    json!({})
                } else {
                    json!({"content": text})
                };
                json!({"index": 0, "delta": delta, "logprobs": null, "finish_reason": finish})
            }
        };
        let mut chunk = json!({
            "id": self.id,
            "object": self.object(true),
            "created": self.created,
            "model": self.model,
            "choices": [choice],
        });
        if include_usage {
            chunk["usage"] = Value::Null;
        }
        chunk
    }

    /// The final usage chunk (`stream_options.include_usage`).
    pub fn usage_chunk(&self, usage: &Usage) -> Value {
        json!({
            "id": self.id,
            "object": self.object(true),
            "created": self.created,
            "model": self.model,
            "choices": [],
            "usage": usage_json(usage),
        })
    }

    fn object(&self, chunk: bool) -> &'static str {
        match (self.endpoint, chunk) {
            (Endpoint::Completions, _) => "text_completion",
            (Endpoint::Chat, false) => "chat.completion",
            (Endpoint::Chat, true) => "chat.completion.chunk",
        }
    }
}

/// What a streaming chunk carries.
#[derive(Debug, Clone, Copy)]
pub enum ChunkPiece<'a> {
    /// The assistant role (first chat chunk).
    Role,
    /// Generated text.
    Text(&'a str),
    /// The end, with `finish_reason`.
    Finish,
}

#[cfg(test)]
mod tests {
    use super::*;

    fn parse_err(endpoint: Endpoint, body: &str) -> String {
        parse(endpoint, body.as_bytes())
            .expect_err("invalid body")
            .message()
            .to_owned()
    }

    #[test]
    fn completion_prompts_in_every_accepted_shape() {
        let p = parse(Endpoint::Completions, br#"{"prompt":"hi","max_tokens":3}"#).expect("ok");
        assert_eq!(p.segments, [Segment::Text("hi".into())]);
        assert_eq!(p.max_tokens, 3);
        let p = parse(Endpoint::Completions, br#"{"prompt":[1,2,3]}"#).expect("ok");
        assert_eq!(p.segments, [Segment::Tokens(vec![1, 2, 3])]);
        assert_eq!(p.max_tokens, DEFAULT_MAX_TOKENS);
        let p = parse(Endpoint::Completions, br#"{"prompt":[[7,8]]}"#).expect("ok");
        assert_eq!(p.segments, [Segment::Tokens(vec![7, 8])]);
        let p = parse(
            Endpoint::Completions,
            br#"{"prompt":["x"],"stream":true,"stream_options":{"include_usage":true}}"#,
        )
        .expect("ok");
        assert!(p.stream && p.include_usage);
    }

    #[test]
    fn malformed_bodies_name_the_problem() {
        assert!(parse_err(Endpoint::Completions, "{").contains("not valid JSON"));
        assert!(parse_err(Endpoint::Completions, "[]").contains("JSON object"));
        assert!(parse_err(Endpoint::Completions, "{}").contains("`prompt` is required"));
        assert!(parse_err(Endpoint::Completions, r#"{"prompt":""}"#).contains("empty"));
        assert!(parse_err(Endpoint::Completions, r#"{"prompt":["a","b"]}"#).contains("batched"));
        assert!(parse_err(Endpoint::Completions, r#"{"prompt":[1,-2]}"#).contains("prompt[1]"));
        assert!(
            parse_err(Endpoint::Completions, r#"{"prompt":"a","max_tokens":0}"#)
                .contains("at least 1")
        );
        assert!(
            parse_err(Endpoint::Completions, r#"{"prompt":"a","max_tokens":"x"}"#)
                .contains("max_tokens")
        );
        assert!(parse_err(Endpoint::Completions, r#"{"prompt":"a","n":2}"#).contains("`n`"));
        assert!(
            parse_err(Endpoint::Completions, r#"{"prompt":"a","stream":1}"#).contains("stream")
        );
        assert!(parse_err(Endpoint::Chat, r#"{"messages":[]}"#).contains("empty"));
        assert!(parse_err(Endpoint::Chat, r#"{"messages":[{"content":"x"}]}"#).contains("role"));
        assert!(parse_err(
            Endpoint::Chat,
            r#"{"messages":[{"role":"user","content":[{"type":"input_audio"}]}]}"#
        )
        .contains("not supported"));
        assert!(parse_err(
            Endpoint::Chat,
            r#"{"messages":[{"role":"user","content":"x"}],"mm_hashes":[-1]}"#
        )
        .contains("mm_hashes[0]"));
    }

    #[test]
    fn chat_messages_render_through_the_template() {
        let body = br#"{"messages":[{"role":"user","content":[{"type":"text","text":"look"},{"type":"image_url","image_url":{"url":"data:image/png;base64,aGVsbG8="}}]}],"max_completion_tokens":2}"#;
        let p = parse(Endpoint::Chat, body).expect("ok");
        assert_eq!(p.max_tokens, 2);
        assert_eq!(
            p.segments,
            [
                Segment::Special(SpecialToken::ImStart),
                Segment::Text("user\n".into()),
                Segment::Text("look".into()),
                Segment::Image("data:image/png;base64,aGVsbG8=".into()),
                Segment::Special(SpecialToken::ImEnd),
                Segment::Text("\n".into()),
                Segment::Special(SpecialToken::ImStart),
                Segment::Text("assistant\n".into()),
            ]
        );
    }

    #[test]
    fn images_become_wide_pads_for_sglang_and_placeholders_for_vllm() {
        let body = br#"{"messages":[{"role":"user","content":[{"type":"image_url","image_url":"data:image/png;base64,aGVsbG8="}]}]}"#;
        let p = parse(Endpoint::Chat, body).expect("ok");
        let tok = Tokenizer::builtin();
        let settings = PromptSettings {
            flavor: WorkerFlavor::Sglang,
            mm_tokens_per_image: 6,
            seed: 0,
        };
        let (r, filler) = build(&p, &tok, settings).expect("ok");
        assert_eq!(filler.len(), DEFAULT_MAX_TOKENS);
        let pads = crate::multimodal::sglang_pad_values(0x2cf24dba5fb0a30e);
        let i = r
            .prompt
            .iter()
            .position(|&t| t == pads[0])
            .expect("pads present");
        assert_eq!(r.prompt[i - 1], crate::tokenizer::VISION_START);
        assert_eq!(
            &r.prompt[i..i + 6],
            &[pads[0], pads[1], pads[2], pads[3], pads[0], pads[1]]
        );
        assert_eq!(r.prompt[i + 6], crate::tokenizer::VISION_END);
        assert!(r.mm_items.is_empty());

        let (r, _) = build(
            &p,
            &tok,
            PromptSettings {
                flavor: WorkerFlavor::Vllm,
                ..settings
            },
        )
        .expect("ok");
        assert_eq!(r.mm_items.len(), 1);
        let item = &r.mm_items[0];
        assert_eq!(item.len, 6);
        assert!(item.identifier.starts_with("2cf24dba5fb0a30e"));
        assert!(r.prompt[item.start..item.start + 6]
            .iter()
            .all(|&t| t == crate::tokenizer::IMAGE_PAD));
    }

    #[test]
    fn supplied_mm_hashes_replace_the_image_identity_and_must_match_in_count() {
        let body = br#"{"messages":[{"role":"user","content":[{"type":"image_url","image_url":"https://x.invalid/a.png"}]}],"mm_hashes":["00000000000000ff"]}"#;
        let p = parse(Endpoint::Chat, body).expect("ok");
        assert_eq!(p.mm_hashes, Some(vec![255]));
        let settings = PromptSettings {
            flavor: WorkerFlavor::Sglang,
            mm_tokens_per_image: 4,
            seed: 0,
        };
        let (r, _) = build(&p, &Tokenizer::builtin(), settings).expect("ok");
        let pads = crate::multimodal::sglang_pad_values(255);
        assert!(r.prompt.windows(4).any(|w| w == pads));
        let body = br#"{"messages":[{"role":"user","content":[{"type":"image_url","image_url":"x"}]}],"mm_hashes":[1,2]}"#;
        let p = parse(Endpoint::Chat, body).expect("ok");
        let err = build(&p, &Tokenizer::builtin(), settings).expect_err("count mismatch");
        assert!(err.message().contains("2 entries for 1 image"));
    }

    /// The router's per-flavour hashes of a prompt with an image equal the
    /// local hashes the wire decoder computes from the engine's own events.
    #[test]
    fn router_hashes_of_an_image_prompt_equal_the_decoded_event_hashes() {
        use crate::encode::{encode_batch, EncodeOptions};
        use crate::engine::timing::TimingModel;
        use crate::engine::{Engine, EngineConfig, RequestId};
        use crate::EventFormat;
        use kvroute_core::event::KvEvent;
        use kvroute_core::event::WorkerFlavor;
        use kvroute_core::hash::HASH_SEED;
        use kvroute_core::multimodal::prompt_local_hashes;
        use kvroute_core::tokens::fold_token_id;
        use kvroute_core::wire::{DecoderConfig, StreamDecoder};

        let body = br#"{"messages":[{"role":"user","content":[{"type":"text","text":"what is this picture"},{"type":"image_url","image_url":{"url":"data:image/png;base64,aGVsbG8="}},{"type":"text","text":"and this one, please say"},{"type":"image_url","image_url":"https://x.invalid/b.png"}]}],"max_tokens":2}"#;
        let parsed = parse(Endpoint::Chat, body).expect("ok");
        let tok = Tokenizer::builtin();
        let bs = 4;
        for (flavor, router_flavor) in [
            (WorkerFlavor::Sglang, WorkerFlavor::Sglang),
            (WorkerFlavor::Vllm, WorkerFlavor::Vllm),
        ] {
            let settings = PromptSettings {
                flavor,
                mm_tokens_per_image: 7,
                seed: 0,
            };
            let neutral = layout(&parsed, &tok, ImageTokenRule::fixed(7)).expect("ok");
            let folded: Vec<u32> = neutral.tokens.iter().map(|&t| fold_token_id(t)).collect();
            let expected =
                prompt_local_hashes(&folded, &neutral.images, router_flavor, bs, HASH_SEED);
            assert_eq!(expected.len(), folded.len() / bs);

            let (request, _) = build(&parsed, &tok, settings).expect("ok");
            let mut engine = Engine::new(EngineConfig {
                flavor,
                block_size: bs,
                num_gpu_blocks: 256,
                max_num_seqs: 4,
                max_num_batched_tokens: 1024,
                timing: TimingModel::default(),
            });
            engine.submit(RequestId(1), request).expect("accepted");
            let mut decoder = StreamDecoder::new(DecoderConfig {
                block_size: Some(bs as u32),
                ..DecoderConfig::default()
            });
            let options = EncodeOptions {
                flavor,
                format: EventFormat::Map,
            };
            let mut decoded = Vec::new();
            let mut steps = 0;
            while let Some(step) = engine.step() {
                steps += 1;
                assert!(steps < 10_000, "engine did not go idle");
                if step.events.is_empty() {
                    continue;
                }
                let payload = encode_batch(options, 0.0, &step.events, Some(0), None);
                let batch = decoder.decode(&payload).expect("envelope");
                assert_eq!(batch.skipped().count(), 0, "{flavor:?}: no decode errors");
                for event in batch.decoded() {
                    if let KvEvent::Stored(s) = event {
                        decoded.extend(s.blocks.iter().map(|b| b.local));
                    }
                }
            }
            assert!(decoded.len() >= expected.len(), "{flavor:?}");
            assert_eq!(decoded[..expected.len()], expected[..], "{flavor:?}");
        }
    }
}
