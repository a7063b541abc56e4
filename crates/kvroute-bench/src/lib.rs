//! Measurements of kvroute's own parts: the prefix index alone
//! ([`index`], beside the floor of any exact index's size:
//! [`index_floor`]), a router process ingesting thousands of event streams
//! ([`ingest`]), the latency and CPU the router adds to a request
//! ([`proxy`]), the time a router takes to be ready on a saved index
//! ([`restore`]), what router replicas cost and buy ([`replicas`]), and
//! how the overload queue shares a saturated fleet ([`fairness`]).
//! All but the first run the router as a child process; [`trace`] makes
//! the index bench's synthetic events. Built on `kvroute-loadgen` (its
//! driver, workloads, in-process fleets and routers, statistics).

mod child;
pub mod fairness;
pub mod index;
pub mod index_floor;
pub mod index_trace;
pub mod ingest;
pub mod proxy;
pub mod replicas;
pub mod restore;
pub mod trace;

// The load generator's modules the benches build on, under their own names.
use kvroute_loadgen::{
    driver, embedded_router, engines, error, metrics, mooncake, nats, preset, report, stats,
    workload, PolicyReport,
};

/// A flat JSON report as aligned `key  value` lines, keys right-aligned to
/// `width` (how `kvroute bench index` and `bench ingest` print without `--json`).
pub fn key_value_lines(report: &serde_json::Value, width: usize) -> String {
    let mut out = String::new();
    if let Some(map) = report.as_object() {
        for (k, v) in map {
            out.push_str(&format!("{k:>width$}  {v}\n"));
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn flat_reports_print_one_aligned_line_per_field_in_order() {
        let report = serde_json::json!({"workers": 4, "bytes_per_residency": null});
        assert_eq!(
            key_value_lines(&report, 20),
            "             workers  4\n bytes_per_residency  null\n"
        );
    }
}
