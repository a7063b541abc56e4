use super::*;
use proptest::prelude::*;

/// Payloads are (seq, engine generation): the fingerprint tells generations apart.
type P = (u64, u64);

fn cursor() -> StreamCursor<P> {
    StreamCursor::new(16, |p| p.0 ^ (p.1 << 40))
}

fn live(c: &mut StreamCursor<P>, seq: u64, generation: u64) -> Vec<Action<P>> {
    let mut out = Vec::new();
    c.live(seq, (seq, generation), &mut out);
    out
}

fn replayed(c: &mut StreamCursor<P>, seq: u64, generation: u64) -> Vec<Action<P>> {
    let mut out = Vec::new();
    c.replayed(seq, (seq, generation), &mut out);
    out
}

fn finished(c: &mut StreamCursor<P>, end: ReplayEnd) -> Vec<Action<P>> {
    let mut out = Vec::new();
    c.replay_finished(end, &mut out);
    out
}

fn resync(c: &mut StreamCursor<P>) -> Vec<Action<P>> {
    let mut out = Vec::new();
    c.resync(&mut out);
    out
}

fn apply(seq: u64, generation: u64) -> Action<P> {
    Action::Apply {
        seq,
        payload: (seq, generation),
    }
}

const RESTART: Action<P> = Action::Clear(ClearReason::EngineRestart);

fn replay(from: u64) -> Action<P> {
    Action::Replay { from }
}

#[test]
fn contiguous_batches_apply_in_order() {
    let mut c = cursor();
    for seq in 0..5 {
        assert_eq!(live(&mut c, seq, 0), [apply(seq, 0)]);
    }
    assert_eq!(c.last_seq(), Some(4));
    assert_eq!(c.history(), History::Exact);
}

#[test]
fn sequence_numbers_past_the_engines_range_are_dropped_without_overflow() {
    let mut c = cursor();
    assert_eq!(live(&mut c, 0, 0), [apply(0, 0)]);
    assert!(live(&mut c, u64::MAX, 0).is_empty());
    assert_eq!(c.stats().invalid_seq, 1);
    assert_eq!(live(&mut c, 1, 0), [apply(1, 0)], "the stream goes on");
    let mut c = cursor();
    assert_eq!(live(&mut c, MAX_SEQ, 0), [replay(0)]);
    assert!(replayed(&mut c, MAX_SEQ + 1, 0).is_empty());
    assert_eq!(finished(&mut c, ReplayEnd::TimedOut), [apply(MAX_SEQ, 0)]);
    assert_eq!(c.next_seq(), Some(MAX_SEQ + 1));
}

#[test]
fn a_late_join_replays_from_zero() {
    let mut c = cursor();
    assert_eq!(live(&mut c, 3, 0), [replay(0)]);
    assert!(live(&mut c, 4, 0).is_empty(), "buffered during the replay");
    for seq in 0..4 {
        assert_eq!(replayed(&mut c, seq, 0), [apply(seq, 0)]);
    }
    assert_eq!(finished(&mut c, ReplayEnd::Complete), [apply(4, 0)]);
    let s = c.stats();
    assert_eq!((s.replays_ok, s.stale, s.gaps), (1, 1, 1));
}

#[test]
fn a_gap_replays_from_the_last_applied_batch_which_proves_continuity() {
    let mut c = cursor();
    live(&mut c, 0, 0);
    live(&mut c, 1, 0);
    assert_eq!(live(&mut c, 4, 0), [replay(1)]);
    live(&mut c, 5, 0);
    assert!(
        replayed(&mut c, 1, 0).is_empty(),
        "the anchor is not applied twice"
    );
    assert_eq!(replayed(&mut c, 2, 0), [apply(2, 0)]);
    assert_eq!(replayed(&mut c, 3, 0), [apply(3, 0)]);
    assert_eq!(replayed(&mut c, 4, 0), [apply(4, 0)]);
    assert_eq!(finished(&mut c, ReplayEnd::Complete), [apply(5, 0)]);
    let s = c.stats();
    assert_eq!((s.gaps, s.replays_ok, s.verifies, s.clears), (1, 1, 1, 0));
    assert_eq!(c.history(), History::Exact);
}

#[test]
fn a_restart_between_reconnects_is_found_by_the_anchor() {
    // The old engine's 0..=2 were applied; the new one published 0..=9 while
    // the router was away, and its batch 2 has other bytes.
    let mut c = cursor();
    for seq in 0..3 {
        live(&mut c, seq, 0);
    }
    assert_eq!(resync(&mut c), [replay(2)]);
    assert_eq!(replayed(&mut c, 2, 1), [RESTART]);
    for seq in 3..10 {
        assert!(replayed(&mut c, seq, 1).is_empty(), "the rest is ignored");
    }
    assert_eq!(finished(&mut c, ReplayEnd::Complete), [replay(0)]);
    for seq in 0..10 {
        assert_eq!(replayed(&mut c, seq, 1), [apply(seq, 1)]);
    }
    assert!(finished(&mut c, ReplayEnd::Complete).is_empty());
    assert_eq!(live(&mut c, 10, 1), [apply(10, 1)]);
    let s = c.stats();
    assert_eq!((s.restarts, s.clears, s.verifies), (1, 1, 0));
    assert_eq!(c.history(), History::Exact);
}

#[test]
fn a_fast_restart_with_an_empty_ring_is_a_restart() {
    let mut c = cursor();
    for seq in 0..6 {
        live(&mut c, seq, 0);
    }
    assert_eq!(resync(&mut c), [replay(5)]);
    assert_eq!(finished(&mut c, ReplayEnd::Complete), [RESTART, replay(0)]);
    assert!(finished(&mut c, ReplayEnd::Complete).is_empty());
    assert_eq!(c.last_seq(), None);
    assert_eq!(live(&mut c, 0, 1), [apply(0, 1)]);
    assert_eq!(c.stats().restarts, 1);
}

#[test]
fn a_quiet_stream_is_verified_against_its_last_batch() {
    let mut c = cursor();
    live(&mut c, 0, 0);
    live(&mut c, 1, 0);
    let mut out = Vec::new();
    c.verify(&mut out);
    assert_eq!(out, [replay(1)]);
    assert!(replayed(&mut c, 1, 0).is_empty());
    assert!(finished(&mut c, ReplayEnd::Complete).is_empty());
    let s = c.stats();
    assert_eq!((s.verifies, s.replays_ok, s.resyncs, s.gaps), (1, 1, 0, 0));
    // A check that times out on a stream with nothing missing loses nothing.
    c.verify(&mut out);
    assert!(finished(&mut c, ReplayEnd::TimedOut).is_empty());
    assert_eq!(c.history(), History::Exact);
    assert_eq!(c.stats().replay_timeouts, 1);
    assert_eq!(c.stats().replays_incomplete, 0);
}

#[test]
fn a_ring_that_no_longer_reaches_back_is_incomplete_not_ok() {
    let mut c = cursor();
    assert_eq!(resync(&mut c), [replay(0)]);
    // The ring kept 40..=50 of a stream that began at 0.
    assert_eq!(replayed(&mut c, 40, 0), [apply(40, 0)]);
    for seq in 41..=50 {
        replayed(&mut c, seq, 0);
    }
    assert!(finished(&mut c, ReplayEnd::Complete).is_empty());
    assert_eq!(c.next_seq(), Some(51));
    let s = c.stats();
    assert_eq!((s.replays_ok, s.replays_incomplete), (0, 1));
    assert_eq!(
        c.history(),
        History::Incomplete(Loss::RingTooShort {
            wanted: 0,
            first: 40
        })
    );
    // A clear by the engine makes history exact again.
    c.history_reset();
    assert_eq!(c.history(), History::Exact);
}

#[test]
fn a_gap_the_ring_cannot_fill_is_incomplete() {
    let mut c = cursor();
    live(&mut c, 0, 0);
    assert_eq!(live(&mut c, 50, 0), [replay(0)]);
    assert_eq!(replayed(&mut c, 40, 0), [apply(40, 0)]);
    for seq in 41..=50 {
        replayed(&mut c, seq, 0);
    }
    assert!(
        finished(&mut c, ReplayEnd::Complete).is_empty(),
        "50 was replayed"
    );
    assert!(matches!(
        c.history(),
        History::Incomplete(Loss::RingTooShort { .. })
    ));
    assert_eq!(c.stats().clears, 0, "older blocks are kept");
}

#[test]
fn without_a_replay_endpoint_a_gap_is_skipped_and_said() {
    let mut c = cursor();
    live(&mut c, 0, 0);
    assert_eq!(live(&mut c, 7, 0), [replay(0)]);
    assert_eq!(finished(&mut c, ReplayEnd::Unavailable), [apply(7, 0)]);
    assert_eq!(c.stats().replays_incomplete, 1);
    assert_eq!(c.stats().replay_timeouts, 0);
    assert_eq!(
        c.history(),
        History::Incomplete(Loss::Gap { from: 1, to: 7 })
    );
    assert_eq!(live(&mut c, 8, 0), [apply(8, 0)]);
    // On a reconnect such a rank starts over.
    let mut out = Vec::new();
    c.reconnected_unverifiable(&mut out);
    assert_eq!(out, [Action::Clear(ClearReason::Unverifiable)]);
    assert_eq!(c.history(), History::Exact);
}

#[test]
fn seq_going_back_with_other_bytes_is_a_restart_and_a_repeat_is_not() {
    let mut c = cursor();
    for seq in 0..10 {
        live(&mut c, seq, 0);
    }
    assert!(live(&mut c, 9, 0).is_empty(), "the same batch again");
    assert_eq!(c.stats().stale, 1);
    assert_eq!(live(&mut c, 0, 1), [RESTART, apply(0, 1)]);
    assert_eq!(c.stats().restarts, 1);
    // A restart seen late (seq already past 0) replays the new run from 0.
    let mut c = cursor();
    for seq in 0..10 {
        live(&mut c, seq, 0);
    }
    assert_eq!(live(&mut c, 2, 1), [RESTART, replay(0)]);
}

#[test]
fn live_copies_of_replayed_batches_are_duplicates_not_a_restart() {
    let mut c = cursor();
    live(&mut c, 0, 0);
    live(&mut c, 3, 0);
    for seq in 0..=6 {
        replayed(&mut c, seq, 0);
    }
    finished(&mut c, ReplayEnd::Complete);
    // 4..6 were published while the replay ran; their live copies arrive now.
    for seq in 4..=6 {
        assert!(live(&mut c, seq, 0).is_empty());
    }
    assert_eq!(c.stats().restarts, 0);
    assert_eq!(live(&mut c, 7, 0), [apply(7, 0)]);
    // After live caught up, an old seq with other bytes is a restart again.
    assert_eq!(live(&mut c, 0, 1), [RESTART, apply(0, 1)]);
}

#[test]
fn a_resync_on_connect_fetches_what_was_published_before_the_subscription() {
    let mut c = cursor();
    assert_eq!(resync(&mut c), [replay(0)]);
    assert_eq!(replayed(&mut c, 0, 0), [apply(0, 0)]);
    assert!(finished(&mut c, ReplayEnd::Complete).is_empty());
    assert_eq!(live(&mut c, 1, 0), [apply(1, 0)]);
    assert_eq!(resync(&mut c), [replay(1)], "from the last applied batch");
    assert_eq!(c.stats().gaps, 0);
    assert_eq!(c.stats().resyncs, 2);
}

#[test]
fn replies_the_engine_dropped_are_asked_for_again() {
    let mut c = cursor();
    live(&mut c, 0, 0);
    live(&mut c, 6, 0);
    replayed(&mut c, 0, 0);
    replayed(&mut c, 1, 0);
    replayed(&mut c, 2, 0);
    assert!(replayed(&mut c, 4, 0).is_empty(), "3 is missing");
    replayed(&mut c, 5, 0);
    assert_eq!(finished(&mut c, ReplayEnd::Complete), [replay(2)]);
    replayed(&mut c, 2, 0);
    for seq in 3..=6 {
        assert_eq!(replayed(&mut c, seq, 0), [apply(seq, 0)]);
    }
    assert!(
        finished(&mut c, ReplayEnd::Complete).is_empty(),
        "6 is stale"
    );
    assert_eq!(c.history(), History::Exact);
}

#[test]
fn the_buffer_is_bounded_and_its_overflow_is_recovered_later() {
    let mut c: StreamCursor<P> = StreamCursor::new(2, |p| p.0);
    live(&mut c, 0, 0);
    live(&mut c, 3, 0);
    live(&mut c, 4, 0);
    live(&mut c, 5, 0); // dropped: the buffer holds 3 and 4
    assert_eq!(c.stats().overflowed, 1);
    replayed(&mut c, 0, 0);
    replayed(&mut c, 1, 0);
    replayed(&mut c, 2, 0);
    assert_eq!(
        finished(&mut c, ReplayEnd::Complete),
        [apply(3, 0), apply(4, 0)]
    );
    assert_eq!(live(&mut c, 6, 0), [replay(4)]);
}

#[test]
fn an_undecodable_batch_is_skipped_and_history_says_so() {
    let mut c = cursor();
    live(&mut c, 0, 0);
    live(&mut c, 1, 0);
    c.undecodable(1);
    assert_eq!(live(&mut c, 2, 0), [apply(2, 0)]);
    assert_eq!(c.stats().undecodable_skipped, 1);
    assert_eq!(
        c.history(),
        History::Incomplete(Loss::Undecodable { seq: 1 })
    );
}

#[test]
fn live_batches_wait_while_the_link_is_down() {
    let mut c = cursor();
    for seq in 0..3 {
        live(&mut c, seq, 0);
    }
    c.suspend();
    assert!(c.is_suspended());
    // A new engine's batches 0..=3 were published; 3 reaches us live first.
    assert!(live(&mut c, 3, 1).is_empty(), "held, not applied");
    assert_eq!(resync(&mut c), [replay(2)]);
    assert_eq!(replayed(&mut c, 2, 1), [RESTART]);
    replayed(&mut c, 3, 1);
    assert_eq!(finished(&mut c, ReplayEnd::Complete), [replay(0)]);
    for seq in 0..=3 {
        assert_eq!(replayed(&mut c, seq, 1), [apply(seq, 1)]);
    }
    assert!(
        finished(&mut c, ReplayEnd::Complete).is_empty(),
        "3 is stale now"
    );
    // If the link never comes back, the shell gives up waiting.
    c.suspend();
    live(&mut c, 4, 1);
    assert_eq!(finished(&mut c, ReplayEnd::TimedOut), [apply(4, 1)]);
    assert_eq!(c.history(), History::Exact, "nothing was skipped");
}

#[test]
fn a_reply_below_the_request_is_not_taken_for_the_answer() {
    let mut c = cursor();
    for seq in 0..5 {
        live(&mut c, seq, 0);
    }
    resync(&mut c);
    assert!(replayed(&mut c, 1, 0).is_empty());
    assert!(replayed(&mut c, 4, 0).is_empty());
    assert_eq!(c.stats().verifies, 1);
}

// ---- property: whatever the network does, exact history means exact state ----

/// What happens next to the stream.
#[derive(Debug, Clone)]
enum Step {
    /// The engine publishes a batch; `delivered` says whether live gets it.
    Publish { delivered: bool },
    /// The link drops (the shell suspends the cursor); `restart` says
    /// whether the engine restarts meanwhile (seq from 0, ring emptied).
    Down { restart: bool },
    /// The link is back: the shell resyncs.
    Reconnect,
    /// The periodic check.
    Verify,
}

fn step() -> impl Strategy<Value = Step> {
    prop_oneof![
        8 => any::<bool>().prop_map(|d| Step::Publish { delivered: d }),
        1 => any::<bool>().prop_map(|restart| Step::Down { restart }),
        1 => Just(Step::Reconnect),
        1 => Just(Step::Verify),
    ]
}

/// An engine: its generation and published batches, and a ring of `ring` batches.
struct Engine {
    generation: u64,
    published: u64,
    ring: u64,
}

impl Engine {
    fn ring_from(&self, from: u64) -> std::ops::Range<u64> {
        let first = self.published.saturating_sub(self.ring);
        from.max(first)..self.published
    }
}

/// Runs the cursor's actions against `engine`, answering replays at once.
/// Returns the (seq, generation) of every batch applied since the last clear.
fn run(c: &mut StreamCursor<P>, engine: &Engine, mut out: Vec<Action<P>>, state: &mut Vec<P>) {
    while !out.is_empty() {
        let mut more = Vec::new();
        for action in out {
            match action {
                Action::Apply { payload, .. } => state.push(payload),
                Action::Clear(_) => state.clear(),
                Action::Replay { from } => {
                    for seq in engine.ring_from(from) {
                        c.replayed(seq, (seq, engine.generation), &mut more);
                    }
                    c.replay_finished(ReplayEnd::Complete, &mut more);
                }
            }
        }
        out = more;
    }
}

proptest! {
    #[test]
    fn exact_history_is_the_current_engines_batches(
        steps in proptest::collection::vec(step(), 1..60),
        ring in 1u64..20,
    ) {
        let mut engine = Engine { generation: 0, published: 0, ring };
        let mut c = cursor();
        let mut state = Vec::new();
        for s in steps {
            let mut out = Vec::new();
            match s {
                Step::Publish { delivered } => {
                    let seq = engine.published;
                    engine.published += 1;
                    if delivered {
                        c.live(seq, (seq, engine.generation), &mut out);
                    }
                }
                Step::Down { restart } => {
                    c.suspend();
                    if restart {
                        engine.generation += 1;
                        engine.published = 0;
                    }
                }
                Step::Reconnect => c.resync(&mut out),
                Step::Verify => c.verify(&mut out),
            }
            run(&mut c, &engine, out, &mut state);
            // What routing counts on is never a dead engine's: blocks of an
            // earlier generation are only ever held in doubt.
            if !c.in_doubt() && c.history() == History::Exact {
                prop_assert!(
                    state.iter().all(|p| p.1 == engine.generation),
                    "trusted blocks of a restarted engine's predecessor"
                );
            }
        }
        // The link comes back, or the shell verifies a quiet stream:
        // afterwards the state must match.
        let mut out = Vec::new();
        c.resync(&mut out);
        run(&mut c, &engine, out, &mut state);
        if c.history() == History::Exact {
            let expected: Vec<P> = (0..engine.published).map(|s| (s, engine.generation)).collect();
            prop_assert_eq!(state, expected);
        } else {
            prop_assert!(engine.published > engine.ring, "incomplete only when the ring wrapped");
        }
    }
}

/// Found by `kvroute bench ingest`: under a flood, live batches buffered
/// during a replay whose ring started after them were taken for a
/// restarted engine's (a seq at or below the last applied, bytes unknown).
#[test]
fn a_live_batch_the_ring_no_longer_holds_is_old_news_not_a_restart() {
    let mut c = cursor();
    for seq in 0..=3 {
        live(&mut c, seq, 0);
    }
    // 4 is lost; 5 arrives and starts a replay; 6 and 7 arrive meanwhile.
    assert_eq!(live(&mut c, 5, 0), [replay(3)]);
    live(&mut c, 6, 0);
    live(&mut c, 7, 0);
    // The ring has moved on: it starts at 6.
    assert_eq!(replayed(&mut c, 6, 0), [apply(6, 0)]);
    replayed(&mut c, 7, 0);
    replayed(&mut c, 8, 0);
    assert!(
        finished(&mut c, ReplayEnd::Complete).is_empty(),
        "5, 6, 7 dropped"
    );
    assert_eq!(c.stats().restarts, 0);
    assert_eq!(c.stats().stale, 3);
    assert_eq!(c.last_seq(), Some(8));
    assert!(matches!(
        c.history(),
        History::Incomplete(Loss::RingTooShort { .. })
    ));
}

#[test]
fn a_resumed_stream_is_proven_by_its_first_resync() {
    let mut c = cursor();
    c.resume(7, 7, true);
    assert_eq!(resync(&mut c), [replay(7)]);
    assert!(
        replayed(&mut c, 7, 0).is_empty(),
        "the same batch: continuous"
    );
    assert_eq!(replayed(&mut c, 8, 0), [apply(8, 0)]);
    assert!(finished(&mut c, ReplayEnd::Complete).is_empty());
    assert_eq!((c.stats().verifies, c.stats().restarts), (1, 0));
    // Resumed again, against an engine that restarted meanwhile.
    let mut c = cursor();
    c.resume(7, 7, false);
    assert!(matches!(c.history(), History::Incomplete(Loss::Restored)));
    resync(&mut c);
    assert_eq!(replayed(&mut c, 7, 1), [RESTART]);
    assert_eq!(c.history(), History::Exact);
}

/// A replay whose replies stop mid-way, end marker and all (vLLM's replay
/// socket drops what a slow reader has not taken past 1,000 queued
/// messages), is asked again from the last batch it brought, until the
/// end marker comes: nothing is lost, history stays exact.
#[test]
fn a_replay_cut_short_without_its_end_marker_is_asked_again_from_where_it_stopped() {
    let mut c = cursor();
    // Joined late: live 1500 arrives, the replay from 0 starts.
    assert_eq!(live(&mut c, 1_500, 0), [replay(0)]);
    for seq in 0..1_000 {
        assert_eq!(replayed(&mut c, seq, 0), [apply(seq, 0)]);
    }
    // The engine dropped 1000.. and its end marker: the shell times out.
    assert_eq!(finished(&mut c, ReplayEnd::TimedOut), [replay(999)]);
    assert!(replayed(&mut c, 999, 0).is_empty(), "the anchor, verified");
    for seq in 1_000..1_500 {
        assert_eq!(replayed(&mut c, seq, 0), [apply(seq, 0)]);
    }
    replayed(&mut c, 1_500, 0);
    assert!(
        finished(&mut c, ReplayEnd::Complete).is_empty(),
        "1500 came by replay; the live copy is stale"
    );
    assert_eq!(c.last_seq(), Some(1_500));
    assert_eq!(c.history(), History::Exact);
    let s = c.stats();
    assert_eq!(
        (s.replay_timeouts, s.replays_ok, s.replays_incomplete),
        (1, 1, 0)
    );
    // A replay that brings nothing before timing out is not asked again.
    c.verify(&mut Vec::new());
    assert!(finished(&mut c, ReplayEnd::TimedOut).is_empty());
}

/// From the link's drop until a replay has ended, the blocks are in doubt:
/// whether the same engine comes back (continuity proven) or a restarted
/// one (the rank cleared), or no proof comes at all (the replay timed out).
#[test]
fn blocks_are_in_doubt_from_the_links_drop_until_a_replay_ends() {
    let mut c = cursor();
    for seq in 0..3 {
        live(&mut c, seq, 0);
    }
    assert!(!c.in_doubt(), "a live stream is trusted");
    c.suspend();
    assert!(c.in_doubt(), "the link dropped");
    resync(&mut c);
    assert!(replayed(&mut c, 2, 0).is_empty(), "the same engine");
    assert!(c.in_doubt(), "until its replay ends");
    assert!(finished(&mut c, ReplayEnd::Complete).is_empty());
    assert!(!c.in_doubt(), "continuity proven");
    // A restarted engine: the end marker alone clears the rank.
    c.suspend();
    resync(&mut c);
    assert_eq!(finished(&mut c, ReplayEnd::Complete), [RESTART, replay(0)]);
    assert!(!c.in_doubt(), "cleared: nothing left to doubt");
    finished(&mut c, ReplayEnd::Complete);
    // No proof: a replay that timed out leaves the doubt.
    live(&mut c, 0, 1);
    c.suspend();
    resync(&mut c);
    finished(&mut c, ReplayEnd::TimedOut);
    assert!(c.in_doubt(), "nothing proved the engine the same");
    // A verify later proves it.
    c.verify(&mut Vec::new());
    replayed(&mut c, 0, 1);
    finished(&mut c, ReplayEnd::Complete);
    assert!(!c.in_doubt());
    // Resumed from a snapshot: in doubt until the first resync's replay ends.
    let mut c = cursor();
    c.resume(7, 7, true);
    assert!(c.in_doubt());
    // Without a replay ring, a reconnection starts over.
    let mut c = cursor();
    live(&mut c, 0, 0);
    c.distrust();
    assert!(c.in_doubt());
    c.reconnected_unverifiable(&mut Vec::new());
    assert!(!c.in_doubt());
}
