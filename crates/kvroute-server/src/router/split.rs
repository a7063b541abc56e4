//! A request through a disaggregated fleet, placed: workers registered
//! with `role=prefill` compute prompts, workers with `role=decode`
//! generate. The core's placer plans both phases
//! ([`Placer::plan_split`](kvroute_core::scheduler::Placer::plan_split)):
//! the decode rank first, by its load, with credit for its own cache only
//! where that cache lets it prefill the request itself; then, unless it
//! does, the prefill ranks, by the same KV-aware cost as an aggregated
//! request. Each chosen rank is charged here; the forwarder runs the legs
//! ([`crate::proxy`]).

use std::sync::Arc;

use kvroute_core::scheduler::{Plan, WorkerRole};

use super::active::ActiveGuard;
use super::admission::{charge, charge_as};
use super::candidates::{Candidates, Target};
use super::intake::RoutedRequest;
use super::queue::QueueWait;
use super::{on_cpu, Router};
use crate::api::ProxyError;

/// Whether requests to this fleet are split: it has prefill workers and
/// decode workers.
pub fn splits(targets: &[Target]) -> bool {
    targets.iter().any(|t| t.role == WorkerRole::Prefill)
        && targets.iter().any(|t| t.role == WorkerRole::Decode)
}

/// Where a request's phases go, each chosen rank already charged.
pub(crate) struct Placed {
    /// The decode rank (a position in the candidates).
    pub decode: usize,
    /// The decode rank's place in its load.
    pub decode_guard: ActiveGuard,
    /// Prefill ranks in the order to try them; empty when the decode rank
    /// prefills the request itself.
    pub prefill: Vec<usize>,
    /// The first of them, charged with the prefill.
    pub first_prefill: Option<(usize, ActiveGuard)>,
    /// Where each phase goes and why, for the decisions ring and logs.
    pub why: String,
}

/// Scores a request of a disaggregated fleet and places its phases,
/// charging each chosen rank; when no rank may take a phase now, waits in
/// the overload queue as an aggregated request does (when it is on), or
/// refuses with [`ProxyError::NoWorkers`].
pub(crate) async fn admit(
    router: &Arc<Router>,
    req: &Arc<RoutedRequest>,
    large: bool,
) -> Result<(Candidates, Placed), ProxyError> {
    let mut wait = QueueWait::new(router, req);
    let mut ranks = 0;
    let (candidates, placed) = loop {
        if wait.may_try() {
            let (candidates, placed) = {
                let (router, req) = (router.clone(), req.clone());
                on_cpu(large, move || place(&router, &req)).await?
            };
            match placed {
                Some(placed) => break (candidates, placed),
                // No rank may take a phase now: busy ranks wait in the queue
                // as an aggregated request does, when it is on.
                None if !candidates.scored.is_empty() && router.config().queue_capacity > 0 => {
                    ranks = candidates.scored.len();
                }
                None => {
                    router.metrics.no_workers.inc();
                    return Err(ProxyError::NoWorkers);
                }
            }
        }
        wait.busy(ranks).await?;
    };
    Ok((candidates, placed))
}

/// Scores the request and places its phases (the core's
/// [`Placer::plan_split`](kvroute_core::scheduler::Placer::plan_split))
/// while the loads they were scored on are held; `None` when no rank may
/// decode it.
fn place(router: &Arc<Router>, req: &RoutedRequest) -> (Candidates, Option<Placed>) {
    router.candidates_for(&req.body, |candidates, ranks| {
        let tokens = req.body.tokens.as_ref().map(|t| t.len() as u64);
        let plan = router
            .placer()
            .plan_split(&candidates.scored, &candidates.targets, tokens)?;
        let why = explain(candidates, &plan, tokens.unwrap_or(0));
        let Plan {
            decode, prefill, ..
        } = plan;
        let decode_guard = charge_as(router, ranks, (candidates, req, decode), prefill.is_empty())?;
        let first_prefill = prefill
            .first()
            .and_then(|&i| Some((i, charge(router, ranks, candidates, req, i)?)));
        Some(Placed {
            decode,
            decode_guard,
            prefill,
            first_prefill,
            why,
        })
    })
}

/// In words: where each phase goes and why.
pub(crate) fn explain(candidates: &Candidates, plan: &Plan, tokens: u64) -> String {
    let Plan {
        decode,
        cost,
        prefill,
        rule,
    } = plan;
    let decode = *decode;
    let name = |i: usize| {
        let s = &candidates.scored[i];
        let worker = candidates.targets.get(s.worker).map_or("?", |t| &t.name);
        format!("{worker}/{}", s.key.rank)
    };
    let uncached = format!(
        "{} of {tokens} prompt tokens uncached on decode rank {} (decode cost {:.1})",
        cost.uncached_tokens,
        name(decode),
        cost.total
    );
    match prefill.first() {
        _ if cost.local => format!(
            "prefilled on the decode rank: {uncached}, under {} tokens and {} of the prompt",
            rule.max_uncached_tokens, rule.max_uncached_fraction
        ),
        None => format!("prefilled on the decode rank (no prefill worker to split to): {uncached}"),
        Some(&p) => format!(
            "split: {uncached}; prefill on {} ({} tokens uncached there)",
            name(p),
            candidates.scored[p].uncached_prefill_tokens(tokens)
        ),
    }
}
