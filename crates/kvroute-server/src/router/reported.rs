//! The engines' own view of their load (`--engine-metrics-ms`): each
//! worker's `/metrics` scraped for the gauges of the Model Server Protocol
//! (requests running and waiting, KV-cache usage), kept per rank, and
//! added to the router's own accounting where the engine reports more
//! (`kvroute_core::scheduler::Load::with_report`): requests that reached an
//! engine without passing through this router load it all the same.
//!
//! | | vLLM (rank label `engine`) | SGLang (rank label `dp_rank`) |
//! | --- | --- | --- |
//! | requests | `vllm:num_requests_running` + `vllm:num_requests_waiting` | `sglang:num_running_reqs` + `sglang:num_queue_reqs` |
//! | KV usage (0–1) | `vllm:kv_cache_usage_perc` | `sglang:token_usage` |
//! | capacity in blocks | `vllm:cache_config_info{num_gpu_blocks}` | `sglang:cache_config_info{num_pages}` |
//!
//! KV usage counts as blocks only where the capacity is given.

use std::collections::{BTreeMap, HashMap};
use std::sync::{Arc, RwLock};
use std::time::{Duration, Instant};

use kvroute_core::event::WorkerFlavor;
use kvroute_core::index::{DpRank, WorkerRank};
use kvroute_core::scheduler::EngineReport;

/// The largest `/metrics` answer read from an engine.
pub const MAX_METRICS_BYTES: usize = 8 << 20;

/// The gauges read, per flavour: (requests running, requests waiting, KV
/// usage, capacity info and its label, the rank label).
struct Names {
    running: &'static str,
    waiting: &'static str,
    usage: &'static str,
    config: &'static str,
    capacity_label: &'static str,
    rank_label: &'static str,
}

fn names(flavor: WorkerFlavor) -> Names {
    match flavor {
        WorkerFlavor::Vllm => Names {
            running: "vllm:num_requests_running",
            waiting: "vllm:num_requests_waiting",
            usage: "vllm:kv_cache_usage_perc",
            config: "vllm:cache_config_info",
            capacity_label: "num_gpu_blocks",
            rank_label: "engine",
        },
        WorkerFlavor::Sglang => Names {
            running: "sglang:num_running_reqs",
            waiting: "sglang:num_queue_reqs",
            usage: "sglang:token_usage",
            config: "sglang:cache_config_info",
            capacity_label: "num_pages",
            rank_label: "dp_rank",
        },
        // trtllm-serve's gauges as public scrapers of its `/metrics` name
        // them; it publishes no block capacity, so no KV share is derived.
        WorkerFlavor::Trtllm => Names {
            running: "trtllm_num_requests_running",
            waiting: "trtllm_num_requests_waiting",
            usage: "trtllm_kv_cache_utilization",
            config: "trtllm_cache_config_info",
            capacity_label: "num_gpu_blocks",
            rank_label: "dp_rank",
        },
    }
}

/// Each rank's report in one engine's `/metrics` text (ranks without a
/// rank label are rank 0).
pub fn parse_engine_metrics(text: &str, flavor: WorkerFlavor) -> BTreeMap<DpRank, EngineReport> {
    let n = names(flavor);
    #[derive(Default)]
    struct Seen {
        requests: f64,
        usage: Option<f64>,
        capacity: Option<f64>,
    }
    let mut seen: BTreeMap<u32, Seen> = BTreeMap::new();
    for sample in crate::prom_text::samples(text) {
        let (name, value) = (sample.name, sample.value);
        if !value.is_finite() || value < 0.0 {
            continue;
        }
        let label = |key: &str| sample.label(key);
        let rank = label(n.rank_label)
            .and_then(|r| r.parse().ok())
            .unwrap_or(0);
        let entry = seen.entry(rank).or_default();
        if name == n.running || name == n.waiting {
            entry.requests += value;
        } else if name == n.usage {
            entry.usage = Some(value.min(1.0));
        } else if name == n.config {
            entry.capacity = label(n.capacity_label).and_then(|c| c.parse().ok());
        }
    }
    seen.into_iter()
        .map(|(rank, s)| {
            let kv_blocks = s.usage.zip(s.capacity).map(|(u, c)| (u * c).round() as u64);
            let report = EngineReport {
                requests: s.requests.round() as u64,
                kv_blocks,
            };
            (DpRank(rank), report)
        })
        .collect()
}

/// The latest report of every rank, read by each request without a lock
/// held while it is scored.
#[derive(Debug, Default)]
pub struct ReportBook {
    reports: RwLock<Arc<HashMap<WorkerRank, (EngineReport, Instant)>>>,
}

impl ReportBook {
    /// Records one worker's reports, read now.
    pub fn record(
        &self,
        worker: kvroute_core::index::WorkerId,
        reports: BTreeMap<DpRank, EngineReport>,
    ) {
        let now = Instant::now();
        let mut guard = match self.reports.write() {
            Ok(g) => g,
            Err(poisoned) => poisoned.into_inner(),
        };
        let mut next = HashMap::clone(&guard);
        next.retain(|key, _| key.worker != worker);
        for (rank, report) in reports {
            next.insert(WorkerRank { worker, rank }, (report, now));
        }
        *guard = Arc::new(next);
    }

    /// The reports as they stand: shared, not copied, by each request.
    pub fn latest(&self) -> Reports {
        let reports = match self.reports.read() {
            Ok(g) => g.clone(),
            Err(poisoned) => poisoned.into_inner().clone(),
        };
        Reports(reports)
    }
}

/// Every rank's latest report, as [`ReportBook::latest`] found them.
#[derive(Debug, Clone)]
pub struct Reports(Arc<HashMap<WorkerRank, (EngineReport, Instant)>>);

impl Reports {
    /// `key`'s report, unless it is older than `max_age`.
    pub fn fresh(&self, key: &WorkerRank, max_age: Duration) -> Option<&EngineReport> {
        self.0
            .get(key)
            .filter(|(_, at)| at.elapsed() <= max_age)
            .map(|(r, _)| r)
    }

    /// How many ranks have a report younger than `max_age`.
    #[cfg(test)]
    pub fn count_fresh(&self, max_age: Duration) -> usize {
        self.0
            .values()
            .filter(|(_, at)| at.elapsed() <= max_age)
            .count()
    }
}

impl super::Router {
    /// Reads every worker's `/metrics` once (at most `timeout` each, all at
    /// once) and records the load each reports.
    pub async fn scrape_engines(&self, timeout: Duration) {
        let targets = self.targets();
        let reads = targets.iter().map(|t| async move {
            let read = read_metrics(&self.client, &t.url, timeout).await;
            (t.id, t.flavor, read)
        });
        for (worker, flavor, read) in futures_util::future::join_all(reads).await {
            match read {
                Some(text) => {
                    self.metrics.engine_scrapes.inc();
                    self.reported
                        .record(worker, parse_engine_metrics(&text, flavor));
                }
                None => {
                    self.metrics.engine_scrape_failures.inc();
                }
            }
        }
    }
}

/// A worker's `/metrics` text, read to at most [`MAX_METRICS_BYTES`];
/// `None` when it cannot be read in time, fails, or is longer.
async fn read_metrics(client: &reqwest::Client, url: &str, timeout: Duration) -> Option<String> {
    let mut resp = client
        .get(format!("{url}/metrics"))
        .timeout(timeout)
        .send()
        .await
        .ok()?;
    if !resp.status().is_success() {
        return None;
    }
    let mut body = Vec::new();
    while let Some(chunk) = resp.chunk().await.ok()? {
        if body.len() + chunk.len() > MAX_METRICS_BYTES {
            return None;
        }
        body.extend_from_slice(&chunk);
    }
    String::from_utf8(body).ok()
}

#[cfg(test)]
mod tests {
    use super::*;

    const VLLM: &str = r#"# HELP vllm:num_requests_running Number of requests.
# TYPE vllm:num_requests_running gauge
vllm:num_requests_running{engine="0",model_name="m"} 3.0
vllm:num_requests_running{engine="1",model_name="m"} 1.0
vllm:num_requests_waiting{engine="0",model_name="m"} 5
vllm:kv_cache_usage_perc{engine="0",model_name="m"} 0.25
vllm:cache_config_info{block_size="16",engine="0",num_gpu_blocks="2048"} 1.0
vllm:prefix_cache_hits_total{engine="0"} 99
"#;

    #[test]
    fn each_ranks_requests_and_kv_blocks_are_read() {
        let r = parse_engine_metrics(VLLM, WorkerFlavor::Vllm);
        assert_eq!(
            r.get(&DpRank(0)),
            Some(&EngineReport {
                requests: 8,
                kv_blocks: Some(512)
            })
        );
        assert_eq!(
            r.get(&DpRank(1)),
            Some(&EngineReport {
                requests: 1,
                kv_blocks: None
            }),
            "no capacity: no blocks"
        );
        let sglang = "sglang:num_running_reqs 2\nsglang:num_queue_reqs{dp_rank=\"0\"} 1\nsglang:token_usage 0.5\n";
        let r = parse_engine_metrics(sglang, WorkerFlavor::Sglang);
        assert_eq!(r.get(&DpRank(0)).map(|r| r.requests), Some(3));
        // Garbage, negative and non-finite values are skipped, never a panic.
        let junk = "vllm:num_requests_running{engine=\"0\" 3\nvllm:num_requests_waiting -4\nvllm:num_requests_running NaN\n{}\n";
        assert!(parse_engine_metrics(junk, WorkerFlavor::Vllm)
            .values()
            .all(|r| r.requests == 0));
    }

    #[test]
    fn the_book_keeps_each_workers_latest_reports_while_fresh() {
        let book = ReportBook::default();
        let w = kvroute_core::index::WorkerId(3);
        book.record(w, parse_engine_metrics(VLLM, WorkerFlavor::Vllm));
        assert_eq!(book.latest().count_fresh(Duration::from_secs(60)), 2);
        book.record(w, BTreeMap::from([(DpRank(0), EngineReport::default())]));
        let latest = book.latest();
        assert_eq!(
            latest.count_fresh(Duration::from_secs(60)),
            1,
            "the worker's older ranks are replaced"
        );
        let rank0 = WorkerRank {
            worker: w,
            rank: DpRank(0),
        };
        assert_eq!(
            latest.fresh(&rank0, Duration::from_secs(60)),
            Some(&EngineReport::default())
        );
        std::thread::sleep(Duration::from_millis(5));
        assert_eq!(
            book.latest().fresh(&rank0, Duration::from_millis(1)),
            None,
            "stale"
        );
    }
}
