//! `GET /dashboard` and `GET /api/stats`: the fleet and the routing as a
//! page that refreshes itself every second, for operators asking "is it
//! routing on the cache, or silently balancing load?".
//!
//! The page (HTML, CSS and JavaScript in one file, `page.html`) is part of
//! the binary and fetches nothing from elsewhere, so it works in an
//! air-gapped cluster; it holds no data and is served to anyone. Its data,
//! `/api/stats`, is introspection: it needs the admin token unless
//! `--public-introspection` is given (the page asks for the token and keeps
//! it in the tab's session storage).

pub mod series;

use std::collections::BTreeMap;
use std::sync::Arc;

use axum::extract::State;
use axum::http::header;
use axum::response::{IntoResponse, Response};
use axum::Json;
use serde_json::{json, Value};

use crate::admin::AdminState;
use crate::router::unix_ms;
use series::Sample;

/// The page, as built into the binary.
const PAGE: &str = include_str!("page.html");

/// Seconds of samples the per-rank request rates are averaged over.
const RATE_SECS: usize = 10;

/// Seconds of samples the load-only fraction is taken over.
const LOAD_ONLY_SECS: usize = 300;

/// `GET /dashboard`.
pub async fn page() -> Response {
    (
        [
            (header::CONTENT_TYPE, "text/html; charset=utf-8"),
            (header::CACHE_CONTROL, "no-store"),
            (
                header::CONTENT_SECURITY_POLICY,
                "default-src 'self'; script-src 'unsafe-inline'; style-src 'unsafe-inline'; img-src 'self' data:",
            ),
        ],
        PAGE,
    )
        .into_response()
}

/// `GET /api/stats`: see [`stats`].
pub async fn api_stats(State(state): State<AdminState>) -> Json<Value> {
    Json(stats(&state))
}

/// The sum of `f` over the last `n` samples.
fn last_sum(samples: &[Sample], n: usize, f: impl Fn(&Sample) -> u64) -> u64 {
    samples.iter().rev().take(n).map(f).sum()
}

/// Everything the page shows: a summary, every worker (with its
/// prefill/decode role) and rank with its state and load, the last ten minutes second by second, and the last
/// routing decisions with their candidates.
pub fn stats(state: &AdminState) -> Value {
    let router = &state.router;
    let totals = router.observed.totals();
    let samples = state.series.samples();
    let window = samples.len().clamp(1, RATE_SECS);
    let load: BTreeMap<_, _> = router
        .load()
        .into_iter()
        .map(|(key, requests, prefill, blocks)| (key, (requests, prefill, blocks)))
        .collect();
    let learned = router.learned_speeds();
    let workers: Vec<Value> = state
        .registry
        .view()
        .into_iter()
        .map(|w| {
            let name: Arc<str> = Arc::from(w.name.as_str());
            let ranks: Vec<Value> = w
                .ranks
                .iter()
                .map(|r| {
                    let key = kvroute_core::index::WorkerRank {
                        worker: w.id,
                        rank: r.dp_rank,
                    };
                    let (requests, prefill, _) = load.get(&key).copied().unwrap_or_default();
                    let speed = learned.as_ref().and_then(|l| l.get(&key).copied());
                    let routed = last_sum(&samples, RATE_SECS, |s| {
                        s.by_rank
                            .get(&(name.clone(), r.dp_rank))
                            .copied()
                            .unwrap_or(0)
                    });
                    json!({
                        "dp_rank": r.dp_rank,
                        "state": r.state.as_str(),
                        "state_reason": r.state_reason,
                        "connected": r.connected,
                        "blocks": r.blocks,
                        "in_flight": requests,
                        "prefill_tokens": prefill,
                        "routed_per_s": routed as f64 / window as f64,
                        "speed": speed.unwrap_or(w.speed),
                        "speed_learned": speed.is_some(),
                    })
                })
                .collect();
            json!({"name": w.name, "url": w.url, "model": w.model, "role": w.role.as_str(),
                   "bootstrap_port": w.bootstrap_port, "ranks": ranks})
        })
        .collect();
    let routed_total: u64 = totals.routed.values().sum();
    let recent_routed = last_sum(&samples, LOAD_ONLY_SECS, |s| s.routed);
    let recent_on_load = last_sum(&samples, LOAD_ONLY_SECS, |s| s.on_load);
    let ratio = |a: u64, b: u64| (b > 0).then(|| a as f64 / b as f64);
    let latest = samples.last();
    json!({
        "now_ms": unix_ms(),
        "policy": router.config().policy.as_str(),
        "summary": {
            "routed": routed_total,
            "routed_per_s": last_sum(&samples, RATE_SECS, |s| s.routed) as f64 / window as f64,
            "hit_rate": ratio(totals.cached_tokens, totals.prompt_tokens),
            "accuracy": ratio(totals.exact, totals.compared),
            "compared": totals.compared,
            "predicted_tokens": totals.predicted_tokens,
            "reported_tokens": totals.cached_tokens,
            "routed_on_load": totals.routed_on_load,
            "load_only_fraction": ratio(recent_on_load, recent_routed),
            "ttft_p50_ms": latest.and_then(|s| s.ttft_p50_ms),
            "ttft_p99_ms": latest.and_then(|s| s.ttft_p99_ms),
        },
        "workers": workers,
        "tokenizers": crate::tokenizers::tokenizers_json(router.tokenizers()),
        "series": samples,
        "decisions": decisions(&router.observed.decisions()),
    })
}

/// The decisions as JSON, each with its reason in words.
fn decisions(kept: &[crate::router::observe::Decision]) -> Vec<Value> {
    kept.iter()
        .map(|d| {
            let mut v = serde_json::to_value(d).unwrap_or(Value::Null);
            if let Some(o) = v.as_object_mut() {
                o.insert("reason".into(), Value::from(d.reason()));
            }
            v
        })
        .collect()
}
