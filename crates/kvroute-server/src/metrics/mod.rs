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
//!
//! By area: [`catalogue`] declares every metric and writes the docs' table;
//! [`ingest`] reads the workers' streams and the index; [`proxy`] holds the
//! counters of requests; [`replicas`] reads the replica sync; [`epp`]
//! holds the endpoint picker's counters; [`tenants`] the overload queue's by
//! tenant and priority class. This module
//! holds what they share: the kinds, the label sets, the encoding helpers
//! and the registry.

use std::sync::Arc;

use prometheus_client::collector::Collector;
use prometheus_client::encoding::{DescriptorEncoder, EncodeLabelSet, EncodeMetric};
use prometheus_client::metrics::counter::ConstCounter;
use prometheus_client::metrics::gauge::ConstGauge;
use prometheus_client::metrics::MetricType;
use prometheus_client::registry::Registry;

use crate::ingest::stats::RankState;
use crate::listen::ConnectionMetrics;

pub mod catalogue;
pub mod epp;
pub mod fetch;
pub mod ingest;
pub mod proxy;
pub mod replicas;
pub mod tenants;
#[cfg(test)]
mod tests;

pub use catalogue::*;
pub use ingest::IngestCollector;
pub use proxy::ProxyMetrics;
pub use replicas::ReplicaCollector;

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

    pub(crate) fn metric_type(self) -> MetricType {
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
