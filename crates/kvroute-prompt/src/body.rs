//! Reading an OpenAI request body once, for the router: the fields routing
//! needs (model, prompt or messages, stream, LoRA and salt namespaces,
//! client image hashes, `include_usage`, the sampling fields an engine would
//! refuse), with a prompt of token ids read straight into ids. A text prompt
//! or chat messages are kept as parsed values for [`crate::Prompt`].
//! Everything else in the body is left to the engine, which gets the body
//! unchanged.

use kvroute_core::hash::LocalBlockHash;
use kvroute_core::multimodal::ImageSpan;
use kvroute_core::tokens::fold_token_id;
use serde_json::value::RawValue;
use serde_json::Value;

use crate::sampling::{self, SamplingFields};

/// Why a request body cannot be routed (answered with a 400).
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{0}")]
pub struct ParseError(pub String);

pub(crate) fn bad(message: impl Into<String>) -> ParseError {
    ParseError(message.into())
}

/// A prompt given as text, parsed once, for the tokenizer to render.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum TextPrompt {
    /// A completion's `prompt` (a string, or a list of strings).
    Completion(Value),
    /// A chat's `messages`.
    Chat(Value),
}

/// What routing needs from a completion or chat request.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct RoutingRequest {
    /// The `model` field.
    pub model: Option<String>,
    /// The prompt's token ids (folded): as the client gave them, or as the
    /// tokenizer rendered [`RoutingRequest::text`].
    pub tokens: Option<Vec<u32>>,
    /// The prompt, when the client gave text or messages instead of ids.
    pub text: Option<TextPrompt>,
    /// `stream: true`.
    pub stream: bool,
    /// `lora_name`, if given.
    pub lora_name: Option<String>,
    /// `cache_salt`, if given.
    pub cache_salt: Option<String>,
    /// The images of the prompt (from the tokenizer), each with its span in
    /// `tokens` and its identity; empty for prompts given as token ids.
    pub images: Vec<ImageSpan>,
    /// The client's own `mm_hashes` (then the proxy never adds them).
    pub mm_hashes: Option<Value>,
    /// `stream_options.include_usage: true`: the client wants the usage chunk.
    pub include_usage: bool,
    /// The output budget asked for (`max_completion_tokens` or `max_tokens`).
    pub max_tokens: Option<u64>,
    /// SGLang's `/generate` with `return_logprob`: the answer carries the
    /// prompt's log-probabilities, which a disaggregated request must
    /// gather from its prefill leg too.
    pub input_logprobs: bool,
    /// A Responses API continuation's `previous_response_id`: the
    /// conversation so far lives only on the worker that produced that
    /// response, so the router sends it to that worker.
    pub previous_response_id: Option<String>,
    /// The first prefill/decode hand-off field the client sent itself (one
    /// of [`HANDOFF_FIELDS`]), if any: the router sets these for its own
    /// hand-offs, and an engine obeys them (it would read KV from wherever
    /// they point), so the router refuses a request that carries one.
    pub handoff_field: Option<&'static str>,
    /// The body's own `priority` (vLLM's and SGLang's scheduling priority,
    /// lower first), which the engine obeys: the router holds it to what
    /// the client may ask for, as it does `x-priority`.
    pub engine_priority: Option<i64>,
}

/// A body's `priority`: absent or `null` is `None`; anything but an
/// integer is refused (the engine would read it as a priority).
pub(crate) fn priority_value(value: Option<&Value>) -> Result<Option<i64>, ParseError> {
    match value {
        None | Some(Value::Null) => Ok(None),
        Some(v) => v
            .as_i64()
            .map(Some)
            .ok_or_else(|| bad("`priority` must be an integer")),
    }
}

/// The body fields with which a router tells engines to hand KV over
/// between them: vLLM's `kv_transfer_params` and SGLang's bootstrap triple.
/// An engine trusts them, so only the router may set them.
pub const HANDOFF_FIELDS: [&str; 4] = [
    "kv_transfer_params",
    "bootstrap_host",
    "bootstrap_port",
    "bootstrap_room",
];

/// The first of [`HANDOFF_FIELDS`] a JSON object holds with a value other
/// than `null` (which engines read as absent).
pub(crate) fn handoff_field_in(obj: &serde_json::Map<String, Value>) -> Option<&'static str> {
    HANDOFF_FIELDS
        .into_iter()
        .find(|key| obj.get(*key).is_some_and(|v| !v.is_null()))
}

pub(crate) fn token_list(items: &[Value], key: &str) -> Result<Vec<u32>, ParseError> {
    items
        .iter()
        .map(|v| {
            v.as_u64()
                .map(fold_token_id)
                .ok_or_else(|| bad(format!("`{key}` must hold non-negative integer token ids")))
        })
        .collect()
}

/// Checks chat `messages` as routing reads them: a non-empty array of
/// objects whose `content` is absent, a string or an array of parts.
fn check_messages(messages: &Value) -> Result<(), ParseError> {
    let list = messages
        .as_array()
        .ok_or_else(|| bad("`messages` must be an array"))?;
    if list.is_empty() {
        return Err(bad("`messages` must not be empty"));
    }
    for m in list {
        let obj = m
            .as_object()
            .ok_or_else(|| bad("each message must be an object"))?;
        match obj.get("content") {
            None | Some(Value::Null | Value::String(_) | Value::Array(_)) => {}
            Some(_) => return Err(bad("message `content` must be a string or an array")),
        }
    }
    Ok(())
}

/// The top-level fields routing reads, left raw; every other field is
/// skipped without being built (bodies are mostly token ids and text).
#[derive(serde::Deserialize, Default)]
struct RawFields<'a> {
    #[serde(borrow, default)]
    model: Option<&'a RawValue>,
    #[serde(borrow, default)]
    prompt: Option<&'a RawValue>,
    #[serde(borrow, default)]
    messages: Option<&'a RawValue>,
    #[serde(borrow, default)]
    stream: Option<&'a RawValue>,
    #[serde(borrow, default)]
    lora_name: Option<&'a RawValue>,
    #[serde(borrow, default)]
    cache_salt: Option<&'a RawValue>,
    #[serde(borrow, default)]
    mm_hashes: Option<&'a RawValue>,
    #[serde(borrow, default)]
    stream_options: Option<&'a RawValue>,
    /// `/query` only: the prompt as token ids.
    #[serde(borrow, default)]
    token_ids: Option<&'a RawValue>,
    #[serde(borrow, default)]
    max_tokens: Option<&'a RawValue>,
    #[serde(borrow, default)]
    max_completion_tokens: Option<&'a RawValue>,
    #[serde(borrow, default)]
    n: Option<&'a RawValue>,
    #[serde(borrow, default)]
    temperature: Option<&'a RawValue>,
    #[serde(borrow, default)]
    logprobs: Option<&'a RawValue>,
    #[serde(borrow, default)]
    kv_transfer_params: Option<&'a RawValue>,
    #[serde(borrow, default)]
    bootstrap_host: Option<&'a RawValue>,
    #[serde(borrow, default)]
    bootstrap_port: Option<&'a RawValue>,
    #[serde(borrow, default)]
    bootstrap_room: Option<&'a RawValue>,
    #[serde(borrow, default)]
    priority: Option<&'a RawValue>,
}

impl<'a> RawFields<'a> {
    fn sampling(&self) -> SamplingFields<'a> {
        SamplingFields {
            max_tokens: self.max_tokens,
            max_completion_tokens: self.max_completion_tokens,
            n: self.n,
            temperature: self.temperature,
            logprobs: self.logprobs,
        }
    }

    /// The first hand-off field present (see [`HANDOFF_FIELDS`]).
    fn handoff_field(&self) -> Option<&'static str> {
        let present = [
            self.kv_transfer_params,
            self.bootstrap_host,
            self.bootstrap_port,
            self.bootstrap_room,
        ];
        HANDOFF_FIELDS
            .into_iter()
            .zip(present)
            .find_map(|(name, raw)| raw.map(|_| name))
    }
}

/// `stream_options.include_usage`, read leniently (anything but `true` is false;
/// the engine validates the field).
fn raw_include_usage(raw: Option<&RawValue>) -> bool {
    #[derive(serde::Deserialize)]
    struct Options {
        include_usage: Option<bool>,
    }
    raw.and_then(|r| serde_json::from_str::<Option<Options>>(r.get()).ok())
        .flatten()
        .and_then(|o| o.include_usage)
        .unwrap_or(false)
}

fn raw_str(raw: Option<&RawValue>, key: &str) -> Result<Option<String>, ParseError> {
    match raw {
        None => Ok(None),
        Some(r) => serde_json::from_str::<Option<String>>(r.get())
            .map_err(|_| bad(format!("`{key}` must be a string"))),
    }
}

fn raw_prompt(raw: &RawValue, req: &mut RoutingRequest) -> Result<(), ParseError> {
    let text = raw.get();
    if text.starts_with('[') {
        // The common cases first, without building a `Value`.
        if let Ok(ids) = serde_json::from_str::<Vec<u64>>(text) {
            if ids.is_empty() {
                return Err(bad("`prompt` must not be empty"));
            }
            req.tokens = Some(ids.into_iter().map(fold_token_id).collect());
            return Ok(());
        }
        if let Ok(mut batch) = serde_json::from_str::<Vec<Vec<u64>>>(text) {
            if batch.len() == 1 {
                let ids = batch.remove(0);
                if ids.is_empty() {
                    return Err(bad("`prompt` must not be empty"));
                }
                req.tokens = Some(ids.into_iter().map(fold_token_id).collect());
                return Ok(());
            }
        }
    }
    let value: Value =
        serde_json::from_str(text).map_err(|e| bad(format!("invalid JSON body: {e}")))?;
    match value {
        Value::Null => return Err(bad("`prompt` is required")),
        Value::String(_) => req.text = Some(TextPrompt::Completion(value)),
        Value::Array(ref items) => match items.as_slice() {
            [] => return Err(bad("`prompt` must not be empty")),
            [Value::Array(ids)] if ids.is_empty() => return Err(bad("`prompt` must not be empty")),
            [Value::Array(ids)] => req.tokens = Some(token_list(ids, "prompt")?),
            items if items.iter().all(Value::is_number) => {
                req.tokens = Some(token_list(items, "prompt")?);
            }
            // Text, or a batch of prompts: the tokenizer decides.
            _ => req.text = Some(TextPrompt::Completion(value)),
        },
        _ => return Err(bad("`prompt` must be a string or token ids")),
    }
    Ok(())
}

/// JSON's whitespace (RFC 8259; narrower than `u8::is_ascii_whitespace`).
fn is_json_ws(b: u8) -> bool {
    matches!(b, b' ' | b'\n' | b'\r' | b'\t')
}

fn skip_json_ws(body: &[u8], mut i: usize) -> usize {
    while body.get(i).copied().is_some_and(is_json_ws) {
        i += 1;
    }
    i
}

/// How many of eight bytes (in text order) are ASCII digits before the
/// first that is not, and the number they spell (SWAR: no branch per digit).
fn leading_digits(chunk: [u8; 8]) -> (u64, usize) {
    const HIGH: u64 = 0xF0F0_F0F0_F0F0_F0F0;
    const THREES: u64 = 0x3030_3030_3030_3030;
    const LOW7: u64 = 0x7F7F_7F7F_7F7F_7F7F;
    let x = u64::from_le_bytes(chunk);
    // A byte is a digit when its high nibble is 3, and still is 6 higher. A
    // carry out of a byte (from 0xFA and up, never a digit) only disturbs
    // bytes after the first non-digit.
    let off = ((x & HIGH) ^ THREES) | ((x.wrapping_add(0x0606_0606_0606_0606) & HIGH) ^ THREES);
    // The high bit of each byte that is not a digit.
    let non_digits = (((off & LOW7) + LOW7) | off) & !LOW7;
    let n = (non_digits.trailing_zeros() / 8) as usize;
    if n == 0 {
        return (0, 0);
    }
    // The digits, first in the most significant place, padded with leading
    // zeros to eight, combined pairwise (Lemire's eight-digit parse).
    let mut v = (x & 0x0F0F_0F0F_0F0F_0F0F) << (8 * (8 - n));
    v = (v.wrapping_mul(10 * 256 + 1) >> 8) & 0x00FF_00FF_00FF_00FF;
    v = (v.wrapping_mul(100 * 65_536 + 1) >> 16) & 0x0000_FFFF_0000_FFFF;
    v = v.wrapping_mul(10_000 * (1 << 32) + 1) >> 32;
    (v, n)
}

/// A non-empty JSON array of non-negative integers that fit in 64 bits
/// starting at `body[i]` (`[`), folded to token ids, and the offset just
/// past its `]`. `None` for anything else (an empty array, negative, decimal
/// or exponent numbers, other elements, malformed text): the caller then
/// takes the general path, which decides.
fn scan_token_ids(body: &[u8], i: usize) -> Option<(Vec<u32>, usize)> {
    if body.get(i) != Some(&b'[') {
        return None;
    }
    let mut j = skip_json_ws(body, i + 1);
    // Ids take 2 bytes or more with their commas; most take 4 or more.
    let mut out = Vec::with_capacity((body.len() - j) / 4);
    loop {
        let start = j;
        // Eight bytes at a time while they last (token ids have up to 6 or 7
        // digits), then digit by digit.
        let (mut v, n) = match body.get(j..j + 8) {
            Some(chunk) => leading_digits(chunk.try_into().ok()?),
            None => (0, 0),
        };
        j += n;
        if n == 8 || body.len() < start + 8 {
            while let Some(&d) = body.get(j) {
                if !d.is_ascii_digit() {
                    break;
                }
                // 19 digits cannot overflow; longer ids go the general way.
                if j - start == 19 {
                    return None;
                }
                v = v * 10 + u64::from(d - b'0');
                j += 1;
            }
        }
        // JSON has no leading zeros.
        if j == start || (body[start] == b'0' && j - start > 1) {
            return None;
        }
        out.push(fold_token_id(v));
        j = skip_json_ws(body, j);
        match body.get(j) {
            Some(b',') => j = skip_json_ws(body, j + 1),
            Some(b']') => return Some((out, j + 1)),
            _ => return None,
        }
    }
}

/// The fields of [`RawFields`] read in one pass over a well-formed body,
/// with a `prompt` of token ids read straight into ids (the bulk of most
/// bodies) instead of being scanned twice. Every other value is checked by
/// serde as it would be by [`RawFields`]'s derive.
///
/// `None` whenever this reading might differ from the derive's, which then
/// decides (and words any error): a body that is not one plain object, keys
/// with escapes or non-ASCII bytes, a field routing reads given twice, a
/// prompt that is not a non-empty list of integer ids, trailing text.
fn scan_fields(body: &[u8]) -> Option<(RawFields<'_>, Option<Vec<u32>>)> {
    let mut raw = RawFields::default();
    let mut ids = None;
    let mut seen = 0u32;
    let mut i = skip_json_ws(body, 0);
    if body.get(i) != Some(&b'{') {
        return None;
    }
    i = skip_json_ws(body, i + 1);
    if body.get(i) == Some(&b'}') {
        i += 1;
    } else {
        loop {
            if body.get(i) != Some(&b'"') {
                return None;
            }
            let start = i + 1;
            let len = body.get(start..)?.iter().position(|&b| b == b'"')?;
            let key = &body[start..start + len];
            if key
                .iter()
                .any(|&b| !(0x20..0x7f).contains(&b) || b == b'\\')
            {
                return None;
            }
            i = skip_json_ws(body, start + len + 1);
            if body.get(i) != Some(&b':') {
                return None;
            }
            i = skip_json_ws(body, i + 1);
            let slot: Option<(u16, &mut Option<&RawValue>)> = match key {
                b"model" => Some((0, &mut raw.model)),
                b"prompt" => Some((1, &mut raw.prompt)),
                b"messages" => Some((2, &mut raw.messages)),
                b"stream" => Some((3, &mut raw.stream)),
                b"lora_name" => Some((4, &mut raw.lora_name)),
                b"cache_salt" => Some((5, &mut raw.cache_salt)),
                b"mm_hashes" => Some((6, &mut raw.mm_hashes)),
                b"stream_options" => Some((7, &mut raw.stream_options)),
                b"token_ids" => Some((8, &mut raw.token_ids)),
                b"max_tokens" => Some((9, &mut raw.max_tokens)),
                b"max_completion_tokens" => Some((10, &mut raw.max_completion_tokens)),
                b"n" => Some((11, &mut raw.n)),
                b"temperature" => Some((12, &mut raw.temperature)),
                b"logprobs" => Some((13, &mut raw.logprobs)),
                b"kv_transfer_params" => Some((14, &mut raw.kv_transfer_params)),
                b"bootstrap_host" => Some((15, &mut raw.bootstrap_host)),
                b"bootstrap_port" => Some((16, &mut raw.bootstrap_port)),
                b"bootstrap_room" => Some((17, &mut raw.bootstrap_room)),
                b"priority" => Some((18, &mut raw.priority)),
                _ => None,
            };
            if let Some((bit, _)) = slot {
                if seen & (1 << bit) != 0 {
                    return None;
                }
                seen |= 1 << bit;
            }
            let found = if key == b"prompt" {
                scan_token_ids(body, i)
            } else {
                None
            };
            match found {
                Some((found, end)) => {
                    ids = Some(found);
                    i = end;
                }
                None => {
                    let mut values = serde_json::Deserializer::from_slice(body.get(i..)?)
                        .into_iter::<&RawValue>();
                    let value = values.next()?.ok()?;
                    i += values.byte_offset();
                    if let Some((_, field)) = slot {
                        // As `Option<&RawValue>` reads it: `null` is absent.
                        *field = (value.get() != "null").then_some(value);
                    }
                }
            }
            i = skip_json_ws(body, i);
            match body.get(i) {
                Some(b',') => i = skip_json_ws(body, i + 1),
                Some(b'}') => {
                    i += 1;
                    break;
                }
                _ => return None,
            }
        }
    }
    (skip_json_ws(body, i) == body.len()).then_some((raw, ids))
}

/// Reads the fields routing needs from a request body; `chat` selects
/// `messages` instead of `prompt`. Everything else is left to the engine.
pub fn parse_request(body: &[u8], chat: bool) -> Result<RoutingRequest, ParseError> {
    let (raw, ids) = read_fields(body)?;
    request_of(&raw, ids, chat)
}

/// [`parse_request`] by serde's derive alone, without the one-pass scan: the
/// reference the scan must equal on every body (tests and fuzzing compare
/// the two).
pub fn parse_request_by_serde(body: &[u8], chat: bool) -> Result<RoutingRequest, ParseError> {
    request_of(&slow_fields(body)?, None, chat)
}

/// The fields routing reads, in one pass when the body allows it.
fn read_fields(body: &[u8]) -> Result<(RawFields<'_>, Option<Vec<u32>>), ParseError> {
    match scan_fields(body) {
        Some(found) => Ok(found),
        None => Ok((slow_fields(body)?, None)),
    }
}

/// The request `raw` describes; `ids`: its prompt's token ids, when already read.
fn request_of(
    raw: &RawFields<'_>,
    ids: Option<Vec<u32>>,
    chat: bool,
) -> Result<RoutingRequest, ParseError> {
    let stream = match raw.stream {
        None => false,
        Some(r) => serde_json::from_str::<Option<bool>>(r.get())
            .map_err(|_| bad("`stream` must be a boolean"))?
            .unwrap_or(false),
    };
    let mut req = RoutingRequest {
        model: raw_str(raw.model, "model")?,
        stream,
        lora_name: raw_str(raw.lora_name, "lora_name")?,
        cache_salt: raw_str(raw.cache_salt, "cache_salt")?,
        mm_hashes: raw
            .mm_hashes
            .filter(|r| r.get() != "null")
            .and_then(|r| serde_json::from_str(r.get()).ok()),
        include_usage: raw_include_usage(raw.stream_options),
        max_tokens: sampling::check(&raw.sampling(), chat).map_err(bad)?,
        handoff_field: raw.handoff_field(),
        engine_priority: match raw.priority {
            None => None,
            Some(r) => serde_json::from_str::<Option<i64>>(r.get())
                .map_err(|_| bad("`priority` must be an integer"))?,
        },
        ..RoutingRequest::default()
    };
    if chat {
        let messages = raw.messages.ok_or_else(|| bad("`messages` is required"))?;
        let messages: Value = serde_json::from_str(messages.get())
            .map_err(|e| bad(format!("invalid JSON body: {e}")))?;
        check_messages(&messages)?;
        req.text = Some(TextPrompt::Chat(messages));
        return Ok(req);
    }
    if let Some(ids) = ids {
        req.tokens = Some(ids);
        return Ok(req);
    }
    match raw.prompt {
        None => Err(bad("`prompt` is required")),
        Some(p) => raw_prompt(p, &mut req).map(|()| req),
    }
}

/// [`RawFields`] by serde's derive, with its errors worded for the client.
fn slow_fields(body: &[u8]) -> Result<RawFields<'_>, ParseError> {
    let first = body.iter().find(|b| !b.is_ascii_whitespace());
    if first.is_some_and(|&b| b != b'{') {
        // Valid JSON that is not an object, or not JSON at all.
        return Err(
            match serde_json::from_slice::<serde::de::IgnoredAny>(body) {
                Ok(_) => bad("the body must be a JSON object"),
                Err(e) => bad(format!("invalid JSON body: {e}")),
            },
        );
    }
    serde_json::from_slice(body).map_err(|e| bad(format!("invalid JSON body: {e}")))
}

/// A `/query` body: `token_ids`, `prompt` or `messages`, and the namespace fields.
pub fn parse_query(body: &[u8]) -> Result<RoutingRequest, ParseError> {
    let (raw, ids) = read_fields(body)?;
    if let Some(ids) = raw.token_ids {
        let ids: Vec<Value> =
            serde_json::from_str(ids.get()).map_err(|_| bad("`token_ids` must be an array"))?;
        return Ok(RoutingRequest {
            tokens: Some(token_list(&ids, "token_ids")?),
            lora_name: raw_str(raw.lora_name, "lora_name")?,
            cache_salt: raw_str(raw.cache_salt, "cache_salt")?,
            ..RoutingRequest::default()
        });
    }
    let chat = raw.messages.is_some();
    // A prompt of token ids is read by the fast scan, which leaves no raw field.
    if !chat && raw.prompt.is_none() && ids.is_none() {
        return Err(bad("give `token_ids`, `prompt` or `messages`"));
    }
    request_of(&raw, ids, chat)
}

/// A `/query_by_hash` body's `local_hashes`.
pub fn parse_hash_query(body: &[u8]) -> Result<Vec<LocalBlockHash>, ParseError> {
    let value: Value =
        serde_json::from_slice(body).map_err(|e| bad(format!("invalid JSON body: {e}")))?;
    let list = value
        .get("local_hashes")
        .and_then(Value::as_array)
        .ok_or_else(|| bad("`local_hashes` (an array of integers) is required"))?;
    list.iter()
        .map(|v| {
            v.as_u64()
                .or_else(|| v.as_i64().map(|i| i as u64))
                .map(LocalBlockHash)
                .ok_or_else(|| bad("`local_hashes` must hold 64-bit integers"))
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn prompts_parse_as_ids_or_text() {
        let r = parse_request(
            br#"{"model":"m","prompt":[1,2,5000000000],"stream":true}"#,
            false,
        )
        .expect("valid");
        assert_eq!(r.model.as_deref(), Some("m"));
        assert!(r.stream);
        assert_eq!(r.tokens, Some(vec![1, 2, fold_token_id(5_000_000_000)]));
        let r = parse_request(br#"{"prompt":[[7,8]],"cache_salt":"s"}"#, false).expect("valid");
        assert_eq!(
            (r.tokens, r.cache_salt.as_deref()),
            (Some(vec![7, 8]), Some("s"))
        );
        let r = parse_request(br#"{"prompt":"hello"}"#, false).expect("valid");
        assert_eq!(r.text, Some(TextPrompt::Completion(json!("hello"))));
        let r = parse_request(
            br#"{"messages":[{"role":"user","content":[{"type":"text","text":"hi"}]}]}"#,
            true,
        )
        .expect("valid");
        assert_eq!(
            r.text,
            Some(TextPrompt::Chat(
                json!([{"role": "user", "content": [{"type": "text", "text": "hi"}]}])
            ))
        );
    }

    #[test]
    fn bad_bodies_are_refused_with_a_reason() {
        let err = |b: &[u8], chat| parse_request(b, chat).expect_err("invalid").0;
        assert!(err(b"{", false).contains("invalid JSON"));
        assert!(err(b"[1]", false).contains("JSON object"));
        assert!(err(b"{}", false).contains("`prompt` is required"));
        assert!(err(br#"{"prompt":[1,-2]}"#, false).contains("token ids"));
        assert!(err(br#"{"prompt":"x","stream":"yes"}"#, false).contains("`stream`"));
        assert!(err(br#"{"messages":5}"#, true).contains("array"));
        assert!(err(br#"{"prompt":[]}"#, false).contains("empty"));
        assert!(err(br#"{"prompt":[[]]}"#, false).contains("empty"));
        assert!(err(br#"{"prompt":null}"#, false).contains("required"));
        assert!(err(br#"{"prompt":[1],"model":3}"#, false).contains("`model`"));
        assert!(parse_query(br#"{"nothing":1}"#).is_err());
        let ids = parse_query(br#"{"model":"m","prompt":[0,1,2]}"#).expect("valid");
        assert_eq!(ids.tokens, Some(vec![0, 1, 2]));
        assert_eq!(
            parse_hash_query(br#"{"local_hashes":[1,-1]}"#).expect("valid"),
            vec![LocalBlockHash(1), LocalBlockHash(u64::MAX)]
        );
    }

    #[test]
    fn include_usage_is_read() {
        let r = parse_request(
            br#"{"prompt":[1],"stream":true,"stream_options":{"include_usage":true}}"#,
            false,
        )
        .expect("valid");
        assert!(r.include_usage);
        for body in [
            &br#"{"prompt":[1],"stream":true}"#[..],
            br#"{"prompt":[1],"stream_options":null}"#,
            br#"{"prompt":[1],"stream_options":{"continuous_usage_stats":true}}"#,
        ] {
            assert!(!parse_request(body, false).expect("valid").include_usage);
        }
    }

    #[test]
    fn client_mm_hashes_are_noticed() {
        let body = br#"{"messages":[{"role":"user","content":"x"}],"mm_hashes":[1]}"#;
        assert!(parse_request(body, true)
            .expect("valid")
            .mm_hashes
            .is_some());
        let body = br#"{"messages":[{"role":"user","content":"x"}],"mm_hashes":null}"#;
        assert!(parse_request(body, true)
            .expect("valid")
            .mm_hashes
            .is_none());
    }

    fn general(body: &[u8], chat: bool) -> Result<RoutingRequest, ParseError> {
        parse_request_by_serde(body, chat)
    }

    #[test]
    fn the_one_pass_scan_reads_bodies_as_serde_does() {
        let long: Vec<String> = (0..300u64)
            .map(|i| (i * 7_919_113 % 100_000_007).to_string())
            .collect();
        let long = format!(r#"{{"prompt":[{}],"model":"m"}}"#, long.join(","));
        let bodies: Vec<&[u8]> = vec![
            br#"{"model":"m","prompt":[1,2,5000000000],"stream":true}"#,
            br#" { "prompt" : [ 0 , 12 ,345678, 99999999, 123456789 ] , "max_tokens" : 1 } "#,
            b"{\"prompt\":\n[1,\t2]\r\n}\n",
            br#"{"prompt":[18446744073709551615]}"#,
            br#"{"prompt":[18446744073709551616]}"#,
            br#"{"prompt":[9999999999999999999,1]}"#,
            br#"{"prompt":[00]}"#,
            br#"{"prompt":[01]}"#,
            br#"{"prompt":[-0]}"#,
            br#"{"prompt":[1.0]}"#,
            br#"{"prompt":[1e3]}"#,
            br#"{"prompt":[1,]}"#,
            br#"{"prompt":[1 2]}"#,
            br#"{"prompt":[]}"#,
            br#"{"prompt":[[7,8]]}"#,
            br#"{"prompt":[[]]}"#,
            br#"{"prompt":["a"]}"#,
            br#"{"prompt":"text","stream":false}"#,
            br#"{"prompt":null}"#,
            br#"{"prompt":[1],"prompt":[2]}"#,
            br#"{"prompt":[1],"model":null,"model":"m"}"#,
            br#"{"prompt":[1],"x":1,"x":2}"#,
            br#"{"pro\u006dpt":[1]}"#,
            br#"{"prompt":[1],"stream_options":{"include_usage":true},"mm_hashes":[3]}"#,
            br#"{"prompt":[1],"mm_hashes":null,"lora_name":"l","cache_salt":"s"}"#,
            br#"{"prompt":[1],"extra":{"a":[1,{"b":"\u00e9\""}],"c":-1.5e-3}}"#,
            br#"{"prompt":[1],"extra":tru}"#,
            br#"{"prompt":[1],"extra":"\x"}"#,
            br#"{"prompt":[1]}x"#,
            br#"{"prompt":[1]} {}"#,
            br#"{"prompt":[1],}"#,
            br#"{"prompt":[1]"#,
            br#"{"prompt":[1"#,
            br#"{"prompt":[123456"#,
            br#"{"prompt":[12345678901"#,
            b"{\"prompt\":[1]}\x0c",
            b"{\"prompt\":[1],\"x\":\"\xff\"}",
            b"{\"prompt\":[1\xff]}",
            br#"{}"#,
            br#"{ }"#,
            br#"[1]"#,
            br#""#,
            br#"{"messages":[{"role":"user","content":"hi"}],"prompt":[1]}"#,
            br#"{"messages":[{"role":"user","content":[{"type":"text","text":"x"}]}]}"#,
            br#"{"messages":[]}"#,
            long.as_bytes(),
        ];
        for body in bodies {
            for chat in [false, true] {
                assert_eq!(
                    parse_request(body, chat),
                    general(body, chat),
                    "{} (chat: {chat})",
                    String::from_utf8_lossy(body)
                );
            }
        }
        assert!(scan_fields(long.as_bytes()).is_some_and(|(_, ids)| ids.is_some()));
    }

    #[test]
    fn eight_digits_at_a_time() {
        for text in [
            "12345678", "1234567,", "0,", "9]", "x", "99999999", "1 ", "10000000",
        ] {
            let mut chunk = [b' '; 8];
            chunk[..text.len()].copy_from_slice(text.as_bytes());
            let n = text.bytes().take_while(u8::is_ascii_digit).count();
            let v = text[..n].parse::<u64>().unwrap_or(0);
            assert_eq!(leading_digits(chunk), (v, n), "{text}");
        }
        assert_eq!(leading_digits(*b"12\xff45678"), (12, 2));
        assert_eq!(leading_digits(*b"\xfa3456789"), (0, 0));
        assert_eq!(leading_digits(*b"1/:23456"), (1, 1));
    }
}
