//! Getting a request to a worker: admission (the candidates in the policy's
//! order, or a bounded wait while every rank is over its busy thresholds),
//! then attempts on the candidates in that order.
//!
//! Which failures move a request on, what each worker's breaker records
//! and what the client is told is the retry rule of [`super::outcome`],
//! applied here as each attempt ends: when it is sent, and when a whole
//! (non-streamed) answer has been read; [`super::relay`] applies it when a
//! stream ends. In short: a request moves on only when it provably did not
//! reach the worker or was refused before any work (no connection, 503,
//! 429); a worker that took it and then failed (the connection dropped, the
//! answer cut off) gets no other worker the request, and its breaker opens;
//! any other answer, a 500 included, is the worker's and goes to the client.

use std::sync::Arc;
use std::time::Instant;

use axum::body::Body;
use axum::http::{header, HeaderValue};
use axum::response::Response;
use futures_util::StreamExt as _;
use kvroute_core::hash::LocalBlockHash;
use kvroute_core::index::WorkerRank;
use kvroute_core::scheduler::Scored;

use super::answer::{self, UpTo};
use super::migrate::{Migration, Upstream};
use super::outcome::{self, Ending};
use super::relay::{reported_cached_tokens, Passthrough, StreamOrigin};
use super::Proxy;
use crate::api::{error_chain, ErrorKind, ProxyError};
use crate::router::active::ActiveGuard;
use crate::router::admission;
use crate::router::candidates::{Candidates, Target};
use crate::router::continuations::response_id_in_body;
use crate::router::intake::RoutedRequest;
use crate::router::{on_cpu, Endpoint};
use kvroute_prompt::sampling::check_context;

pub use super::send::Request;
use super::send::{open_candidate, outgoing, send, Sent};

/// Tries the admitted candidates in order; the first worker that answers
/// (see the module docs for which failures move on) gives the response.
pub async fn forward(
    proxy: &Arc<Proxy>,
    admitted: admission::Admitted,
    request: Request<'_>,
) -> Result<Response, ProxyError> {
    let (candidates, ordered, mut first) = admitted.into_parts();
    let mut migration = Migration::of(proxy, &request);
    let Request {
        req,
        headers,
        body,
        endpoint,
        request_id,
        large,
        arrived,
        disagg,
    } = request;
    let request_tokens = req.body.tokens.as_ref().map_or(0, |t| t.len() as u64);
    let mut last_error = String::new();
    let max_attempts = proxy.router.config().max_attempts.max(1);
    for (attempt, &i) in ordered.iter().take(max_attempts).enumerate() {
        let Some((s, target)) = open_candidate(proxy, &candidates, i) else {
            continue;
        };
        if let Some(limit) = proxy.router.context_length(target) {
            if let Err(message) = check_context(request_tokens, req.body.max_tokens, limit) {
                return Err(ProxyError::ContextTooLong(message));
            }
        }
        if attempt > 0 {
            proxy.router.metrics.retries.inc();
        }
        let (locals, _) = admission::hashes_for(&candidates, req, s);
        let Some(guard) = charge(proxy, &mut first, &candidates, req, i) else {
            continue;
        };
        let rewritten = {
            let (req, s, body) = (req.clone(), s.clone(), body.clone());
            let (in_body, ranks) = (proxy.router.config().dp_rank_in_body, target.ranks.len());
            on_cpu(large, move || outgoing(in_body, &req, &s, ranks, &body)).await
        };
        let out = rewritten??;
        let added_usage = out.added_usage;
        let resp = match send(proxy, target, endpoint, out, headers, request_id).await {
            Sent::Answer(resp) => resp,
            Sent::Refused(message) => {
                last_error = message;
                continue;
            }
            Sent::Failed(error) => {
                // Lost before its answer: asked again whole elsewhere, once.
                let worker = &target.name;
                match migration
                    .as_mut()
                    .map(|m| m.ask_again(worker, &error.message()))
                {
                    Some(Ok(())) => {
                        last_error = error.message();
                        continue;
                    }
                    _ => return Err(error),
                }
            }
        };
        admission::remember_for_approx(&proxy.router, s, &locals);
        let chosen = admission::Chosen {
            candidates: &candidates,
            ordered: &ordered,
            index: i,
            retries: attempt,
        };
        record_routed(proxy, (req, request_id, target), chosen, disagg);
        let relay = Relay {
            guard,
            added_usage,
            request_id,
            locals: &locals,
            arrived,
            predict: true,
            endpoint,
            migration: migration.take(),
        };
        match respond(proxy, req, s, target, resp, relay).await? {
            Responded::Answer(answer) => return Ok(answer),
            Responded::AskAgain {
                migration: m,
                error,
            } => {
                migration = Some(*m);
                last_error = error.to_string();
            }
        }
    }
    Err(ProxyError::UpstreamUnreachable(last_error))
}

/// The guard that charges candidate `i` with the request: the first
/// candidate was charged when it was chosen; a candidate tried after it is
/// charged now (and the first's charge dropped). `None`: it cannot be.
fn charge(
    proxy: &Proxy,
    first: &mut Option<(usize, ActiveGuard)>,
    candidates: &Candidates,
    req: &RoutedRequest,
    i: usize,
) -> Option<ActiveGuard> {
    match first.take() {
        Some((charged, guard)) if charged == i => Some(guard),
        _ => admission::charge_later(&proxy.router, candidates, req, i),
    }
}

/// Records the routing decision for `/query` and the decisions ring, with
/// where each phase went in a disaggregated fleet (`disagg`).
fn record_routed(
    proxy: &Proxy,
    (req, request_id, target): (&RoutedRequest, &str, &Target),
    chosen: admission::Chosen<'_>,
    disagg: Option<&str>,
) {
    let mut decision = admission::decision(&proxy.router, req, request_id, target, chosen);
    decision.disagg = disagg.map(str::to_owned);
    proxy.router.observed.routed(decision);
}

/// What relaying the chosen worker's answer needs besides the answer.
pub(super) struct Relay<'a> {
    /// The request's place in its rank's load.
    pub guard: ActiveGuard,
    /// The proxy asked for the usage chunk on the client's behalf.
    pub added_usage: bool,
    /// The request's id.
    pub request_id: &'a str,
    /// The request's local block hashes at the target's block size.
    pub locals: &'a [LocalBlockHash],
    /// When the request arrived.
    pub arrived: Instant,
    /// Compare the engine's `cached_tokens` with the index's prediction
    /// (not for a decode leg, whose blocks came from a prefill worker).
    pub predict: bool,
    /// The endpoint the request came in on (its stream's conventions, and
    /// whether the answer names a response to remember).
    pub endpoint: Endpoint,
    /// Where a stream cut off by its worker may go on ([`super::migrate`];
    /// `None`: it may not).
    pub migration: Option<Migration>,
}

/// What [`respond`] made of a worker's answer.
pub(super) enum Responded {
    /// The client's response.
    Answer(Response),
    /// A whole answer was cut off and the request may be asked again whole
    /// elsewhere ([`Migration::ask_again`] allowed it); `error` is what the
    /// client gets if no other worker answers.
    AskAgain {
        /// The request's migration, one move further.
        migration: Box<Migration>,
        /// The cut-off answer's error.
        error: ProxyError,
    },
}

impl Responded {
    /// The client's response, for a caller that never passes a migration
    /// (an asked-again answer is then its error).
    pub(super) fn answer(self) -> Result<Response, ProxyError> {
        match self {
            Responded::Answer(answer) => Ok(answer),
            Responded::AskAgain { error, .. } => Err(error),
        }
    }
}

/// The client's response from the worker's: streams relayed as they come,
/// whole bodies read, and in both the engine's `cached_tokens` compared
/// with the prediction.
pub(super) async fn respond(
    proxy: &Proxy,
    req: &RoutedRequest,
    s: &Scored,
    target: &Target,
    resp: reqwest::Response,
    relay: Relay<'_>,
) -> Result<Responded, ProxyError> {
    let Relay {
        guard,
        added_usage,
        request_id,
        locals,
        arrived,
        predict,
        endpoint,
        migration,
    } = relay;
    let status = resp.status();
    // A continuation's prompt holds turns the router never saw.
    let continues = req.body.previous_response_id.is_some();
    let remembers = endpoint == Endpoint::Responses && status.is_success();
    let prediction = req
        .body
        .tokens
        .as_ref()
        .filter(|_| predict && !continues && status.is_success())
        .map(|t| crate::router::accuracy::prediction(s, target, t.len() as u64, locals));
    let mut builder = Response::builder()
        .status(status.as_u16())
        .header("x-kvroute-worker", &*target.name)
        .header("x-kvroute-dp-rank", s.key.rank.0);
    let content_type = resp.headers().get(header::CONTENT_TYPE);
    if let Some(v) = content_type.and_then(|ct| HeaderValue::from_bytes(ct.as_bytes()).ok()) {
        builder = builder.header(header::CONTENT_TYPE, v);
    }
    let sse = content_type.is_some_and(|v| v.as_bytes().starts_with(b"text/event-stream"));
    let origin = StreamOrigin {
        worker: target.name.clone(),
        request_id: request_id.to_owned(),
        sse,
        status,
        dialect: endpoint.dialect(),
    };
    let remember = remembers.then_some((s.key, req.owner));
    let body = if req.body.stream || sse {
        let strip = added_usage && status.is_success();
        let stream: Upstream = Box::pin(resp.bytes_stream());
        let mut relayed = Passthrough::new(stream, guard, prediction, strip, (origin, arrived));
        if let Some(m) = migration.filter(|_| status.is_success() && sse) {
            relayed = relayed.migrating(m);
        }
        relayed_body(relayed, remember)
    } else {
        let whole = Whole {
            proxy,
            req,
            s,
            target,
            request_id,
            arrived,
            prediction,
            remember,
            remembers,
        };
        return respond_whole(whole, resp, builder, (guard, origin), migration).await;
    };
    built(builder, body)
}

/// What answering with a whole (non-streamed) body needs to know of the
/// request and of the worker it went to.
struct Whole<'a> {
    proxy: &'a Proxy,
    req: &'a RoutedRequest,
    s: &'a Scored,
    target: &'a Target,
    request_id: &'a str,
    arrived: Instant,
    prediction: Option<crate::router::accuracy::Prediction>,
    remember: Option<(WorkerRank, [u8; 32])>,
    remembers: bool,
}

/// [`respond`] for an answer read whole: read up to the answer cap (one
/// longer is passed on unread), settled with the retry rule, its
/// `cached_tokens` compared with the prediction; a cut-off answer is asked
/// again whole elsewhere when `migration` allows.
async fn respond_whole(
    whole: Whole<'_>,
    resp: reqwest::Response,
    builder: axum::http::response::Builder,
    (guard, origin): (ActiveGuard, StreamOrigin),
    migration: Option<Migration>,
) -> Result<Responded, ProxyError> {
    let Whole {
        proxy,
        req,
        s,
        target,
        request_id,
        arrived,
        prediction,
        remember,
        remembers,
    } = whole;
    let status = origin.status;
    let cap = proxy.router.config().max_answer_bytes;
    let read = match answer::read_up_to(resp, cap).await {
        Ok(UpTo::Over(read, rest)) => {
            // Too long to hold: passed on as it comes, unread.
            let head = futures_util::stream::once(async move { Ok(read) });
            let stream: Upstream = Box::pin(head.chain(rest.bytes_stream()));
            let relayed = Passthrough::new(stream, guard, None, false, (origin, arrived));
            return built(builder, relayed_body(relayed, remember));
        }
        Ok(UpTo::Whole(bytes)) => Ok(bytes),
        Err(e) => Err(e),
    };
    guard.prefill_done();
    let ending = match &read {
        Ok(_) => Ending::Complete(status),
        Err(_) => Ending::CutOff,
    };
    let verdict = outcome::settle(&proxy.router, &target.name, ending, request_id);
    let bytes = match read {
        Ok(b) => b,
        Err(e) => {
            let kind = verdict
                .next
                .error()
                .unwrap_or(ErrorKind::UpstreamIncomplete);
            let detail = format!("reading the answer: {}", error_chain(&e));
            let error = ProxyError::lost(kind, &target.name, request_id, detail);
            // A whole answer cut off is asked again whole elsewhere.
            let Some(mut m) = migration else {
                return Err(error);
            };
            return match m.ask_again(&target.name, &error.to_string()) {
                Ok(()) => Ok(Responded::AskAgain {
                    migration: Box::new(m),
                    error,
                }),
                Err(_) => Err(error),
            };
        }
    };
    drop(guard);
    let id = remembers.then(|| response_id_in_body(&bytes)).flatten();
    if let Some(id) = id {
        proxy.router.record_response(&id, &req.owner, s.key);
    }
    if let (Some(p), Some(reported)) = (prediction, reported_cached_tokens(&bytes)) {
        p.settle(&proxy.router, reported);
    }
    proxy.router.timed(arrived, None);
    built(builder, Body::from(bytes))
}

/// The client's response with `body`.
fn built(builder: axum::http::response::Builder, body: Body) -> Result<Responded, ProxyError> {
    builder
        .body(body)
        .map(Responded::Answer)
        .map_err(|e| ProxyError::internal(e.to_string()))
}

/// The client's body relaying `relayed`, which remembers the response it
/// names as produced by `remember`'s rank for its owner, if given.
fn relayed_body(relayed: Passthrough, remember: Option<(WorkerRank, [u8; 32])>) -> Body {
    match remember {
        Some((rank, owner)) => Body::from_stream(relayed.remembering_response(rank, owner)),
        None => Body::from_stream(relayed),
    }
}
