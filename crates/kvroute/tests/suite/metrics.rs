//! `/metrics` of a running router: every metric of the catalogue
//! (`kvroute_server::metrics::CATALOGUE`, which `docs/metrics.md` lists) is
//! exposed, in the Prometheus text format and in OpenMetrics (by a router
//! with `--nats`: the replica families exist only then).

use kvroute_server::metrics::{Kind, CATALOGUE};
use serde_json::json;

use crate::support::http::*;
use crate::support::*;

/// Whether `text` has a sample of `name` (a labelled one, or a bare one).
pub fn has_sample(text: &str, name: &str) -> bool {
    text.lines()
        .any(|l| l.starts_with(&format!("{name}{{")) || l.starts_with(&format!("{name} ")))
}

#[test]
fn every_catalogue_metric_is_scraped_from_a_running_router() {
    let (_mocker, lines) = start_mocker(1, "100");
    // As a replica, so that the `kvroute_replica_*` families exist too.
    let nats = kvroute_loadgen::nats::NatsServer::start().expect("nats-server starts");
    let (_serve, serve) = start_serve(&lines, &["--nats", &nats.url()]);
    // One routed request, so that the per-request and per-rank families
    // have samples.
    let body =
        json!({"model": "mock-model", "prompt": (0..40).collect::<Vec<u32>>(), "max_tokens": 1});
    let r = request(&serve, "POST", "/v1/completions", &body.to_string());
    assert_eq!(r.status, 200, "{}", r.body);

    let classic = request(&serve, "GET", "/metrics", "");
    assert_eq!(classic.status, 200);
    assert!(classic
        .header("content-type")
        .is_some_and(|t| t.starts_with("text/plain")));
    let open = request_with(
        &serve,
        "GET",
        "/metrics",
        &[("Accept", "application/openmetrics-text; version=1.0.0")],
        "",
    );
    assert!(open
        .header("content-type")
        .is_some_and(|t| t.starts_with("application/openmetrics-text")));
    assert!(open.body.trim_end().ends_with("# EOF"));

    for m in CATALOGUE {
        let (family, samples) = match m.kind {
            Kind::Counter => (m.name.trim_end_matches("_total"), vec![m.name.to_owned()]),
            Kind::Gauge => (m.name, vec![m.name.to_owned()]),
            Kind::Histogram => (
                m.name,
                vec![format!("{}_count", m.name), format!("{}_bucket", m.name)],
            ),
        };
        let kind = m.kind.as_str();
        assert!(
            classic.body.contains(&format!("# TYPE {} {kind}", m.name)),
            "no TYPE line for {}",
            m.name
        );
        assert!(
            open.body.contains(&format!("# TYPE {family} {kind}")),
            "no OpenMetrics TYPE line for {family}"
        );
        for sample in &samples {
            assert!(has_sample(&classic.body, sample), "no sample of {sample}");
            assert!(
                has_sample(&open.body, sample),
                "no OpenMetrics sample of {sample}"
            );
        }
        if m.labels.contains(&"dp_rank") {
            // Per-rank labels first (the state gauge adds its `state` after them).
            let labelled = format!("{}{{worker=\"w0\",dp_rank=\"0\"", samples[0]);
            assert!(classic.body.contains(&labelled), "{labelled}");
        } else if m.labels.contains(&"worker") {
            // Per-worker: the worker first (the info gauge adds its `role`).
            let labelled = format!("{}{{worker=\"w0\"", samples[0]);
            assert!(classic.body.contains(&labelled), "{labelled}");
        }
    }
}
