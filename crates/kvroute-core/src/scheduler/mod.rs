//! Choosing the (worker, rank) for a request: what each candidate would cost
//! ([`cost`]), what each is already doing ([`active`]), each candidate priced
//! ([`candidates`]), the order they are tried in under each routing
//! policy ([`policy`]), and the workers' speeds learned from their
//! responses ([`speed`]).
//!
//! Pure: the caller passes the index's matches, the active-sequence state
//! and a random number; nothing here reads a clock or a socket.

pub mod active;
pub mod candidates;
pub mod cost;
pub mod policy;
pub mod speed;

pub use active::{ActiveRequest, ActiveSequences};
pub use candidates::{predicted_cached_tokens, BusyThresholds, Load, Pricing, Scored};
pub use cost::{Candidate, CostBreakdown, CostWeights};
pub use policy::{order, Policy};
pub use speed::{SpeedConfig, SpeedLearner};

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
