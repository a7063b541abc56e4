//! The answer of a split SGLang `/generate` request that asked for the
//! prompt's log-probabilities (`return_logprob`): the decode engine
//! received the prompt's KV and reports none of them, so the prefill
//! leg's `meta_info.input_token_logprobs` are put in front of its own
//! ([`super::handoff::merge_input_logprobs`]), as SGLang's gateway does.
//! Non-streamed answers only: a stream is relayed as the decode engine
//! sends it.

use axum::body::Body;
use axum::http::header;
use axum::response::Response;
use serde_json::Value;

use super::answer;
use super::handoff;
use super::outcome::{self, Ending};
use super::Proxy;
use crate::api::{error_chain, ErrorKind, ProxyError};
use crate::router::active::ActiveGuard;
use crate::router::candidates::Target;

/// One leg's answer, from the worker it went to, and the load it holds.
pub struct LegAnswer<'a> {
    /// The worker.
    pub target: &'a Target,
    /// Its answer's head.
    pub resp: reqwest::Response,
    /// The load the leg holds until its answer is read.
    pub guard: ActiveGuard,
}

/// Reads both answers to their ends (settling each worker's breaker),
/// merges the prefill leg's prompt log-probabilities into the decode
/// answer and returns it, from the decode rank `rank`. A prefill answer
/// that cannot be read or holds no list leaves the decode answer as it is
/// (logged): its tokens were generated.
pub async fn respond(
    proxy: &Proxy,
    prefill: LegAnswer<'_>,
    decode: LegAnswer<'_>,
    (rank, request_id): (u32, &str),
) -> Result<Response, ProxyError> {
    let prefill_doc = read(proxy, prefill, request_id)
        .await
        .ok()
        .and_then(|(_, bytes)| serde_json::from_slice::<Value>(&bytes).ok());
    let worker = decode.target.name.clone();
    let (status, bytes) = read(proxy, decode, request_id)
        .await
        .map_err(|(kind, detail)| ProxyError::lost(kind, &worker, request_id, detail))?;
    let merged = match (prefill_doc, serde_json::from_slice::<Value>(&bytes)) {
        (Some(prefill_doc), Ok(mut decode_doc)) if status.is_success() => {
            handoff::merge_input_logprobs(&prefill_doc, &mut decode_doc);
            serde_json::to_vec(&decode_doc).ok()
        }
        _ => None,
    };
    let answer = merged.unwrap_or_else(|| {
        if status.is_success() {
            tracing::warn!(
                request_id,
                worker = %worker,
                "the prefill leg's input_token_logprobs could not be merged; the decode answer is returned as it came"
            );
        }
        bytes.to_vec()
    });
    Response::builder()
        .status(status.as_u16())
        .header("x-kvroute-worker", &*worker)
        .header("x-kvroute-dp-rank", rank)
        .header(header::CONTENT_TYPE, "application/json")
        .body(Body::from(answer))
        .map_err(|e| ProxyError::internal(e.to_string()))
}

/// One leg's answer read to its end, its worker's breaker settled and its
/// load freed; else the error kind and detail the request would end with.
async fn read(
    proxy: &Proxy,
    leg: LegAnswer<'_>,
    request_id: &str,
) -> Result<(reqwest::StatusCode, axum::body::Bytes), (ErrorKind, String)> {
    let LegAnswer {
        target,
        resp,
        guard,
    } = leg;
    let status = resp.status();
    guard.prefill_done();
    let read = answer::read_capped(resp, proxy.router.config().max_answer_bytes).await;
    let ending = match &read {
        Ok(_) => Ending::Complete(status),
        Err(_) => Ending::CutOff,
    };
    let verdict = outcome::settle(&proxy.router, &target.name, ending, request_id);
    drop(guard);
    match read {
        Ok(bytes) => Ok((status, bytes)),
        Err(e) => Err((
            verdict
                .next
                .error()
                .unwrap_or(ErrorKind::UpstreamIncomplete),
            format!("reading the answer: {}", error_chain(&e)),
        )),
    }
}
