//! Which replay request an end marker closes.
//!
//! A replay's end marker carries no request id: the shell counts the
//! requests it sent and the end markers that came back. An engine answers
//! the requests of one connection in order, so that count is enough while
//! every end marker arrives; two faults break it:
//!
//! * an end marker that never comes (the engine dropped the tail of its
//!   answer): the replay times out and is **over** — counting on its end
//!   marker would make every later replay of the rank wait for one end
//!   marker too many, and time out, until the link reconnects;
//! * an end marker that comes late, after its replay timed out: it must not
//!   end the replay asked for since. It comes before any reply to the new
//!   request (one connection is FIFO), so an end marker that arrives while
//!   the current replay has had no reply, and a given-up replay's end
//!   marker may still come, is taken as that late one.
//!
//! A current replay whose only answer is its end marker (an engine that
//! restarted) may be taken once for a late one and time out; a timed-out
//! replay that swallowed an end marker that way expects no late one of its
//! own, so the next replay's end marker is taken as its own.

/// End markers owed by one replay connection.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct EndLedger {
    /// Requests sent, neither ended nor given up.
    pending: u32,
    /// Given-up requests whose end marker may still come.
    late: u32,
    /// The current request swallowed an end marker as a late one.
    swallowed: bool,
}

/// Given-up requests whose late end marker is still expected, at most.
const MAX_LATE: u32 = 4;

impl EndLedger {
    /// A request was sent.
    pub fn sent(&mut self) {
        self.pending += 1;
        self.swallowed = false;
    }

    /// The connection (re)started: nothing sent before can be answered.
    pub fn reset(&mut self) {
        *self = EndLedger::default();
    }

    /// The oldest outstanding request was given up (it timed out): its end
    /// marker is presumed lost, though it may still come late.
    pub fn given_up(&mut self) {
        if self.pending == 0 {
            return;
        }
        self.pending -= 1;
        if !std::mem::take(&mut self.swallowed) {
            self.late = (self.late + 1).min(MAX_LATE);
        }
    }

    /// True when a replayed batch answers the current request (exactly
    /// one is outstanding).
    pub fn current(&self) -> bool {
        self.pending == 1
    }

    /// Requests outstanding.
    pub fn pending(&self) -> u32 {
        self.pending
    }

    /// An end marker arrived; `answered`: the current replay has had a
    /// reply. True when it ends the current replay.
    pub fn end(&mut self, answered: bool) -> bool {
        if self.pending == 0 {
            // Nothing is outstanding: a given-up request's, if anything.
            self.late = self.late.saturating_sub(1);
            return false;
        }
        if answered {
            // Any older end marker would have come before the reply.
            self.late = 0;
        } else if self.late > 0 {
            self.late -= 1;
            self.swallowed = true;
            return false;
        }
        self.pending -= 1;
        self.pending == 0
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn an_end_marker_ends_the_replay_it_answers() {
        let mut l = EndLedger::default();
        l.sent();
        assert!(l.current());
        assert!(l.end(false));
        assert_eq!(l.pending(), 0);
    }

    #[test]
    fn a_lost_end_marker_does_not_hold_up_the_next_replay() {
        let mut l = EndLedger::default();
        l.sent();
        l.given_up();
        l.sent();
        assert!(l.current(), "the next replay's replies are its own");
        assert!(l.end(true));
        // And the one after.
        l.sent();
        assert!(l.end(true));
    }

    #[test]
    fn a_late_end_marker_is_not_taken_for_the_next_replays() {
        let mut l = EndLedger::default();
        l.sent();
        l.given_up();
        l.sent();
        // The old one's end marker, before any reply to the new request.
        assert!(!l.end(false));
        assert!(l.current());
        assert!(l.end(true));
    }

    #[test]
    fn a_late_end_marker_with_nothing_outstanding_is_dropped() {
        let mut l = EndLedger::default();
        l.sent();
        l.given_up();
        assert!(!l.end(false));
        l.sent();
        // An engine that restarted answers with the end marker alone.
        assert!(l.end(false));
    }

    #[test]
    fn a_restarted_engines_bare_end_marker_is_taken_at_the_latest_the_second_time() {
        let mut l = EndLedger::default();
        l.sent();
        l.given_up();
        l.sent();
        // Its bare end marker looks like the lost one's…
        assert!(!l.end(false));
        l.given_up();
        l.sent();
        // …but only once.
        assert!(l.end(false));
    }

    #[test]
    fn a_reconnect_forgets_everything() {
        let mut l = EndLedger::default();
        l.sent();
        l.given_up();
        l.sent();
        l.reset();
        assert_eq!(l, EndLedger::default());
        assert!(!l.end(false));
    }
}
