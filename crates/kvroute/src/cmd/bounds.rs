//! `kvroute serve`'s bounds on what clients and workers may make the router
//! hold: body sizes, how long a request's head and body may take, the memory
//! every request body in flight shares, and how much of a worker's answer is
//! read whole (`kvroute_server::bodies`, `kvroute_server::budget`).

use std::time::Duration;

use clap::Args;
use kvroute_server::bodies::BodyLimits;
use kvroute_server::listen::HttpLimits;
use kvroute_server::proxy::ProxyConfig;
use kvroute_server::query::QueryLimits;
use kvroute_server::ServeConfig;

/// The bounds flags of `kvroute serve`.
#[derive(Debug, Args)]
pub struct BoundsArgs {
    /// Largest request body accepted, in MiB (larger: 413).
    #[arg(long, default_value_t = ServeConfig::default().max_body_bytes >> 20, env = "KVROUTE_MAX_BODY_MIB")]
    max_body_mib: usize,
    /// Largest `/query` or `/query_by_hash` body, in MiB (larger: 413).
    #[arg(long, default_value_t = QueryLimits::default().max_body_bytes >> 20, env = "KVROUTE_QUERY_MAX_BODY_MIB")]
    query_max_body_mib: usize,
    /// `/query` and `/query_by_hash` requests computed at once (more: 429);
    /// default: the number of cores.
    #[arg(long, env = "KVROUTE_QUERY_CONCURRENCY")]
    query_concurrency: Option<usize>,
    /// Seconds a client may take to send a request's head, from its first byte.
    #[arg(long, default_value_t = HttpLimits::default().header_timeout.as_secs(), value_parser = clap::value_parser!(u64).range(1..), env = "KVROUTE_HEADER_TIMEOUT_SECS")]
    header_timeout_secs: u64,
    /// Seconds a kept-alive connection may wait for its next request.
    #[arg(long, default_value_t = HttpLimits::default().idle_timeout.as_secs(), value_parser = clap::value_parser!(u64).range(1..), env = "KVROUTE_IDLE_TIMEOUT_SECS")]
    idle_timeout_secs: u64,
    /// Seconds a request body (over HTTP, or through the endpoint picker)
    /// may take from its head, plus one for every --body-min-rate-kib that
    /// arrived; slower: 408 and the connection closed
    #[arg(long, default_value_t = BodyLimits::default().read_timeout.as_secs(), value_parser = clap::value_parser!(u64).range(1..=3600), env = "KVROUTE_BODY_TIMEOUT_SECS")]
    body_timeout_secs: u64,
    /// KiB of a request body that earn it one more second to arrive
    #[arg(long, default_value_t = (BodyLimits::default().min_rate >> 10) as u64, value_parser = clap::value_parser!(u64).range(1..), env = "KVROUTE_BODY_MIN_RATE_KIB")]
    body_min_rate_kib: u64,
    /// MiB that all request bodies being read or routed may hold at once,
    /// parsing included (a sixth, at most 32, kept for bodies under 256 KiB);
    /// a body that would pass it: 503, retry shortly
    #[arg(long, default_value_t = (BodyLimits::default().memory_bytes >> 20) as u64, value_parser = clap::value_parser!(u64).range(8..), env = "KVROUTE_BODY_MEMORY_MIB")]
    body_memory_mib: u64,
    /// MiB of a worker's answer the router reads whole (a prefill leg's, a
    /// merged P/D answer); more: the leg fails. A longer non-streamed answer
    /// to a client is passed on unread
    #[arg(long, default_value_t = (ProxyConfig::default().max_answer_bytes >> 20) as u64, value_parser = clap::value_parser!(u64).range(1..), env = "KVROUTE_MAX_ANSWER_MIB")]
    max_answer_mib: u64,
}

/// MiB as bytes, saturating.
fn mib(n: u64) -> usize {
    usize::try_from(n)
        .unwrap_or(usize::MAX)
        .saturating_mul(1 << 20)
}

impl BoundsArgs {
    /// The largest request body, in bytes.
    pub fn max_body_bytes(&self) -> usize {
        mib(self.max_body_mib as u64)
    }

    /// The bounds of `/query` and `/query_by_hash`.
    pub fn query(&self) -> QueryLimits {
        QueryLimits {
            max_body_bytes: mib(self.query_max_body_mib as u64),
            concurrency: self
                .query_concurrency
                .unwrap_or(QueryLimits::default().concurrency),
        }
    }

    /// The connection bounds, with `max_connections` at once.
    pub fn http(&self, max_connections: usize) -> HttpLimits {
        HttpLimits {
            max_connections,
            header_timeout: Duration::from_secs(self.header_timeout_secs),
            idle_timeout: Duration::from_secs(self.idle_timeout_secs),
            ..HttpLimits::default()
        }
    }

    /// How long request bodies may take and the memory they share.
    pub fn bodies(&self) -> BodyLimits {
        BodyLimits {
            read_timeout: Duration::from_secs(self.body_timeout_secs),
            min_rate: mib(self.body_min_rate_kib) >> 10,
            memory_bytes: mib(self.body_memory_mib),
        }
    }

    /// The most of a worker's answer read whole, in bytes.
    pub fn max_answer_bytes(&self) -> usize {
        mib(self.max_answer_mib)
    }
}
