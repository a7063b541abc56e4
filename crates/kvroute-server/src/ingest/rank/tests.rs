//! A rank's stream fed by hand: what reaches the index, and its state.

use super::*;
use kvroute_core::index::{DpRank, Index, IndexConfig, WorkerId};
use kvroute_core::wire::write as mp;

/// A vLLM-style batch `[ts, [BlockStored], dp_rank]` storing one block of 4 tokens.
fn stored(hash: u64, dp_rank: u32) -> Vec<u8> {
    stored_at(hash, dp_rank, 4)
}

/// A batch storing one block of `block_size` tokens.
fn stored_at(hash: u64, dp_rank: u32, block_size: u64) -> Vec<u8> {
    let mut w = Vec::new();
    mp::array(&mut w, 3);
    mp::f64(&mut w, 0.0);
    mp::array(&mut w, 1);
    mp::array(&mut w, 7);
    mp::str(&mut w, "BlockStored");
    mp::uints(&mut w, &[hash]);
    mp::nil(&mut w);
    let tokens: Vec<u64> = (hash..hash + block_size).collect();
    mp::uints(&mut w, &tokens);
    mp::uint(&mut w, block_size);
    mp::nil(&mut w);
    mp::nil(&mut w);
    mp::uint(&mut w, u64::from(dp_rank));
    w
}

fn stream(replay: bool, dp_size: u32) -> (RankStream, Arc<SharedIndex>) {
    stream_sized(replay, dp_size, Arc::new(AtomicU32::new(4)))
}

/// A stream whose worker's block size is `block_size` (0: to be learned).
fn stream_sized(
    replay: bool,
    dp_size: u32,
    block_size: Arc<AtomicU32>,
) -> (RankStream, Arc<SharedIndex>) {
    let index = Arc::new(SharedIndex::new(Index::new(IndexConfig::default())));
    let target = RankTarget {
        worker: "w0".into(),
        key: WorkerRank {
            worker: WorkerId(0),
            rank: DpRank(0),
        },
        endpoints: RankEndpoints {
            rank: DpRank(0),
            events: "tcp://127.0.0.1:1".into(),
            replay: replay.then(|| "tcp://127.0.0.1:2".into()),
        },
        topic: String::new(),
        block_size,
        dp_size: Arc::new(AtomicU32::new(dp_size)),
        stats: Arc::new(RankStats::default()),
    };
    (
        RankStream::new(target, index.clone(), Timing::default()),
        index,
    )
}

fn residencies(index: &SharedIndex) -> u64 {
    index.stats().residencies
}

/// Connects and answers the first resync with an empty ring.
fn connect_fresh(s: &mut RankStream) {
    s.link_up();
    assert_eq!(s.take_requests(), [0]);
    s.replay_end(ReplayEnd::Complete);
}

#[test]
fn batches_for_a_rank_the_worker_lacks_are_counted_and_leave_no_state() {
    let (mut s, index) = stream(true, 1);
    connect_fresh(&mut s);
    s.live(0, stored(7, 3));
    assert_eq!(s.target().stats.counters().foreign_rank_batches, 1);
    assert_eq!(residencies(&index), 0);
    s.live(1, stored(8, 0));
    assert_eq!(residencies(&index), 1, "the worker's own rank is applied");
}

#[test]
fn a_restart_seen_on_reconnect_clears_the_rank() {
    let (mut s, index) = stream(true, 1);
    connect_fresh(&mut s);
    assert_eq!(s.state().0, RankState::Live);
    s.live(0, stored(1, 0));
    s.live(1, stored(2, 0));
    assert_eq!(residencies(&index), 2);
    s.link_down();
    assert_eq!(s.state().0, RankState::Disconnected);
    s.link_up();
    assert_eq!(s.take_requests(), [1], "proves from the last batch applied");
    assert_eq!(s.state().0, RankState::Replaying);
    // The engine restarted: its seq 1 is another batch.
    s.replayed(1, stored(9, 0));
    assert_eq!(residencies(&index), 0);
    s.replay_end(ReplayEnd::Complete);
    assert_eq!(s.take_requests(), [0]);
    s.replayed(0, stored(8, 0));
    s.replayed(1, stored(9, 0));
    s.replay_end(ReplayEnd::Complete);
    assert_eq!(residencies(&index), 2);
    assert_eq!(s.target().stats.counters().engine_restarts, 1);
    assert_eq!(s.state().0, RankState::Live);
}

#[test]
fn a_ring_that_does_not_reach_back_degrades_until_predictions_agree() {
    let (mut s, _index) = stream(true, 1);
    s.link_up();
    assert_eq!(s.take_requests(), [0]);
    s.replayed(5, stored(5, 0));
    s.replay_end(ReplayEnd::Complete);
    let (state, reason) = s.state();
    assert_eq!(state, RankState::Degraded);
    assert!(reason.is_some_and(|r| r.contains("starts at seq 5")));
    let stats = s.target().stats.clone();
    assert_eq!(stats.counters().replays_incomplete, 1);
    stats
        .exact_streak
        .store(EXACT_STREAK_TO_RECOVER - 1, Ordering::Relaxed);
    s.tick(now_ms());
    assert_eq!(s.state().0, RankState::Degraded);
    stats.exact_streak.fetch_add(1, Ordering::Relaxed);
    s.tick(now_ms());
    assert_eq!(s.state().0, RankState::Live);
    assert_eq!(stats.state(), RankState::Live);
}

#[test]
fn a_rank_without_replay_is_unverified_and_cleared_on_reconnect() {
    let (mut s, index) = stream(false, 1);
    s.link_up();
    assert!(s.take_requests().is_empty());
    s.live(0, stored(1, 0));
    assert_eq!(s.state().0, RankState::Unverified);
    s.link_down();
    s.link_up();
    assert_eq!(residencies(&index), 0);
    assert_eq!(s.target().stats.counters().clears, 1);
}

#[test]
fn a_quiet_stream_is_verified_and_an_unanswered_replay_times_out() {
    let (mut s, _index) = stream(true, 1);
    connect_fresh(&mut s);
    s.live(0, stored(1, 0));
    let later = now_ms() + Timing::default().verify_ms;
    assert!(s.tick(later), "a quiet stream asks for its last batch");
    assert_eq!(s.take_requests(), [0]);
    s.tick(later + Timing::default().replay_timeout_ms + 1_000);
    assert_eq!(s.target().stats.counters().replay_timeouts, 1);
}

#[test]
fn the_block_size_is_learned_from_the_first_stored_event_and_a_conflict_is_an_error() {
    let shared = Arc::new(AtomicU32::new(0));
    let (mut s, index) = stream_sized(true, 1, shared.clone());
    connect_fresh(&mut s);
    s.live(0, stored_at(1, 0, 8));
    assert_eq!(shared.load(Ordering::Relaxed), 8, "learned");
    assert_eq!(residencies(&index), 1);
    assert_eq!(s.state().0, RankState::Live);
    // A later event at another size is never hashed at the wrong size.
    s.live(1, stored_at(2, 0, 16));
    assert_eq!(residencies(&index), 1);
    let (state, reason) = s.state();
    assert_eq!(state, RankState::Error);
    assert!(reason.is_some_and(|r| r.contains("block size conflict")));
    assert_eq!(s.target().stats.counters().events_filtered, 1);
}

#[test]
fn a_rank_takes_up_the_block_size_another_rank_learned() {
    let shared = Arc::new(AtomicU32::new(0));
    let (mut first, first_index) = stream_sized(true, 1, shared.clone());
    let (mut second, second_index) = stream_sized(true, 1, shared.clone());
    connect_fresh(&mut first);
    connect_fresh(&mut second);
    first.live(0, stored_at(1, 0, 8));
    // The second rank's first event disagrees with what the worker learned.
    second.live(0, stored_at(5, 0, 4));
    assert_eq!(residencies(&first_index), 1);
    assert_eq!(
        residencies(&second_index),
        0,
        "not hashed at the wrong size"
    );
    assert_eq!(second.state().0, RankState::Error);
    assert_eq!(first.state().0, RankState::Live);
}

#[test]
fn a_bursts_lost_last_batch_is_looked_for_once_soon_after_the_stream_goes_quiet() {
    let (mut s, index) = stream(true, 1);
    connect_fresh(&mut s);
    s.live(0, stored(1, 0));
    s.live(1, stored(2, 0));
    // Batch 2 was published and lost: nothing shows it.
    let base = now_ms();
    let early = Timing::default().early_verify_ms;
    assert!(!s.tick(base), "not while the burst may go on");
    assert!(s.tick(base + early + 200), "the early check is due");
    assert_eq!(s.take_requests(), [1]);
    s.replayed(1, stored(2, 0));
    s.replayed(2, stored(3, 0));
    s.replay_end(ReplayEnd::Complete);
    assert_eq!(residencies(&index), 3);
    let c = s.target().stats.counters();
    assert_eq!(
        (c.early_verifies, c.early_repairs, c.periodic_repairs),
        (1, 1, 0)
    );
    // Once per quiet spell.
    assert!(!s.tick(now_ms() + early + 200));
    assert!(s.take_requests().is_empty());
}

#[test]
fn a_replay_that_times_out_without_replies_is_over() {
    let (mut s, _index) = stream(true, 1);
    connect_fresh(&mut s);
    s.live(0, stored(1, 0));
    let base = now_ms() + Timing::default().early_verify_ms + 200;
    assert!(s.tick(base));
    assert_eq!(s.take_requests(), [0]);
    assert_eq!(s.take_lost_ends(), 0);
    s.tick(base + Timing::default().replay_timeout_ms + 200);
    assert_eq!(s.take_lost_ends(), 1, "its end marker is presumed lost");
    assert!(!s.is_replaying());
    assert_eq!(s.target().stats.counters().replay_timeouts, 1);
}
