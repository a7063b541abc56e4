//! The sequence cursor of one (worker, rank) event stream: which batches to
//! apply, when to ask the engine's replay ring, and whether the rank's
//! history is still exact.
//!
//! Engines number batches per publisher from 0 (`seq`, 8 bytes big-endian on
//! the wire) and keep the last N (10,000 by default) in a replay ring that
//! answers "every batch from `seq` on, then an end marker". An engine that
//! restarts starts again from 0 with an empty cache, on the same ports, so a
//! router that was away cannot tell from sequence numbers alone whether the
//! batches it now sees continue the stream it applied. The cursor therefore
//! proves continuity instead of assuming it: every replay it asks for starts
//! at the **last batch it applied** (the anchor), and the first reply decides.
//!
//! | first reply | meaning | what follows |
//! | --- | --- | --- |
//! | the anchor's seq, same bytes | same engine, stream continuous | apply what follows |
//! | the anchor's seq, other bytes | the engine restarted | clear the rank, replay from 0 |
//! | only the end marker | the engine restarted (it never published that far) | clear, replay from 0 |
//! | a later seq | the ring no longer reaches back | apply; history incomplete |
//!
//! The shell asks for such a replay after every reconnect ([`StreamCursor::resync`]),
//! on a quiet stream ([`StreamCursor::verify`]: once soon after a burst's
//! last batch, whose loss no later batch reveals, then every few seconds;
//! [`quiet::QuietClock`] decides when), and the
//! cursor asks for one itself when a live batch skips ahead (a gap) or when
//! the first batch it ever sees is not seq 0 (a late join). While the link
//! to the engine is down ([`StreamCursor::suspend`]) live batches wait, so a
//! restarted engine's batch can never become the anchor.
//!
//! From the moment the link drops (or a rank is resumed from a snapshot)
//! until a replay has ended or the rank was cleared, the rank's blocks are
//! **in doubt** ([`StreamCursor::in_doubt`]): they may be a dead engine's,
//! whose restarted successor on the same ports holds nothing. They stay in
//! the index (a blip of the link loses no cache), but routing must not
//! count on them, or its first request to a restarted engine is predicted
//! as a hit the engine no longer has.
//!
//! | live batch | meaning | actions |
//! | --- | --- | --- |
//! | `seq == last + 1` | contiguous | apply |
//! | `seq > last + 1` | batches were lost | buffer it, replay from `last` |
//! | `seq ≤ last`, bytes as applied (or replayed) | a duplicate | drop |
//! | `seq ≤ last`, other bytes | the engine restarted | clear the rank, start over |
//! | first batch, `seq > 0` | we joined late | buffer it, replay from 0 |
//!
//! While a replay runs, live batches are buffered (bounded: past the bound
//! they are dropped, and the gap they leave is found and replayed later).
//! A replay whose replies stop before the end marker, after bringing some
//! batches, is asked again from the last one applied: a ring that sends
//! faster than its reader reads may drop its tail. Any replay that times out
//! is over, its end marker taken as lost; [`ends::EndLedger`] keeps the
//! shell from waiting for it, or taking it, late, for a later replay's. When history cannot be
//! completed (the ring is too short, a replay failed while a gap was open,
//! a batch could not be decoded), the cursor says so in
//! [`StreamCursor::history`] and keeps going: the rank is *degraded*, and the
//! shell decides how to recover. A clear (an engine restart, or the engine's
//! own `AllBlocksCleared`) makes history exact again.
//!
//! Sequence numbers above [`MAX_SEQ`] cannot come from an engine counting
//! from 0 (and `u64::MAX` is the replay's end marker): such a batch is
//! counted as `invalid_seq` and dropped, so `seq + 1` never overflows.

use std::collections::VecDeque;

pub mod ends;
pub mod quiet;

pub use ends::EndLedger;
pub use quiet::{QuietCheck, QuietClock};

/// Why a rank's blocks were dropped.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ClearReason {
    /// The engine restarted: its cache is empty and its seq began again.
    EngineRestart,
    /// The stream reconnected and has no replay ring to prove that nothing
    /// changed meanwhile.
    Unverifiable,
}

impl ClearReason {
    /// Stable name for metrics and logs.
    pub fn as_str(self) -> &'static str {
        match self {
            ClearReason::EngineRestart => "engine_restart",
            ClearReason::Unverifiable => "unverifiable_reconnect",
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
    /// Ask the replay socket for every batch from `from` on, feed each reply
    /// to [`StreamCursor::replayed`], then call [`StreamCursor::replay_finished`].
    Replay {
        /// First sequence number wanted.
        from: u64,
    },
    /// Drop everything the index holds for this rank.
    Clear(ClearReason),
}

/// How a replay ended.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ReplayEnd {
    /// The end marker arrived.
    Complete,
    /// No reply came in time, or the link never came back.
    TimedOut,
    /// The rank has no replay endpoint.
    Unavailable,
}

/// Why a rank's history is no longer known to be exact.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Loss {
    /// The replay ring started at `first`, after the wanted `wanted`.
    RingTooShort {
        /// The first seq asked for.
        wanted: u64,
        /// The first seq the ring still held.
        first: u64,
    },
    /// Batches `from..to` were lost and no replay could bring them back.
    Gap {
        /// The first lost seq.
        from: u64,
        /// The seq applied after the hole.
        to: u64,
    },
    /// Batch `seq` could not be decoded.
    Undecodable {
        /// Its seq.
        seq: u64,
    },
    /// The state was restored from a snapshot taken while history was
    /// already incomplete.
    Restored,
}

impl std::fmt::Display for Loss {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Loss::RingTooShort { wanted, first } => write!(
                f,
                "the replay ring starts at seq {first}; batches from {wanted} are gone"
            ),
            Loss::Gap { from, to } => write!(f, "batches {from}..{to} were lost"),
            Loss::Undecodable { seq } => write!(f, "batch {seq} could not be decoded"),
            Loss::Restored => write!(f, "restored from a snapshot whose history was incomplete"),
        }
    }
}

/// Whether everything the rank's engine published since the last clear was applied.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum History {
    /// Every batch since the last clear (or since the stream began) was applied.
    Exact,
    /// Some were not; the first loss since the last clear.
    Incomplete(Loss),
}

/// Counts kept by a cursor, for `/workers` and metrics.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct CursorStats {
    /// Batches handed out for applying.
    pub applied: u64,
    /// Batches dropped as copies of already applied ones.
    pub stale: u64,
    /// Gaps detected (including a late join).
    pub gaps: u64,
    /// Replays that brought back everything they were asked for.
    pub replays_ok: u64,
    /// Replays that could not (the ring no longer reached back, or a gap
    /// stayed open when the replay failed).
    pub replays_incomplete: u64,
    /// Replays that got no end marker in time.
    pub replay_timeouts: u64,
    /// Engine restarts seen.
    pub restarts: u64,
    /// Times the rank was cleared.
    pub clears: u64,
    /// Live batches dropped because the replay buffer was full.
    pub overflowed: u64,
    /// Batches skipped because they could not be decoded.
    pub undecodable_skipped: u64,
    /// Replays asked for on (re)connection.
    pub resyncs: u64,
    /// Replays whose first reply proved the stream continuous.
    pub verifies: u64,
    /// Batches dropped because their sequence number was above [`MAX_SEQ`].
    pub invalid_seq: u64,
}

/// The largest sequence number a batch may carry (engines number batches
/// from 0 in a signed 64-bit integer).
pub const MAX_SEQ: u64 = i64::MAX as u64;

/// The last applied batch: its seq and a fingerprint of its bytes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct Anchor {
    seq: u64,
    fingerprint: u64,
}

/// An outstanding replay request.
#[derive(Debug, Clone, Copy)]
struct Replay {
    from: u64,
    /// The batch the first reply must repeat, if anything was applied.
    anchor: Option<Anchor>,
    /// A reply (other than the end marker) has arrived.
    answered: bool,
    /// The first reply showed a restarted engine: ignore the rest, then replay from 0.
    restart: bool,
    /// Replies skipped a seq (the engine dropped some): ask again afterwards.
    hole: bool,
    /// The ring did not reach back to what was wanted.
    short: bool,
    /// The request went out (false while the link is down).
    sent: bool,
}

/// The cursor of one stream; `T` is the payload type the shell carries.
#[derive(Debug, Clone)]
pub struct StreamCursor<T> {
    last: Option<Anchor>,
    replay: Option<Replay>,
    buffer: VecDeque<(u64, T)>,
    max_buffered: usize,
    /// What is known of batches at or below the last applied besides the
    /// anchor: live copies of replayed ones are duplicates, skipped ones are
    /// old news, and a known seq with other bytes means a restart.
    seen: Seen,
    history: History,
    fingerprint: fn(&T) -> u64,
    stats: CursorStats,
    /// The applied blocks may be a previous engine's (see [`StreamCursor::in_doubt`]).
    doubt: bool,
}

/// Replayed batches remembered for duplicate detection, at most.
const MAX_REPLAYED: usize = 16_384;

/// Skipped ranges remembered, at most.
const MAX_SKIPPED: usize = 32;

/// Fingerprints of the latest contiguous run of replayed batches, and the
/// latest ranges of seqs the cursor went past without applying.
#[derive(Debug, Clone, Default)]
struct Seen {
    /// The seq of `fingerprints[0]`.
    base: u64,
    fingerprints: VecDeque<u64>,
    /// `[from, to)` ranges.
    skipped: VecDeque<(u64, u64)>,
}

impl Seen {
    /// A replayed batch was applied; a jump starts a new run (live copies of
    /// the older run were all received before the jump: one connection is FIFO).
    fn record(&mut self, seq: u64, fingerprint: u64) {
        let end = self.base + self.fingerprints.len() as u64;
        if self.fingerprints.is_empty() || seq != end {
            self.fingerprints.clear();
            self.base = seq;
        }
        if self.fingerprints.len() == MAX_REPLAYED {
            self.fingerprints.pop_front();
            self.base += 1;
        }
        self.fingerprints.push_back(fingerprint);
    }

    fn replayed(&self, seq: u64, fingerprint: u64) -> bool {
        seq.checked_sub(self.base)
            .and_then(|i| usize::try_from(i).ok())
            .and_then(|i| self.fingerprints.get(i))
            == Some(&fingerprint)
    }

    fn skip(&mut self, from: u64, to: u64) {
        if from < to {
            if self.skipped.len() == MAX_SKIPPED {
                self.skipped.pop_front();
            }
            self.skipped.push_back((from, to));
        }
    }

    fn skipped(&self, seq: u64) -> bool {
        self.skipped
            .iter()
            .any(|&(from, to)| (from..to).contains(&seq))
    }

    /// Live delivered the next batch: no older live copy can follow.
    fn live_caught_up(&mut self) {
        self.fingerprints.clear();
    }
}

impl<T> StreamCursor<T> {
    /// A cursor that has seen nothing, buffering at most `max_buffered` live
    /// batches while a replay runs. `fingerprint` identifies a payload's
    /// bytes (a hash), to tell a duplicate from a restarted engine's batch.
    pub fn new(max_buffered: usize, fingerprint: fn(&T) -> u64) -> Self {
        StreamCursor {
            last: None,
            replay: None,
            buffer: VecDeque::new(),
            max_buffered: max_buffered.max(1),
            seen: Seen::default(),
            history: History::Exact,
            fingerprint,
            stats: CursorStats::default(),
            doubt: false,
        }
    }

    /// True from the link's drop (or a resume from a snapshot) until a
    /// replay has ended or the rank was cleared: until then nothing proves
    /// the engine behind the applied blocks is the one now on its ports.
    pub fn in_doubt(&self) -> bool {
        self.doubt
    }

    /// The link dropped on a stream with no replay ring: the blocks are in
    /// doubt until [`StreamCursor::reconnected_unverifiable`] starts over.
    pub fn distrust(&mut self) {
        self.doubt = true;
    }

    /// The next expected sequence number, once anything was applied.
    pub fn next_seq(&self) -> Option<u64> {
        self.last.map(|a| a.seq + 1)
    }

    /// The last applied sequence number.
    pub fn last_seq(&self) -> Option<u64> {
        self.last.map(|a| a.seq)
    }

    /// True while a replay request is out.
    pub fn is_replaying(&self) -> bool {
        self.replay.is_some_and(|r| r.sent)
    }

    /// True while a replay request is out and a reply (other than its end
    /// marker) has arrived.
    pub fn replay_answered(&self) -> bool {
        self.replay.is_some_and(|r| r.sent && r.answered)
    }

    /// True while live batches wait for the link to come back.
    pub fn is_suspended(&self) -> bool {
        self.replay.is_some_and(|r| !r.sent)
    }

    /// Live batches waiting for a replay or a resync.
    pub fn buffered(&self) -> usize {
        self.buffer.len()
    }

    /// Whether the rank's history since the last clear is complete.
    pub fn history(&self) -> History {
        self.history
    }

    /// Counts so far.
    pub fn stats(&self) -> CursorStats {
        self.stats
    }

    fn lose(&mut self, loss: Loss) {
        if self.history == History::Exact {
            self.history = History::Incomplete(loss);
        }
    }

    /// The last applied batch, as (seq, fingerprint): what a snapshot of the
    /// rank's state must record to be resumed later.
    pub fn anchor(&self) -> Option<(u64, u64)> {
        self.last.map(|a| (a.seq, a.fingerprint))
    }

    /// Resumes a stream whose state was restored from a snapshot: batch
    /// `seq` with `fingerprint` was the last applied, and `exact` says
    /// whether history was complete then. Nothing is trusted yet: the first
    /// resync asks for that batch, which proves the engine is the same one
    /// (and replays what followed) or shows it restarted (and clears).
    pub fn resume(&mut self, seq: u64, fingerprint: u64, exact: bool) {
        self.last = Some(Anchor { seq, fingerprint });
        self.doubt = true;
        self.history = if exact {
            History::Exact
        } else {
            History::Incomplete(Loss::Restored)
        };
    }

    /// The rank's state is exact again from here on: the engine cleared its
    /// cache (`AllBlocksCleared`), or the shell has other evidence.
    pub fn history_reset(&mut self) {
        self.history = History::Exact;
    }

    fn apply(&mut self, seq: u64, payload: T, out: &mut Vec<Action<T>>) {
        self.last = Some(Anchor {
            seq,
            fingerprint: (self.fingerprint)(&payload),
        });
        self.stats.applied += 1;
        out.push(Action::Apply { seq, payload });
    }

    fn restart(&mut self, out: &mut Vec<Action<T>>) {
        self.stats.restarts += 1;
        self.clear(ClearReason::EngineRestart, out);
    }

    fn clear(&mut self, reason: ClearReason, out: &mut Vec<Action<T>>) {
        self.stats.clears += 1;
        self.doubt = false;
        self.last = None;
        self.seen = Seen::default();
        self.history = History::Exact;
        out.push(Action::Clear(reason));
    }

    /// A replay from the anchor on (from 0 when nothing was applied).
    fn new_replay(&self, sent: bool) -> Replay {
        Replay {
            from: self.last.map_or(0, |a| a.seq),
            anchor: self.last,
            answered: false,
            restart: false,
            hole: false,
            short: false,
            sent,
        }
    }

    /// Asks for every batch from the anchor on.
    fn start_replay(&mut self, out: &mut Vec<Action<T>>) {
        let replay = self.new_replay(true);
        out.push(Action::Replay { from: replay.from });
        self.replay = Some(replay);
    }

    fn buffer_back(&mut self, seq: u64, payload: T) {
        if self.buffer.len() < self.max_buffered {
            self.buffer.push_back((seq, payload));
        } else {
            self.stats.overflowed += 1;
        }
    }

    /// A batch from the live subscription.
    pub fn live(&mut self, seq: u64, payload: T, out: &mut Vec<Action<T>>) {
        if seq > MAX_SEQ {
            self.stats.invalid_seq += 1;
            return;
        }
        if self.replay.is_some() {
            self.buffer_back(seq, payload);
            return;
        }
        if let Some((seq, payload)) = self.dispatch(seq, payload, out) {
            self.buffer_back(seq, payload);
        }
    }

    /// Handles one live batch outside a replay; returns it when a replay
    /// started and the batch must wait for it.
    fn dispatch(&mut self, seq: u64, payload: T, out: &mut Vec<Action<T>>) -> Option<(u64, T)> {
        match self.last {
            None if seq == 0 => self.apply(seq, payload, out),
            Some(last) if seq == last.seq + 1 => {
                // Live has caught up: no older live copy can follow (one connection is FIFO).
                self.seen.live_caught_up();
                self.apply(seq, payload, out);
            }
            None => {
                self.stats.gaps += 1;
                self.start_replay(out);
                return Some((seq, payload));
            }
            Some(last) if seq > last.seq => {
                self.stats.gaps += 1;
                self.start_replay(out);
                return Some((seq, payload));
            }
            Some(last) => {
                let fingerprint = (self.fingerprint)(&payload);
                let applied = seq == last.seq && fingerprint == last.fingerprint;
                if applied || self.seen.replayed(seq, fingerprint) || self.seen.skipped(seq) {
                    // A duplicate, or a batch lost earlier that comes too late.
                    self.stats.stale += 1;
                } else {
                    // Same seq, other bytes: the publisher started over, and so did its cache.
                    self.restart(out);
                    return self.dispatch(seq, payload, out);
                }
            }
        }
        None
    }

    /// A batch from the replay socket, in the order received.
    pub fn replayed(&mut self, seq: u64, payload: T, out: &mut Vec<Action<T>>) {
        let Some(mut replay) = self.replay.filter(|r| r.sent) else {
            // A reply nobody is waiting for (the shell should not pass these).
            self.stats.stale += 1;
            return;
        };
        if seq > MAX_SEQ {
            self.stats.invalid_seq += 1;
            return;
        }
        if replay.restart {
            return;
        }
        if !replay.answered {
            if seq < replay.from {
                // Not an answer to this request: a ring never replies below `from`.
                self.stats.stale += 1;
                return;
            }
            replay.answered = true;
            if let Some(anchor) = replay.anchor.filter(|a| a.seq == seq) {
                if (self.fingerprint)(&payload) == anchor.fingerprint {
                    self.stats.verifies += 1;
                } else {
                    replay.restart = true;
                    self.restart(out);
                }
                self.replay = Some(replay);
                return;
            }
            let wanted = replay.anchor.map_or(0, |a| a.seq);
            if seq > wanted {
                replay.short = true;
                let lost_from = replay.anchor.map_or(0, |a| a.seq + 1);
                self.seen.skip(lost_from, seq);
                self.lose(Loss::RingTooShort { wanted, first: seq });
                self.replay = Some(replay);
                self.apply_replayed(seq, payload, out);
                return;
            }
        }
        let next = self.last.map_or(0, |a| a.seq + 1);
        if seq < next {
            self.stats.stale += 1;
        } else if seq == next {
            self.apply_replayed(seq, payload, out);
        } else {
            // The engine dropped replies (its send queue was full): ask again after.
            replay.hole = true;
        }
        self.replay = Some(replay);
    }

    fn apply_replayed(&mut self, seq: u64, payload: T, out: &mut Vec<Action<T>>) {
        self.seen.record(seq, (self.fingerprint)(&payload));
        self.apply(seq, payload, out);
    }

    /// The replay ended (see [`ReplayEnd`]). Applies what was buffered.
    pub fn replay_finished(&mut self, end: ReplayEnd, out: &mut Vec<Action<T>>) {
        let Some(replay) = self.replay.take() else {
            return;
        };
        if replay.restart {
            self.start_replay(out);
            return;
        }
        let complete = end == ReplayEnd::Complete && replay.sent;
        // Whatever the replay showed (continuity, a restart, a short ring),
        // the rank's blocks are what the cursor now knows of this engine.
        self.doubt &= !complete;
        if complete && !replay.answered && replay.anchor.is_some() {
            // The ring holds nothing at or after a batch this engine published:
            // it is not that engine any more.
            self.restart(out);
            self.start_replay(out);
            return;
        }
        if end == ReplayEnd::TimedOut {
            self.stats.replay_timeouts += 1;
            if self.last.map(|a| a.seq) > replay.anchor.map(|a| a.seq) {
                // Replies came, then stopped before the end marker: the
                // engine dropped the rest (vLLM's replay socket queues at
                // most 1,000 messages per reader and drops what a slow
                // reader has not taken, its end marker too). What came is
                // applied; ask for the rest from there.
                self.start_replay(out);
                return;
            }
        }
        let mut jumped = false;
        while let Some((seq, payload)) = self.buffer.pop_front() {
            let next = self.last.map_or(0, |a| a.seq + 1);
            if seq > next && !complete {
                // Nothing more will come: go on after the hole, and say so.
                self.lose(Loss::Gap {
                    from: next,
                    to: seq,
                });
                self.seen.skip(next, seq);
                jumped = true;
                self.apply(seq, payload, out);
                continue;
            }
            if let Some(back) = self.dispatch(seq, payload, out) {
                self.buffer.push_front(back);
                break;
            }
        }
        if replay.hole && complete && self.replay.is_none() {
            self.stats.gaps += 1;
            self.start_replay(out);
        }
        if replay.short || jumped {
            self.stats.replays_incomplete += 1;
        } else if complete && !replay.hole {
            self.stats.replays_ok += 1;
        }
    }

    /// The link to the engine went down: whatever arrives live from now on
    /// may come from a restarted engine, so it waits (buffered) until a
    /// [`StreamCursor::resync`] has proved the stream continuous from the
    /// last batch applied before. Without this, a new engine's first batch
    /// that happens to carry the next seq would be applied, and become the
    /// anchor later checks compare against.
    pub fn suspend(&mut self) {
        self.doubt = true;
        if self.replay.is_none() {
            self.replay = Some(self.new_replay(false));
        }
    }

    /// The subscription (re)connected: batches published while we were away
    /// are only in the ring, and the engine may have restarted. Asks from
    /// the last applied batch (from 0 on a first connect). Not a gap.
    ///
    /// Batches that arrived while the link was down are dropped: they may be
    /// a restarted engine's, and the replay brings the current engine's.
    pub fn resync(&mut self, out: &mut Vec<Action<T>>) {
        if self.is_replaying() {
            return;
        }
        if self.is_suspended() {
            self.stats.stale += self.buffer.len() as u64;
            self.buffer.clear();
        }
        self.stats.resyncs += 1;
        self.start_replay(out);
    }

    /// A quiet stream's periodic check that the engine is still the one
    /// whose batches were applied (the same request as a resync).
    pub fn verify(&mut self, out: &mut Vec<Action<T>>) {
        if self.replay.is_none() {
            self.start_replay(out);
        }
    }

    /// The stream reconnected and has no replay ring: nothing can prove the
    /// engine is the same, so the rank starts over.
    pub fn reconnected_unverifiable(&mut self, out: &mut Vec<Action<T>>) {
        self.replay = None;
        self.doubt = false;
        if self.last.is_some() || self.history != History::Exact {
            self.clear(ClearReason::Unverifiable, out);
        }
    }

    /// The shell could not decode batch `seq` it was told to apply: it is
    /// skipped (its replayed copy would be the same bytes), and history
    /// is no longer exact.
    pub fn undecodable(&mut self, seq: u64) {
        self.stats.undecodable_skipped += 1;
        self.lose(Loss::Undecodable { seq });
    }
}

#[cfg(test)]
mod tests;
