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

use kvroute_prompt::body::RoutingRequest;
use kvroute_prompt::shape::{shape, BodyShape};

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
    let read = parse_and_tokenize(proxy, endpoint, body);
    // What stays while the request is routed: its bytes.
    share.shrink_to(body.len());
    read
}

fn parse_and_tokenize(
    proxy: &Proxy,
    endpoint: Endpoint,
    body: &[u8],
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
    proxy.tokenize(&mut req);
    if req.tokens.is_some() {
        // Routing reads the tokens from now on; the parsed prompt can go.
        req.text = None;
    }
    Ok(req)
}

/// Refuses a prompt of more parts than the largest context any worker has
/// holds tokens.
fn check_parts(proxy: &Proxy, shape: &BodyShape) -> Result<(), ProxyError> {
    let targets = proxy.targets();
    let largest = targets.iter().filter_map(|t| proxy.context_length(t)).max();
    match largest {
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
