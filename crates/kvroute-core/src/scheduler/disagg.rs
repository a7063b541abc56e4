//! Prefill/decode disaggregation: the role each worker plays, and where a
//! request's two phases go.
//!
//! A disaggregated fleet computes a prompt on a *prefill* worker, moves its
//! KV blocks to a *decode* worker and generates there. The decode worker is
//! placed first, by its load: a decode step's cost is the blocks it reads,
//! not the prompt. Its own cache earns it credit only where that cache would
//! let it skip the transfer: when the part of the prompt it lacks is short
//! ([`LocalPrefillRule`], Dynamo's `isl_bounding`), it prefills locally. Any
//! other request's prefill goes to the prefill worker whose cache saves the
//! most work, priced by the aggregated cost ([`super::cost`]), since that is
//! where the prompt is computed.

use super::candidates::Scored;
use super::pick;

/// What a worker does in a disaggregated fleet.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Hash)]
pub enum WorkerRole {
    /// Prefill and decode both (an aggregated engine): the default.
    #[default]
    Both,
    /// Computes prompts and hands their KV blocks to a decode worker.
    Prefill,
    /// Generates from KV blocks a prefill worker computed, or prefills a
    /// short remainder itself.
    Decode,
}

impl WorkerRole {
    /// The role's name in worker specs, `/workers` and metric labels.
    pub fn as_str(self) -> &'static str {
        match self {
            WorkerRole::Both => "both",
            WorkerRole::Prefill => "prefill",
            WorkerRole::Decode => "decode",
        }
    }

    /// Whether a request's separate prefill leg may go here.
    pub fn prefills(self) -> bool {
        matches!(self, WorkerRole::Prefill | WorkerRole::Both)
    }

    /// Whether a request may decode here (and prefill here when the rule
    /// allows, or when the worker is aggregated).
    pub fn decodes(self) -> bool {
        matches!(self, WorkerRole::Decode | WorkerRole::Both)
    }
}

impl std::fmt::Display for WorkerRole {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.as_str())
    }
}

impl std::str::FromStr for WorkerRole {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, String> {
        match s {
            "both" | "prefill-decode" => Ok(WorkerRole::Both),
            "prefill" => Ok(WorkerRole::Prefill),
            "decode" => Ok(WorkerRole::Decode),
            _ => Err(format!("unknown role `{s}` (prefill, decode, both)")),
        }
    }
}

/// Conditional disaggregation: a decode rank prefills a request itself,
/// skipping the transfer, when the part of the prompt it does not cache is
/// shorter than `max_uncached_tokens` and under `max_uncached_fraction` of
/// the prompt (Dynamo's `isl_bounding`: 2 048 tokens and 0.7).
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct LocalPrefillRule {
    /// Uncached prompt tokens below which a decode rank may prefill locally
    /// (0: never; every request is disaggregated).
    pub max_uncached_tokens: u64,
    /// The uncached share of the prompt below which it may.
    pub max_uncached_fraction: f64,
}

impl Default for LocalPrefillRule {
    fn default() -> Self {
        LocalPrefillRule {
            max_uncached_tokens: 2_048,
            max_uncached_fraction: 0.7,
        }
    }
}

impl LocalPrefillRule {
    /// Every request disaggregated.
    pub const NEVER: LocalPrefillRule = LocalPrefillRule {
        max_uncached_tokens: 0,
        max_uncached_fraction: 0.0,
    };

    /// Whether a rank caching `cached_tokens` of a `prompt_tokens`-token
    /// prompt prefills it itself.
    pub fn prefills_locally(&self, prompt_tokens: u64, cached_tokens: u64) -> bool {
        let uncached = prompt_tokens.saturating_sub(cached_tokens);
        uncached < self.max_uncached_tokens
            && (uncached as f64) < self.max_uncached_fraction * prompt_tokens.max(1) as f64
    }
}

/// A decode rank's price for one request.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct DecodeCost {
    /// Blocks the rank would hold active, its decode-load terms, less the
    /// cache credit when it prefills locally; divided by its speed.
    pub total: f64,
    /// It would prefill the request itself.
    pub local: bool,
    /// Prompt tokens it does not cache.
    pub uncached_tokens: u64,
}

impl DecodeCost {
    /// The decode price of an already scored rank for a
    /// `request_tokens`-token request. Its prefill term plays no part:
    /// where the rule sends the prefill elsewhere the rank does not compute
    /// the prompt, and where the rule keeps it local the remainder is short
    /// by definition; its cache credit counts only in the second case
    /// (Dynamo's `max(0, decode_blocks − overlap)`).
    pub fn of(s: &Scored, request_tokens: u64, rule: &LocalPrefillRule) -> DecodeCost {
        let uncached_tokens = s.uncached_prefill_tokens(request_tokens);
        let cached = request_tokens - uncached_tokens;
        let local = rule.prefills_locally(request_tokens, cached);
        let c = &s.cost;
        let credit = if local { c.overlap_credit } else { 0.0 };
        let blocks = (c.decode_blocks - credit).max(0.0);
        DecodeCost {
            total: (blocks + c.requests + c.decode_load + c.size) / s.speed,
            local,
            uncached_tokens,
        }
    }
}

/// The decode rank for a request among the candidates `decodes` allows
/// (not overloaded): the lowest [`DecodeCost`], ties shared by `random`
/// (uniform in `[0, 1)`). `None` when no rank may decode it.
pub fn pick_decode(
    scored: &[Scored],
    decodes: impl Fn(&Scored) -> bool,
    request_tokens: u64,
    rule: &LocalPrefillRule,
    random: f64,
) -> Option<(usize, DecodeCost)> {
    let eligible: Vec<(usize, DecodeCost)> = scored
        .iter()
        .enumerate()
        .filter(|(_, s)| !s.overloaded && decodes(s))
        .map(|(i, s)| (i, DecodeCost::of(s, request_tokens, rule)))
        .collect();
    let costs: Vec<f64> = eligible.iter().map(|(_, d)| d.total).collect();
    pick(&costs, 0.0, random).map(|p| eligible[p])
}

/// The decode ranks a split request's decode leg may go to, in the order to
/// try them: the `placed` rank first, then every other rank `decodes`
/// allows on another worker (a worker that refused the leg refuses it on
/// every rank), the ones under their busy thresholds first, each group by
/// its [`DecodeCost`] with no local prefill. A leg refused before any work
/// moves down this list; what the prefill computed is not lost.
pub fn decode_order(
    scored: &[Scored],
    decodes: impl Fn(&Scored) -> bool,
    placed: usize,
    request_tokens: u64,
) -> Vec<usize> {
    let Some(first) = scored.get(placed) else {
        return Vec::new();
    };
    let mut rest: Vec<(bool, f64, usize)> = scored
        .iter()
        .enumerate()
        .filter(|&(i, s)| i != placed && s.worker != first.worker && decodes(s))
        .map(|(i, s)| {
            let cost = DecodeCost::of(s, request_tokens, &LocalPrefillRule::NEVER);
            (s.overloaded, cost.total, i)
        })
        .collect();
    rest.sort_by(|a, b| a.0.cmp(&b.0).then(a.1.total_cmp(&b.1)).then(a.2.cmp(&b.2)));
    std::iter::once(placed)
        .chain(rest.into_iter().map(|(_, _, i)| i))
        .collect()
}

/// The candidates `prefills` allows, in the order `order` gives for them
/// (a policy's order over that subset), as positions in `scored`.
pub fn prefill_order(
    scored: &[Scored],
    prefills: impl Fn(&Scored) -> bool,
    order: impl FnOnce(&[Scored]) -> Vec<usize>,
) -> Vec<usize> {
    let positions: Vec<usize> = (0..scored.len())
        .filter(|&i| prefills(&scored[i]))
        .collect();
    let subset: Vec<Scored> = positions.iter().map(|&i| scored[i].clone()).collect();
    order(&subset)
        .into_iter()
        .filter_map(|i| positions.get(i).copied())
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::event::WorkerFlavor;
    use crate::index::{RankMatch, WorkerRank};
    use crate::scheduler::{order, BusyThresholds, CostWeights, Load, Policy, Pricing};

    #[test]
    fn roles_parse_and_print_as_in_worker_specs() {
        for role in [WorkerRole::Both, WorkerRole::Prefill, WorkerRole::Decode] {
            assert_eq!(role.as_str().parse::<WorkerRole>(), Ok(role));
        }
        assert_eq!("prefill-decode".parse::<WorkerRole>(), Ok(WorkerRole::Both));
        assert!("encode".parse::<WorkerRole>().is_err());
        assert_eq!(WorkerRole::default(), WorkerRole::Both);
        assert!(WorkerRole::Prefill.prefills() && !WorkerRole::Prefill.decodes());
        assert!(!WorkerRole::Decode.prefills() && WorkerRole::Decode.decodes());
        assert!(WorkerRole::Both.prefills() && WorkerRole::Both.decodes());
    }

    #[test]
    fn a_short_remainder_under_the_share_is_prefilled_locally() {
        let rule = LocalPrefillRule::default();
        // 10 000-token prompt, 9 000 cached: 1 000 uncached, 0.1 of it.
        assert!(rule.prefills_locally(10_000, 9_000));
        // 2 048 uncached is not under 2 048.
        assert!(!rule.prefills_locally(10_000, 10_000 - 2_048));
        // 1 000 uncached of a 1 200-token prompt is 0.83 of it.
        assert!(!rule.prefills_locally(1_200, 200));
        // A 100-token prompt with nothing cached: short, but all of it.
        assert!(!rule.prefills_locally(100, 0));
        assert!(rule.prefills_locally(100, 40));
        assert!(!LocalPrefillRule::NEVER.prefills_locally(10_000, 9_999));
    }

    /// Rank `rank` of worker 0 holding `cached` 16-token blocks of a
    /// 64-block request, with `active` blocks already decoding there.
    fn rank(rank: u32, cached: u32, active: u64) -> Scored {
        let key = WorkerRank::new(0, rank);
        let matched = RankMatch {
            worker_rank: key,
            device: cached,
            host: cached,
            any: cached,
        };
        let load = Load {
            decode_blocks: active,
            new_blocks: 64 - u64::from(cached.min(64)),
            ..Load::default()
        };
        let weights = CostWeights::default();
        let busy = BusyThresholds::default();
        let pricing = Pricing {
            request_tokens: 1_024,
            weights: &weights,
            busy: &busy,
        };
        Scored::rank(
            0,
            key,
            (16, WorkerFlavor::Vllm, 1.0),
            Some(&matched),
            load,
            pricing,
        )
    }

    #[test]
    fn the_decode_rank_is_chosen_by_load_unless_its_cache_keeps_the_prefill_local() {
        let rule = LocalPrefillRule::default();
        // A cold, idle rank and a loaded one that caches 32 of 64 blocks
        // (512 of 1 024 tokens uncached: 0.5 of the prompt, so local).
        let (cold, warm) = (rank(0, 0, 0), rank(1, 32, 40));
        let d_cold = DecodeCost::of(&cold, 1_024, &rule);
        let d_warm = DecodeCost::of(&warm, 1_024, &rule);
        assert!(!d_cold.local && d_warm.local);
        assert_eq!(d_cold.uncached_tokens, 1_024);
        assert_eq!(d_warm.uncached_tokens, 512);
        // cold: 64 new blocks; warm: 40 + 32 new, less 2 × 32 of credit.
        assert_eq!(d_cold.total, 64.0 + cold.cost.size);
        assert_eq!(d_warm.total, 8.0 + warm.cost.size);
        let scored = [cold.clone(), warm.clone()];
        let chosen = pick_decode(&scored, |_| true, 1_024, &rule, 0.5);
        assert_eq!(chosen.map(|(i, d)| (i, d.local)), Some((1, true)));
        // Without conditional disaggregation the cache earns nothing, and
        // the idle rank wins on load.
        let never = LocalPrefillRule::NEVER;
        let chosen = pick_decode(&scored, |_| true, 1_024, &never, 0.5);
        assert_eq!(chosen.map(|(i, d)| (i, d.local)), Some((0, false)));
        // Ranks the caller rules out, or overloaded ones, are never chosen.
        let chosen = pick_decode(&scored, |s| s.key.rank.0 == 0, 1_024, &rule, 0.5);
        assert_eq!(chosen.map(|(i, _)| i), Some(0));
        let mut busy = scored.clone();
        busy[0].overloaded = true;
        busy[1].overloaded = true;
        assert_eq!(pick_decode(&busy, |_| true, 1_024, &rule, 0.5), None);
    }

    #[test]
    fn a_refused_decode_leg_moves_to_the_cheapest_decode_rank_of_another_worker() {
        // Worker 0 ranks 0 and 1 (the placed one and its twin), then
        // workers 1, 2 and 3, one rank each; worker 3 only prefills.
        let mut scored = vec![
            rank(0, 0, 0),
            rank(1, 0, 0),
            rank(0, 0, 30),
            rank(0, 0, 10),
            rank(0, 0, 0),
        ];
        for (i, s) in scored.iter_mut().enumerate().skip(1) {
            s.worker = i.saturating_sub(1);
        }
        let decodes = |s: &Scored| s.worker != 3;
        // The placed rank first; its worker's other rank never; the rest
        // by cost.
        assert_eq!(decode_order(&scored, decodes, 0, 1_024), vec![0, 3, 2]);
        // A busy rank comes after every free one, whatever its cost.
        scored[3].overloaded = true;
        assert_eq!(decode_order(&scored, decodes, 0, 1_024), vec![0, 2, 3]);
        assert!(decode_order(&scored, decodes, 9, 1_024).is_empty());
    }

    #[test]
    fn the_prefill_order_is_the_policys_over_the_prefill_ranks_only() {
        // Ranks 0 and 2 prefill; rank 1 (the cheapest) only decodes.
        let scored = [rank(0, 0, 0), rank(1, 64, 0), rank(2, 48, 0)];
        let prefills = |s: &Scored| s.key.rank.0 != 1;
        let ordered = prefill_order(&scored, prefills, |subset| {
            order(subset, Policy::Kv, 0.0, 0.5, 0)
        });
        assert_eq!(ordered, vec![2, 0]);
        let none = prefill_order(
            &scored,
            |_| false,
            |subset| order(subset, Policy::Kv, 0.0, 0.5, 0),
        );
        assert!(none.is_empty());
    }
}
