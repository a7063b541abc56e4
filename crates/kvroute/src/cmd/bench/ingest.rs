//! `kvroute bench ingest`: sustained ingest from mock engines into the index.
//!
//! Each simulated worker is the mocker's own publisher thread (the one
//! `kvroute mocker` runs: msgpack encoding, PUB socket, replay ring); kvroute's
//! registry subscribes to every worker exactly as `kvroute serve` does. The
//! timed region runs from the first published batch until the index has
//! applied every event: encoding, ZeroMQ transport over 127.0.0.1, decoding,
//! local hashing and index writes, with lookups answered meanwhile.

use std::process::ExitCode;
use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::{bail, Context, Result};
use clap::Args;
use kvroute_core::event::WorkerFlavor;
use kvroute_core::hash::LocalBlockHash;
use kvroute_core::index::{Index, IndexConfig, SharedIndex};
use kvroute_mocker::config::{EventFormat, ReplayFrames};
use kvroute_mocker::encode::EncodeOptions;
use kvroute_mocker::event::{BlockRemoved, BlockStored, KvCacheEvent, MEDIUM_GPU};
use kvroute_mocker::faults::FaultConfig;
use kvroute_mocker::publisher::{PublisherHandle, PublisherSettings};
use kvroute_server::ingest::registry::Registry;
use kvroute_server::ingest::spec::{RankEndpoints, WorkerSpec};
use kvroute_server::ingest::stream::{IngestConfig, RankCounters};
use serde_json::json;

use kvroute_core::rng::SplitMix64;

/// Arguments of `kvroute bench ingest`.
#[derive(Debug, Args)]
pub struct IngestBenchArgs {
    /// Simulated workers (one publisher and one ingest thread each).
    #[arg(long, default_value_t = 4)]
    workers: u32,
    /// Batches each worker publishes.
    #[arg(long, default_value_t = 5_000)]
    batches: u64,
    /// Events per batch (stored events, every other one followed by a removal).
    #[arg(long, default_value_t = 8)]
    events_per_batch: u64,
    /// Blocks per stored event.
    #[arg(long, default_value_t = 4)]
    blocks_per_event: u64,
    /// Tokens per block.
    #[arg(long, default_value_t = 16)]
    block_size: u32,
    /// Wire format of the publishers: vllm or sglang.
    #[arg(long, default_value_t = WorkerFlavor::Vllm)]
    flavor: WorkerFlavor,
    /// Print one JSON object instead of a table.
    #[arg(long)]
    json: bool,
}

/// A batch of `events` stored events of `blocks` blocks (and removals of the previous ones).
fn make_batch(
    rng: &mut SplitMix64,
    args: &IngestBenchArgs,
    previous: &mut Vec<u64>,
) -> (Vec<KvCacheEvent>, u64) {
    let mut events = Vec::new();
    let mut block_ops = 0;
    for i in 0..args.events_per_batch {
        let hashes: Vec<u64> = (0..args.blocks_per_event)
            .map(|_| rng.next_u64() >> 1)
            .collect();
        let token_ids: Vec<u64> = (0..args.blocks_per_event * u64::from(args.block_size))
            .map(|_| rng.below(150_000) as u64)
            .collect();
        block_ops += hashes.len() as u64;
        events.push(KvCacheEvent::BlockStored(BlockStored {
            block_hashes: hashes.clone(),
            parent_block_hash: None,
            token_ids,
            block_size: args.block_size,
            lora_id: None,
            medium: Some(MEDIUM_GPU.to_owned()),
            lora_name: None,
            extra_keys: None,
            cache_salt: None,
            session_id: None,
        }));
        // Keep the index at a steady size: evict what the previous batch stored.
        if i % 2 == 1 && !previous.is_empty() {
            let take = previous.len().min(args.blocks_per_event as usize * 2);
            let gone: Vec<u64> = previous.drain(..take).collect();
            block_ops += gone.len() as u64;
            events.push(KvCacheEvent::BlockRemoved(BlockRemoved {
                block_hashes: gone,
                medium: Some(MEDIUM_GPU.to_owned()),
            }));
        }
        previous.extend(hashes);
    }
    (events, block_ops)
}

/// Runs the benchmark and prints the figures.
pub fn run(args: &IngestBenchArgs) -> Result<ExitCode> {
    let flavor = args.flavor;
    let progress = |msg: &str| eprintln!("[bench ingest] {msg}");
    let ctx = zmq::Context::new();
    let index = Arc::new(SharedIndex::new(Index::new(IndexConfig {
        default_capacity: None,
        ..IndexConfig::default()
    })));
    let registry = Registry::new(
        index.clone(),
        IngestConfig::default(),
        Duration::from_secs(3600),
    );
    let mut publishers = Vec::new();
    for w in 0..args.workers {
        let settings = PublisherSettings {
            host: "127.0.0.1".parse().context("host")?,
            events_port: 0,
            replay_port: 0,
            replay_frames: ReplayFrames::Four,
            encode: EncodeOptions {
                flavor,
                format: EventFormat::Map,
            },
            dp_rank: 0,
            faults: FaultConfig::default(),
            buffer_steps: 10_000,
        };
        let publisher = PublisherHandle::spawn(&ctx, settings).context("starting a publisher")?;
        let spec = WorkerSpec {
            name: format!("w{w}"),
            url: String::new(),
            ranks: vec![RankEndpoints {
                rank: 0,
                events: publisher.events_endpoint().to_owned(),
                replay: Some(publisher.replay_endpoint().to_owned()),
            }],
            block_size: args.block_size,
            topic: String::new(),
            model: None,
            flavor: Default::default(),
        };
        registry.register(spec).context("registering")?;
        publishers.push(publisher);
    }
    let deadline = Instant::now() + Duration::from_secs(30);
    while !registry
        .view()
        .iter()
        .all(|w| w.ranks.iter().all(|r| r.connected))
    {
        if Instant::now() > deadline {
            bail!("the subscribers did not connect");
        }
        std::thread::sleep(Duration::from_millis(10));
    }

    progress(&format!("generating {} batches per worker", args.batches));
    let mut rng = SplitMix64::new(7);
    let mut total_events = 0u64;
    let mut total_ops = 0u64;
    let mut plans: Vec<Vec<Vec<KvCacheEvent>>> = Vec::new();
    for _ in 0..args.workers {
        let mut previous = Vec::new();
        let mut batches = Vec::new();
        for _ in 0..args.batches {
            let (events, ops) = make_batch(&mut rng, args, &mut previous);
            total_events += events.len() as u64;
            total_ops += ops;
            batches.push(events);
        }
        plans.push(batches);
    }

    progress(&format!(
        "publishing {total_events} events ({total_ops} block ops)"
    ));
    let applied = || -> u64 {
        registry
            .view()
            .iter()
            .flat_map(|w| &w.ranks)
            .map(|r| r.counters.events)
            .sum()
    };
    let started = Instant::now();
    let mut lookup_worst = Duration::ZERO;
    let probe: Vec<LocalBlockHash> = (0..64).map(LocalBlockHash).collect();
    let rounds = plans.iter().map(Vec::len).max().unwrap_or(0);
    let mut plans: Vec<std::vec::IntoIter<Vec<KvCacheEvent>>> =
        plans.into_iter().map(Vec::into_iter).collect();
    for round in 0..rounds {
        for (publisher, plan) in publishers.iter().zip(plans.iter_mut()) {
            if let Some(events) = plan.next() {
                publisher.publish(1.0 + round as f64, events);
            }
        }
        if round % 100 == 0 {
            let t = Instant::now();
            let _ = index.find_matches(&probe);
            lookup_worst = lookup_worst.max(t.elapsed());
        }
    }
    let deadline = Instant::now() + Duration::from_secs(300);
    while applied() < total_events {
        if Instant::now() > deadline {
            bail!("only {} of {total_events} events were applied", applied());
        }
        let t = Instant::now();
        let _ = index.find_matches(&probe);
        lookup_worst = lookup_worst.max(t.elapsed());
        std::thread::sleep(Duration::from_millis(2));
    }
    let elapsed = started.elapsed().as_secs_f64();
    let view = registry.view();
    let sum = |field: fn(&RankCounters) -> u64| -> u64 {
        view.iter()
            .flat_map(|w| &w.ranks)
            .map(|r| field(&r.counters))
            .sum()
    };
    let report = json!({
        "workers": args.workers,
        "flavor": args.flavor.as_str(),
        "batches": args.batches * u64::from(args.workers),
        "events": total_events,
        "block_ops": total_ops,
        "seconds": elapsed,
        "events_per_s": (total_events as f64 / elapsed).round(),
        "block_ops_per_s": (total_ops as f64 / elapsed).round(),
        "batches_per_s": ((args.batches * u64::from(args.workers)) as f64 / elapsed).round(),
        "decode_errors": sum(|c| c.decode_errors),
        "gaps": sum(|c| c.gaps),
        "replays_ok": sum(|c| c.replays_ok),
        "clears": sum(|c| c.clears),
        "slowest_lookup_us": lookup_worst.as_secs_f64() * 1e6,
        "index_residencies": index.read().stats().residencies,
    });
    registry.shutdown();
    for p in publishers {
        p.shutdown();
    }
    if args.json {
        println!("{report}");
    } else if let Some(map) = report.as_object() {
        for (k, v) in map {
            println!("{k:>24}  {v}");
        }
    }
    Ok(ExitCode::SUCCESS)
}
