//! `/query` and `/query_by_hash`: what each (worker, rank) holds of a request
//! and what sending it there would cost, without sending it. `scores` has the
//! shape of Dynamo's standalone indexer `/query` (worker → dp rank → matched
//! device tokens); `workers` and `chosen` add the detail.

use std::sync::Arc;

use axum::extract::State;
use axum::Json;
use kvroute_core::event::WorkerFlavor;
use kvroute_core::hash::LocalBlockHash;
use kvroute_core::scheduler::{order, Policy};
use serde_json::{json, Map, Value};

use crate::api::{ApiError, Body};
use crate::proxy::candidates::request_hashes;
use crate::proxy::scan::{parse_hash_query, parse_query, RoutingRequest};
use crate::proxy::Proxy;

/// The `/query` answer for a request's local hashes at each block size and
/// worker flavour (`flavor_matters`: the request has images).
fn query_answer(
    proxy: &Proxy,
    locals_at: &mut dyn FnMut(u32, WorkerFlavor) -> Vec<LocalBlockHash>,
    request_tokens: &dyn Fn(u32) -> u64,
    flavor_matters: bool,
) -> Value {
    let tokens = proxy
        .targets()
        .first()
        .map_or(0, |t| request_tokens(t.block_size));
    let candidates = proxy.candidates(locals_at, tokens, flavor_matters);
    let (targets, scored) = (&candidates.targets, &candidates.scored);
    let mut scores = Map::new();
    let workers: Vec<Value> = scored
        .iter()
        .map(|s| {
            let c = &s.candidate;
            let name = targets.get(s.worker).map_or("", |t| &*t.name);
            if c.device_blocks > 0 {
                let entry = scores
                    .entry(name.to_owned())
                    .or_insert_with(|| Value::Object(Map::new()));
                if let Some(m) = entry.as_object_mut() {
                    m.insert(
                        s.key.rank.to_string(),
                        Value::from(u64::from(c.device_blocks) * u64::from(s.block_size)),
                    );
                }
            }
            json!({
                "name": name,
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
        scored,
        Policy::Kv,
        proxy.config().temperature,
        proxy.random(),
        0,
    );
    let chosen = ordered.first().map_or(Value::Null, |&i| {
        let name = targets.get(scored[i].worker).map_or("", |t| &*t.name);
        json!({"name": name, "dp_rank": scored[i].key.rank})
    });
    json!({"scores": scores, "workers": workers, "chosen": chosen})
}

/// `POST /query`: what each (worker, rank) holds of a request and what it would cost.
pub async fn query(
    State(proxy): State<Arc<Proxy>>,
    Body(body): Body,
) -> Result<Json<Value>, ApiError> {
    let mut req: RoutingRequest = parse_query(&body).map_err(|e| ApiError::bad_request(e.0))?;
    proxy.tokenize(&mut req);
    let Some(tokens) = &req.tokens else {
        proxy.metrics.load_only.inc();
        return Err(ApiError::bad_request(
            "text prompts need `kvroute serve --tokenizer`; give `token_ids`",
        ));
    };
    let n = tokens.len() as u64;
    Ok(Json(query_answer(
        &proxy,
        &mut |bs, flavor| request_hashes(&req, bs, flavor),
        &|_| n,
        !req.images.is_empty(),
    )))
}

/// `POST /query_by_hash`: `/query` for precomputed `local_hashes`.
pub async fn query_by_hash(
    State(proxy): State<Arc<Proxy>>,
    Body(body): Body,
) -> Result<Json<Value>, ApiError> {
    let locals = parse_hash_query(&body).map_err(|e| ApiError::bad_request(e.0))?;
    let n = locals.len() as u64;
    Ok(Json(query_answer(
        &proxy,
        &mut |_, _| locals.clone(),
        &|bs| n * u64::from(bs),
        false,
    )))
}
