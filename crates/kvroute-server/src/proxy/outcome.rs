//! The retry rule: how one attempt on a worker ended decides whether the
//! request moves on to the next candidate, what the worker's circuit breaker
//! records, what the client is told and what is counted.
//!
//! A request moves on as a retry only when it provably did not reach the
//! worker, or the worker refused it before doing any work. A worker that
//! took the request and then failed gets its breaker opened; the request
//! is then *migrated* ([`super::migrate`]): a stream is continued on
//! another rank from what it had generated, a whole answer is asked again
//! elsewhere — at most `--migration-limit` times, never on a worker that
//! failed it, within the request's time. Only when that cannot be done does
//! the client get the rule's error below, naming the request id. Running
//! out of `--request-timeout-secs` is never migrated (the request's time is
//! spent), and a stream still bringing tokens when it runs out is a long
//! answer, not a failing worker: its breaker records nothing. A worker's
//! success is recorded only once its whole answer has arrived.
//!
//! | the attempt… | kvroute | the worker's breaker | `kvroute_proxy_upstream_errors_total` |
//! | --- | --- | --- | --- |
//! | could not connect (refused, or `--connect-timeout-ms` passed) | next candidate (after the last: 502 `upstream_unreachable`) | one failure | +1 |
//! | got 503 or 429 | next candidate (after the last: 502 `upstream_unreachable`) | one failure | +1 |
//! | was sent, then the connection dropped before an answer | migrates the request to another worker; when it cannot, 502 `upstream_failed` naming the request id | opens at once | +1 |
//! | got any other status | relays the answer | waits for the answer's end | - |
//! | had its answer cut off after the head (body or stream) | migrates the request to another worker; when it cannot, 502 `upstream_incomplete` naming the request id | opens at once | +1 |
//! | got its whole answer, a 5xx | done: the worker's answer was the client's | one failure | +1 |
//! | got its whole answer, any other status | done: the worker's answer was the client's | closes (a success) | - |
//! | ran out of `--request-timeout-secs` before any answer | 502 `upstream_failed` naming the request id; no other worker | one failure | +1 |
//! | ran out of `--request-timeout-secs` while its stream was flowing | 502 `upstream_incomplete` naming the request id; no other worker | nothing (the worker was working) | - |
//!
//! A stream cut off after its head has been relayed cannot become a 502:
//! an SSE stream ends with a last `data: {"error": …}` event of that error
//! and `data: [DONE]`. An answer the client stopped reading (it
//! disconnected) records nothing; a half-open probe lost that way expires
//! after the breaker period.
//!
//! Each leg of a disaggregated request is an attempt under this rule
//! (`super::disagg`), through its worker's breaker: a refused leg moves on
//! to the next worker of its pool (vLLM's decode leg with the prefill's
//! `kv_transfer_params`; SGLang's two legs together, in new rooms), so a
//! refused half-open probe costs no client its request; a prefill leg with
//! no answer within `--prefill-timeout-secs` was sent and lost before an
//! answer (502 `upstream_failed`, the breaker opens).

use axum::http::StatusCode;
use tracing::{debug, warn};

use crate::api::ErrorKind;
use crate::router::Router;

/// How one attempt on a worker ended, as far as the rule cares.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Ending {
    /// No connection could be made (refused, or the connect timeout
    /// passed): the request never reached the worker.
    NotConnected,
    /// The request was sent, then the connection dropped or the request
    /// timed out before the answer's head.
    LostBeforeAnswer,
    /// The answer's head arrived with this status; its body is to come.
    Head(StatusCode),
    /// The answer was cut off after its head: its body or its stream.
    CutOff,
    /// The whole answer arrived, with this status.
    Complete(StatusCode),
    /// `--request-timeout-secs` ran out; `flowing`: its stream was still
    /// bringing tokens (a long answer, not a failing worker).
    OutOfTime {
        /// The stream had brought part of the answer.
        flowing: bool,
    },
}

/// What the proxy does after an attempt ended so.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Next {
    /// Try the next candidate; after the last, answer
    /// [`ErrorKind::UpstreamUnreachable`].
    Retry,
    /// Relay the worker's answer to the client.
    Relay,
    /// Answer the client with this error; send the request to no one else.
    Fail(ErrorKind),
    /// Nothing more: the worker's answer was the client's.
    Done,
}

impl Next {
    /// The error the client gets, when the rule gives one.
    pub fn error(self) -> Option<ErrorKind> {
        match self {
            Next::Fail(kind) => Some(kind),
            Next::Retry | Next::Relay | Next::Done => None,
        }
    }
}

/// What a worker's circuit breaker records for an attempt.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum BreakerOutcome {
    /// Nothing yet: the answer is still coming.
    Pending,
    /// A success: the breaker closes.
    Success,
    /// One failure towards `--breaker-failures`.
    Failure,
    /// The breaker opens at once.
    Trip,
    /// Nothing: the worker was doing the work asked of it.
    Untouched,
}

/// The rule's answer for one [`Ending`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Verdict {
    /// What the proxy does next.
    pub next: Next,
    /// What the worker's breaker records.
    pub breaker: BreakerOutcome,
    /// Counted in `kvroute_proxy_upstream_errors_total`: the worker failed
    /// the attempt.
    pub upstream_error: bool,
}

/// The retry rule, the table of the module docs.
pub fn verdict(ending: Ending) -> Verdict {
    let (next, breaker, upstream_error) = match ending {
        Ending::NotConnected => (Next::Retry, BreakerOutcome::Failure, true),
        Ending::Head(status) if refuses(status) => (Next::Retry, BreakerOutcome::Failure, true),
        Ending::LostBeforeAnswer => (
            Next::Fail(ErrorKind::UpstreamFailed),
            BreakerOutcome::Trip,
            true,
        ),
        Ending::Head(_) => (Next::Relay, BreakerOutcome::Pending, false),
        Ending::CutOff => (
            Next::Fail(ErrorKind::UpstreamIncomplete),
            BreakerOutcome::Trip,
            true,
        ),
        Ending::Complete(status) if status.is_server_error() => {
            (Next::Done, BreakerOutcome::Failure, true)
        }
        Ending::Complete(_) => (Next::Done, BreakerOutcome::Success, false),
        Ending::OutOfTime { flowing: false } => (
            Next::Fail(ErrorKind::UpstreamFailed),
            BreakerOutcome::Failure,
            true,
        ),
        Ending::OutOfTime { flowing: true } => (
            Next::Fail(ErrorKind::UpstreamIncomplete),
            BreakerOutcome::Untouched,
            false,
        ),
    };
    Verdict {
        next,
        breaker,
        upstream_error,
    }
}

/// Whether a status refuses the request before any work: 503 or 429.
fn refuses(status: StatusCode) -> bool {
    matches!(
        status,
        StatusCode::SERVICE_UNAVAILABLE | StatusCode::TOO_MANY_REQUESTS
    )
}

/// Applies the rule to an attempt on `worker` that ended so: records the
/// breaker's outcome and counts the upstream error; returns the verdict for
/// the caller to act on.
pub fn settle(router: &Router, worker: &str, ending: Ending, request_id: &str) -> Verdict {
    let v = verdict(ending);
    if v.upstream_error {
        router.metrics.upstream_errors.inc();
    }
    match v.breaker {
        BreakerOutcome::Pending | BreakerOutcome::Untouched => {}
        BreakerOutcome::Success => router.breakers().record_outcome(worker, true),
        BreakerOutcome::Failure => router.breakers().record_outcome(worker, false),
        BreakerOutcome::Trip => router.breakers().trip(worker),
    }
    match v.next {
        Next::Fail(kind) => warn!(
            worker,
            request_id,
            ?ending,
            error = kind.label(),
            "the worker failed a request it had taken"
        ),
        Next::Retry => debug!(worker, request_id, ?ending, "trying the next candidate"),
        Next::Relay | Next::Done => {}
    }
    v
}

#[cfg(test)]
mod tests {
    use super::*;

    /// One row of the table: the endings it covers, what the attempt did
    /// (as the docs say it) and what the rule does.
    struct Row {
        endings: &'static [Ending],
        attempt: &'static str,
        expected: Verdict,
    }

    const fn v(next: Next, breaker: BreakerOutcome, upstream_error: bool) -> Verdict {
        Verdict {
            next,
            breaker,
            upstream_error,
        }
    }

    const RETRY: Next = Next::Retry;
    const FAILED: Next = Next::Fail(ErrorKind::UpstreamFailed);
    const INCOMPLETE: Next = Next::Fail(ErrorKind::UpstreamIncomplete);

    const TABLE: &[Row] = &[
        Row {
            endings: &[Ending::NotConnected],
            attempt: "could not connect (refused, or `--connect-timeout-ms` passed)",
            expected: v(RETRY, BreakerOutcome::Failure, true),
        },
        Row {
            endings: &[
                Ending::Head(StatusCode::SERVICE_UNAVAILABLE),
                Ending::Head(StatusCode::TOO_MANY_REQUESTS),
            ],
            attempt: "got 503 or 429",
            expected: v(RETRY, BreakerOutcome::Failure, true),
        },
        Row {
            endings: &[Ending::LostBeforeAnswer],
            attempt: "was sent, then the connection dropped before an answer",
            expected: v(FAILED, BreakerOutcome::Trip, true),
        },
        Row {
            endings: &[
                Ending::Head(StatusCode::OK),
                Ending::Head(StatusCode::BAD_REQUEST),
                Ending::Head(StatusCode::INTERNAL_SERVER_ERROR),
                Ending::Head(StatusCode::BAD_GATEWAY),
            ],
            attempt: "got any other status",
            expected: v(Next::Relay, BreakerOutcome::Pending, false),
        },
        Row {
            endings: &[Ending::CutOff],
            attempt: "had its answer cut off after the head (body or stream)",
            expected: v(INCOMPLETE, BreakerOutcome::Trip, true),
        },
        Row {
            endings: &[
                Ending::Complete(StatusCode::INTERNAL_SERVER_ERROR),
                Ending::Complete(StatusCode::BAD_GATEWAY),
                Ending::Complete(StatusCode::SERVICE_UNAVAILABLE),
            ],
            attempt: "got its whole answer, a 5xx",
            expected: v(Next::Done, BreakerOutcome::Failure, true),
        },
        Row {
            endings: &[
                Ending::Complete(StatusCode::OK),
                Ending::Complete(StatusCode::BAD_REQUEST),
                Ending::Complete(StatusCode::TOO_MANY_REQUESTS),
            ],
            attempt: "got its whole answer, any other status",
            expected: v(Next::Done, BreakerOutcome::Success, false),
        },
        Row {
            endings: &[Ending::OutOfTime { flowing: false }],
            attempt: "ran out of `--request-timeout-secs` before any answer",
            expected: v(FAILED, BreakerOutcome::Failure, true),
        },
        Row {
            endings: &[Ending::OutOfTime { flowing: true }],
            attempt: "ran out of `--request-timeout-secs` while its stream was flowing",
            expected: v(INCOMPLETE, BreakerOutcome::Untouched, false),
        },
    ];

    /// How the docs say what the proxy does.
    /// A worker that took the request and then failed is migrated from;
    /// running out of the request's time is not.
    fn next_text(next: Next, endings: &[Ending]) -> String {
        let migrates = endings
            .iter()
            .any(|e| matches!(e, Ending::LostBeforeAnswer | Ending::CutOff));
        match next {
            Next::Retry => "next candidate (after the last: 502 `upstream_unreachable`)".into(),
            Next::Relay => "relays the answer".into(),
            Next::Fail(kind) if migrates => format!(
                "migrates the request to another worker; when it cannot, {} `{}` naming the request id",
                kind.status().as_u16(),
                kind.openai_type()
            ),
            Next::Fail(kind) => format!(
                "{} `{}` naming the request id; no other worker",
                kind.status().as_u16(),
                kind.openai_type()
            ),
            Next::Done => "done: the worker's answer was the client's".into(),
        }
    }

    /// How the docs say what the breaker records.
    fn breaker_text(outcome: BreakerOutcome) -> &'static str {
        match outcome {
            BreakerOutcome::Pending => "waits for the answer's end",
            BreakerOutcome::Success => "closes (a success)",
            BreakerOutcome::Failure => "one failure",
            BreakerOutcome::Trip => "opens at once",
            BreakerOutcome::Untouched => "nothing (the worker was working)",
        }
    }

    /// The table as the docs state it.
    fn table() -> String {
        let mut out = String::from(
            "| the attempt… | kvroute | the worker's breaker | `kvroute_proxy_upstream_errors_total` |\n\
             | --- | --- | --- | --- |\n",
        );
        for row in TABLE {
            let v = row.expected;
            let counted = if v.upstream_error { "+1" } else { "-" };
            out.push_str(&format!(
                "| {} | {} | {} | {counted} |\n",
                row.attempt,
                next_text(v.next, row.endings),
                breaker_text(v.breaker)
            ));
        }
        out
    }

    #[test]
    fn every_row_of_the_table_holds() {
        for row in TABLE {
            for &ending in row.endings {
                assert_eq!(verdict(ending), row.expected, "{}: {ending:?}", row.attempt);
            }
        }
    }

    #[test]
    fn every_ending_is_in_the_table() {
        let covered = |e: fn(&Ending) -> bool| TABLE.iter().any(|r| r.endings.iter().any(e));
        assert!(covered(|e| matches!(e, Ending::NotConnected)));
        assert!(covered(|e| matches!(e, Ending::LostBeforeAnswer)));
        assert!(covered(|e| matches!(e, Ending::Head(_))));
        assert!(covered(|e| matches!(e, Ending::CutOff)));
        assert!(covered(|e| matches!(
            e,
            Ending::OutOfTime { flowing: true }
        )));
        assert!(covered(|e| matches!(
            e,
            Ending::OutOfTime { flowing: false }
        )));
        assert!(covered(|e| matches!(e, Ending::Complete(_))));
    }

    #[test]
    fn a_request_is_retried_only_when_the_worker_did_no_work() {
        for code in 100..600 {
            let Ok(s) = StatusCode::from_u16(code) else {
                continue;
            };
            let retried = verdict(Ending::Head(s)).next == Next::Retry;
            assert_eq!(retried, code == 503 || code == 429, "{code}");
            // A whole answer is never retried, and only it closes a breaker.
            assert_eq!(verdict(Ending::Complete(s)).next, Next::Done);
            assert_ne!(verdict(Ending::Head(s)).breaker, BreakerOutcome::Success);
        }
        for taken in [Ending::LostBeforeAnswer, Ending::CutOff] {
            let v = verdict(taken);
            assert!(matches!(v.next, Next::Fail(_)) && v.breaker == BreakerOutcome::Trip);
        }
    }

    /// The module docs and `docs/serving.md` state the table as generated
    /// from the rule.
    #[test]
    fn the_docs_state_the_rule() {
        let table = table();
        let module: String = include_str!("outcome.rs")
            .lines()
            .filter_map(|l| l.strip_prefix("//! ").or(l.strip_prefix("//!")))
            .map(|l| format!("{l}\n"))
            .collect();
        assert!(
            module.contains(&table),
            "the module docs must state the table:\n\n{table}"
        );
        let path = concat!(env!("CARGO_MANIFEST_DIR"), "/../../docs/serving.md");
        let doc = std::fs::read_to_string(path).expect("docs/serving.md");
        assert!(
            doc.contains(&table),
            "docs/serving.md must state the table:\n\n{table}"
        );
    }
}
