//! The endpoint picker's own counters (`kvroute_epp_*`); what it routes is
//! counted by the proxy's metrics, as `kvroute serve`'s requests are.

use std::sync::Arc;

use prometheus_client::collector::Collector;
use prometheus_client::encoding::{DescriptorEncoder, EncodeLabelSet, EncodeMetric};
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::metrics::histogram::Histogram;

use super::catalogue::*;
use super::MetricInfo;

/// Buckets of the decision time, in seconds: 25 µs to 1 s.
const DECISION_BUCKETS: [f64; 13] = [
    25e-6, 50e-6, 100e-6, 200e-6, 500e-6, 1e-3, 2e-3, 5e-3, 0.01, 0.05, 0.1, 0.5, 1.0,
];

/// One label: `status` (an HTTP status) or `reason` (why a stream was refused).
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub enum EppLabel {
    /// `status="429"`.
    Status(u16),
    /// `reason="processing_mode"`.
    Reason(&'static str),
}

impl EncodeLabelSet for EppLabel {
    fn encode(
        &self,
        encoder: &mut prometheus_client::encoding::LabelSetEncoder,
    ) -> Result<(), std::fmt::Error> {
        use prometheus_client::encoding::EncodeLabel as _;
        match self {
            EppLabel::Status(s) => ("status", s.to_string()).encode(encoder.encode_label()),
            EppLabel::Reason(r) => ("reason", *r).encode(encoder.encode_label()),
        }
    }
}

/// What the endpoint picker counts.
#[derive(Debug)]
pub struct EppMetrics {
    /// [`EPP_STREAMS`].
    pub streams: Counter,
    /// [`EPP_STREAMS_OPEN`].
    pub open: Gauge,
    /// [`EPP_PICKS`].
    pub picks: Counter,
    /// [`EPP_IMMEDIATE`].
    pub immediate: Family<EppLabel, Counter>,
    /// [`EPP_REFUSED_STREAMS`].
    pub refused: Family<EppLabel, Counter>,
    /// [`EPP_SERVED_MISMATCH`].
    pub served_mismatch: Counter,
    /// [`EPP_DECISION`].
    pub decision: Histogram,
}

impl Default for EppMetrics {
    fn default() -> Self {
        let refused = Family::<EppLabel, Counter>::default();
        for reason in ["processing_mode", "out_of_order"] {
            let _ = refused.get_or_create(&EppLabel::Reason(reason));
        }
        // The picker's own answers, exported from the start at 0.
        let immediate = Family::<EppLabel, Counter>::default();
        for status in [400, 413, 429, 503] {
            let _ = immediate.get_or_create(&EppLabel::Status(status));
        }
        EppMetrics {
            streams: Counter::default(),
            open: Gauge::default(),
            picks: Counter::default(),
            immediate,
            refused,
            served_mismatch: Counter::default(),
            decision: Histogram::new(DECISION_BUCKETS),
        }
    }
}

impl EppMetrics {
    /// Counts an answer the picker gave itself, with its HTTP status.
    pub fn answered(&self, status: u16) {
        self.immediate
            .get_or_create(&EppLabel::Status(status))
            .inc();
    }
}

/// Reads [`EppMetrics`] into `/metrics` (at 0 when the picker does not run).
#[derive(Debug)]
pub struct EppCollector(pub Arc<EppMetrics>);

fn encode_one(
    encoder: &mut DescriptorEncoder,
    info: &MetricInfo,
    metric: &dyn EncodeMetric,
) -> Result<(), std::fmt::Error> {
    metric.encode(encoder.encode_descriptor(
        info.family(),
        info.help,
        None,
        metric.metric_type(),
    )?)
}

impl Collector for EppCollector {
    fn encode(&self, mut encoder: DescriptorEncoder) -> Result<(), std::fmt::Error> {
        let m = &self.0;
        let all: [(&MetricInfo, &dyn EncodeMetric); 7] = [
            (&EPP_STREAMS, &m.streams),
            (&EPP_STREAMS_OPEN, &m.open),
            (&EPP_PICKS, &m.picks),
            (&EPP_IMMEDIATE, &m.immediate),
            (&EPP_REFUSED_STREAMS, &m.refused),
            (&EPP_SERVED_MISMATCH, &m.served_mismatch),
            (&EPP_DECISION, &m.decision),
        ];
        for (info, metric) in all {
            encode_one(&mut encoder, info, metric)?;
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::listen::ConnectionMetrics;
    use crate::metrics::{Metrics, ProxyMetrics};

    #[test]
    fn the_pickers_metrics_are_scraped_under_their_catalogue_names() {
        let epp = Arc::new(EppMetrics::default());
        epp.streams.inc();
        epp.answered(429);
        epp.answered(429);
        epp.decision.observe(150e-6);
        let collector: Box<dyn Collector> = Box::new(EppCollector(epp.clone()));
        let metrics = Metrics::new(
            &ProxyMetrics::default(),
            &ConnectionMetrics::default(),
            vec![collector],
        );
        let text = metrics.render(None).1;
        for sample in [
            "kvroute_epp_streams_total 1",
            "kvroute_epp_immediate_responses_total{status=\"429\"} 2",
            "kvroute_epp_refused_streams_total{reason=\"processing_mode\"} 0",
            "kvroute_epp_decision_seconds_bucket{le=\"0.0002\"} 1",
            "kvroute_epp_streams_open 0",
        ] {
            assert!(text.contains(sample), "{sample}\n{text}");
        }
    }
}
