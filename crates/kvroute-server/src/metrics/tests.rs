//! The catalogue against the docs, and the proxy's counters as scraped.

use super::*;
use crate::api::ErrorKind;

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
    let (_, text) = Metrics::new(&proxy, &ConnectionMetrics::default(), Vec::new()).render(None);
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
