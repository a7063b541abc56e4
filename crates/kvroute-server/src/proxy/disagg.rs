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
//!   the retry rule (`super::outcome`); then the decode leg with
//!   the prefill's `kv_transfer_params`, its answer relayed to the client;
//! * SGLang: both legs at once with one bootstrap room; if either fails
//!   before the decode answers, the other is dropped (cancelled) too.
//!
//! A request is sent to one decode worker at most: a decode leg that fails
//! is the client's error, never retried elsewhere. Workers with
//! `role=both` in such a fleet decode like decode workers and always
//! prefill their own requests.

use std::sync::Arc;

use axum::body::Bytes;
use axum::response::Response;
use kvroute_core::event::WorkerFlavor;
use serde_json::Value;

use super::answer::{self, AnswerError};
use super::attempt::{self, open_candidate, outgoing, send, Outgoing, Request, Sent};
use super::handoff::{self, Bootstrap};
use super::merge;
use super::outcome::{self, Ending};
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
        WorkerFlavor::Sglang => sglang(proxy, &candidates, placed, request).await,
        // Worker specs refuse prefill and decode roles on TensorRT-LLM workers.
        WorkerFlavor::Trtllm => Err(ProxyError::NoWorkers),
    }
}

/// The body and rank header of one leg to candidate `i`, the leg's
/// rewrite applied to the client's body as the aggregated path sends it.
async fn leg(
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
enum Prefilled {
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
    let params = match vllm_prefill(proxy, candidates, &prefill, first_prefill, &request).await? {
        Prefilled::Params(params) => params,
        Prefilled::Answer(response) => return Ok(response),
    };
    let out = leg(proxy, candidates, decode, &request, move |body| {
        handoff::vllm_decode_body(body, params.as_ref())
    })
    .await?;
    relay_decode(
        proxy,
        candidates,
        (decode, decode_guard),
        out,
        &request,
        why,
    )
    .await
}

/// Tries the prefill leg on each prefill candidate in turn, as the retry
/// rule allows, until one answers.
async fn vllm_prefill(
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

/// Sends the decode leg to decode rank `decode` (once: never to another
/// decode worker) and relays its answer to the client.
async fn relay_decode(
    proxy: &Arc<Proxy>,
    candidates: &Candidates,
    (decode, guard): (usize, ActiveGuard),
    out: Outgoing,
    request: &Request<'_>,
    why: String,
) -> Result<Response, ProxyError> {
    let s = &candidates.scored[decode];
    let target = candidates
        .targets
        .get(s.worker)
        .ok_or(ProxyError::NoWorkers)?;
    let added_usage = out.added_usage;
    let resp = match send(
        proxy,
        target,
        request.endpoint,
        out,
        request.headers,
        request.request_id,
    )
    .await
    {
        Sent::Answer(resp) => resp,
        Sent::Refused(message) => return Err(ProxyError::UpstreamUnreachable(message)),
        Sent::Failed(error) => return Err(error),
    };
    record(proxy, candidates, decode, request, why);
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
    attempt::respond(proxy, request.req, s, target, resp, relay)
        .await?
        .answer()
}

/// Puts the decision in the dashboard's ring.
fn record(
    proxy: &Proxy,
    candidates: &Candidates,
    decode: usize,
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
        retries: 0,
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

/// The most prompts one request may carry to SGLang: one bootstrap room each.
const MAX_BATCH: usize = 4_096;

/// SGLang: both legs at once, in one bootstrap room; the decode's answer
/// relayed, the prefill's read to its end in the background.
async fn sglang(
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
    // Both legs go at once, so a prefill refusal cannot be retried
    // elsewhere without sending the decode leg twice: one prefill worker.
    let (p, prefill_guard) = match first_prefill {
        Some(first) => first,
        None => {
            return Err(ProxyError::UpstreamUnreachable(
                "no prefill worker available".into(),
            ))
        }
    };
    debug_assert_eq!(prefill.first(), Some(&p));
    let prefill_target = in_rotation(proxy, candidates, p)?;
    let (bootstrap, batch) = sglang_bootstrap(proxy, prefill_target, request.body)?;
    let legs = |i: usize| {
        let bootstrap = bootstrap.clone();
        leg(proxy, candidates, i, &request, move |body| {
            handoff::sglang_body(body, &bootstrap, batch)
        })
    };
    let (prefill_out, decode_out) = (legs(p).await?, legs(decode).await?);
    let decode_target = candidates
        .targets
        .get(candidates.scored[decode].worker)
        .ok_or(ProxyError::NoWorkers)?;
    let added_usage = decode_out.added_usage;
    let (prefill_resp, decode_resp) = both(
        send(
            proxy,
            prefill_target,
            request.endpoint,
            prefill_out,
            request.headers,
            request.request_id,
        ),
        send(
            proxy,
            decode_target,
            request.endpoint,
            decode_out,
            request.headers,
            request.request_id,
        ),
    )
    .await?;
    record(proxy, candidates, decode, &request, why);
    if request.req.body.input_logprobs && !request.req.body.stream {
        let rank = candidates.scored[decode].key.rank.0;
        let prefill = merge::LegAnswer {
            target: prefill_target,
            resp: prefill_resp,
            guard: prefill_guard,
        };
        let decode = merge::LegAnswer {
            target: decode_target,
            resp: decode_resp,
            guard: decode_guard,
        };
        let answer = merge::respond(proxy, prefill, decode, (rank, request.request_id)).await;
        proxy.router.timed(request.arrived, None);
        return answer;
    }
    drain_prefill(
        proxy,
        prefill_target.name.clone(),
        prefill_resp,
        prefill_guard,
        request.request_id,
    );
    let relay = attempt::Relay {
        guard: decode_guard,
        added_usage,
        request_id: request.request_id,
        locals: &[],
        arrived: request.arrived,
        predict: false,
        endpoint: request.endpoint,
        migration: None,
    };
    let s = &candidates.scored[decode];
    attempt::respond(proxy, request.req, s, decode_target, decode_resp, relay)
        .await?
        .answer()
}

/// The target of candidate `p`, its attempt begun: an error when its
/// breaker has it out of rotation (the SGLang prefill worker, which has no
/// second try).
fn in_rotation<'a>(
    proxy: &Proxy,
    candidates: &'a Candidates,
    p: usize,
) -> Result<&'a Target, ProxyError> {
    let target = candidates
        .targets
        .get(candidates.scored[p].worker)
        .ok_or(ProxyError::NoWorkers)?;
    if !proxy.router.breakers().begin_attempt(&target.route.name) {
        return Err(ProxyError::UpstreamUnreachable(format!(
            "prefill worker `{}` is out of rotation",
            target.name
        )));
    }
    Ok(target)
}

/// The bootstrap both SGLang legs name: the prefill worker's host and
/// bootstrap port, and one fresh room per prompt of the body (at most
/// [`MAX_BATCH`]); with the body's prompt count when it is a batch.
fn sglang_bootstrap(
    proxy: &Proxy,
    prefill_target: &Target,
    body: &[u8],
) -> Result<(Bootstrap, Option<usize>), ProxyError> {
    let batch = handoff::batch_size(body).map_err(|e| ProxyError::bad_request(e.to_string()))?;
    if batch.is_some_and(|n| n > MAX_BATCH) {
        return Err(ProxyError::bad_request(format!(
            "at most {MAX_BATCH} prompts per disaggregated request"
        )));
    }
    let bootstrap = Bootstrap {
        host: host_of(&prefill_target.url),
        port: Some(
            prefill_target
                .bootstrap_port
                .unwrap_or(handoff::DEFAULT_BOOTSTRAP_PORT),
        ),
        rooms: (0..batch.unwrap_or(1))
            .map(|_| Bootstrap::room(proxy.router.random_u64()))
            .collect(),
    };
    Ok((bootstrap, batch))
}

/// Sends both SGLang legs at once and waits for both heads; the first leg
/// to fail drops (cancels) the other, which would otherwise wait for a
/// bootstrap room that never fills.
async fn both(
    prefill: impl std::future::Future<Output = Sent>,
    decode: impl std::future::Future<Output = Sent>,
) -> Result<(reqwest::Response, reqwest::Response), ProxyError> {
    tokio::pin!(prefill);
    tokio::pin!(decode);
    let (mut p, mut d) = (None, None);
    loop {
        tokio::select! {
            sent = &mut prefill, if p.is_none() => p = Some(answered(sent, true)?),
            sent = &mut decode, if d.is_none() => d = Some(answered(sent, false)?),
        }
        if p.is_some() && d.is_some() {
            if let (Some(p), Some(d)) = (p.take(), d.take()) {
                return Ok((p, d));
            }
        }
    }
}

/// A leg's answer, or the error the request ends with. A prefill leg must
/// succeed: its decode twin cannot finish without it.
fn answered(sent: Sent, prefill: bool) -> Result<reqwest::Response, ProxyError> {
    match sent {
        Sent::Answer(resp) if prefill && !resp.status().is_success() => Err(
            ProxyError::UpstreamUnreachable(format!("the prefill leg answered {}", resp.status())),
        ),
        Sent::Answer(resp) => Ok(resp),
        Sent::Refused(message) => Err(ProxyError::UpstreamUnreachable(message)),
        Sent::Failed(error) => Err(error),
    }
}

/// Reads an SGLang prefill leg's answer to its end in the background, then
/// settles the worker's breaker and frees its prefill load.
fn drain_prefill(
    proxy: &Arc<Proxy>,
    worker: Arc<str>,
    resp: reqwest::Response,
    guard: ActiveGuard,
    request_id: &str,
) {
    let (proxy, request_id) = (proxy.clone(), request_id.to_owned());
    let timeout = proxy.router.config().prefill_timeout;
    tokio::spawn(async move {
        let status = resp.status();
        let ending = match tokio::time::timeout(timeout, answer::drain(resp)).await {
            Ok(Ok(())) => Ending::Complete(status),
            Ok(Err(_)) | Err(_) => Ending::CutOff,
        };
        outcome::settle(&proxy.router, &worker, ending, &request_id);
        drop(guard);
    });
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
