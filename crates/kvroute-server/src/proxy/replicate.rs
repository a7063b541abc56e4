//! Copies of hot prefixes made ahead of demand: when the placer finds a
//! prefix's holder saturated for longer than `--replicate-hot-ms`
//! ([`kvroute_core::scheduler::Replicator`]), it asks for the prefix to be
//! copied to the rank a fetch would choose, so that later requests of the
//! prefix split between two holders instead of queueing on one.
//!
//! The copy runs beside the request that found the prefix hot, never in
//! its way, with the engines' own hand-off between two aggregated vLLM
//! workers, as a fetch moves a prefix ([`super::fetch`]): the holder
//! answers a one-token leg (`do_remote_decode`) from its cache with
//! `kv_transfer_params`, then the second rank runs a one-token request
//! with those params, reading the blocks it lacks from the holder; its
//! engine announces them as stored, so the index lists two holders.
//!
//! A copy is only ever extra work: one that fails (a leg refused, failed,
//! or past `--prefill-timeout-secs`, a holder that dies mid-copy) costs no
//! request and is counted `failed`; pairs without a hand-off (SGLang,
//! TensorRT-LLM, mixed engines) and copies beyond [`MAX_IN_FLIGHT`] are
//! `skipped`. Each rank's copies stay within `--replica-budget-blocks`
//! (the placer's count, released when the rank's cache evicts them).

use std::sync::Arc;

use axum::body::Bytes;
use axum::http::HeaderMap;
use kvroute_core::event::WorkerFlavor;
use kvroute_core::scheduler::Replicate;

use super::answer;
use super::disagg::{self, Prefilled};
use super::handoff;
use super::outcome::{self, Ending};
use super::send::{open_candidate, send, Request, Sent};
use super::Proxy;
use crate::metrics::fetch::ReplicaOutcome;
use crate::router::admission;
use crate::router::candidates::Candidates;
use crate::router::intake::RoutedRequest;
use crate::router::Endpoint;

/// Copies running at once, at most: more are skipped (a copy is extra
/// load on a saturated holder).
pub const MAX_IN_FLIGHT: usize = 4;

/// The copy's reason in the request's decision: what moves where.
pub fn explain(candidates: &Candidates, copy: &Replicate) -> String {
    format!(
        "replicate: hot prefix, {} blocks copied ahead of demand from {} to {}",
        copy.blocks,
        disagg::rank_name(candidates, copy.source),
        disagg::rank_name(candidates, copy.target),
    )
}

/// Starts `copy` (positions in `candidates`) of `request`'s prefix in the
/// background, or counts it skipped (see the module docs).
pub fn spawn(proxy: &Arc<Proxy>, copy: Replicate, candidates: &Candidates, request: &Request<'_>) {
    let metrics = &proxy.router.metrics.replicas;
    metrics.started.inc();
    let flavor = |i: usize| candidates.scored.get(i).map(|s| s.flavor);
    let vllm = Some(WorkerFlavor::Vllm);
    if flavor(copy.source) != vllm || flavor(copy.target) != vllm {
        tracing::debug!(
            request_id = request.request_id,
            "copy skipped: no vLLM hand-off"
        );
        metrics.ended(ReplicaOutcome::Skipped, copy.blocks);
        return;
    }
    let Ok(permit) = proxy.copies.clone().try_acquire_owned() else {
        metrics.ended(ReplicaOutcome::Skipped, copy.blocks);
        return;
    };
    let body = match handoff::one_token_body(request.body) {
        Ok(body) => Bytes::from(body),
        Err(e) => {
            tracing::debug!(request_id = request.request_id, "copy skipped: {e}");
            metrics.ended(ReplicaOutcome::Skipped, copy.blocks);
            return;
        }
    };
    let owned = Owned {
        req: request.req.clone(),
        headers: request.headers.clone(),
        body,
        endpoint: request.endpoint,
        request_id: format!("{}-replica", request.request_id),
        large: request.large,
    };
    let (proxy, candidates) = (proxy.clone(), candidates.clone());
    let why = explain(&candidates, &copy);
    tokio::spawn(async move {
        let request = owned.request();
        let ended = make(&proxy, &candidates, copy, &request).await;
        let outcome = match ended {
            Ok(()) => {
                tracing::info!(request_id = request.request_id, "{why}");
                ReplicaOutcome::Copied
            }
            Err(detail) => {
                tracing::info!(request_id = request.request_id, "{why}: failed: {detail}");
                ReplicaOutcome::Failed
            }
        };
        proxy.router.metrics.replicas.ended(outcome, copy.blocks);
        drop(permit);
    });
}

/// What a copy's legs need of the request that found the prefix hot.
struct Owned {
    req: Arc<RoutedRequest>,
    headers: HeaderMap,
    /// The client's body cut to one unstreamed token.
    body: Bytes,
    endpoint: Endpoint,
    request_id: String,
    large: bool,
}

impl Owned {
    fn request(&self) -> Request<'_> {
        Request {
            req: &self.req,
            headers: &self.headers,
            body: &self.body,
            endpoint: self.endpoint,
            request_id: &self.request_id,
            large: self.large,
            arrived: std::time::Instant::now(),
            disagg: None,
        }
    }
}

/// The copy's two legs: the holder's one-token leg for its
/// `kv_transfer_params`, then the target's with them; `Err` says why
/// nothing was copied.
async fn make(
    proxy: &Arc<Proxy>,
    candidates: &Candidates,
    copy: Replicate,
    request: &Request<'_>,
) -> Result<(), String> {
    let held = disagg::vllm_prefill(proxy, candidates, &[copy.source], None, request).await;
    let params = match held {
        Ok(Prefilled::Params(Some(params))) => params,
        Ok(Prefilled::Params(None)) => return Err("the holder named no kv_transfer_params".into()),
        Ok(Prefilled::Answer(answer)) => {
            return Err(format!("the holder answered {}", answer.status()))
        }
        Err(e) => return Err(e.message()),
    };
    let Some((_, target)) = open_candidate(proxy, candidates, copy.target) else {
        return Err("the target is unavailable (breaker open or unknown)".into());
    };
    let router = &proxy.router;
    let Some(guard) = admission::charge_later(router, candidates, request.req, copy.target) else {
        return Err("the target could not be charged".into());
    };
    let rewrite = move |body: &[u8]| handoff::vllm_decode_body(body, Some(&params));
    let out = disagg::leg(proxy, candidates, copy.target, request, rewrite)
        .await
        .map_err(|e| e.message())?;
    let (endpoint, headers, id) = (request.endpoint, request.headers, request.request_id);
    let timeout = router.config().prefill_timeout;
    let sent = tokio::time::timeout(timeout, send(proxy, target, endpoint, out, headers, id)).await;
    let resp = match sent {
        Err(_) => {
            outcome::settle(router, &target.name, Ending::LostBeforeAnswer, id);
            return Err(format!(
                "no answer from the target within {} s",
                timeout.as_secs()
            ));
        }
        Ok(Sent::Answer(resp)) => resp,
        Ok(Sent::Refused(message)) => return Err(format!("the target refused: {message}")),
        Ok(Sent::Failed(error)) => return Err(error.message()),
    };
    let status = resp.status();
    let cap = router.config().max_answer_bytes;
    let read = tokio::time::timeout(timeout, answer::read_capped(resp, cap)).await;
    drop(guard);
    match read {
        Ok(Ok(_)) => {
            outcome::settle(router, &target.name, Ending::Complete(status), id);
            match status.is_success() {
                true => Ok(()),
                false => Err(format!("the target answered {status}")),
            }
        }
        Ok(Err(e)) => {
            outcome::settle(router, &target.name, Ending::CutOff, id);
            Err(format!("reading the target's answer: {e}"))
        }
        Err(_) => {
            outcome::settle(router, &target.name, Ending::CutOff, id);
            Err(format!(
                "the target's answer took over {} s",
                timeout.as_secs()
            ))
        }
    }
}
