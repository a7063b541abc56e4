//! Migration: when the worker serving a request fails after the request
//! reached it (the connection reset, the stream cut off), the rest of the
//! request goes to another rank and the client receives one answer.
//!
//! - A stream is continued from what it generated: a completion's prompt
//!   followed by the generated text (or token ids, when the engine sent
//!   them), a chat's messages followed by the partial assistant message with
//!   `continue_final_message` ([`splice::continuation`]); the output budget
//!   is reduced by what was generated, and the continuation's events are
//!   rewritten into the rest of the first answer: same id, no second role
//!   chunk, a `usage` counting the whole answer ([`splice::Splicer`]).
//!   While a request may migrate, its stream is passed on in whole events
//!   ([`transcript::Transcript`]) so the client never holds half of one.
//! - A whole (non-streamed) answer, or a stream that had generated nothing,
//!   is asked again whole.
//! - Bounded: `--migration-limit` moves per request (3 by default; 0:
//!   never), never to a worker that failed it, only while the request's
//!   `--request-timeout-secs` lasts (a request that ran out of time is not
//!   moved), only while what it generated fits `--max-answer-mib`, and a
//!   request that failed twice before any output is not sent on (it may be
//!   what kills workers). A client opts out with `x-kvroute-migrate: 0`.
//! - Each move is counted (`kvroute_proxy_migrations_total`, and
//!   `…_failed_total` when it could not be made), logged with its reason,
//!   and shown in the decisions ring as its continuation's decision.
//!
//! The Responses and Messages APIs and SGLang's `/generate` are asked again
//! whole when nothing was generated yet; mid-stream they are not continued.

mod splice;
mod transcript;

use std::pin::Pin;
use std::sync::Arc;
use std::time::{Duration, Instant};

use axum::body::Bytes;
use axum::http::HeaderMap;
use futures_util::Stream;
use tracing::warn;

pub use splice::{continuation, Continuation, Splicer};
pub use transcript::{Generated, Transcript};

use super::send::{forwarded_headers, open_candidate, outgoing, send_within, Request, Sent};
use super::Proxy;
use crate::router::active::ActiveGuard;
use crate::router::admission;
use crate::router::intake::RoutedRequest;
use crate::router::Endpoint;

/// The header with which a client keeps its request from being migrated
/// (`x-kvroute-migrate: 0`).
pub const OPT_OUT_HEADER: &str = "x-kvroute-migrate";

/// A worker's answer body as the relay reads it.
pub type Upstream = Pin<Box<dyn Stream<Item = Result<Bytes, reqwest::Error>> + Send>>;

/// A future continuation leg.
pub type PendingLeg = Pin<Box<dyn std::future::Future<Output = Result<Leg, String>> + Send>>;

/// Another rank's answer to a continuation, to relay in place of the failed one.
pub struct Leg {
    /// Its body.
    pub stream: Upstream,
    /// Its place in its rank's load.
    pub guard: ActiveGuard,
    /// Its worker.
    pub worker: Arc<str>,
}

/// What moving one request needs: the request as it came, what was passed
/// on of its answer, and who failed it.
pub struct Migration {
    proxy: Arc<Proxy>,
    req: Arc<RoutedRequest>,
    body: Bytes,
    headers: HeaderMap,
    endpoint: Endpoint,
    request_id: String,
    arrived: Instant,
    large: bool,
    moves: u32,
    failed: Vec<Arc<str>>,
    /// What the client was sent so far.
    pub transcript: Transcript,
    /// Rewrites the leg being relayed when it is a continuation.
    pub splicer: Option<Splicer>,
    /// The request's trace span, the parent of its migrations' (`None`
    /// while tracing is off).
    trace: Option<opentelemetry::Context>,
}

/// What to do after the leg being relayed failed.
pub enum Step {
    /// Nothing was left to generate: end the stream as it is.
    Finished,
    /// Relay this leg once it answers.
    Resume(PendingLeg),
}

impl Migration {
    /// The migration state of `request`, or `None` when it may not migrate
    /// (`--migration-limit 0`, or the client opted out).
    pub fn of(proxy: &Arc<Proxy>, request: &Request<'_>) -> Option<Migration> {
        let limit = proxy.router.config().migration_limit;
        let opted_out = request
            .headers
            .get(OPT_OUT_HEADER)
            .is_some_and(|v| v.as_bytes() == b"0" || v.as_bytes().eq_ignore_ascii_case(b"false"));
        if limit == 0 || opted_out {
            return None;
        }
        Some(Migration {
            proxy: proxy.clone(),
            req: request.req.clone(),
            body: request.body.clone(),
            headers: forwarded_headers(request.headers),
            endpoint: request.endpoint,
            request_id: request.request_id.to_owned(),
            arrived: request.arrived,
            large: request.large,
            moves: 0,
            failed: Vec::new(),
            transcript: Transcript::new(proxy.router.config().max_answer_bytes),
            splicer: None,
            trace: crate::otel::spans::current(),
        })
    }

    /// The next bytes of the leg being relayed, as the client gets them:
    /// a continuation's rewritten into the first answer, and whole events
    /// only (kept for a later move).
    pub fn pass(&mut self, chunk: Bytes) -> Bytes {
        let chunk = match &mut self.splicer {
            Some(splicer) => splicer.feed(&chunk),
            None => chunk,
        };
        self.transcript.feed(chunk)
    }

    /// The proxy the request goes through.
    pub fn proxy(&self) -> &Arc<Proxy> {
        &self.proxy
    }

    /// Moves done so far.
    pub fn moves(&self) -> u32 {
        self.moves
    }

    /// The leg on `worker` failed (`cause` in words): the next step, or
    /// why the request cannot move (counted, logged).
    pub fn after_failure(&mut self, worker: &Arc<str>, cause: &str) -> Result<Step, String> {
        self.failed.push(worker.clone());
        let decided = self.decide(worker, cause);
        if let Err(why) = &decided {
            self.proxy.router.metrics.migrations_failed.inc();
            warn!(request_id = %self.request_id, %worker, cause, why = %why, "the request could not be migrated");
        }
        decided
    }

    /// The request, sent to `worker`, was lost before any answer (`cause`):
    /// whether it may be asked again whole of the next candidate (a move;
    /// counted and logged either way).
    pub fn ask_again(&mut self, worker: &Arc<str>, cause: &str) -> Result<(), String> {
        self.failed.push(worker.clone());
        let allowed = self.time_left().and_then(|_| self.may_move(0));
        match &allowed {
            Ok(()) => {
                self.moves += 1;
                self.proxy.router.metrics.migrations.inc();
                warn!(request_id = %self.request_id, %worker, moves = self.moves, cause, "asking another worker: the request was lost before its answer");
            }
            Err(why) => {
                self.proxy.router.metrics.migrations_failed.inc();
                warn!(request_id = %self.request_id, %worker, cause, why = %why, "the request could not be migrated");
            }
        }
        allowed
    }

    /// What is left of the request's time, if any.
    fn time_left(&self) -> Result<Duration, String> {
        self.proxy
            .router
            .config()
            .request_timeout
            .checked_sub(self.arrived.elapsed())
            .filter(|left| !left.is_zero())
            .ok_or_else(|| "its --request-timeout-secs is spent".to_owned())
    }

    /// Whether one more move is allowed after `pieces` of output.
    fn may_move(&self, pieces: u64) -> Result<(), String> {
        if self.moves >= self.proxy.router.config().migration_limit {
            return Err(format!(
                "moved {} times already (--migration-limit)",
                self.moves
            ));
        }
        if pieces == 0 && self.moves > 0 {
            return Err(
                "a second worker failed it before any output (it may be what kills workers)".into(),
            );
        }
        Ok(())
    }

    fn decide(&mut self, worker: &Arc<str>, cause: &str) -> Result<Step, String> {
        let left = self.time_left()?;
        if self.transcript.over() {
            return Err("its answer so far is over --max-answer-mib".into());
        }
        let generated = self.transcript.generated(self.endpoint);
        self.may_move(generated.pieces)?;
        let payload = match continuation(&self.body, self.endpoint, &generated)? {
            Continuation::Finished => return Ok(Step::Finished),
            Continuation::Body(b) => Bytes::from(b),
        };
        self.moves += 1;
        let note = format!(
            "migration {} from `{worker}` after {} generated tokens ({cause})",
            self.moves,
            generated.tokens()
        );
        warn!(request_id = %self.request_id, %worker, moves = self.moves, tokens = generated.tokens(), cause, "migrating the request to another rank");
        self.splicer = Some(Splicer::new(
            &generated,
            self.endpoint,
            self.req.body.tokens.as_ref().map(|t| t.len() as u64),
        ));
        let resume = Resume {
            proxy: self.proxy.clone(),
            req: self.req.clone(),
            payload,
            headers: self.headers.clone(),
            endpoint: self.endpoint,
            request_id: self.request_id.clone(),
            large: self.large,
            failed: self.failed.clone(),
            left,
            note,
        };
        let trace = self
            .trace
            .as_ref()
            .map(|parent| crate::otel::spans::migration(parent, worker, generated.tokens(), cause));
        Ok(Step::Resume(Box::pin(crate::otel::within(
            trace,
            resume.run(),
        ))))
    }
}

/// One continuation to place and send.
struct Resume {
    proxy: Arc<Proxy>,
    req: Arc<RoutedRequest>,
    payload: Bytes,
    headers: HeaderMap,
    endpoint: Endpoint,
    request_id: String,
    large: bool,
    failed: Vec<Arc<str>>,
    left: Duration,
    note: String,
}

impl Resume {
    /// Places the continuation as the request was placed (its prefix is
    /// the same), on a worker that did not fail it, and sends it.
    async fn run(self) -> Result<Leg, String> {
        let router = &self.proxy.router;
        let admitted = admission::admit(router, &self.req, self.large)
            .await
            .map_err(|e| e.message())?;
        let (candidates, ordered, mut first) = admitted.into_parts();
        let mut last = String::from("no other worker is available");
        for (tried, &i) in ordered.iter().enumerate() {
            let failed_it = candidates
                .scored
                .get(i)
                .and_then(|s| candidates.targets.get(s.worker))
                .is_none_or(|t| self.failed.iter().any(|w| **w == *t.name));
            if failed_it {
                continue;
            }
            let Some((s, target)) = open_candidate(&self.proxy, &candidates, i) else {
                continue;
            };
            let guard = match first.take() {
                Some((charged, guard)) if charged == i => guard,
                _ => match admission::charge_later(router, &candidates, &self.req, i) {
                    Some(guard) => guard,
                    None => continue,
                },
            };
            let in_body = router.config().dp_rank_in_body;
            let ranks = target.ranks.len();
            let out =
                outgoing(in_body, &self.req, s, ranks, &self.payload).map_err(|e| e.message())?;
            let sent = send_within(
                &self.proxy,
                target,
                (self.endpoint, out, &self.headers),
                &self.request_id,
                self.left,
            )
            .await;
            match sent {
                Sent::Answer(resp) if resp.status().is_success() => {
                    router.metrics.migrations.inc();
                    let chosen = admission::Chosen {
                        candidates: &candidates,
                        ordered: &ordered,
                        index: i,
                        retries: tried,
                    };
                    let mut decision =
                        admission::decision(router, &self.req, &self.request_id, target, chosen);
                    decision.migrated = Some(self.note.clone());
                    router.observed.routed(decision);
                    return Ok(Leg {
                        stream: Box::pin(resp.bytes_stream()),
                        guard,
                        worker: target.name.clone(),
                    });
                }
                Sent::Answer(resp) => {
                    return Err(format!(
                        "worker `{}` answered the continuation {}",
                        target.name,
                        resp.status()
                    ))
                }
                Sent::Refused(message) => last = message,
                Sent::Failed(error) => last = error.message(),
            }
        }
        Err(last)
    }
}
