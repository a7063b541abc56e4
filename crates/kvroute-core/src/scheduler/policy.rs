//! The routing policies and the order in which a request's candidates are
//! tried: the first is the choice, the rest are retried in turn; and
//! [`pick`], the cost-based policies' choice among costs.
//!
//! Two policies are other routers' ([`super::peers`]), kept as baselines:
//! `dynamo` orders by Dynamo's logit and needs nothing else; `sglang-cache-aware`
//! needs its tree, which the caller keeps: it chooses with
//! [`CacheAware::choose`](super::peers::CacheAware::choose) and orders with
//! [`order_from`]. Without the tree, [`order`] takes its load fallback (the
//! fewest requests in flight).

use super::candidates::Scored;
use super::peers::dynamo::{logit, DynamoConfig, DynamoInputs};
use crate::index::WorkerRank;

/// How the next (worker, rank) is chosen.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Policy {
    /// Lowest cost, with the index fed by KV events.
    Kv,
    /// Lowest cost, with the index fed by routing decisions (no events).
    Approx,
    /// Each candidate in turn.
    RoundRobin,
    /// Uniformly random.
    Random,
    /// Fewest active blocks, then fewest prefill tokens.
    LeastLoaded,
    /// SGLang router's `cache_aware` ([`super::peers::sglang_cache_aware`]).
    SglangCacheAware,
    /// Dynamo's KV router ([`super::peers::dynamo`]).
    Dynamo,
}

impl Policy {
    /// The policy's name in flags and reports.
    pub fn as_str(self) -> &'static str {
        match self {
            Policy::Kv => "kv",
            Policy::Approx => "approx",
            Policy::RoundRobin => "round-robin",
            Policy::Random => "random",
            Policy::LeastLoaded => "least-loaded",
            Policy::SglangCacheAware => "sglang-cache-aware",
            Policy::Dynamo => "dynamo",
        }
    }
}

impl std::fmt::Display for Policy {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.as_str())
    }
}

impl std::str::FromStr for Policy {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, String> {
        Ok(match s {
            "kv" => Policy::Kv,
            "approx" => Policy::Approx,
            "round-robin" => Policy::RoundRobin,
            "random" => Policy::Random,
            "least-loaded" => Policy::LeastLoaded,
            "sglang-cache-aware" => Policy::SglangCacheAware,
            "dynamo" => Policy::Dynamo,
            _ => {
                return Err(format!(
                    "unknown policy `{s}` (kv, approx, round-robin, random, least-loaded, \
                     sglang-cache-aware, dynamo)"
                ))
            }
        })
    }
}

/// Orders the usable (not overloaded) candidates: the first is the choice,
/// the rest, cheapest first, are retried in order. `random` is uniform in
/// `[0, 1)`; `turn` counts requests for round-robin. Empty when every
/// candidate is overloaded.
pub fn order(
    scored: &[Scored],
    policy: Policy,
    temperature: f64,
    random: f64,
    turn: u64,
) -> Vec<usize> {
    let usable: Vec<usize> = (0..scored.len())
        .filter(|&i| !scored[i].overloaded)
        .collect();
    if usable.is_empty() {
        return usable;
    }
    let pick_among = |n: usize| ((random * n as f64) as usize).min(n - 1);
    let first = match policy {
        Policy::Kv | Policy::Approx => {
            let costs: Vec<f64> = usable.iter().map(|&i| scored[i].cost.total).collect();
            pick(&costs, temperature, random).map_or(usable[0], |p| usable[p])
        }
        Policy::RoundRobin => usable[(turn % usable.len() as u64) as usize],
        Policy::Random => usable[pick_among(usable.len())],
        Policy::LeastLoaded => {
            let load = |i: usize| {
                let c = &scored[i].candidate;
                (
                    c.active_decode_blocks,
                    c.active_prefill_tokens,
                    c.active_requests,
                )
            };
            let min = usable.iter().map(|&i| load(i)).min().unwrap_or_default();
            let ties: Vec<usize> = usable.iter().copied().filter(|&i| load(i) == min).collect();
            ties[pick_among(ties.len())]
        }
        Policy::Dynamo => {
            let logits: Vec<f64> = usable.iter().map(|&i| dynamo_logit(&scored[i])).collect();
            pick(&logits, temperature, random).map_or(usable[0], |p| usable[p])
        }
        Policy::SglangCacheAware => {
            // Without the caller's tree: sglang's shortest queue.
            let min = usable
                .iter()
                .map(|&i| scored[i].candidate.active_requests)
                .min();
            usable
                .iter()
                .copied()
                .find(|&i| Some(scored[i].candidate.active_requests) == min)
                .unwrap_or(usable[0])
        }
    };
    rest_after(scored, usable, first, policy)
}

/// Dynamo's logit for a scored candidate, with its default weight.
fn dynamo_logit(s: &Scored) -> f64 {
    logit(&DynamoConfig::default(), &DynamoInputs::of(s))
}

/// `first`, then the other usable candidates cheapest first (by Dynamo's
/// logit under `dynamo`, by kvroute's cost otherwise).
fn rest_after(scored: &[Scored], usable: Vec<usize>, first: usize, policy: Policy) -> Vec<usize> {
    let mut rest: Vec<usize> = usable.into_iter().filter(|&i| i != first).collect();
    if policy == Policy::Dynamo {
        rest.sort_by(|&a, &b| dynamo_logit(&scored[a]).total_cmp(&dynamo_logit(&scored[b])));
    } else {
        rest.sort_by(|&a, &b| scored[a].cost.total.total_cmp(&scored[b].cost.total));
    }
    rest.insert(0, first);
    rest
}

/// Where a request whose prefix no rank holds (none caches a block of it,
/// none has a request in flight that holds one) goes when new prefixes are
/// dealt: the usable candidate that `dealt` says received the least so far,
/// the first listed of equals (deterministic, as SGLang's smallest tree
/// is). `None` when some rank holds a part of it (the cost decides) or none
/// is usable.
///
/// A new prefix's first request brings the load of every request of its
/// group that follows it: placing it on the rank least loaded *now* (what
/// the cost does) can pile groups onto one rank; dealing them evenly is
/// what SGLang's `cache_aware` does by sending a miss to its smallest tree.
pub fn deal_new_prefix(scored: &[Scored], dealt: &dyn Fn(usize) -> u64) -> Option<usize> {
    if holds_some(scored) {
        return None;
    }
    (0..scored.len())
        .filter(|&i| !scored[i].overloaded)
        .min_by(|&a, &b| {
            dealt(a)
                .cmp(&dealt(b))
                .then(scored[a].worker.cmp(&scored[b].worker))
                .then(scored[a].key.rank.cmp(&scored[b].key.rank))
        })
}

/// Whether some rank caches a block of the request or has one in flight.
fn holds_some(scored: &[Scored]) -> bool {
    scored
        .iter()
        .any(|s| s.candidate.device_blocks > 0 || s.candidate.active_prefix_blocks > 0)
}

/// The slowest speed a worker's work is divided by (a speed of 0 would
/// make its tally infinite).
const MIN_SPEED: f64 = 1e-3;

/// kvroute's default [`keep_on_holder`] factor: a request leaves the rank
/// holding most of its prefix only for one that costs less than half as much.
pub const DEFAULT_STICKINESS: f64 = 2.0;

/// Puts first the rank that holds most of the request's prefix (more than
/// half its blocks, the way SGLang's `cache_threshold` 0.5 reads a match)
/// unless its cost is over `stickiness` × the cheapest's or it is slower
/// than the cheapest; `ordered` is [`order`]'s answer, and a `stickiness`
/// below 1 leaves it unchanged.
///
/// The lowest cost alone moves a request off its holder as soon as the
/// holder's queue outweighs a recompute elsewhere. That costs a whole
/// prefix's prefill and starts a second copy, which pays off only if the
/// queue lasts; measured on the `long` and `short` presets it lengthened
/// the latency tail as often as it shortened it. A margin keeps requests
/// where their prefix is until the holder is clearly the worse choice,
/// which is SGLang's behaviour with kvroute's exact index and cost as the
/// way out (SGLang's is a gap of 64 requests in flight).
pub fn keep_on_holder(scored: &[Scored], mut ordered: Vec<usize>, stickiness: f64) -> Vec<usize> {
    if stickiness < 1.0 || ordered.len() < 2 {
        return ordered;
    }
    let cached = |i: usize| scored[i].predicted_cached_blocks();
    // The most cached, the cheapest of equals, the first of those.
    let Some(at) = (0..ordered.len()).min_by(|&a, &b| {
        let (x, y) = (ordered[a], ordered[b]);
        cached(y)
            .cmp(&cached(x))
            .then(scored[x].cost.total.total_cmp(&scored[y].cost.total))
    }) else {
        return ordered;
    };
    let holder = &scored[ordered[at]];
    let Some(cheapest) = ordered
        .iter()
        .map(|&i| &scored[i])
        .min_by(|a, b| a.cost.total.total_cmp(&b.cost.total))
    else {
        return ordered;
    };
    let holds_most =
        u64::from(holder.predicted_cached_blocks()) * 2 > holder.candidate.request_blocks;
    // A slower holder gets no margin: its speed is not a queue that passes.
    let as_fast = holder.speed >= cheapest.speed;
    if at > 0 && holds_most && as_fast && holder.cost.total <= stickiness * cheapest.cost.total {
        let chosen = ordered.remove(at);
        ordered.insert(0, chosen);
    }
    ordered
}

/// What [`PrefixDealer`] tallies per rank to deal new prefixes by.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum DealBy {
    /// New prefixes dealt to it: groups evenly by count.
    Prefixes,
    /// Prompt tokens it was sent and did not hold (nor had in flight),
    /// divided by its speed: the prefill work it was given, which is how
    /// SGLang's `cache_aware` tree grows per worker (a miss goes to its
    /// smallest tree), in kvroute's terms.
    Work,
    /// Requests it was sent.
    Requests,
}

impl std::str::FromStr for DealBy {
    type Err = String;

    /// `prefixes`, `work` or `requests`.
    fn from_str(s: &str) -> Result<Self, String> {
        match s {
            "prefixes" => Ok(DealBy::Prefixes),
            "work" => Ok(DealBy::Work),
            "requests" => Ok(DealBy::Requests),
            _ => Err(format!("unknown tally `{s}` (work, prefixes, requests)")),
        }
    }
}

/// Deals requests whose prefix no rank holds ([`deal_new_prefix`]) by a
/// running tally per rank, which [`PrefixDealer::record`] keeps for every
/// request the caller routes. Work (`DealBy::Work`) balances what sticky
/// routing cannot move later: a group's first request brings its later
/// requests' prefill, so the rank given the least work so far takes it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PrefixDealer {
    by: DealBy,
    tally: std::collections::BTreeMap<WorkerRank, u64>,
}

impl PrefixDealer {
    /// A dealer with every tally at 0.
    pub fn new(by: DealBy) -> Self {
        PrefixDealer {
            by,
            tally: std::collections::BTreeMap::new(),
        }
    }

    /// Where a new prefix goes ([`deal_new_prefix`] by this dealer's
    /// tallies); `None` when some rank holds a part of it.
    ///
    /// A rank met for the first time after others were dealt to (one that
    /// joined a running fleet) starts level with the least dealt, not at 0,
    /// or it would take every new prefix until it caught up.
    pub fn choose(&mut self, scored: &[Scored]) -> Option<usize> {
        if holds_some(scored) {
            return None;
        }
        let floor = self.tally.values().copied().min().unwrap_or(0);
        for s in scored {
            self.tally.entry(s.key).or_insert(floor);
        }
        deal_new_prefix(scored, &|i| self.tally(scored[i].key))
    }

    /// Records a `request_tokens`-token request sent to `s`; `dealt` says
    /// whether [`PrefixDealer::choose`] placed it (a new prefix).
    pub fn record(&mut self, s: &Scored, request_tokens: u64, dealt: bool) {
        let add = match self.by {
            DealBy::Prefixes => u64::from(dealt),
            DealBy::Work => {
                // In the reference engine's time: a rank half as fast is
                // dealt half as much.
                let cached = s.predicted_cached_tokens(request_tokens);
                (request_tokens.saturating_sub(cached) as f64 / s.speed.max(MIN_SPEED)) as u64
            }
            DealBy::Requests => 1,
        };
        match self.tally.get_mut(&s.key) {
            Some(tally) => *tally += add,
            None => {
                // Met here first: level with the least dealt, as in `choose`.
                let floor = self.tally.values().copied().min().unwrap_or(0);
                self.tally.insert(s.key, floor + add);
            }
        }
    }

    /// The tally of `key`.
    pub fn tally(&self, key: WorkerRank) -> u64 {
        self.tally.get(&key).copied().unwrap_or(0)
    }
}

/// The order when the caller chose `first` itself (a policy whose state it
/// keeps: `sglang-cache-aware`): `first`, then the other candidates that
/// are not overloaded, cheapest first. Empty when `first` is out of range.
pub fn order_from(scored: &[Scored], first: usize) -> Vec<usize> {
    if first >= scored.len() {
        return Vec::new();
    }
    let usable: Vec<usize> = (0..scored.len())
        .filter(|&i| i == first || !scored[i].overloaded)
        .collect();
    rest_after(scored, usable, first, Policy::SglangCacheAware)
}

/// Picks the index of the cheapest cost, or samples one when `temperature > 0`.
///
/// * temperature 0: the lowest cost wins; ties are broken by `random`
///   (uniform in `[0, 1)`), so equal workers share the load;
/// * temperature > 0: softmax over normalised costs,
///   `p_i ∝ exp(−(c_i − c_min) / ((c_max − c_min) · T))`; all-equal costs are uniform.
///
/// `None` only when `costs` is empty.
pub fn pick(costs: &[f64], temperature: f64, random: f64) -> Option<usize> {
    let min = costs.iter().copied().fold(f64::INFINITY, f64::min);
    let max = costs.iter().copied().fold(f64::NEG_INFINITY, f64::max);
    if costs.is_empty() || !min.is_finite() {
        return None;
    }
    let random = random.clamp(0.0, 1.0 - f64::EPSILON);
    let range = max - min;
    if temperature <= 0.0 || range <= 0.0 || !range.is_finite() {
        let ties: Vec<usize> = (0..costs.len()).filter(|&i| costs[i] <= min).collect();
        return ties.get((random * ties.len() as f64) as usize).copied();
    }
    let weights: Vec<f64> = costs
        .iter()
        .map(|c| (-(c - min) / (range * temperature)).exp())
        .collect();
    let total: f64 = weights.iter().sum();
    let mut target = random * total;
    for (i, w) in weights.iter().enumerate() {
        if target < *w {
            return Some(i);
        }
        target -= w;
    }
    Some(costs.len() - 1)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::event::WorkerFlavor;
    use crate::index::WorkerRank;
    use crate::scheduler::{Candidate, CostBreakdown};

    fn scored(total: f64, decode_blocks: u64, overloaded: bool) -> Scored {
        Scored {
            worker: 0,
            key: WorkerRank::new(0, 0),
            block_size: 16,
            flavor: WorkerFlavor::Vllm,
            speed: 1.0,
            candidate: Candidate {
                active_decode_blocks: decode_blocks,
                ..Candidate::default()
            },
            cost: CostBreakdown {
                total,
                ..CostBreakdown::default()
            },
            overloaded,
        }
    }

    #[test]
    fn every_policy_puts_its_choice_first_and_the_rest_by_cost() {
        let s = [
            scored(5.0, 9, false),
            scored(1.0, 7, false),
            scored(0.5, 0, true),
            scored(3.0, 2, false),
        ];
        assert_eq!(order(&s, Policy::Kv, 0.0, 0.0, 0), [1, 3, 0]);
        assert_eq!(order(&s, Policy::Approx, 0.0, 0.0, 0), [1, 3, 0]);
        assert_eq!(order(&s, Policy::LeastLoaded, 0.0, 0.0, 0), [3, 1, 0]);
        assert_eq!(order(&s, Policy::RoundRobin, 0.0, 0.0, 2), [3, 1, 0]);
        assert_eq!(order(&s, Policy::Random, 0.0, 0.99, 0), [3, 1, 0]);
        assert_eq!(order(&s, Policy::Random, 0.0, 0.0, 0), [0, 1, 3]);
        // Without its tree, sglang's policy takes the fewest requests.
        assert_eq!(order(&s, Policy::SglangCacheAware, 0.0, 0.0, 0), [0, 1, 3]);
        assert_eq!(order_from(&s, 3), [3, 1, 0]);
        assert!(order_from(&s, 9).is_empty());
    }

    #[test]
    fn a_new_prefix_is_dealt_to_the_rank_dealt_fewest_and_a_held_one_is_not() {
        let s = [
            scored(1.0, 0, false),
            scored(3.0, 0, false),
            scored(2.0, 0, false),
            scored(0.5, 0, true),
        ];
        let mut s = s;
        for (i, c) in s.iter_mut().enumerate() {
            c.worker = i;
        }
        let dealt = [2, 1, 1, 0];
        // 1 and 2 were dealt as little: the first listed, not the cheaper.
        assert_eq!(deal_new_prefix(&s, &|i| dealt[i]), Some(1));
        let mut held = s.clone();
        held[1].candidate.active_prefix_blocks = 3;
        assert_eq!(deal_new_prefix(&held, &|i| dealt[i]), None);
        held[1].candidate.active_prefix_blocks = 0;
        held[0].candidate.device_blocks = 1;
        assert_eq!(deal_new_prefix(&held, &|i| dealt[i]), None);
    }

    #[test]
    fn the_dealer_sends_a_new_prefix_to_the_rank_given_the_least_work() {
        let mut s = [
            scored(1.0, 0, false),
            scored(2.0, 0, false),
            scored(3.0, 0, false),
        ];
        for (i, c) in s.iter_mut().enumerate() {
            c.worker = i;
            c.key = WorkerRank::new(i as u32, 0);
        }
        let key = |i: u32| WorkerRank::new(i, 0);
        let mut work = PrefixDealer::new(DealBy::Work);
        let mut prefixes = PrefixDealer::new(DealBy::Prefixes);
        // Rank 0 takes a new 160-token prefix; rank 1 a request of 160
        // tokens of which 8 blocks (128) are cached there: 32 uncached.
        assert_eq!(work.choose(&s), Some(0));
        assert_eq!(prefixes.choose(&s), Some(0));
        work.record(&s[0], 160, true);
        prefixes.record(&s[0], 160, true);
        s[1].candidate.device_blocks = 8;
        assert_eq!(work.choose(&s), None);
        work.record(&s[1], 160, false);
        prefixes.record(&s[1], 160, false);
        assert_eq!(
            (work.tally(key(0)), work.tally(key(1)), work.tally(key(2))),
            (160, 32, 0)
        );
        assert_eq!((prefixes.tally(key(0)), prefixes.tally(key(1))), (1, 0));
        s[1].candidate.device_blocks = 0;
        assert_eq!(work.choose(&s), Some(2));
        work.record(&s[2], 160, true);
        // The least work, not the fewest prefixes: rank 1 (32 tokens).
        assert_eq!(work.choose(&s), Some(1));
        assert_eq!(prefixes.choose(&s), Some(1));
        // A prefix in flight on a rank is held: the cost decides.
        s[2].candidate.active_prefix_blocks = 4;
        assert_eq!(work.choose(&s), None);
        s[2].candidate.active_prefix_blocks = 0;
        // A rank that joins now starts level with the least dealt (32), so
        // it does not take every new prefix until it catches up.
        let mut joined = s.to_vec();
        let mut late = s[2].clone();
        (late.worker, late.key) = (3, key(7));
        joined.push(late);
        assert_eq!(work.choose(&joined), Some(1));
        assert_eq!(work.tally(key(7)), 32);
        // A rank a quarter as fast is dealt four times the work.
        joined[0].speed = 0.25;
        work.record(&joined[0], 160, true);
        assert_eq!(work.tally(key(0)), 160 + 640);
        let mut requests = PrefixDealer::new(DealBy::Requests);
        requests.record(&s[2], 160, false);
        assert_eq!(requests.tally(key(2)), 1);
    }

    #[test]
    fn dp_ranks_of_one_worker_are_dealt_as_separate_ranks() {
        let mut s = [scored(1.0, 0, false), scored(1.0, 0, false)];
        s[1].key = WorkerRank::new(0, 1);
        let mut work = PrefixDealer::new(DealBy::Work);
        assert_eq!(work.choose(&s), Some(0));
        work.record(&s[0], 160, true);
        assert_eq!(work.choose(&s), Some(1));
    }

    #[test]
    fn a_request_stays_on_its_holder_until_the_holder_costs_over_the_margin() {
        // 10 blocks; rank 2 caches 8 of them but is busy.
        let mut s = [
            scored(40.0, 0, false),
            scored(30.0, 0, false),
            scored(50.0, 0, false),
        ];
        for c in &mut s {
            c.candidate.request_blocks = 10;
        }
        s[2].candidate.device_blocks = 8;
        let ordered = order(&s, Policy::Kv, 0.0, 0.0, 0);
        assert_eq!(ordered, [1, 0, 2]);
        assert_eq!(keep_on_holder(&s, ordered.clone(), 2.0), [2, 1, 0]);
        // Over twice the cheapest: the cost decides.
        s[2].cost.total = 61.0;
        assert_eq!(keep_on_holder(&s, ordered.clone(), 2.0), [1, 0, 2]);
        // Off below 1.
        s[2].cost.total = 50.0;
        assert_eq!(keep_on_holder(&s, ordered.clone(), 0.0), [1, 0, 2]);
        // Half the blocks is not most of them.
        s[2].candidate.device_blocks = 5;
        assert_eq!(keep_on_holder(&s, ordered.clone(), 2.0), [1, 0, 2]);
        // A slower holder gets no margin.
        s[2].speed = 0.5;
        assert_eq!(keep_on_holder(&s, ordered.clone(), 2.0), [1, 0, 2]);
        s[2].speed = 1.0;
        // A vLLM rank computing the prefix holds it; an SGLang rank does not yet.
        s[2].candidate.device_blocks = 0;
        s[2].candidate.active_prefix_blocks = 8;
        assert_eq!(keep_on_holder(&s, ordered.clone(), 2.0), [2, 1, 0]);
        s[2].flavor = WorkerFlavor::Sglang;
        assert_eq!(keep_on_holder(&s, ordered, 2.0), [1, 0, 2]);
    }

    #[test]
    fn dynamo_orders_by_its_own_logit_not_kvroutes_cost() {
        let mut s = [scored(1.0, 30, false), scored(9.0, 2, false)];
        for c in &mut s {
            c.block_size = 16;
            c.cost.prefill_blocks = 4.0;
        }
        // Equal prefill, 30 active blocks against 2: Dynamo takes the second.
        assert_eq!(order(&s, Policy::Dynamo, 0.0, 0.0, 0), [1, 0]);
        assert_eq!(order(&s, Policy::Kv, 0.0, 0.0, 0), [0, 1]);
    }

    #[test]
    fn policies_read_and_print_their_flag_names() {
        for p in [
            Policy::Kv,
            Policy::Approx,
            Policy::RoundRobin,
            Policy::Random,
            Policy::LeastLoaded,
            Policy::SglangCacheAware,
            Policy::Dynamo,
        ] {
            assert_eq!(p.as_str().parse::<Policy>(), Ok(p));
        }
        assert!("fastest".parse::<Policy>().is_err());
    }

    #[test]
    fn the_lowest_cost_wins_and_ties_are_shared() {
        assert_eq!(pick(&[3.0, 1.0, 2.0], 0.0, 0.9), Some(1));
        assert_eq!(pick(&[1.0, 5.0, 1.0], 0.0, 0.1), Some(0));
        assert_eq!(pick(&[1.0, 5.0, 1.0], 0.0, 0.9), Some(2));
        assert_eq!(pick(&[], 0.0, 0.5), None);
    }

    #[test]
    fn softmax_prefers_cheap_candidates_without_excluding_others() {
        let costs = [0.0, 10.0];
        let picks: Vec<usize> = (0..100)
            .filter_map(|i| pick(&costs, 1.0, f64::from(i) / 100.0))
            .collect();
        let cheap = picks.iter().filter(|&&i| i == 0).count();
        // p(cheap) = 1 / (1 + e^-1) ≈ 0.73
        assert!((70..=76).contains(&cheap), "{cheap}");
        assert_eq!(pick(&[2.0, 2.0], 1.0, 0.6), Some(1));
    }
}
