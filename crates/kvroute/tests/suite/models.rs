//! Many models on one router: each request goes only to workers that serve
//! the model it names (their `/v1/models`, LoRA adapters included), an
//! unknown model is OpenAI's 404, and an adapter's prompt is hashed with
//! the adapter, as the engines hash it.

use serde_json::{json, Value};

use crate::support::http::{count, request};
use crate::support::{eventually, start_mocker_with, start_serve};

/// One mock engine serving `model` (and `adapters`), its `--worker` line named `name`.
fn engine(model: &str, adapters: &str, name: &str) -> (crate::support::Proc, String) {
    let mut args = vec!["--model", model];
    if !adapters.is_empty() {
        args.extend(["--lora-adapters", adapters]);
    }
    let (proc, mut lines) = start_mocker_with(1, &args);
    let line = lines
        .remove(0)
        .replacen("name=w0", &format!("name={name}"), 1);
    (proc, line)
}

fn complete(serve: &str, model: &str, seed: u32) -> (u16, Option<String>, Value) {
    let prompt: Vec<u32> = (0..128).map(|i| 7_000 + seed * 500 + i).collect();
    let body = json!({"model": model, "prompt": prompt, "max_tokens": 2});
    let reply = request(serve, "POST", "/v1/completions", &body.to_string());
    let doc: Value = serde_json::from_str(&reply.body).unwrap_or(Value::Null);
    (reply.status, reply.header("x-kvroute-worker"), doc)
}

#[test]
fn requests_reach_only_workers_that_serve_their_model() {
    let (_a, a) = engine("alpha", "sql", "a");
    let (_b, b) = engine("beta", "", "b");
    let (_serve, serve) = start_serve(&[a, b], &["--public-introspection"]);
    eventually("both workers' models learned", || {
        let doc: Value = request(&serve, "GET", "/workers", "").json();
        let models = |name: &str| {
            doc["workers"]
                .as_array()
                .into_iter()
                .flatten()
                .find(|w| w["name"] == name)
                .map(|w| w["models"].clone())
        };
        models("a") == Some(json!(["alpha", "sql"])) && models("b") == Some(json!(["beta"]))
    });
    for seed in 0..6 {
        for (model, worker) in [("alpha", "a"), ("beta", "b"), ("sql", "a")] {
            let (status, served_by, doc) = complete(&serve, model, seed);
            assert_eq!(status, 200, "{model}: {doc}");
            assert_eq!(
                served_by.as_deref(),
                Some(worker),
                "{model} went to the wrong worker"
            );
        }
    }
    // Unknown: OpenAI's answer.
    let (status, _, doc) = complete(&serve, "gamma", 0);
    assert_eq!(status, 404, "{doc}");
    assert_eq!(doc["error"]["code"], "model_not_found", "{doc}");
    assert_eq!(doc["error"]["param"], "model", "{doc}");
    // The adapter's repeat hits its own blocks, and the router, hashing
    // with the adapter, predicted exactly what the engine reported.
    let (before_exact, before_all) = (
        count(&serve, "kvroute_accuracy_exact_total"),
        count(&serve, "kvroute_accuracy_comparisons_total"),
    );
    eventually("the adapter's blocks are indexed", || {
        let (_, _, doc) = complete(&serve, "sql", 0);
        doc["usage"]["prompt_tokens_details"]["cached_tokens"].as_u64() >= Some(112)
    });
    eventually("its prediction compared", || {
        count(&serve, "kvroute_accuracy_comparisons_total") > before_all
    });
    let (exact, all) = (
        count(&serve, "kvroute_accuracy_exact_total") - before_exact,
        count(&serve, "kvroute_accuracy_comparisons_total") - before_all,
    );
    assert!(
        all > 0 && exact == all,
        "{exact} of {all} predictions exact"
    );
    let models: Value = request(&serve, "GET", "/v1/models", "").json();
    let mut ids: Vec<&str> = models["data"]
        .as_array()
        .into_iter()
        .flatten()
        .filter_map(|m| m["id"].as_str())
        .collect();
    ids.sort_unstable();
    assert_eq!(ids, ["alpha", "beta", "sql"], "the union");
}
