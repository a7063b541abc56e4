//! Every metric `kvroute serve` exposes, declared once, and the one
//! `prometheus-client` registry that `GET /metrics` encodes.
//!
//! [`CATALOGUE`] names each metric as a scraper sees it, with its type,
//! labels and help text; `docs/metrics.md` is generated from it (a test keeps
//! the two equal). Counters the proxy bumps per request are
//! `prometheus-client` counters held in [`ProxyMetrics`]; figures that other
//! parts already keep (each rank's stream counters, the index's sizes, the
//! load in flight) are read at scrape time by collectors, so there is one
//! source for each number. The exposition is the Prometheus text format,
//! which the engines use too, or OpenMetrics when the scraper asks for it.

use std::fmt::Write as _;
use std::sync::Arc;

use kvroute_core::index::SharedIndex;
use prometheus_client::collector::Collector;
use prometheus_client::encoding::{DescriptorEncoder, EncodeLabelSet, EncodeMetric};
use prometheus_client::metrics::counter::{ConstCounter, Counter};
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::ConstGauge;
use prometheus_client::metrics::histogram::Histogram;
use prometheus_client::metrics::MetricType;
use prometheus_client::registry::Registry;

use crate::api::ErrorKind;
use crate::ingest::registry::{RankView, Registry as Workers};
use crate::ingest::stats::{RankCounters, RankState};
use crate::listen::ConnectionMetrics;
use crate::replica::bus::ReplicaSync;
use crate::replica::speeds::SpeedShare;

/// The kind of a metric.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Kind {
    /// Only goes up; its samples end in `_total`.
    Counter,
    /// Goes up and down.
    Gauge,
    /// Buckets, sum and count.
    Histogram,
}

impl Kind {
    /// The name Prometheus gives the kind.
    pub fn as_str(self) -> &'static str {
        match self {
            Kind::Counter => "counter",
            Kind::Gauge => "gauge",
            Kind::Histogram => "histogram",
        }
    }

    fn metric_type(self) -> MetricType {
        match self {
            Kind::Counter => MetricType::Counter,
            Kind::Gauge => MetricType::Gauge,
            Kind::Histogram => MetricType::Histogram,
        }
    }
}

/// One metric: its name as scraped, kind, labels and meaning.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct MetricInfo {
    /// The name in the exposition (counters with their `_total`).
    pub name: &'static str,
    /// Its kind.
    pub kind: Kind,
    /// Its label names.
    pub labels: &'static [&'static str],
    /// What it counts or measures.
    pub help: &'static str,
}

impl MetricInfo {
    /// The name `prometheus-client` registers: counters without `_total`,
    /// which the encoder appends to their samples.
    pub fn family(&self) -> &'static str {
        match self.kind {
            Kind::Counter => self.name.strip_suffix("_total").unwrap_or(self.name),
            Kind::Gauge | Kind::Histogram => self.name,
        }
    }
}

const RANK: &[&str] = &["worker", "dp_rank"];
const RANK_STATE: &[&str] = &["worker", "dp_rank", "state"];
const STATE: &[&str] = &["state"];
const RANK_STATE_ONLY: &[&str] = &["rank_state"];
const NONE: &[&str] = &[];
const KIND: &[&str] = &["kind"];

/// Declares each metric as a constant (documented by its help text) and
/// lists them all, in exposition order, as [`CATALOGUE`].
macro_rules! catalogue {
    ($($id:ident: $name:ident $kind:ident $labels:ident $help:literal;)*) => {
        $(
            #[doc = $help]
            pub const $id: MetricInfo = MetricInfo {
                name: stringify!($name),
                kind: Kind::$kind,
                labels: $labels,
                help: $help,
            };
        )*
        /// Every metric, in exposition order.
        pub const CATALOGUE: &[MetricInfo] = &[$($id),*];
    };
}

catalogue! {
    INGEST_BATCHES:               kvroute_ingest_batches_total                 Counter   RANK "Event batches received live.";
    INGEST_EVENTS:                kvroute_ingest_events_total                  Counter   RANK "Events applied to the index.";
    INGEST_DECODE_ERRORS:         kvroute_ingest_decode_errors_total           Counter   RANK "Malformed events skipped.";
    INGEST_EVENTS_FILTERED:       kvroute_ingest_events_filtered_total         Counter   RANK "Events dropped on purpose (tier, placement, block size).";
    INGEST_ENVELOPE_ERRORS:       kvroute_ingest_envelope_errors_total         Counter   RANK "Batches whose envelope could not be decoded.";
    INGEST_BAD_FRAMES:            kvroute_ingest_bad_frames_total              Counter   RANK "Messages that were not [topic, seq, payload].";
    INGEST_GAPS:                  kvroute_ingest_gaps_total                    Counter   RANK "Sequence gaps detected.";
    INGEST_REPLAYS_OK:            kvroute_ingest_replays_ok_total              Counter   RANK "Replays that filled their gap.";
    INGEST_REPLAYS_INCOMPLETE:    kvroute_ingest_replays_incomplete_total      Counter   RANK "Replays that could not fill their gap.";
    INGEST_ENGINE_RESTARTS:       kvroute_ingest_engine_restarts_total         Counter   RANK "Engine restarts seen (sequence went back).";
    INGEST_RANK_CLEARS:           kvroute_ingest_rank_clears_total             Counter   RANK "Times a rank's blocks were dropped.";
    INGEST_STALE_BATCHES:         kvroute_ingest_stale_batches_total           Counter   RANK "Batches dropped as already applied.";
    INGEST_VERIFIES:              kvroute_ingest_verifies_total                Counter   RANK "Continuity checks that proved the stream continuous.";
    INGEST_REPLAY_TIMEOUTS:       kvroute_ingest_replay_timeouts_total         Counter   RANK "Replays that got no end marker in time.";
    INGEST_FOREIGN_RANK_BATCHES:  kvroute_ingest_foreign_rank_batches_total    Counter   RANK "Batches for a DP rank the worker does not have, dropped.";
    INGEST_CONNECTED:             kvroute_ingest_connected                     Gauge     RANK "Whether the rank's engine is reachable.";
    INGEST_RANK_STATE:            kvroute_ingest_rank_state                    Gauge     RANK_STATE "1 for the rank's current state (live, replaying, unverified, degraded, disconnected, error).";
    INGEST_RANKS:                 kvroute_ingest_ranks                         Gauge     STATE "Ranks in each state.";
    INDEX_NODES:                  kvroute_index_nodes                          Gauge     NONE "Block prefixes in the index, once per index shard holding them.";
    INDEX_RESIDENCIES:            kvroute_index_residencies                    Gauge     NONE "(block, rank, tier) residencies in the index.";
    INDEX_HEAP_BYTES:             kvroute_index_heap_bytes                     Gauge     NONE "Heap bytes held by the index.";
    INDEX_BLOCKS_STORED:          kvroute_index_blocks_stored_total            Counter   NONE "Blocks stored in the index.";
    INDEX_BLOCKS_REMOVED:         kvroute_index_blocks_removed_total           Counter   NONE "Blocks removed from the index.";
    INDEX_DUPLICATE_BLOCKS:       kvroute_index_duplicate_blocks_total         Counter   NONE "Stored blocks a rank already held.";
    INDEX_PARENT_MISSING:         kvroute_index_parent_missing_total           Counter   NONE "Stored events dropped because their parent block was unknown.";
    INDEX_UNKNOWN_REMOVALS:       kvroute_index_unknown_removals_total         Counter   NONE "Removals of blocks the rank did not hold.";
    INDEX_EVICTED_OVER_CAPACITY:  kvroute_index_evicted_over_capacity_total    Counter   NONE "Residencies dropped because a rank was over its cap.";
    INDEX_HASH_CONFLICTS:         kvroute_index_hash_conflicts_total           Counter   NONE "Engine hashes a rank bound to another block than the shared binding.";
    INDEX_APPROX_EXPIRED:         kvroute_index_approx_expired_total           Counter   NONE "Approximate residencies that expired.";
    PROXY_REQUESTS:               kvroute_proxy_requests_total                 Counter   NONE "Completion requests received.";
    PROXY_BAD_REQUESTS:           kvroute_proxy_bad_requests_total             Counter   NONE "Requests refused as malformed.";
    PROXY_UPSTREAM_ERRORS:        kvroute_proxy_upstream_errors_total          Counter   NONE "Attempts a worker failed: connection errors, 503 and 429 refusals, 5xx answers, answers cut off.";
    PROXY_ERRORS:                 kvroute_proxy_errors_total                   Counter   KIND "Completion requests kvroute answered with an error of its own, by kind (a stream cut off mid-way counts as upstream_incomplete).";
    PROXY_RETRIES:                kvroute_proxy_retries_total                  Counter   NONE "Attempts on a further candidate after a failure.";
    PROXY_OVERLOADED:             kvroute_proxy_overloaded_total               Counter   NONE "Requests refused because every candidate was busy.";
    PROXY_QUEUED:                 kvroute_proxy_queued_total                   Counter   NONE "Requests that waited in the overload queue.";
    PROXY_QUEUE_TIMEOUTS:         kvroute_proxy_queue_timeouts_total           Counter   NONE "Queued requests refused when their wait ran out.";
    PROXY_NO_WORKERS:             kvroute_proxy_no_workers_total               Counter   NONE "Requests refused because no worker was available.";
    PROXY_LOAD_ONLY:              kvroute_proxy_load_only_total                Counter   NONE "Text requests routed on load alone (no tokenizer).";
    PROXY_ROUTED:                 kvroute_proxy_routed_total                   Counter   RANK "Requests forwarded per (worker, rank).";
    PROXY_ROUTED_ON_LOAD:         kvroute_proxy_routed_on_load_total           Counter   NONE "Requests forwarded without cache knowledge: no tokens, a load-only policy, or a rank whose history is incomplete.";
    QUALITY_PROMPT_TOKENS:        kvroute_quality_prompt_tokens_total          Counter   NONE "Prompt tokens of responses whose cached_tokens the engine reported.";
    QUALITY_CACHED_TOKENS:        kvroute_quality_cached_tokens_total          Counter   NONE "Cached tokens the engines reported for those responses.";
    QUALITY_PREDICTED_TOKENS:     kvroute_quality_predicted_cached_tokens_total Counter  NONE "Cached tokens the index predicted for those responses.";
    PROXY_TTFT:                   kvroute_proxy_ttft_seconds                   Histogram NONE "From a streamed request's arrival to the worker's first chunk.";
    PROXY_LATENCY:                kvroute_proxy_request_seconds                Histogram NONE "From a request's arrival to the end of its answer.";
    ACCURACY_COMPARISONS:         kvroute_accuracy_comparisons_total           Counter   RANK_STATE_ONLY "Responses whose cached_tokens were compared with the prediction, by the state of the rank the prediction came from.";
    ACCURACY_EXACT:               kvroute_accuracy_exact_total                 Counter   RANK_STATE_ONLY "Comparisons where prediction and cached_tokens agreed exactly.";
    ACCURACY_DIFFERENCE:          kvroute_accuracy_difference_tokens           Histogram RANK_STATE_ONLY "|predicted cached tokens - engine cached_tokens|.";
    ACTIVE_REQUESTS:              kvroute_active_requests                      Gauge     RANK "Requests in flight per (worker, rank).";
    ACTIVE_PREFILL_TOKENS:        kvroute_active_prefill_tokens                Gauge     RANK "Prompt tokens still to prefill per (worker, rank).";
    HTTP_CONNECTIONS:             kvroute_http_connections                     Gauge     NONE "Client connections open.";
    HTTP_CONNECTIONS_REFUSED:     kvroute_http_connections_refused_total       Counter   NONE "Connections closed on arrival because --max-connections were open.";
    HTTP_HEADER_TIMEOUTS:         kvroute_http_header_timeouts_total           Counter   NONE "Connections closed because a request head took longer than --header-timeout-secs.";
    HTTP_IDLE_TIMEOUTS:           kvroute_http_idle_timeouts_total             Counter   NONE "Kept-alive connections closed after --idle-timeout-secs without a request.";
    ACTIVE_DECODE_BLOCKS:         kvroute_active_decode_blocks                 Gauge     RANK "Distinct blocks held by requests in flight per (worker, rank).";
    RANK_SPEED:                   kvroute_rank_speed                           Gauge     RANK "The speed a rank is priced at: learned from its responses once known (--learn-speeds), else its worker's declared speed.";
    REPLICA_NATS_CONNECTED:       kvroute_replica_nats_connected               Gauge     NONE "Whether this replica is connected to NATS (--nats).";
    REPLICA_NATS_OUTAGES:         kvroute_replica_nats_outages_total           Counter   NONE "Times the NATS connection went down.";
    REPLICA_PEERS:                kvroute_replica_peers                        Gauge     NONE "Peer replicas heard within the last 3.5 s.";
    REPLICA_MESSAGES_SENT:        kvroute_replica_messages_sent_total          Counter   NONE "Messages published to the peers.";
    REPLICA_MESSAGES_RECEIVED:    kvroute_replica_messages_received_total      Counter   NONE "Peer messages received.";
    REPLICA_MESSAGES_LOST:        kvroute_replica_messages_lost_total          Counter   NONE "Peer messages that never arrived (sequence gaps).";
    REPLICA_MESSAGES_UNDECODABLE: kvroute_replica_messages_undecodable_total   Counter   NONE "Replica messages skipped as undecodable.";
    REPLICA_EVENTS_DROPPED:       kvroute_replica_events_dropped_total         Counter   NONE "In-flight events not published (NATS down or too slow); the whole state is resent.";
    REPLICA_UNKNOWN_WORKERS:      kvroute_replica_unknown_workers_total        Counter   NONE "Peer events and speed observations about a worker or rank this replica does not have.";
    REPLICA_RESYNCS_SENT:         kvroute_replica_resyncs_sent_total           Counter   NONE "Times this replica sent its whole in-flight state.";
    REPLICA_RESYNCS_ASKED:        kvroute_replica_resyncs_asked_total          Counter   NONE "Times this replica asked a peer for its whole state.";
    REPLICA_PEERS_EXPIRED:        kvroute_replica_peers_expired_total          Counter   NONE "Peers forgotten, with their requests, after 3.5 s of silence.";
    REPLICA_ID_CONFLICTS:         kvroute_replica_id_conflicts_total           Counter   NONE "Messages skipped because another router uses this replica's --replica-id.";
    REPLICA_SNAPSHOTS_WRITTEN:    kvroute_replica_snapshots_written_total      Counter   NONE "Index snapshots written to the JetStream object store.";
    REPLICA_SNAPSHOT_FAILURES:    kvroute_replica_snapshot_failures_total      Counter   NONE "Index snapshots the object store did not take.";
    REPLICA_SPEEDS_SENT:          kvroute_replica_speed_observations_sent_total     Counter NONE "Speed observations (one per streamed response) published to the peers (--learn-speeds).";
    REPLICA_SPEEDS_RECEIVED:      kvroute_replica_speed_observations_received_total Counter NONE "Peers' speed observations fed to this replica's learner.";
    REPLICA_SPEEDS_DROPPED:       kvroute_replica_speed_observations_dropped_total  Counter NONE "Speed observations not published: NATS was down or too slow.";
    REPLICA_PEER_DELAY:           kvroute_replica_peer_delay_seconds           Histogram NONE "Delay from a peer's admission of a request to this replica applying it.";
    REPLICA_PUBLISH_COST:         kvroute_replica_publish_seconds              Histogram NONE "Time a request spends handing an event to the outbox.";
    STATE_SNAPSHOTS_WRITTEN:      kvroute_state_snapshots_written_total        Counter   NONE "Router state snapshots written to --state-dir (every --snapshot-secs and at shutdown).";
    STATE_SNAPSHOT_FAILURES:      kvroute_state_snapshot_failures_total        Counter   NONE "Router state snapshots that could not be written to --state-dir.";
}

/// The catalogue as the Markdown table of `docs/metrics.md`.
pub fn catalogue_table() -> String {
    let mut out = String::from("| metric | type | labels | meaning |\n| --- | --- | --- | --- |\n");
    for m in CATALOGUE {
        let labels = if m.labels.is_empty() {
            "-".to_owned()
        } else {
            m.labels.join(", ")
        };
        let help = m.help.replace('|', "\\|");
        let _ = writeln!(
            out,
            "| `{}` | {} | {labels} | {help} |",
            m.name,
            m.kind.as_str()
        );
    }
    out
}

/// The labels of a per-rank metric: `{worker="…",dp_rank="…"}`.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct RankLabels {
    /// The worker's name.
    pub worker: Arc<str>,
    /// The rank.
    pub dp_rank: u32,
}

impl EncodeLabelSet for RankLabels {
    fn encode(
        &self,
        encoder: &mut prometheus_client::encoding::LabelSetEncoder,
    ) -> Result<(), std::fmt::Error> {
        use prometheus_client::encoding::EncodeLabel as _;
        ("worker", &*self.worker).encode(encoder.encode_label())?;
        ("dp_rank", self.dp_rank.to_string()).encode(encoder.encode_label())
    }
}

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
}

impl Default for ProxyMetrics {
    fn default() -> Self {
        ProxyMetrics {
            requests: Counter::default(),
            bad_requests: Counter::default(),
            upstream_errors: Counter::default(),
            retries: Counter::default(),
            overloaded: Counter::default(),
            queued: Counter::default(),
            queue_timeouts: Counter::default(),
            no_workers: Counter::default(),
            load_only: Counter::default(),
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
            ErrorKind::Overloaded => &[&self.overloaded],
            ErrorKind::QueueTimeout => &[&self.overloaded, &self.queue_timeouts],
            _ => &[],
        };
        for counter in older {
            counter.inc();
        }
    }

    fn register(&self, registry: &mut Registry) {
        let counters = [
            (PROXY_REQUESTS, &self.requests),
            (PROXY_BAD_REQUESTS, &self.bad_requests),
            (PROXY_UPSTREAM_ERRORS, &self.upstream_errors),
            (PROXY_RETRIES, &self.retries),
            (PROXY_OVERLOADED, &self.overloaded),
            (PROXY_QUEUED, &self.queued),
            (PROXY_QUEUE_TIMEOUTS, &self.queue_timeouts),
            (PROXY_NO_WORKERS, &self.no_workers),
            (PROXY_LOAD_ONLY, &self.load_only),
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
    }
}

/// Writes one per-rank family: a descriptor, then one sample per rank.
pub fn encode_rank_family<'a>(
    encoder: &mut DescriptorEncoder,
    info: &MetricInfo,
    rows: impl IntoIterator<Item = (&'a RankLabels, u64)>,
) -> Result<(), std::fmt::Error> {
    let mut family =
        encoder.encode_descriptor(info.family(), info.help, None, info.kind.metric_type())?;
    for (labels, value) in rows {
        let sample = family.encode_family(labels)?;
        match info.kind {
            Kind::Counter => ConstCounter::new(value).encode(sample)?,
            Kind::Gauge | Kind::Histogram => {
                ConstGauge::new(i64::try_from(value).unwrap_or(i64::MAX)).encode(sample)?
            }
        }
    }
    Ok(())
}

/// Writes one per-rank gauge of fractional values.
pub fn encode_rank_ratios(
    encoder: &mut DescriptorEncoder,
    info: &MetricInfo,
    rows: impl IntoIterator<Item = (RankLabels, f64)>,
) -> Result<(), std::fmt::Error> {
    let mut family =
        encoder.encode_descriptor(info.family(), info.help, None, info.kind.metric_type())?;
    for (labels, value) in rows {
        ConstGauge::new(value).encode(family.encode_family(&labels)?)?;
    }
    Ok(())
}

/// Writes one unlabelled counter or gauge.
pub fn encode_single(
    encoder: &mut DescriptorEncoder,
    info: &MetricInfo,
    value: u64,
) -> Result<(), std::fmt::Error> {
    let metric =
        encoder.encode_descriptor(info.family(), info.help, None, info.kind.metric_type())?;
    match info.kind {
        Kind::Counter => ConstCounter::new(value).encode(metric),
        Kind::Gauge | Kind::Histogram => {
            ConstGauge::new(i64::try_from(value).unwrap_or(i64::MAX)).encode(metric)
        }
    }
}

/// Reads each rank's stream counters and connection from the worker
/// registry, and the index's sizes and counters, at scrape time.
#[derive(Debug)]
pub struct IngestCollector {
    workers: Arc<Workers>,
    index: Arc<SharedIndex>,
}

impl IngestCollector {
    /// A collector over these workers and this index.
    pub fn new(workers: Arc<Workers>, index: Arc<SharedIndex>) -> Self {
        IngestCollector { workers, index }
    }
}

type CounterField = fn(&RankCounters) -> u64;

const RANK_COUNTERS: [(MetricInfo, CounterField); 15] = [
    (INGEST_BATCHES, |c| c.batches),
    (INGEST_EVENTS, |c| c.events),
    (INGEST_DECODE_ERRORS, |c| c.decode_errors),
    (INGEST_EVENTS_FILTERED, |c| c.events_filtered),
    (INGEST_ENVELOPE_ERRORS, |c| c.envelope_errors),
    (INGEST_BAD_FRAMES, |c| c.bad_frames),
    (INGEST_GAPS, |c| c.gaps),
    (INGEST_REPLAYS_OK, |c| c.replays_ok),
    (INGEST_REPLAYS_INCOMPLETE, |c| c.replays_incomplete),
    (INGEST_ENGINE_RESTARTS, |c| c.engine_restarts),
    (INGEST_RANK_CLEARS, |c| c.clears),
    (INGEST_STALE_BATCHES, |c| c.stale),
    (INGEST_VERIFIES, |c| c.verifies),
    (INGEST_REPLAY_TIMEOUTS, |c| c.replay_timeouts),
    (INGEST_FOREIGN_RANK_BATCHES, |c| c.foreign_rank_batches),
];

impl Collector for IngestCollector {
    fn encode(&self, mut encoder: DescriptorEncoder) -> Result<(), std::fmt::Error> {
        let ranks: Vec<(RankLabels, RankView)> = self
            .workers
            .view()
            .into_iter()
            .flat_map(|w| {
                let worker: Arc<str> = Arc::from(w.name.as_str());
                w.ranks.into_iter().map(move |r| {
                    let labels = RankLabels {
                        worker: worker.clone(),
                        dp_rank: r.dp_rank.0,
                    };
                    (labels, r)
                })
            })
            .collect();
        for (info, field) in RANK_COUNTERS {
            let rows = ranks.iter().map(|(l, r)| (l, field(&r.counters)));
            encode_rank_family(&mut encoder, &info, rows)?;
        }
        let connected = ranks.iter().map(|(l, r)| (l, u64::from(r.connected)));
        encode_rank_family(&mut encoder, &INGEST_CONNECTED, connected)?;
        encode_states(&mut encoder, &ranks)?;
        let (counters, stats) = {
            let index = self.index.frozen();
            (index.counters(), index.stats())
        };
        let singles = [
            (INDEX_NODES, stats.nodes),
            (INDEX_RESIDENCIES, stats.residencies),
            (INDEX_HEAP_BYTES, stats.heap_bytes),
            (INDEX_BLOCKS_STORED, counters.blocks_stored),
            (INDEX_BLOCKS_REMOVED, counters.blocks_removed),
            (INDEX_DUPLICATE_BLOCKS, counters.duplicate_blocks),
            (INDEX_PARENT_MISSING, counters.parent_missing),
            (INDEX_UNKNOWN_REMOVALS, counters.unknown_removals),
            (INDEX_EVICTED_OVER_CAPACITY, counters.evicted_over_capacity),
            (INDEX_HASH_CONFLICTS, counters.hash_conflicts),
            (INDEX_APPROX_EXPIRED, counters.approx_expired),
        ];
        for (info, value) in singles {
            encode_single(&mut encoder, &info, value)?;
        }
        Ok(())
    }
}

/// Labels of [`INGEST_RANK_STATE`].
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
struct RankStateLabels<'a> {
    rank: &'a RankLabels,
    state: RankState,
}

impl EncodeLabelSet for RankStateLabels<'_> {
    fn encode(
        &self,
        encoder: &mut prometheus_client::encoding::LabelSetEncoder,
    ) -> Result<(), std::fmt::Error> {
        use prometheus_client::encoding::EncodeLabel as _;
        self.rank.encode(encoder)?;
        ("state", self.state.as_str()).encode(encoder.encode_label())
    }
}

/// Writes each rank's state (one sample per rank) and the count per state.
fn encode_states(
    encoder: &mut DescriptorEncoder,
    ranks: &[(RankLabels, RankView)],
) -> Result<(), std::fmt::Error> {
    let info = INGEST_RANK_STATE;
    let mut family =
        encoder.encode_descriptor(info.family(), info.help, None, info.kind.metric_type())?;
    for (rank, view) in ranks {
        let labels = RankStateLabels {
            rank,
            state: view.state,
        };
        ConstGauge::new(1).encode(family.encode_family(&labels)?)?;
    }
    let info = INGEST_RANKS;
    let mut family =
        encoder.encode_descriptor(info.family(), info.help, None, info.kind.metric_type())?;
    for state in RankState::ALL {
        let n = ranks.iter().filter(|(_, v)| v.state == state).count();
        let labels = StateLabel {
            rank_state: None,
            state,
        };
        ConstGauge::new(n as i64).encode(family.encode_family(&labels)?)?;
    }
    Ok(())
}

/// A label naming a rank state: `state` (the ranks gauge) or `rank_state`
/// (the accuracy metrics, the state of the rank a prediction came from).
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct StateLabel {
    rank_state: Option<()>,
    state: RankState,
}

impl StateLabel {
    /// The `rank_state` label of the accuracy metrics.
    pub fn rank_state(state: RankState) -> Self {
        StateLabel {
            rank_state: Some(()),
            state,
        }
    }
}

impl EncodeLabelSet for StateLabel {
    fn encode(
        &self,
        encoder: &mut prometheus_client::encoding::LabelSetEncoder,
    ) -> Result<(), std::fmt::Error> {
        use prometheus_client::encoding::EncodeLabel as _;
        let name = if self.rank_state.is_some() {
            "rank_state"
        } else {
            "state"
        };
        (name, self.state.as_str()).encode(encoder.encode_label())
    }
}

/// The router's metrics registry: the proxy's counters and every collector.
#[derive(Debug)]
pub struct Metrics {
    registry: Registry,
}

/// The `Content-Type` of OpenMetrics text.
const OPENMETRICS: &str = "application/openmetrics-text; version=1.0.0; charset=utf-8";

impl Metrics {
    /// A registry with `proxy`'s counters, the HTTP server's and the given collectors.
    pub fn new(
        proxy: &ProxyMetrics,
        http: &ConnectionMetrics,
        collectors: Vec<Box<dyn Collector>>,
    ) -> Self {
        let mut registry = Registry::default();
        for collector in collectors {
            registry.register_collector(collector);
        }
        proxy.register(&mut registry);
        registry.register(
            HTTP_CONNECTIONS.family(),
            HTTP_CONNECTIONS.help,
            http.open.clone(),
        );
        let counters = [
            (HTTP_CONNECTIONS_REFUSED, &http.refused),
            (HTTP_HEADER_TIMEOUTS, &http.header_timeouts),
            (HTTP_IDLE_TIMEOUTS, &http.idle_timeouts),
        ];
        for (info, counter) in counters {
            registry.register(info.family(), info.help, counter.clone());
        }
        Metrics { registry }
    }

    /// The exposition and its content type: OpenMetrics when `accept`
    /// asks for it, the Prometheus text format otherwise.
    pub fn render(&self, accept: Option<&str>) -> (&'static str, String) {
        let mut out = String::new();
        let openmetrics = accept.is_some_and(|a| a.contains("application/openmetrics-text"));
        // Writing into a String cannot fail; an encoder error would be a bug
        // in a collector, and then the exposition is cut where it happened.
        if openmetrics {
            let _ = prometheus_client::encoding::text::encode(&mut out, &self.registry);
            (OPENMETRICS, out)
        } else {
            let _ = prometheus_client::encoding::prometheus_text::encode(&mut out, &self.registry);
            (
                prometheus_client::encoding::prometheus_text::CONTENT_TYPE,
                out,
            )
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// `UPDATE_DOCS=1 cargo test -p kvroute-server the_docs` rewrites the
    /// table in place after a change to the catalogue.
    #[test]
    fn the_docs_list_the_catalogue() {
        let path = concat!(env!("CARGO_MANIFEST_DIR"), "/../../docs/metrics.md");
        let doc = std::fs::read_to_string(path).expect("docs/metrics.md");
        let table = catalogue_table();
        if std::env::var_os("UPDATE_DOCS").is_some() {
            let start = doc.find("| metric |").unwrap_or(doc.len());
            let end = doc[start..]
                .find("\n\n")
                .map_or(doc.len(), |i| start + i + 1);
            let updated = format!("{}{table}{}", &doc[..start], &doc[end..]);
            std::fs::write(path, updated).expect("write docs/metrics.md");
            return;
        }
        assert!(
            doc.contains(&table),
            "docs/metrics.md must contain the catalogue table as generated \
             (UPDATE_DOCS=1 rewrites it):\n\n{table}"
        );
    }

    #[test]
    fn every_name_is_unique_and_counters_end_in_total() {
        let mut names: Vec<&str> = CATALOGUE.iter().map(|m| m.name).collect();
        names.sort_unstable();
        names.dedup();
        assert_eq!(names.len(), CATALOGUE.len());
        for m in CATALOGUE {
            assert_eq!(
                m.kind == Kind::Counter,
                m.name.ends_with("_total"),
                "{}",
                m.name
            );
            assert!(m.name.starts_with("kvroute_"), "{}", m.name);
        }
    }

    #[test]
    fn every_error_kind_is_exported_and_counted_with_its_older_counter() {
        let (proxy, http) = (ProxyMetrics::default(), ConnectionMetrics::default());
        let metrics = Metrics::new(&proxy, &http, Vec::new());
        let text = metrics.render(None).1;
        for kind in ErrorKind::PROXY {
            let sample = format!("kvroute_proxy_errors_total{{kind=\"{}\"}} 0", kind.label());
            assert!(text.contains(&sample), "{sample}\n{text}");
        }
        for kind in [
            ErrorKind::QueueTimeout,
            ErrorKind::ContextTooLong,
            ErrorKind::UpstreamIncomplete,
        ] {
            proxy.answered(kind);
        }
        let text = metrics.render(None).1;
        for sample in [
            "kvroute_proxy_errors_total{kind=\"queue_timeout\"} 1",
            "kvroute_proxy_errors_total{kind=\"upstream_incomplete\"} 1",
            "kvroute_proxy_overloaded_total 1",
            "kvroute_proxy_queue_timeouts_total 1",
            "kvroute_proxy_bad_requests_total 1",
            "kvroute_proxy_no_workers_total 0",
        ] {
            assert!(text.contains(sample), "{sample}\n{text}");
        }
    }

    #[test]
    fn the_accuracy_histogram_is_cumulative() {
        let proxy = ProxyMetrics::default();
        proxy.compare(48, 48, RankState::Live);
        proxy.compare(64, 48, RankState::Live);
        proxy.compare(0, 48, RankState::Degraded);
        let (_, text) =
            Metrics::new(&proxy, &ConnectionMetrics::default(), Vec::new()).render(None);
        let live = "rank_state=\"live\"";
        assert!(text.contains(&format!("kvroute_accuracy_comparisons_total{{{live}}} 2")));
        assert!(text.contains(&format!("kvroute_accuracy_exact_total{{{live}}} 1")));
        assert!(text.contains("kvroute_accuracy_comparisons_total{rank_state=\"degraded\"} 1"));
        let bucket = "kvroute_accuracy_difference_tokens_bucket";
        assert!(
            text.contains(&format!("{bucket}{{{live},le=\"0\"}} 1")),
            "{text}"
        );
        assert!(text.contains(&format!("{bucket}{{{live},le=\"16\"}} 2")));
    }
}

/// The replica sync's metrics (`kvroute_replica_*`), read at scrape time.
#[derive(Debug)]
pub struct ReplicaCollector {
    sync: Arc<ReplicaSync>,
    speeds: Arc<SpeedShare>,
}

impl ReplicaCollector {
    /// A collector over `sync` and the sharing of `speeds`.
    pub fn new(sync: Arc<ReplicaSync>, speeds: Arc<SpeedShare>) -> Self {
        ReplicaCollector { sync, speeds }
    }
}

impl Collector for ReplicaCollector {
    fn encode(&self, mut encoder: DescriptorEncoder) -> Result<(), std::fmt::Error> {
        use std::sync::atomic::Ordering::Relaxed;
        let c = &self.sync.counters;
        let s = &self.speeds.counters;
        let view = self.sync.view();
        let singles = [
            (REPLICA_NATS_CONNECTED, u64::from(view.connected)),
            (REPLICA_NATS_OUTAGES, c.outages.load(Relaxed)),
            (REPLICA_PEERS, view.peers.len() as u64),
            (REPLICA_MESSAGES_SENT, c.sent.load(Relaxed)),
            (REPLICA_MESSAGES_RECEIVED, c.received.load(Relaxed)),
            (REPLICA_MESSAGES_LOST, c.lost.load(Relaxed)),
            (
                REPLICA_MESSAGES_UNDECODABLE,
                c.undecodable.load(Relaxed) + s.undecodable.load(Relaxed),
            ),
            (REPLICA_EVENTS_DROPPED, view.dropped_events),
            (
                REPLICA_UNKNOWN_WORKERS,
                c.unknown_workers.load(Relaxed) + s.unknown.load(Relaxed),
            ),
            (REPLICA_RESYNCS_SENT, c.resyncs_sent.load(Relaxed)),
            (REPLICA_RESYNCS_ASKED, c.resyncs_asked.load(Relaxed)),
            (REPLICA_PEERS_EXPIRED, c.peers_expired.load(Relaxed)),
            (REPLICA_ID_CONFLICTS, c.id_conflicts.load(Relaxed)),
            (REPLICA_SNAPSHOTS_WRITTEN, c.snapshots_written.load(Relaxed)),
            (REPLICA_SNAPSHOT_FAILURES, c.snapshot_failures.load(Relaxed)),
            (REPLICA_SPEEDS_SENT, s.sent.load(Relaxed)),
            (REPLICA_SPEEDS_RECEIVED, s.received.load(Relaxed)),
            (REPLICA_SPEEDS_DROPPED, s.dropped.load(Relaxed)),
        ];
        for (info, value) in singles {
            encode_single(&mut encoder, &info, value)?;
        }
        for (info, histogram) in [
            (REPLICA_PEER_DELAY, self.sync.delay_histogram()),
            (REPLICA_PUBLISH_COST, self.sync.outbox().cost_histogram()),
        ] {
            let metric = encoder.encode_descriptor(
                info.family(),
                info.help,
                None,
                info.kind.metric_type(),
            )?;
            histogram.encode(metric)?;
        }
        Ok(())
    }
}
