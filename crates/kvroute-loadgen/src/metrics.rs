//! Reading kvroute's Prometheus `/metrics` text: the counters the load
//! generator and the demo report beside their own measurements.

use std::collections::BTreeMap;
use std::time::Duration;

use kvroute_server::prom_text::samples;

use crate::error::{Error, Result};

/// The router's accuracy counters (comparisons, exact agreements) from its
/// `/metrics`; `None` when the target is not kvroute or does not answer.
pub async fn accuracy_counters(client: &reqwest::Client, base: &str) -> Option<(u64, u64)> {
    let resp = client
        .get(format!("{base}/metrics"))
        .timeout(Duration::from_secs(5))
        .send()
        .await
        .ok()?;
    if !resp.status().is_success() {
        return None;
    }
    parse_accuracy(&resp.text().await.ok()?)
}

/// [`accuracy_counters`] summed over several routers (replicas behind a
/// balancer); `None` when there is none or any of them has no counters.
pub async fn accuracy_total(client: &reqwest::Client, bases: &[String]) -> Option<(u64, u64)> {
    if bases.is_empty() {
        return None;
    }
    let mut sum = (0u64, 0u64);
    for base in bases {
        let (compared, exact) = accuracy_counters(client, base).await?;
        sum = (sum.0 + compared, sum.1 + exact);
    }
    Some(sum)
}

/// `kvroute_accuracy_comparisons_total` and `kvroute_accuracy_exact_total`.
///
/// The counters are labelled (`rank_state`), so a router that has compared
/// nothing yet shows no sample of them: both are then 0, when the text is a
/// router's (it has `kvroute_proxy_requests_total`). `None` otherwise (not
/// kvroute: an engine, another router).
fn parse_accuracy(metrics: &str) -> Option<(u64, u64)> {
    let compared = total(metrics, "kvroute_accuracy_comparisons_total");
    if compared.is_none() && total(metrics, "kvroute_proxy_requests_total").is_none() {
        return None;
    }
    Some((
        compared.unwrap_or(0),
        total(metrics, "kvroute_accuracy_exact_total").unwrap_or(0),
    ))
}

/// The sum of every sample of the metric `name` in `text`, whatever its
/// labels; `None` when `text` has no sample of it.
pub fn total(text: &str, name: &str) -> Option<u64> {
    samples(text)
        .filter(|s| s.name == name)
        .fold(None, |sum: Option<f64>, s| {
            Some(sum.unwrap_or(0.0) + s.value)
        })
        .map(|v| v as u64)
}

/// The samples of the metric `name` in `text` summed per value of their
/// label `label` (e.g. `kvroute_proxy_routed_total` per `worker`, over its
/// `dp_rank`s); samples without that label are left out.
pub fn by_label(text: &str, name: &str, label: &str) -> BTreeMap<String, u64> {
    let mut out = BTreeMap::new();
    for s in samples(text).filter(|s| s.name == name) {
        if let Some(v) = s.label(label) {
            *out.entry(v.to_owned()).or_insert(0) += s.value as u64;
        }
    }
    out
}

/// [`total`], 0 when there is no sample.
pub fn sum(text: &str, name: &str) -> u64 {
    total(text, name).unwrap_or(0)
}

/// Exact agreements per comparison between two readings of the counters.
pub fn accuracy_between(before: (u64, u64), after: (u64, u64)) -> Option<f64> {
    let compared = after.0.checked_sub(before.0)?;
    let exact = after.1.checked_sub(before.1)?;
    (compared > 0).then(|| exact as f64 / compared as f64)
}

/// GETs `base` + `path` and returns the body as text.
pub async fn get_text(client: &reqwest::Client, base: &str, path: &str) -> Result<String> {
    let url = format!("{base}{path}");
    let resp = client
        .get(&url)
        .timeout(Duration::from_secs(10))
        .send()
        .await
        .map_err(Error::http(format!("GET {url}")))?;
    let status = resp.status();
    let text = resp
        .text()
        .await
        .map_err(Error::http(format!("reading {url}")))?;
    if !status.is_success() {
        return Err(Error::Unexpected(format!("{url} answered {status}")));
    }
    Ok(text)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn accuracy_comes_from_the_router_counters() {
        let text = "# TYPE kvroute_accuracy_comparisons_total counter\nkvroute_accuracy_comparisons_total 10\nkvroute_accuracy_exact_total 7\n";
        assert_eq!(parse_accuracy(text), Some((10, 7)));
        assert_eq!(parse_accuracy("vllm:num_requests_running 1\n"), None);
        let fresh = "# TYPE kvroute_proxy_requests_total counter\nkvroute_proxy_requests_total 0\n";
        assert_eq!(parse_accuracy(fresh), Some((0, 0)));
        let labelled = "kvroute_accuracy_comparisons_total{rank_state=\"live\"} 4\nkvroute_accuracy_comparisons_total{rank_state=\"degraded\"} 1\nkvroute_accuracy_exact_total{rank_state=\"live\"} 3\n";
        assert_eq!(parse_accuracy(labelled), Some((5, 3)));
        assert_eq!(accuracy_between((10, 7), (20, 16)), Some(0.9));
        assert_eq!(accuracy_between((10, 7), (10, 7)), None);
        assert_eq!(accuracy_between((10, 7), (0, 0)), None);
    }

    #[test]
    fn prometheus_counters_are_summed_over_labels() {
        let text = "# HELP x y\n# TYPE kvroute_a counter\nkvroute_a{worker=\"w0\",rank=\"0\"} 3\nkvroute_a{worker=\"w1\",rank=\"0\"} 4\nkvroute_ab 100\n";
        assert_eq!(sum(text, "kvroute_a"), 7);
        assert_eq!(sum(text, "kvroute_ab"), 100);
        assert_eq!(sum(text, "kvroute_c"), 0);
    }

    #[test]
    fn labelled_counters_are_summed_per_value_of_one_label() {
        let text = "# TYPE kvroute_proxy_routed_total counter\nkvroute_proxy_routed_total{worker=\"w0\",dp_rank=\"0\"} 3\nkvroute_proxy_routed_total{worker=\"w0\",dp_rank=\"1\"} 4\nkvroute_proxy_routed_total{dp_rank=\"0\",worker=\"w1\"} 5\nkvroute_proxy_routed_total_other{worker=\"w2\"} 9\nkvroute_proxy_routed_total 1\n";
        let per = by_label(text, "kvroute_proxy_routed_total", "worker");
        assert_eq!(
            per.into_iter().collect::<Vec<_>>(),
            [("w0".into(), 7), ("w1".into(), 5)]
        );
        assert!(by_label(text, "kvroute_proxy_routed_total", "rank").is_empty());
    }
}
