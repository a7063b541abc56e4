//! Moving the cache instead of the work, executed: when the placer
//! decides that a request runs on a cooler rank that first receives its
//! prefix from the busy holder ([`kvroute_core::scheduler::fetch`]), the
//! two legs of a disaggregated request ([`super::disagg`]) run between two
//! aggregated (`both`) workers of one engine:
//!
//! * vLLM: the holder answers the one-token leg (`do_remote_decode`) from
//!   its cache, holding the prompt's blocks, with `kv_transfer_params`;
//!   then the receiver runs the client's request with those params: its
//!   engine reads the blocks it lacks from the holder and decodes;
//! * SGLang: both legs at once in one bootstrap room
//!   ([`super::disagg::sglang::hand_off`]), the holder as the bootstrap
//!   source (its `bootstrap_port=`: an SGLang worker without one is never
//!   fetched from), the receiver reading the blocks it lacks from it.
//!
//! Either way the receiver announces the blocks as stored, so the index
//! learns it holds the prefix too.
//!
//! The request is never lost to the hand-off: a holder leg that fails, is
//! refused, answers without params or takes over `--prefill-timeout-secs`
//! (and, for SGLang, a receiver leg refused or answering an error before
//! anything reached the client) falls back to a plain request on the
//! receiver (which recomputes the prefix), counted as `fell_back`. Other
//! pairs (mixed engines, TensorRT-LLM) do not hand off: a fetch the placer
//! plans between them is sent as a plain request to the receiver.

use std::sync::Arc;

use axum::response::Response;
use kvroute_core::event::WorkerFlavor;
use kvroute_core::scheduler::Fetch;

use super::attempt::{self, Request};
use super::disagg::sglang::{self, HandOff};
use super::disagg::{self, Prefilled};
use super::Proxy;
use crate::api::ProxyError;
use crate::metrics::fetch::FetchOutcome;
use crate::router::active::ActiveGuard;
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
    let legs = legs_of(&candidates, &fetch);
    let placed = match first {
        Some((i, guard)) if i == fetch.receiver && legs.is_some() => (i, guard),
        first => {
            let admitted = Admitted::new(candidates, ordered, first);
            return attempt::forward(proxy, admitted, request).await;
        }
    };
    let why = explain(&candidates, &fetch);
    tracing::debug!(request_id = request.request_id, fetch = %why, "fetching the prefix");
    let metrics = &proxy.router.metrics.fetch;
    metrics.started.inc();
    let (detail, placed) = if legs == Some(WorkerFlavor::Sglang) {
        let pair = (fetch.source, placed);
        match sglang::hand_off(proxy, &candidates, pair, &request, why.clone()).await {
            HandOff::Answered(answer) => {
                metrics.handed_off(fetch.blocks);
                return answer;
            }
            HandOff::NotHandedOff(detail, placed) => (detail, placed),
        }
    } else {
        let source = [fetch.source];
        let held = disagg::vllm_prefill(proxy, &candidates, &source, None, &request).await;
        let detail = match held {
            Ok(Prefilled::Params(Some(params))) => {
                metrics.handed_off(fetch.blocks);
                let (decodes, params) = ((&ordered[..], placed), Some(params));
                return disagg::relay_decode(proxy, &candidates, decodes, params, &request, why)
                    .await;
            }
            Ok(Prefilled::Params(None)) => "the holder named no kv_transfer_params".to_owned(),
            Ok(Prefilled::Answer(answer)) => format!("the holder answered {}", answer.status()),
            Err(e) => e.message(),
        };
        (detail, placed)
    };
    let placement = (candidates, ordered, placed);
    fall_back(proxy, placement, request, (why, detail)).await
}

/// The engine whose legs move the prefix between a fetch's two ranks:
/// vLLM between two vLLM workers, SGLang between two SGLang workers whose
/// holder declares its bootstrap server; `None` (no hand-off) otherwise.
fn legs_of(candidates: &Candidates, fetch: &Fetch) -> Option<WorkerFlavor> {
    let source = candidates.scored.get(fetch.source)?;
    let receiver = candidates.scored.get(fetch.receiver)?;
    let bootstrap = || {
        candidates
            .targets
            .get(source.worker)
            .is_some_and(|t| t.bootstrap_port.is_some())
    };
    match (source.flavor, receiver.flavor) {
        (WorkerFlavor::Vllm, WorkerFlavor::Vllm) => Some(WorkerFlavor::Vllm),
        (WorkerFlavor::Sglang, WorkerFlavor::Sglang) if bootstrap() => Some(WorkerFlavor::Sglang),
        _ => None,
    }
}

/// A fetch that did not hand off (`detail` says why): counted, and the
/// request sent plain to the placed receiver (which recomputes the
/// prefix), then on to the next candidates as the retry rule allows.
async fn fall_back(
    proxy: &Arc<Proxy>,
    (candidates, ordered, placed): (Candidates, Vec<usize>, (usize, ActiveGuard)),
    request: Request<'_>,
    (why, detail): (String, String),
) -> Result<Response, ProxyError> {
    proxy.router.metrics.fetch.ended(FetchOutcome::FellBack);
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
    attempt::forward(proxy, admitted, request).await
}

/// The decision's reason: why the prefix moved, how many blocks from
/// which rank, and the costs compared.
pub fn explain(candidates: &Candidates, fetch: &Fetch) -> String {
    let rank = |i: usize| disagg::rank_name(candidates, i);
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
