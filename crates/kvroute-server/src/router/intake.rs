//! A request as both doors take it in (HTTP, `router::route`, and the
//! endpoint picker, [`crate::epp`]), into the one [`RoutedRequest`] that
//! admission places: whatever a feature adds to a request here reaches
//! both doors by construction.
//!
//! In turn ([`prepare`]):
//! 1. who sent it, from its headers: its session
//!    (`--session-header`), its tenant and the priorities it may use
//!    ([`super::tenants`]), its `x-priority` held to them, and the owner of
//!    its sessions and responses ([`super::owners`]);
//! 2. its body, for an API kvroute reads: the size check before any
//!    parsing, the parse, the refusal of fields only the router may set,
//!    the body's own `priority` held to what the caller may ask for, a
//!    LoRA adapter named as its `model` taken as its `lora_name` (the
//!    engine hashes the adapter into its blocks), and its prompt's tokens
//!    (the router's tokenizer, else the engine's `/tokenize`);
//! 3. the session and the previous response looked up at the peer
//!    replicas when this one has not seen them (`--nats`);
//! 4. a continuation of a response its owner did not make is refused
//!    ([`super::continuations`]), and so is a model no worker serves.
//!
//! The body is read inline, or on the blocking pool when large. A large
//! body is measured before it is parsed ([`kvroute_prompt::shape`]): a
//! prompt of more messages or items than any worker's context has tokens
//! cannot fit (each renders to at least one token), so it is refused
//! without being built; otherwise the body's share of the memory budget
//! grows by what parsing and rendering it will hold, or the request is
//! refused (503 while other bodies hold the budget, 413 when it alone is
//! over it). The parsed prompt is dropped once its tokens are known.

use std::sync::Arc;

use axum::body::Bytes;
use axum::http::HeaderMap;
use kvroute_prompt::body::{RoutingRequest, TextPrompt};
use kvroute_prompt::shape::{shape, BodyShape};
use kvroute_prompt::{Prompt, PromptError, PromptFields, PromptSource, Renderer};
use serde_json::Value;

use super::tenants::PriorityRange;
use super::{on_cpu, owners, Endpoint, Router, LARGE_BODY};
use crate::api::ProxyError;
use crate::bodies::HELD_PER_BYTE;
use crate::budget::Share;

/// A request ready to be placed: what routing reads of its body, and who
/// sent it.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct RoutedRequest {
    /// What routing reads of its body, its prompt's tokens included.
    pub body: RoutingRequest,
    /// The key its session is pinned under (its owner's and the id its
    /// header named, [`Router::session_key`]); `None`: it names none.
    pub session: Option<String>,
    /// Its place in the overload queue: lower is served first.
    pub priority: i64,
    /// Its tenant, whom the overload queue shares the fleet with fairly.
    pub tenant: String,
    /// Who its sessions and responses belong to (a digest of its API key
    /// and tenant).
    pub owner: [u8; 32],
}

impl RoutedRequest {
    /// The prompt's tokens, 0 when it has none.
    pub fn token_count(&self) -> u64 {
        self.body.tokens.as_ref().map_or(0, |t| t.len() as u64)
    }
}

/// A request as it arrives at a door.
#[derive(Debug, Clone, Copy)]
pub struct Arrival<'a> {
    /// The client's headers.
    pub headers: &'a HeaderMap,
    /// The client's body.
    pub body: &'a Bytes,
    /// The API its path names; `None`: a body kvroute does not read (the
    /// request is placed on load alone).
    pub endpoint: Option<Endpoint>,
}

/// Who sent a request, as its headers say.
struct Caller {
    session: Option<String>,
    priority: i64,
    priorities: PriorityRange,
    tenant: String,
    owner: [u8; 32],
}

impl Caller {
    fn of(router: &Router, headers: &HeaderMap) -> Result<Caller, ProxyError> {
        let session = router.session_of(headers)?;
        let identity = router.identify(headers)?;
        let priority = router.allowed_priority(&identity, priority_of(headers)?);
        // Sessions and responses are their owner's: keyed by owner and id.
        let owner = owners::owner_of(headers, &identity.tenant).0;
        Ok(Caller {
            session: session.map(|id| router.session_key(&owner, &id)),
            priority,
            priorities: identity.priorities,
            tenant: identity.tenant,
            owner,
        })
    }
}

/// Reads `arrival` into the request admission places (see the module
/// docs); `share` holds the body's part of the memory budget, which grows
/// while the body is parsed and is given back holding its bytes.
pub async fn prepare(
    router: &Arc<Router>,
    arrival: Arrival<'_>,
    share: Share,
) -> Result<(RoutedRequest, Share), ProxyError> {
    let Arrival {
        headers,
        body,
        endpoint,
    } = arrival;
    let caller = Caller::of(router, headers)?;
    if endpoint.is_some() {
        router
            .tokenizers()
            .settled(crate::tokenizers::LOOK_WAIT)
            .await;
    }
    let (mut read, share) = match endpoint {
        Some(endpoint) => {
            let (router, bytes, priorities) = (router.clone(), body.clone(), caller.priorities);
            on_cpu(body.len() > LARGE_BODY, move || {
                let mut share = share;
                let req = read(&router, (endpoint, &bytes, &mut share), priorities)?;
                Ok::<_, ProxyError>((req, share))
            })
            .await??
        }
        None => (RoutingRequest::default(), share),
    };
    if let Some(endpoint) = endpoint {
        let chat = endpoint == Endpoint::Chat;
        super::tokens::complete_from_engine(router, &mut read, body, chat).await;
    }
    let req = RoutedRequest {
        body: read,
        session: caller.session,
        priority: caller.priority,
        tenant: caller.tenant,
        owner: caller.owner,
    };
    router.fetch_pins(&req).await;
    router.check_continuation(&req)?;
    if let Some(model) = req.body.model.as_deref() {
        if !router.targets().is_empty() && !router.model_served(model) {
            return Err(ProxyError::ModelNotFound(model.to_owned()));
        }
    }
    if req.body.tokens.is_none() && !body.is_empty() {
        router.metrics.load_only.inc();
    }
    Ok((req, share))
}

impl Router {
    /// The renderer of requests naming `model` (or none): `--model`'s for
    /// it, else `--tokenizer`'s, else the one found for it; a request that
    /// names no model is taken to ask for the one model the workers list.
    pub fn renderer_for(&self, model: Option<&str>) -> Option<Arc<Renderer>> {
        let model = model.map(str::to_owned).or_else(|| self.only_model());
        self.explicit_renderer(model.as_deref())
            .or_else(|| model.as_deref().and_then(|m| self.tokenizers.renderer(m)))
    }

    /// The renderer the operator gave for `model` (`--model`, else
    /// `--tokenizer`), if any.
    fn explicit_renderer(&self, model: Option<&str>) -> Option<Arc<Renderer>> {
        model
            .and_then(|m| self.config.model_renderers.get(m))
            .or(self.config.renderer.as_ref())
            .cloned()
    }

    /// Whether the operator gave `model`'s renderer (`--model`, `--tokenizer`).
    pub(crate) fn has_explicit_renderer(&self, model: &str) -> bool {
        self.explicit_renderer(Some(model)).is_some()
    }

    /// Fills in `req.tokens` and `req.images` from its text with the
    /// renderer of the model it names, else the default one, if there is
    /// one. Requests with token ids keep them as given; a prompt the
    /// renderer refuses is routed on load alone (the engine then answers
    /// the client). Images are named for the model's `root`; a chat with
    /// images for a model whose tokenizer was found (not given) is left to
    /// its engine's `/tokenize`, which alone knows the positions each image
    /// takes ([`super::tokens::complete_from_engine`]).
    pub fn tokenize(&self, req: &mut RoutingRequest) {
        if req.tokens.is_some() {
            return;
        }
        let (Some(renderer), Some(text)) = (self.renderer_for(req.model.as_deref()), &req.text)
        else {
            return;
        };
        let source = match text {
            TextPrompt::Completion(p) => PromptSource::Completion(Some(p)),
            TextPrompt::Chat(m) => PromptSource::Chat(Some(m)),
        };
        let fields = PromptFields {
            source,
            mm_hashes: req.mm_hashes.as_ref(),
            model: req.model.as_deref(),
        };
        let rendered = Prompt::from_fields(&fields).and_then(|mut p| {
            if p.image_count() > 0 {
                let model = req.model.clone().or_else(|| self.only_model());
                if let Some(model) = model {
                    if !self.has_explicit_renderer(&model) {
                        return Err(PromptError::NoTokens);
                    }
                    p.model_id = self.model_root(&model);
                }
            }
            renderer.render_for_routing(&p)
        });
        match rendered {
            Ok(prompt) => {
                req.tokens = Some(prompt.tokens);
                req.images = prompt.images;
            }
            Err(e) => {
                tracing::debug!(error = %e, "prompt not rendered here; routed by the engine's tokens or on load alone")
            }
        }
    }
}

/// A request's `x-priority` as asked: an integer, lower served first from
/// the queue (vLLM's sense of `priority`); 0 without the header, a 400 when
/// it is not one. What the request gets is clamped into what its tenant may
/// use ([`Router::allowed_priority`]).
fn priority_of(headers: &HeaderMap) -> Result<i64, ProxyError> {
    let Some(value) = headers.get("x-priority") else {
        return Ok(0);
    };
    value
        .to_str()
        .ok()
        .and_then(|v| v.trim().parse::<i32>().ok())
        .map(i64::from)
        .ok_or_else(|| {
            ProxyError::bad_request("`x-priority` must be an integer (lower is served first)")
        })
}

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

/// Reads `body`, sent to `endpoint`, for routing, from a caller who may
/// ask the engine for `priorities`; `share` holds the body's part of the
/// memory budget and grows while the body is parsed.
fn read(
    router: &Router,
    (endpoint, body, share): (Endpoint, &[u8], &mut Share),
    priorities: PriorityRange,
) -> Result<RoutingRequest, ProxyError> {
    if body.len() > LARGE_BODY {
        if let Some(shape) = shape(body) {
            check_parts(router, &shape)?;
            reserve(router, share, parse_cost(body.len(), &shape))?;
        }
    }
    let large = body.len() > LARGE_BODY;
    let read = parse_and_tokenize(router, (endpoint, body, large), priorities);
    // What stays while the request is routed: its bytes.
    share.shrink_to(body.len());
    read
}

fn parse_and_tokenize(
    router: &Router,
    (endpoint, body, large): (Endpoint, &[u8], bool),
    priorities: PriorityRange,
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
    if let Some(asked) = req.engine_priority {
        if priorities.clamp(asked) != asked {
            return Err(ProxyError::bad_request(format!(
                "`priority` {asked} is not one this client may ask the engine for \
                 (docs/serving.md, tenants, keys and priorities)"
            )));
        }
    }
    // A LoRA adapter named as the model is hashed into the engine's
    // blocks: the request's must be too.
    if req.lora_name.is_none()
        && req
            .model
            .as_deref()
            .is_some_and(|m| router.models.is_adapter(m))
    {
        req.lora_name = req.model.clone();
    }
    if large {
        check_text(router, &req)?;
    }
    router.tokenize(&mut req);
    if req.tokens.is_some() {
        // Routing reads the tokens from now on; the parsed prompt can go.
        req.text = None;
    }
    Ok(req)
}

/// The largest context any worker has.
fn largest_context(router: &Router) -> Option<u64> {
    let targets = router.targets();
    targets
        .iter()
        .filter_map(|t| router.context_length(t))
        .max()
}

/// Refuses a text that its tokenizer could not make into fewer tokens than
/// the largest context holds, before tokenizing it: a tokenizer that
/// bounds the text one token stands for ([`Tokenizer::max_token_bytes`])
/// turns a text of `n` such bytes into at least `n / max` tokens.
///
/// [`Tokenizer::max_token_bytes`]: kvroute_prompt::Tokenizer::max_token_bytes
fn check_text(router: &Router, req: &RoutingRequest) -> Result<(), ProxyError> {
    let (Some(text), Some(context)) = (&req.text, largest_context(router)) else {
        return Ok(());
    };
    let renderer = router.renderer_for(req.model.as_deref());
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
fn check_parts(router: &Router, shape: &BodyShape) -> Result<(), ProxyError> {
    match largest_context(router) {
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
fn reserve(router: &Router, share: &mut Share, bytes: usize) -> Result<(), ProxyError> {
    if share.grow_to(bytes) {
        return Ok(());
    }
    let budget = router.body_budget();
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
