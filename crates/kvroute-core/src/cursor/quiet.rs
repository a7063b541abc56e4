//! When a stream's continuity is checked, from timestamps passed in.
//!
//! A lost batch shows as a gap only when the engine publishes the next one:
//! the *last* batch of a burst, lost, stays unseen for as long as the engine
//! stays quiet. Two checks ask the replay ring for what follows the last
//! batch applied:
//!
//! * **early**: once per quiet spell, [`QuietClock::early_ms`] after the last
//!   live batch (and after the last replay ended), so a burst's lost tail is
//!   found within about a second. A busy stream never gets one (its next
//!   batch shows a gap by itself), nor does a stream that has published
//!   nothing since the last check;
//! * **periodic**: every [`QuietClock::period_ms`] without anything applied
//!   or checked, which also proves that a stream quiet for long is still the
//!   same engine's.
//!
//! The clock only decides; the shell sends the request (and tells the clock
//! when it could not: [`QuietClock::due`] is asked again on the next tick).

/// Which check is due.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum QuietCheck {
    /// The first check of a quiet spell, soon after the last live batch.
    Early,
    /// The regular check of a stream that has been quiet for long.
    Periodic,
}

impl QuietCheck {
    /// Stable name for logs.
    pub fn as_str(self) -> &'static str {
        match self {
            QuietCheck::Early => "early",
            QuietCheck::Periodic => "periodic",
        }
    }
}

/// The quiet-stream timers of one stream; times are milliseconds on any
/// clock that does not go back (the shell passes them in).
#[derive(Debug, Clone)]
pub struct QuietClock {
    early_ms: u64,
    period_ms: u64,
    /// When a live batch last arrived.
    last_live_ms: Option<u64>,
    /// When a replay (of any cause) last ended.
    last_replay_ms: u64,
    /// When a batch was last applied or continuity last checked.
    active_ms: u64,
    /// A live batch arrived since the last early check.
    armed: bool,
}

impl QuietClock {
    /// A clock started at `now`: an early check `early_ms` after a spell's
    /// last live batch (0: never), a periodic one every `period_ms`.
    pub fn new(early_ms: u64, period_ms: u64, now: u64) -> Self {
        QuietClock {
            early_ms,
            period_ms,
            last_live_ms: None,
            last_replay_ms: now,
            active_ms: now,
            armed: false,
        }
    }

    /// The delay of the early check after a spell's last live batch.
    pub fn early_ms(&self) -> u64 {
        self.early_ms
    }

    /// The period of the regular check.
    pub fn period_ms(&self) -> u64 {
        self.period_ms
    }

    /// A live batch arrived: a quiet spell starts (again) from now.
    pub fn live(&mut self, now: u64) {
        self.last_live_ms = Some(now);
        self.armed = self.early_ms > 0;
    }

    /// A batch was applied (live or replayed): the periodic check waits.
    pub fn applied(&mut self, now: u64) {
        self.active_ms = self.active_ms.max(now);
    }

    /// A replay ended (its end marker, a timeout, the link): continuity was
    /// just checked as far as it could be; an armed early check waits
    /// `early_ms` from here.
    pub fn replay_ended(&mut self, now: u64) {
        self.last_replay_ms = self.last_replay_ms.max(now);
        self.active_ms = self.active_ms.max(now);
    }

    /// The check due at `now`, if any (the early one first). Asking does
    /// not start it: call [`QuietClock::started`] once the request is out.
    pub fn due(&self, now: u64) -> Option<QuietCheck> {
        if self.armed {
            let since = self.last_live_ms.unwrap_or(0).max(self.last_replay_ms);
            if now.saturating_sub(since) >= self.early_ms {
                return Some(QuietCheck::Early);
            }
        }
        (now.saturating_sub(self.active_ms) >= self.period_ms).then_some(QuietCheck::Periodic)
    }

    /// The shell started `check` at `now`: an early check is not repeated
    /// before another live batch, and either restarts the period.
    pub fn started(&mut self, check: QuietCheck, now: u64) {
        if check == QuietCheck::Early {
            self.armed = false;
        }
        self.active_ms = self.active_ms.max(now);
    }

    /// The early check would have been due, but nothing could be asked (no
    /// link, no replay ring): the spell needs no early check any more.
    pub fn disarm(&mut self) {
        self.armed = false;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn clock() -> QuietClock {
        QuietClock::new(500, 5_000, 1_000)
    }

    #[test]
    fn a_stream_that_never_published_gets_only_the_periodic_check() {
        let c = clock();
        assert_eq!(c.due(1_499), None);
        assert_eq!(c.due(5_999), None);
        assert_eq!(c.due(6_000), Some(QuietCheck::Periodic));
    }

    #[test]
    fn the_early_check_comes_once_per_quiet_spell() {
        let mut c = clock();
        c.live(2_000);
        c.applied(2_000);
        assert_eq!(c.due(2_499), None);
        assert_eq!(c.due(2_500), Some(QuietCheck::Early));
        c.started(QuietCheck::Early, 2_500);
        c.replay_ended(2_510);
        // Not again, however long the stream stays quiet.
        assert_eq!(c.due(3_000), None);
        assert_eq!(c.due(7_509), None);
        assert_eq!(c.due(7_510), Some(QuietCheck::Periodic));
        c.started(QuietCheck::Periodic, 7_510);
        assert_eq!(c.due(8_000), None);
        // A new batch, a new spell.
        c.live(9_000);
        assert_eq!(c.due(9_499), None);
        assert_eq!(c.due(9_500), Some(QuietCheck::Early));
    }

    #[test]
    fn a_busy_stream_never_gets_an_early_check() {
        let mut c = clock();
        for t in (2_000..20_000).step_by(100) {
            c.live(t);
            c.applied(t);
            assert_eq!(c.due(t + 99), None, "at {t}");
        }
    }

    #[test]
    fn a_replay_ending_after_the_last_batch_pushes_the_early_check_back() {
        let mut c = clock();
        c.live(2_000);
        c.replay_ended(2_300);
        assert_eq!(c.due(2_500), None);
        assert_eq!(c.due(2_799), None);
        assert_eq!(c.due(2_800), Some(QuietCheck::Early));
    }

    #[test]
    fn an_early_check_that_could_not_start_stays_due_until_disarmed() {
        let mut c = clock();
        c.live(2_000);
        assert_eq!(c.due(2_600), Some(QuietCheck::Early));
        assert_eq!(c.due(2_800), Some(QuietCheck::Early));
        c.disarm();
        assert_eq!(c.due(2_800), None);
    }

    #[test]
    fn zero_disables_the_early_check() {
        let mut c = QuietClock::new(0, 5_000, 0);
        c.live(100);
        assert_eq!(c.due(4_999), None);
        assert_eq!(c.due(5_000), Some(QuietCheck::Periodic));
    }

    #[test]
    fn a_clock_passed_an_older_time_does_not_go_back() {
        let mut c = clock();
        c.applied(3_000);
        c.applied(2_000);
        assert_eq!(c.due(7_999), None);
        assert_eq!(c.due(8_000), Some(QuietCheck::Periodic));
        assert_eq!(c.due(10), None);
    }
}
