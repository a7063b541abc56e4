//! What one rank's stream shares with the rest of the router: its counters
//! and its state, written by its ingest thread and read by `/workers`,
//! `/metrics` and routing.

use std::sync::atomic::{AtomicBool, AtomicU32, AtomicU64, AtomicU8, Ordering};
use std::sync::{Mutex, PoisonError};

use kvroute_core::cursor::CursorStats;
use serde::{Deserialize, Serialize};

/// Where a rank's stream stood: the last batch applied (its seq and
/// fingerprint) and whether history up to it was complete. A snapshot
/// records it so a restarted router can prove, from the engine's ring, that
/// it can carry on from there.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct ResumePoint {
    /// The last batch applied.
    pub seq: u64,
    /// Its fingerprint.
    pub fingerprint: u64,
    /// History up to it was complete.
    pub exact: bool,
}

/// How far the router can trust what it knows of a rank.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize)]
#[serde(rename_all = "lowercase")]
pub enum RankState {
    /// Connected, and its history is complete: predictions are exact.
    Live,
    /// Catching up from the engine's replay ring.
    Replaying,
    /// No replay endpoint: continuity cannot be checked, so the rank is
    /// cleared on every reconnect.
    Unverified,
    /// Connected, but part of its history is missing (the ring did not reach
    /// back, or batches were lost): predictions may miss blocks.
    Degraded,
    /// The engine cannot be reached.
    Disconnected,
    /// The stream cannot be followed (see its reason).
    Error,
}

impl RankState {
    /// Every state, in the order of its one-byte code.
    pub const ALL: [RankState; 6] = [
        RankState::Live,
        RankState::Replaying,
        RankState::Unverified,
        RankState::Degraded,
        RankState::Disconnected,
        RankState::Error,
    ];

    /// The name `/workers` and the metrics use.
    pub fn as_str(self) -> &'static str {
        match self {
            RankState::Live => "live",
            RankState::Replaying => "replaying",
            RankState::Unverified => "unverified",
            RankState::Degraded => "degraded",
            RankState::Disconnected => "disconnected",
            RankState::Error => "error",
        }
    }

    fn as_u8(self) -> u8 {
        self as u8
    }

    fn from_u8(n: u8) -> RankState {
        RankState::ALL
            .get(usize::from(n))
            .copied()
            .unwrap_or(RankState::Error)
    }
}

/// Live counters and state of one rank's stream.
#[derive(Debug, Default)]
pub struct RankStats {
    /// The engine is reachable (the replay socket, or the event socket when
    /// there is none, is connected).
    pub connected: AtomicBool,
    /// Milliseconds since the epoch when the connection last changed.
    pub last_connected_ms: AtomicU64,
    /// Last applied sequence number + 1 (0: none yet).
    pub next_seq: AtomicU64,
    /// Milliseconds between a batch's timestamp and its application (last batch).
    pub lag_ms: AtomicU64,
    /// Batches received live.
    pub batches: AtomicU64,
    /// Events applied to the index.
    pub events: AtomicU64,
    /// Events skipped as malformed (bad input).
    pub decode_errors: AtomicU64,
    /// Events skipped on purpose (filters, block size).
    pub events_filtered: AtomicU64,
    /// Batches whose envelope could not be decoded.
    pub envelope_errors: AtomicU64,
    /// Messages that were not `[topic, seq, payload]`.
    pub bad_frames: AtomicU64,
    /// Batches for a DP rank the worker does not have, dropped.
    pub foreign_rank_batches: AtomicU64,
    /// Early checks of a quiet stream (once per quiet spell, soon after
    /// its last live batch).
    pub early_verifies: AtomicU64,
    /// Early checks that found batches the stream had lost.
    pub early_repairs: AtomicU64,
    /// Periodic checks of a quiet stream that found batches it had lost.
    pub periodic_repairs: AtomicU64,
    cursor: Mutex<CursorStats>,
    resume: Mutex<Option<ResumePoint>>,
    state: AtomicU8,
    reason: Mutex<Option<String>>,
    /// The rank's blocks may be a dead engine's, whose restarted successor
    /// holds none (the link dropped, or they were restored from a snapshot,
    /// and no replay has proven the stream since): routing does not count
    /// them until it has.
    pub in_doubt: AtomicBool,
    /// Consecutive requests whose prediction matched the engine's report,
    /// while degraded; enough of them make the rank live again.
    pub exact_streak: AtomicU32,
}

/// A snapshot of a rank's counters (see [`RankStats`] for their meaning).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize)]
pub struct RankCounters {
    /// Batches received live.
    pub batches: u64,
    /// Events applied to the index.
    pub events: u64,
    /// Events skipped as malformed.
    pub decode_errors: u64,
    /// Events skipped on purpose.
    pub events_filtered: u64,
    /// Batches whose envelope could not be decoded.
    pub envelope_errors: u64,
    /// Messages that were not `[topic, seq, payload]`.
    pub bad_frames: u64,
    /// Gaps detected (live skipped ahead, or a replay missed batches).
    pub gaps: u64,
    /// Replays asked for on (re)connection.
    pub resyncs: u64,
    /// Replays that delivered everything asked for.
    pub replays_ok: u64,
    /// Replays after which history was still incomplete.
    pub replays_incomplete: u64,
    /// Replays that timed out.
    pub replay_timeouts: u64,
    /// Engine restarts seen.
    pub engine_restarts: u64,
    /// Times the rank was cleared.
    pub clears: u64,
    /// Duplicate batches dropped.
    pub stale: u64,
    /// Continuity checks that proved the stream continuous.
    pub verifies: u64,
    /// Batches for a DP rank the worker does not have, dropped.
    pub foreign_rank_batches: u64,
    /// Early checks of a quiet stream.
    pub early_verifies: u64,
    /// Early checks that found lost batches.
    pub early_repairs: u64,
    /// Periodic checks that found lost batches.
    pub periodic_repairs: u64,
}

impl RankStats {
    /// The counters as they are now.
    pub fn counters(&self) -> RankCounters {
        let get = |c: &AtomicU64| c.load(Ordering::Relaxed);
        let cursor = *self.cursor.lock().unwrap_or_else(PoisonError::into_inner);
        RankCounters {
            batches: get(&self.batches),
            events: get(&self.events),
            decode_errors: get(&self.decode_errors),
            events_filtered: get(&self.events_filtered),
            envelope_errors: get(&self.envelope_errors),
            bad_frames: get(&self.bad_frames),
            gaps: cursor.gaps,
            resyncs: cursor.resyncs,
            replays_ok: cursor.replays_ok,
            replays_incomplete: cursor.replays_incomplete,
            replay_timeouts: cursor.replay_timeouts,
            engine_restarts: cursor.restarts,
            clears: cursor.clears,
            stale: cursor.stale,
            verifies: cursor.verifies,
            foreign_rank_batches: get(&self.foreign_rank_batches),
            early_verifies: get(&self.early_verifies),
            early_repairs: get(&self.early_repairs),
            periodic_repairs: get(&self.periodic_repairs),
        }
    }

    /// Publishes the cursor's counters and where the stream stands (once
    /// everything up to it is in the index).
    pub fn set_cursor(&self, stats: CursorStats, next_seq: Option<u64>, at: Option<ResumePoint>) {
        *self.cursor.lock().unwrap_or_else(PoisonError::into_inner) = stats;
        *self.resume.lock().unwrap_or_else(PoisonError::into_inner) = at;
        self.next_seq
            .store(next_seq.unwrap_or(0), Ordering::Relaxed);
    }

    /// Where the stream stands, for a snapshot.
    pub fn resume_point(&self) -> Option<ResumePoint> {
        *self.resume.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// The rank's state now.
    pub fn state(&self) -> RankState {
        RankState::from_u8(self.state.load(Ordering::Relaxed))
    }

    /// Why the rank is in its state (set for `error` and `degraded`).
    pub fn reason(&self) -> Option<String> {
        self.reason
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .clone()
    }

    /// Sets the state and its reason; true when either changed.
    pub fn set_state(&self, state: RankState, reason: Option<String>) -> bool {
        let mut current = self.reason.lock().unwrap_or_else(PoisonError::into_inner);
        let old = self.state.swap(state.as_u8(), Ordering::Relaxed);
        let changed = old != state.as_u8() || *current != reason;
        *current = reason;
        changed
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn states_round_trip_and_report_changes() {
        for state in RankState::ALL {
            assert_eq!(RankState::from_u8(state.as_u8()), state);
        }
        let stats = RankStats::default();
        assert_eq!(stats.state(), RankState::Live);
        assert!(stats.set_state(RankState::Disconnected, None));
        assert!(!stats.set_state(RankState::Disconnected, None));
        assert!(stats.set_state(RankState::Disconnected, Some("x".into())));
        assert_eq!(stats.reason().as_deref(), Some("x"));
    }
}
