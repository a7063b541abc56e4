//! A request through a disaggregated fleet: workers registered with
//! `role=prefill` compute prompts, workers with `role=decode` generate.
//!
//! The decode rank is placed first, by its load, with credit for its own
//! cache only where that cache lets it prefill the request itself
//! (`kvroute_core::scheduler::disagg`); then, unless it prefills locally,
//! the prefill rank, by the same KV-aware cost as an aggregated request,
//! since its cache is what saves work. The legs follow the decode worker's
//! engine (`super::handoff`):
//! * vLLM: the prefill leg first, retried on the next prefill worker under
//!   the retry rule (`super::outcome`); then the decode leg with the
//!   prefill's `kv_transfer_params`, its answer relayed to the client;
//! * SGLang ([`sglang`]): both legs at once with one bootstrap room; if
//!   either fails before the decode answers, the other is dropped
//!   (cancelled) too.
//!
//! Every leg goes through its worker's circuit breaker and under the retry
//! rule: a leg refused before any work (no connection, 503, 429) moves on
//! to the next worker of its pool, a half-open probe included, so a dead
//! worker costs no client its request. vLLM's decode leg goes to the next
//! decode worker with the same `kv_transfer_params`; SGLang's two legs are
//! sent again, in a new room, with the refusing side's next worker. A leg
//! that a worker took and then failed is the client's error, never sent
//! elsewhere. A prefill leg with no answer within `--prefill-timeout-secs`
//! is such a failure: the client gets a 502 and the worker's breaker
//! opens. Workers with `role=both` in such a fleet decode like decode
//! workers and always prefill their own requests.

pub(super) mod sglang;

use std::sync::Arc;

use axum::body::Bytes;
use axum::response::Response;
use kvroute_core::event::WorkerFlavor;
use serde_json::Value;

use kvroute_core::scheduler::disagg::decode_order;
use kvroute_core::scheduler::WorkerRole;

use super::answer::{self, AnswerError};
use super::attempt;
use super::handoff;
use super::outcome::{self, Ending};
use super::send::{open_candidate, outgoing, send, Outgoing, Request, Sent};
use super::Proxy;
use crate::api::{ErrorKind, ProxyError};
use crate::router::active::ActiveGuard;
use crate::router::admission::{self, Admitted};
use crate::router::candidates::{Candidates, Target};
use crate::router::intake::RoutedRequest;
use crate::router::on_cpu;
use crate::router::split::{self, Placed};

/// Routes one parsed request through the disaggregated fleet.
pub async fn route(
    proxy: &Arc<Proxy>,
    req: &Arc<RoutedRequest>,
    request: Request<'_>,
) -> Result<Response, ProxyError> {
    let (candidates, placed) = split::admit(&proxy.router, req, request.large).await?;
    tracing::debug!(request_id = request.request_id, placement = %placed.why, "disaggregated");
    if placed.prefill.is_empty() {
        proxy.router.metrics.disagg_local.inc();
        let first = Some((placed.decode, placed.decode_guard));
        let admitted = Admitted::new(candidates, vec![placed.decode], first);
        let request = Request {
            disagg: Some(&placed.why),
            ..request
        };
        return attempt::forward(proxy, admitted, request).await;
    }
    proxy.router.metrics.disagg_split.inc();
    let flavor = candidates.scored[placed.decode].flavor;
    match flavor {
        WorkerFlavor::Vllm => vllm(proxy, &candidates, placed, request).await,
        WorkerFlavor::Sglang => sglang::route(proxy, &candidates, placed, request).await,
        // Worker specs refuse prefill and decode roles on TensorRT-LLM workers.
        WorkerFlavor::Trtllm => Err(ProxyError::NoWorkers),
    }
}

/// The body and rank header of one leg to candidate `i`, the leg's
/// rewrite applied to the client's body as the aggregated path sends it.
pub(super) async fn leg(
    proxy: &Proxy,
    candidates: &Candidates,
    i: usize,
    request: &Request<'_>,
    rewrite: impl FnOnce(&[u8]) -> Result<Vec<u8>, handoff::HandoffError> + Send + 'static,
) -> Result<Outgoing, ProxyError> {
    let s = candidates.scored[i].clone();
    let ranks = candidates
        .targets
        .get(s.worker)
        .map_or(1, |t| t.ranks.len());
    let in_body = proxy.router.config().dp_rank_in_body;
    let (req, body) = (request.req.clone(), request.body.clone());
    on_cpu(request.large, move || {
        let mut out = outgoing(in_body, &req, &s, ranks, &body)?;
        out.payload =
            Bytes::from(rewrite(&out.payload).map_err(|e| ProxyError::bad_request(e.to_string()))?);
        Ok(out)
    })
    .await?
}

/// How a vLLM prefill leg ended.
pub(super) enum Prefilled {
    /// Its `kv_transfer_params` (none for a connector that hands KV over by
    /// the prompt), from the prefill candidate at this position.
    Params(Option<Value>),
    /// The prefill worker's own answer, not a success: the client's.
    Answer(Response),
}

/// vLLM: the prefill leg (retried under the rule), then the decode leg.
async fn vllm(
    proxy: &Arc<Proxy>,
    candidates: &Candidates,
    placed: Placed,
    request: Request<'_>,
) -> Result<Response, ProxyError> {
    let Placed {
        decode,
        decode_guard,
        prefill,
        first_prefill,
        why,
        ..
    } = placed;
    let prefilling = std::pin::pin!(vllm_prefill(
        proxy,
        candidates,
        &prefill,
        first_prefill,
        &request
    ));
    let prefill_span = crate::otel::spans::phase("kvroute.prefill");
    let params = match crate::otel::within(prefill_span, prefilling).await? {
        Prefilled::Params(params) => params,
        Prefilled::Answer(response) => return Ok(response),
    };
    let decodes = decode_ranks(candidates, decode, &request);
    let decoding = std::pin::pin!(relay_decode(
        proxy,
        candidates,
        (&decodes, (decode, decode_guard)),
        params,
        &request,
        why,
    ));
    crate::otel::within(crate::otel::spans::phase("kvroute.decode"), decoding).await
}

/// The decode ranks to try a split request's decode leg on, placed rank
/// first: decode workers of the placed one's engine (the legs' protocol).
fn decode_ranks(candidates: &Candidates, placed: usize, request: &Request<'_>) -> Vec<usize> {
    let flavor = candidates.scored[placed].flavor;
    let decodes = |s: &kvroute_core::scheduler::Scored| {
        s.flavor == flavor
            && candidates
                .targets
                .get(s.worker)
                .is_some_and(|t| t.role == WorkerRole::Decode)
    };
    let tokens = request
        .req
        .body
        .tokens
        .as_ref()
        .map_or(0, |t| t.len() as u64);
    decode_order(&candidates.scored, decodes, placed, tokens)
}

/// The next of `ranks` (from position `*next`) whose worker is known and
/// not `tried`, and whose breaker lets an attempt through (begun), with its
/// target and place in the load: `first`'s guard when it is that rank,
/// else charged now (as a decode rank when `decode`).
fn next_leg<'c>(
    proxy: &Arc<Proxy>,
    candidates: &'c Candidates,
    (ranks, next): (&[usize], &mut usize),
    first: &mut Option<(usize, ActiveGuard)>,
    (request, decode): (&Request<'_>, bool),
) -> Option<(usize, &'c Target, ActiveGuard)> {
    while let Some(&i) = ranks.get(*next) {
        *next += 1;
        let Some((_, target)) = open_candidate(proxy, candidates, i) else {
            continue;
        };
        let guard = match first.take() {
            Some((charged, guard)) if charged == i => Some(guard),
            _ if decode => {
                admission::charge_decode_later(&proxy.router, candidates, request.req, i)
            }
            _ => admission::charge_later(&proxy.router, candidates, request.req, i),
        };
        if let Some(guard) = guard {
            return Some((i, target, guard));
        }
    }
    None
}

/// Tries the prefill leg on each prefill candidate in turn, as the retry
/// rule allows, until one answers.
pub(super) async fn vllm_prefill(
    proxy: &Arc<Proxy>,
    candidates: &Candidates,
    prefill: &[usize],
    mut first: Option<(usize, ActiveGuard)>,
    request: &Request<'_>,
) -> Result<Prefilled, ProxyError> {
    let mut last_error = String::from("no prefill worker available");
    let max_attempts = proxy.router.config().max_attempts.max(1);
    for (attempt, &i) in prefill.iter().take(max_attempts).enumerate() {
        let Some((_, target)) = open_candidate(proxy, candidates, i) else {
            continue;
        };
        if attempt > 0 {
            proxy.router.metrics.retries.inc();
        }
        let guard = match first.take() {
            Some((charged, guard)) if charged == i => guard,
            _ => match admission::charge_later(&proxy.router, candidates, request.req, i) {
                Some(guard) => guard,
                None => continue,
            },
        };
        let out = leg(proxy, candidates, i, request, handoff::vllm_prefill_body).await?;
        let sent = tokio::time::timeout(
            proxy.router.config().prefill_timeout,
            send(
                proxy,
                target,
                request.endpoint,
                out,
                request.headers,
                request.request_id,
            ),
        )
        .await;
        let resp = match sent {
            Err(_) => return Err(prefill_timed_out(proxy, target, request.request_id)),
            Ok(Sent::Answer(resp)) => resp,
            Ok(Sent::Refused(message)) => {
                last_error = message;
                continue;
            }
            Ok(Sent::Failed(error)) => return Err(error),
        };
        let answer = read_whole(proxy, target, resp, request.request_id).await;
        drop(guard);
        return answer;
    }
    Err(ProxyError::UpstreamUnreachable(last_error))
}

/// The error for a prefill leg that got no answer in `--prefill-timeout-secs`:
/// the worker took it and failed, so the rule opens its breaker.
fn prefill_timed_out(proxy: &Proxy, target: &Target, request_id: &str) -> ProxyError {
    outcome::settle(
        &proxy.router,
        &target.name,
        Ending::LostBeforeAnswer,
        request_id,
    );
    let detail = format!(
        "no prefill answer within {} s",
        proxy.router.config().prefill_timeout.as_secs()
    );
    ProxyError::lost(ErrorKind::UpstreamFailed, &target.name, request_id, detail)
}

/// Reads a prefill worker's whole answer: its `kv_transfer_params` when it
/// succeeded, the answer itself (for the client) when it did not.
async fn read_whole(
    proxy: &Proxy,
    target: &Target,
    resp: reqwest::Response,
    request_id: &str,
) -> Result<Prefilled, ProxyError> {
    let status = resp.status();
    let cap = proxy.router.config().max_answer_bytes;
    let read = tokio::time::timeout(
        proxy.router.config().prefill_timeout,
        answer::read_capped(resp, cap),
    )
    .await;
    let bytes = match read {
        Err(_) => return Err(prefill_timed_out(proxy, target, request_id)),
        Ok(Err(e @ AnswerError::TooLarge { .. })) => {
            // A worker's fault, not the client's: its breaker hears of it.
            outcome::settle(&proxy.router, &target.name, Ending::CutOff, request_id);
            let detail = format!("reading its prefill answer: {e}");
            return Err(ProxyError::lost(
                ErrorKind::UpstreamFailed,
                &target.name,
                request_id,
                detail,
            ));
        }
        Ok(Err(e)) => {
            outcome::settle(&proxy.router, &target.name, Ending::CutOff, request_id);
            let detail = format!(
                "reading its prefill answer: {}",
                crate::api::error_chain(&e)
            );
            return Err(ProxyError::lost(
                ErrorKind::UpstreamIncomplete,
                &target.name,
                request_id,
                detail,
            ));
        }
        Ok(Ok(bytes)) => bytes,
    };
    outcome::settle(
        &proxy.router,
        &target.name,
        Ending::Complete(status),
        request_id,
    );
    if !status.is_success() {
        let response = Response::builder()
            .status(status.as_u16())
            .header("x-kvroute-worker", &*target.name)
            .header(axum::http::header::CONTENT_TYPE, "application/json")
            .body(axum::body::Body::from(bytes))
            .map_err(|e| ProxyError::internal(e.to_string()))?;
        return Ok(Prefilled::Answer(response));
    }
    match handoff::vllm_transfer_params(&bytes) {
        Ok(params) => Ok(Prefilled::Params(params)),
        Err(e) => Err(ProxyError::lost(
            ErrorKind::UpstreamFailed,
            &target.name,
            request_id,
            e.to_string(),
        )),
    }
}

/// Sends the decode leg, with the prefill's `kv_transfer_params`, to the
/// first of `decodes` that takes it (a refused leg moves on, as the retry
/// rule allows) and relays its answer to the client.
pub(super) async fn relay_decode(
    proxy: &Arc<Proxy>,
    candidates: &Candidates,
    (decodes, placed): (&[usize], (usize, ActiveGuard)),
    params: Option<Value>,
    request: &Request<'_>,
    why: String,
) -> Result<Response, ProxyError> {
    let mut last_error = String::from("no decode worker available");
    let (mut next, mut first) = (0, Some(placed));
    let max_attempts = proxy.router.config().max_attempts.max(1);
    for attempt in 0..max_attempts {
        let leg_at = (decodes, &mut next);
        let Some((decode, target, guard)) =
            next_leg(proxy, candidates, leg_at, &mut first, (request, true))
        else {
            break;
        };
        if attempt > 0 {
            proxy.router.metrics.retries.inc();
        }
        let params = params.clone();
        let out = leg(proxy, candidates, decode, request, move |body| {
            handoff::vllm_decode_body(body, params.as_ref())
        })
        .await?;
        let added_usage = out.added_usage;
        let (endpoint, headers, id) = (request.endpoint, request.headers, request.request_id);
        let resp = match send(proxy, target, endpoint, out, headers, id).await {
            Sent::Answer(resp) => resp,
            Sent::Refused(message) => {
                last_error = message;
                continue;
            }
            Sent::Failed(error) => return Err(error),
        };
        let why = moved_on(&why, candidates, decode, attempt);
        record(proxy, candidates, (decode, attempt), request, why);
        let answer = (resp, guard, added_usage);
        return respond_decode(proxy, candidates, (decode, target), answer, request).await;
    }
    Err(ProxyError::UpstreamUnreachable(last_error))
}

/// The client's response from decode rank `decode`'s answer (with the
/// leg's load guard and whether the usage chunk was asked for on the
/// client's behalf), relayed as an aggregated answer is, but predicting
/// nothing (the decode worker received the prompt's KV) and never migrated.
async fn respond_decode(
    proxy: &Proxy,
    candidates: &Candidates,
    (decode, target): (usize, &Target),
    (resp, guard, added_usage): (reqwest::Response, ActiveGuard, bool),
    request: &Request<'_>,
) -> Result<Response, ProxyError> {
    let relay = attempt::Relay {
        guard,
        added_usage,
        request_id: request.request_id,
        locals: &[],
        arrived: request.arrived,
        predict: false,
        endpoint: request.endpoint,
        migration: None,
    };
    let s = &candidates.scored[decode];
    attempt::respond(proxy, request.req, s, target, resp, relay)
        .await?
        .answer()
}

/// The decision's reason, naming the decode rank the leg went to when it
/// is not the placed one (`refused` legs before it were refused).
fn moved_on(why: &str, candidates: &Candidates, decode: usize, refused: usize) -> String {
    if refused == 0 {
        return why.to_owned();
    }
    format!(
        "{why}; decode on {} after {refused} refused",
        rank_name(candidates, decode)
    )
}

/// A rank's name in decisions: `worker/rank` (`?` for a position or
/// worker no longer known).
pub(super) fn rank_name(candidates: &Candidates, i: usize) -> String {
    candidates.scored.get(i).map_or_else(
        || "?".to_owned(),
        |s| {
            let worker = candidates.targets.get(s.worker).map_or("?", |t| &t.name);
            format!("{worker}/{}", s.key.rank)
        },
    )
}

/// Puts the decision in the dashboard's ring.
fn record(
    proxy: &Proxy,
    candidates: &Candidates,
    (decode, retries): (usize, usize),
    request: &Request<'_>,
    why: String,
) {
    let Some(target) = candidates.targets.get(candidates.scored[decode].worker) else {
        return;
    };
    let chosen = admission::Chosen {
        candidates,
        ordered: &[decode],
        index: decode,
        retries,
    };
    let mut decision = admission::decision(
        &proxy.router,
        request.req,
        request.request_id,
        target,
        chosen,
    );
    decision.disagg = Some(why);
    proxy.router.observed.routed(decision);
}

/// The host of a worker's URL, as its peers reach it (IPv6 without brackets).
fn host_of(url: &str) -> String {
    reqwest::Url::parse(url)
        .ok()
        .and_then(|u| u.host_str().map(|h| h.trim_matches(['[', ']']).to_owned()))
        .unwrap_or_default()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_bootstrap_host_is_the_prefill_workers_host() {
        assert_eq!(host_of("http://10.0.0.5:30000"), "10.0.0.5");
        assert_eq!(host_of("http://[::1]:30000"), "::1");
        assert_eq!(host_of("http://prefill-0.svc:8000/"), "prefill-0.svc");
        assert_eq!(host_of("not a url"), "");
    }
}
