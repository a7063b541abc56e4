//! `kvroute bench index`: the prefix index measured on a synthetic fleet trace.
//!
//! Inside the timed regions: applying pre-generated events (decoding is not
//! included), `find_matches` on pre-generated 64-block queries, `dump` and
//! `restore`. Memory is the growth of live heap bytes while the index is built,
//! measured by the process's counting allocator, divided by residencies.

use std::process::ExitCode;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::time::{Duration, Instant};

use anyhow::{ensure, Result};
use clap::Args;
use kvroute_core::event::KvEvent;
use kvroute_core::hash::LocalBlockHash;
use kvroute_core::index::{Index, IndexConfig, SharedIndex, WorkerRank};
use serde_json::json;

use crate::alloc_meter::live_bytes;
use kvroute_loadgen::trace::{TraceConfig, TraceGen};

/// Arguments of `kvroute bench index`.
#[derive(Debug, Args)]
pub struct IndexBenchArgs {
    /// Workers in the simulated fleet.
    #[arg(long, default_value_t = 128)]
    workers: u32,
    /// Resident (block, worker) entries the index holds once every cache is full.
    #[arg(long, default_value_t = 1_000_000)]
    blocks: u64,
    /// A tenth of the size and fewer queries (under 30 s).
    #[arg(long)]
    quick: bool,
    /// Print one JSON object instead of a table.
    #[arg(long)]
    json: bool,
    /// Seed of the trace.
    #[arg(long, default_value_t = 42)]
    seed: u64,
    /// Blocks per lookup query.
    #[arg(long, default_value_t = 64)]
    query_blocks: usize,
}

type Events = Vec<(WorkerRank, KvEvent)>;

fn apply_all(index: &mut Index, events: &Events) {
    for (key, event) in events {
        index.apply(*key, event);
    }
}

fn percentile(sorted: &[u64], p: f64) -> f64 {
    if sorted.is_empty() {
        return 0.0;
    }
    let i = ((sorted.len() as f64 * p / 100.0).ceil() as usize).clamp(1, sorted.len()) - 1;
    sorted[i] as f64 / 1_000.0
}

fn median(mut values: Vec<f64>) -> f64 {
    values.sort_by(f64::total_cmp);
    values.get(values.len() / 2).copied().unwrap_or(0.0)
}

/// Times each query; returns sorted nanoseconds and the mean device depth matched.
fn time_queries(
    queries: &[Vec<LocalBlockHash>],
    mut find: impl FnMut(&[LocalBlockHash]) -> u32,
) -> (Vec<u64>, f64) {
    let mut nanos = Vec::with_capacity(queries.len());
    let mut depth = 0u64;
    for q in queries {
        let start = Instant::now();
        let best = find(q);
        nanos.push(start.elapsed().as_nanos() as u64);
        depth += u64::from(best);
    }
    nanos.sort_unstable();
    (nanos, depth as f64 / queries.len().max(1) as f64)
}

fn best_device(matches: &[kvroute_core::index::RankMatch]) -> u32 {
    matches.iter().map(|m| m.device).max().unwrap_or(0)
}

/// Runs the benchmark and prints the figures.
pub fn run(args: &IndexBenchArgs) -> Result<ExitCode> {
    ensure!(args.workers > 0, "--workers must be at least 1");
    let blocks = if args.quick {
        (args.blocks / 10).max(1_000)
    } else {
        args.blocks
    };
    let query_count = if args.quick { 20_000 } else { 100_000 };
    let progress = |msg: &str| eprintln!("[bench index] {msg}");

    progress(&format!(
        "generating a trace: {} workers, {} resident blocks",
        args.workers, blocks
    ));
    let mut gen = TraceGen::new(TraceConfig {
        workers: args.workers,
        residencies: blocks,
        seed: args.seed,
    });
    let mut build: Events = Vec::new();
    let mut build_ops = 0u64;
    // Fill every cache, then keep going as long again so evictions are in the mix.
    while gen.held() < blocks * 95 / 100 {
        build_ops += gen.step(&mut build);
    }
    let fill_ops = build_ops;
    while build_ops < 2 * fill_ops {
        build_ops += gen.step(&mut build);
    }
    let queries: Vec<Vec<LocalBlockHash>> = (0..query_count)
        .map(|_| gen.query(args.query_blocks))
        .collect();
    let mut live: Events = Vec::new();
    let mut live_ops = 0u64;
    while live_ops < build_ops {
        live_ops += gen.step(&mut live);
    }

    let config = IndexConfig {
        default_capacity: None,
        ..IndexConfig::default()
    };
    progress(&format!(
        "applying {} events ({build_ops} block ops), 3 runs",
        build.len()
    ));
    let mut apply_rates = Vec::new();
    let mut index = Index::new(config.clone());
    let mut bytes_measured = 0usize;
    for run in 0..3 {
        let mut fresh = Index::new(config.clone());
        let before = live_bytes();
        let start = Instant::now();
        apply_all(&mut fresh, &build);
        let elapsed = start.elapsed();
        if run == 0 {
            bytes_measured = live_bytes().saturating_sub(before);
        }
        apply_rates.push(build_ops as f64 / elapsed.as_secs_f64());
        index = fresh;
    }
    let apply_rate = median(apply_rates);
    let stats = index.stats();
    let residencies = stats.residencies.max(1);

    progress(&format!(
        "timing {} lookups of {} blocks",
        queries.len(),
        args.query_blocks
    ));
    let (alone, mean_depth) = time_queries(&queries, |q| best_device(&index.find_matches(q)));

    progress("dump and restore");
    let start = Instant::now();
    let snapshot = index.dump();
    let dump_s = start.elapsed().as_secs_f64();
    let start = Instant::now();
    let restored = Index::restore(&snapshot)?;
    let restore_s = start.elapsed().as_secs_f64();
    ensure!(
        restored.stats().residencies == stats.residencies,
        "restore changed the index"
    );
    drop(restored);

    progress("timing lookups while another thread applies events");
    let shared = SharedIndex::new(index);
    let stop = AtomicBool::new(false);
    let writer_ops = AtomicU64::new(0);
    let writer_time = AtomicU64::new(0);
    let under = std::thread::scope(|scope| {
        scope.spawn(|| {
            let start = Instant::now();
            let mut ops = 0u64;
            'outer: loop {
                for (key, event) in &live {
                    if stop.load(Ordering::Relaxed) {
                        break 'outer;
                    }
                    shared.apply(*key, event);
                    ops += match event {
                        KvEvent::Stored(s) => s.blocks.len() as u64,
                        KvEvent::Removed(r) => r.blocks.len() as u64,
                        KvEvent::Cleared => 0,
                    };
                }
            }
            writer_ops.store(ops, Ordering::Relaxed);
            writer_time.store(start.elapsed().as_nanos() as u64, Ordering::Relaxed);
        });
        // Give the writer a moment to start.
        std::thread::sleep(Duration::from_millis(20));
        let result = time_queries(&queries, |q| best_device(&shared.find_matches(q)));
        stop.store(true, Ordering::Relaxed);
        result
    });
    let writer_rate = writer_ops.load(Ordering::Relaxed) as f64
        / (writer_time.load(Ordering::Relaxed).max(1) as f64 / 1e9);

    let report = json!({
        "workers": args.workers,
        "target_residencies": blocks,
        "residencies": stats.residencies,
        "nodes": stats.nodes,
        "events": build.len(),
        "block_ops": build_ops,
        "apply_block_ops_per_s": apply_rate.round(),
        "queries": queries.len(),
        "query_blocks": args.query_blocks,
        "mean_matched_device_blocks": mean_depth,
        "lookup_p50_us": percentile(&alone, 50.0),
        "lookup_p90_us": percentile(&alone, 90.0),
        "lookup_p99_us": percentile(&alone, 99.0),
        "lookup_max_us": percentile(&alone, 100.0),
        "lookup_p50_us_under_writes": percentile(&under.0, 50.0),
        "lookup_p99_us_under_writes": percentile(&under.0, 99.0),
        "writer_block_ops_per_s_during_lookups": writer_rate.round(),
        "bytes_per_residency": bytes_measured as f64 / residencies as f64,
        "estimated_heap_bytes_per_residency": stats.heap_bytes as f64 / residencies as f64,
        "dump_bytes": snapshot.len(),
        "dump_s": dump_s,
        "restore_s": restore_s,
    });
    if args.json {
        println!("{report}");
    } else if let Some(map) = report.as_object() {
        for (k, v) in map {
            println!("{k:>40}  {v}");
        }
    }
    Ok(ExitCode::SUCCESS)
}
