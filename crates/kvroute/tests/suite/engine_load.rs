//! `serve --engine-metrics-ms`: the load an engine reports on its own
//! `/metrics` (requests that never passed through the router) counts in
//! routing, so a busy engine is passed over even where its cache would
//! have drawn the request.

use serde_json::{json, Value};

use crate::support::http::{count, request};
use crate::support::{eventually, start_mocker, start_serve};

/// A prompt of 256 ids, its own for each `seed`.
fn prompt(seed: u32) -> Vec<u32> {
    (0..256).map(|i| 50_000 + seed * 1_000 + i).collect()
}

fn complete(serve: &str, tokens: &[u32], max_tokens: u32) -> Option<String> {
    let body = json!({"model": "mock-model", "prompt": tokens, "max_tokens": max_tokens});
    let reply = request(serve, "POST", "/v1/completions", &body.to_string());
    assert_eq!(reply.status, 200, "{}", reply.body);
    reply.header("x-kvroute-worker")
}

/// Whether `/query` marks `worker`'s rank overloaded.
fn overloaded(serve: &str, tokens: &[u32], worker: &str) -> bool {
    let q = json!({"token_ids": tokens}).to_string();
    let doc: Value = request(serve, "POST", "/query", &q).json();
    doc["workers"]
        .as_array()
        .into_iter()
        .flatten()
        .any(|w| w["name"] == worker && w["overloaded"] == true)
}

#[test]
fn requests_an_engine_reports_count_though_they_never_passed_through_the_router() {
    let (_mocker, lines) = start_mocker(2, "1");
    let busy = ["--busy-requests", "3", "--public-introspection"];
    let mut scraping = busy.to_vec();
    scraping.extend(["--engine-metrics-ms", "100"]);
    let (_blind, blind) = start_serve(&lines, &busy);
    let (_seeing, seeing) = start_serve(&lines, &scraping);
    // Both routers see the prompt cached on the worker that served it.
    let tokens = prompt(1);
    let cached_on = complete(&blind, &tokens, 1).expect("a worker");
    for router in [&blind, &seeing] {
        eventually("both routers see the prompt cached", || {
            let q = json!({"token_ids": tokens}).to_string();
            let doc: Value = request(router, "POST", "/query", &q).json();
            doc["scores"][&cached_on]["0"].as_u64().unwrap_or(0) >= 240
        });
    }
    // Four long requests straight to that engine, past both routers.
    let url = lines
        .iter()
        .find(|l| l.contains(&format!("name={cached_on},")))
        .and_then(|l| l.split(',').find_map(|kv| kv.strip_prefix("url=http://")))
        .expect("its url")
        .to_owned();
    for k in 0..4 {
        let url = url.clone();
        std::thread::spawn(move || {
            let body = json!({"model": "mock-model", "prompt": prompt(10 + k), "max_tokens": 3000});
            let _ = request(&url, "POST", "/v1/completions", &body.to_string());
        });
    }
    eventually("the scraping router sees the engine busy", || {
        overloaded(&seeing, &tokens, &cached_on)
    });
    assert!(count(&seeing, "kvroute_proxy_engine_scrapes_total") > 0);
    // The blind router first: the other's pick caches the prompt there too.
    let blind_pick = complete(&blind, &tokens, 1);
    let seeing_pick = complete(&seeing, &tokens, 1);
    assert_ne!(
        seeing_pick.as_deref(),
        Some(cached_on.as_str()),
        "passed over while busy"
    );
    assert_eq!(
        blind_pick.as_deref(),
        Some(cached_on.as_str()),
        "the router alone cannot tell"
    );
}
