//! Lookup latency by match depth and ranks on the `kvroute bench index`
//! fleet, to see what sets the tail; and a fixed lookup workload for
//! counting instructions, which stay the same from run to run:
//!
//! ```sh
//! cargo build --release -p kvroute-bench --example lookup_depths
//! target/release/examples/lookup_depths 1000000        # 128 workers × 1 M residencies, timed
//! valgrind --tool=callgrind --toggle-collect='kvroute_core::index::walk::find_matches*' \
//!     target/release/examples/lookup_depths 100000 once  # 100 000 lookups, counted
//! ```
//!
//! The fleet and the queries are the bench's (`TraceGen`, seed 1): the
//! caches filled and then run as long again, then 100 000 64-block queries.
//! Timed runs look every query up three times and report the last round.

use std::collections::BTreeMap;
use std::time::Instant;

use kvroute_bench::trace::{TraceConfig, TraceGen};
use kvroute_core::hash::sequence_hashes;
use kvroute_core::index::{Index, IndexConfig};

fn main() {
    let mut args = std::env::args().skip(1);
    let residencies: u64 = args
        .next()
        .and_then(|a| a.parse().ok())
        .unwrap_or(1_000_000);
    let rounds = if args.next().is_some() { 1 } else { 3 };
    let mut gen = TraceGen::new(TraceConfig {
        workers: 128,
        residencies,
        seed: 1,
    });
    let mut events = Vec::new();
    let mut ops = 0u64;
    while gen.held() < residencies * 95 / 100 {
        ops += gen.step(&mut events);
    }
    let filled = ops;
    while ops < 2 * filled {
        ops += gen.step(&mut events);
    }
    let queries: Vec<_> = (0..100_000)
        .map(|_| sequence_hashes(&gen.query(64)))
        .collect();
    let mut index = Index::new(IndexConfig {
        default_capacity: None,
        ..IndexConfig::default()
    });
    for (key, event) in &events {
        index.apply(*key, event);
    }
    // (nanoseconds, ranks returned, deepest device match) of each query.
    let mut rows = Vec::with_capacity(queries.len());
    for round in 0..rounds {
        rows.clear();
        for q in &queries {
            let start = Instant::now();
            let matches = index.find_matches(q);
            let ns = start.elapsed().as_nanos() as u64;
            let depth = matches.iter().map(|m| m.device).max().unwrap_or(0);
            if round + 1 == rounds {
                rows.push((ns, matches.len(), depth));
            }
        }
    }
    report(&rows);
}

/// Prints the latency percentiles, the median and p99 per (ranks, depth)
/// bucket, and what the slowest 1 % of queries match.
fn report(rows: &[(u64, usize, u32)]) {
    let mut ns: Vec<u64> = rows.iter().map(|r| r.0).collect();
    ns.sort_unstable();
    let at = |v: &[u64], p: usize| v.get(v.len() * p / 100).copied().unwrap_or(0);
    for p in [50, 90, 99] {
        println!("p{p}: {} ns", at(&ns, p));
    }
    let mut buckets: BTreeMap<(usize, u32), Vec<u64>> = BTreeMap::new();
    for &(t, ranks, depth) in rows {
        buckets
            .entry((ranks / 32 * 32, depth / 16 * 16))
            .or_default()
            .push(t);
    }
    println!("ranks from, depth from, queries, median ns, p99 ns (buckets of 200 or more)");
    for ((ranks, depth), mut v) in buckets {
        v.sort_unstable();
        if v.len() >= 200 {
            println!(
                "{ranks:>4} {depth:>3} {:>6} {:>6} {:>6}",
                v.len(),
                at(&v, 50),
                at(&v, 99)
            );
        }
    }
    let slow = at(&ns, 99);
    let mean = |rows: &mut dyn Iterator<Item = &(u64, usize, u32)>| {
        let (mut n, mut ranks, mut depth) = (0f64, 0f64, 0f64);
        for r in rows {
            (n, ranks, depth) = (n + 1.0, ranks + r.1 as f64, depth + f64::from(r.2));
        }
        (ranks / n.max(1.0), depth / n.max(1.0))
    };
    let (slow_ranks, slow_depth) = mean(&mut rows.iter().filter(|r| r.0 >= slow));
    let (all_ranks, all_depth) = mean(&mut rows.iter());
    println!(
        "slowest 1 %: {slow_ranks:.1} ranks, depth {slow_depth:.1}; all: {all_ranks:.1} ranks, depth {all_depth:.1}"
    );
}
