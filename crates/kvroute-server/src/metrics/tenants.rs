//! The overload queue's metrics by tenant and by priority class
//! (`kvroute_tenant_*`, `kvroute_priority_*`), with bounded label sets: a
//! tenant is named only when the flags name it (`--tenant-weight`,
//! `--tenant-key`, `--tenant-priority`), every other one is `other`; a
//! priority is one of three classes.

use prometheus_client::encoding::EncodeLabelSet;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::metrics::histogram::Histogram;
use prometheus_client::registry::Registry;
use std::sync::Arc;

use super::catalogue::*;

/// The tenant label of every tenant the flags do not name, and the turn
/// the queue's tenants beyond `--queue-max-tenants` share.
pub const OTHER_TENANT: &str = "other";

/// Buckets of the queue wait, in seconds: 1 ms (0: not queued) to 2 min.
const WAIT_BUCKETS: [f64; 15] = [
    0.0, 0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 120.0,
];

/// `{tenant="…"}`: a tenant the flags name, or [`OTHER_TENANT`].
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct TenantLabel(pub Arc<str>);

impl EncodeLabelSet for TenantLabel {
    fn encode(
        &self,
        encoder: &mut prometheus_client::encoding::LabelSetEncoder,
    ) -> Result<(), std::fmt::Error> {
        use prometheus_client::encoding::EncodeLabel as _;
        ("tenant", &*self.0).encode(encoder.encode_label())
    }
}

/// `{priority="…"}`: the class of a request's `x-priority`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum PriorityClass {
    /// Below 0: served before the default.
    High,
    /// 0, the default.
    Normal,
    /// Above 0: served after the default.
    Low,
}

impl PriorityClass {
    /// Every class, each exported from the start.
    pub const ALL: [PriorityClass; 3] = [
        PriorityClass::High,
        PriorityClass::Normal,
        PriorityClass::Low,
    ];

    /// The class of an `x-priority` (lower is served first).
    pub fn of(priority: i64) -> Self {
        match priority {
            p if p < 0 => PriorityClass::High,
            0 => PriorityClass::Normal,
            _ => PriorityClass::Low,
        }
    }

    /// The label value.
    pub fn as_str(self) -> &'static str {
        match self {
            PriorityClass::High => "high",
            PriorityClass::Normal => "normal",
            PriorityClass::Low => "low",
        }
    }
}

impl EncodeLabelSet for PriorityClass {
    fn encode(
        &self,
        encoder: &mut prometheus_client::encoding::LabelSetEncoder,
    ) -> Result<(), std::fmt::Error> {
        use prometheus_client::encoding::EncodeLabel as _;
        ("priority", self.as_str()).encode(encoder.encode_label())
    }
}

/// What the overload queue counts by tenant and by priority class.
#[derive(Debug)]
pub struct TenantMetrics {
    /// [`TENANT_REQUESTS`].
    pub requests: Family<TenantLabel, Counter>,
    /// [`TENANT_QUEUED`].
    pub queued: Family<TenantLabel, Counter>,
    /// [`TENANT_REFUSED_OVER_SHARE`].
    pub refused: Family<TenantLabel, Counter>,
    /// [`TENANT_WAITING`].
    pub waiting: Family<TenantLabel, Gauge>,
    /// [`PRIORITY_QUEUE_WAIT`].
    pub queue_wait: Family<PriorityClass, Histogram>,
    /// [`TENANT_POOLED`].
    pub pooled: Counter,
    /// [`PRIORITY_CLAMPED`].
    pub priority_clamped: Counter,
}

impl Default for TenantMetrics {
    /// The families with `other` and every priority class at 0.
    fn default() -> Self {
        let metrics = TenantMetrics {
            requests: Family::default(),
            queued: Family::default(),
            refused: Family::default(),
            waiting: Family::default(),
            queue_wait: Family::new_with_constructor(|| Histogram::new(WAIT_BUCKETS)),
            pooled: Counter::default(),
            priority_clamped: Counter::default(),
        };
        metrics.export([OTHER_TENANT]);
        for class in PriorityClass::ALL {
            let _ = metrics.queue_wait.get_or_create(&class);
        }
        metrics
    }
}

impl TenantMetrics {
    /// Exports the tenants `names` at 0 (the ones the flags name).
    pub fn export<'a>(&self, names: impl IntoIterator<Item = &'a str>) {
        for name in names {
            let label = TenantLabel(Arc::from(name));
            let _ = self.requests.get_or_create(&label);
            let _ = self.queued.get_or_create(&label);
            let _ = self.refused.get_or_create(&label);
            let _ = self.waiting.get_or_create(&label);
        }
    }

    /// Registers every family in `registry`.
    pub(super) fn register(&self, registry: &mut Registry) {
        for (info, family) in [
            (TENANT_REQUESTS, &self.requests),
            (TENANT_QUEUED, &self.queued),
            (TENANT_REFUSED_OVER_SHARE, &self.refused),
        ] {
            registry.register(info.family(), info.help, family.clone());
        }
        registry.register(
            TENANT_WAITING.family(),
            TENANT_WAITING.help,
            self.waiting.clone(),
        );
        for (info, counter) in [
            (TENANT_POOLED, &self.pooled),
            (PRIORITY_CLAMPED, &self.priority_clamped),
        ] {
            registry.register(info.family(), info.help, counter.clone());
        }
        registry.register(
            PRIORITY_QUEUE_WAIT.family(),
            PRIORITY_QUEUE_WAIT.help,
            self.queue_wait.clone(),
        );
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn named_tenants_other_and_every_priority_class_are_exported_at_zero() {
        let proxy = super::super::ProxyMetrics::default();
        proxy.tenants.export(["gold"]);
        let http = crate::listen::ConnectionMetrics::default();
        let text = super::super::Metrics::new(&proxy, &http, Vec::new())
            .render(None)
            .1;
        for tenant in ["gold", OTHER_TENANT] {
            for name in [
                "kvroute_tenant_requests_total",
                "kvroute_tenant_queued_total",
                "kvroute_tenant_refused_over_share_total",
                "kvroute_tenant_queue_waiting",
            ] {
                let sample = format!("{name}{{tenant=\"{tenant}\"}} 0");
                assert!(text.contains(&sample), "{sample}\n{text}");
            }
        }
        for class in PriorityClass::ALL {
            let sample = format!(
                "kvroute_priority_queue_wait_seconds_count{{priority=\"{}\"}} 0",
                class.as_str()
            );
            assert!(text.contains(&sample), "{sample}\n{text}");
        }
    }

    #[test]
    fn priorities_fall_into_three_classes() {
        let classes = [-5, -1, 0, 1, 9].map(PriorityClass::of);
        use PriorityClass::*;
        assert_eq!(classes, [High, High, Normal, Low, Low]);
    }
}
