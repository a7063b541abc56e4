//! Sending one attempt to a worker: the body with the rewrites the chosen
//! rank needs, the client's headers that go on, and how the sending ended
//! as the retry rule of [`super::outcome`] sorts it (refused before any
//! work: try the next candidate; taken and failed: try no one else).
//! Attempts in order ([`super::attempt`]), the P/D legs
//! ([`super::disagg`]) and migrated continuations ([`super::migrate`]) all
//! send through here.

use std::sync::Arc;
use std::time::Instant;

use axum::body::Bytes;
use axum::http::{header, HeaderMap};
use kvroute_core::event::WorkerFlavor;
use kvroute_core::scheduler::Scored;

use super::outcome::{self, Ending, Next};
use super::rewrite::{inject_dp_rank, inject_include_usage, inject_mm_hashes};
use super::Proxy;
use crate::api::{error_chain, ErrorKind, ProxyError};
use crate::otel::headers::is_trace_header;
use crate::otel::spans::Attempt;
use crate::router::candidates::{Candidates, Target};
use crate::router::intake::RoutedRequest;
use crate::router::{Endpoint, REQUEST_ID};
use kvroute_prompt::body::ParseError;

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
