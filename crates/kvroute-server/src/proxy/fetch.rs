//! Moving the cache instead of the work, executed: when the placer
//! decides that a request runs on a cooler rank that first receives its
//! prefix from the busy holder ([`kvroute_core::scheduler::fetch`]), the
//! two legs of a disaggregated vLLM request ([`super::disagg`]) run
//! between two aggregated (`both`) workers:
//!
//! 1. the holder answers the one-token leg (`do_remote_decode`) from its
//!    cache, holding the prompt's blocks, with `kv_transfer_params`;
//! 2. the receiver runs the client's request with those params: its engine
//!    reads the blocks it lacks from the holder and decodes, and announces
//!    them as stored, so the index learns it holds the prefix too.
//!
//! The request is never lost to the hand-off: a holder leg that fails, is
//! refused, answers without params or takes over `--prefill-timeout-secs`
//! falls back to a plain request on the receiver (which recomputes the
//! prefix), counted as `fell_back`. Only vLLM pairs hand off; a fetch the
//! placer plans between other engines is sent as a plain request to the
//! receiver.

use std::sync::Arc;

use axum::response::Response;
use kvroute_core::event::WorkerFlavor;
use kvroute_core::scheduler::Fetch;

use super::attempt::{self, Request};
use super::disagg::{self, Prefilled};
use super::Proxy;
use crate::api::ProxyError;
use crate::metrics::fetch::FetchOutcome;
use crate::router::admission::Admitted;
use crate::router::candidates::Candidates;

/// Runs an admitted request whose first candidate receives its prefix as
/// `fetch` says (see the module docs).
pub async fn route(
    proxy: &Arc<Proxy>,
    admitted: Admitted,
    fetch: Fetch,
    request: Request<'_>,
) -> Result<Response, ProxyError> {
    let (candidates, ordered, first) = admitted.into_parts();
    let vllm = |i: usize| {
        candidates
            .scored
            .get(i)
            .is_some_and(|s| s.flavor == WorkerFlavor::Vllm)
    };
    let placed = match first {
        Some((i, guard)) if i == fetch.receiver && vllm(i) && vllm(fetch.source) => (i, guard),
        first => {
            let admitted = Admitted::new(candidates, ordered, first);
            return attempt::forward(proxy, admitted, request).await;
        }
    };
    let why = explain(&candidates, &fetch);
    tracing::debug!(request_id = request.request_id, fetch = %why, "fetching the prefix");
    let metrics = &proxy.router.metrics.fetch;
    metrics.started.inc();
    let source = [fetch.source];
    let held = disagg::vllm_prefill(proxy, &candidates, &source, None, &request).await;
    let params = match held {
        Ok(Prefilled::Params(Some(params))) => params,
        other => {
            let detail = match other {
                Ok(Prefilled::Params(_)) => "the holder named no kv_transfer_params".to_owned(),
                Ok(Prefilled::Answer(answer)) => format!("the holder answered {}", answer.status()),
                Err(e) => e.message(),
            };
            metrics.ended(FetchOutcome::FellBack);
            tracing::info!(
                request_id = request.request_id,
                "fetch fell back to recomputing: {detail}"
            );
            let why = format!("{why}; fell back to recomputing: {detail}");
            let request = Request {
                disagg: Some(&why),
                ..request
            };
            let admitted = Admitted::new(candidates, ordered, Some(placed));
            return attempt::forward(proxy, admitted, request).await;
        }
    };
    metrics.ended(FetchOutcome::HandedOff);
    let params = Some(params);
    disagg::relay_decode(
        proxy,
        &candidates,
        (&ordered, placed),
        params,
        &request,
        why,
    )
    .await
}

/// The decision's reason: why the prefix moved, how many blocks from
/// which rank, and the costs compared.
pub fn explain(candidates: &Candidates, fetch: &Fetch) -> String {
    let rank = |i: usize| {
        candidates.scored.get(i).map_or_else(
            || "?".to_owned(),
            |s| {
                let worker = candidates.targets.get(s.worker).map_or("?", |t| &t.name);
                format!("{worker}/{}", s.key.rank)
            },
        )
    };
    format!(
        "{}: {} blocks from {} to {} (cost {:.2} instead of {:.2})",
        fetch.reason.as_str(),
        fetch.blocks,
        rank(fetch.source),
        rank(fetch.receiver),
        fetch.cost,
        fetch.instead,
    )
}
