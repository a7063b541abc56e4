//! `kvroute bench ingest`: sustained ingest from mock engines into the index.
//!
//! Each simulated worker is the mocker's own publisher thread (the one
//! `kvroute mocker` runs: msgpack encoding, PUB socket, replay ring); kvroute's
//! registry subscribes to every worker exactly as `kvroute serve` does. The
//! timed region runs from the first published batch until the index has
//! applied every event: encoding, ZeroMQ transport over 127.0.0.1, decoding,
//! local hashing and index writes, with lookups answered meanwhile.

use std::sync::Arc;
use std::time::{Duration, Instant};

use kvroute_core::event::WorkerFlavor;
use kvroute_core::hash::LocalBlockHash;
use kvroute_core::index::{Index, IndexConfig, SharedIndex};
use kvroute_core::rng::SplitMix64;
use kvroute_mocker::config::{EventFormat, ReplayFrames};
use kvroute_mocker::encode::EncodeOptions;
use kvroute_mocker::event::{BlockRemoved, BlockStored, KvCacheEvent, MEDIUM_GPU};
use kvroute_mocker::faults::FaultConfig;
use kvroute_mocker::publisher::{PublisherHandle, PublisherSettings};
use kvroute_server::ingest::registry::IngestConfig;
use kvroute_server::ingest::registry::Registry;
use kvroute_server::ingest::spec::{RankEndpoints, WorkerSpec};
use kvroute_server::ingest::stats::RankCounters;
use serde_json::{json, Value};

use crate::error::{Error, Result};

/// What `kvroute bench ingest` publishes.
#[derive(Debug, Clone)]
pub struct IngestBenchConfig {
    /// Simulated workers (one publisher and one ingest thread each).
    pub workers: u32,
    /// Batches each worker publishes.
    pub batches: u64,
    /// Events per batch (stored events, every other one followed by a removal).
    pub events_per_batch: u64,
    /// Blocks per stored event.
    pub blocks_per_event: u64,
    /// Tokens per block.
    pub block_size: u32,
    /// Wire format of the publishers.
    pub flavor: WorkerFlavor,
}

fn progress(msg: &str) {
    eprintln!("[bench ingest] {msg}");
}

/// A batch of `events` stored events of `blocks` blocks (and removals of the previous ones).
fn make_batch(
    rng: &mut SplitMix64,
    args: &IngestBenchConfig,
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

/// Every worker's batches, generated before the timed region; with the
/// total events and block operations.
fn plan(config: &IngestBenchConfig) -> (Vec<Vec<Vec<KvCacheEvent>>>, u64, u64) {
    progress(&format!("generating {} batches per worker", config.batches));
    let mut rng = SplitMix64::new(7);
    let (mut events, mut ops) = (0u64, 0u64);
    let mut plans = Vec::new();
    for _ in 0..config.workers {
        let mut previous = Vec::new();
        let mut batches = Vec::new();
        for _ in 0..config.batches {
            let (batch, batch_ops) = make_batch(&mut rng, config, &mut previous);
            events += batch.len() as u64;
            ops += batch_ops;
            batches.push(batch);
        }
        plans.push(batches);
    }
    (plans, events, ops)
}

/// One publisher per worker, each registered with `registry`; returns when
/// every subscriber is connected.
fn start_publishers(
    config: &IngestBenchConfig,
    registry: &Registry,
    ctx: &zmq::Context,
) -> Result<Vec<PublisherHandle>> {
    let mut publishers = Vec::new();
    for w in 0..config.workers {
        let settings = PublisherSettings {
            host: std::net::Ipv4Addr::LOCALHOST.into(),
            events_port: 0,
            replay_port: 0,
            replay_frames: ReplayFrames::Four,
            encode: EncodeOptions {
                flavor: config.flavor,
                format: EventFormat::Map,
            },
            dp_rank: 0,
            faults: FaultConfig::default(),
            buffer_steps: 10_000,
        };
        let publisher = PublisherHandle::spawn(ctx, settings)?;
        registry.register(WorkerSpec {
            name: format!("w{w}"),
            url: String::new(),
            ranks: vec![RankEndpoints {
                rank: 0,
                events: publisher.events_endpoint().to_owned(),
                replay: Some(publisher.replay_endpoint().to_owned()),
            }],
            block_size: config.block_size,
            topic: String::new(),
            model: None,
            flavor: Default::default(),
        })?;
        publishers.push(publisher);
    }
    let deadline = Instant::now() + Duration::from_secs(30);
    while !registry
        .view()
        .iter()
        .all(|w| w.ranks.iter().all(|r| r.connected))
    {
        if Instant::now() > deadline {
            return Err(Error::Timeout("the subscribers did not connect".into()));
        }
        std::thread::sleep(Duration::from_millis(10));
    }
    Ok(publishers)
}

/// The sum of one stream counter over every rank of every worker.
fn rank_sum(registry: &Registry, field: fn(&RankCounters) -> u64) -> u64 {
    registry
        .view()
        .iter()
        .flat_map(|w| &w.ranks)
        .map(|r| field(&r.counters))
        .sum()
}

/// Runs the benchmark (progress on stderr) and returns its figures as one
/// JSON object.
pub fn run(config: &IngestBenchConfig) -> Result<Value> {
    let ctx = zmq::Context::new();
    let index = Arc::new(SharedIndex::new(Index::new(IndexConfig {
        default_capacity: None,
        ..IndexConfig::default()
    })));
    let registry = Registry::new(
        index.clone(),
        IngestConfig::default(),
        Duration::from_secs(3600),
    )?;
    let publishers = start_publishers(config, &registry, &ctx)?;
    let (plans, total_events, total_ops) = plan(config);

    progress(&format!(
        "publishing {total_events} events ({total_ops} block ops)"
    ));
    let applied = || rank_sum(&registry, |c| c.events);
    let started = Instant::now();
    let mut lookup_worst = Duration::ZERO;
    let probe: Vec<LocalBlockHash> = (0..64).map(LocalBlockHash).collect();
    let mut timed_lookup = || {
        let t = Instant::now();
        let _ = index.find_matches(&probe);
        lookup_worst = lookup_worst.max(t.elapsed());
    };
    let rounds = plans.iter().map(Vec::len).max().unwrap_or(0);
    let mut plans: Vec<_> = plans.into_iter().map(Vec::into_iter).collect();
    for round in 0..rounds {
        for (publisher, plan) in publishers.iter().zip(plans.iter_mut()) {
            if let Some(events) = plan.next() {
                publisher.publish(1.0 + round as f64, events);
            }
        }
        if round % 100 == 0 {
            timed_lookup();
        }
    }
    let deadline = Instant::now() + Duration::from_secs(300);
    while applied() < total_events {
        if Instant::now() > deadline {
            return Err(Error::Timeout(format!(
                "only {} of {total_events} events were applied",
                applied()
            )));
        }
        timed_lookup();
        std::thread::sleep(Duration::from_millis(2));
    }
    let elapsed = started.elapsed().as_secs_f64();
    let batches = config.batches * u64::from(config.workers);
    let report = json!({
        "workers": config.workers,
        "flavor": config.flavor.as_str(),
        "batches": batches,
        "events": total_events,
        "block_ops": total_ops,
        "seconds": elapsed,
        "events_per_s": (total_events as f64 / elapsed).round(),
        "block_ops_per_s": (total_ops as f64 / elapsed).round(),
        "batches_per_s": (batches as f64 / elapsed).round(),
        "decode_errors": rank_sum(&registry, |c| c.decode_errors),
        "gaps": rank_sum(&registry, |c| c.gaps),
        "replays_ok": rank_sum(&registry, |c| c.replays_ok),
        "clears": rank_sum(&registry, |c| c.clears),
        "slowest_lookup_us": lookup_worst.as_secs_f64() * 1e6,
        "index_residencies": index.read().stats().residencies,
    });
    registry.shutdown();
    for p in publishers {
        p.shutdown();
    }
    Ok(report)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_published_event_is_applied_without_errors() {
        let config = IngestBenchConfig {
            workers: 2,
            batches: 20,
            events_per_batch: 4,
            blocks_per_event: 2,
            block_size: 16,
            flavor: WorkerFlavor::Sglang,
        };
        let report = run(&config).expect("runs");
        // 4 stores and 2 removals per batch.
        assert_eq!(report["events"], 2 * 20 * 6);
        assert_eq!(report["batches"], 40);
        assert_eq!(report["decode_errors"], 0);
        assert_eq!(report["flavor"], "sglang");
        assert!(report["events_per_s"].as_f64().is_some_and(|r| r > 0.0));
    }
}
