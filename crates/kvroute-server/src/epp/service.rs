//! `envoy.service.ext_proc.v3.ExternalProcessor/Process`: one task per
//! stream, which reads Envoy's messages into the stream's [`Exchange`],
//! picks once the request is whole, and writes the answers in the order the
//! protocol needs (the headers' answer naming the endpoint, then the body
//! echoed in pieces, then the response phase passed through as it comes).
//!
//! The request's place in its rank's load is held from the pick until the
//! answer ends, or the stream closes for any reason (the client went away,
//! Envoy timed out): the [`Accounting`] is dropped with the task. A pick
//! still waiting in the overload queue when Envoy closes the stream is
//! abandoned at once.

use std::sync::Arc;
use std::time::Instant;

use envoy_types::pb::envoy::service::ext_proc::v3::external_processor_server::ExternalProcessor;
use envoy_types::pb::envoy::service::ext_proc::v3::{ProcessingRequest, ProcessingResponse};
use tokio::sync::mpsc;
use tokio_stream::wrappers::ReceiverStream;
use tonic::{Request, Response, Status, Streaming};
use tracing::{debug, warn};

use super::exchange::{Exchange, Input, WholeRequest};
use super::pick::{pick, Accounting};
use super::reply::{self, Side};
use crate::api::{ErrorKind, ProxyError};
use crate::dialect::Dialect;
use crate::metrics::epp::{EppLabel, EppMetrics};
use crate::router::{Endpoint as ApiEndpoint, Router};

/// Answers queued for Envoy per stream before the task waits for it to
/// read them (a body of 1 MB is 17 pieces: backpressure, not a bound on size).
const OUT_QUEUE: usize = 8;

type Out = mpsc::Sender<Result<ProcessingResponse, Status>>;

/// The ext_proc service: the router's routing state, the picker's metrics
/// and its body bound.
#[derive(Debug, Clone)]
pub struct Picker {
    router: Arc<Router>,
    metrics: Arc<EppMetrics>,
    max_body_bytes: usize,
}

impl Picker {
    /// A picker routing with `router`, counting in `metrics`, reading
    /// request bodies of at most `max_body_bytes` (larger: 413).
    pub fn new(router: Arc<Router>, metrics: Arc<EppMetrics>, max_body_bytes: usize) -> Self {
        Picker {
            router,
            metrics,
            max_body_bytes,
        }
    }
}

#[tonic::async_trait]
impl ExternalProcessor for Picker {
    type ProcessStream = ReceiverStream<Result<ProcessingResponse, Status>>;

    async fn process(
        &self,
        request: Request<Streaming<ProcessingRequest>>,
    ) -> Result<Response<Self::ProcessStream>, Status> {
        let (out, answers) = mpsc::channel(OUT_QUEUE);
        tokio::spawn(self.clone().run(request.into_inner(), out));
        Ok(Response::new(ReceiverStream::new(answers)))
    }
}

/// The open-streams gauge, decremented however the stream's task ends.
struct Open(Arc<EppMetrics>);

impl Drop for Open {
    fn drop(&mut self) {
        self.0.open.dec();
    }
}

/// Completes at `deadline`, or never without one.
async fn body_late(deadline: Option<Instant>) {
    match deadline {
        Some(at) => tokio::time::sleep_until(tokio::time::Instant::from_std(at)).await,
        None => std::future::pending().await,
    }
}

/// Sends answers in order; false once Envoy is gone.
async fn send_all(out: &Out, answers: impl IntoIterator<Item = ProcessingResponse>) -> bool {
    for answer in answers {
        if out.send(Ok(answer)).await.is_err() {
            return false;
        }
    }
    true
}

impl Picker {
    /// Serves one stream until the exchange is over or either side goes.
    async fn run(self, mut inbound: Streaming<ProcessingRequest>, out: Out) {
        self.metrics.streams.inc();
        self.metrics.open.inc();
        let _open = Open(self.metrics.clone());
        let arrived = Instant::now();
        let rules = self.router.body_rules(self.max_body_bytes);
        let mut exchange = Exchange::new(rules, arrived);
        // Dropped with the task: frees the request's load however it ends.
        let mut accounting: Option<Accounting> = None;
        loop {
            // A request body must arrive as fast as over HTTP.
            let deadline = exchange.body_deadline();
            let next = tokio::select! {
                next = inbound.message() => next,
                () = out.closed() => return,
                () = body_late(deadline) => {
                    if let Some(refusal) = exchange.body_timed_out() {
                        self.refuse(&refusal.into(), (None, Dialect::OpenAi), &out).await;
                    }
                    return;
                }
            };
            let message = match next {
                Ok(Some(message)) => message,
                Ok(None) => return,
                Err(status) => {
                    debug!(%status, "ext_proc stream ended by the data plane");
                    return;
                }
            };
            let input = match exchange.accept(message) {
                Ok(input) => input,
                Err(e) => {
                    let reason = EppLabel::Reason(e.reason());
                    self.metrics.refused.get_or_create(&reason).inc();
                    warn!(error = %e, "ext_proc stream refused");
                    let _ = out
                        .send(Err(Status::failed_precondition(e.to_string())))
                        .await;
                    return;
                }
            };
            let going = match input {
                Input::Buffered => true,
                Input::Refused(e) => {
                    self.refuse(&ProxyError::from(e), (None, Dialect::OpenAi), &out)
                        .await;
                    return;
                }
                Input::Whole(whole) => match self
                    .route(whole, exchange.take_share(), arrived, &out)
                    .await
                {
                    Some(picked) => {
                        accounting = Some(picked);
                        true
                    }
                    None => return,
                },
                Input::ResponseHead(head) => {
                    if let Some(a) = &mut accounting {
                        a.head(&head, &self.metrics);
                    }
                    send_all(&out, [reply::response_headers()]).await
                }
                Input::ResponseChunk {
                    body,
                    end_of_stream,
                } => {
                    if let Some(a) = &mut accounting {
                        a.chunk(&body, end_of_stream);
                    }
                    send_all(&out, reply::body(Side::Response, &body, end_of_stream)).await
                }
                Input::ResponseTrailers => {
                    if let Some(a) = &mut accounting {
                        a.end();
                    }
                    send_all(&out, [reply::trailers(Side::Response)]).await
                }
            };
            if !going || exchange.is_done() {
                return;
            }
        }
    }

    /// Picks the endpoint of a whole request and sends the headers' answer
    /// naming it, then the body (and the trailers' answer); on an error, the
    /// immediate answer. The accounting of the answer to come, or `None`
    /// when the stream is over.
    async fn route(
        &self,
        whole: WholeRequest,
        share: crate::budget::Share,
        arrived: Instant,
        out: &Out,
    ) -> Option<Accounting> {
        let started = Instant::now();
        let WholeRequest {
            head,
            body,
            has_body,
            trailers,
        } = whole;
        let traced = crate::otel::spans::arrived("kvroute.pick", &head.headers, head.path.clone());
        let picking = std::pin::pin!(pick(&self.router, &head, (&body, share), has_body, arrived));
        let picked = tokio::select! {
            biased;
            () = out.closed() => return None,
            picked = crate::otel::within(traced.clone(), picking) => picked,
        };
        crate::otel::spans::picked(
            traced,
            picked.as_ref().err().map(|e| e.message()).as_deref(),
        );
        let picked = match picked {
            Ok(picked) => picked,
            Err(e) => {
                let subset = head.subset.as_ref().map(|s| s.len());
                let dialect =
                    ApiEndpoint::of_path(&head.path).map_or(Dialect::OpenAi, |e| e.dialect());
                self.refuse(&e, (subset, dialect), out).await;
                return None;
            }
        };
        if !send_all(out, [reply::routed(&picked.endpoint, &picked.headers)]).await {
            return None;
        }
        self.metrics
            .decision
            .observe(started.elapsed().as_secs_f64());
        self.metrics.picks.inc();
        debug!(request_id = %picked.request_id, endpoint = %picked.endpoint, "picked");
        let mut answers = Vec::new();
        if has_body {
            answers = reply::body(Side::Request, &body, !trailers);
        }
        if trailers {
            answers.push(reply::trailers(Side::Request));
        }
        let sent = send_all(out, answers).await;
        drop(picked.body_share);
        sent.then_some(picked.accounting)
    }

    /// Answers the client with `error` (the immediate answer ends the
    /// stream) in its API's `dialect`, counting it as `kvroute serve`
    /// counts its errors, and by status. With a subset hint of `subset`
    /// entries, no worker available says that none of them was.
    async fn refuse(
        &self,
        error: &ProxyError,
        (subset, dialect): (Option<usize>, Dialect),
        out: &Out,
    ) {
        let kind = error.kind();
        self.router.metrics.answered(kind);
        self.metrics.answered(reply::status_of(kind));
        let answer = match (kind, subset) {
            (ErrorKind::NoWorkers, Some(n)) => reply::for_kind(
                kind,
                &format!("none of the {n} endpoint(s) of the subset hint is an available worker"),
            ),
            _ => reply::for_error(error, dialect),
        };
        let _ = out.send(Ok(answer)).await;
    }
}
