//! A fixed index workload for counting instructions, which stay the same from
//! run to run where wall time on a shared machine does not:
//!
//! ```sh
//! cargo build --release -p kvroute-core --example index_ops
//! valgrind --tool=callgrind target/release/examples/index_ops 0       # apply only
//! valgrind --tool=callgrind target/release/examples/index_ops 100000  # apply, then 100 000 lookups
//! ```
//!
//! 16 workers store 16-block chains (many shared between workers, as system
//! prompts are) and remove their tails, 40 rounds: 2.56 M block operations.
//! The difference between the two runs, over the lookups, is the cost of one
//! 16-block lookup; the first run over its block operations, that of one
//! applied block (event construction included).

use kvroute_core::event::{ExternalHash, KvEvent, Removed, Stored, StoredBlock, Tier};
use kvroute_core::hash::{sequence_hashes, LocalBlockHash};
use kvroute_core::index::{Index, IndexConfig, WorkerRank};

/// An engine hash that, like a real engine's, depends on the whole prefix.
fn ext(chain: u64, i: u64) -> u64 {
    (chain.wrapping_mul(0x9E37_79B9_7F4A_7C15) ^ i).wrapping_mul(0xff51_afd7_ed55_8ccd) | 1
}

fn main() {
    let lookups: u64 = std::env::args()
        .nth(1)
        .and_then(|a| a.parse().ok())
        .unwrap_or(0);
    let mut index = Index::new(IndexConfig {
        default_capacity: None,
        ..IndexConfig::default()
    });
    let mut ops = 0u64;
    for round in 0..40u64 {
        for w in 0..16u32 {
            let key = WorkerRank::new(w, 0);
            for c in 0..200u64 {
                let chain = (c * 7 + u64::from(w) + round) % 1000;
                let blocks = (0..16)
                    .map(|i| StoredBlock {
                        external: ExternalHash(ext(chain, i)),
                        local: LocalBlockHash(chain * 100 + i),
                    })
                    .collect();
                ops += 16;
                let stored = Stored::plain(None, blocks, Tier::Device, 16);
                index.apply(key, &KvEvent::Stored(stored));
            }
            for c in 0..100u64 {
                let chain = (c * 13 + u64::from(w) + round) % 1000;
                let blocks = (8..16).map(|i| ExternalHash(ext(chain, i))).collect();
                ops += 8;
                let removed = Removed {
                    blocks,
                    tier: Tier::Device,
                };
                index.apply(key, &KvEvent::Removed(removed));
            }
        }
    }
    let mut matched = 0u64;
    for q in 0..lookups {
        let chain = (q * 7919) % 1000;
        let locals: Vec<LocalBlockHash> =
            (0..16).map(|i| LocalBlockHash(chain * 100 + i)).collect();
        matched += index.find_matches(&sequence_hashes(&locals)).len() as u64;
    }
    let stats = index.stats();
    println!(
        "{ops} block ops, {} residencies, {lookups} lookups matching {matched} ranks",
        stats.residencies
    );
}
