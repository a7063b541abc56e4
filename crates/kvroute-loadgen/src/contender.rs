//! The routing configurations a comparison names: a policy with its cost
//! weights and temperature, or the oracle. The same names mean the same
//! thing in `kvroute demo` (real time) and `kvroute bench sim` (virtual time).

use kvroute_core::scheduler::policy::{DealBy, DEFAULT_STICKINESS};
use kvroute_core::scheduler::{
    BusyThresholds, CostWeights, FetchConfig, LocalPrefillRule, Policy, ReplicaConfig,
};

use crate::error::Error;
use crate::report::ORACLE;

/// The name of Dynamo's KV router re-implemented ([`Policy::Dynamo`]).
pub const DYNAMO: &str = "dynamo";

/// The name of kvroute's `kv` policy run with Dynamo's cost weights
/// ([`CostWeights::DYNAMO`]): kvroute's accounting and retries, Dynamo's
/// weights (what `dynamo` meant before the policy itself was re-implemented).
pub const KV_DYNAMO_WEIGHTS: &str = "kv-dynamo-weights";

/// The name of kvroute's `kv` policy set for the latency tail
/// ([`Routing::tail`]): the documented setting that dominates `dynamo`.
pub const KV_TAIL: &str = "kv-tail";

/// The name of kvroute's `kv` policy with the fetch lever on
/// ([`Routing::fetch`]): a busy holder's request runs on a cooler rank that
/// fetches the prefix's blocks.
pub const KV_FETCH: &str = "kv-fetch";

/// The name of `kv` copying hot prefixes ahead of demand, without fetches
/// ([`Routing::replicate`]): a holder saturated for 2 s has the prefix
/// copied to a second rank, up to 1,024 blocks per rank.
pub const KV_REPLICATE: &str = "kv-replicate";

/// The name of SGLang router's `cache_aware` re-implemented
/// ([`Policy::SglangCacheAware`]).
pub const SGLANG: &str = "sglang-cache-aware";

/// The name of the `kv` policy that always transfers a disaggregated
/// request's KV ([`Disagg::AlwaysSplit`]).
pub const KV_SPLIT: &str = "kv-split";

/// The name of the `kv` policy serving a disaggregated fleet's engines as
/// aggregated ones ([`Disagg::Aggregated`]).
pub const AGGREGATED: &str = "aggregated";

/// How a fleet with prefill and decode engines is served. Fleets without
/// roles are served alike under all three.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub enum Disagg {
    /// Split each request, unless the decode rank's own cache leaves little
    /// to compute (the router's default [`LocalPrefillRule`]).
    #[default]
    Conditional,
    /// Split every request ([`LocalPrefillRule::NEVER`]): the baseline that
    /// shows what conditional disaggregation saves.
    AlwaysSplit,
    /// Every engine serves whole requests, roles ignored: the same engines
    /// as an aggregated fleet.
    Aggregated,
}

impl Disagg {
    /// The rule a router with this setting prefills locally by.
    pub fn local_prefill(self) -> LocalPrefillRule {
        match self {
            Disagg::AlwaysSplit => LocalPrefillRule::NEVER,
            Disagg::Conditional | Disagg::Aggregated => LocalPrefillRule::default(),
        }
    }
}

/// The [`DealBy`] a numeric sweep value names (`--deal-new-prefixes`): 0
/// none (a new prefix goes to the cheapest rank, the default), 1 prefixes,
/// 2 work, 3 requests (anything else: none).
pub fn deal_from_value(v: f64) -> Option<DealBy> {
    match v as i64 {
        1 => Some(DealBy::Prefixes),
        2 => Some(DealBy::Work),
        3 => Some(DealBy::Requests),
        _ => None,
    }
}

/// A kvroute router's routing settings.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Routing {
    /// The policy.
    pub policy: Policy,
    /// The cost's weights (used by `kv` and `approx`).
    pub weights: CostWeights,
    /// 0: lowest cost; > 0: softmax sampling.
    pub temperature: f64,
    /// Ranks at or over these are skipped.
    pub busy: BusyThresholds,
    /// How prefill and decode engines are used, where the fleet has them.
    pub disagg: Disagg,
    /// Under `kv`: a request whose prefix no rank holds goes to the rank
    /// with the lowest tally of this
    /// ([`kvroute_core::scheduler::policy::PrefixDealer`]; by default the
    /// work dealt; `None`: to the cheapest).
    pub deal_new_prefixes: Option<DealBy>,
    /// Under `kv`: how much dearer than the cheapest the rank holding most
    /// of a request's prefix may be and still take it
    /// ([`kvroute_core::scheduler::policy::keep_on_holder`]; below 1: off).
    pub stickiness: f64,
    /// Per-rank caps on requests in flight, learned from time to first
    /// token against this target in ms
    /// (`kvroute_sim::caps`; `None`: no caps, the default;
    /// simulator only).
    pub cap_ttft_ms: Option<f64>,
    /// Under `kv`: when a request fetches its prefix from a busy holder
    /// instead of waiting or recomputing (`None`: never, the default).
    pub fetch: Option<FetchConfig>,
    /// Under `kv`: when a hot prefix is copied ahead of demand to a second
    /// rank (`None`: never, the default).
    pub replicate: Option<ReplicaConfig>,
}

impl Routing {
    /// `policy` with kvroute's default weights.
    pub fn new(policy: Policy) -> Self {
        Routing {
            policy,
            weights: CostWeights::default(),
            temperature: 0.0,
            busy: BusyThresholds::default(),
            disagg: Disagg::Conditional,
            deal_new_prefixes: Some(DealBy::Work),
            stickiness: DEFAULT_STICKINESS,
            cap_ttft_ms: None,
            fetch: None,
            replicate: None,
        }
    }
}

impl Routing {
    /// `kv` set for the latency tail: `--prefill-load-scale 4
    /// --request-kv-weight 2 --deal-new-prefixes off --holder-stickiness 0`.
    /// Prefill is priced low and decode load high, and every request goes to
    /// the cheapest rank: a lower hit rate than the default, Dynamo's tails
    /// or better (docs/serving.md, "Against the peers").
    pub fn tail() -> Self {
        let mut r = Routing::new(Policy::Kv);
        r.weights.prefill_load_scale = 4.0;
        r.weights.request_kv_weight = 2.0;
        r.deal_new_prefixes = None;
        r.stickiness = 0.0;
        r
    }
}

impl Routing {
    /// `kv` with the fetch lever at the mock engines' transfer cost (20 µs
    /// per block) and the setting that met the most goals in the simulator
    /// (docs/serving.md, "Moving the cache"): `--prefill-load-scale 24
    /// --request-kv-weight 2 --fetch-us-per-block 20 --fetch-margin 1.6`.
    /// Prefill priced high keeps prefixes on their holders; decode load
    /// priced high makes a busy holder dear, and the fetch moves its
    /// requests off it without recomputing their prefixes.
    pub fn fetch() -> Self {
        let mut r = Routing::new(Policy::Kv);
        r.weights.prefill_load_scale = 24.0;
        r.weights.request_kv_weight = 2.0;
        r.fetch = Some(FetchConfig {
            margin: 1.6,
            ..FetchConfig::default()
        });
        r
    }
}

impl Routing {
    /// `kv` with hot prefixes copied ahead of demand and no fetch (with
    /// fetches on, a fetch makes the copy and none is asked): saturated
    /// for 2 s, 1,024 blocks per rank, the simulator's best alone
    /// (docs/serving.md, "Replication of hot prefixes"), as `serve
    /// --replicate-hot-ms 2000 --replica-budget-blocks 1024` does.
    pub fn replicate() -> Self {
        Routing {
            replicate: Some(ReplicaConfig {
                hot_for_ms: 2_000,
                budget_blocks: 1_024,
            }),
            ..Routing::new(Policy::Kv)
        }
    }
}

/// One side of a comparison.
// `Copy` and passed by value a few times per run: boxing the settings
// would cost more than the bytes the oracle's variant leaves unused.
#[allow(clippy::large_enum_variant)]
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum Contender {
    /// A kvroute router with these settings.
    Router(Routing),
    /// The oracle over the mock engines' true caches ([`ORACLE`]).
    Oracle,
}

impl std::str::FromStr for Contender {
    type Err = Error;

    /// `oracle`, `kv-dynamo-weights` (the `kv` policy with
    /// [`CostWeights::DYNAMO`]), `kv-split` and `aggregated` (the `kv`
    /// policy with [`Disagg`]'s other settings), or a router policy's name
    /// (`kv`, `round-robin`, `dynamo`, `sglang-cache-aware`, …) with
    /// kvroute's weights.
    fn from_str(name: &str) -> Result<Self, Error> {
        if name == ORACLE {
            return Ok(Contender::Oracle);
        }
        let disagg = match name {
            KV_SPLIT => Some(Disagg::AlwaysSplit),
            AGGREGATED => Some(Disagg::Aggregated),
            _ => None,
        };
        if let Some(disagg) = disagg {
            return Ok(Contender::Router(Routing {
                disagg,
                ..Routing::new(Policy::Kv)
            }));
        }
        if name == KV_TAIL {
            return Ok(Contender::Router(Routing::tail()));
        }
        if name == KV_FETCH {
            return Ok(Contender::Router(Routing::fetch()));
        }
        if name == KV_REPLICATE {
            return Ok(Contender::Router(Routing::replicate()));
        }
        if name == KV_DYNAMO_WEIGHTS {
            return Ok(Contender::Router(Routing {
                weights: CostWeights::DYNAMO,
                deal_new_prefixes: None,
                stickiness: 0.0,
                ..Routing::new(Policy::Kv)
            }));
        }
        name.parse::<Policy>()
            .map(|p| Contender::Router(Routing::new(p)))
            .map_err(|e| {
                Error::Invalid(format!(
                    "{e}, kv-tail, kv-fetch, kv-replicate, kv-dynamo-weights, kv-split, aggregated or oracle"
                ))
            })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_parse_to_their_settings() {
        let weights: Contender = "kv-dynamo-weights".parse().expect("known");
        let Contender::Router(r) = weights else {
            panic!("a router");
        };
        assert_eq!((r.policy, r.weights), (Policy::Kv, CostWeights::DYNAMO));
        for (name, policy) in [(DYNAMO, Policy::Dynamo), (SGLANG, Policy::SglangCacheAware)] {
            assert_eq!(
                name.parse::<Contender>().ok(),
                Some(Contender::Router(Routing::new(policy)))
            );
        }
        assert_eq!("oracle".parse::<Contender>().ok(), Some(Contender::Oracle));
        let fetch: Contender = "kv-fetch".parse().expect("known");
        assert_eq!(fetch, Contender::Router(Routing::fetch()));
        let replicate: Contender = "kv-replicate".parse().expect("known");
        let Contender::Router(r) = replicate else {
            panic!("a router");
        };
        assert_eq!(r.fetch, None, "a fetch would make the copy itself");
        assert_eq!(r.replicate.map(|c| c.budget_blocks), Some(1_024));
        let tail: Contender = "kv-tail".parse().expect("known");
        assert_eq!(tail, Contender::Router(Routing::tail()));
        assert_eq!(
            "least-loaded".parse::<Contender>().ok(),
            Some(Contender::Router(Routing::new(Policy::LeastLoaded)))
        );
        let split: Contender = "kv-split".parse().expect("known");
        let aggregated: Contender = "aggregated".parse().expect("known");
        for (c, disagg) in [
            (split, Disagg::AlwaysSplit),
            (aggregated, Disagg::Aggregated),
        ] {
            let Contender::Router(r) = c else {
                panic!("a router");
            };
            assert_eq!((r.policy, r.disagg), (Policy::Kv, disagg));
        }
        assert_eq!(Disagg::AlwaysSplit.local_prefill(), LocalPrefillRule::NEVER);
        assert_eq!(
            Routing::new(Policy::Kv).deal_new_prefixes,
            Some(DealBy::Work)
        );
        let dealt: Vec<Option<DealBy>> = [0.0, 1.0, 2.0, 3.0, 4.0]
            .into_iter()
            .map(deal_from_value)
            .collect();
        assert_eq!(
            dealt,
            [
                None,
                Some(DealBy::Prefixes),
                Some(DealBy::Work),
                Some(DealBy::Requests),
                None
            ]
        );
        let e = "best".parse::<Contender>().expect_err("unknown");
        assert!(e.to_string().contains("aggregated or oracle"), "{e}");
    }
}
