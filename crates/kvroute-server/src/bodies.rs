//! Reading a request body within its three bounds: its size (the route's
//! limit, 413), its time (408) and the memory every body in flight shares
//! (the [`MemoryBudget`], 503).
//!
//! A body's share holds [`HELD_PER_BYTE`] bytes of the budget for each of
//! its bytes while it is read and parsed: the body, and what parsing and
//! tokenizing it makes of its text (measured: a text prompt holds about
//! five times its bytes at its peak). A body whose length its head declares
//! takes its whole share before it is read, waiting for others to give theirs
//! back as long as its time allows, so that bodies never hold half their
//! share each and starve one another.
//!
//! Time is a rate, not a fixed wait: a body gets [`BodyLimits::read_timeout`]
//! from its head, plus a second for every [`BodyLimits::min_rate`] bytes
//! that arrived, so a large upload on a slow but honest link finishes while
//! a client trickling a byte a second loses its connection after the first
//! allowance. The same rule serves the endpoint picker's streams.

use std::sync::Arc;
use std::time::{Duration, Instant};

use axum::body::Bytes;
use axum::extract::{FromRequest, Request};
use axum::http::StatusCode;
use futures_util::StreamExt as _;

use crate::api::ProxyError;
use crate::budget::{MemoryBudget, Share};

/// Bytes of the budget a body holds per byte while it is read and parsed.
pub const HELD_PER_BYTE: usize = 5;

/// How long a body may take, and how much memory all bodies may hold.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct BodyLimits {
    /// Time a body gets from its request's head before any rate credit
    /// (`--body-timeout-secs`).
    pub read_timeout: Duration,
    /// Bytes a second that earn a body one more second
    /// (`--body-min-rate-kib`).
    pub min_rate: usize,
    /// Bytes every request body being read or routed may hold at once
    /// (`--body-memory-mib`): the [`MemoryBudget`]'s limit.
    pub memory_bytes: usize,
}

impl Default for BodyLimits {
    fn default() -> Self {
        BodyLimits {
            read_timeout: Duration::from_secs(10),
            min_rate: 128 << 10,
            memory_bytes: 192 << 20,
        }
    }
}

impl BodyLimits {
    /// The time a body may have taken once `received` bytes arrived.
    pub fn allowance(&self, received: usize) -> Duration {
        let credit = received / self.min_rate.max(1);
        self.read_timeout + Duration::from_secs(u64::try_from(credit).unwrap_or(u64::MAX))
    }

    /// The budget these limits describe: a sixth of it (at most 32 MiB)
    /// kept for small bodies.
    pub fn budget(&self) -> Arc<MemoryBudget> {
        MemoryBudget::new(self.memory_bytes, (self.memory_bytes / 6).min(32 << 20))
    }
}

/// Why a body was not read.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum BodyRefusal {
    /// Over the route's limit.
    #[error("the body is over the {limit} bytes this route takes")]
    TooLarge {
        /// The limit.
        limit: usize,
    },
    /// Every body in flight together holds the budget.
    #[error(
        "the router holds as many request bodies as its memory budget allows \
         ({} MiB, --body-memory-mib); retry shortly",
        budget >> 20
    )]
    OverBudget {
        /// The budget's limit.
        budget: usize,
    },
    /// Slower than the body-read rule.
    #[error(
        "the body did not arrive in time: {received} bytes in {secs} s \
         (--body-timeout-secs, --body-min-rate-kib)"
    )]
    TimedOut {
        /// Bytes that arrived.
        received: usize,
        /// Seconds it was given.
        secs: u64,
    },
}

impl From<BodyRefusal> for ProxyError {
    fn from(refusal: BodyRefusal) -> Self {
        let message = refusal.to_string();
        match refusal {
            BodyRefusal::TooLarge { .. } => ProxyError::TooLarge(message),
            BodyRefusal::OverBudget { .. } => ProxyError::Overloaded(message),
            BodyRefusal::TimedOut { .. } => ProxyError::BodyTimeout(message),
        }
    }
}

/// What reading a route's bodies obeys: a request extension set by the
/// app's layers (a narrower route sets its own over the app's).
#[derive(Debug, Clone)]
pub struct BodyRules {
    /// The route's size limit, in bytes.
    pub max_bytes: usize,
    /// Time and memory.
    pub limits: BodyLimits,
    /// The budget shared by every body in flight.
    pub budget: Arc<MemoryBudget>,
}

impl BodyRules {
    /// The same rules with another size limit.
    pub fn with_max_bytes(&self, max_bytes: usize) -> Self {
        BodyRules {
            max_bytes,
            ..self.clone()
        }
    }
}

/// A body being gathered under [`BodyRules`]: what arrived, the share of
/// the budget it holds, and when it started. Pure; the caller brings the
/// chunks and the clock.
#[derive(Debug)]
pub struct Gathering {
    bytes: Vec<u8>,
    share: Share,
    max_bytes: usize,
    limits: BodyLimits,
    budget_limit: usize,
    started: Instant,
}

impl Gathering {
    /// An empty body under `rules`, started at `started`.
    pub fn new(rules: &BodyRules, started: Instant) -> Self {
        Gathering {
            bytes: Vec::new(),
            share: rules.budget.share(),
            max_bytes: rules.max_bytes,
            limits: rules.limits,
            budget_limit: rules.budget.limit(),
            started,
        }
    }

    /// Appends a chunk, growing the share to [`HELD_PER_BYTE`] times the
    /// body; refuses it when the body would pass its limit or the budget
    /// cannot hold it (keeping what came before).
    pub fn push(&mut self, chunk: &[u8]) -> Result<(), BodyRefusal> {
        let len = self.bytes.len();
        if chunk.len() > self.max_bytes.saturating_sub(len) {
            return Err(BodyRefusal::TooLarge {
                limit: self.max_bytes,
            });
        }
        if !self.share.grow_to(held_for(len + chunk.len())) {
            return Err(BodyRefusal::OverBudget {
                budget: self.budget_limit,
            });
        }
        self.bytes.extend_from_slice(chunk);
        Ok(())
    }

    /// Takes the share of a body of `declared` bytes (at most the limit)
    /// at once; false when the budget cannot give it now.
    pub fn reserve(&mut self, declared: usize) -> bool {
        self.share.grow_to(held_for(declared.min(self.max_bytes)))
    }

    /// Bytes so far.
    pub fn len(&self) -> usize {
        self.bytes.len()
    }

    /// Whether nothing arrived yet.
    pub fn is_empty(&self) -> bool {
        self.bytes.is_empty()
    }

    /// When the body must be whole, as what arrived so far earns.
    pub fn deadline(&self) -> Instant {
        self.started + self.limits.allowance(self.bytes.len())
    }

    /// The refusal for a body that missed [`Gathering::deadline`].
    pub fn timed_out(&self) -> BodyRefusal {
        BodyRefusal::TimedOut {
            received: self.bytes.len(),
            secs: self.limits.allowance(self.bytes.len()).as_secs(),
        }
    }

    /// The whole body and the share that holds it.
    pub fn finish(self) -> (Bytes, Share) {
        (Bytes::from(self.bytes), self.share)
    }
}

/// The share a body of `bytes` holds.
fn held_for(bytes: usize) -> usize {
    bytes.saturating_mul(HELD_PER_BYTE)
}

/// Reads `body`, whose head declared `declared` bytes, to its end under
/// `rules`.
pub async fn read_body(
    body: axum::body::Body,
    declared: Option<usize>,
    rules: &BodyRules,
) -> Result<(Bytes, Share), ProxyError> {
    let mut gathering = Gathering::new(rules, Instant::now());
    if let Some(declared) = declared {
        let deadline = tokio::time::Instant::from_std(gathering.deadline());
        loop {
            let released = rules.budget.released();
            if gathering.reserve(declared) {
                break;
            }
            if tokio::time::timeout_at(deadline, released).await.is_err() {
                let budget = rules.budget.limit();
                return Err(BodyRefusal::OverBudget { budget }.into());
            }
        }
    }
    let mut frames = body.into_data_stream();
    loop {
        let deadline = tokio::time::Instant::from_std(gathering.deadline());
        match tokio::time::timeout_at(deadline, frames.next()).await {
            Err(_) => return Err(gathering.timed_out().into()),
            Ok(None) => return Ok(gathering.finish()),
            Ok(Some(Ok(chunk))) => gathering.push(&chunk)?,
            Ok(Some(Err(e))) => {
                return Err(ProxyError::BadRequest(format!(
                    "reading the body: {}",
                    crate::api::error_chain(&e)
                )))
            }
        }
    }
}

/// A request body, read to its end under the route's [`BodyRules`] (a
/// request extension the app's layers set): over the size limit a 413,
/// slower than the read rule a 408, past the memory budget a 503, a broken
/// upload a 400, all as [`ProxyError`]s. The [`Share`] holds the body's part
/// of the budget: keep it while the bytes are in use.
///
/// Without rules (an app built without them, as some tests build it) the
/// body is read up to axum's `DefaultBodyLimit`, with no deadline or budget.
#[derive(Debug)]
pub struct Body(pub Bytes, pub Share);

impl<S: Send + Sync> FromRequest<S> for Body {
    type Rejection = ProxyError;

    async fn from_request(req: Request, state: &S) -> Result<Self, ProxyError> {
        if let Some(rules) = req.extensions().get::<BodyRules>().cloned() {
            let declared = req
                .headers()
                .get(axum::http::header::CONTENT_LENGTH)
                .and_then(|v| v.to_str().ok())
                .and_then(|v| v.parse::<usize>().ok());
            let (bytes, share) = read_body(req.into_body(), declared, &rules).await?;
            return Ok(Body(bytes, share));
        }
        match Bytes::from_request(req, state).await {
            Ok(bytes) => Ok(Body(bytes, Share::unbounded())),
            Err(rejection) if rejection.status() == StatusCode::PAYLOAD_TOO_LARGE => {
                Err(ProxyError::TooLarge(rejection.body_text()))
            }
            Err(rejection) => Err(ProxyError::BadRequest(rejection.body_text())),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn rules(max_bytes: usize, memory: usize) -> BodyRules {
        let limits = BodyLimits {
            memory_bytes: memory,
            ..BodyLimits::default()
        };
        BodyRules {
            max_bytes,
            limits,
            budget: limits.budget(),
        }
    }

    #[test]
    fn a_body_earns_time_by_the_bytes_it_sends() {
        let limits = BodyLimits::default();
        assert_eq!(limits.allowance(0), Duration::from_secs(10));
        assert_eq!(limits.allowance((128 << 10) - 1), Duration::from_secs(10));
        assert_eq!(limits.allowance(32 << 20), Duration::from_secs(10 + 256));
        let start = Instant::now();
        let mut g = Gathering::new(&rules(1 << 20, 64 << 20), start);
        assert_eq!(g.deadline(), start + Duration::from_secs(10));
        g.push(&vec![b'x'; 256 << 10]).expect("fits");
        assert_eq!(g.deadline(), start + Duration::from_secs(12));
        assert!(matches!(
            g.timed_out(),
            BodyRefusal::TimedOut { received, secs: 12 } if received == 256 << 10
        ));
    }

    #[test]
    fn a_body_is_refused_past_its_limit_or_the_budget_and_gives_its_share_back() {
        let r = rules(100, 64 << 20);
        let mut g = Gathering::new(&r, Instant::now());
        g.push(&[1; 60]).expect("fits");
        assert_eq!(g.push(&[1; 41]), Err(BodyRefusal::TooLarge { limit: 100 }));
        g.push(&[1; 40]).expect("exactly the limit");
        let (bytes, share) = g.finish();
        assert_eq!(bytes.len(), 100);
        assert_eq!(share.held(), 100 * HELD_PER_BYTE);
        assert_eq!(r.budget.used(), share.held());
        drop(share);
        assert_eq!(r.budget.used(), 0);

        // A budget of 60 MiB keeps 10 MiB for small bodies: a body of
        // 10 MiB (50 held) fits, a second does not.
        let r = rules(32 << 20, 60 << 20);
        let mut first = Gathering::new(&r, Instant::now());
        first.push(&vec![0; 10 << 20]).expect("the large lane");
        let mut second = Gathering::new(&r, Instant::now());
        assert!(!second.reserve(1 << 20));
        assert_eq!(
            second.push(&vec![0; 1 << 20]),
            Err(BodyRefusal::OverBudget { budget: 60 << 20 })
        );
        second
            .push(&[0; 1000])
            .expect("a small body uses the reserve");
        drop(first);
        assert!(second.reserve(1 << 20), "room again");
        second.push(&vec![0; 1 << 20]).expect("within its share");
    }

    #[test]
    fn refusals_are_answered_with_their_status() {
        let status = |r: BodyRefusal| ProxyError::from(r).status().as_u16();
        assert_eq!(status(BodyRefusal::TooLarge { limit: 1 }), 413);
        assert_eq!(status(BodyRefusal::OverBudget { budget: 1 }), 503);
        let slow = BodyRefusal::TimedOut {
            received: 1,
            secs: 10,
        };
        assert_eq!(status(slow), 408);
    }
}
