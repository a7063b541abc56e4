//! `/query` and `/query_by_hash`: what each (worker, rank) holds of a request
//! and what sending it there would cost, without sending it. `scores` has the
//! shape of Dynamo's standalone indexer `/query` (worker → dp rank → matched
//! device tokens); `workers` and `chosen` add the detail.

use std::sync::atomic::Ordering;
use std::sync::PoisonError;

use axum::body::Bytes;
use axum::extract::State;
use axum::Json;
use kvroute_core::event::WorkerFlavor;
use kvroute_core::hash::LocalBlockHash;
use kvroute_core::index::SharedIndex;
use serde_json::{json, Map, Value};

use crate::http::{ApiError, AppState};
use crate::proxy::Router;
use crate::routing::{self, order, Policy, RoutingRequest};

/// The `/query` answer for a request's local hashes at each block size and
/// worker flavour (`flavor_matters`: the request has images).
fn query_answer(
    router: &Router,
    index: &SharedIndex,
    locals_at: &dyn Fn(u32, WorkerFlavor) -> Vec<LocalBlockHash>,
    request_tokens: &dyn Fn(u32) -> u64,
    flavor_matters: bool,
) -> Value {
    let targets = router
        .targets
        .read()
        .unwrap_or_else(PoisonError::into_inner)
        .clone();
    let tokens = targets.first().map_or(0, |t| request_tokens(t.block_size));
    let (_, scored) = router.score(index, locals_at, tokens, flavor_matters);
    let mut scores = Map::new();
    let workers: Vec<Value> = scored
        .iter()
        .map(|s| {
            let c = &s.candidate;
            if c.device_blocks > 0 {
                let entry = scores
                    .entry(s.name.clone())
                    .or_insert_with(|| Value::Object(Map::new()));
                if let Some(m) = entry.as_object_mut() {
                    m.insert(
                        s.key.rank.to_string(),
                        Value::from(u64::from(c.device_blocks) * u64::from(s.block_size)),
                    );
                }
            }
            json!({
                "name": s.name,
                "dp_rank": s.key.rank,
                "flavor": s.flavor.as_str(),
                "device_blocks": c.device_blocks,
                "host_blocks": c.host_blocks.saturating_sub(c.device_blocks),
                "disk_blocks": c.any_blocks.saturating_sub(c.host_blocks),
                "matched_tokens": u64::from(c.device_blocks) * u64::from(s.block_size),
                "active_prefill_tokens": c.active_prefill_tokens,
                "active_decode_blocks": c.active_decode_blocks,
                "overloaded": s.overloaded,
                "cost": {
                    "prefill_blocks": s.cost.prefill_blocks,
                    "overlap_credit": s.cost.overlap_credit,
                    "prefill": s.cost.prefill,
                    "decode_blocks": s.cost.decode_blocks,
                    "requests": s.cost.requests,
                    "total": s.cost.total,
                },
            })
        })
        .collect();
    let ordered = order(
        &scored,
        Policy::Kv,
        router.config().temperature,
        router.random(),
        0,
    );
    let chosen = ordered.first().map_or(
        Value::Null,
        |&i| json!({"name": scored[i].name, "dp_rank": scored[i].key.rank}),
    );
    json!({"scores": scores, "workers": workers, "chosen": chosen})
}

/// `POST /query`: what each (worker, rank) holds of a request and what it would cost.
pub async fn query(State(state): State<AppState>, body: Bytes) -> Result<Json<Value>, ApiError> {
    let mut req: RoutingRequest =
        routing::parse_query(&body).map_err(|e| ApiError::bad_request(e.0))?;
    let chat = req.text.is_some()
        && serde_json::from_slice::<Value>(&body).is_ok_and(|v| v.get("messages").is_some());
    state.router.tokenize(&mut req, &body, chat);
    let Some(tokens) = &req.tokens else {
        state
            .router
            .metrics
            .load_only
            .fetch_add(1, Ordering::Relaxed);
        return Err(ApiError::bad_request(
            "text prompts need `kvroute serve --tokenizer`; give `token_ids`",
        ));
    };
    let n = tokens.len() as u64;
    Ok(Json(query_answer(
        &state.router,
        &state.index,
        &|bs, flavor| routing::request_hashes(&req, bs, flavor),
        &|_| n,
        !req.images.is_empty(),
    )))
}

/// `POST /query_by_hash`: `/query` for precomputed `local_hashes`.
pub async fn query_by_hash(
    State(state): State<AppState>,
    body: Bytes,
) -> Result<Json<Value>, ApiError> {
    let locals = routing::parse_hash_query(&body).map_err(|e| ApiError::bad_request(e.0))?;
    let n = locals.len() as u64;
    Ok(Json(query_answer(
        &state.router,
        &state.index,
        &|_, _| locals.clone(),
        &|bs| n * u64::from(bs),
        false,
    )))
}
