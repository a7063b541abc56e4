//! OpenAI request bodies in, validated engine requests out; response bodies back.
//!
//! The prompt fields (`prompt`, `messages`, `mm_hashes`) are validated and
//! rendered by `kvroute_prompt`, shared with the router; this module reads
//! the engine-side fields (`max_tokens`, `n`, `stream`, `stream_options`,
//! `data_parallel_rank`, `model`), builds the engine request for the imitated
//! flavour and writes the response bodies. Parsing is by hand over
//! `serde_json::Value` so that every malformed body gets a 400 naming the
//! offending field, and nothing panics on input.

use serde_json::{json, Map, Value};

use crate::engine::SubmitError;
use crate::engine::{MmPlacement, NewRequest, Usage};
use crate::filler::{Filler, FillerToken};
use crate::handoff::TransferFields;
use crate::multimodal::sglang_padding;
use kvroute_core::event::WorkerFlavor;
use kvroute_prompt::{fields, ChatEnding, NeutralPrompt, Prompt, PromptError, Renderer};

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
    /// SGLang's native `/generate` ([`super::native`]).
    Generate,
}

/// A request body after validation.
#[derive(Debug, Clone, PartialEq)]
pub struct ParsedRequest {
    /// The endpoint.
    pub endpoint: Endpoint,
    /// The prompt: segments, template messages, `mm_hashes` and `model`.
    pub prompt: Prompt,
    /// Tokens to generate.
    pub max_tokens: usize,
    /// SSE streaming.
    pub stream: bool,
    /// `stream_options.include_usage`.
    pub include_usage: bool,
    /// `data_parallel_rank` from the body.
    pub dp_rank: Option<u32>,
    /// The disaggregation fields, unparsed: `kv_transfer_params` and the
    /// `bootstrap_*` triple (which apply depends on the engine's role).
    pub transfer: TransferFields,
    /// `/generate`'s `return_logprob`: the prompt's log-probabilities.
    pub input_logprobs: bool,
    /// The LoRA adapter the request names as its model, if it is one.
    pub lora: Option<String>,
}

impl From<PromptError> for ApiError {
    fn from(e: PromptError) -> Self {
        if e.is_client_error() {
            ApiError::bad_request(e.to_string())
        } else {
            ApiError::internal(e.to_string())
        }
    }
}

fn bad(message: impl Into<String>) -> ApiError {
    ApiError::bad_request(message)
}

fn field_u64(value: &Value, field: &str) -> Result<u64, ApiError> {
    value
        .as_u64()
        .ok_or_else(|| bad(format!("`{field}` must be a non-negative integer")))
}

/// Parses and validates a request body.
pub fn parse(endpoint: Endpoint, body: &[u8]) -> Result<ParsedRequest, ApiError> {
    let value: Value = serde_json::from_slice(body)
        .map_err(|e| bad(format!("the body is not valid JSON: {e}")))?;
    let Value::Object(mut obj) = value else {
        return Err(bad("the body must be a JSON object"));
    };
    let transfer = TransferFields::take(&mut obj);
    let mut prompt = match endpoint {
        Endpoint::Completions => Prompt::completion(obj.get("prompt"))?,
        Endpoint::Chat => Prompt::chat(obj.get("messages"))?,
        Endpoint::Generate => Prompt::completion(Some(super::native::prompt_field(&obj)?))?,
    };
    let max_tokens = match endpoint {
        Endpoint::Generate => super::native::max_new_tokens(&obj)?,
        Endpoint::Completions | Endpoint::Chat => max_tokens(&obj, endpoint)?,
    };
    let input_logprobs = match endpoint {
        Endpoint::Generate => super::native::return_logprob(&obj)?,
        Endpoint::Completions | Endpoint::Chat => false,
    };
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
    if endpoint == Endpoint::Chat {
        prompt.end_chat(chat_ending(&obj)?);
    }
    prompt.mm_hashes = fields::mm_hashes(obj.get("mm_hashes"))?;
    let dp_rank = dp_rank(&obj)?;
    prompt.model = model(&obj)?;
    Ok(ParsedRequest {
        endpoint,
        prompt,
        max_tokens,
        stream,
        include_usage,
        dp_rank,
        transfer,
        input_logprobs,
        lora: None,
    })
}

/// A chat request whose `messages` were converted from another API's body
/// (OpenAI's Responses, Anthropic's Messages): rendered exactly as
/// `/v1/chat/completions` renders `messages`. The fields it shares with a
/// chat body are read from `obj` as [`parse`] reads them: `mm_hashes`,
/// `data_parallel_rank`, `model` and the disaggregation fields.
pub fn converted_chat(
    mut obj: Map<String, Value>,
    messages: &Value,
    max_tokens: usize,
    stream: bool,
) -> Result<ParsedRequest, ApiError> {
    let transfer = TransferFields::take(&mut obj);
    let mut prompt = Prompt::chat(Some(messages))?;
    prompt.mm_hashes = fields::mm_hashes(obj.get("mm_hashes"))?;
    prompt.model = model(&obj)?;
    Ok(ParsedRequest {
        endpoint: Endpoint::Chat,
        prompt,
        max_tokens,
        stream,
        include_usage: stream,
        dp_rank: dp_rank(&obj)?,
        transfer,
        input_logprobs: false,
        lora: None,
    })
}

/// `data_parallel_rank`, if given.
/// How a chat's prompt ends: vLLM's `add_generation_prompt` (default
/// true) and `continue_final_message` (default false; it needs the first
/// false, and continues an assistant's final message).
fn chat_ending(obj: &Map<String, Value>) -> Result<ChatEnding, ApiError> {
    let flag = |name: &str, default: bool| match obj.get(name) {
        None | Some(Value::Null) => Ok(default),
        Some(Value::Bool(b)) => Ok(*b),
        Some(_) => Err(bad(format!("`{name}` must be a boolean"))),
    };
    let generation_prompt = flag("add_generation_prompt", true)?;
    match (flag("continue_final_message", false)?, generation_prompt) {
        (false, true) => Ok(ChatEnding::GenerationPrompt),
        (false, false) => Ok(ChatEnding::Messages),
        (true, true) => Err(bad(
            "`continue_final_message` and `add_generation_prompt` cannot both be true",
        )),
        (true, false) => {
            let last_role = obj
                .get("messages")
                .and_then(Value::as_array)
                .and_then(|m| m.last())
                .and_then(|m| m.get("role"))
                .and_then(Value::as_str);
            if last_role != Some("assistant") {
                return Err(bad(
                    "`continue_final_message` needs an assistant's final message",
                ));
            }
            Ok(ChatEnding::ContinueFinal)
        }
    }
}

fn dp_rank(obj: &Map<String, Value>) -> Result<Option<u32>, ApiError> {
    match obj.get("data_parallel_rank") {
        None | Some(Value::Null) => Ok(None),
        Some(v) => u32::try_from(field_u64(v, "data_parallel_rank")?)
            .map(Some)
            .map_err(|_| bad("`data_parallel_rank` is out of range")),
    }
}

/// `model`, if given.
fn model(obj: &Map<String, Value>) -> Result<Option<String>, ApiError> {
    match obj.get("model") {
        None | Some(Value::Null) => Ok(None),
        Some(Value::String(s)) => Ok(Some(s.clone())),
        Some(_) => Err(bad("`model` must be a string")),
    }
}

fn max_tokens(obj: &Map<String, Value>, endpoint: Endpoint) -> Result<usize, ApiError> {
    let keys: &[&str] = match endpoint {
        Endpoint::Completions | Endpoint::Generate => &["max_tokens"],
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

/// TensorRT-LLM's `mm_token_id_offset` in the mocker: the vocabulary size of
/// the Qwen2 models its built-in tokenizer numbers like (image position k of
/// a TensorRT-LLM prompt holds this plus k).
pub const TRTLLM_MM_TOKEN_ID_OFFSET: u64 = 151_936;

/// What the engine side needs to build requests.
#[derive(Debug, Clone, Copy)]
pub struct PromptSettings {
    /// Pads (SGLang), placeholders (vLLM) or digest-first ids (TensorRT-LLM).
    pub flavor: WorkerFlavor,
    /// Seed of the filler.
    pub seed: u64,
}

/// Renders a parsed request into the engine request and its planned output:
/// the neutral prompt (see [`kvroute_prompt::Renderer`]) with each image's
/// positions filled the imitated engine's way, and the filler it will
/// "generate". A request whose prompt and `max_tokens` cannot fit the
/// engine's `capacity_tokens` is refused before anything is allocated for
/// its output (a `max_tokens` of 10^11 would otherwise ask for terabytes).
pub fn build(
    parsed: &ParsedRequest,
    renderer: &Renderer,
    filler: &Filler,
    settings: PromptSettings,
    capacity_tokens: usize,
) -> Result<(NewRequest, Vec<FillerToken>), ApiError> {
    let NeutralPrompt {
        tokens: mut prompt,
        images,
    } = renderer.render(&parsed.prompt)?;
    if prompt.len().saturating_add(parsed.max_tokens) > capacity_tokens {
        let too_long = SubmitError::TooLong {
            prompt: prompt.len(),
            output: parsed.max_tokens,
            capacity: capacity_tokens,
        };
        return Err(bad(too_long.to_string()));
    }
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
            WorkerFlavor::Trtllm => {
                // Digest-first: position k holds the offset + k (position 0
                // is published as the image's digest).
                let end = image.start + image.len;
                if let Some(span) = prompt.get_mut(image.start..end) {
                    for (k, slot) in span.iter_mut().enumerate() {
                        *slot = TRTLLM_MM_TOKEN_ID_OFFSET + k as u64;
                    }
                }
                mm_items.push(MmPlacement {
                    start: image.start,
                    len: image.len,
                    identifier: image.identity.identifier,
                });
            }
        }
    }
    let filler = filler.tokens(settings.seed, &prompt, parsed.max_tokens);
    let request = NewRequest {
        prompt,
        output: filler.iter().map(|f| f.id).collect(),
        mm_items,
        lora_name: parsed.lora.clone(),
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
    /// `/generate` with `return_logprob`: the prompt's `input_token_logprobs`.
    pub input_logprobs: Option<Value>,
}

impl ResponseMeta {
    /// The non-streaming response body.
    pub fn full(&self, text: &str, usage: &Usage) -> Value {
        let choice = match self.endpoint {
            Endpoint::Generate => {
                return super::native::full(&self.id, text, usage, self.input_logprobs.as_ref())
            }
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
            Endpoint::Completions | Endpoint::Generate => json!({
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
            (Endpoint::Completions | Endpoint::Generate, _) => "text_completion",
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
    use kvroute_prompt::{ImageTokenRule, Segment, SpecialToken, Tokenizer};

    /// The built-in tokenizer with `n` positions per image, and its filler.
    fn prompter(n: usize) -> (Renderer, Filler) {
        let tokenizer = Tokenizer::builtin();
        let filler = Filler::new(&tokenizer).expect("builtin");
        (Renderer::new(tokenizer, ImageTokenRule::fixed(n)), filler)
    }

    fn parse_err(endpoint: Endpoint, body: &str) -> String {
        parse(endpoint, body.as_bytes())
            .expect_err("invalid body")
            .message()
            .to_owned()
    }

    #[test]
    fn an_output_budget_past_the_cache_is_refused_before_anything_is_allocated() {
        let (renderer, filler) = prompter(4);
        let p = parse(
            Endpoint::Completions,
            br#"{"prompt":[1,2,3],"max_tokens":99999999999}"#,
        )
        .expect("parses");
        let settings = PromptSettings {
            flavor: WorkerFlavor::Vllm,
            seed: 0,
        };
        let err = build(&p, &renderer, &filler, settings, 4096).expect_err("too long");
        assert_eq!(err.status(), axum::http::StatusCode::BAD_REQUEST);
        assert!(
            err.message()
                .contains("exceeds the KV cache of 4096 tokens"),
            "{}",
            err.message()
        );
    }

    #[test]
    fn completion_prompts_in_every_accepted_shape() {
        let p = parse(Endpoint::Completions, br#"{"prompt":"hi","max_tokens":3}"#).expect("ok");
        assert_eq!(p.prompt.segments, [Segment::Text("hi".into())]);
        assert_eq!(p.max_tokens, 3);
        let p = parse(Endpoint::Completions, br#"{"prompt":[1,2,3]}"#).expect("ok");
        assert_eq!(p.prompt.segments, [Segment::Tokens(vec![1, 2, 3])]);
        assert_eq!(p.max_tokens, DEFAULT_MAX_TOKENS);
        let p = parse(Endpoint::Completions, br#"{"prompt":[[7,8]]}"#).expect("ok");
        assert_eq!(p.prompt.segments, [Segment::Tokens(vec![7, 8])]);
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
            p.prompt.segments,
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
    fn a_final_assistant_message_is_continued_inside_its_turn() {
        let body = br#"{"messages":[{"role":"user","content":"hi"},{"role":"assistant","content":"Hel"}],"continue_final_message":true,"add_generation_prompt":false}"#;
        let p = parse(Endpoint::Chat, body).expect("ok");
        assert_eq!(
            p.prompt.segments[5..],
            [
                Segment::Special(SpecialToken::ImStart),
                Segment::Text("assistant\n".into()),
                Segment::Text("Hel".into()),
            ],
            "the final message stays open and no header follows"
        );
        let both =
            br#"{"messages":[{"role":"assistant","content":"a"}],"continue_final_message":true}"#;
        assert!(
            parse_err(Endpoint::Chat, std::str::from_utf8(both).expect("utf8"))
                .contains("cannot both be true")
        );
        let user_last = br#"{"messages":[{"role":"user","content":"a"}],"continue_final_message":true,"add_generation_prompt":false}"#;
        assert!(parse_err(
            Endpoint::Chat,
            std::str::from_utf8(user_last).expect("utf8")
        )
        .contains("assistant"));
    }

    #[test]
    fn images_become_wide_pads_for_sglang_and_placeholders_for_vllm() {
        let body = br#"{"messages":[{"role":"user","content":[{"type":"image_url","image_url":"data:image/png;base64,aGVsbG8="}]}]}"#;
        let p = parse(Endpoint::Chat, body).expect("ok");
        let (renderer, fill) = prompter(6);
        let settings = PromptSettings {
            flavor: WorkerFlavor::Sglang,
            seed: 0,
        };
        let (r, filler) = build(&p, &renderer, &fill, settings, usize::MAX).expect("ok");
        assert_eq!(filler.len(), DEFAULT_MAX_TOKENS);
        let pads = crate::multimodal::sglang_pad_values(0x2cf24dba5fb0a30e);
        let i = r
            .prompt
            .iter()
            .position(|&t| t == pads[0])
            .expect("pads present");
        assert_eq!(r.prompt[i - 1], kvroute_prompt::tokenizer::VISION_START);
        assert_eq!(
            &r.prompt[i..i + 6],
            &[pads[0], pads[1], pads[2], pads[3], pads[0], pads[1]]
        );
        assert_eq!(r.prompt[i + 6], kvroute_prompt::tokenizer::VISION_END);
        assert!(r.mm_items.is_empty());

        let (r, _) = build(
            &p,
            &renderer,
            &fill,
            PromptSettings {
                flavor: WorkerFlavor::Vllm,
                ..settings
            },
            usize::MAX,
        )
        .expect("ok");
        assert_eq!(r.mm_items.len(), 1);
        let item = &r.mm_items[0];
        assert_eq!(item.len, 6);
        assert!(item.identifier.starts_with("2cf24dba5fb0a30e"));
        assert!(r.prompt[item.start..item.start + 6]
            .iter()
            .all(|&t| t == kvroute_prompt::tokenizer::IMAGE_PAD));
    }

    #[test]
    fn supplied_mm_hashes_replace_the_image_identity_and_must_match_in_count() {
        let body = br#"{"messages":[{"role":"user","content":[{"type":"image_url","image_url":"https://x.invalid/a.png"}]}],"mm_hashes":["00000000000000ff"]}"#;
        let p = parse(Endpoint::Chat, body).expect("ok");
        assert_eq!(p.prompt.mm_hashes, Some(vec![255]));
        let settings = PromptSettings {
            flavor: WorkerFlavor::Sglang,
            seed: 0,
        };
        let (renderer, filler) = prompter(4);
        let (r, _) = build(&p, &renderer, &filler, settings, usize::MAX).expect("ok");
        let pads = crate::multimodal::sglang_pad_values(255);
        assert!(r.prompt.windows(4).any(|w| w == pads));
        let body = br#"{"messages":[{"role":"user","content":[{"type":"image_url","image_url":"x"}]}],"mm_hashes":[1,2]}"#;
        let p = parse(Endpoint::Chat, body).expect("ok");
        let err = build(&p, &renderer, &filler, settings, usize::MAX).expect_err("count mismatch");
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
        let (renderer, filler) = prompter(7);
        let bs = 4;
        for (flavor, router_flavor) in [
            (WorkerFlavor::Sglang, WorkerFlavor::Sglang),
            (WorkerFlavor::Vllm, WorkerFlavor::Vllm),
        ] {
            let settings = PromptSettings { flavor, seed: 0 };
            let neutral = renderer.render(&parsed.prompt).expect("ok");
            let folded: Vec<u32> = neutral.tokens.iter().map(|&t| fold_token_id(t)).collect();
            let expected =
                prompt_local_hashes(&folded, &neutral.images, router_flavor, bs, HASH_SEED);
            assert_eq!(expected.len(), folded.len() / bs);

            let (request, _) =
                build(&parsed, &renderer, &filler, settings, usize::MAX).expect("ok");
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
