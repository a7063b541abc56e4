//! One (worker, rank) stream as plain data: what its cursor decides, applied
//! to the index, with the rank's state kept up to date.
//!
//! A [`RankStream`] owns no socket. Its ingest thread hands it what arrived
//! (a live batch, a replay reply, a link going up or down, the clock) and
//! sends the replay requests it asks for; everything in between — decoding,
//! the cursor's verdicts, clearing, foreign ranks, the rank's state — is here.

use std::sync::atomic::{AtomicU32, Ordering};
use std::sync::Arc;
use std::time::{SystemTime, UNIX_EPOCH};

use kvroute_core::cursor::{
    Action, ClearReason, History, QuietCheck, QuietClock, ReplayEnd, StreamCursor,
};
use kvroute_core::event::KvEvent;
use kvroute_core::index::{DpRank, SharedIndex, WorkerRank};
use kvroute_core::wire::{DecodedBatch, DecoderConfig, SkipReason, StreamDecoder};
use tracing::{debug, info, warn};

use super::spec::RankEndpoints;
use super::stats::{RankState, RankStats, ResumePoint};

/// Live batches kept while a replay runs (beyond: dropped, and replayed later).
const MAX_BUFFERED: usize = 10_000;

/// Exact predictions in a row after which a degraded rank is trusted again.
pub const EXACT_STREAK_TO_RECOVER: u32 = 20;

/// Timings of the stream's checks.
#[derive(Debug, Clone, Copy)]
pub struct Timing {
    /// How long a replay may go without a reply before it is given up.
    pub replay_timeout_ms: u64,
    /// How often a quiet stream proves its continuity.
    pub verify_ms: u64,
    /// How long after a burst's last live batch the stream is checked once
    /// for a lost tail (0: never).
    pub early_verify_ms: u64,
    /// How long live batches may wait for a link that stays down.
    pub suspend_timeout_ms: u64,
}

impl Default for Timing {
    fn default() -> Self {
        Timing {
            replay_timeout_ms: 2_000,
            verify_ms: 5_000,
            early_verify_ms: 500,
            suspend_timeout_ms: 10_000,
        }
    }
}

/// What identifies a rank's stream and where its events go.
#[derive(Debug, Clone)]
pub struct RankTarget {
    /// The worker's name (for logs).
    pub worker: String,
    /// The worker's index id and the rank.
    pub key: WorkerRank,
    /// The rank's sockets.
    pub endpoints: RankEndpoints,
    /// ZMQ topic to subscribe to.
    pub topic: String,
    /// The worker's block size, shared by its ranks: 0 until learned from
    /// the first stored event when the spec gave none.
    pub block_size: Arc<AtomicU32>,
    /// How many DP ranks the worker has: batches for a rank at or beyond it
    /// are foreign (shared by the worker's ranks, grows as ranks are added).
    pub dp_size: Arc<AtomicU32>,
    /// Counters and state shared with `/workers` and routing.
    pub stats: Arc<RankStats>,
}

/// One rank's stream.
#[derive(Debug)]
pub struct RankStream {
    target: RankTarget,
    index: Arc<SharedIndex>,
    decoder: StreamDecoder,
    cursor: StreamCursor<Vec<u8>>,
    timing: Timing,
    connected: bool,
    error: Option<String>,
    /// Events declared another block size than the worker's: they are
    /// skipped (never hashed at the wrong size) and the rank is in error.
    conflict: Option<String>,
    /// When a quiet stream's continuity is checked next.
    quiet: QuietClock,
    /// The quiet-stream check whose replay is out, and the last seq applied
    /// when it was asked (a later one when it ends: it repaired a loss).
    check: Option<(QuietCheck, Option<u64>)>,
    /// When the outstanding replay was asked for, or last answered (ms).
    replay_active_ms: Option<u64>,
    /// When live batches started waiting for the link (ms).
    suspended_ms: Option<u64>,
    requests: Vec<u64>,
    /// Replay requests whose end marker will not come: the engine dropped
    /// the tail of its answer (see [`RankStream::take_lost_ends`]).
    lost_ends: u32,
    /// The first state was published (it is not logged as a change).
    announced: bool,
}

/// A shared block size, when known (0: not yet).
fn known(block_size: &AtomicU32) -> Option<u32> {
    Some(block_size.load(Ordering::Relaxed)).filter(|&b| b > 0)
}

/// Milliseconds since the epoch.
pub fn now_ms() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| d.as_millis() as u64)
}

/// A batch's identity for the cursor: XXH3 of its bytes (a verify reply
/// is hashed for every quiet rank every few seconds, so the hash is the
/// fastest one at hand; it need not resist an adversary, only tell two
/// engines' batches apart).
#[expect(
    clippy::ptr_arg,
    reason = "the cursor takes `fn(&T)`, and `T` is `Vec<u8>`"
)]
fn fingerprint(payload: &Vec<u8>) -> u64 {
    xxhash_rust::xxh3::xxh3_64(payload)
}

impl RankStream {
    /// A stream that has seen nothing and is not connected yet.
    pub fn new(target: RankTarget, index: Arc<SharedIndex>, timing: Timing) -> Self {
        Self::resumed(target, index, timing, None)
    }

    /// A stream whose state up to `from` is already in the index (restored
    /// from a snapshot): its first resync proves the engine is the same.
    pub fn resumed(
        target: RankTarget,
        index: Arc<SharedIndex>,
        timing: Timing,
        from: Option<ResumePoint>,
    ) -> Self {
        let decoder = StreamDecoder::new(DecoderConfig {
            block_size: known(&target.block_size),
            registered_rank: target.key.rank.0,
            ..DecoderConfig::default()
        });
        let mut stream = RankStream {
            target,
            index,
            decoder,
            cursor: StreamCursor::new(MAX_BUFFERED, fingerprint),
            timing,
            connected: false,
            error: None,
            conflict: None,
            quiet: QuietClock::new(timing.early_verify_ms, timing.verify_ms, now_ms()),
            check: None,
            replay_active_ms: None,
            suspended_ms: None,
            requests: Vec::new(),
            lost_ends: 0,
            announced: false,
        };
        if let Some(at) = from {
            stream.cursor.resume(at.seq, at.fingerprint, at.exact);
        }
        stream.publish();
        stream
    }

    /// Which stream this is.
    pub fn target(&self) -> &RankTarget {
        &self.target
    }

    /// Whether the engine has a replay ring this stream can verify against.
    pub fn has_replay(&self) -> bool {
        self.target.endpoints.replay.is_some()
    }

    /// Replay requests (from seq) to send now.
    pub fn take_requests(&mut self) -> Vec<u64> {
        std::mem::take(&mut self.requests)
    }

    /// Replay requests given up since the last call whose end marker will
    /// never come, so the shell stops waiting for it: a replay whose replies
    /// stopped before its end marker, after some came, is asked again at
    /// once (the engine sends its whole answer in one go and dropped the
    /// rest, end marker included: vLLM's replay socket keeps at most 1,000
    /// messages queued for a slow reader). The next request's replies are
    /// then its own, not an older request's.
    /// Any replay that timed out counts here: its end marker is presumed
    /// lost, so later replays do not wait for it (the shell still guards
    /// against it arriving late, see `EndLedger`).
    pub fn take_lost_ends(&mut self) -> u32 {
        std::mem::take(&mut self.lost_ends)
    }

    /// True while a replay request is out and unanswered.
    pub fn is_replaying(&self) -> bool {
        self.cursor.is_replaying()
    }

    /// True while a replay request is out and a reply other than its end
    /// marker has arrived.
    pub fn replay_answered(&self) -> bool {
        self.cursor.replay_answered()
    }

    /// A batch from the live subscription.
    pub fn live(&mut self, seq: u64, payload: Vec<u8>) {
        self.target.stats.batches.fetch_add(1, Ordering::Relaxed);
        self.quiet.live(now_ms());
        let mut out = Vec::new();
        self.cursor.live(seq, payload, &mut out);
        if self.cursor.is_suspended() && self.suspended_ms.is_none() && self.cursor.buffered() > 0 {
            self.suspended_ms = Some(now_ms());
        }
        self.run(out);
    }

    /// A reply to the outstanding replay.
    pub fn replayed(&mut self, seq: u64, payload: Vec<u8>) {
        if self.replay_active_ms.is_some() {
            self.replay_active_ms = Some(now_ms());
        }
        let mut out = Vec::new();
        self.cursor.replayed(seq, payload, &mut out);
        self.run(out);
    }

    /// The outstanding replay ended.
    pub fn replay_end(&mut self, end: ReplayEnd) {
        self.replay_active_ms = None;
        self.suspended_ms = None;
        if end != ReplayEnd::Complete {
            let from = self.cursor.last_seq();
            warn!(worker = %self.target.worker, rank = %self.target.key.rank, ?from, ?end, "replay ended without its end marker");
        }
        let mut out = Vec::new();
        self.cursor.replay_finished(end, &mut out);
        self.quiet.replay_ended(now_ms());
        self.count_repair();
        self.run(out);
    }

    /// A quiet-stream check's replay ended: counted as a repair when it
    /// brought batches the stream had lost.
    fn count_repair(&mut self) {
        let Some((check, before)) = self.check.take() else {
            return;
        };
        let after = self.cursor.last_seq();
        if after.is_none() || after <= before {
            return;
        }
        let stats = &self.target.stats;
        let counter = match check {
            QuietCheck::Early => &stats.early_repairs,
            QuietCheck::Periodic => &stats.periodic_repairs,
        };
        counter.fetch_add(1, Ordering::Relaxed);
        info!(worker = %self.target.worker, rank = %self.target.key.rank, check = check.as_str(), ?before, ?after, "a quiet-stream check found lost batches");
    }

    /// The link to the engine is up (again): prove what was applied still
    /// holds, or start over when nothing can prove it.
    pub fn link_up(&mut self) {
        self.set_connected(true);
        let mut out = Vec::new();
        if self.has_replay() {
            self.cursor.resync(&mut out);
        } else {
            self.cursor.reconnected_unverifiable(&mut out);
        }
        self.run(out);
    }

    /// The link to the engine went down.
    pub fn link_down(&mut self) {
        self.set_connected(false);
        if self.has_replay() {
            if self.cursor.is_replaying() {
                // Its replies cannot come any more.
                self.replay_end(ReplayEnd::Unavailable);
            }
            self.cursor.suspend();
        } else {
            self.cursor.distrust();
        }
        self.publish();
    }

    fn set_connected(&mut self, connected: bool) {
        if self.connected != connected {
            self.connected = connected;
            let stats = &self.target.stats;
            stats.connected.store(connected, Ordering::Relaxed);
            stats.last_connected_ms.store(now_ms(), Ordering::Relaxed);
        }
    }

    /// The stream cannot be followed (its sockets failed): shown until cleared.
    pub fn set_error(&mut self, reason: Option<String>) {
        self.error = reason;
        self.publish();
    }

    /// Timeouts, periodic continuity checks and recovery from a degraded
    /// history; returns true when a replay request was queued.
    pub fn tick(&mut self, now: u64) -> bool {
        if let Some(since) = self.replay_active_ms {
            if now.saturating_sub(since) >= self.timing.replay_timeout_ms {
                self.replay_end(ReplayEnd::TimedOut);
                // The replay is over, whether or not it was asked again:
                // its end marker is presumed lost.
                self.lost_ends += 1;
            }
        } else if let Some(since) = self.suspended_ms {
            if now.saturating_sub(since) >= self.timing.suspend_timeout_ms {
                self.replay_end(ReplayEnd::TimedOut);
            }
        }
        if self.degraded()
            && self.target.stats.exact_streak.load(Ordering::Relaxed) >= EXACT_STREAK_TO_RECOVER
        {
            info!(worker = %self.target.worker, rank = %self.target.key.rank, "predictions match the engine again; history trusted");
            self.cursor.history_reset();
            self.publish();
        }
        self.quiet_check(now);
        !self.requests.is_empty()
    }

    /// Asks the replay ring for what follows the last batch applied when
    /// the quiet clock says so and nothing else is out.
    fn quiet_check(&mut self, now: u64) {
        let Some(check) = self.quiet.due(now) else {
            return;
        };
        if !self.connected || !self.has_replay() {
            // Nothing to ask; a reconnect resyncs anyway.
            self.quiet.disarm();
            return;
        }
        if !self.requests.is_empty() || self.cursor.is_replaying() || self.cursor.is_suspended() {
            // A replay is out: its end pushes the early check back.
            return;
        }
        self.quiet.started(check, now);
        let before = self.cursor.last_seq();
        let mut out = Vec::new();
        self.cursor.verify(&mut out);
        if out.is_empty() {
            return;
        }
        if check == QuietCheck::Early {
            self.target
                .stats
                .early_verifies
                .fetch_add(1, Ordering::Relaxed);
        }
        debug!(worker = %self.target.worker, rank = %self.target.key.rank, check = check.as_str(), ?before, "quiet-stream check");
        self.check = Some((check, before));
        self.run(out);
    }

    fn degraded(&self) -> bool {
        self.cursor.history() != History::Exact
    }

    fn run(&mut self, out: Vec<Action<Vec<u8>>>) {
        for action in out {
            match action {
                Action::Apply { seq, payload } => self.apply(seq, &payload),
                Action::Clear(reason) => self.clear(reason),
                Action::Replay { from } => {
                    debug!(worker = %self.target.worker, rank = %self.target.key.rank, from, "requesting replay");
                    self.requests.push(from);
                    self.replay_active_ms = Some(now_ms());
                }
            }
        }
        self.publish();
    }

    fn clear(&mut self, reason: ClearReason) {
        warn!(worker = %self.target.worker, rank = %self.target.key.rank, reason = reason.as_str(), "clearing the rank's blocks");
        self.index.clear_rank(self.target.key);
        self.decoder.reset();
        self.conflict = None;
        self.target.stats.exact_streak.store(0, Ordering::Relaxed);
    }

    /// Takes up the worker's block size once another rank learned it, or
    /// learns it from this batch's first stored event.
    fn settle_block_size(&mut self, batch: &DecodedBatch) {
        if self.decoder.block_size().is_some() {
            return;
        }
        let shared = &self.target.block_size;
        let learned = match known(shared) {
            Some(size) => size,
            None => {
                let Some(size) = batch.decoded().find_map(|e| match e {
                    KvEvent::Stored(s) => Some(s.block_size),
                    _ => None,
                }) else {
                    return;
                };
                match shared.compare_exchange(0, size, Ordering::Relaxed, Ordering::Relaxed) {
                    Ok(_) => {
                        info!(worker = %self.target.worker, rank = %self.target.key.rank, block_size = size, "block size learned from the stream");
                        size
                    }
                    Err(other) => other,
                }
            }
        };
        self.decoder.set_block_size(Some(learned));
    }

    /// Events at another block size than the worker's: logged once, shown
    /// as the rank's error.
    fn block_size_conflict(&mut self, seq: u64, detail: String) {
        if self.conflict.is_none() {
            warn!(worker = %self.target.worker, rank = %self.target.key.rank, seq, %detail, "block size conflict: such events are skipped");
            self.conflict = Some(format!("block size conflict: {detail}"));
        }
    }

    fn apply(&mut self, seq: u64, payload: &[u8]) {
        self.quiet.applied(now_ms());
        let stats = self.target.stats.clone();
        if self.decoder.block_size().is_none() {
            self.decoder.set_block_size(known(&self.target.block_size));
        }
        let batch = match self.decoder.decode(payload) {
            Ok(batch) => batch,
            Err(e) => {
                stats.envelope_errors.fetch_add(1, Ordering::Relaxed);
                warn!(worker = %self.target.worker, rank = %self.target.key.rank, seq, error = %e, "undecodable batch");
                self.cursor.undecodable(seq);
                return;
            }
        };
        if batch.dp_rank >= self.target.dp_size.load(Ordering::Relaxed) {
            if stats.foreign_rank_batches.fetch_add(1, Ordering::Relaxed) == 0 {
                warn!(worker = %self.target.worker, rank = %self.target.key.rank, seq, batch_rank = batch.dp_rank, "batch for a DP rank the worker does not have; dropped");
            }
            return;
        }
        if let Some(ts) = batch.ts {
            let lag = (now_ms() as f64 - ts * 1000.0).max(0.0);
            stats.lag_ms.store(lag as u64, Ordering::Relaxed);
        }
        let key = WorkerRank {
            worker: self.target.key.worker,
            rank: DpRank(batch.dp_rank),
        };
        self.settle_block_size(&batch);
        let expected = self.decoder.block_size();
        let mut applied = 0;
        for event in &batch.events {
            match &event.outcome {
                // Decoded before the size was learned, at another size.
                Ok(KvEvent::Stored(s)) if expected.is_some_and(|b| b != s.block_size) => {
                    stats.events_filtered.fetch_add(1, Ordering::Relaxed);
                    let detail = format!(
                        "event block_size {}, worker's {}",
                        s.block_size,
                        expected.unwrap_or(0)
                    );
                    self.block_size_conflict(seq, detail);
                }
                Ok(e) => {
                    if matches!(e, KvEvent::Cleared) && key == self.target.key {
                        // The engine's own reset: from here on we know all of it.
                        self.cursor.history_reset();
                    }
                    self.index.apply(key, e);
                    applied += 1;
                }
                Err(skipped) if skipped.reason.is_error() => {
                    stats.decode_errors.fetch_add(1, Ordering::Relaxed);
                    warn!(worker = %self.target.worker, rank = %self.target.key.rank, seq, event = event.index, error = %skipped, "malformed event skipped");
                }
                Err(skipped) => {
                    stats.events_filtered.fetch_add(1, Ordering::Relaxed);
                    if skipped.reason == SkipReason::BlockSizeMismatch {
                        self.block_size_conflict(seq, skipped.detail.clone());
                    }
                    debug!(worker = %self.target.worker, rank = %self.target.key.rank, seq, event = event.index, reason = %skipped, "event filtered");
                }
            }
        }
        stats.events.fetch_add(applied, Ordering::Relaxed);
    }

    /// The state as it follows from the link, the cursor and errors.
    pub fn state(&self) -> (RankState, Option<String>) {
        if let Some(reason) = self.error.as_ref().or(self.conflict.as_ref()) {
            return (RankState::Error, Some(reason.clone()));
        }
        if !self.connected {
            return (RankState::Disconnected, None);
        }
        if self.cursor.is_replaying() || self.cursor.is_suspended() {
            return (RankState::Replaying, None);
        }
        if let History::Incomplete(loss) = self.cursor.history() {
            return (RankState::Degraded, Some(loss.to_string()));
        }
        if !self.has_replay() {
            let why = "no replay endpoint: cleared on every reconnect";
            return (RankState::Unverified, Some(why.to_owned()));
        }
        (RankState::Live, None)
    }

    /// Publishes counters and state; logs a state change once.
    fn publish(&mut self) {
        let stats = &self.target.stats;
        let exact = self.cursor.history() == History::Exact;
        let at = self.cursor.anchor().map(|(seq, fingerprint)| ResumePoint {
            seq,
            fingerprint,
            exact,
        });
        stats.set_cursor(self.cursor.stats(), self.cursor.next_seq(), at);
        stats
            .in_doubt
            .store(self.cursor.in_doubt(), Ordering::Relaxed);
        let (state, reason) = self.state();
        let old = stats.state();
        if stats.set_state(state, reason.clone()) {
            stats.exact_streak.store(0, Ordering::Relaxed);
            if !std::mem::replace(&mut self.announced, true) {
                return;
            }
            let (worker, rank) = (&self.target.worker, self.target.key.rank);
            match state {
                RankState::Error | RankState::Degraded => {
                    warn!(%worker, %rank, from = old.as_str(), to = state.as_str(), reason = reason.as_deref().unwrap_or(""), "rank state changed")
                }
                _ => {
                    info!(%worker, %rank, from = old.as_str(), to = state.as_str(), "rank state changed")
                }
            }
        }
    }
}

#[cfg(test)]
mod tests;
