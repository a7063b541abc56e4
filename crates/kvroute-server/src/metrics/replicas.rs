//! The replica sync's metrics (`kvroute_replica_*`), read at scrape time.

use std::sync::Arc;

use prometheus_client::collector::Collector;
use prometheus_client::encoding::{DescriptorEncoder, EncodeMetric};

use super::catalogue::*;
use super::encode_single;
use crate::replica::bus::ReplicaSync;
use crate::replica::pins::PinShare;
use crate::replica::speeds::SpeedShare;

/// The replica sync's metrics (`kvroute_replica_*`), read at scrape time.
#[derive(Debug)]
pub struct ReplicaCollector {
    sync: Arc<ReplicaSync>,
    speeds: Arc<SpeedShare>,
    pins: Arc<PinShare>,
}

impl ReplicaCollector {
    /// A collector over `sync` and the sharing of `speeds` and `pins`.
    pub fn new(sync: Arc<ReplicaSync>, speeds: Arc<SpeedShare>, pins: Arc<PinShare>) -> Self {
        ReplicaCollector { sync, speeds, pins }
    }
}

impl Collector for ReplicaCollector {
    fn encode(&self, mut encoder: DescriptorEncoder) -> Result<(), std::fmt::Error> {
        use std::sync::atomic::Ordering::Relaxed;
        let c = &self.sync.counters;
        let s = &self.speeds.counters;
        let p = &self.pins.counters;
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
            (REPLICA_PINS_SENT, p.sent.load(Relaxed)),
            (REPLICA_PINS_RECEIVED, p.received.load(Relaxed)),
            (REPLICA_PINS_DROPPED, p.dropped.load(Relaxed)),
            (REPLICA_PINS_SKIPPED, p.skipped.load(Relaxed)),
            (
                REPLICA_BUCKETS_RECREATED,
                p.recreated.load(Relaxed) + c.buckets_recreated.load(Relaxed),
            ),
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
