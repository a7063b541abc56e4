//! A disaggregated request's plan: where its decode phase goes, and its
//! prefill phase unless the decode rank computes the prompt itself.
//!
//! The decode rank first ([`pick_decode`] under `kv` and `approx` for a
//! tokenized prompt: its load, with credit for its own cache only where the
//! [`LocalPrefillRule`] lets it prefill; the policy's order among the ranks
//! that decode otherwise); then, unless it prefills locally or is an
//! aggregated worker, the prefill ranks in the policy's order among the
//! prefill workers ([`prefill_order`]), the stickiness of `kv` included:
//! a prefill worker's cache is what saves a split request's work, so its
//! prefix stays where it is as an aggregated request's does.

use super::{relaxed, Draw, Placer, WhenAllBusy};
use crate::event::WorkerFlavor;
use crate::scheduler::candidates::Scored;
use crate::scheduler::disagg::{pick_decode, prefill_order, DecodeCost, LocalPrefillRule};
use crate::scheduler::{Policy, RouteTarget, WorkerRole};

/// What a plan needs to know of the fleet besides the candidates.
#[derive(Clone, Copy)]
struct SplitFleet<'a> {
    /// Each worker's role, by its position in the caller's list
    /// ([`Scored::worker`]).
    role: &'a dyn Fn(usize) -> WorkerRole,
    /// Some decode worker runs SGLang: those take no request without a
    /// bootstrap room, so no decode rank prefills locally.
    sglang_decodes: bool,
}

impl<'a> SplitFleet<'a> {
    fn with<T: AsRef<RouteTarget>, R>(
        targets: &'a [T],
        then: impl FnOnce(SplitFleet<'_>) -> R,
    ) -> R {
        let role = |w: usize| targets.get(w).map_or(WorkerRole::Both, |t| t.as_ref().role);
        let sglang_decodes = targets
            .iter()
            .map(AsRef::as_ref)
            .any(|t| t.role == WorkerRole::Decode && t.flavor == WorkerFlavor::Sglang);
        then(SplitFleet {
            role: &role,
            sglang_decodes,
        })
    }
}

/// Where a disaggregated request's phases go, before anything is charged.
#[derive(Debug, Clone, PartialEq)]
pub struct Plan {
    /// The decode rank (a position in the candidates).
    pub decode: usize,
    /// Its decode cost, and whether it prefills the request itself.
    pub cost: DecodeCost,
    /// Prefill ranks in the order to try them; empty when the decode rank
    /// prefills (the rule says so, it is an aggregated worker, or no
    /// prefill rank is free).
    pub prefill: Vec<usize>,
    /// The rule the plan was made under.
    pub rule: LocalPrefillRule,
}

impl Placer {
    /// Places a request of `tokens` prompt tokens (`None`: unknown, no
    /// KV-aware choice) on the candidates of a disaggregated fleet,
    /// `targets` (the caller's list, each worker's role); takes one
    /// turn and one random draw. `None` when no rank may decode it, or
    /// when an SGLang decode rank would need a prefill worker and none is
    /// free (then, with [`WhenAllBusy::PlaceAnyway`], busy ranks are
    /// considered too).
    pub fn plan_split<T: AsRef<RouteTarget>>(
        &mut self,
        scored: &[Scored],
        targets: &[T],
        tokens: Option<u64>,
    ) -> Option<Plan> {
        let draw = self.draw();
        SplitFleet::with(targets, |fleet| {
            self.plan_with(scored, fleet, tokens, draw).or_else(|| {
                (self.config.when_all_busy == WhenAllBusy::PlaceAnyway)
                    .then(|| self.plan_with(&relaxed(scored), fleet, tokens, draw))
                    .flatten()
            })
        })
    }

    /// The plan `/query` shows: [`Placer::plan_split`] at `random` on the
    /// first turn, nothing recorded.
    pub fn preview_split<T: AsRef<RouteTarget>>(
        &self,
        scored: &[Scored],
        targets: &[T],
        tokens: Option<u64>,
        random: f64,
    ) -> Option<Plan> {
        let draw = Draw { turn: 0, random };
        SplitFleet::with(targets, |fleet| self.plan_with(scored, fleet, tokens, draw))
    }

    fn plan_with(
        &self,
        scored: &[Scored],
        fleet: SplitFleet<'_>,
        tokens: Option<u64>,
        draw: Draw,
    ) -> Option<Plan> {
        let kv = matches!(self.config.policy, Policy::Kv | Policy::Approx) && tokens.is_some();
        let tokens = tokens.unwrap_or(0);
        let rule = if kv && !fleet.sglang_decodes {
            self.config.local_prefill
        } else {
            LocalPrefillRule::NEVER
        };
        let role = |s: &Scored| (fleet.role)(s.worker);
        let by_policy = |subset: &[Scored]| self.by_policy(subset, draw);
        let (decode, cost) = if kv {
            pick_decode(scored, |s| role(s).decodes(), tokens, &rule, draw.random)?
        } else {
            let i = *prefill_order(scored, |s| role(s).decodes(), by_policy).first()?;
            (i, DecodeCost::of(&scored[i], tokens, &rule))
        };
        let aggregated = role(&scored[decode]) == WorkerRole::Both;
        let prefill = if cost.local || aggregated {
            Vec::new()
        } else {
            prefill_order(scored, |s| role(s) == WorkerRole::Prefill, by_policy)
        };
        let needs_prefill = !cost.local && !aggregated;
        if needs_prefill && prefill.is_empty() && scored[decode].flavor == WorkerFlavor::Sglang {
            return None;
        }
        Some(Plan {
            decode,
            cost,
            prefill,
            rule,
        })
    }
}
