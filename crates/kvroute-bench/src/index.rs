//! `kvroute bench index`: the prefix index measured on a synthetic fleet trace.
//!
//! Inside the timed regions: applying pre-generated events (decoding is not
//! included), `find_matches` on pre-generated 64-block queries (their
//! sequence hashes, as the router computes them once per request; hashing is
//! timed on its own), `dump` and
//! `restore`, and the same events applied from `threads` threads into an
//! index of as many shards of ranks. Memory is the growth of live heap bytes while the index is
//! built, divided by residencies, when the process can count its heap (a
//! counting global allocator, [`IndexBenchConfig::heap_meter`]); the
//! estimate from the index's table capacities is reported either way.

use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::time::{Duration, Instant};

use kvroute_core::event::KvEvent;
use kvroute_core::hash::{sequence_hashes, LocalBlockHash, SequenceHash};
use kvroute_core::index::{Index, IndexConfig, IndexLayout, SharedIndex, WorkerRank};
use serde_json::{json, Value};

use super::index_floor::IndexFloor;
use crate::error::{Error, Result};
use crate::stats;
use crate::trace::{TraceConfig, TraceGen};

/// What `kvroute bench index` measures.
#[derive(Debug, Clone)]
pub struct IndexBenchConfig {
    /// Workers in the simulated fleet (at least 1).
    pub workers: u32,
    /// Resident (block, worker) entries the index holds once every cache is full.
    pub residencies: u64,
    /// Lookup queries timed.
    pub queries: usize,
    /// Blocks per lookup query.
    pub query_blocks: usize,
    /// Seed of the trace.
    pub seed: u64,
    /// Writer threads of the sharded apply, and shards of the index it
    /// builds (at least 1).
    pub threads: usize,
    /// The process's live heap bytes, when its global allocator counts them;
    /// without it `bytes_per_residency` is not measured (`null`).
    pub heap_meter: Option<fn() -> usize>,
}

type Events = Vec<(WorkerRank, KvEvent)>;

/// The pre-generated inputs: events that build the index, queries, and a
/// second stream of events applied while the queries run.
struct Trace {
    build: Events,
    build_ops: u64,
    /// The queries' blocks, as a request's tokens hash to them.
    locals: Vec<Vec<LocalBlockHash>>,
    /// The same queries as the index is asked them.
    queries: Vec<Vec<SequenceHash>>,
    live: Events,
}

fn progress(msg: &str) {
    eprintln!("[bench index] {msg}");
}

fn apply_all(index: &mut Index, events: &Events) {
    for (key, event) in events {
        index.apply(*key, event);
    }
}

/// Generates the trace: fill every cache, then keep going as long again so
/// evictions are in the mix; then the queries and the live stream.
fn generate(config: &IndexBenchConfig) -> Trace {
    progress(&format!(
        "generating a trace: {} workers, {} resident blocks",
        config.workers, config.residencies
    ));
    let mut gen = TraceGen::new(TraceConfig {
        workers: config.workers,
        residencies: config.residencies,
        seed: config.seed,
    });
    let mut build: Events = Vec::new();
    let mut build_ops = 0u64;
    while gen.held() < config.residencies * 95 / 100 {
        build_ops += gen.step(&mut build);
    }
    let fill_ops = build_ops;
    while build_ops < 2 * fill_ops {
        build_ops += gen.step(&mut build);
    }
    let locals: Vec<_> = (0..config.queries)
        .map(|_| gen.query(config.query_blocks))
        .collect();
    let queries = locals.iter().map(|q| sequence_hashes(q)).collect();
    let mut live: Events = Vec::new();
    let mut live_ops = 0u64;
    while live_ops < build_ops {
        live_ops += gen.step(&mut live);
    }
    Trace {
        build,
        build_ops,
        locals,
        queries,
        live,
    }
}

/// Builds the index three times from the trace; returns the last index, the
/// apply rate (block-ops/s) of each run and the heap growth of the first build.
fn build(config: &IndexBenchConfig, trace: &Trace) -> (Index, Vec<f64>, Option<usize>) {
    progress(&format!(
        "applying {} events ({} block ops), 3 runs",
        trace.build.len(),
        trace.build_ops
    ));
    let index_config = IndexConfig {
        default_capacity: None,
        ..IndexConfig::default()
    };
    let mut apply_rates = Vec::new();
    let mut index = Index::new(index_config.clone());
    let mut bytes_measured = None;
    for run in 0..3 {
        let mut fresh = Index::new(index_config.clone());
        let before = config.heap_meter.map(|live| live());
        let start = Instant::now();
        apply_all(&mut fresh, &trace.build);
        let elapsed = start.elapsed();
        if run == 0 {
            bytes_measured = config
                .heap_meter
                .zip(before)
                .map(|(live, before)| live().saturating_sub(before));
        }
        apply_rates.push(trace.build_ops as f64 / elapsed.as_secs_f64());
        index = fresh;
    }
    (index, apply_rates, bytes_measured)
}

/// Builds a [`SharedIndex`] of `threads` shards from the trace, each thread
/// applying the events of one shard's ranks (in their order), all at once;
/// returns the index and the median block-ops/s of 3 runs.
fn build_sharded(trace: &Trace, threads: usize) -> (SharedIndex, f64) {
    progress(&format!(
        "applying the same events from {threads} threads into {threads} shards, 3 runs"
    ));
    let index_config = IndexConfig {
        default_capacity: None,
        ..IndexConfig::default()
    };
    let probe = SharedIndex::sharded(Index::new(index_config.clone()), threads);
    let mut parts: Vec<Events> = vec![Vec::new(); probe.shard_count()];
    for (key, event) in &trace.build {
        parts[probe.shard_of(*key)].push((*key, event.clone()));
    }
    let mut rates = Vec::new();
    let mut last = probe;
    for _ in 0..3 {
        let shared = SharedIndex::sharded(Index::new(index_config.clone()), threads);
        let start = Instant::now();
        std::thread::scope(|scope| {
            for part in &parts {
                let shared = &shared;
                scope.spawn(move || {
                    for (key, event) in part {
                        shared.apply(*key, event);
                    }
                });
            }
        });
        rates.push(trace.build_ops as f64 / start.elapsed().as_secs_f64());
        last = shared;
    }
    (last, stats::median(&stats::sorted(rates)))
}

/// Times each query; returns the sorted latencies in µs and the mean device
/// depth matched.
fn time_queries<Q>(queries: &[Vec<Q>], mut find: impl FnMut(&[Q]) -> u32) -> (Vec<f64>, f64) {
    let mut micros = Vec::with_capacity(queries.len());
    let mut depth = 0u64;
    for q in queries {
        let start = Instant::now();
        let best = find(q);
        micros.push(start.elapsed().as_nanos() as f64 / 1_000.0);
        depth += u64::from(best);
    }
    (
        stats::sorted(micros),
        depth as f64 / queries.len().max(1) as f64,
    )
}

fn best_device(matches: &[kvroute_core::index::RankMatch]) -> u32 {
    matches.iter().map(|m| m.device).max().unwrap_or(0)
}

/// The machine's 1-minute load average (Linux), to tell a quiet run from a
/// busy one: rates measured beside other work are not the index's.
fn load_average() -> Option<f64> {
    let text = std::fs::read_to_string("/proc/loadavg").ok()?;
    text.split_whitespace().next()?.parse().ok()
}

/// The index's bytes by part per node, and this layout's least size and the
/// node-table fill that twice the floor would need (see [`IndexLayout`]).
fn layout_figures(layout: &IndexLayout, floor: &IndexFloor, residencies: u64) -> Value {
    let budget = 2.0 * floor.total() * residencies as f64;
    let fill_needed = layout.table_fill_needed(budget);
    let per_node = |bytes: u64| bytes as f64 / layout.nodes.max(1) as f64;
    json!({
        "layout_record_bytes_per_node": per_node(layout.record_bytes),
        "layout_node_table_bytes_per_node": per_node(layout.node_table_bytes),
        "layout_holder_list_bytes_per_node": per_node(layout.holder_list_bytes),
        "layout_rank_bytes_per_node": per_node(layout.rank_bytes),
        "layout_holder_entries_per_node": layout.holder_entries as f64 / layout.nodes.max(1) as f64,
        "layout_least_bytes_per_residency_tables_full": layout.least_bytes(1.0) / residencies as f64,
        "layout_table_fill_needed_for_two_times_floor": fill_needed.is_finite().then_some(fill_needed),
    })
}

/// Block operations of one event.
fn block_ops(event: &KvEvent) -> u64 {
    match event {
        KvEvent::Stored(s) => s.blocks.len() as u64,
        KvEvent::Removed(r) => r.blocks.len() as u64,
        KvEvent::Cleared => 0,
        KvEvent::Group(g) => g.blocks.len() as u64,
    }
}

/// Times the queries through a [`SharedIndex`] while another thread applies
/// `live` as fast as it can; returns the sorted latencies in µs and the writer's
/// block-ops/s meanwhile.
fn time_under_writes(shared: &SharedIndex, trace: &Trace) -> (Vec<f64>, f64) {
    let stop = AtomicBool::new(false);
    let writer_ops = AtomicU64::new(0);
    let writer_time = AtomicU64::new(0);
    let (micros, _) = std::thread::scope(|scope| {
        scope.spawn(|| {
            let start = Instant::now();
            let mut ops = 0u64;
            'outer: loop {
                for (key, event) in &trace.live {
                    if stop.load(Ordering::Relaxed) {
                        break 'outer;
                    }
                    shared.apply(*key, event);
                    ops += block_ops(event);
                }
            }
            writer_ops.store(ops, Ordering::Relaxed);
            writer_time.store(start.elapsed().as_nanos() as u64, Ordering::Relaxed);
        });
        // Give the writer a moment to start.
        std::thread::sleep(Duration::from_millis(20));
        let result = time_queries(&trace.queries, |q| best_device(&shared.find_matches(q)));
        stop.store(true, Ordering::Relaxed);
        result
    });
    let writer_rate = writer_ops.load(Ordering::Relaxed) as f64
        / (writer_time.load(Ordering::Relaxed).max(1) as f64 / 1e9);
    (micros, writer_rate)
}

/// Runs the benchmark (progress on stderr) and returns its figures as one
/// JSON object.
pub fn run(config: &IndexBenchConfig) -> Result<Value> {
    if config.workers == 0 {
        return Err(Error::Invalid("workers must be at least 1".into()));
    }
    let load_before = load_average();
    let trace = generate(config);
    let (index, apply_rates, bytes_measured) = build(config, &trace);
    let apply_rate = stats::median(&stats::sorted(apply_rates.clone()));
    let stats = index.stats();
    let layout = index.layout();
    let residencies = stats.residencies.max(1);

    progress(&format!(
        "timing {} lookups of {} blocks",
        trace.queries.len(),
        config.query_blocks
    ));
    let (alone, mean_depth) = time_queries(&trace.queries, |q| best_device(&index.find_matches(q)));
    let (hashing, _) = time_queries(&trace.locals, |q| {
        std::hint::black_box(sequence_hashes(q)).len() as u32
    });

    progress("dump and restore");
    let start = Instant::now();
    let snapshot = index.dump();
    let dump_s = start.elapsed().as_secs_f64();
    let start = Instant::now();
    let restored = Index::restore(&snapshot)?;
    let restore_s = start.elapsed().as_secs_f64();
    if restored.stats().residencies != stats.residencies {
        return Err(Error::Unexpected("restore changed the index".into()));
    }
    drop(restored);

    progress("timing lookups while another thread applies events");
    let (under, writer_rate) = time_under_writes(&SharedIndex::new(index), &trace);

    let threads = config.threads.max(1);
    let (sharded, sharded_rate) = build_sharded(&trace, threads);
    let sharded_stats = sharded.stats();
    if sharded_stats.residencies != stats.residencies {
        return Err(Error::Unexpected("the sharded index differs".into()));
    }
    let (sharded_lookups, _) =
        time_queries(&trace.queries, |q| best_device(&sharded.find_matches(q)));

    let floor = IndexFloor::of(stats.nodes, stats.residencies, u64::from(config.workers));
    let mut report = json!({
        "workers": config.workers,
        "target_residencies": config.residencies,
        "residencies": stats.residencies,
        "nodes": stats.nodes,
        "events": trace.build.len(),
        "block_ops": trace.build_ops,
        "apply_block_ops_per_s": apply_rate.round(),
        "apply_block_ops_per_s_runs": apply_rates.iter().map(|r| r.round()).collect::<Vec<_>>(),
        "load_average_before": load_before,
        "load_average_after": load_average(),
        "queries": trace.queries.len(),
        "query_blocks": config.query_blocks,
        "mean_matched_device_blocks": mean_depth,
        "lookup_p50_us": stats::percentile(&alone, 0.50),
        "lookup_p90_us": stats::percentile(&alone, 0.90),
        "lookup_p99_us": stats::percentile(&alone, 0.99),
        "lookup_max_us": stats::max(&alone),
        "sequence_hashes_p50_us": stats::percentile(&hashing, 0.50),
        "sequence_hashes_p99_us": stats::percentile(&hashing, 0.99),
        "lookup_p50_us_under_writes": stats::percentile(&under, 0.50),
        "lookup_p99_us_under_writes": stats::percentile(&under, 0.99),
        "writer_block_ops_per_s_during_lookups": writer_rate.round(),
        "bytes_per_residency": bytes_measured.map(|b| b as f64 / residencies as f64),
        "estimated_heap_bytes_per_residency": stats.heap_bytes as f64 / residencies as f64,
        "exact_floor_bytes_per_residency": floor.total(),
        "two_times_floor_bytes_per_residency": 2.0 * floor.total(),
        "threads": threads,
        "apply_block_ops_per_s_sharded": sharded_rate.round(),
        "sharded_apply_speedup": sharded_rate / apply_rate.max(1.0),
        "sharded_nodes": sharded_stats.nodes,
        "sharded_estimated_heap_bytes_per_residency": sharded_stats.heap_bytes as f64 / residencies as f64,
        "lookup_p50_us_sharded": stats::percentile(&sharded_lookups, 0.50),
        "lookup_p99_us_sharded": stats::percentile(&sharded_lookups, 0.99),
        "dump_bytes": snapshot.len(),
        "dump_s": dump_s,
        "restore_s": restore_s,
    });
    if let (Some(report), Value::Object(layout)) = (
        report.as_object_mut(),
        layout_figures(&layout, &floor, residencies),
    ) {
        report.extend(layout);
    }
    Ok(report)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn config(heap_meter: Option<fn() -> usize>) -> IndexBenchConfig {
        IndexBenchConfig {
            workers: 4,
            residencies: 2_000,
            queries: 200,
            query_blocks: 16,
            seed: 7,
            threads: 2,
            heap_meter,
        }
    }

    #[test]
    fn a_small_run_reports_every_figure_and_memory_only_when_metered() {
        let report = run(&config(None)).expect("runs");
        assert!(report["residencies"].as_u64().is_some_and(|r| r > 1_000));
        assert!(report["apply_block_ops_per_s"]
            .as_f64()
            .is_some_and(|r| r > 0.0));
        let p50 = report["lookup_p50_us"].as_f64().expect("p50");
        let max = report["lookup_max_us"].as_f64().expect("max");
        assert!(p50 > 0.0 && p50 <= max);
        let hash_p50 = report["sequence_hashes_p50_us"].as_f64().expect("hash p50");
        let hash_p99 = report["sequence_hashes_p99_us"].as_f64().expect("hash p99");
        assert!(hash_p50 > 0.0 && hash_p50 <= hash_p99);
        assert_eq!(report["threads"], 2);
        assert!(report["apply_block_ops_per_s_sharded"]
            .as_f64()
            .is_some_and(|r| r > 0.0));
        assert!(report["sharded_nodes"].as_u64() >= report["nodes"].as_u64());
        assert!(report["bytes_per_residency"].is_null());
        let estimated = report["estimated_heap_bytes_per_residency"]
            .as_f64()
            .expect("estimated bytes");
        let floor = report["exact_floor_bytes_per_residency"]
            .as_f64()
            .expect("floor");
        assert!(floor > 0.0 && floor < estimated, "{floor} {estimated}");
        assert_eq!(
            report["apply_block_ops_per_s_runs"]
                .as_array()
                .map(Vec::len),
            Some(3)
        );
        let least = report["layout_least_bytes_per_residency_tables_full"]
            .as_f64()
            .expect("least");
        assert!(
            least > floor && least < estimated,
            "{floor} {least} {estimated}"
        );
        let record = report["layout_record_bytes_per_node"]
            .as_f64()
            .expect("records");
        assert!(record >= 20.0, "{record}");
        // A meter that reads a growing counter gives a number.
        static CALLS: AtomicU64 = AtomicU64::new(0);
        fn fake() -> usize {
            CALLS.fetch_add(1_000_000, Ordering::Relaxed) as usize
        }
        let metered = run(&config(Some(fake))).expect("runs");
        assert!(metered["bytes_per_residency"]
            .as_f64()
            .is_some_and(|b| b > 0.0));
        assert!(run(&IndexBenchConfig {
            workers: 0,
            ..config(None)
        })
        .is_err());
    }
}
