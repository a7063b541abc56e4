//! The simulated router's placement of a request in a disaggregated fleet:
//! the plan is the core placer's, as `kvroute serve` makes it
//! (`Placer::plan_split`: the decode rank, then the prefill ranks unless
//! the decode rank prefills the request itself). Each chosen rank is
//! charged as the proxy charges it: the decode rank with the prompt's
//! uncached tokens only when it prefills them itself, the prefill rank
//! with them always.

use kvroute_core::scheduler::Policy;

use super::{Placement, Scoring, SimRouter};
use crate::contender::Contender;

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

impl SimRouter {
    /// Places a request in a fleet with prefill and decode engines and
    /// charges its ranks; `None` for the oracle or pinned groups (which
    /// place whole requests), a fleet with no engine that decodes, or an
    /// SGLang decode engine with no prefill engine.
    pub fn route_split(&mut self, tokens: &[u32], now_ms: u64) -> Option<Split> {
        let Contender::Router(routing) = self.policy else {
            return None;
        };
        if self.pins.is_some() {
            return None;
        }
        let Scoring { scored, hashes } = self.score_request(tokens, &routing);
        let request_tokens = tokens.len() as u64;
        let targets = self.targets.clone();
        let plan = self
            .placer
            .plan_split(&scored, &targets, Some(request_tokens))?;
        let d = &scored[plan.decode];
        let local = plan.prefill.is_empty();
        let decode_prefill = if local {
            d.uncached_prefill_tokens(request_tokens)
        } else {
            0
        };
        let decode = Placement {
            engine: d.worker,
            active_id: self.charge(d, &hashes, decode_prefill, now_ms),
            predicted_cached: local.then(|| d.predicted_cached_tokens(request_tokens)),
            fetch: None,
            replicate: None,
        };
        // Only a request forwarded whole (prefilled where it decodes) is
        // recorded by the `approx` policy, as in the proxy's `forward`.
        if local && routing.policy == Policy::Approx {
            self.record_decision(d, &hashes, now_ms);
        }
        let prefill = plan.prefill.first().map(|&p| {
            let s = &scored[p];
            let uncached = s.uncached_prefill_tokens(request_tokens);
            Placement {
                engine: s.worker,
                active_id: self.charge(s, &hashes, uncached, now_ms),
                predicted_cached: None,
                fetch: None,
                replicate: None,
            }
        });
        Some(Split { decode, prefill })
    }
}
