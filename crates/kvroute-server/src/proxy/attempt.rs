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

use axum::body::{Body, Bytes};
use axum::http::{header, HeaderMap, HeaderValue};
use axum::response::Response;
use futures_util::StreamExt as _;
use kvroute_core::event::WorkerFlavor;
use kvroute_core::hash::LocalBlockHash;
use kvroute_core::index::WorkerRank;
use kvroute_core::scheduler::Scored;

use super::answer::{self, UpTo};
use super::migrate::{Migration, Upstream};
use super::outcome::{self, Ending, Next};
use super::relay::{reported_cached_tokens, Passthrough, StreamOrigin};
use super::rewrite::{inject_dp_rank, inject_include_usage, inject_mm_hashes};
use super::Proxy;
use crate::api::{error_chain, ErrorKind, ProxyError};
use crate::otel::headers::is_trace_header;
use crate::otel::spans::Attempt;
use crate::router::active::ActiveGuard;
use crate::router::admission;
use crate::router::candidates::{Candidates, Target};
use crate::router::continuations::response_id_in_body;
use crate::router::intake::RoutedRequest;
use crate::router::{on_cpu, Endpoint, REQUEST_ID};
use kvroute_prompt::body::ParseError;
use kvroute_prompt::sampling::check_context;

/// What one attempt sends, besides the client's headers.
pub(super) struct Outgoing {
    /// The body to send.
    pub payload: Bytes,
    /// The rank goes in the `X-data-parallel-rank` header.
    pub rank_header: Option<u32>,
    /// The proxy asked for the usage chunk on the client's behalf.
    pub added_usage: bool,
    /// The rank it goes to (the attempt's trace span names it).
    pub rank: u32,
}

/// The body for candidate `s` of a worker with `ranks` ranks, with the
/// rewrites it needs (`dp_rank_in_body`: the rank always goes in the body).
pub(super) fn outgoing(
    dp_rank_in_body: bool,
    req: &RoutedRequest,
    s: &Scored,
    ranks: usize,
    body: &Bytes,
) -> Result<Outgoing, ProxyError> {
    let bad = |e: ParseError| ProxyError::bad_request(e.0);
    let multi_rank = ranks > 1;
    let rank_in_body = dp_rank_in_body || s.flavor == WorkerFlavor::Sglang;
    let mut payload = body.clone();
    if multi_rank && rank_in_body {
        payload = Bytes::from(inject_dp_rank(&payload, s.key.rank).map_err(bad)?);
    }
    let added_usage = req.body.stream && !req.body.include_usage && req.body.tokens.is_some();
    if added_usage {
        payload = Bytes::from(inject_include_usage(&payload).map_err(bad)?);
    }
    if s.flavor == WorkerFlavor::Sglang
        && !req.body.images.is_empty()
        && req.body.mm_hashes.is_none()
    {
        let hashes: Vec<u64> = req.body.images.iter().map(|i| i.identity.hash).collect();
        payload = Bytes::from(inject_mm_hashes(&payload, &hashes).map_err(bad)?);
    }
    Ok(Outgoing {
        payload,
        rank_header: (multi_rank && !rank_in_body).then_some(s.key.rank.0),
        added_usage,
        rank: s.key.rank.0,
    })
}

/// A request being forwarded: what the client sent and what was read of it.
#[derive(Debug, Clone, Copy)]
pub struct Request<'a> {
    /// What routing read of the body.
    pub req: &'a Arc<RoutedRequest>,
    /// The client's headers.
    pub headers: &'a HeaderMap,
    /// The client's body.
    pub body: &'a Bytes,
    /// The endpoint it came in on.
    pub endpoint: Endpoint,
    /// Its id in logs and answers.
    pub request_id: &'a str,
    /// Its body is large: rewrites run on the blocking pool.
    pub large: bool,
    /// When it arrived.
    pub arrived: Instant,
    /// In a disaggregated fleet: where each phase went and why.
    pub disagg: Option<&'a str>,
}

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
        // The first candidate was charged when it was chosen; a candidate
        // tried after it is charged now (and the first's charge dropped).
        let guard = match first.take() {
            Some((charged, guard)) if charged == i => guard,
            _ => match admission::charge_later(&proxy.router, &candidates, req, i) {
                Some(guard) => guard,
                None => continue,
            },
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
        let mut decision = admission::decision(&proxy.router, req, request_id, target, chosen);
        decision.disagg = disagg.map(str::to_owned);
        proxy.router.observed.routed(decision);
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

/// Candidate `i` and its worker, when the worker is still known and its
/// circuit breaker lets an attempt through (the attempt is then begun).
pub(super) fn open_candidate<'c>(
    proxy: &Proxy,
    candidates: &'c Candidates,
    i: usize,
) -> Option<(&'c Scored, &'c Target)> {
    let s = candidates.scored.get(i)?;
    let target = candidates.targets.get(s.worker)?;
    proxy
        .router
        .breakers()
        .begin_attempt(&target.route.name)
        .then_some((s, target))
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

/// How sending one attempt ended, as the retry rule sorted it.
pub(super) enum Sent {
    /// The worker answered (any status but 503 and 429): relay it.
    Answer(reqwest::Response),
    /// The request never reached the worker, or the worker refused it
    /// before doing any work: try the next candidate.
    Refused(String),
    /// The worker took the request and failed: answer the client, try no one else.
    Failed(ProxyError),
}

/// The client's headers passed on to the worker: its credentials (OpenAI's
/// bearer token, Anthropic's `x-api-key`), the Anthropic API version and
/// betas the engine may check, and the W3C trace context (replaced by the
/// attempt's own while kvroute traces: [`crate::otel`]).
const FORWARDED_HEADERS: [&str; 6] = [
    "authorization",
    "x-api-key",
    "anthropic-version",
    "anthropic-beta",
    "traceparent",
    "tracestate",
];

/// Sends one attempt and sorts out how it ended (see the module docs).
pub(super) async fn send(
    proxy: &Proxy,
    target: &Target,
    endpoint: Endpoint,
    out: Outgoing,
    headers: &HeaderMap,
    request_id: &str,
) -> Sent {
    let timeout = proxy.router.config().request_timeout;
    send_within(proxy, target, (endpoint, out, headers), request_id, timeout).await
}

/// The client's headers that go on to the worker ([`FORWARDED_HEADERS`]).
pub(super) fn forwarded_headers(headers: &HeaderMap) -> HeaderMap {
    let mut kept = HeaderMap::new();
    for name in FORWARDED_HEADERS {
        if let Some(value) = headers.get(name) {
            kept.insert(name, value.clone());
        }
    }
    kept
}

/// [`send`] with `timeout` for the whole answer (a migrated request's
/// continuation has what is left of the request's time).
pub(super) async fn send_within(
    proxy: &Proxy,
    target: &Target,
    (endpoint, out, headers): (Endpoint, Outgoing, &HeaderMap),
    request_id: &str,
    timeout: std::time::Duration,
) -> Sent {
    let mut upstream = proxy
        .client
        .post(format!("{}{}", target.url, endpoint.path()))
        .timeout(timeout)
        .header(header::CONTENT_TYPE, "application/json")
        .header(REQUEST_ID, request_id)
        .body(out.payload);
    if let Some(rank) = out.rank_header {
        upstream = upstream.header("X-data-parallel-rank", rank.to_string());
    }
    let traced = Attempt::start(&target.name, &target.url, Some(out.rank));
    for name in FORWARDED_HEADERS {
        if traced.is_some() && is_trace_header(name) {
            continue;
        }
        if let Some(value) = headers.get(name) {
            upstream = upstream.header(name, value.clone());
        }
    }
    if let Some(attempt) = &traced {
        upstream = upstream.headers(attempt.headers());
    }
    let sent = upstream.send().await;
    if let Some(attempt) = traced {
        attempt.ended(match &sent {
            Ok(resp) => Ok(resp.status().as_u16()),
            Err(e) => Err(if e.is_connect() {
                "no connection"
            } else {
                "no answer"
            }),
        });
    }
    let ending = match &sent {
        Err(e) if e.is_connect() => Ending::NotConnected,
        Err(e) if e.is_timeout() => Ending::OutOfTime { flowing: false },
        Err(_) => Ending::LostBeforeAnswer,
        Ok(resp) => Ending::Head(resp.status()),
    };
    let verdict = outcome::settle(&proxy.router, &target.name, ending, request_id);
    match (verdict.next, sent) {
        (Next::Retry, Err(e)) => {
            Sent::Refused(format!("worker `{}`: {}", target.name, error_chain(&e)))
        }
        (Next::Retry, Ok(resp)) => Sent::Refused(format!(
            "worker `{}` answered {}",
            target.name,
            resp.status()
        )),
        // The rule relays every answer it does not retry, and fails every
        // request that was sent and got none.
        (_, Ok(resp)) => Sent::Answer(resp),
        (next, Err(e)) => {
            let kind = next.error().unwrap_or(ErrorKind::UpstreamFailed);
            let error = ProxyError::lost(kind, &target.name, request_id, error_chain(&e));
            Sent::Failed(error)
        }
    }
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
        let cap = proxy.router.config().max_answer_bytes;
        let read = match answer::read_up_to(resp, cap).await {
            Ok(UpTo::Over(read, rest)) => {
                // Too long to hold: passed on as it comes, unread.
                let head = futures_util::stream::once(async move { Ok(read) });
                let stream: Upstream = Box::pin(head.chain(rest.bytes_stream()));
                let relayed = Passthrough::new(stream, guard, None, false, (origin, arrived));
                let built = builder.body(relayed_body(relayed, remember));
                return built
                    .map(Responded::Answer)
                    .map_err(|e| ProxyError::internal(e.to_string()));
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
        Body::from(bytes)
    };
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
