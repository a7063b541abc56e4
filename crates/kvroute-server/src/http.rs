//! The HTTP surface: health, metrics, the worker listing and the admin
//! endpoints that register and unregister workers (shaped after Dynamo's
//! standalone indexer API so its tooling works against kvroute).

use std::fmt::Write as _;
use std::sync::Arc;

use axum::extract::State;
use axum::http::{header, HeaderMap, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use axum::{Json, Router};
use kvroute_core::index::SharedIndex;
use serde_json::{json, Value};

use crate::registry::Registry;
use crate::spec::{parse_flavor, RankEndpoints, WorkerFlavor, WorkerSpec};

/// What every handler shares.
#[derive(Debug, Clone)]
pub struct AppState {
    /// Registered workers.
    pub registry: Arc<Registry>,
    /// The prefix index.
    pub index: Arc<SharedIndex>,
    /// Bearer token required by the admin endpoints, when set.
    pub admin_token: Option<String>,
    /// Block size for registrations that do not give one.
    pub default_block_size: u32,
    /// Routing state of the proxy.
    pub router: Arc<crate::proxy::Router>,
    /// Largest request body accepted, in bytes.
    pub max_body_bytes: usize,
}

/// An error answered as `{"error": {"message", "type"}}` with its status.
#[derive(Debug)]
pub struct ApiError {
    status: StatusCode,
    message: String,
}

impl ApiError {
    /// A 400 with a message.
    pub fn bad_request(message: impl Into<String>) -> Self {
        ApiError {
            status: StatusCode::BAD_REQUEST,
            message: message.into(),
        }
    }
}

impl IntoResponse for ApiError {
    fn into_response(self) -> Response {
        let kind = match self.status {
            StatusCode::UNAUTHORIZED => "unauthorized",
            StatusCode::NOT_FOUND => "not_found",
            StatusCode::CONFLICT => "conflict",
            s if s.is_client_error() => "invalid_request_error",
            _ => "internal_error",
        };
        (
            self.status,
            Json(json!({"error": {"message": self.message, "type": kind}})),
        )
            .into_response()
    }
}

/// The router for the ingestion and admin endpoints.
pub fn app(state: AppState) -> Router {
    let limit = state.max_body_bytes;
    Router::new()
        .route("/v1/completions", post(crate::proxy::completions))
        .route("/v1/chat/completions", post(crate::proxy::chat_completions))
        .route("/v1/models", get(crate::proxy::models))
        .route("/query", post(crate::query::query))
        .route("/query_by_hash", post(crate::query::query_by_hash))
        .route("/health", get(health))
        .route("/workers", get(workers))
        .route("/metrics", get(metrics))
        .route("/register", post(register))
        .route("/unregister", post(unregister))
        .layer(axum::extract::DefaultBodyLimit::max(limit))
        .with_state(state)
}

async fn health(State(state): State<AppState>) -> Json<Value> {
    Json(json!({"status": "ok", "workers": state.registry.workers().len()}))
}

async fn workers(State(state): State<AppState>) -> Json<Value> {
    Json(state.registry.describe())
}

fn authorize(state: &AppState, headers: &HeaderMap) -> Result<(), ApiError> {
    let Some(token) = &state.admin_token else {
        return Ok(());
    };
    let given = headers
        .get(header::AUTHORIZATION)
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.strip_prefix("Bearer "));
    if given == Some(token.as_str()) {
        Ok(())
    } else {
        Err(ApiError {
            status: StatusCode::UNAUTHORIZED,
            message: "a valid admin bearer token is required".into(),
        })
    }
}

/// Parses a JSON body, answering 400 with serde's message when it is not JSON.
fn parse_body(body: &[u8]) -> Result<Value, ApiError> {
    let value: Value = serde_json::from_slice(body)
        .map_err(|e| ApiError::bad_request(format!("invalid JSON body: {e}")))?;
    if !value.is_object() {
        return Err(ApiError::bad_request("the body must be a JSON object"));
    }
    Ok(value)
}

fn str_field<'a>(v: &'a Value, key: &str) -> Result<Option<&'a str>, ApiError> {
    match v.get(key) {
        None | Some(Value::Null) => Ok(None),
        Some(Value::String(s)) => Ok(Some(s)),
        Some(Value::Number(n)) => Err(ApiError::bad_request(format!(
            "`{key}` must be a string, found {n}"
        ))),
        Some(_) => Err(ApiError::bad_request(format!("`{key}` must be a string"))),
    }
}

fn u32_field(v: &Value, key: &str) -> Result<Option<u32>, ApiError> {
    match v.get(key) {
        None | Some(Value::Null) => Ok(None),
        Some(value) => value
            .as_u64()
            .and_then(|n| u32::try_from(n).ok())
            .map(Some)
            .ok_or_else(|| {
                ApiError::bad_request(format!("`{key}` must be a non-negative integer"))
            }),
    }
}

/// A worker from a registration body: kvroute's own fields (`name`, `url`,
/// `events`, `replay`, `dp`, `block_size`, `topic`, `model`) or Dynamo's
/// standalone-indexer fields (`instance_id`, `endpoint`, `replay_endpoint`,
/// `dp_rank`, `block_size`, `model_name`), which register one rank.
fn spec_from_body(v: &Value, default_block_size: u32) -> Result<WorkerSpec, ApiError> {
    let block_size = u32_field(v, "block_size")?.unwrap_or(default_block_size);
    if let Some(events) = str_field(v, "events")? {
        let name =
            str_field(v, "name")?.ok_or_else(|| ApiError::bad_request("`name` is required"))?;
        let url = str_field(v, "url")?.ok_or_else(|| ApiError::bad_request("`url` is required"))?;
        let mut spec = WorkerSpec::with_base_endpoints(
            name.to_owned(),
            url.to_owned(),
            events,
            str_field(v, "replay")?,
            u32_field(v, "dp")?.unwrap_or(1),
            block_size,
        )
        .map_err(|e| ApiError::bad_request(e.to_string()))?;
        spec.topic = str_field(v, "topic")?.unwrap_or_default().to_owned();
        spec.model = str_field(v, "model")?.map(str::to_owned);
        spec.flavor = flavor_from_body(v)?;
        return Ok(spec);
    }
    if let Some(endpoint) = str_field(v, "endpoint")? {
        let name = match v.get("instance_id") {
            Some(Value::String(s)) => s.clone(),
            Some(Value::Number(n)) => n.to_string(),
            _ => {
                return Err(ApiError::bad_request(
                    "`instance_id` is required with `endpoint`",
                ))
            }
        };
        if block_size == 0 {
            return Err(ApiError::bad_request("`block_size` must be at least 1"));
        }
        let rank = u32_field(v, "dp_rank")?.unwrap_or(0);
        return Ok(WorkerSpec {
            url: str_field(v, "url")?.unwrap_or_default().to_owned(),
            name,
            ranks: vec![RankEndpoints {
                rank,
                events: endpoint.to_owned(),
                replay: str_field(v, "replay_endpoint")?.map(str::to_owned),
            }],
            block_size,
            topic: String::new(),
            model: str_field(v, "model_name")?.map(str::to_owned),
            flavor: flavor_from_body(v)?,
        });
    }
    Err(ApiError::bad_request(
        "give `name`, `url` and `events` (or Dynamo's `instance_id` and `endpoint`)",
    ))
}

/// A registration's `flavor` (`vllm` or `sglang`; absent: `vllm`).
fn flavor_from_body(v: &Value) -> Result<WorkerFlavor, ApiError> {
    parse_flavor(str_field(v, "flavor")?).map_err(|e| ApiError::bad_request(e.to_string()))
}

async fn register(
    State(state): State<AppState>,
    headers: HeaderMap,
    body: axum::body::Bytes,
) -> Result<Json<Value>, ApiError> {
    authorize(&state, &headers)?;
    let body = parse_body(&body)?;
    let spec = spec_from_body(&body, state.default_block_size)?;
    let flavor = spec.flavor;
    let name = spec.name.clone();
    let registry = state.registry.clone();
    let id = tokio::task::spawn_blocking(move || registry.register(spec))
        .await
        .map_err(|e| ApiError {
            status: StatusCode::INTERNAL_SERVER_ERROR,
            message: e.to_string(),
        })?
        .map_err(|e| ApiError {
            status: StatusCode::CONFLICT,
            message: e.to_string(),
        })?;
    state.router.refresh(&state.registry);
    Ok(Json(
        json!({"status": "registered", "name": name, "worker_id": id.0, "flavor": flavor.as_str()}),
    ))
}

async fn unregister(
    State(state): State<AppState>,
    headers: HeaderMap,
    body: axum::body::Bytes,
) -> Result<Json<Value>, ApiError> {
    authorize(&state, &headers)?;
    let body = parse_body(&body)?;
    let name = match (body.get("name"), body.get("instance_id")) {
        (Some(Value::String(s)), _) | (None, Some(Value::String(s))) => s.clone(),
        (None, Some(Value::Number(n))) => n.to_string(),
        _ => {
            return Err(ApiError::bad_request(
                "`name` (or `instance_id`) is required",
            ))
        }
    };
    let registry = state.registry.clone();
    let lookup = name.clone();
    let removed = tokio::task::spawn_blocking(move || registry.unregister(&lookup))
        .await
        .map_err(|e| ApiError {
            status: StatusCode::INTERNAL_SERVER_ERROR,
            message: e.to_string(),
        })?;
    state.router.refresh(&state.registry);
    if removed {
        Ok(Json(json!({"status": "unregistered", "name": name})))
    } else {
        Err(ApiError {
            status: StatusCode::NOT_FOUND,
            message: format!("no worker named `{name}`"),
        })
    }
}

/// Prometheus text exposition of ingestion and index counters.
pub fn metrics_text(registry: &Registry, index: &SharedIndex) -> String {
    let (counters, stats) = {
        let index = index.read();
        (index.counters(), index.stats())
    };
    let mut out = String::new();
    let workers = registry.describe();
    let rank_counters: [(&str, &str, &str); 12] = [
        (
            "batches",
            "kvroute_ingest_batches_total",
            "Event batches received live.",
        ),
        (
            "events",
            "kvroute_ingest_events_total",
            "Events applied to the index.",
        ),
        (
            "decode_errors",
            "kvroute_ingest_decode_errors_total",
            "Malformed events skipped.",
        ),
        (
            "events_filtered",
            "kvroute_ingest_events_filtered_total",
            "Events dropped on purpose (tier, placement, block size).",
        ),
        (
            "envelope_errors",
            "kvroute_ingest_envelope_errors_total",
            "Batches whose envelope could not be decoded.",
        ),
        (
            "bad_frames",
            "kvroute_ingest_bad_frames_total",
            "Messages that were not [topic, seq, payload].",
        ),
        (
            "gaps",
            "kvroute_ingest_gaps_total",
            "Sequence gaps detected.",
        ),
        (
            "replays_ok",
            "kvroute_ingest_replays_ok_total",
            "Replays that filled their gap.",
        ),
        (
            "replays_incomplete",
            "kvroute_ingest_replays_incomplete_total",
            "Replays that could not fill their gap.",
        ),
        (
            "restarts",
            "kvroute_ingest_engine_restarts_total",
            "Engine restarts seen (sequence went back).",
        ),
        (
            "clears",
            "kvroute_ingest_rank_clears_total",
            "Times a rank's blocks were dropped.",
        ),
        (
            "stale",
            "kvroute_ingest_stale_batches_total",
            "Batches dropped as already applied.",
        ),
    ];
    let list = workers["workers"].as_array().cloned().unwrap_or_default();
    for (field, name, help) in rank_counters {
        let _ = writeln!(out, "# HELP {name} {help}\n# TYPE {name} counter");
        for w in &list {
            for r in w["ranks"].as_array().into_iter().flatten() {
                let _ = writeln!(
                    out,
                    "{name}{{worker=\"{}\",dp_rank=\"{}\"}} {}",
                    w["name"].as_str().unwrap_or(""),
                    r["dp_rank"],
                    r[field]
                );
            }
        }
    }
    let _ = writeln!(out, "# HELP kvroute_ingest_connected Whether the rank's event socket is connected.\n# TYPE kvroute_ingest_connected gauge");
    for w in &list {
        for r in w["ranks"].as_array().into_iter().flatten() {
            let up = u8::from(r["connected"].as_bool().unwrap_or(false));
            let _ = writeln!(
                out,
                "kvroute_ingest_connected{{worker=\"{}\",dp_rank=\"{}\"}} {up}",
                w["name"].as_str().unwrap_or(""),
                r["dp_rank"]
            );
        }
    }
    let gauges = [
        (
            "kvroute_index_nodes",
            "Distinct block prefixes in the index.",
            stats.nodes,
        ),
        (
            "kvroute_index_residencies",
            "(block, rank, tier) residencies in the index.",
            stats.residencies,
        ),
        (
            "kvroute_index_heap_bytes",
            "Heap bytes held by the index.",
            stats.heap_bytes,
        ),
    ];
    for (name, help, value) in gauges {
        let _ = writeln!(
            out,
            "# HELP {name} {help}\n# TYPE {name} gauge\n{name} {value}"
        );
    }
    let index_counters = [
        ("kvroute_index_blocks_stored_total", counters.blocks_stored),
        (
            "kvroute_index_blocks_removed_total",
            counters.blocks_removed,
        ),
        (
            "kvroute_index_duplicate_blocks_total",
            counters.duplicate_blocks,
        ),
        (
            "kvroute_index_parent_missing_total",
            counters.parent_missing,
        ),
        (
            "kvroute_index_unknown_removals_total",
            counters.unknown_removals,
        ),
        (
            "kvroute_index_evicted_over_capacity_total",
            counters.evicted_over_capacity,
        ),
        (
            "kvroute_index_hash_conflicts_total",
            counters.hash_conflicts,
        ),
        (
            "kvroute_index_approx_expired_total",
            counters.approx_expired,
        ),
    ];
    for (name, value) in index_counters {
        let _ = writeln!(out, "# TYPE {name} counter\n{name} {value}");
    }
    out
}

async fn metrics(State(state): State<AppState>) -> impl IntoResponse {
    let mut text = metrics_text(&state.registry, &state.index);
    crate::proxy::metrics_text(&state.router, &mut text);
    ([(header::CONTENT_TYPE, "text/plain; version=0.0.4")], text)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn registrations_accept_kvroute_and_dynamo_shapes() {
        let ours = json!({"name": "w0", "url": "http://h:1", "events": "tcp://h:5557", "replay": "tcp://h:5657", "dp": 2});
        let spec = spec_from_body(&ours, 16).expect("valid");
        assert_eq!(spec.ranks.len(), 2);
        assert_eq!(spec.block_size, 16);
        let dynamo = json!({"instance_id": 7, "endpoint": "tcp://h:6000", "dp_rank": 1, "block_size": 32, "model_name": "m"});
        let spec = spec_from_body(&dynamo, 16).expect("valid");
        assert_eq!(
            (spec.name.as_str(), spec.ranks[0].rank, spec.block_size),
            ("7", 1, 32)
        );
    }

    #[test]
    fn bad_registrations_get_clear_messages() {
        let err = |v: Value| spec_from_body(&v, 16).expect_err("invalid").message;
        assert!(err(json!({"url": "x"})).contains("give `name`"));
        assert!(err(json!({"name": "a", "events": "tcp://h:1"})).contains("`url` is required"));
        assert!(
            err(json!({"name": "a", "url": "u", "events": "tcp://h:1", "dp": -1})).contains("`dp`")
        );
        assert!(err(json!({"name": 5, "url": "u", "events": "tcp://h:1"}))
            .contains("`name` must be a string"));
        assert!(flavor_from_body(&json!({"flavor": "tgi"}))
            .expect_err("unknown")
            .message
            .contains("vllm or sglang"));
        assert_eq!(
            flavor_from_body(&json!({"flavor": "sglang"})).expect("valid"),
            WorkerFlavor::Sglang
        );
        assert_eq!(
            flavor_from_body(&json!({})).expect("valid"),
            WorkerFlavor::Vllm
        );
        assert!(parse_body(b"[1]").is_err());
        assert!(parse_body(b"{")
            .expect_err("not json")
            .message
            .contains("invalid JSON"));
    }
}
