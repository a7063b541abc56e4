//! The routing configurations a comparison names: a policy with its cost
//! weights and temperature, or the oracle. The same names mean the same
//! thing in `kvroute demo` (real time) and `kvroute bench sim` (virtual time).

use kvroute_core::scheduler::{BusyThresholds, CostWeights, Policy};

use crate::error::Error;
use crate::report::ORACLE;

/// The name of kvroute's KV policy run with Dynamo's cost weights.
pub const DYNAMO: &str = "dynamo";

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
}

impl Routing {
    /// `policy` with kvroute's default weights.
    pub fn new(policy: Policy) -> Self {
        Routing {
            policy,
            weights: CostWeights::default(),
            temperature: 0.0,
            busy: BusyThresholds::default(),
        }
    }
}

/// One side of a comparison.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum Contender {
    /// A kvroute router with these settings.
    Router(Routing),
    /// The oracle over the mock engines' true caches ([`ORACLE`]).
    Oracle,
}

impl std::str::FromStr for Contender {
    type Err = Error;

    /// `oracle`, `dynamo` (the `kv` policy with [`CostWeights::DYNAMO`]), or
    /// a router policy's name (`kv`, `round-robin`, …) with kvroute's weights.
    fn from_str(name: &str) -> Result<Self, Error> {
        if name == ORACLE {
            return Ok(Contender::Oracle);
        }
        if name == DYNAMO {
            return Ok(Contender::Router(Routing {
                weights: CostWeights::DYNAMO,
                ..Routing::new(Policy::Kv)
            }));
        }
        name.parse::<Policy>()
            .map(|p| Contender::Router(Routing::new(p)))
            .map_err(|e| Error::Invalid(format!("{e}, dynamo or oracle")))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_parse_to_their_settings() {
        let dynamo: Contender = "dynamo".parse().expect("known");
        let Contender::Router(r) = dynamo else {
            panic!("a router");
        };
        assert_eq!((r.policy, r.weights), (Policy::Kv, CostWeights::DYNAMO));
        assert_eq!("oracle".parse::<Contender>().ok(), Some(Contender::Oracle));
        assert_eq!(
            "least-loaded".parse::<Contender>().ok(),
            Some(Contender::Router(Routing::new(Policy::LeastLoaded)))
        );
        let e = "best".parse::<Contender>().expect_err("unknown");
        assert!(e.to_string().contains("dynamo or oracle"), "{e}");
    }
}
