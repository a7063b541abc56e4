//! The picker's routing, which is `kvroute serve`'s: the body read by the
//! same parser, the prompt tokenized by the same renderer, every rank priced
//! and ordered by the same scheduler and the first charged with the
//! request ([`crate::proxy::attempt`]), only among the endpoints the subset
//! hint allows. Nothing is sent: the gateway sends the request where the
//! pick says. Then [`Accounting`] follows the answer through the response
//! phase, as the proxy's relay does, so load, TTFT and accuracy are kept
//! the same way.

use std::sync::Arc;
use std::time::Instant;

use axum::body::Bytes;
use axum::http::{HeaderMap, HeaderValue};
use kvroute_prompt::body::RoutingRequest;

use super::exchange::{RequestHead, ResponseHead};
use super::subset::Endpoint;
use super::usage::UsageWatch;
use crate::api::ProxyError;
use crate::budget::Share;
use crate::metrics::epp::EppMetrics;
use crate::proxy::active::ActiveGuard;
use crate::proxy::attempt::{self, Eligible, REQUEST_ID};
use crate::proxy::candidates::Target;
use crate::proxy::relay::Prediction;
use crate::proxy::{intake, on_cpu, Endpoint as ApiEndpoint, Proxy, LARGE_BODY};

/// The header naming a multi-rank worker's rank, as vLLM reads it.
pub const RANK_HEADER: &str = "x-data-parallel-rank";

/// Where a request goes, and the accounting of its answer.
#[derive(Debug)]
pub struct Pick {
    /// `ip:port` (or `name:port`) of the chosen worker.
    pub endpoint: String,
    /// Headers added to the request besides the destination.
    pub headers: Vec<(&'static str, String)>,
    /// The request's id.
    pub request_id: String,
    /// The answer's accounting.
    pub accounting: Accounting,
    /// The request body's share of the memory budget (held until the body
    /// went back to Envoy).
    pub body_share: Share,
}

/// What routing reads of a request: for a completion or chat body, what
/// `kvroute serve` reads and tokenizes (on the blocking pool when large);
/// for any other request, nothing (it is routed on load alone).
async fn read(
    proxy: &Arc<Proxy>,
    head: &RequestHead,
    (body, share): (&Bytes, Share),
    has_body: bool,
) -> Result<(RoutingRequest, Share), ProxyError> {
    let endpoint = match ApiEndpoint::of_path(&head.path) {
        Some(endpoint) if has_body => endpoint,
        _ => return Ok((RoutingRequest::default(), share)),
    };
    let large = body.len() > LARGE_BODY;
    let (proxy, body) = (proxy.clone(), body.clone());
    on_cpu(large, move || {
        let mut share = share;
        let req = intake::read(&proxy, endpoint, &body, &mut share)?;
        Ok((req, share))
    })
    .await?
}

/// The request's id: the client's `x-request-id` when it is a short
/// printable token, else a new one (the proxy's rule).
fn request_id(proxy: &Proxy, head: &RequestHead) -> String {
    let mut headers = HeaderMap::new();
    if let Some(value) = head
        .request_id
        .as_deref()
        .and_then(|v| HeaderValue::from_str(v).ok())
    {
        headers.insert(REQUEST_ID, value);
    }
    proxy.request_id(&headers)
}

/// Picks the worker for a whole request (`has_body`: its headers did not
/// end the stream), charging it with the request.
pub async fn pick(
    proxy: &Arc<Proxy>,
    head: &RequestHead,
    (body, share): (&Bytes, Share),
    has_body: bool,
    arrived: Instant,
) -> Result<Pick, ProxyError> {
    let (mut req, body_share) = read(proxy, head, (body, share), has_body).await?;
    let chat = ApiEndpoint::of_path(&head.path) == Some(ApiEndpoint::Chat);
    crate::tokenizers::complete_from_engine(proxy, &mut req, body, chat).await;
    let req = Arc::new(req);
    if has_body {
        proxy.metrics.requests.inc();
        if req.tokens.is_none() {
            proxy.metrics.load_only.inc();
        }
    }
    let eligible: Eligible = head.subset.clone().map(|subset| {
        let keep = move |t: &Target| Endpoint::of_url(&t.url).is_some_and(|e| subset.admits(&e));
        Arc::new(keep) as Arc<dyn Fn(&Target) -> bool + Send + Sync>
    });
    let large = body.len() > LARGE_BODY;
    let admitted = attempt::admit_among(proxy, &req, large, eligible).await?;
    let request_id = request_id(proxy, head);
    let picked = admitted
        .pick(proxy, &req, &request_id)
        .ok_or(ProxyError::NoWorkers)?;
    let endpoint = Endpoint::of_url(&picked.target.url)
        .ok_or_else(|| {
            ProxyError::internal(format!(
                "worker `{}` has no host in its URL {}",
                picked.target.name, picked.target.url
            ))
        })?
        .to_string();
    let mut headers = Vec::new();
    if picked.target.ranks.len() > 1 {
        headers.push((RANK_HEADER, picked.scored.key.rank.0.to_string()));
    }
    Ok(Pick {
        accounting: Accounting {
            proxy: proxy.clone(),
            guard: Some(picked.guard),
            prediction: picked.prediction,
            arrived,
            first_chunk: None,
            sse: false,
            watch: None,
            endpoint: endpoint.clone(),
        },
        endpoint,
        headers,
        request_id,
        body_share,
    })
}

/// A picked request's answer as it passes: its place in the rank's load
/// (held until the answer ends or the stream closes, then freed), its
/// prefill marked done at the answer's first byte, its timings, and the
/// engine's `cached_tokens` compared with the prediction.
#[derive(Debug)]
pub struct Accounting {
    proxy: Arc<Proxy>,
    guard: Option<ActiveGuard>,
    prediction: Option<Prediction>,
    arrived: Instant,
    first_chunk: Option<Instant>,
    sse: bool,
    watch: Option<UsageWatch>,
    endpoint: String,
}

impl Accounting {
    /// The answer's head: whether it streams, whether it is a success (only
    /// successes are compared), and whether the gateway says another
    /// endpoint served it (counted in `metrics`).
    pub fn head(&mut self, head: &ResponseHead, metrics: &EppMetrics) {
        self.sse = head.sse;
        if head.status.is_some_and(|s| !(200..300).contains(&s)) {
            self.prediction = None;
        }
        if head.served.as_deref().is_some_and(|s| s != self.endpoint) {
            metrics.served_mismatch.inc();
            tracing::debug!(picked = %self.endpoint, served = ?head.served, "served by another endpoint than picked");
            self.prediction = None;
        }
        self.watch = self.prediction.is_some().then(|| UsageWatch::new(head.sse));
        if head.end_of_stream {
            self.end();
        }
    }

    /// A piece of the answer; `end_of_stream` on the last.
    pub fn chunk(&mut self, bytes: &[u8], end_of_stream: bool) {
        if self.first_chunk.is_none() && !bytes.is_empty() {
            self.first_chunk = Some(Instant::now());
            if let Some(g) = &self.guard {
                g.prefill_done();
            }
        }
        if let Some(reported) = self.watch.as_mut().and_then(|w| w.feed(bytes)) {
            self.settle(reported);
        }
        if end_of_stream {
            self.end();
        }
    }

    fn settle(&mut self, reported: u64) {
        if let Some(p) = self.prediction.take() {
            p.settle(&self.proxy, reported);
        }
        self.watch = None;
    }

    /// The answer is over (its last piece, its trailers): compare what a
    /// whole body reported, record the timings, free the load.
    pub fn end(&mut self) {
        let Some(guard) = self.guard.take() else {
            return;
        };
        if let Some(reported) = self.watch.as_mut().and_then(UsageWatch::finish) {
            self.settle(reported);
        }
        drop(guard);
        let first = self.first_chunk.filter(|_| self.sse);
        self.proxy.timed(self.arrived, first);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_apis_paths_are_read_and_others_routed_on_load() {
        let of = ApiEndpoint::of_path;
        assert_eq!(of("/v1/chat/completions"), Some(ApiEndpoint::Chat));
        assert_eq!(of("/v1/chat/completions/"), Some(ApiEndpoint::Chat));
        assert_eq!(of("/v1/completions"), Some(ApiEndpoint::Completions));
        assert_eq!(
            of("/openai/v1/completions?x=1"),
            Some(ApiEndpoint::Completions)
        );
        assert_eq!(of("/v1/responses"), Some(ApiEndpoint::Responses));
        assert_eq!(of("/v1/messages"), Some(ApiEndpoint::Messages));
        assert_eq!(of("/generate"), Some(ApiEndpoint::Generate));
        assert_eq!(of("/v1/models"), None);
        assert_eq!(of("/v1/embeddings"), None);
        assert_eq!(of(""), None);
    }
}
