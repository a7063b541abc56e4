//! The whole placement of one request, from plain inputs: the one place a
//! decision is assembled, which `kvroute serve` (over HTTP and through the
//! endpoint picker), `kvroute bench sim` and `kvroute demo` all call.
//!
//! A [`Placer`] owns the state a policy keeps between requests (the
//! [`PrefixDealer`] of `--deal-new-prefixes`, SGLang's `cache_aware` tree,
//! the round-robin turn and the random draws) and decides from the
//! candidates as [`super::score`] priced them and a [`PlaceRequest`] of
//! plain facts (the prompt, the session's last rank, the rank of a
//! continued response, the workers a gateway allows). Nothing here reads a
//! clock, a socket or a lock: the caller holds the placer and the loads the
//! candidates were scored on together, and charges the chosen rank.
//!
//! An aggregated request's order ([`Placer::order`]) is, in turn:
//! 1. the policy's order ([`order`]) among the eligible candidates;
//! 2. under `kv`: a request whose prefix no rank holds is dealt
//!    ([`PrefixDealer`]), else the rank holding most of it keeps it within
//!    the stickiness margin ([`keep_on_holder`]); under
//!    `sglang-cache-aware`: its tree chooses ([`CacheAware::choose`]);
//!    Then, under `kv` with [`PlacerConfig::fetch`] set, a request whose
//!    prefix's holder costs more than moving the prefix goes to a cooler
//!    rank that fetches the blocks from the holder ([`plan_fetch`]):
//!    [`Ordered::fetch`] names the source, the blocks and the reason;
//! 3. the session's rank first where its history pays for its queue
//!    ([`prefer_session`]);
//! 4. the rank that produced the continued response first, whatever it
//!    costs (only it has the conversation).
//!
//! The caller charges the first and tells the placer with
//! [`Placer::record`]. A disaggregated request's two phases are placed by
//! [`Placer::plan_split`].
//!
//! Every decision takes one turn and one random draw, so two placers of
//! the same seed given the same inputs decide alike: `serve
//! --routing-seed` and the simulator's seed make their placements
//! comparable request by request.

mod split;
#[cfg(test)]
mod tests;

pub use split::Plan;

use super::candidates::Scored;
use super::cost::CostWeights;
use super::disagg::LocalPrefillRule;
use super::fetch::{plan_fetch, Fetch, FetchConfig};
use super::peers::{tenant_of, CacheAware, CacheAwareConfig};
use super::policy::{keep_on_holder, order, order_from, DealBy, PrefixDealer, DEFAULT_STICKINESS};
use super::replicate::{prefix_key, ReplicaConfig, Replicate, Replicator};
use super::session::{prefer_session, SessionEntry};
use super::Policy;
use crate::index::WorkerRank;
use crate::rng::SplitMix64;

/// What a request does when every candidate is over its busy thresholds.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub enum WhenAllBusy {
    /// Nothing is placed: the caller holds the request until a rank's
    /// load drops (`kvroute serve`'s queue, or its 503).
    #[default]
    Wait,
    /// Placed as the policy would with the thresholds ignored (the
    /// simulator, which has no queue). Only the policy's order and the
    /// stickiness apply then: the dealer and the tree were asked already.
    PlaceAnyway,
}

/// How a [`Placer`] decides: the policy and its settings.
#[derive(Debug, Clone, PartialEq)]
pub struct PlacerConfig {
    /// The routing policy.
    pub policy: Policy,
    /// The cost's weights (a session's history is priced with them).
    pub weights: CostWeights,
    /// 0: the lowest cost; above: softmax sampling among costs.
    pub temperature: f64,
    /// Under `kv`: a request whose prefix no rank holds goes to the rank
    /// dealt the least of this so far (`None`: to the cheapest).
    pub deal_new_prefixes: Option<DealBy>,
    /// Under `kv`: how much dearer than the cheapest the rank holding most
    /// of a request's prefix may be and still take it (below 1: off).
    pub stickiness: f64,
    /// In a disaggregated fleet: when a decode rank prefills a request
    /// itself instead of fetching its blocks from a prefill worker.
    pub local_prefill: LocalPrefillRule,
    /// SGLang's `cache_aware` settings (`sglang-cache-aware` only).
    pub tree: CacheAwareConfig,
    /// What happens when every candidate is busy.
    pub when_all_busy: WhenAllBusy,
    /// The seed of the placer's random draws.
    pub seed: u64,
    /// Under `kv`: when a request runs on a cooler rank that fetches its
    /// prefix from the holder (`None`: never, the default; the caller must
    /// be able to execute the hand-off).
    pub fetch: Option<FetchConfig>,
    /// Under `kv`: when a hot prefix is copied ahead of demand to a second
    /// rank (`None`: never, the default). Saturation is judged by the fetch
    /// rule ([`PlacerConfig::fetch`]'s, or its defaults when that is off);
    /// with fetches on, a fetch makes the copy itself and none is asked.
    pub replicate: Option<ReplicaConfig>,
}

impl PlacerConfig {
    /// `policy` with kvroute's defaults for everything else.
    pub fn new(policy: Policy) -> Self {
        PlacerConfig {
            policy,
            weights: CostWeights::default(),
            temperature: 0.0,
            deal_new_prefixes: Some(DealBy::Work),
            stickiness: DEFAULT_STICKINESS,
            local_prefill: LocalPrefillRule::default(),
            tree: CacheAwareConfig::default(),
            when_all_busy: WhenAllBusy::Wait,
            seed: 0,
            fetch: None,
            replicate: None,
        }
    }
}

/// One decision's round-robin turn and random number (uniform in `[0, 1)`).
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Draw {
    /// Decisions taken before this one.
    pub turn: u64,
    /// The decision's random number: ties, sampling and `random`.
    pub random: f64,
}

/// What the placer is told of a request besides its candidates' prices.
#[derive(Clone, Copy, Default)]
pub struct PlaceRequest<'a> {
    /// The prompt's token ids; `None`: not tokenized (placed on load alone).
    pub tokens: Option<&'a [u32]>,
    /// The symbols SGLang's tree keys an untokenized prompt by (its text's
    /// characters); asked only under `sglang-cache-aware`.
    pub text_symbols: Option<&'a dyn Fn() -> Vec<u32>>,
    /// The time of the tree's last-access marks, in ms.
    pub now_ms: u64,
    /// Where the request's session went last, if it names a known one.
    pub session: Option<SessionEntry>,
    /// The rank that produced the response the request continues, if known.
    pub continuation: Option<WorkerRank>,
    /// The candidates it may go to (a gateway's subset); `None`: any.
    pub eligible: Option<&'a dyn Fn(&Scored) -> bool>,
}

impl std::fmt::Debug for PlaceRequest<'_> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("PlaceRequest")
            .field("tokens", &self.tokens.map(<[u32]>::len))
            .field("now_ms", &self.now_ms)
            .field("session", &self.session)
            .field("continuation", &self.continuation)
            .field("eligible", &self.eligible.is_some())
            .finish()
    }
}

impl PlaceRequest<'_> {
    /// The prompt's tokens, 0 when it has none.
    pub fn token_count(&self) -> u64 {
        self.tokens.map_or(0, |t| t.len() as u64)
    }
}

/// How a preference (a session's rank, a continued response's rank) fared.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub enum Preference {
    /// The request had none.
    #[default]
    None,
    /// Its rank is first.
    Kept,
    /// Its rank is not first (its cost moved the session on, or the rank
    /// is not among the candidates).
    Moved,
}

/// An aggregated request's candidates in the order to try them.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct Ordered {
    /// Positions in the scored candidates; the first is the choice, the
    /// rest are tried in turn. Empty: every eligible candidate is busy (or
    /// there is none).
    pub order: Vec<usize>,
    /// The candidates it was chosen among (the eligible ones); 0: none.
    pub among: usize,
    /// The rank a new prefix was dealt to, if it was.
    pub dealt: Option<WorkerRank>,
    /// How the session's rank fared.
    pub session: Preference,
    /// How the continued response's rank fared.
    pub continuation: Preference,
    /// The first runs the request with a prefix fetched from another rank
    /// (`None`: it computes what it does not hold).
    pub fetch: Option<Fetch>,
    /// A copy of the request's prefix to make ahead of demand (see
    /// [`PlacerConfig::replicate`]); the request itself goes first in `order`.
    pub replicate: Option<Replicate>,
}

/// The placement state of one router (see the module docs).
#[derive(Debug, Clone)]
pub struct Placer {
    config: PlacerConfig,
    dealer: Option<PrefixDealer>,
    tree: Option<CacheAware>,
    rng: SplitMix64,
    turn: u64,
    replicator: Option<Replicator>,
}

impl Placer {
    /// A placer with nothing dealt, an empty tree and the first turn.
    pub fn new(config: PlacerConfig) -> Self {
        let dealer = match (config.policy, config.deal_new_prefixes) {
            (Policy::Kv, Some(by)) => Some(PrefixDealer::new(by)),
            _ => None,
        };
        let tree =
            (config.policy == Policy::SglangCacheAware).then(|| CacheAware::new(config.tree));
        Placer {
            replicator: config.replicate.map(Replicator::new),
            rng: SplitMix64::new(config.seed),
            config,
            dealer,
            tree,
            turn: 0,
        }
    }

    /// How it decides.
    pub fn config(&self) -> &PlacerConfig {
        &self.config
    }

    /// The dealer's tally of `key`, if new prefixes are dealt.
    pub fn dealt_to(&self, key: WorkerRank) -> Option<u64> {
        self.dealer.as_ref().map(|d| d.tally(key))
    }

    /// The next decision's turn and random number.
    pub fn draw(&mut self) -> Draw {
        let draw = Draw {
            turn: self.turn,
            random: self.rng.next_f64(),
        };
        self.turn += 1;
        draw
    }

    /// The order to try an aggregated request's candidates in (see the
    /// module docs); takes one turn and one random draw.
    pub fn order(&mut self, scored: &[Scored], req: &PlaceRequest<'_>) -> Ordered {
        let draw = self.draw();
        let kept: Option<Vec<usize>> = req
            .eligible
            .map(|keep| (0..scored.len()).filter(|&i| keep(&scored[i])).collect());
        let subset: Option<Vec<Scored>> = kept
            .as_ref()
            .map(|kept| kept.iter().map(|&i| scored[i].clone()).collect());
        let among = subset.as_deref().unwrap_or(scored);
        let (mut order, dealt) = self.policy_order(among, req, draw);
        if order.is_empty() && self.config.when_all_busy == WhenAllBusy::PlaceAnyway {
            order = self.by_policy(&relaxed(among), draw);
        }
        if let Some(kept) = &kept {
            order = order.into_iter().map(|j| kept[j]).collect();
        }
        let planned = self.fetch(scored, kept.as_deref(), &order, req.token_count());
        let fetch = planned.filter(|_| self.config.fetch.is_some());
        let replicate = match (&mut self.replicator, req.tokens, fetch) {
            (Some(r), Some(tokens), None) => {
                let bs = scored.first().map_or(16, |s| s.block_size);
                r.observe(prefix_key(tokens, bs), scored, planned.as_ref(), req.now_ms)
            }
            _ => None,
        };
        if let Some(f) = &fetch {
            order.retain(|&i| i != f.receiver);
            order.insert(0, f.receiver);
        }
        let mut ordered = Ordered {
            order,
            among: among.len(),
            dealt,
            fetch,
            replicate,
            ..Ordered::default()
        };
        self.prefer(scored, req, &mut ordered);
        if let Some(f) = ordered.fetch {
            // A session or a continuation moved another rank first.
            if ordered.order.first() != Some(&f.receiver) {
                ordered.fetch = None;
            }
        }
        ordered
    }

    /// Records that the request `ordered` was placed on `placed`, a
    /// `request_tokens`-token prompt: what the dealer tallies.
    pub fn record(&mut self, ordered: &Ordered, placed: &Scored, request_tokens: u64) {
        if let Some(dealer) = &mut self.dealer {
            dealer.record(placed, request_tokens, ordered.dealt == Some(placed.key));
        }
    }

    /// The order `/query` shows: the `kv` policy's, with this placer's
    /// `kv` rules as its tallies stand, at `random`; nothing recorded and
    /// no turn taken.
    pub fn preview(&self, scored: &[Scored], random: f64) -> Vec<usize> {
        let c = &self.config;
        let ordered = order(scored, Policy::Kv, c.temperature, random, 0);
        if c.policy != Policy::Kv {
            return ordered;
        }
        let dealt = self.dealer.clone().and_then(|mut d| d.choose(scored));
        match dealt {
            Some(first) => order_from(scored, first),
            None => keep_on_holder(scored, ordered, c.stickiness),
        }
    }

    /// The fetch `/query` shows for a request of `request_tokens` tokens
    /// whose candidates would be tried in `order` (a [`Placer::preview`]),
    /// with [`PlacerConfig::fetch`] on; nothing recorded.
    pub fn preview_fetch(
        &self,
        scored: &[Scored],
        order: &[usize],
        request_tokens: u64,
    ) -> Option<Fetch> {
        self.config.fetch?;
        self.fetch(scored, None, order, request_tokens)
    }

    /// The copy ahead of demand `/query` shows for a request of `tokens`
    /// whose candidates would be tried in `order` (a [`Placer::preview`]),
    /// with [`PlacerConfig::replicate`] on and no fetch made instead;
    /// nothing recorded.
    pub fn preview_replicate(
        &self,
        scored: &[Scored],
        order: &[usize],
        (tokens, now_ms): (&[u32], u64),
    ) -> Option<Replicate> {
        let replicator = self.replicator.as_ref()?;
        let planned = self.fetch(scored, None, order, tokens.len() as u64);
        if self.config.fetch.is_some() && planned.is_some() {
            return None;
        }
        let bs = scored.first().map_or(16, |s| s.block_size);
        replicator.preview(prefix_key(tokens, bs), scored, planned.as_ref(), now_ms)
    }

    /// The fetch the rule plans instead of the policy's first choice, if
    /// any (`kv` with [`PlacerConfig::fetch`] or [`PlacerConfig::replicate`]
    /// only, the fetch's defaults for the latter; `eligible`: the positions
    /// allowed, `None`: all).
    fn fetch(
        &self,
        scored: &[Scored],
        eligible: Option<&[usize]>,
        order: &[usize],
        request_tokens: u64,
    ) -> Option<Fetch> {
        let config = match (self.config.fetch, self.config.replicate) {
            (Some(f), _) => f,
            (None, Some(_)) => FetchConfig::default(),
            (None, None) => return None,
        };
        let &first = order.first()?;
        if self.config.policy != Policy::Kv || request_tokens == 0 {
            return None;
        }
        let all: Vec<usize>;
        let eligible = match eligible {
            Some(e) => e,
            None => {
                all = (0..scored.len()).collect();
                &all
            }
        };
        let w = &self.config.weights;
        plan_fetch(scored, eligible, first, request_tokens, (w, &config))
    }

    /// The policy's order with its kept state's say (step 2 of the module
    /// docs), and the rank dealt to.
    fn policy_order(
        &mut self,
        among: &[Scored],
        req: &PlaceRequest<'_>,
        draw: Draw,
    ) -> (Vec<usize>, Option<WorkerRank>) {
        match self.config.policy {
            Policy::Kv => {
                if let Some(first) = self.dealer.as_mut().and_then(|d| d.choose(among)) {
                    return (order_from(among, first), Some(among[first].key));
                }
                (self.by_policy(among, draw), None)
            }
            Policy::SglangCacheAware => {
                let chosen = self.tree.as_mut().and_then(|tree| {
                    let loads: Vec<(u32, u64)> = among
                        .iter()
                        .map(|s| (tenant_of(s.key), s.candidate.active_requests))
                        .collect();
                    let chosen = match (req.tokens, req.text_symbols) {
                        (Some(tokens), _) => tree.choose(tokens, &loads, req.now_ms),
                        (None, Some(text)) => tree.choose(&text(), &loads, req.now_ms),
                        (None, None) => tree.choose(&[], &loads, req.now_ms),
                    };
                    chosen.map(|(first, _)| first)
                });
                match chosen {
                    Some(first) => (order_from(among, first), None),
                    None => (self.by_policy(among, draw), None),
                }
            }
            _ => (self.by_policy(among, draw), None),
        }
    }

    /// The policy's order, with the holder kept under `kv`.
    fn by_policy(&self, among: &[Scored], draw: Draw) -> Vec<usize> {
        let c = &self.config;
        let ordered = order(among, c.policy, c.temperature, draw.random, draw.turn);
        match c.policy {
            Policy::Kv => keep_on_holder(among, ordered, c.stickiness),
            _ => ordered,
        }
    }

    /// The session's and the continued response's ranks first where they
    /// belong (steps 3 and 4 of the module docs).
    fn prefer(&self, scored: &[Scored], req: &PlaceRequest<'_>, ordered: &mut Ordered) {
        if let Some(entry) = &req.session {
            let order = std::mem::take(&mut ordered.order);
            let w = &self.config.weights;
            ordered.order = prefer_session(scored, order, entry, req.token_count(), w);
            let kept = first_is(scored, &ordered.order, entry.rank);
            ordered.session = if kept {
                Preference::Kept
            } else {
                Preference::Moved
            };
        }
        if let Some(rank) = req.continuation {
            let at = ordered
                .order
                .iter()
                .position(|&i| scored.get(i).is_some_and(|s| s.key == rank));
            ordered.continuation = match at {
                Some(at) => {
                    let i = ordered.order.remove(at);
                    ordered.order.insert(0, i);
                    Preference::Kept
                }
                None => Preference::Moved,
            };
        }
    }
}

/// Whether the first of `order` is `rank`.
fn first_is(scored: &[Scored], order: &[usize], rank: WorkerRank) -> bool {
    order
        .first()
        .is_some_and(|&i| scored.get(i).is_some_and(|s| s.key == rank))
}

/// `scored` with every busy mark cleared.
fn relaxed(scored: &[Scored]) -> Vec<Scored> {
    scored
        .iter()
        .map(|s| Scored {
            overloaded: false,
            ..s.clone()
        })
        .collect()
}
