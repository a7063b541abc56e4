//! Ingestion over real ZeroMQ sockets on 127.0.0.1: a publisher in the test
//! plays the engine (live PUB, replay ROUTER with a ring), kvroute's registry
//! (`kvroute_server`, in this process) subscribes, and the index is checked
//! through lookups.

use std::sync::Arc;
use std::time::{Duration, Instant};

use kvroute_core::hash::{local_block_hashes, sequence_hashes, HASH_SEED};
use kvroute_core::index::{DpRank, Index, IndexConfig, SharedIndex, WorkerId, WorkerRank};
use kvroute_server::ingest::registry::IngestConfig;
use kvroute_server::ingest::registry::Registry;
use kvroute_server::ingest::spec::{RankEndpoints, WorkerSpec};

use crate::support::eventually;
use crate::support::publisher::{batch, removed, stored, Publisher as Engine};

const BS: usize = 4;

/// The tokens of "conversation" `c`, block `b`.
fn tokens_of(c: u32, blocks: usize) -> Vec<u32> {
    (0..(blocks * BS) as u32).map(|i| c * 10_000 + i).collect()
}

/// The sequence hashes a lookup of `tokens` asks for.
fn locals(tokens: &[u32]) -> Vec<kvroute_core::hash::SequenceHash> {
    sequence_hashes(&local_block_hashes(tokens, BS, HASH_SEED, 0))
}

/// One batch storing conversation `c` (`blocks` blocks, engine hashes `c*100 + i`).
fn conversation_batch(c: u32, blocks: usize, rank: u64) -> Vec<u8> {
    let hashes: Vec<u64> = (0..blocks as u64)
        .map(|i| u64::from(c) * 100 + i + 1)
        .collect();
    let mut e = Vec::new();
    stored(&mut e, &hashes, None, &tokens_of(c, blocks), BS);
    batch(&[e], rank)
}

struct Fixture {
    index: Arc<SharedIndex>,
    registry: Registry,
}

fn fixture() -> Fixture {
    let index = Arc::new(SharedIndex::new(Index::new(IndexConfig {
        default_capacity: None,
        ..IndexConfig::default()
    })));
    let mut ingest = IngestConfig::default();
    ingest.timing.replay_timeout_ms = 500;
    let registry =
        Registry::new(index.clone(), ingest, Duration::from_secs(3600)).expect("ingest threads");
    Fixture { index, registry }
}

/// A fake engine (replies in `frames`-frame layout, ring of `ring` batches)
/// and a registry following it as worker `w0`, connected and synced.
fn follow(ctx: &zmq::Context, frames: usize, ring: usize) -> (Engine, Fixture, WorkerRank) {
    let engine = Engine::start(ctx, frames, ring);
    let f = fixture();
    let id = f
        .registry
        .register(worker("w0", vec![engine.endpoints(0)]))
        .expect("register");
    eventually("connected and synced", || synced(&f.registry, "w0"));
    (
        engine,
        f,
        WorkerRank {
            worker: id,
            rank: DpRank(0),
        },
    )
}

fn worker(name: &str, ranks: Vec<RankEndpoints>) -> WorkerSpec {
    WorkerSpec {
        name: name.into(),
        url: "http://127.0.0.1:1".into(),
        ranks,
        block_size: Some(BS as u32),
        topic: String::new(),
        model: None,
        flavor: Default::default(),
        speed: Default::default(),
        role: Default::default(),
        bootstrap_port: None,
    }
}

fn device_depth(index: &SharedIndex, key: WorkerRank, tokens: &[u32]) -> u32 {
    index
        .find_matches(&locals(tokens))
        .iter()
        .find(|m| m.worker_rank == key)
        .map_or(0, |m| m.device)
}

fn rank_field(registry: &Registry, name: &str, rank: u64, field: &str) -> u64 {
    let doc = serde_json::json!({"workers": registry.view()});
    doc["workers"]
        .as_array()
        .and_then(|ws| ws.iter().find(|w| w["name"] == name))
        .and_then(|w| {
            w["ranks"]
                .as_array()?
                .iter()
                .find(|r| r["dp_rank"] == rank)
                .cloned()
        })
        .and_then(|r| r[field].as_u64())
        .unwrap_or(0)
}

/// Connected, and the replay asked for on connection has finished: batches
/// published from now on arrive live.
fn synced(registry: &Registry, name: &str) -> bool {
    connected(registry, name)
        && rank_field(registry, name, 0, "replays_ok")
            + rank_field(registry, name, 0, "replays_incomplete")
            >= 1
}

/// A text field of rank `rank` of the first worker (empty when absent).
fn rank_text(registry: &Registry, rank: usize, field: &str) -> String {
    let doc = serde_json::json!({"workers": registry.view()});
    doc["workers"][0]["ranks"][rank][field]
        .as_str()
        .unwrap_or_default()
        .to_owned()
}

fn connected(registry: &Registry, name: &str) -> bool {
    serde_json::json!({"workers": registry.view()})["workers"][0]["ranks"][0]["connected"]
        .as_bool()
        .unwrap_or(false)
        && !name.is_empty()
}

#[test]
fn live_batches_are_applied_and_a_late_join_is_replayed_from_zero() {
    let ctx = zmq::Context::new();
    let engine = Engine::start(&ctx, 4, 10_000);
    // Published before anyone subscribed: only the ring has it.
    engine.publish(0, &conversation_batch(1, 3, 0), true, 10_000);
    let f = fixture();
    let id = f
        .registry
        .register(worker("w0", vec![engine.endpoints(0)]))
        .expect("register");
    eventually("connected and synced", || synced(&f.registry, "w0"));
    let key = WorkerRank {
        worker: id,
        rank: DpRank(0),
    };
    eventually(
        "the batch published before the subscription, from the ring",
        || device_depth(&f.index, key, &tokens_of(1, 3)) == 3,
    );
    // Live batches follow (the first may still race the subscription; the ring covers it).
    for seq in 1..=3u64 {
        engine.publish(seq, &conversation_batch(seq as u32 + 1, 2, 0), true, 10_000);
        // Pacing, as an engine's steps are; what the test waits for comes next.
        std::thread::sleep(Duration::from_millis(20));
    }
    eventually("live stores applied", || {
        (2..=4).all(|c| device_depth(&f.index, key, &tokens_of(c, 2)) == 2)
    });
    assert!(rank_field(&f.registry, "w0", 0, "replays_ok") >= 1);
    assert_eq!(rank_field(&f.registry, "w0", 0, "last_seq"), 3);
    assert_eq!(rank_field(&f.registry, "w0", 0, "clears"), 0);
}

fn dropped_batches_are_recovered(frames: usize) {
    let ctx = zmq::Context::new();
    let (engine, f, key) = follow(&ctx, frames, 10_000);
    for seq in 0..10u64 {
        // Batches 3, 4 and 7 never reach the subscriber live.
        let live = !matches!(seq, 3 | 4 | 7);
        engine.publish(seq, &conversation_batch(seq as u32 + 1, 2, 0), live, 10_000);
    }
    eventually("every batch applied", || {
        (1..=10).all(|c| device_depth(&f.index, key, &tokens_of(c, 2)) == 2)
    });
    assert!(rank_field(&f.registry, "w0", 0, "replays_ok") >= 1);
    assert_eq!(rank_field(&f.registry, "w0", 0, "clears"), 0);
}

#[test]
fn dropped_batches_are_recovered_by_replay_with_the_topic_frame() {
    dropped_batches_are_recovered(4);
}

#[test]
fn dropped_batches_are_recovered_by_replay_without_the_topic_frame() {
    dropped_batches_are_recovered(3);
}

/// What the ring no longer holds is lost: the rank keeps its older blocks
/// (mostly still right), applies what the ring has, and says its history is
/// incomplete.
#[test]
fn a_gap_older_than_the_ring_degrades_the_rank_and_keeps_its_blocks() {
    let ctx = zmq::Context::new();
    let (engine, f, key) = follow(&ctx, 4, 3);
    engine.publish(0, &conversation_batch(1, 2, 0), true, 3);
    eventually("first store", || {
        device_depth(&f.index, key, &tokens_of(1, 2)) == 2
    });
    // Seqs 1..=5 are lost; the ring keeps only the last 3 (4, 5, 6).
    for seq in 1..=6u64 {
        engine.publish(seq, &conversation_batch(seq as u32 + 1, 2, 0), seq == 6, 3);
    }
    eventually("what the ring holds applied", || {
        device_depth(&f.index, key, &tokens_of(7, 2)) == 2
    });
    assert_eq!(rank_field(&f.registry, "w0", 0, "clears"), 0);
    assert!(rank_field(&f.registry, "w0", 0, "replays_incomplete") >= 1);
    assert_eq!(rank_text(&f.registry, 0, "state"), "degraded");
    assert_eq!(
        device_depth(&f.index, key, &tokens_of(1, 2)),
        2,
        "blocks before the gap are kept"
    );
    assert_eq!(device_depth(&f.index, key, &tokens_of(3, 2)), 0, "lost");
    assert_eq!(
        device_depth(&f.index, key, &tokens_of(5, 2)),
        2,
        "replayed from the ring"
    );
}

/// A live batch numbered `u64::MAX` (the replay's end marker, which no
/// engine publishes live) is counted as a bad frame and applied to nothing;
/// the stream goes on after it (its next sequence number does not overflow).
#[test]
fn a_sequence_number_no_engine_can_publish_is_a_bad_frame() {
    let ctx = zmq::Context::new();
    let (engine, f, key) = follow(&ctx, 4, 10_000);
    for seq in 0..2u64 {
        engine.publish(seq, &conversation_batch(seq as u32 + 1, 2, 0), true, 10_000);
    }
    eventually("two stores", || {
        device_depth(&f.index, key, &tokens_of(2, 2)) == 2
    });
    engine.publish(u64::MAX, &conversation_batch(77, 2, 0), true, 10_000);
    engine.publish(2, &conversation_batch(3, 2, 0), true, 10_000);
    eventually("the stream goes on after it", || {
        device_depth(&f.index, key, &tokens_of(3, 2)) == 2
    });
    assert_eq!(device_depth(&f.index, key, &tokens_of(77, 2)), 0);
    assert!(rank_field(&f.registry, "w0", 0, "bad_frames") >= 1);
}

#[test]
fn an_engine_restart_resets_the_rank() {
    let ctx = zmq::Context::new();
    let (engine, f, key) = follow(&ctx, 4, 10_000);
    for seq in 0..5u64 {
        engine.publish(seq, &conversation_batch(seq as u32 + 1, 2, 0), true, 10_000);
    }
    eventually("five stores", || {
        device_depth(&f.index, key, &tokens_of(5, 2)) == 2
    });
    engine.restart_ring();
    engine.publish(0, &conversation_batch(42, 2, 0), true, 10_000);
    eventually("reset and rebuilt", || {
        rank_field(&f.registry, "w0", 0, "engine_restarts") == 1
            && device_depth(&f.index, key, &tokens_of(42, 2)) == 2
    });
    assert_eq!(device_depth(&f.index, key, &tokens_of(1, 2)), 0);
}

/// An envelope that cannot be decoded is skipped (its ring copy holds the
/// same bytes) and the rank says its history is incomplete; a malformed
/// event costs only itself.
#[test]
fn a_malformed_envelope_is_skipped_and_a_malformed_event_loses_only_itself() {
    let ctx = zmq::Context::new();
    let (engine, f, key) = follow(&ctx, 4, 10_000);
    engine.publish(0, &conversation_batch(1, 2, 0), true, 10_000);
    // Seq 1 is garbage, live and in the ring.
    engine.publish(1, &[0xc1, 0x00], true, 10_000);
    // Seq 2: a bad event between two good ones.
    let mut good_a = Vec::new();
    stored(&mut good_a, &[301, 302], None, &tokens_of(3, 2), BS);
    let bad = vec![0x81, 0xa4, b't', b'y', b'p', b'e', 0x07];
    let mut good_b = Vec::new();
    stored(&mut good_b, &[401, 402], None, &tokens_of(4, 2), BS);
    engine.publish(2, &batch(&[good_a, bad, good_b], 0), true, 10_000);
    eventually("all good data applied", || {
        [1, 3, 4]
            .iter()
            .all(|&c| device_depth(&f.index, key, &tokens_of(c, 2)) == 2)
    });
    assert_eq!(rank_field(&f.registry, "w0", 0, "envelope_errors"), 1);
    assert_eq!(rank_text(&f.registry, 0, "state"), "degraded");
    assert!(rank_text(&f.registry, 0, "state_reason").contains("batch 1"));
    assert_eq!(rank_field(&f.registry, "w0", 0, "decode_errors"), 1);
    assert_eq!(rank_field(&f.registry, "w0", 0, "clears"), 0);
}

#[test]
fn two_ranks_stay_apart_and_unregistering_drops_the_workers_blocks() {
    let ctx = zmq::Context::new();
    let rank0 = Engine::start(&ctx, 4, 10_000);
    let rank1 = Engine::start(&ctx, 4, 10_000);
    let f = fixture();
    let id = f
        .registry
        .register(worker("w0", vec![rank0.endpoints(0), rank1.endpoints(1)]))
        .expect("register");
    eventually("connected", || {
        let doc = serde_json::json!({"workers": f.registry.view()});
        doc["workers"][0]["ranks"].as_array().is_some_and(|r| {
            r.len() == 2
                && r.iter().all(|r| {
                    r["connected"] == true
                        && r["replays_ok"].as_u64().unwrap_or(0)
                            + r["replays_incomplete"].as_u64().unwrap_or(0)
                            >= 1
                })
        })
    });
    rank0.publish(0, &conversation_batch(1, 2, 0), true, 10_000);
    rank1.publish(0, &conversation_batch(2, 3, 1), true, 10_000);
    let (k0, k1) = (
        WorkerRank {
            worker: id,
            rank: DpRank(0),
        },
        WorkerRank {
            worker: id,
            rank: DpRank(1),
        },
    );
    eventually("both ranks", || {
        device_depth(&f.index, k0, &tokens_of(1, 2)) == 2
            && device_depth(&f.index, k1, &tokens_of(2, 3)) == 3
    });
    assert_eq!(device_depth(&f.index, k1, &tokens_of(1, 2)), 0);
    assert_eq!(device_depth(&f.index, k0, &tokens_of(2, 3)), 0);
    assert!(f.registry.unregister("w0"));
    assert!(f.index.ranks().iter().all(|k| k.worker != WorkerId(id.0)));
    assert!(f.index.find_matches(&locals(&tokens_of(1, 2))).is_empty());
    assert!(!f.registry.unregister("w0"));
}

#[test]
fn a_flood_of_events_does_not_stop_lookups() {
    let ctx = zmq::Context::new();
    let (engine, f, key) = follow(&ctx, 4, 100_000);
    const EVENTS: u64 = 100_000;
    const PER_BATCH: u64 = 100;
    let started = Instant::now();
    let mut lookups = 0u64;
    let mut slowest = Duration::ZERO;
    for seq in 0..EVENTS / PER_BATCH {
        let events: Vec<Vec<u8>> = (0..PER_BATCH)
            .map(|i| {
                let c = (seq * PER_BATCH + i) as u32;
                let mut e = Vec::new();
                stored(
                    &mut e,
                    &[u64::from(c) * 100 + 1],
                    None,
                    &tokens_of(c, 1),
                    BS,
                );
                e
            })
            .collect();
        engine.publish(seq, &batch(&events, 0), true, 100_000);
        let t = Instant::now();
        let _ = f.index.find_matches(&locals(&tokens_of(7, 1)));
        slowest = slowest.max(t.elapsed());
        lookups += 1;
    }
    eventually("every event applied", || {
        rank_field(&f.registry, "w0", 0, "events") == EVENTS
    });
    let elapsed = started.elapsed();
    assert_eq!(
        device_depth(&f.index, key, &tokens_of((EVENTS - 1) as u32, 1)),
        1
    );
    eprintln!(
        "flood: {EVENTS} events in {:.2} s ({:.0} events/s), {lookups} lookups, slowest {:?}",
        elapsed.as_secs_f64(),
        EVENTS as f64 / elapsed.as_secs_f64(),
        slowest
    );
    assert!(
        slowest < Duration::from_millis(500),
        "a lookup waited {slowest:?}"
    );
}

#[test]
fn a_worker_unreachable_past_the_grace_period_loses_its_blocks() {
    let ctx = zmq::Context::new();
    let engine = Engine::start(&ctx, 4, 10_000);
    let index = Arc::new(SharedIndex::new(Index::new(IndexConfig {
        default_capacity: None,
        ..IndexConfig::default()
    })));
    let registry = Registry::new(
        index.clone(),
        IngestConfig::default(),
        Duration::from_millis(300),
    )
    .expect("ingest threads");
    let id = registry
        .register(worker("w0", vec![engine.endpoints(0)]))
        .expect("register");
    eventually("connected and synced", || synced(&registry, "w0"));
    let key = WorkerRank {
        worker: id,
        rank: DpRank(0),
    };
    engine.publish(0, &conversation_batch(1, 2, 0), true, 10_000);
    eventually("stored", || {
        device_depth(&index, key, &tokens_of(1, 2)) == 2
    });
    registry.check_unreachable();
    assert_eq!(
        device_depth(&index, key, &tokens_of(1, 2)),
        2,
        "connected workers keep their blocks"
    );
    drop(engine);
    eventually("blocks dropped after the grace period", || {
        registry.check_unreachable();
        device_depth(&index, key, &tokens_of(1, 2)) == 0
    });
    assert_eq!(registry.len(), 1, "the worker stays registered");
}

#[test]
fn an_engine_hash_reaches_only_the_blocks_of_the_worker_that_published_it() {
    // w0 stores block x as engine hash 10, w1 stores x as 11; then w1's
    // removal of hash 10, and w1's store under parent 10, do not reach x
    // through w0's name for it.
    let ctx = zmq::Context::new();
    let (e0, e1) = (Engine::start(&ctx, 4, 100), Engine::start(&ctx, 4, 100));
    let f = fixture();
    let w0 = f
        .registry
        .register(worker("w0", vec![e0.endpoints(0)]))
        .expect("w0");
    let w1 = f
        .registry
        .register(worker("w1", vec![e1.endpoints(0)]))
        .expect("w1");
    let (k0, k1) = (
        WorkerRank {
            worker: w0,
            rank: DpRank(0),
        },
        WorkerRank {
            worker: w1,
            rank: DpRank(0),
        },
    );
    let x = tokens_of(1, 1);
    let one = |hashes: &[u64], parent: Option<u64>, tokens: &[u32]| {
        let mut e = Vec::new();
        stored(&mut e, hashes, parent, tokens, BS);
        batch(&[e], 0)
    };
    eventually("both connected", || {
        e0.publish(0, &one(&[10], None, &x), true, 100);
        e1.publish(0, &one(&[11], None, &x), true, 100);
        device_depth(&f.index, k0, &x) == 1 && device_depth(&f.index, k1, &x) == 1
    });
    let mut gone = Vec::new();
    removed(&mut gone, &[10]);
    e1.publish(1, &one(&[10], Some(999), &tokens_of(2, 1)), true, 100);
    e1.publish(2, &batch(&[gone], 0), true, 100);
    let mut xy = x.clone();
    xy.extend(tokens_of(3, 1));
    e1.publish(3, &one(&[12], Some(10), &tokens_of(3, 1)), true, 100);
    let mut xw = x.clone();
    xw.extend(tokens_of(4, 1));
    e1.publish(4, &one(&[13], Some(11), &tokens_of(4, 1)), true, 100);
    eventually("w1's batches applied", || {
        rank_field(&f.registry, "w1", 0, "last_seq") == 4
    });
    assert_eq!(device_depth(&f.index, k0, &x), 1, "w0 keeps x");
    assert_eq!(
        device_depth(&f.index, k1, &x),
        1,
        "w1 keeps x: it never named it 10"
    );
    assert_eq!(
        device_depth(&f.index, k1, &xy),
        1,
        "y is not attached under x"
    );
    assert_eq!(
        device_depth(&f.index, k1, &xw),
        2,
        "w1's own name for x works"
    );
}

#[test]
fn a_worker_keeps_its_role_through_a_snapshot_and_another_role_is_another_worker() {
    use kvroute_server::ingest::registry::RegistryError;
    use kvroute_server::ingest::spec::WorkerRole;
    let rank = |r: u32| RankEndpoints {
        rank: DpRank(r),
        events: format!("tcp://127.0.0.1:{}", crate::support::free_port()),
        replay: None,
    };
    let line = |role: &str| {
        let events = format!("tcp://127.0.0.1:{}", crate::support::free_port());
        let line = format!("name=p,url=http://127.0.0.1:1,events={events},flavor=sglang,{role}");
        WorkerSpec::parse(&line, Some(BS as u32)).expect("spec")
    };
    let f = fixture();
    let mut spec = line("role=prefill,bootstrap_port=8998");
    f.registry.register(spec.clone()).expect("register");
    // More ranks of the same worker: the same role and port.
    spec.ranks = vec![rank(1)];
    f.registry.register(spec.clone()).expect("a second rank");
    let view = f.registry.view();
    assert_eq!(
        (view[0].role, view[0].bootstrap_port, view[0].ranks.len()),
        (WorkerRole::Prefill, Some(8998), 2)
    );
    for other in ["role=decode", "role=prefill,bootstrap_port=9000"] {
        let err = f.registry.register(line(other)).expect_err(other);
        assert!(matches!(err, RegistryError::NameTaken(_)), "{other}: {err}");
    }

    // A restarted router registers it again, from its snapshot, as it was.
    let snapshot = f.registry.snapshot();
    f.registry.shutdown();
    let g = fixture();
    g.registry.restore(&snapshot).expect("restore");
    g.registry.register_saved();
    let view = g.registry.view();
    assert_eq!(
        (view[0].name.as_str(), view[0].role, view[0].bootstrap_port),
        ("p", WorkerRole::Prefill, Some(8998))
    );
    let doc = serde_json::json!(view);
    assert_eq!(
        (&doc[0]["role"], &doc[0]["bootstrap_port"]),
        (&serde_json::json!("prefill"), &serde_json::json!(8998))
    );
    g.registry.shutdown();
}
