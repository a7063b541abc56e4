//! A client-side load balancer over several OpenAI-compatible servers
//! (router replicas): round-robin, and a retry of requests no server began
//! to answer.
//!
//! Request n goes to URL n mod k. When no response head comes back (the
//! port refuses the connection, the host is unreachable, the connect times
//! out, or the connection closes before an answer because the process
//! died) the client has received nothing, so the request is tried on the
//! next URL, each URL at most once per round, for a few rounds with a short
//! backoff between them and never longer than [`RETRY_BUDGET`] in all: a
//! replica that was killed costs the client nothing while another one is
//! up. This is what Envoy's `connect-failure,reset` retry policy does.
//! Every other failure (an error status, a stream cut after its head, a
//! timeout) is not retried: the client already saw part of an answer, or
//! the request may still be running.

use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::time::{Duration, Instant};

use crate::exchange::{exchange, Failure, Measured};
use crate::workload::PlannedRequest;

/// Rounds over every URL before a request whose connections were all
/// refused counts as failed.
pub(crate) const RETRY_ROUNDS: usize = 4;

/// No retry starts later than this after a request's first attempt.
pub(crate) const RETRY_BUDGET: Duration = Duration::from_secs(5);

/// The pause after the first round of refused connections; it doubles
/// after each further round (100, 200, 400 ms: 0.7 s in all).
const FIRST_BACKOFF: Duration = Duration::from_millis(100);

/// The URLs, the round-robin cursor and the retries made so far.
#[derive(Debug)]
pub(crate) struct Balancer {
    urls: Vec<String>,
    next: AtomicUsize,
    retried: AtomicU64,
}

impl Balancer {
    /// A balancer over `urls` (normalized base URLs, at least one).
    pub(crate) fn new(urls: Vec<String>) -> Self {
        Balancer {
            urls,
            next: AtomicUsize::new(0),
            retried: AtomicU64::new(0),
        }
    }

    /// The base URLs, in round-robin order.
    pub(crate) fn urls(&self) -> &[String] {
        &self.urls
    }

    /// Attempts made beyond each request's first, all requests together.
    pub(crate) fn retried(&self) -> u64 {
        self.retried.load(Ordering::Relaxed)
    }

    /// Sends `planned` to the next URL in turn, retrying refused connections
    /// on the following ones; measures it from `scheduled`.
    pub(crate) async fn send(
        &self,
        client: &reqwest::Client,
        planned: &PlannedRequest,
        scheduled: Instant,
    ) -> Result<Measured, Failure> {
        let k = self.urls.len();
        if k == 0 {
            return Err(Failure::other("the balancer has no URL"));
        }
        let first = self.next.fetch_add(1, Ordering::Relaxed) % k;
        let give_up = Instant::now() + RETRY_BUDGET;
        let mut backoff = FIRST_BACKOFF;
        let mut last = None;
        let mut attempts = 0usize;
        'rounds: for round in 0..RETRY_ROUNDS {
            if round > 0 {
                if Instant::now() + backoff >= give_up {
                    break;
                }
                tokio::time::sleep(backoff).await;
                backoff *= 2;
            }
            for i in 0..k {
                if attempts > 0 {
                    if Instant::now() >= give_up {
                        break 'rounds;
                    }
                    self.retried.fetch_add(1, Ordering::Relaxed);
                }
                attempts += 1;
                let url = format!("{}{}", self.urls[(first + i) % k], planned.path);
                match exchange(client, &url, &planned.body, None, scheduled).await {
                    Err(failure) if failure.no_response => {
                        tracing::debug!(%url, error = %failure.message, "no answer began; trying the next URL");
                        last = Some(failure.message);
                    }
                    outcome => return outcome,
                }
            }
        }
        Err(Failure {
            message: format!(
                "no URL accepted the connection in {attempts} attempts (last: {})",
                last.unwrap_or_default()
            ),
            no_response: true,
        })
    }
}
