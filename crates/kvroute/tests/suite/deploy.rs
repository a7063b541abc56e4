//! `deploy/`: the Kubernetes manifests ([`kubernetes`]), and the Grafana
//! dashboard and the Prometheus alert rules: these name only metrics that
//! a running router exposes (one with `--nats`, so the replica
//! families exist, after a routed request, so the per-request ones have
//! samples), and every panel and rule has the fields Grafana and Prometheus
//! need. promtool is not available here: the rules are parsed as YAML and
//! checked field by field.

mod kubernetes;

use serde_json::{json, Value};
use yaml_rust2::{Yaml, YamlLoader};

use super::metrics::has_sample;
use crate::support::http::*;
use crate::support::*;

fn repo_file(path: &str) -> String {
    let full = format!("{}/../../{path}", env!("CARGO_MANIFEST_DIR"));
    std::fs::read_to_string(&full).unwrap_or_else(|e| panic!("{full}: {e}"))
}

/// Every `kvroute_…` name in a PromQL expression.
fn metric_names(expr: &str) -> Vec<String> {
    let mut names = Vec::new();
    let mut rest = expr;
    while let Some(at) = rest.find("kvroute_") {
        let tail = &rest[at..];
        let end = tail
            .find(|c: char| !(c.is_ascii_alphanumeric() || c == '_'))
            .unwrap_or(tail.len());
        names.push(tail[..end].to_owned());
        rest = &tail[end..];
    }
    names
}

/// Brackets of an expression open and close in order.
fn balanced(expr: &str) -> bool {
    let mut stack = Vec::new();
    for c in expr.chars() {
        match c {
            '(' | '[' | '{' => stack.push(c),
            ')' | ']' | '}' => {
                let open = stack.pop();
                let ok = matches!(
                    (open, c),
                    (Some('('), ')') | (Some('['), ']') | (Some('{'), '}')
                );
                if !ok {
                    return false;
                }
            }
            _ => {}
        }
    }
    stack.is_empty()
}

/// The panels of the dashboard (rows included), and each panel's expressions.
fn grafana_exprs() -> Vec<String> {
    let doc: Value = serde_json::from_str(&repo_file("deploy/grafana/kvroute.json")).expect("JSON");
    assert_eq!(doc["uid"], "kvroute");
    let panels = doc["panels"].as_array().expect("panels");
    let mut exprs = Vec::new();
    for p in panels.iter().filter(|p| p["type"] != "row") {
        let title = p["title"].as_str().expect("a title");
        assert!(!title.is_empty());
        assert_eq!(
            p["datasource"]["uid"], "${datasource}",
            "{title}: datasource"
        );
        let pos = &p["gridPos"];
        let (x, w) = (pos["x"].as_u64().expect("x"), pos["w"].as_u64().expect("w"));
        assert!(
            x + w <= 24 && pos["h"].as_u64().is_some_and(|h| h > 0),
            "{title}: gridPos"
        );
        let targets = p["targets"].as_array().expect("targets");
        assert!(!targets.is_empty(), "{title}: no query");
        let mut refs: Vec<&str> = targets
            .iter()
            .map(|t| t["refId"].as_str().expect("refId"))
            .collect();
        refs.sort_unstable();
        refs.dedup();
        assert_eq!(refs.len(), targets.len(), "{title}: refIds repeat");
        for t in targets {
            let expr = t["expr"].as_str().expect("expr");
            assert!(balanced(expr), "{title}: {expr}");
            exprs.push(expr.to_owned());
        }
    }
    exprs
}

fn text<'a>(y: &'a Yaml, key: &str) -> &'a str {
    y[key]
        .as_str()
        .unwrap_or_else(|| panic!("`{key}` missing or not a string in {y:?}"))
}

/// The alert rules' expressions, each rule checked for its fields.
fn alert_exprs() -> Vec<String> {
    let docs = YamlLoader::load_from_str(&repo_file("deploy/prometheus/alerts.yml")).expect("YAML");
    let groups = docs[0]["groups"].as_vec().expect("groups");
    let mut exprs = Vec::new();
    let mut alerts = Vec::new();
    for g in groups {
        assert!(!text(g, "name").is_empty());
        for rule in g["rules"].as_vec().expect("rules") {
            let alert = text(rule, "alert");
            assert!(
                alert.starts_with("Kvroute") && !alert.contains(' '),
                "{alert}"
            );
            let expr = text(rule, "expr");
            assert!(
                balanced(expr) && !metric_names(expr).is_empty(),
                "{alert}: {expr}"
            );
            let wait = text(rule, "for");
            let (n, unit) = wait.split_at(wait.len() - 1);
            assert!(
                n.parse::<u32>().is_ok() && ["s", "m", "h"].contains(&unit),
                "{alert}: for {wait}"
            );
            assert!(
                ["warning", "critical"].contains(&text(&rule["labels"], "severity")),
                "{alert}"
            );
            for key in ["summary", "description"] {
                assert!(
                    !text(&rule["annotations"], key).trim().is_empty(),
                    "{alert}: {key}"
                );
            }
            alerts.push(alert.to_owned());
            exprs.push(expr.to_owned());
        }
    }
    for wanted in [
        "RanksNotLive",
        "DecodeErrors",
        "IndexAccuracyLow",
        "RoutingOnLoadAlone",
        "ReplicasOutOfSync",
    ] {
        assert!(
            alerts.iter().any(|a| a.ends_with(wanted)),
            "no {wanted} alert in {alerts:?}"
        );
    }
    exprs
}

#[test]
fn the_grafana_dashboard_and_the_alert_rules_name_only_metrics_a_router_exposes() {
    let exprs: Vec<String> = grafana_exprs().into_iter().chain(alert_exprs()).collect();
    let (_mocker, lines) = start_mocker(1, "100");
    let nats = kvroute_loadgen::nats::NatsServer::start().expect("nats-server starts");
    let (_serve, serve) = start_serve(&lines, &["--nats", &nats.url()]);
    let body = json!({"model": "mock-model", "prompt": (0..40).collect::<Vec<u32>>(), "max_tokens": 1, "stream": true});
    let r = request(&serve, "POST", "/v1/completions", &body.to_string());
    assert_eq!(r.status, 200, "{}", r.body);
    let scraped = request(&serve, "GET", "/metrics", "").body;
    let mut names: Vec<String> = exprs.iter().flat_map(|e| metric_names(e)).collect();
    names.sort_unstable();
    names.dedup();
    assert!(names.len() >= 25, "only {} metrics referenced", names.len());
    let missing: Vec<&String> = names.iter().filter(|n| !has_sample(&scraped, n)).collect();
    assert!(
        missing.is_empty(),
        "referenced but not exposed: {missing:?}"
    );
}
