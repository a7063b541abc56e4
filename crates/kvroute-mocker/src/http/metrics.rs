//! `GET /metrics`: every metric of an engine declared once (name, help,
//! type), its values read from the ranks at scrape time, encoded by
//! `prometheus-client`.
//!
//! The metrics are named as the imitated engine names them (`vllm:` or
//! `sglang:` prefixes; rank label `engine` or `dp_rank`), plus the mocker's
//! own `kvroute_mocker_` metrics; a prefill or decode engine adds its
//! transfer metrics (labelled `model_name` only, but for the held blocks of
//! each rank), a `both` engine has none. Both engines serve the classic Prometheus
//! text format (Python `prometheus_client`'s default: a counter's HELP and
//! TYPE lines name its `_total` sample, no `# EOF`), so that is the default
//! here too, from `prometheus_client::encoding::prometheus_text`; a scraper
//! whose `Accept` header asks for `application/openmetrics-text` gets
//! OpenMetrics (family names without `_total`, `# EOF`).

use std::fmt;
use std::sync::atomic::Ordering;
use std::sync::Arc;

use axum::http::HeaderValue;
use prometheus_client::collector::Collector;
use prometheus_client::encoding::{DescriptorEncoder, EncodeMetric};
use prometheus_client::metrics::counter::ConstCounter;
use prometheus_client::metrics::gauge::ConstGauge;
use prometheus_client::metrics::MetricType;
use prometheus_client::registry::Registry;

use super::handoff::HandoffStats;
use super::EngineState;
use crate::config::Role;
use crate::engine::EngineStats;
use kvroute_core::event::WorkerFlavor;

/// One rank's counters, read once per scrape.
#[derive(Debug, Clone, Copy)]
struct RankSnapshot {
    rank: u32,
    engine: EngineStats,
    batches: u64,
    events: u64,
    dropped: u64,
    replays: u64,
    restarts: u64,
}

impl RankSnapshot {
    fn usage(&self) -> f64 {
        self.engine.used_blocks as f64 / self.engine.total_blocks.max(1) as f64
    }

    fn hit_rate(&self) -> f64 {
        let s = &self.engine;
        if s.prefix_cache_queries_total == 0 {
            0.0
        } else {
            s.prefix_cache_hits_total as f64 / s.prefix_cache_queries_total as f64
        }
    }
}

/// How a metric's value is read from a rank, and so its type.
#[derive(Clone, Copy)]
enum Value {
    /// A counter.
    Counter(fn(&RankSnapshot) -> u64),
    /// A gauge holding a count.
    Count(fn(&RankSnapshot) -> u64),
    /// A gauge holding a fraction.
    Ratio(fn(&RankSnapshot) -> f64),
}

/// One metric: its exposed name (a counter's with `_total`), help and value.
struct Metric {
    name: &'static str,
    help: &'static str,
    value: Value,
}

const fn metric(name: &'static str, help: &'static str, value: Value) -> Metric {
    Metric { name, help, value }
}

/// vLLM's names.
const VLLM: &[Metric] = &[
    metric(
        "vllm:num_requests_running",
        "Requests in model execution batches.",
        Value::Count(|r| r.engine.running as u64),
    ),
    metric(
        "vllm:num_requests_waiting",
        "Requests waiting to be processed.",
        Value::Count(|r| r.engine.waiting as u64),
    ),
    metric(
        "vllm:kv_cache_usage_perc",
        "KV-cache usage: 1 means 100 percent.",
        Value::Ratio(RankSnapshot::usage),
    ),
    metric(
        "vllm:prompt_tokens_total",
        "Prefill tokens processed.",
        Value::Counter(|r| r.engine.prompt_tokens_total),
    ),
    metric(
        "vllm:generation_tokens_total",
        "Generation tokens processed.",
        Value::Counter(|r| r.engine.generation_tokens_total),
    ),
    metric(
        "vllm:prefix_cache_queries_total",
        "Prefix-cache queries, in tokens.",
        Value::Counter(|r| r.engine.prefix_cache_queries_total),
    ),
    metric(
        "vllm:prefix_cache_hits_total",
        "Prefix-cache hits, in tokens.",
        Value::Counter(|r| r.engine.prefix_cache_hits_total),
    ),
    metric(
        "vllm:num_preemptions_total",
        "Cumulative number of preemptions.",
        Value::Counter(|r| r.engine.preemptions_total),
    ),
    metric(
        "vllm:request_success_total",
        "Successfully processed requests.",
        Value::Counter(|r| r.engine.requests_finished_total),
    ),
];

/// SGLang's names.
const SGLANG: &[Metric] = &[
    metric(
        "sglang:num_running_reqs",
        "The number of running requests.",
        Value::Count(|r| r.engine.running as u64),
    ),
    metric(
        "sglang:num_queue_reqs",
        "The number of requests in the waiting queue.",
        Value::Count(|r| r.engine.waiting as u64),
    ),
    metric(
        "sglang:token_usage",
        "The token usage.",
        Value::Ratio(RankSnapshot::usage),
    ),
    metric(
        "sglang:cache_hit_rate",
        "The prefix cache hit rate.",
        Value::Ratio(RankSnapshot::hit_rate),
    ),
    metric(
        "sglang:prompt_tokens_total",
        "Number of prefill tokens processed.",
        Value::Counter(|r| r.engine.prompt_tokens_total),
    ),
    metric(
        "sglang:generation_tokens_total",
        "Number of generation tokens processed.",
        Value::Counter(|r| r.engine.generation_tokens_total),
    ),
    metric(
        "sglang:num_requests_total",
        "Number of requests processed.",
        Value::Counter(|r| r.engine.requests_finished_total),
    ),
];

/// TensorRT-LLM's gauges as `trtllm-serve` names them (what public scrapers
/// of its `/metrics` read; it publishes no cache configuration).
const TRTLLM: &[Metric] = &[
    metric(
        "trtllm_num_requests_running",
        "Requests in the running batch.",
        Value::Count(|r| r.engine.running as u64),
    ),
    metric(
        "trtllm_num_requests_waiting",
        "Requests waiting to be scheduled.",
        Value::Count(|r| r.engine.waiting as u64),
    ),
    metric(
        "trtllm_kv_cache_utilization",
        "Fraction of the GPU KV-cache blocks in use.",
        Value::Ratio(RankSnapshot::usage),
    ),
    metric(
        "trtllm_kv_cache_hit_rate",
        "Prefix-cache hit rate.",
        Value::Ratio(RankSnapshot::hit_rate),
    ),
];

/// The mocker's own metrics, for every flavour.
const OWN: &[Metric] = &[
    metric(
        "kvroute_mocker_kv_batches_total",
        "KV-event batches numbered (live or dropped).",
        Value::Counter(|r| r.batches),
    ),
    metric(
        "kvroute_mocker_kv_events_total",
        "KV events published.",
        Value::Counter(|r| r.events),
    ),
    metric(
        "kvroute_mocker_kv_batches_dropped_total",
        "Batches kept off the live socket by --drop-every.",
        Value::Counter(|r| r.dropped),
    ),
    metric(
        "kvroute_mocker_replays_total",
        "Replay requests answered.",
        Value::Counter(|r| r.replays),
    ),
    metric(
        "kvroute_mocker_publisher_restarts_total",
        "Simulated publisher restarts.",
        Value::Counter(|r| r.restarts),
    ),
    metric(
        "kvroute_mocker_evicted_blocks_total",
        "Blocks evicted from the prefix cache.",
        Value::Counter(|r| r.engine.evicted_blocks_total),
    ),
    metric(
        "kvroute_mocker_cached_blocks",
        "Blocks holding a cached hash.",
        Value::Count(|r| r.engine.cached_blocks as u64),
    ),
];

/// The per-rank metrics of prefill and decode engines.
const OWN_PD: &[Metric] = &[
    metric(
        "kvroute_mocker_held_blocks",
        "Blocks held by finished prefill legs until their decode reads them.",
        Value::Count(|r| r.engine.held_blocks as u64),
    ),
    metric(
        "kvroute_mocker_kv_received_tokens_total",
        "Prompt tokens looked up here whose KV arrived from a prefill engine (neither cached nor computed here).",
        Value::Counter(|r| r.engine.kv_received_tokens_total),
    ),
];

/// How an engine-wide transfer metric is read, and so its type.
#[derive(Clone, Copy)]
enum PdValue {
    /// A counter.
    Counter(fn(&HandoffStats) -> u64),
    /// A counter of seconds, kept in nanoseconds.
    Seconds(fn(&HandoffStats) -> u64),
}

/// The engine-wide transfer metrics of prefill and decode engines.
const PD: &[(&str, &str, PdValue)] = &[
    (
        "kvroute_mocker_kv_transfers_sent_total",
        "Transfers handed to a decode: vLLM answers with kv_transfer_params, SGLang rooms filled.",
        PdValue::Counter(|s| s.sent.load(Ordering::Relaxed)),
    ),
    (
        "kvroute_mocker_kv_transfers_received_total",
        "Decode requests whose prompt KV arrived from a prefill engine.",
        PdValue::Counter(|s| s.received.load(Ordering::Relaxed)),
    ),
    (
        "kvroute_mocker_kv_transfer_blocks_total",
        "KV blocks moved to this decode engine.",
        PdValue::Counter(|s| s.blocks.load(Ordering::Relaxed)),
    ),
    (
        "kvroute_mocker_kv_transfer_wait_seconds_total",
        "Time waited for modelled transfers (--transfer-us-per-block, divided by --speedup).",
        PdValue::Seconds(|s| s.wait_nanos.load(Ordering::Relaxed)),
    ),
    (
        "kvroute_mocker_kv_transfer_params_invalid_total",
        "vLLM decode requests with do_remote_prefill but not every remote field, computed locally.",
        PdValue::Counter(|s| s.invalid.load(Ordering::Relaxed)),
    ),
    (
        "kvroute_mocker_kv_transfer_failures_total",
        "Transfers that failed: an unreadable vLLM prefill (computed locally), an SGLang room failed or never filled.",
        PdValue::Counter(|s| s.failures.load(Ordering::Relaxed)),
    ),
];

/// The exposition formats served.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Format {
    /// Prometheus text 0.0.4, as vLLM and SGLang serve it.
    Classic,
    /// OpenMetrics 1.0 text.
    OpenMetrics,
}

impl Format {
    /// The format an `Accept` header asks for: OpenMetrics when it lists
    /// `application/openmetrics-text` (with a non-zero `q`), else classic.
    pub fn negotiate(accept: Option<&HeaderValue>) -> Format {
        let Some(accept) = accept.and_then(|v| v.to_str().ok()) else {
            return Format::Classic;
        };
        let wants_openmetrics = accept.split(',').any(|range| {
            let mut params = range.split(';');
            let media = params.next().unwrap_or_default().trim();
            let q = params
                .filter_map(|p| p.trim().strip_prefix("q="))
                .find_map(|q| q.trim().parse::<f64>().ok())
                .unwrap_or(1.0);
            media.eq_ignore_ascii_case("application/openmetrics-text") && q > 0.0
        });
        if wants_openmetrics {
            Format::OpenMetrics
        } else {
            Format::Classic
        }
    }

    /// The response's `Content-Type`.
    pub fn content_type(self) -> &'static str {
        match self {
            Format::Classic => prometheus_client::encoding::prometheus_text::CONTENT_TYPE,
            Format::OpenMetrics => "application/openmetrics-text; version=1.0.0; charset=utf-8",
        }
    }
}

/// Every metric of one engine, read from its ranks when scraped.
#[derive(Debug)]
struct EngineCollector {
    state: Arc<EngineState>,
}

impl Collector for EngineCollector {
    fn encode(&self, mut encoder: DescriptorEncoder) -> Result<(), fmt::Error> {
        let state = &self.state;
        let (engine_metrics, rank_label) = match state.flavor {
            WorkerFlavor::Vllm => (VLLM, "engine"),
            WorkerFlavor::Sglang => (SGLANG, "dp_rank"),
            WorkerFlavor::Trtllm => (TRTLLM, "dp_rank"),
        };
        let ranks: Vec<RankSnapshot> = state
            .ranks
            .iter()
            .map(|r| {
                let p = r.publisher_stats();
                RankSnapshot {
                    rank: r.rank(),
                    engine: r.stats(),
                    batches: p.batches.load(Ordering::Relaxed),
                    events: p.events.load(Ordering::Relaxed),
                    dropped: p.dropped.load(Ordering::Relaxed),
                    replays: p.replays.load(Ordering::Relaxed),
                    restarts: p.restarts.load(Ordering::Relaxed),
                }
            })
            .collect();
        // Engines that hand KV off: disaggregated ones, SGLang `--kv-both` ones.
        let pd = state.pd.role != Role::Both || state.pd.rooms.is_some();
        let own_pd: &[Metric] = if pd { OWN_PD } else { &[] };
        for m in engine_metrics.iter().chain(OWN).chain(own_pd) {
            let (kind, name) = match m.value {
                // The encoders add the suffix to a counter's family name.
                Value::Counter(_) => (
                    MetricType::Counter,
                    m.name.strip_suffix("_total").unwrap_or(m.name),
                ),
                Value::Count(_) | Value::Ratio(_) => (MetricType::Gauge, m.name),
            };
            let mut family = encoder.encode_descriptor(name, m.help, None, kind)?;
            for rank in &ranks {
                let rank_value = rank.rank.to_string();
                let labels = [
                    ("model_name", state.model.as_str()),
                    (rank_label, rank_value.as_str()),
                ];
                let sample = family.encode_family(&labels)?;
                match m.value {
                    Value::Counter(read) => ConstCounter::new(read(rank)).encode(sample)?,
                    Value::Count(read) => ConstGauge::new(read(rank)).encode(sample)?,
                    Value::Ratio(read) => ConstGauge::new(read(rank)).encode(sample)?,
                }
            }
        }
        if pd {
            encode_pd(state, &mut encoder)?;
        }
        Ok(())
    }
}

/// The engine-wide transfer metrics, labelled with the model only.
fn encode_pd(state: &EngineState, encoder: &mut DescriptorEncoder) -> Result<(), fmt::Error> {
    let labels = [("model_name", state.model.as_str())];
    let stats = &state.pd.stats;
    for &(name, help, value) in PD {
        let family_name = name.strip_suffix("_total").unwrap_or(name);
        let mut family = encoder.encode_descriptor(family_name, help, None, MetricType::Counter)?;
        let sample = family.encode_family(&labels)?;
        match value {
            PdValue::Counter(read) => ConstCounter::new(read(stats)).encode(sample)?,
            PdValue::Seconds(read) => {
                ConstCounter::new(read(stats) as f64 / 1e9).encode(sample)?;
            }
        }
    }
    if let Some(rooms) = &state.pd.rooms {
        let mut family = encoder.encode_descriptor(
            "kvroute_mocker_bootstrap_rooms",
            "Bootstrap rooms this SGLang prefill engine holds (pending, filled or failed).",
            None,
            MetricType::Gauge,
        )?;
        ConstGauge::new(rooms.len() as u64).encode(family.encode_family(&labels)?)?;
    }
    Ok(())
}

/// The exposition of `state`'s metrics in `format`.
pub fn render(state: &Arc<EngineState>, format: Format) -> Result<String, fmt::Error> {
    let mut registry = Registry::default();
    registry.register_collector(Box::new(EngineCollector {
        state: state.clone(),
    }));
    let mut out = String::new();
    match format {
        Format::Classic => {
            prometheus_client::encoding::prometheus_text::encode(&mut out, &registry)?
        }
        Format::OpenMetrics => prometheus_client::encoding::text::encode(&mut out, &registry)?,
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn accept(v: &'static str) -> Format {
        Format::negotiate(Some(&HeaderValue::from_static(v)))
    }

    #[test]
    fn openmetrics_is_served_only_when_asked_for() {
        assert_eq!(Format::negotiate(None), Format::Classic);
        assert_eq!(accept("text/plain"), Format::Classic);
        assert_eq!(accept("*/*"), Format::Classic);
        assert_eq!(
            accept("application/openmetrics-text;version=1.0.0,text/plain;version=0.0.4;q=0.5"),
            Format::OpenMetrics
        );
        assert_eq!(
            accept("text/plain, Application/OpenMetrics-Text; q=0.3"),
            Format::OpenMetrics
        );
        assert_eq!(
            accept("application/openmetrics-text;q=0, text/plain"),
            Format::Classic
        );
    }

    #[test]
    fn every_counter_is_named_with_total_and_names_are_unique() {
        let mut seen = std::collections::HashSet::new();
        for m in VLLM.iter().chain(SGLANG).chain(OWN).chain(OWN_PD) {
            assert!(seen.insert(m.name), "{} twice", m.name);
            let is_counter = matches!(m.value, Value::Counter(_));
            assert_eq!(m.name.ends_with("_total"), is_counter, "{}", m.name);
        }
        for &(name, _, _) in PD {
            assert!(seen.insert(name), "{name} twice");
            assert!(name.ends_with("_total"), "{name}");
        }
    }
}
