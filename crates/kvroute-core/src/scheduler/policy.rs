//! The routing policies and the order in which a request's candidates are
//! tried: the first is the choice, the rest are retried in turn.

use super::candidates::Scored;
use super::pick;

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
            _ => {
                return Err(format!(
                    "unknown policy `{s}` (kv, approx, round-robin, random, least-loaded)"
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
    };
    let mut rest: Vec<usize> = usable.into_iter().filter(|&i| i != first).collect();
    rest.sort_by(|&a, &b| scored[a].cost.total.total_cmp(&scored[b].cost.total));
    rest.insert(0, first);
    rest
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
    }

    #[test]
    fn policies_read_and_print_their_flag_names() {
        for p in [
            Policy::Kv,
            Policy::Approx,
            Policy::RoundRobin,
            Policy::Random,
            Policy::LeastLoaded,
        ] {
            assert_eq!(p.as_str().parse::<Policy>(), Ok(p));
        }
        assert!("fastest".parse::<Policy>().is_err());
    }
}
