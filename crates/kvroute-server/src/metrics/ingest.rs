//! The ingest side, read at scrape time: each rank's stream counters,
//! connection and state, each worker's role, and the index's sizes and
//! counters.

use std::sync::Arc;

use kvroute_core::index::SharedIndex;
use kvroute_core::scheduler::WorkerRole;
use prometheus_client::collector::Collector;
use prometheus_client::encoding::{DescriptorEncoder, EncodeLabelSet, EncodeMetric};
use prometheus_client::metrics::gauge::ConstGauge;

use super::catalogue::*;
use super::{encode_rank_family, encode_single, MetricInfo, RankLabels, StateLabel};
use crate::ingest::registry::{RankView, Registry as Workers, WorkerView};
use crate::ingest::stats::{RankCounters, RankState};

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

const RANK_COUNTERS: [(MetricInfo, CounterField); 18] = [
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
    (INGEST_EARLY_VERIFIES, |c| c.early_verifies),
    (INGEST_EARLY_REPAIRS, |c| c.early_repairs),
    (INGEST_PERIODIC_REPAIRS, |c| c.periodic_repairs),
];

impl Collector for IngestCollector {
    fn encode(&self, mut encoder: DescriptorEncoder) -> Result<(), std::fmt::Error> {
        let workers = self.workers.view();
        encode_roles(&mut encoder, &workers)?;
        let ranks: Vec<(RankLabels, RankView)> = workers
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

/// Labels of [`WORKER_INFO`]: `{worker="…",role="…"}`.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
struct WorkerRoleLabels<'a> {
    worker: &'a str,
    role: WorkerRole,
}

impl EncodeLabelSet for WorkerRoleLabels<'_> {
    fn encode(
        &self,
        encoder: &mut prometheus_client::encoding::LabelSetEncoder,
    ) -> Result<(), std::fmt::Error> {
        use prometheus_client::encoding::EncodeLabel as _;
        ("worker", self.worker).encode(encoder.encode_label())?;
        ("role", self.role.as_str()).encode(encoder.encode_label())
    }
}

/// Writes each worker's role, one sample of 1 per worker (an info gauge:
/// joined on `worker`, it splits any per-rank metric by role without adding
/// the label to every family).
fn encode_roles(
    encoder: &mut DescriptorEncoder,
    workers: &[WorkerView],
) -> Result<(), std::fmt::Error> {
    let info = WORKER_INFO;
    let mut family =
        encoder.encode_descriptor(info.family(), info.help, None, info.kind.metric_type())?;
    for w in workers {
        let labels = WorkerRoleLabels {
            worker: &w.name,
            role: w.role,
        };
        ConstGauge::new(1).encode(family.encode_family(&labels)?)?;
    }
    Ok(())
}
