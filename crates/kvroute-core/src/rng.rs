//! The one seeded random number generator (SplitMix64), shared by everything
//! that must be reproducible from a seed: the mock engine's filler text and
//! injected failures, the load generator's workloads and arrivals, the
//! router's tie-breaking, and randomized tests. It is not cryptographic and
//! does not need to be.

/// SplitMix64: a 64-bit state advanced by a constant, mixed on output.
#[derive(Debug, Clone)]
pub struct SplitMix64 {
    state: u64,
}

impl SplitMix64 {
    /// The increment of the state per draw (the golden ratio in 64 bits).
    /// A generator shared across threads can keep its state in an atomic
    /// and advance it with `fetch_add(GAMMA)`, then [`mix`] the new state.
    pub const GAMMA: u64 = 0x9E37_79B9_7F4A_7C15;

    /// A generator starting from `seed`.
    pub fn new(seed: u64) -> Self {
        SplitMix64 { state: seed }
    }

    /// The next 64 random bits.
    pub fn next_u64(&mut self) -> u64 {
        self.state = self.state.wrapping_add(SplitMix64::GAMMA);
        mix(self.state)
    }

    /// A uniform float in `[0, 1)` (53 random bits).
    pub fn next_f64(&mut self) -> f64 {
        unit_f64(self.next_u64())
    }

    /// A value in `0..n` (`n` > 0); the modulo bias is irrelevant here.
    pub fn below(&mut self, n: usize) -> usize {
        (self.next_u64() % n.max(1) as u64) as usize
    }
}

/// SplitMix64's output function: a bijective mix of 64 bits, so distinct
/// inputs give distinct outputs.
pub fn mix(mut z: u64) -> u64 {
    z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    z ^ (z >> 31)
}

/// 64 random bits as a uniform float in `[0, 1)` (their top 53 bits).
pub fn unit_f64(bits: u64) -> f64 {
    (bits >> 11) as f64 / (1u64 << 53) as f64
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn same_seed_same_sequence_and_floats_stay_in_range() {
        let mut a = SplitMix64::new(7);
        let mut b = SplitMix64::new(7);
        for _ in 0..100 {
            assert_eq!(a.next_u64(), b.next_u64());
            let f = a.next_f64();
            b.next_f64();
            assert!((0.0..1.0).contains(&f));
        }
        assert_ne!(SplitMix64::new(1).next_u64(), SplitMix64::new(2).next_u64());
    }

    #[test]
    fn splitmix_reference_value() {
        // First output of SplitMix64 seeded with 0 (the published reference sequence).
        assert_eq!(SplitMix64::new(0).next_u64(), 0xE220_A839_7B1D_CDAF);
    }
}
