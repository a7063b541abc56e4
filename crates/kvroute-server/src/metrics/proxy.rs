//! The counters and histograms the proxy bumps as requests go through it.

use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::histogram::Histogram;
use prometheus_client::registry::Registry;

use super::catalogue::*;
use super::StateLabel;
use crate::api::ErrorKind;
use crate::ingest::stats::RankState;

/// Upper bounds (tokens) of the accuracy histogram's buckets.
const ACCURACY_BUCKETS: [f64; 7] = [0.0, 1.0, 16.0, 64.0, 256.0, 1024.0, 4096.0];

/// Buckets of the proxy's time histograms, in seconds: 5 ms to 2 min.
const SECONDS_BUCKETS: [f64; 14] = [
    0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0,
];

/// The counters the proxy bumps as requests go through it.
#[derive(Debug)]
pub struct ProxyMetrics {
    /// [`PROXY_REQUESTS`].
    pub requests: Counter,
    /// [`PROXY_BAD_REQUESTS`].
    pub bad_requests: Counter,
    /// [`PROXY_UPSTREAM_ERRORS`].
    pub upstream_errors: Counter,
    /// [`PROXY_RETRIES`].
    pub retries: Counter,
    /// [`PROXY_MIGRATIONS`].
    pub migrations: Counter,
    /// [`PROXY_MIGRATIONS_FAILED`].
    pub migrations_failed: Counter,
    /// [`PROXY_OVERLOADED`].
    pub overloaded: Counter,
    /// [`PROXY_QUEUED`].
    pub queued: Counter,
    /// [`PROXY_QUEUE_TIMEOUTS`].
    pub queue_timeouts: Counter,
    /// [`PROXY_NO_WORKERS`].
    pub no_workers: Counter,
    /// [`PROXY_LOAD_ONLY`].
    pub load_only: Counter,
    /// [`PROXY_ENGINE_SCRAPES`].
    pub engine_scrapes: Counter,
    /// [`PROXY_ENGINE_SCRAPE_FAILURES`].
    pub engine_scrape_failures: Counter,
    /// [`PROXY_SESSION_KEPT`].
    pub session_kept: Counter,
    /// [`PROXY_SESSION_MOVED`].
    pub session_moved: Counter,
    /// [`PROXY_CONTINUATION_KEPT`].
    pub continuation_kept: Counter,
    /// [`PROXY_CONTINUATION_UNKNOWN`].
    pub continuation_unknown: Counter,
    /// [`PROXY_CONTINUATION_REFUSED`].
    pub continuation_refused: Counter,
    /// [`PROXY_DISAGG_SPLIT`].
    pub disagg_split: Counter,
    /// [`PROXY_DISAGG_LOCAL`].
    pub disagg_local: Counter,
    /// [`PROXY_MODEL_LISTS_REFUSED`].
    pub model_lists_refused: Counter,
    /// [`PROXY_ERRORS`]; count through [`ProxyMetrics::answered`].
    pub errors: Family<ErrorKind, Counter>,
    /// [`PROXY_TTFT`].
    pub ttft: Histogram,
    /// [`PROXY_LATENCY`].
    pub latency: Histogram,
    /// [`ACCURACY_COMPARISONS`].
    pub comparisons: Family<StateLabel, Counter>,
    /// [`ACCURACY_EXACT`].
    pub exact: Family<StateLabel, Counter>,
    /// [`ACCURACY_DIFFERENCE`].
    pub difference: Family<StateLabel, Histogram>,
    /// The overload queue's, by tenant and priority class.
    pub tenants: super::tenants::TenantMetrics,
    /// Prefixes moved between aggregated workers.
    pub fetch: super::fetch::FetchMetrics,
    /// Hot prefixes copied ahead of demand.
    pub replicas: super::fetch::ReplicaMetrics,
}

impl Default for ProxyMetrics {
    fn default() -> Self {
        ProxyMetrics {
            requests: Counter::default(),
            bad_requests: Counter::default(),
            upstream_errors: Counter::default(),
            retries: Counter::default(),
            migrations: Counter::default(),
            migrations_failed: Counter::default(),
            overloaded: Counter::default(),
            queued: Counter::default(),
            queue_timeouts: Counter::default(),
            no_workers: Counter::default(),
            load_only: Counter::default(),
            engine_scrapes: Counter::default(),
            engine_scrape_failures: Counter::default(),
            session_kept: Counter::default(),
            session_moved: Counter::default(),
            continuation_kept: Counter::default(),
            continuation_unknown: Counter::default(),
            continuation_refused: Counter::default(),
            disagg_split: Counter::default(),
            disagg_local: Counter::default(),
            model_lists_refused: Counter::default(),
            errors: {
                // Every kind exported from the start, at 0.
                let errors = Family::<ErrorKind, Counter>::default();
                for kind in ErrorKind::PROXY {
                    let _ = errors.get_or_create(&kind);
                }
                errors
            },
            ttft: Histogram::new(SECONDS_BUCKETS),
            latency: Histogram::new(SECONDS_BUCKETS),
            comparisons: Family::default(),
            exact: Family::default(),
            difference: Family::new_with_constructor(|| Histogram::new(ACCURACY_BUCKETS)),
            tenants: super::tenants::TenantMetrics::default(),
            fetch: super::fetch::FetchMetrics::default(),
            replicas: super::fetch::ReplicaMetrics::default(),
        }
    }
}

impl ProxyMetrics {
    /// Records the index's prediction of a response's cached tokens against
    /// what the engine reported, under the state of the rank it came from.
    pub fn compare(&self, predicted: u64, reported: u64, state: RankState) {
        let diff = predicted.abs_diff(reported);
        let label = StateLabel::rank_state(state);
        self.comparisons.get_or_create(&label).inc();
        if diff == 0 {
            self.exact.get_or_create(&label).inc();
        }
        self.difference.get_or_create(&label).observe(diff as f64);
    }

    /// Counts an error kvroute answered a completion request with: in
    /// [`PROXY_ERRORS`], and in the older counter of its kind, if any.
    pub fn answered(&self, kind: ErrorKind) {
        self.errors.get_or_create(&kind).inc();
        let older: &[&Counter] = match kind {
            ErrorKind::BadRequest | ErrorKind::ContextTooLong => &[&self.bad_requests],
            ErrorKind::NoWorkers => &[&self.no_workers],
            ErrorKind::Overloaded | ErrorKind::RateLimited => &[&self.overloaded],
            ErrorKind::QueueTimeout => &[&self.overloaded, &self.queue_timeouts],
            _ => &[],
        };
        for counter in older {
            counter.inc();
        }
    }

    /// Registers every counter and histogram in `registry`.
    pub(super) fn register(&self, registry: &mut Registry) {
        let counters = [
            (PROXY_REQUESTS, &self.requests),
            (PROXY_BAD_REQUESTS, &self.bad_requests),
            (PROXY_UPSTREAM_ERRORS, &self.upstream_errors),
            (PROXY_RETRIES, &self.retries),
            (PROXY_MIGRATIONS, &self.migrations),
            (PROXY_MIGRATIONS_FAILED, &self.migrations_failed),
            (PROXY_OVERLOADED, &self.overloaded),
            (PROXY_QUEUED, &self.queued),
            (PROXY_QUEUE_TIMEOUTS, &self.queue_timeouts),
            (PROXY_NO_WORKERS, &self.no_workers),
            (PROXY_LOAD_ONLY, &self.load_only),
            (PROXY_ENGINE_SCRAPES, &self.engine_scrapes),
            (PROXY_ENGINE_SCRAPE_FAILURES, &self.engine_scrape_failures),
            (PROXY_SESSION_KEPT, &self.session_kept),
            (PROXY_SESSION_MOVED, &self.session_moved),
            (PROXY_CONTINUATION_KEPT, &self.continuation_kept),
            (PROXY_CONTINUATION_UNKNOWN, &self.continuation_unknown),
            (PROXY_CONTINUATION_REFUSED, &self.continuation_refused),
            (PROXY_DISAGG_SPLIT, &self.disagg_split),
            (PROXY_DISAGG_LOCAL, &self.disagg_local),
            (PROXY_MODEL_LISTS_REFUSED, &self.model_lists_refused),
        ];
        for (info, counter) in counters {
            registry.register(info.family(), info.help, counter.clone());
        }
        for (info, histogram) in [(PROXY_TTFT, &self.ttft), (PROXY_LATENCY, &self.latency)] {
            registry.register(info.family(), info.help, histogram.clone());
        }
        registry.register(
            PROXY_ERRORS.family(),
            PROXY_ERRORS.help,
            self.errors.clone(),
        );
        for (info, family) in [
            (ACCURACY_COMPARISONS, &self.comparisons),
            (ACCURACY_EXACT, &self.exact),
        ] {
            registry.register(info.family(), info.help, family.clone());
        }
        registry.register(
            ACCURACY_DIFFERENCE.family(),
            ACCURACY_DIFFERENCE.help,
            self.difference.clone(),
        );
        self.tenants.register(registry);
        self.fetch.register(registry);
        self.replicas.register(registry);
    }
}
