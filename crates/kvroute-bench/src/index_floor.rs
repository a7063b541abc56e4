//! The fewest bytes any exact prefix index can hold a given fleet's
//! contents in: an information-theoretic floor, beside which `kvroute
//! bench index` reports what kvroute's index takes.
//!
//! An exact index has to tell, for any 64-bit sequence hash a lookup asks
//! about, whether a block of that hash is stored (a false match changes a
//! score), and for any engine hash an event names, whether a worker
//! published it (a store under an unknown parent is counted and dropped,
//! and a removal of an unknown hash touches nothing). So it holds, at the
//! least, which `n` of the 2^64 sequence hashes are stored, which `n`
//! engine hashes name them (fewer only where every worker agrees on one;
//! the floor assumes they do), which engine hash names which block (the
//! engine's hash is its own function of the block, unrelated to the
//! router's, so any of the `n!` pairings can occur), and which of the
//! `n × ranks` (block, rank) pairs are resident. However they are laid
//! out, those facts take at least the base-2 logarithm of the number of
//! their possible values in bits: the floor below. Tiers, parents and the
//! structure that makes lookups fast only add to it.

/// The floor of an exact index's size for one fleet's contents.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct IndexFloor {
    /// Bytes per residency for the blocks' two names and their pairing.
    pub names: f64,
    /// Bytes per residency for which ranks hold which blocks.
    pub holders: f64,
}

impl IndexFloor {
    /// The floor for `nodes` distinct blocks held `residencies` times in
    /// all over `ranks` ranks.
    pub fn of(nodes: u64, residencies: u64, ranks: u64) -> IndexFloor {
        let per_residency = 1.0 / (8.0 * residencies.max(1) as f64);
        let hash_space = 2f64.powi(64);
        let one_name_set = log2_binomial(hash_space, nodes);
        let pairing = log2_factorial(nodes);
        let pairs = nodes as f64 * ranks as f64;
        IndexFloor {
            names: (2.0 * one_name_set + pairing) * per_residency,
            holders: log2_binomial(pairs, residencies) * per_residency,
        }
    }

    /// Both parts: the floor in bytes per residency.
    pub fn total(&self) -> f64 {
        self.names + self.holders
    }
}

/// log2 of the number of ways to choose `k` of `n` things (0 when `k > n`
/// makes it empty; callers only ask for possible choices).
fn log2_binomial(n: f64, k: u64) -> f64 {
    // Sum of log2((n - i) / (i + 1)): exact up to float rounding, without
    // the large intermediate factorials.
    let mut bits = 0.0;
    for i in 0..k {
        let i = i as f64;
        if i >= n {
            return 0.0;
        }
        bits += log2_minus(n, i) - (i + 1.0).log2();
    }
    bits
}

/// log2(n - i), precise when `i` is tiny beside `n` (as beside 2^64).
fn log2_minus(n: f64, i: f64) -> f64 {
    n.log2() + (-i / n).ln_1p() / std::f64::consts::LN_2
}

/// log2(n!).
fn log2_factorial(n: u64) -> f64 {
    (2..=n).map(|i| (i as f64).log2()).sum()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn small_counts_are_exact() {
        assert!((log2_binomial(10.0, 3) - 120f64.log2()).abs() < 1e-9);
        assert!((log2_binomial(52.0, 5) - 2_598_960f64.log2()).abs() < 1e-9);
        assert_eq!(log2_binomial(7.0, 0), 0.0);
        assert!((log2_factorial(5) - 120f64.log2()).abs() < 1e-9);
        // Choosing 2 of 2^64: n (n - 1) / 2, so 64 + 64 - 1 bits.
        let n = 2f64.powi(64);
        assert!((log2_binomial(n, 2) - 127.0).abs() < 1e-6);
    }

    #[test]
    fn the_bench_fleet_cannot_be_held_exactly_in_eight_bytes_a_residency() {
        // `kvroute bench index` at 128 workers x 1 M: 648 221 blocks held
        // 999 936 times. Each block's names take about 46 bits a set
        // (64 - log2 n + log2 e), their pairing about 18, the holders about
        // 8 bits a residency.
        let floor = IndexFloor::of(648_221, 999_936, 128);
        assert!((8.8..9.1).contains(&floor.names), "{floor:?}");
        assert!((0.9..1.05).contains(&floor.holders), "{floor:?}");
        assert!(floor.total() > 8.0);
        // The more ranks share each block, the less a residency's share.
        let shared = IndexFloor::of(100_000, 1_000_000, 128);
        assert!(shared.total() < floor.total() / 3.0, "{shared:?}");
    }
}
