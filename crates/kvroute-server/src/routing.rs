//! The pure half of routing: what a request body says that routing needs,
//! the candidates and their costs, the order in which they are tried, and
//! the one body rewrite (the SGLang data-parallel rank).
//!
//! Nothing here touches a socket or a clock; `proxy` does the I/O.

use kvroute_core::event::WorkerFlavor;
use kvroute_core::hash::{namespace_seed, LocalBlockHash, SequenceHash};
use kvroute_core::index::{RankMatch, WorkerId, WorkerRank};
use kvroute_core::multimodal::{prompt_local_hashes, ImageSpan};
use kvroute_core::scheduler::{pick, ActiveSequences, Candidate, CostBreakdown, CostWeights};
use kvroute_core::tokens::fold_token_id;
use serde_json::value::RawValue;
use serde_json::Value;

/// Why a request body cannot be routed (answered with a 400).
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{0}")]
pub struct ParseError(pub String);

fn bad(message: impl Into<String>) -> ParseError {
    ParseError(message.into())
}

/// What routing needs from a completion or chat request.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct RoutingRequest {
    /// The `model` field.
    pub model: Option<String>,
    /// The prompt's token ids (folded), when the client gave ids.
    pub tokens: Option<Vec<u32>>,
    /// The prompt as text (completions with a text prompt, or chat messages'
    /// text), when the client gave no ids.
    pub text: Option<String>,
    /// `stream: true`.
    pub stream: bool,
    /// `lora_name`, if given.
    pub lora_name: Option<String>,
    /// `cache_salt`, if given.
    pub cache_salt: Option<String>,
    /// The images of the prompt (from the tokenizer), each with its span in
    /// `tokens` and its identity; empty for prompts given as token ids.
    pub images: Vec<ImageSpan>,
    /// The client sent `mm_hashes` itself (then the proxy never adds them).
    pub mm_hashes_given: bool,
    /// `stream_options.include_usage: true`: the client wants the usage chunk.
    pub include_usage: bool,
}

fn opt_str(obj: &serde_json::Map<String, Value>, key: &str) -> Result<Option<String>, ParseError> {
    match obj.get(key) {
        None | Some(Value::Null) => Ok(None),
        Some(Value::String(s)) => Ok(Some(s.clone())),
        Some(_) => Err(bad(format!("`{key}` must be a string"))),
    }
}

fn token_list(items: &[Value], key: &str) -> Result<Vec<u32>, ParseError> {
    items
        .iter()
        .map(|v| {
            v.as_u64()
                .map(fold_token_id)
                .ok_or_else(|| bad(format!("`{key}` must hold non-negative integer token ids")))
        })
        .collect()
}

/// The text of chat `messages`: string contents and `text` parts, joined by newlines.
fn messages_text(messages: &Value) -> Result<String, ParseError> {
    let list = messages
        .as_array()
        .ok_or_else(|| bad("`messages` must be an array"))?;
    if list.is_empty() {
        return Err(bad("`messages` must not be empty"));
    }
    let mut out = String::new();
    for m in list {
        let obj = m
            .as_object()
            .ok_or_else(|| bad("each message must be an object"))?;
        if let Some(role) = obj.get("role").and_then(Value::as_str) {
            out.push_str(role);
            out.push('\n');
        }
        match obj.get("content") {
            None | Some(Value::Null) => {}
            Some(Value::String(s)) => out.push_str(s),
            Some(Value::Array(parts)) => {
                for p in parts {
                    if let Some(t) = p.get("text").and_then(Value::as_str) {
                        out.push_str(t);
                    }
                }
            }
            Some(_) => return Err(bad("message `content` must be a string or an array")),
        }
        out.push('\n');
    }
    Ok(out)
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
                req.tokens = Some(ids.into_iter().map(fold_token_id).collect());
                return Ok(());
            }
        }
    }
    let value: Value =
        serde_json::from_str(text).map_err(|e| bad(format!("invalid JSON body: {e}")))?;
    match value {
        Value::Null => return Err(bad("`prompt` is required")),
        Value::String(s) => req.text = Some(s),
        Value::Array(items) => match items.as_slice() {
            [] => return Err(bad("`prompt` must not be empty")),
            [Value::String(s)] => req.text = Some(s.clone()),
            [Value::Array(ids)] => req.tokens = Some(token_list(ids, "prompt")?),
            items if items.iter().all(Value::is_number) => {
                req.tokens = Some(token_list(items, "prompt")?);
            }
            // A batch of prompts: route on their text.
            items => {
                req.text = Some(
                    items
                        .iter()
                        .filter_map(Value::as_str)
                        .collect::<Vec<_>>()
                        .join("\n"),
                );
            }
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
    let mut seen = 0u16;
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
    let (raw, ids) = match scan_fields(body) {
        Some(found) => found,
        None => (slow_fields(body)?, None),
    };
    request_of(&raw, ids, chat)
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
        mm_hashes_given: raw.mm_hashes.is_some_and(|r| r.get() != "null"),
        include_usage: raw_include_usage(raw.stream_options),
        ..RoutingRequest::default()
    };
    if chat {
        let messages = raw.messages.ok_or_else(|| bad("`messages` is required"))?;
        let messages: Value = serde_json::from_str(messages.get())
            .map_err(|e| bad(format!("invalid JSON body: {e}")))?;
        req.text = Some(messages_text(&messages)?);
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
    let value: Value =
        serde_json::from_slice(body).map_err(|e| bad(format!("invalid JSON body: {e}")))?;
    let obj = value
        .as_object()
        .ok_or_else(|| bad("the body must be a JSON object"))?;
    if let Some(ids) = obj.get("token_ids") {
        let ids = ids
            .as_array()
            .ok_or_else(|| bad("`token_ids` must be an array"))?;
        return Ok(RoutingRequest {
            tokens: Some(token_list(ids, "token_ids")?),
            lora_name: opt_str(obj, "lora_name")?,
            cache_salt: opt_str(obj, "cache_salt")?,
            ..RoutingRequest::default()
        });
    }
    let chat = obj.contains_key("messages");
    if !chat && !obj.contains_key("prompt") {
        return Err(bad("give `token_ids`, `prompt` or `messages`"));
    }
    parse_request(body, chat)
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

/// The local block hashes of a request at `block_size`, as a worker of
/// `flavor` publishes them (the flavour matters only for prompts with images:
/// SGLang's folded wide pads, or vLLM's item hashes on overlapping blocks).
pub fn request_hashes(
    req: &RoutingRequest,
    block_size: u32,
    flavor: WorkerFlavor,
) -> Vec<LocalBlockHash> {
    let Some(tokens) = &req.tokens else {
        return Vec::new();
    };
    let seed = namespace_seed(req.lora_name.as_deref(), req.cache_salt.as_deref());
    prompt_local_hashes(tokens, &req.images, flavor, block_size as usize, seed)
}

/// Adds `"data_parallel_rank": rank` to a JSON object body (SGLang's way of
/// choosing a rank).
pub fn inject_dp_rank(body: &[u8], rank: u32) -> Result<Vec<u8>, ParseError> {
    if let Some(b) = append_field(body, "data_parallel_rank", &rank.to_string()) {
        return Ok(b);
    }
    inject_field(body, "data_parallel_rank", Value::from(rank))
}

/// Adds `"mm_hashes": [h, …]` (one unsigned 64-bit integer per image, in
/// order) to a JSON object body, so an SGLang worker seeds each image's pad
/// ids with the identity the router hashed (SGLang honours client-supplied
/// hashes) instead of hashing the processed image itself.
pub fn inject_mm_hashes(body: &[u8], hashes: &[u64]) -> Result<Vec<u8>, ParseError> {
    let list: Vec<String> = hashes.iter().map(u64::to_string).collect();
    if let Some(b) = append_field(body, "mm_hashes", &format!("[{}]", list.join(","))) {
        return Ok(b);
    }
    inject_field(
        body,
        "mm_hashes",
        Value::Array(hashes.iter().map(|&h| Value::from(h)).collect()),
    )
}

/// Sets `stream_options.include_usage` to `true` (keeping any other stream
/// options), so a streaming engine ends with its usage chunk, whose
/// `cached_tokens` the accuracy metric reads; the proxy strips that chunk
/// again for clients that did not ask for it.
pub fn inject_include_usage(body: &[u8]) -> Result<Vec<u8>, ParseError> {
    if let Some(b) = append_field(body, "stream_options", r#"{"include_usage":true}"#) {
        return Ok(b);
    }
    let mut value: Value =
        serde_json::from_slice(body).map_err(|e| bad(format!("invalid JSON body: {e}")))?;
    let obj = value
        .as_object_mut()
        .ok_or_else(|| bad("the body must be a JSON object"))?;
    let options = obj
        .entry("stream_options")
        .or_insert_with(|| Value::Object(serde_json::Map::new()));
    if !options.is_object() {
        *options = Value::Object(serde_json::Map::new());
    }
    if let Some(o) = options.as_object_mut() {
        o.insert("include_usage".into(), Value::Bool(true));
    }
    serde_json::to_vec(&value).map_err(|e| bad(e.to_string()))
}

/// The cheap path of the injections above, for a body already validated as
/// a JSON object: `,"key":value` written before its closing brace, without
/// parsing the (possibly long) prompt again. `None` (use the full parse)
/// when `"key"` appears anywhere in the body, since it might be a top-level
/// key to merge with or replace, or when the body does not end in `}`.
fn append_field(body: &[u8], key: &str, value_json: &str) -> Option<Vec<u8>> {
    let quoted = format!("\"{key}\"");
    if contains(body, quoted.as_bytes()) {
        return None;
    }
    let end = body.iter().rposition(|b| !b.is_ascii_whitespace())?;
    if body[end] != b'}' {
        return None;
    }
    let before = body[..end].iter().rposition(|b| !b.is_ascii_whitespace())?;
    let empty = body[before] == b'{';
    let mut out = Vec::with_capacity(body.len() + quoted.len() + value_json.len() + 2);
    out.extend_from_slice(&body[..end]);
    if !empty {
        out.push(b',');
    }
    out.extend_from_slice(quoted.as_bytes());
    out.push(b':');
    out.extend_from_slice(value_json.as_bytes());
    out.push(b'}');
    Some(out)
}

/// Whether `needle` (which starts with a quote) occurs in `haystack`.
fn contains(haystack: &[u8], needle: &[u8]) -> bool {
    let Some((&first, rest)) = needle.split_first() else {
        return true;
    };
    let mut at = 0;
    while let Some(i) = haystack[at..].iter().position(|&b| b == first) {
        let start = at + i + 1;
        if haystack[start..].starts_with(rest) {
            return true;
        }
        at = start;
    }
    false
}

fn inject_field(body: &[u8], key: &str, field: Value) -> Result<Vec<u8>, ParseError> {
    let mut value: Value =
        serde_json::from_slice(body).map_err(|e| bad(format!("invalid JSON body: {e}")))?;
    let obj = value
        .as_object_mut()
        .ok_or_else(|| bad("the body must be a JSON object"))?;
    obj.insert(key.into(), field);
    serde_json::to_vec(&value).map_err(|e| bad(e.to_string()))
}

/// How the next (worker, rank) is chosen.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Policy {
    /// Lowest cost, with the index fed by KV events.
    Kv,
    /// Lowest cost, with the index fed by routing decisions (no events).
    Approx,
    /// Each candidate in turn.
    RoundRobin,
    /// Uniformly random.
    Random,
    /// Fewest active blocks, then fewest prefill tokens.
    LeastLoaded,
}

impl std::str::FromStr for Policy {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, String> {
        Ok(match s {
            "kv" => Policy::Kv,
            "approx" => Policy::Approx,
            "round-robin" => Policy::RoundRobin,
            "random" => Policy::Random,
            "least-loaded" => Policy::LeastLoaded,
            _ => {
                return Err(format!(
                    "unknown policy `{s}` (kv, approx, round-robin, random, least-loaded)"
                ))
            }
        })
    }
}

/// Busy thresholds: a candidate at or over either is skipped.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct BusyThresholds {
    /// Active prefill tokens.
    pub prefill_tokens: Option<u64>,
    /// Active decode blocks.
    pub decode_blocks: Option<u64>,
}

impl BusyThresholds {
    /// Whether a candidate with this load is overloaded.
    pub fn overloaded(&self, c: &Candidate) -> bool {
        self.prefill_tokens
            .is_some_and(|t| c.active_prefill_tokens >= t)
            || self
                .decode_blocks
                .is_some_and(|t| c.active_decode_blocks >= t)
    }
}

/// One (worker, rank) a request could go to.
#[derive(Debug, Clone, PartialEq)]
pub struct Scored {
    /// Worker name.
    pub name: String,
    /// Index of the worker in the caller's list.
    pub worker: usize,
    /// Index key.
    pub key: WorkerRank,
    /// Tokens per block at this worker.
    pub block_size: u32,
    /// The worker's engine flavour (which hashes of the request it was scored on).
    pub flavor: WorkerFlavor,
    /// Cache and load facts.
    pub candidate: Candidate,
    /// The cost.
    pub cost: CostBreakdown,
    /// Over a busy threshold.
    pub overloaded: bool,
}

/// A rank's load as the cost needs it, for one request.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Load {
    /// Prompt tokens in prefill.
    pub prefill_tokens: u64,
    /// Distinct active blocks.
    pub decode_blocks: u64,
    /// Of the request's blocks, those not active there.
    pub new_blocks: u64,
    /// Leading blocks of the request held by active requests.
    pub active_prefix: u32,
    /// Active requests.
    pub requests: u64,
}

impl Load {
    /// The load of `active` (or of an idle rank) for a request with blocks `seqs`.
    pub fn of(active: Option<&ActiveSequences>, seqs: &[SequenceHash]) -> Load {
        match active {
            None => Load {
                new_blocks: seqs.len() as u64,
                ..Load::default()
            },
            Some(a) => Load {
                prefill_tokens: a.active_prefill_tokens(),
                decode_blocks: a.active_blocks(),
                new_blocks: a.new_blocks(seqs),
                active_prefix: a.active_prefix(seqs),
                requests: a.active_requests(),
            },
        }
    }
}

/// A worker as routing sees it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Target {
    /// Name.
    pub name: String,
    /// Index id.
    pub id: WorkerId,
    /// HTTP base URL.
    pub url: String,
    /// Tokens per block.
    pub block_size: u32,
    /// Its data-parallel ranks.
    pub ranks: Vec<u32>,
    /// Its engine flavour: how it lays out images, so which request hashes apply.
    pub flavor: WorkerFlavor,
}

/// Builds one scored candidate per (worker, rank) of `targets` for which
/// `available(worker)` holds. `matches(block_size, flavor)` gives the index
/// matches and the request's sequence hashes at that block size for that
/// worker flavour (asked once per distinct pair); `active(key)` the rank's
/// active sequences.
pub fn score(
    targets: &[Target],
    request_tokens: u64,
    matches: &mut dyn FnMut(u32, WorkerFlavor) -> (Vec<RankMatch>, Vec<SequenceHash>),
    active: &dyn Fn(WorkerRank, &[SequenceHash]) -> Load,
    available: &dyn Fn(&str) -> bool,
    weights: &CostWeights,
    busy: &BusyThresholds,
) -> Vec<Scored> {
    type Cached = (u32, WorkerFlavor, Vec<RankMatch>, Vec<SequenceHash>);
    let mut cache: Vec<Cached> = Vec::new();
    let mut out = Vec::new();
    for (i, t) in targets.iter().enumerate() {
        if !available(&t.name) {
            continue;
        }
        let same = |c: &&Cached| c.0 == t.block_size && c.1 == t.flavor;
        if !cache.iter().any(|c| same(&c)) {
            let (m, s) = matches(t.block_size, t.flavor);
            cache.push((t.block_size, t.flavor, m, s));
        }
        let Some((_, _, found, seqs)) = cache.iter().find(same) else {
            continue;
        };
        for &rank in &t.ranks {
            let key = WorkerRank { worker: t.id, rank };
            let m = found.iter().find(|m| m.worker_rank == key);
            let load = active(key, seqs);
            let candidate = Candidate {
                device_blocks: m.map_or(0, |m| m.device),
                host_blocks: m.map_or(0, |m| m.host),
                any_blocks: m.map_or(0, |m| m.any),
                active_prefix_blocks: load.active_prefix,
                active_prefill_tokens: load.prefill_tokens,
                active_decode_blocks: load.decode_blocks,
                new_active_blocks: load.new_blocks,
                active_requests: load.requests,
            };
            out.push(Scored {
                name: t.name.clone(),
                worker: i,
                key,
                block_size: t.block_size,
                flavor: t.flavor,
                cost: candidate.cost(request_tokens, t.block_size, weights),
                overloaded: busy.overloaded(&candidate),
                candidate,
            });
        }
    }
    out
}

/// Orders the usable (not overloaded) candidates: the first is the choice,
/// the rest are retried in order. `random` is uniform in `[0, 1)`; `turn`
/// counts requests for round-robin.
pub fn order(
    scored: &[Scored],
    policy: Policy,
    temperature: f64,
    random: f64,
    turn: u64,
) -> Vec<usize> {
    let usable: Vec<usize> = (0..scored.len())
        .filter(|&i| !scored[i].overloaded)
        .collect();
    if usable.is_empty() {
        return usable;
    }
    let by_cost = |mut v: Vec<usize>| {
        v.sort_by(|&a, &b| scored[a].cost.total.total_cmp(&scored[b].cost.total));
        v
    };
    let first = match policy {
        Policy::Kv | Policy::Approx => {
            let costs: Vec<f64> = usable.iter().map(|&i| scored[i].cost.total).collect();
            pick(&costs, temperature, random).map_or(usable[0], |p| usable[p])
        }
        Policy::RoundRobin => usable[(turn % usable.len() as u64) as usize],
        Policy::Random => usable[((random * usable.len() as f64) as usize).min(usable.len() - 1)],
        Policy::LeastLoaded => {
            let load = |i: usize| {
                let c = &scored[i].candidate;
                (
                    c.active_decode_blocks,
                    c.active_prefill_tokens,
                    c.active_requests,
                )
            };
            let min = usable.iter().map(|&i| load(i)).min().unwrap_or_default();
            let ties: Vec<usize> = usable.iter().copied().filter(|&i| load(i) == min).collect();
            ties[((random * ties.len() as f64) as usize).min(ties.len() - 1)]
        }
    };
    let mut rest = by_cost(usable.into_iter().filter(|&i| i != first).collect());
    rest.insert(0, first);
    rest
}

/// The prompt tokens an engine will report as cached if the first
/// `device_blocks` blocks are on its device: engines always compute the last
/// prompt token, so a fully cached prompt reports one block less when its
/// length is a multiple of the block size.
pub fn predicted_cached_tokens(device_blocks: u32, block_size: u32, prompt_tokens: u64) -> u64 {
    let bs = u64::from(block_size.max(1));
    let limit = prompt_tokens.saturating_sub(1) / bs * bs;
    (u64::from(device_blocks) * bs).min(limit)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn appended_fields_equal_the_parsed_rewrite_and_unsafe_bodies_fall_back() {
        let full = |body: &[u8], key: &str, v: Value| {
            let mut doc: Value = serde_json::from_slice(body).expect("json");
            doc.as_object_mut().expect("object").insert(key.into(), v);
            doc
        };
        let parse = |b: &[u8]| serde_json::from_slice::<Value>(b).expect("valid JSON out");
        for body in [
            &br#"{"prompt":[1,2,3],"stream":true}"#[..],
            br#"{}"#,
            b"{ \"prompt\": \"hi\" }\n  ",
            br#"{"messages":[{"role":"user","content":"}"}]}"#,
        ] {
            let out = inject_dp_rank(body, 3).expect("injects");
            assert_eq!(
                parse(&out),
                full(body, "data_parallel_rank", serde_json::json!(3))
            );
            let out = inject_mm_hashes(body, &[u64::MAX, 7]).expect("injects");
            assert_eq!(
                parse(&out),
                full(body, "mm_hashes", serde_json::json!([u64::MAX, 7]))
            );
            let out = inject_include_usage(body).expect("injects");
            assert_eq!(
                parse(&out),
                full(
                    body,
                    "stream_options",
                    serde_json::json!({"include_usage": true})
                )
            );
        }
        // The key already present (or only mentioned): merged or replaced, never duplicated.
        let body = br#"{"stream_options":{"continuous_usage_stats":true},"prompt":"x"}"#;
        assert!(append_field(body, "stream_options", "{}").is_none());
        let out = parse(&inject_include_usage(body).expect("injects"));
        assert_eq!(
            out["stream_options"],
            serde_json::json!({"continuous_usage_stats": true, "include_usage": true})
        );
        let body = br#"{"prompt":"say \"data_parallel_rank\"","data_parallel_rank":0}"#;
        assert!(append_field(body, "data_parallel_rank", "1").is_none());
        assert_eq!(
            parse(&inject_dp_rank(body, 1).expect("injects"))["data_parallel_rank"],
            1
        );
        assert!(append_field(b"[1]", "k", "1").is_none());
    }
    use kvroute_core::hash::{local_block_hashes, sequence_hashes, HASH_SEED};
    use kvroute_core::multimodal::ImageIdentity;

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
        assert_eq!(r.text.as_deref(), Some("hello"));
        let r = parse_request(
            br#"{"messages":[{"role":"user","content":[{"type":"text","text":"hi"}]}]}"#,
            true,
        )
        .expect("valid");
        assert_eq!(r.text.as_deref(), Some("user\nhi\n"));
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
        assert!(err(br#"{"prompt":null}"#, false).contains("required"));
        assert!(err(br#"{"prompt":[1],"model":3}"#, false).contains("`model`"));
        assert!(parse_query(br#"{"nothing":1}"#).is_err());
        assert_eq!(
            parse_hash_query(br#"{"local_hashes":[1,-1]}"#).expect("valid"),
            vec![LocalBlockHash(1), LocalBlockHash(u64::MAX)]
        );
    }

    #[test]
    fn the_dp_rank_is_added_to_the_body_and_nothing_else_changes() {
        let out = inject_dp_rank(br#"{"model":"m","prompt":[1]}"#, 3).expect("valid");
        assert_eq!(
            String::from_utf8(out).expect("utf8"),
            r#"{"model":"m","prompt":[1],"data_parallel_rank":3}"#
        );
        assert!(inject_dp_rank(b"[]", 0).is_err());
        let out = inject_mm_hashes(br#"{"model":"m"}"#, &[u64::MAX, 7]).expect("valid");
        assert_eq!(
            String::from_utf8(out).expect("utf8"),
            r#"{"model":"m","mm_hashes":[18446744073709551615,7]}"#
        );
    }

    #[test]
    fn include_usage_is_read_and_injected_keeping_other_options() {
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
        let out = inject_include_usage(
            br#"{"prompt":[1],"stream_options":{"continuous_usage_stats":false}}"#,
        )
        .expect("valid");
        assert_eq!(
            String::from_utf8(out).expect("utf8"),
            r#"{"prompt":[1],"stream_options":{"continuous_usage_stats":false,"include_usage":true}}"#
        );
        let out = inject_include_usage(br#"{"stream_options":null}"#).expect("valid");
        assert_eq!(
            String::from_utf8(out).expect("utf8"),
            r#"{"stream_options":{"include_usage":true}}"#
        );
    }

    #[test]
    fn client_mm_hashes_are_noticed() {
        let body = br#"{"messages":[{"role":"user","content":"x"}],"mm_hashes":[1]}"#;
        assert!(parse_request(body, true).expect("valid").mm_hashes_given);
        let body = br#"{"messages":[{"role":"user","content":"x"}],"mm_hashes":null}"#;
        assert!(!parse_request(body, true).expect("valid").mm_hashes_given);
    }

    #[test]
    fn image_requests_hash_per_flavour_and_each_target_is_scored_on_its_own() {
        let mut tokens: Vec<u32> = (0..4).collect();
        tokens.extend([151_655; 8]);
        let req = RoutingRequest {
            tokens: Some(tokens.clone()),
            images: vec![ImageSpan {
                start: 4,
                len: 8,
                identity: ImageIdentity::from_hash(42),
            }],
            ..RoutingRequest::default()
        };
        let vllm = request_hashes(&req, 4, WorkerFlavor::Vllm);
        let sglang = request_hashes(&req, 4, WorkerFlavor::Sglang);
        assert_eq!(vllm.len(), 3);
        assert_eq!(vllm[0], sglang[0], "the text block is the same");
        assert_ne!(vllm[1..], sglang[1..], "the image blocks differ");
        assert_ne!(vllm[1], local_block_hashes(&tokens, 4, HASH_SEED, 0)[1]);
        let mut mixed = targets();
        mixed[1].flavor = WorkerFlavor::Sglang;
        let mut asked = Vec::new();
        let scored = score(
            &mixed,
            12,
            &mut |bs, f| {
                asked.push((bs, f));
                (Vec::new(), Vec::new())
            },
            &|_, s| Load::of(None, s),
            &|_| true,
            &CostWeights::default(),
            &BusyThresholds::default(),
        );
        assert_eq!(asked, [(4, WorkerFlavor::Vllm), (4, WorkerFlavor::Sglang)]);
        assert_eq!(scored[2].flavor, WorkerFlavor::Sglang);
    }

    fn targets() -> Vec<Target> {
        vec![
            Target {
                name: "w0".into(),
                id: WorkerId(0),
                url: "http://a".into(),
                block_size: 4,
                ranks: vec![0],
                flavor: WorkerFlavor::Vllm,
            },
            Target {
                name: "w1".into(),
                id: WorkerId(1),
                url: "http://b".into(),
                block_size: 4,
                ranks: vec![0, 1],
                flavor: WorkerFlavor::Vllm,
            },
        ]
    }

    #[test]
    fn candidates_take_cache_hits_and_load_into_account() {
        let req = RoutingRequest {
            tokens: Some((0..16).collect()),
            ..RoutingRequest::default()
        };
        let locals = request_hashes(&req, 4, WorkerFlavor::Vllm);
        assert_eq!(
            locals,
            local_block_hashes(&(0..16).collect::<Vec<_>>(), 4, HASH_SEED, 0)
        );
        let seqs = sequence_hashes(&locals);
        let hit = RankMatch {
            worker_rank: WorkerRank::new(1, 1),
            device: 3,
            host: 3,
            any: 3,
        };
        let mut busy_rank = ActiveSequences::new();
        busy_rank.add(9, &seqs, 100, 0);
        let scored = score(
            &targets(),
            16,
            &mut |_, _| (vec![hit], seqs.clone()),
            &|k, s| Load::of((k == WorkerRank::new(0, 0)).then_some(&busy_rank), s),
            &|_| true,
            &CostWeights::DYNAMO,
            &BusyThresholds {
                prefill_tokens: Some(100),
                decode_blocks: None,
            },
        );
        assert_eq!(scored.len(), 3);
        // w0: (100 + 16)/4 = 29 prefill, 4 active blocks, none new.
        assert_eq!((scored[0].cost.total, scored[0].overloaded), (33.0, true));
        // w1 rank 0: cold, 4 + 4.
        assert_eq!(scored[1].cost.total, 8.0);
        // w1 rank 1: 3 blocks cached, 1 + 4.
        assert_eq!(scored[2].cost.total, 5.0);
        assert_eq!(order(&scored, Policy::Kv, 0.0, 0.5, 0), vec![2, 1]);
        assert_eq!(order(&scored, Policy::RoundRobin, 0.0, 0.5, 1), vec![2, 1]);
        let all_busy: Vec<Scored> = scored
            .iter()
            .cloned()
            .map(|mut s| {
                s.overloaded = true;
                s
            })
            .collect();
        assert!(order(&all_busy, Policy::Kv, 0.0, 0.5, 0).is_empty());
        let without_w1 = score(
            &targets(),
            16,
            &mut |_, _| (Vec::new(), seqs.clone()),
            &|_, s| Load::of(None, s),
            &|n| n != "w1",
            &CostWeights::default(),
            &BusyThresholds::default(),
        );
        assert_eq!(without_w1.len(), 1);
    }

    #[test]
    fn predictions_follow_the_engines_last_token_rule() {
        assert_eq!(predicted_cached_tokens(4, 16, 64), 48);
        assert_eq!(predicted_cached_tokens(4, 16, 100), 64);
        assert_eq!(predicted_cached_tokens(0, 16, 100), 0);
    }
}

#[cfg(test)]
mod scan_tests {
    use super::*;

    /// `parse_request` as it reads every body without the one-pass scan.
    fn general(body: &[u8], chat: bool) -> Result<RoutingRequest, ParseError> {
        request_of(&slow_fields(body)?, None, chat)
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
