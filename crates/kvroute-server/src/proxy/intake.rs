//! A request body into what routing reads of it, the same at both doors
//! (HTTP and the endpoint picker): the size check before any parsing, the
//! parse, the refusal of fields only the router may set, and the prompt's
//! tokens. Synchronous: the caller runs it inline, or on the blocking pool
//! for a large body.
//!
//! A large body is measured before it is parsed ([`kvroute_prompt::shape`]):
//! a prompt of more messages or items than any worker's context has tokens
//! cannot fit (each renders to at least one token), so it is refused
//! without being built; otherwise the body's share of the memory budget
//! grows by what parsing and rendering it will hold, or the request is
//! refused (503 while other bodies hold the budget, 413 when it alone is
//! over it). The parsed prompt is dropped once its tokens are known.

use kvroute_prompt::body::{RoutingRequest, TextPrompt};
use kvroute_prompt::shape::{shape, BodyShape};
use serde_json::Value;

use super::{Endpoint, Proxy, LARGE_BODY};
use crate::api::ProxyError;
use crate::bodies::HELD_PER_BYTE;
use crate::budget::Share;

/// Bytes that parsing, rendering and tokenizing hold per JSON value of a
/// body, beyond the [`HELD_PER_BYTE`] its bytes already hold (measured:
/// chat, Responses and Messages bodies of 400 000 to 550 000 small messages
/// hold 370 to 460 bytes a value at their peak).
const BYTES_PER_VALUE: usize = 400;

/// What reading a body of `bytes` holding `shape` holds at its peak.
pub fn parse_cost(bytes: usize, shape: &BodyShape) -> usize {
    bytes
        .saturating_mul(HELD_PER_BYTE)
        .saturating_add(shape.values.saturating_mul(BYTES_PER_VALUE))
}

/// Reads `body`, sent to `endpoint`, for routing; `share` holds the body's
/// part of the memory budget and grows while the body is parsed.
pub fn read(
    proxy: &Proxy,
    endpoint: Endpoint,
    body: &[u8],
    share: &mut Share,
) -> Result<RoutingRequest, ProxyError> {
    if body.len() > LARGE_BODY {
        if let Some(shape) = shape(body) {
            check_parts(proxy, &shape)?;
            reserve(proxy, share, parse_cost(body.len(), &shape))?;
        }
    }
    let read = parse_and_tokenize(proxy, endpoint, body, body.len() > LARGE_BODY);
    // What stays while the request is routed: its bytes.
    share.shrink_to(body.len());
    read
}

fn parse_and_tokenize(
    proxy: &Proxy,
    endpoint: Endpoint,
    body: &[u8],
    large: bool,
) -> Result<RoutingRequest, ProxyError> {
    let mut req = endpoint
        .parse(body)
        .map_err(|e| ProxyError::bad_request(e.0))?;
    if let Some(field) = req.handoff_field {
        return Err(ProxyError::bad_request(format!(
            "`{field}` is set by the router for its own prefill/decode hand-offs; \
             a request may not carry it"
        )));
    }
    if large {
        check_text(proxy, &req)?;
    }
    proxy.tokenize(&mut req);
    if req.tokens.is_some() {
        // Routing reads the tokens from now on; the parsed prompt can go.
        req.text = None;
    }
    Ok(req)
}

/// The largest context any worker has.
fn largest_context(proxy: &Proxy) -> Option<u64> {
    let targets = proxy.targets();
    targets.iter().filter_map(|t| proxy.context_length(t)).max()
}

/// Refuses a text that its tokenizer could not make into fewer tokens than
/// the largest context holds, before tokenizing it: a tokenizer that
/// bounds the text one token stands for ([`Tokenizer::max_token_bytes`])
/// turns a text of `n` such bytes into at least `n / max` tokens.
///
/// [`Tokenizer::max_token_bytes`]: kvroute_prompt::Tokenizer::max_token_bytes
fn check_text(proxy: &Proxy, req: &RoutingRequest) -> Result<(), ProxyError> {
    let (Some(text), Some(context)) = (&req.text, largest_context(proxy)) else {
        return Ok(());
    };
    let renderer = proxy.renderer_for(req.model.as_deref());
    let Some(max) = renderer.and_then(|r| r.tokenizer().max_token_bytes()) else {
        return Ok(());
    };
    let least = (visible_bytes(text) / max.max(1)) as u64;
    if least <= context {
        return Ok(());
    }
    Err(ProxyError::ContextTooLong(format!(
        "This model's maximum context length is {context} tokens. However, your request's text \
         makes at least {least} tokens. Please reduce the length of the input."
    )))
}

/// The text bytes a prompt's tokens must cover, whitespace aside (which a
/// template may trim): a completion's text (the longest of a batch), or
/// the text of a chat's messages (not their images).
fn visible_bytes(text: &TextPrompt) -> usize {
    let count = |s: &str| s.bytes().filter(|b| !b.is_ascii_whitespace()).count();
    match text {
        TextPrompt::Completion(Value::String(s)) => count(s),
        TextPrompt::Completion(Value::Array(items)) => items
            .iter()
            .filter_map(Value::as_str)
            .map(count)
            .max()
            .unwrap_or(0),
        TextPrompt::Completion(_) => 0,
        TextPrompt::Chat(messages) => messages
            .as_array()
            .into_iter()
            .flatten()
            .map(|m| match m.get("content") {
                Some(Value::String(s)) => count(s),
                Some(Value::Array(parts)) => parts
                    .iter()
                    .filter(|p| p.get("type").and_then(Value::as_str) == Some("text"))
                    .filter_map(|p| p.get("text").and_then(Value::as_str))
                    .map(count)
                    .sum(),
                _ => 0,
            })
            .sum(),
    }
}

/// Refuses a prompt of more parts than the largest context any worker has
/// holds tokens.
fn check_parts(proxy: &Proxy, shape: &BodyShape) -> Result<(), ProxyError> {
    match largest_context(proxy) {
        Some(context) if shape.prompt_parts as u64 > context => {
            Err(ProxyError::ContextTooLong(format!(
                "This model's maximum context length is {context} tokens. However, your request \
                 has {} messages or input items, each at least one token. Please reduce the \
                 length of the input.",
                shape.prompt_parts
            )))
        }
        _ => Ok(()),
    }
}

/// Grows `share` to `bytes`, or says why the request cannot be read now.
fn reserve(proxy: &Proxy, share: &mut Share, bytes: usize) -> Result<(), ProxyError> {
    if share.grow_to(bytes) {
        return Ok(());
    }
    let budget = proxy.body_budget();
    if bytes > budget.large_limit() {
        return Err(ProxyError::TooLarge(format!(
            "reading this body would hold about {} MiB, over the {} MiB one request may use \
             (--body-memory-mib)",
            bytes >> 20,
            budget.large_limit() >> 20
        )));
    }
    Err(ProxyError::Overloaded(format!(
        "the router holds as many request bodies as its memory budget allows ({} MiB, \
         --body-memory-mib); retry shortly",
        budget.limit() >> 20
    )))
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn the_text_a_prompt_must_cover_leaves_out_whitespace_and_images() {
        let text = TextPrompt::Completion(json!("ab  cd\n"));
        assert_eq!(visible_bytes(&text), 4);
        let batch = TextPrompt::Completion(json!(["abc", "abcdef", 7]));
        assert_eq!(visible_bytes(&batch), 6, "the longest prompt of a batch");
        let chat = TextPrompt::Chat(json!([
            {"role": "system", "content": "be brief"},
            {"role": "user", "content": [
                {"type": "text", "text": "look at"},
                {"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA"}}]},
            {"role": "assistant", "content": null},
        ]));
        assert_eq!(visible_bytes(&chat), 7 + 6);
    }

    #[test]
    fn a_large_body_costs_its_bytes_and_its_values() {
        let shape = BodyShape {
            values: 1_000,
            prompt_parts: 10,
        };
        assert_eq!(parse_cost(1 << 20, &shape), (5 << 20) + 400_000);
    }
}
