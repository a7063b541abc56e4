//! `/query` and `/query_by_hash`: what each (worker, rank) holds of a request
//! and what sending it there would cost, without sending it. `scores` has the
//! shape of Dynamo's standalone indexer `/query` (worker → dp rank → matched
//! device tokens); `workers` and `chosen` add the detail, and on a fleet of
//! prefill and decode workers `disagg` says where each phase would go and
//! why, as the router would place it; with `--fetch-us-per-block`, `fetch`
//! names the holder a request's prefix would move from, and why; with
//! `--replicate-hot-ms`, `replicate` the copy of its hot prefix the next
//! such request would start.

use std::sync::Arc;

use axum::extract::State;
use axum::Json;
use kvroute_core::event::WorkerFlavor;
use kvroute_core::hash::LocalBlockHash;
use serde_json::{json, Map, Value};

use crate::api::ProxyError;
use crate::bodies::Body;
use crate::router::candidates::Candidates;
use crate::router::split as disagg;
use crate::router::Router;
use kvroute_prompt::body::{parse_hash_query, parse_query, RoutingRequest};

/// The `/query` answer for a request's local hashes at each block size and
/// worker flavour (`flavor_matters`: the request has images), and its token
/// ids when it gave them (`ids`: what a copy's prefix is keyed by).
fn query_answer(
    router: &Router,
    locals_at: &mut dyn FnMut(u32, WorkerFlavor) -> Vec<LocalBlockHash>,
    request_tokens: &dyn Fn(u32) -> u64,
    (flavor_matters, ids): (bool, Option<&[u32]>),
) -> Value {
    let tokens = router
        .targets()
        .first()
        .map_or(0, |t| request_tokens(t.block_size));
    let candidates = router.candidates(locals_at, tokens, flavor_matters);
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
                "role": targets.get(s.worker).map_or("both", |t| t.role.as_str()),
                "device_blocks": c.device_blocks,
                "host_blocks": c.host_blocks.saturating_sub(c.device_blocks),
                "disk_blocks": c.any_blocks.saturating_sub(c.host_blocks),
                "matched_tokens": u64::from(c.device_blocks) * u64::from(s.block_size),
                "active_prefill_tokens": c.active_prefill_tokens,
                "active_decode_blocks": c.active_decode_blocks,
                "overloaded": s.overloaded,
                "speed": s.speed,
                "cost": {
                    "prefill_blocks": s.cost.prefill_blocks,
                    "overlap_credit": s.cost.overlap_credit,
                    "prefill": s.cost.prefill,
                    "decode_blocks": s.cost.decode_blocks,
                    "requests": s.cost.requests,
                    "decode_load": s.cost.decode_load,
                    "size": s.cost.size,
                    "total": s.cost.total,
                },
            })
        })
        .collect();
    let (ordered, fetch, copy) = {
        let placer = router.placer();
        let ordered = placer.preview(scored, router.random());
        let fetch = placer.preview_fetch(scored, &ordered, tokens);
        let now = router.now_ms();
        let copy = ids.and_then(|ids| placer.preview_replicate(scored, &ordered, (ids, now)));
        (ordered, fetch, copy)
    };
    let rank = |i: usize| {
        let name = targets.get(scored[i].worker).map_or("", |t| &*t.name);
        json!({"name": name, "dp_rank": scored[i].key.rank})
    };
    let chosen = ordered.first().map_or(Value::Null, |&i| rank(i));
    let mut answer = json!({"scores": scores, "workers": workers, "chosen": chosen});
    if disagg::splits(targets) {
        answer["disagg"] = disagg_answer(router, &candidates, tokens);
    } else if let Some(f) = fetch {
        // The rank that runs it receives the prefix from its holder.
        answer["chosen"] = rank(f.receiver);
        answer["fetch"] = json!({
            "source": rank(f.source),
            "receiver": rank(f.receiver),
            "blocks": f.blocks,
            "cost": f.cost,
            "instead": f.instead,
            "reason": crate::proxy::fetch::explain(&candidates, &f),
        });
    } else if let Some(c) = copy {
        answer["replicate"] = json!({
            "source": rank(c.source),
            "target": rank(c.target),
            "blocks": c.blocks,
            "reason": crate::proxy::replicate::explain(&candidates, &c),
        });
    }
    answer
}

/// Where a disaggregated fleet would send the request's phases, and why
/// (the router's own placement, nothing charged); `null` when no rank may
/// decode it.
fn disagg_answer(router: &Router, candidates: &Candidates, tokens: u64) -> Value {
    let random = router.random();
    let (scored, targets) = (&candidates.scored, &candidates.targets);
    let preview = router
        .placer()
        .preview_split(scored, targets, Some(tokens), random);
    let Some(plan) = preview else {
        return Value::Null;
    };
    let why = disagg::explain(candidates, &plan, tokens);
    let rank = |i: usize| {
        let s = &candidates.scored[i];
        let name = candidates.targets.get(s.worker).map_or("", |t| &*t.name);
        json!({"name": name, "dp_rank": s.key.rank})
    };
    json!({
        "decode": rank(plan.decode),
        "decode_cost": plan.cost.total,
        "uncached_on_decode_tokens": plan.cost.uncached_tokens,
        "prefill_locally": plan.prefill.is_empty(),
        "prefill": plan.prefill.first().map_or(Value::Null, |&i| rank(i)),
        "reason": why,
    })
}

/// `POST /query`: what each (worker, rank) holds of a request and what it
/// would cost. The work (parsing, tokenizing, hashing, the index walk) runs
/// on the blocking pool, so a large body never holds up other requests.
pub async fn query(
    State(router): State<Arc<Router>>,
    Body(body, _share): Body,
) -> Result<Json<Value>, ProxyError> {
    off_runtime(move || {
        let mut req: RoutingRequest =
            parse_query(&body).map_err(|e| ProxyError::bad_request(e.0))?;
        router.tokenize(&mut req);
        let Some(tokens) = &req.tokens else {
            router.metrics.load_only.inc();
            return Err(ProxyError::bad_request(
                "text prompts need `kvroute serve --tokenizer`; give `token_ids`",
            ));
        };
        let n = tokens.len() as u64;
        Ok(Json(query_answer(
            &router,
            &mut |bs, flavor| req.local_hashes(bs, flavor),
            &|_| n,
            (!req.images.is_empty(), Some(tokens)),
        )))
    })
    .await
}

/// `POST /query_by_hash`: `/query` for precomputed `local_hashes`.
pub async fn query_by_hash(
    State(router): State<Arc<Router>>,
    Body(body, _share): Body,
) -> Result<Json<Value>, ProxyError> {
    off_runtime(move || {
        let locals = parse_hash_query(&body).map_err(|e| ProxyError::bad_request(e.0))?;
        let n = locals.len() as u64;
        Ok(Json(query_answer(
            &router,
            &mut |_, _| locals.clone(),
            &|bs| n * u64::from(bs),
            (false, None),
        )))
    })
    .await
}

/// Runs `work` on the blocking pool.
async fn off_runtime<T: Send + 'static>(
    work: impl FnOnce() -> Result<T, ProxyError> + Send + 'static,
) -> Result<T, ProxyError> {
    tokio::task::spawn_blocking(work)
        .await
        .map_err(|e| ProxyError::internal(format!("the query failed: {e}")))?
}

/// How many queries may run at once and how large a query body may be.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct QueryLimits {
    /// Largest `/query` or `/query_by_hash` body, in bytes (larger: 413).
    pub max_body_bytes: usize,
    /// Queries computed at once; more get 429 with `Retry-After`.
    pub concurrency: usize,
}

impl Default for QueryLimits {
    fn default() -> Self {
        QueryLimits {
            max_body_bytes: 4 << 20,
            concurrency: std::thread::available_parallelism().map_or(2, |n| n.get()),
        }
    }
}

/// Answers 429 with `Retry-After: 1` when `concurrency` queries are running.
pub async fn limit_concurrency(
    State(slots): State<Arc<tokio::sync::Semaphore>>,
    request: axum::extract::Request,
    next: axum::middleware::Next,
) -> axum::response::Response {
    use axum::response::IntoResponse as _;
    let Ok(_permit) = slots.try_acquire() else {
        let busy = ProxyError::RateLimited(
            "too many /query requests at once; retry in a second".to_owned(),
        );
        let mut response = busy.into_response();
        response.headers_mut().insert(
            axum::http::header::RETRY_AFTER,
            axum::http::HeaderValue::from_static("1"),
        );
        return response;
    };
    next.run(request).await
}
