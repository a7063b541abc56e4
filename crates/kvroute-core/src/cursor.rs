//! The sequence cursor of one (worker, rank) event stream: which batches to
//! apply, when to ask the engine's replay socket for missed ones, and when the
//! rank's state can no longer be trusted.
//!
//! Engines number batches per publisher from 0 (`seq`, 8 bytes big-endian on
//! the wire) and keep the last 10,000 in a replay ring. The cursor tracks the
//! next expected `seq` and turns each observation into [`Action`]s for the
//! shell, which owns the sockets:
//!
//! | live batch | meaning | actions |
//! | --- | --- | --- |
//! | `seq == next` | contiguous | apply |
//! | `seq > next` | batches were lost | buffer it, replay from `next` |
//! | `seq < next` | the engine restarted (seq went back) | clear the rank, start over |
//! | first batch, `seq > 0` | we joined late | buffer it, replay from 0 |
//!
//! During a replay, live batches are buffered (bounded: past the bound they are
//! dropped, and the gap they leave is found and replayed later). Replayed
//! batches older than `next` are stale and dropped. If the replay cannot fill
//! the gap (the ring no longer holds it, the replay timed out, or there is no
//! replay endpoint), the rank is cleared and the stream continues from the
//! next batch it has: the index never keeps state it cannot vouch for.
//!
//! A batch whose envelope cannot be decoded is treated as a gap once (the
//! shell reports it with [`StreamCursor::undecodable`] and it is replayed);
//! if its replayed copy fails too, it is skipped.
//!
//! Sequence numbers above [`MAX_SEQ`] cannot come from an engine counting
//! from 0 (and `u64::MAX` is the replay's end marker): such a batch is
//! counted as `invalid_seq` and dropped, so `seq + 1` never overflows.

use std::collections::VecDeque;

/// Why a rank's blocks were dropped.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ClearReason {
    /// `seq` went backwards: the engine restarted with an empty cache.
    EngineRestart,
    /// Batches were lost and could not be replayed.
    UnrecoverableGap,
}

impl ClearReason {
    /// Stable name for metrics and logs.
    pub fn as_str(self) -> &'static str {
        match self {
            ClearReason::EngineRestart => "engine_restart",
            ClearReason::UnrecoverableGap => "unrecoverable_gap",
        }
    }
}

/// What the shell must do next, in order.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Action<T> {
    /// Decode and apply this batch.
    Apply {
        /// Its sequence number.
        seq: u64,
        /// Its payload.
        payload: T,
    },
    /// Ask the replay socket for every batch from `from` on, feed each to
    /// [`StreamCursor::replayed`], then call [`StreamCursor::replay_finished`].
    Replay {
        /// First sequence number wanted.
        from: u64,
    },
    /// Drop everything the index holds for this rank.
    Clear(ClearReason),
}

/// Counts kept by a cursor, for `/workers` and metrics.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct CursorStats {
    /// Batches handed out for applying.
    pub applied: u64,
    /// Batches dropped as older than already applied ones.
    pub stale: u64,
    /// Gaps detected (including a late join and undecodable batches).
    pub gaps: u64,
    /// Replays that filled their gap.
    pub replays_ok: u64,
    /// Replays that could not (ring too short, timeout, no endpoint).
    pub replays_incomplete: u64,
    /// Engine restarts seen.
    pub restarts: u64,
    /// Times the rank was cleared.
    pub clears: u64,
    /// Live batches dropped because the replay buffer was full.
    pub overflowed: u64,
    /// Batches skipped because even their replayed copy could not be decoded.
    pub undecodable_skipped: u64,
    /// Replays asked for on (re)connection.
    pub resyncs: u64,
    /// Batches dropped because their sequence number was above [`MAX_SEQ`].
    pub invalid_seq: u64,
}

/// The largest sequence number a batch may carry (engines number batches
/// from 0 in a signed 64-bit integer).
pub const MAX_SEQ: u64 = i64::MAX as u64;

/// The cursor of one stream; `T` is the payload type the shell carries.
#[derive(Debug, Clone)]
pub struct StreamCursor<T> {
    next: Option<u64>,
    replaying: bool,
    /// The batch being replayed because it could not be decoded.
    retrying: Option<u64>,
    buffer: VecDeque<(u64, T)>,
    max_buffered: usize,
    /// Batches applied from the replay ring since live last caught up, as
    /// (seq, fingerprint): live copies of them may still be in flight and
    /// are duplicates, while a batch with a known seq but other bytes means
    /// the engine restarted.
    replayed: VecDeque<(u64, u64)>,
    fingerprint: fn(&T) -> u64,
    stats: CursorStats,
}

/// Replayed batches remembered for duplicate detection, at most.
const MAX_REPLAYED: usize = 16_384;

impl<T> StreamCursor<T> {
    /// A cursor that has seen nothing, buffering at most `max_buffered` live
    /// batches while a replay runs. `fingerprint` identifies a payload's bytes
    /// (a hash), to tell a late duplicate from a restarted engine's batch.
    pub fn new(max_buffered: usize, fingerprint: fn(&T) -> u64) -> Self {
        StreamCursor {
            next: None,
            replaying: false,
            retrying: None,
            buffer: VecDeque::new(),
            max_buffered: max_buffered.max(1),
            replayed: VecDeque::new(),
            fingerprint,
            stats: CursorStats::default(),
        }
    }

    /// The next expected sequence number, once known.
    pub fn next_seq(&self) -> Option<u64> {
        self.next
    }

    /// The last applied sequence number.
    pub fn last_seq(&self) -> Option<u64> {
        self.next.and_then(|n| n.checked_sub(1))
    }

    /// True while a replay is outstanding.
    pub fn is_replaying(&self) -> bool {
        self.replaying
    }

    /// Counts so far.
    pub fn stats(&self) -> CursorStats {
        self.stats
    }

    fn apply(&mut self, seq: u64, payload: T, out: &mut Vec<Action<T>>) {
        self.next = Some(seq + 1);
        self.stats.applied += 1;
        out.push(Action::Apply { seq, payload });
    }

    fn clear(&mut self, reason: ClearReason, out: &mut Vec<Action<T>>) {
        self.stats.clears += 1;
        out.push(Action::Clear(reason));
    }

    fn start_replay(&mut self, from: u64, out: &mut Vec<Action<T>>) {
        self.stats.gaps += 1;
        self.replaying = true;
        out.push(Action::Replay { from });
    }

    /// A batch from the live subscription.
    pub fn live(&mut self, seq: u64, payload: T, out: &mut Vec<Action<T>>) {
        if seq > MAX_SEQ {
            self.stats.invalid_seq += 1;
            return;
        }
        if self.replaying {
            if self.buffer.len() < self.max_buffered {
                self.buffer.push_back((seq, payload));
            } else {
                self.stats.overflowed += 1;
            }
            return;
        }
        match self.next {
            None if seq == 0 => self.apply(seq, payload, out),
            None => {
                self.buffer.push_back((seq, payload));
                self.start_replay(0, out);
            }
            Some(next) if seq == next => {
                // Live has caught up: no older live copy can follow (one connection is FIFO).
                self.replayed.clear();
                self.apply(seq, payload, out);
            }
            Some(next) if seq > next => {
                self.buffer.push_back((seq, payload));
                self.start_replay(next, out);
            }
            Some(_) if self.replayed.contains(&(seq, (self.fingerprint)(&payload))) => {
                // The live copy of a batch a replay already delivered.
                self.stats.stale += 1;
            }
            Some(_) => {
                // Backwards: the publisher restarted, and so did its cache.
                self.stats.restarts += 1;
                self.clear(ClearReason::EngineRestart, out);
                self.next = None;
                self.retrying = None;
                self.live(seq, payload, out);
            }
        }
    }

    /// A batch from the replay socket, in the order received.
    pub fn replayed(&mut self, seq: u64, payload: T, out: &mut Vec<Action<T>>) {
        if seq > MAX_SEQ {
            self.stats.invalid_seq += 1;
            return;
        }
        let next = self.next.unwrap_or(0);
        if seq < next {
            self.stats.stale += 1;
        } else {
            if seq > next {
                // The ring no longer holds `next..seq`.
                self.clear(ClearReason::UnrecoverableGap, out);
            }
            if self.replayed.len() == MAX_REPLAYED {
                self.replayed.pop_front();
            }
            self.replayed.push_back((seq, (self.fingerprint)(&payload)));
            self.apply(seq, payload, out);
        }
    }

    /// The replay ended: `complete` when the end marker arrived (false on a
    /// timeout or when there is no replay endpoint). Applies what was buffered.
    pub fn replay_finished(&mut self, complete: bool, out: &mut Vec<Action<T>>) {
        if !self.replaying {
            return;
        }
        self.replaying = false;
        let mut filled = complete;
        while let Some((seq, payload)) = self.buffer.pop_front() {
            match self.next {
                Some(next) if seq < next => self.stats.stale += 1,
                Some(next) if seq == next => self.apply(seq, payload, out),
                None if seq == 0 => self.apply(seq, payload, out),
                _ => {
                    filled = false;
                    self.clear(ClearReason::UnrecoverableGap, out);
                    self.apply(seq, payload, out);
                }
            }
        }
        if filled {
            self.stats.replays_ok += 1;
        } else {
            self.stats.replays_incomplete += 1;
        }
    }

    /// The subscription (re)connected: batches published before the engine saw
    /// our subscription never arrive live, so ask the replay ring for
    /// everything from the next expected batch (from 0 on a first connect).
    /// Not counted as a gap.
    pub fn resync(&mut self, out: &mut Vec<Action<T>>) {
        if self.replaying {
            return;
        }
        let from = self.next.unwrap_or(0);
        self.replaying = true;
        self.stats.resyncs += 1;
        out.push(Action::Replay { from });
    }

    /// The shell could not decode the envelope of batch `seq` it was told to
    /// apply: replay it once; if that copy fails too, skip it.
    pub fn undecodable(&mut self, seq: u64, out: &mut Vec<Action<T>>) {
        if self.retrying == Some(seq) {
            self.retrying = None;
            self.stats.undecodable_skipped += 1;
            return;
        }
        self.retrying = Some(seq);
        self.stats.applied = self.stats.applied.saturating_sub(1);
        self.next = Some(seq);
        if !self.replaying {
            self.start_replay(seq, out);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn live(c: &mut StreamCursor<u64>, seq: u64) -> Vec<Action<u64>> {
        let mut out = Vec::new();
        c.live(seq, seq, &mut out);
        out
    }

    fn replayed(c: &mut StreamCursor<u64>, seq: u64) -> Vec<Action<u64>> {
        let mut out = Vec::new();
        c.replayed(seq, seq, &mut out);
        out
    }

    fn finished(c: &mut StreamCursor<u64>, complete: bool) -> Vec<Action<u64>> {
        let mut out = Vec::new();
        c.replay_finished(complete, &mut out);
        out
    }

    fn apply(seq: u64) -> Action<u64> {
        Action::Apply { seq, payload: seq }
    }

    #[test]
    fn sequence_numbers_past_the_engines_range_are_dropped_without_overflow() {
        let mut c = StreamCursor::new(16, |p| *p);
        assert_eq!(live(&mut c, 0), [apply(0)]);
        assert!(live(&mut c, u64::MAX).is_empty());
        assert!(replayed(&mut c, MAX_SEQ + 1).is_empty());
        assert_eq!(c.stats().invalid_seq, 2);
        assert_eq!(live(&mut c, 1), [apply(1)], "the stream goes on");
        let mut c = StreamCursor::new(16, |p| *p);
        assert_eq!(live(&mut c, MAX_SEQ), [Action::Replay { from: 0 }]);
        assert_eq!(finished(&mut c, false).len(), 2, "clear, then apply");
        assert_eq!(c.next_seq(), Some(MAX_SEQ + 1));
    }

    #[test]
    fn contiguous_batches_apply_in_order() {
        let mut c = StreamCursor::new(16, |p| *p);
        for seq in 0..5 {
            assert_eq!(live(&mut c, seq), [apply(seq)]);
        }
        assert_eq!(c.last_seq(), Some(4));
    }

    #[test]
    fn a_late_join_replays_from_zero() {
        let mut c = StreamCursor::new(16, |p| *p);
        assert_eq!(live(&mut c, 3), [Action::Replay { from: 0 }]);
        assert!(live(&mut c, 4).is_empty(), "buffered during the replay");
        for seq in 0..4 {
            assert_eq!(replayed(&mut c, seq), [apply(seq)]);
        }
        assert_eq!(finished(&mut c, true), [apply(4)]);
        assert_eq!(c.stats().replays_ok, 1);
        assert_eq!(c.stats().stale, 1, "buffered 3 was already replayed");
    }

    #[test]
    fn a_gap_is_replayed_and_buffered_batches_follow() {
        let mut c = StreamCursor::new(16, |p| *p);
        live(&mut c, 0);
        live(&mut c, 1);
        assert_eq!(live(&mut c, 4), [Action::Replay { from: 2 }]);
        live(&mut c, 5);
        assert_eq!(replayed(&mut c, 2), [apply(2)]);
        assert_eq!(replayed(&mut c, 3), [apply(3)]);
        assert_eq!(replayed(&mut c, 4), [apply(4)]);
        assert_eq!(finished(&mut c, true), [apply(5)]);
        assert_eq!(c.next_seq(), Some(6));
        let s = c.stats();
        assert_eq!((s.gaps, s.replays_ok, s.stale, s.clears), (1, 1, 1, 0));
    }

    #[test]
    fn a_gap_beyond_the_ring_clears_the_rank() {
        let mut c = StreamCursor::new(16, |p| *p);
        live(&mut c, 0);
        live(&mut c, 50);
        // The ring starts at 40: 1..40 are gone.
        assert_eq!(
            replayed(&mut c, 40),
            [Action::Clear(ClearReason::UnrecoverableGap), apply(40)]
        );
        for seq in 41..=50 {
            replayed(&mut c, seq);
        }
        assert!(finished(&mut c, true).is_empty());
        assert_eq!(c.next_seq(), Some(51));
    }

    #[test]
    fn no_replay_endpoint_means_clear_and_continue() {
        let mut c = StreamCursor::new(16, |p| *p);
        live(&mut c, 0);
        assert_eq!(live(&mut c, 7), [Action::Replay { from: 1 }]);
        assert_eq!(
            finished(&mut c, false),
            [Action::Clear(ClearReason::UnrecoverableGap), apply(7)]
        );
        assert_eq!(c.stats().replays_incomplete, 1);
        assert_eq!(live(&mut c, 8), [apply(8)]);
    }

    #[test]
    fn a_replay_that_ends_early_clears_the_rank() {
        let mut c = StreamCursor::new(16, |p| *p);
        live(&mut c, 0);
        live(&mut c, 5);
        replayed(&mut c, 1);
        replayed(&mut c, 2);
        assert_eq!(
            finished(&mut c, false),
            [Action::Clear(ClearReason::UnrecoverableGap), apply(5)]
        );
    }

    #[test]
    fn seq_going_backwards_is_an_engine_restart() {
        let mut c = StreamCursor::new(16, |p| *p);
        for seq in 0..10 {
            live(&mut c, seq);
        }
        assert_eq!(
            live(&mut c, 0),
            [Action::Clear(ClearReason::EngineRestart), apply(0)]
        );
        assert_eq!(c.stats().restarts, 1);
        // A restart seen late (seq already past 0) replays the new run from 0.
        let mut c = StreamCursor::new(16, |p| *p);
        for seq in 0..10 {
            live(&mut c, seq);
        }
        assert_eq!(
            live(&mut c, 2),
            [
                Action::Clear(ClearReason::EngineRestart),
                Action::Replay { from: 0 }
            ]
        );
    }

    #[test]
    fn an_undecodable_batch_is_replayed_once_then_skipped() {
        let mut c = StreamCursor::new(16, |p| *p);
        live(&mut c, 0);
        assert_eq!(live(&mut c, 1), [apply(1)]);
        let mut out = Vec::new();
        c.undecodable(1, &mut out);
        assert_eq!(out, [Action::Replay { from: 1 }]);
        assert_eq!(replayed(&mut c, 1), [apply(1)]);
        let mut out = Vec::new();
        c.undecodable(1, &mut out);
        assert!(out.is_empty(), "skipped the second time");
        assert!(finished(&mut c, true).is_empty());
        assert_eq!(live(&mut c, 2), [apply(2)]);
        assert_eq!(c.stats().undecodable_skipped, 1);
    }

    #[test]
    fn live_copies_of_replayed_batches_are_duplicates_not_a_restart() {
        let mut c = StreamCursor::new(16, |p| *p);
        live(&mut c, 0);
        live(&mut c, 3);
        for seq in 1..=6 {
            replayed(&mut c, seq);
        }
        finished(&mut c, true);
        // 4..6 were published while the replay ran; their live copies arrive now.
        for seq in 4..=6 {
            assert!(live(&mut c, seq).is_empty());
        }
        assert_eq!(c.stats().restarts, 0);
        assert_eq!(live(&mut c, 7), [apply(7)]);
        // After live caught up, going backwards is a restart again.
        assert_eq!(
            live(&mut c, 0),
            [Action::Clear(ClearReason::EngineRestart), apply(0)]
        );
    }

    #[test]
    fn a_resync_on_connect_fetches_what_was_published_before_the_subscription() {
        let mut c = StreamCursor::new(16, |p| *p);
        let mut out = Vec::new();
        c.resync(&mut out);
        assert_eq!(out, [Action::Replay { from: 0 }]);
        assert_eq!(replayed(&mut c, 0), [apply(0)]);
        assert!(finished(&mut c, true).is_empty());
        assert_eq!(live(&mut c, 1), [apply(1)]);
        // On a reconnect it starts from the next expected batch.
        let mut out = Vec::new();
        c.resync(&mut out);
        assert_eq!(out, [Action::Replay { from: 2 }]);
        assert_eq!(c.stats().gaps, 0);
        assert_eq!(c.stats().resyncs, 2);
    }

    #[test]
    fn a_restart_right_after_a_replay_is_not_mistaken_for_a_duplicate() {
        let mut c: StreamCursor<(u64, u64)> = StreamCursor::new(16, |p| p.1);
        let mut out = Vec::new();
        c.resync(&mut out);
        for seq in 0..5 {
            c.replayed(seq, (seq, 100 + seq), &mut out);
        }
        c.replay_finished(true, &mut out);
        out.clear();
        // The live copy of seq 2 (same bytes) is a duplicate...
        c.live(2, (2, 102), &mut out);
        assert!(out.is_empty());
        // ...but seq 0 with other bytes is the restarted engine's first batch.
        c.live(0, (0, 999), &mut out);
        assert_eq!(
            out,
            [
                Action::Clear(ClearReason::EngineRestart),
                Action::Apply {
                    seq: 0,
                    payload: (0, 999)
                }
            ]
        );
    }

    #[test]
    fn the_buffer_is_bounded_and_its_overflow_is_recovered_later() {
        let mut c = StreamCursor::new(2, |p| *p);
        live(&mut c, 0);
        live(&mut c, 3);
        live(&mut c, 4);
        live(&mut c, 5); // dropped: buffer holds 3, 4
        assert_eq!(c.stats().overflowed, 1);
        replayed(&mut c, 1);
        replayed(&mut c, 2);
        assert_eq!(finished(&mut c, true), [apply(3), apply(4)]);
        assert_eq!(live(&mut c, 6), [Action::Replay { from: 5 }]);
    }
}
