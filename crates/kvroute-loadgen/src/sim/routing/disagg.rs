//! The simulated router's placement of a request in a disaggregated fleet,
//! as `kvroute serve`'s `proxy::disagg::place` makes it: the decode rank
//! first (`scheduler::disagg::pick_decode` under `kv` and `approx`, the
//! policy's order among the ranks that decode otherwise), then, unless the
//! decode rank prefills the request itself under the [`LocalPrefillRule`],
//! the prefill rank by the policy's order among the prefill ranks
//! (`scheduler::disagg::prefill_order`: the KV-aware cost under `kv`).
//! Each chosen rank is charged as the proxy charges it: the decode rank
//! with the prompt's uncached tokens only when it prefills them itself,
//! the prefill rank with them always.

use kvroute_core::event::WorkerFlavor;
use kvroute_core::scheduler::disagg::{pick_decode, prefill_order};
use kvroute_core::scheduler::{order, DecodeCost, LocalPrefillRule, Policy, Scored, WorkerRole};

use super::{relax, Placement, Scoring, SimRouter};
use crate::contender::{Contender, Routing};

/// Where a request's phases went in a disaggregated fleet.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Split {
    /// The decode rank, which streams the answer to the client (and
    /// prefills the request itself when `prefill` is `None`). It predicts
    /// cached tokens only when it prefills locally: a decode leg's
    /// `cached_tokens` is the KV it received, which the proxy does not
    /// compare either.
    pub decode: Placement,
    /// The prefill rank of a split request; `None`: prefilled on the
    /// decode rank.
    pub prefill: Option<Placement>,
}

/// The positions chosen among the scored ranks.
struct Chosen {
    decode: usize,
    /// Prefill ranks in the policy's order; empty: the decode rank
    /// prefills (the rule says so, or no prefill rank is free).
    prefill: Vec<usize>,
}

/// What the choice is made with: the request's size, the rule, and the
/// policy's turn and random draw.
#[derive(Clone, Copy)]
struct Ask<'a> {
    request_tokens: u64,
    routing: &'a Routing,
    rule: &'a LocalPrefillRule,
    turn: u64,
    random: f64,
}

impl SimRouter {
    /// Places a request in a fleet with prefill and decode engines and
    /// charges its ranks; `None` for the oracle or pinned groups (which
    /// place whole requests) or a fleet with no engine that decodes.
    pub fn route_split(&mut self, tokens: &[u32], now_ms: u64) -> Option<Split> {
        let Contender::Router(routing) = self.policy else {
            return None;
        };
        if self.pins.is_some() {
            return None;
        }
        let Scoring {
            mut scored,
            hashes,
            turn,
            random,
        } = self.score_request(tokens, &routing);
        let rule = self.local_prefill_rule(&routing);
        let request_tokens = tokens.len() as u64;
        let ask = Ask {
            request_tokens,
            routing: &routing,
            rule: &rule,
            turn,
            random,
        };
        let choose = |scored: &[Scored]| self.choose(scored, ask);
        // Every decode rank busy: placed with the thresholds ignored, as
        // aggregated requests are.
        let chosen = match choose(&scored) {
            Some(c) => c,
            None => {
                relax(&mut scored);
                choose(&scored)?
            }
        };
        let d = &scored[chosen.decode];
        let local = chosen.prefill.is_empty();
        let decode_prefill = if local {
            d.uncached_prefill_tokens(request_tokens)
        } else {
            0
        };
        let decode = Placement {
            engine: d.worker,
            active_id: self.charge(d, &hashes, decode_prefill, now_ms),
            predicted_cached: local.then(|| d.predicted_cached_tokens(request_tokens)),
        };
        // Only a request forwarded whole (prefilled where it decodes) is
        // recorded by the `approx` policy, as in the proxy's `forward`.
        if local && routing.policy == Policy::Approx {
            self.record_decision(d, &hashes, now_ms);
        }
        let prefill = chosen.prefill.first().map(|&p| {
            let s = &scored[p];
            let uncached = s.uncached_prefill_tokens(request_tokens);
            Placement {
                engine: s.worker,
                active_id: self.charge(s, &hashes, uncached, now_ms),
                predicted_cached: None,
            }
        });
        Some(Split { decode, prefill })
    }

    /// The rule the proxy prefills locally by: the contender's own under
    /// `kv` and `approx`, never under the load-only policies (which know
    /// nothing of the decode rank's cache), nor when SGLang engines decode
    /// (they take no request without a bootstrap room).
    fn local_prefill_rule(&self, routing: &Routing) -> LocalPrefillRule {
        let kv = matches!(routing.policy, Policy::Kv | Policy::Approx);
        let sglang_decodes = self
            .targets
            .iter()
            .any(|t| t.role == WorkerRole::Decode && t.flavor == WorkerFlavor::Sglang);
        if kv && !sglang_decodes {
            routing.disagg.local_prefill()
        } else {
            LocalPrefillRule::NEVER
        }
    }

    fn role(&self, s: &Scored) -> WorkerRole {
        self.roles.get(s.worker).copied().unwrap_or_default()
    }

    /// The decode rank and the prefill ranks among `scored`, as the proxy
    /// chooses them; `None` when no rank that decodes is free.
    fn choose(&self, scored: &[Scored], ask: Ask<'_>) -> Option<Chosen> {
        let Ask {
            request_tokens,
            routing,
            rule,
            turn,
            random,
        } = ask;
        let by_policy =
            |subset: &[Scored]| order(subset, routing.policy, routing.temperature, random, turn);
        let kv = matches!(routing.policy, Policy::Kv | Policy::Approx);
        let (decode, cost) = if kv {
            pick_decode(
                scored,
                |s| self.role(s).decodes(),
                request_tokens,
                rule,
                random,
            )?
        } else {
            let i = *prefill_order(scored, |s| self.role(s).decodes(), by_policy).first()?;
            (i, DecodeCost::of(&scored[i], request_tokens, rule))
        };
        let aggregated = self.role(&scored[decode]) == WorkerRole::Both;
        let prefill = if cost.local || aggregated {
            Vec::new()
        } else {
            prefill_order(scored, |s| self.role(s) == WorkerRole::Prefill, by_policy)
        };
        Some(Chosen { decode, prefill })
    }
}
