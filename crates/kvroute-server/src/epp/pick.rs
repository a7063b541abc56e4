//! The picker's routing, which is `kvroute serve`'s: the body read by the
//! same parser, the prompt tokenized by the same renderer, every rank priced
//! and ordered by the same scheduler and the first charged with the
//! request ([`crate::router::admission`]), only among the endpoints the subset
//! hint allows. Nothing is sent: the gateway sends the request where the
//! pick says. Then [`Accounting`] follows the answer through the response
//! phase, as the router's relay does, so load, TTFT and accuracy are kept
//! the same way.

use std::sync::Arc;
use std::time::Instant;

use axum::body::Bytes;

use super::exchange::{RequestHead, ResponseHead};
use super::subset::Endpoint;
use super::usage::UsageWatch;
use crate::api::ProxyError;
use crate::budget::Share;
use crate::metrics::epp::EppMetrics;
use crate::router::accuracy::Prediction;
use crate::router::active::ActiveGuard;
use crate::router::admission::{self, Eligible};
use crate::router::candidates::Target;
use crate::router::continuations::ResponseWatch;
use crate::router::{intake, Endpoint as ApiEndpoint, Router, LARGE_BODY};

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

/// Picks the worker for a whole request (`has_body`: its headers did not
/// end the stream), charging it with the request: the request read by the
/// intake both doors share ([`intake::prepare`]: who sent it, its body,
/// its tokens, pins, continuation and model checks; a body of a path
/// kvroute does not read is placed on load alone), then admitted among
/// the endpoints the subset hint allows.
pub async fn pick(
    router: &Arc<Router>,
    head: &RequestHead,
    (body, share): (&Bytes, Share),
    has_body: bool,
    arrived: Instant,
) -> Result<Pick, ProxyError> {
    if has_body {
        router.metrics.requests.inc();
    }
    let endpoint = ApiEndpoint::of_path(&head.path).filter(|_| has_body);
    let arrival = intake::Arrival {
        headers: &head.headers,
        body,
        endpoint,
    };
    let (req, body_share) = intake::prepare(router, arrival, share).await?;
    crate::otel::spans::requested(&req);
    let req = Arc::new(req);
    let eligible: Eligible = head.subset.clone().map(|subset| {
        let keep = move |t: &Target| Endpoint::of_url(&t.url).is_some_and(|e| subset.admits(&e));
        Arc::new(keep) as Arc<dyn Fn(&Target) -> bool + Send + Sync>
    });
    let large = body.len() > LARGE_BODY;
    let admitted = admission::admit_among(router, &req, large, eligible).await?;
    let request_id = router.request_id(&head.headers);
    let picked = admitted
        .pick(router, &req, &request_id)
        .ok_or(ProxyError::NoWorkers)?;
    let endpoint_name = Endpoint::of_url(&picked.target.url)
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
    let remember =
        (endpoint == Some(ApiEndpoint::Responses)).then(|| (picked.scored.key, req.owner));
    Ok(Pick {
        accounting: Accounting {
            router: router.clone(),
            guard: Some(picked.guard),
            prediction: picked.prediction,
            arrived,
            first_chunk: None,
            sse: false,
            watch: None,
            endpoint: endpoint_name.clone(),
            response: remember.map(|(rank, owner)| ResponseWatch::new(rank, owner)),
        },
        endpoint: endpoint_name,
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
    router: Arc<Router>,
    guard: Option<ActiveGuard>,
    prediction: Option<Prediction>,
    arrived: Instant,
    first_chunk: Option<Instant>,
    sse: bool,
    watch: Option<UsageWatch>,
    endpoint: String,
    /// A Responses API answer's id, remembered for its continuations.
    response: Option<ResponseWatch>,
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
        if let Some(w) = &mut self.response {
            let success = head.status.is_none_or(|s| (200..300).contains(&s));
            w.head(head.sse, success);
        }
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
        if let Some(w) = &mut self.response {
            w.feed(&self.router, bytes);
        }
        if end_of_stream {
            self.end();
        }
    }

    fn settle(&mut self, reported: u64) {
        if let Some(p) = self.prediction.take() {
            p.settle(&self.router, reported);
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
        if let Some(w) = &mut self.response {
            w.end(&self.router);
        }
        drop(guard);
        let first = self.first_chunk.filter(|_| self.sse);
        self.router.timed(self.arrived, first);
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
