//! SGLang's bootstrap hand-off: both legs of a split request at once, each
//! naming the prefill worker's bootstrap server and one fresh room per
//! prompt; the decode's answer relayed, the prefill's read to its end in
//! the background (or merged, for prompt log-probabilities).
//!
//! The legs wait for each other, so they fail together: the first to fail
//! drops (cancels) the other, which would otherwise wait for a room that
//! never fills. A leg refused before any work (no connection, 503, 429)
//! sends both legs again, in new rooms, with the refusing side's next
//! worker (at most `--max-attempts` pairs). A prefill leg with no answer
//! within `--prefill-timeout-secs` ends the request with a 502 and opens
//! the prefill worker's breaker: it took the request, so no other worker
//! gets it.
//!
//! [`hand_off`] sends the same two legs once between two given aggregated
//! workers, for a fetch (`crate::proxy::fetch`): the holder as the
//! bootstrap source, the receiver reading from it; a fetch that does not
//! hand off leaves the request to its caller, which recomputes it.

use std::future::Future;
use std::sync::Arc;

use axum::response::Response;
use tokio::time::error::Elapsed;

use super::{
    decode_ranks, host_of, leg, next_leg, prefill_timed_out, rank_name, record, respond_decode,
};
use crate::api::ProxyError;
use crate::otel::spans::phase;
use crate::otel::within;
use crate::proxy::answer;
use crate::proxy::handoff::{self, Bootstrap};
use crate::proxy::merge;
use crate::proxy::outcome::{self, Ending};
use crate::proxy::send::open_candidate;
use crate::proxy::send::{send, Request, Sent};
use crate::proxy::Proxy;
use crate::router::active::ActiveGuard;
use crate::router::candidates::{Candidates, Target};
use crate::router::split::Placed;

/// The most prompts one request may carry to SGLang: one bootstrap room each.
const MAX_BATCH: usize = 4_096;

/// One leg's worker: its position in the candidates, its target and its
/// place in the load.
type Leg<'c> = (usize, &'c Target, ActiveGuard);

/// How sending both legs ended.
enum Legs {
    /// Both heads arrived, the prefill's a success; the proxy asked for
    /// the decode's usage chunk on the client's behalf when the flag is set.
    Answered(Box<(reqwest::Response, reqwest::Response, bool)>),
    /// The prefill worker refused its leg before any work.
    PrefillRefused(String),
    /// The decode worker refused its leg before any work.
    DecodeRefused(String),
}

/// Routes a split request to SGLang workers: the placed prefill and decode
/// ranks first, each side moving on to its pool's next worker when its
/// leg is refused.
pub(super) async fn route(
    proxy: &Arc<Proxy>,
    candidates: &Candidates,
    placed: Placed,
    request: Request<'_>,
) -> Result<Response, ProxyError> {
    let Placed {
        decode,
        decode_guard,
        prefill,
        first_prefill,
        why,
        ..
    } = placed;
    let decodes = decode_ranks(candidates, decode, &request);
    let (mut next_p, mut first_p) = (0, first_prefill);
    let (mut next_d, mut first_d) = (0, Some((decode, decode_guard)));
    let (mut p, mut d): (Option<Leg<'_>>, Option<Leg<'_>>) = (None, None);
    let mut last_error = String::from("no prefill worker available");
    let max_attempts = proxy.router.config().max_attempts.max(1);
    for attempt in 0..max_attempts {
        if p.is_none() {
            let pool = (prefill.as_slice(), &mut next_p);
            p = next_leg(proxy, candidates, pool, &mut first_p, (&request, false));
        }
        if d.is_none() {
            let pool = (decodes.as_slice(), &mut next_d);
            d = next_leg(proxy, candidates, pool, &mut first_d, (&request, true));
        }
        let (Some(prefill_leg), Some(decode_leg)) = (p.take(), d.take()) else {
            break;
        };
        if attempt > 0 {
            proxy.router.metrics.retries.inc();
        }
        match send_both(proxy, candidates, (&prefill_leg, &decode_leg), &request).await? {
            Legs::Answered(answers) => {
                let why = if attempt == 0 {
                    why
                } else {
                    format!(
                        "{why}; legs on {} and {} after {attempt} refused",
                        rank_name(candidates, prefill_leg.0),
                        rank_name(candidates, decode_leg.0)
                    )
                };
                record(proxy, candidates, (decode_leg.0, attempt), &request, why);
                let legs = (prefill_leg, decode_leg);
                return respond(proxy, candidates, legs, *answers, request).await;
            }
            Legs::PrefillRefused(message) => {
                last_error = message;
                d = Some(decode_leg);
            }
            Legs::DecodeRefused(message) => {
                last_error = message;
                p = Some(prefill_leg);
            }
        }
    }
    Err(ProxyError::UpstreamUnreachable(last_error))
}

/// How a bootstrap hand-off between two given workers ended ([`hand_off`]).
pub(in crate::proxy) enum HandOff {
    /// Both legs answered, the receiver's a success: the client's answer.
    Answered(Result<Response, ProxyError>),
    /// Nothing reached the client: why, and the receiver's candidate and
    /// place in the load back, for a plain request.
    NotHandedOff(String, (usize, ActiveGuard)),
}

/// Sends a request's two legs once: to `source` as the bootstrap source
/// (its prefill leg computes or finds the prompt and holds its blocks) and
/// to `receiver` (placed, with its place in the load), which reads the
/// blocks it lacks from the source and runs the request. Only when both
/// heads arrived and the receiver's is a success is the answer the
/// client's; anything else (a leg refused, failed, the source's past
/// `--prefill-timeout-secs`, the receiver's error answer) gives the
/// receiver back unanswered, its leg dropped (cancelled).
pub(in crate::proxy) async fn hand_off(
    proxy: &Arc<Proxy>,
    candidates: &Candidates,
    (source, receiver): (usize, (usize, ActiveGuard)),
    request: &Request<'_>,
    why: String,
) -> HandOff {
    let (mut at, mut first) = (0, None);
    let pool = (std::slice::from_ref(&source), &mut at);
    let Some(source_leg) = next_leg(proxy, candidates, pool, &mut first, (request, false)) else {
        let why = "the holder is unavailable (breaker open or unknown)".to_owned();
        return HandOff::NotHandedOff(why, receiver);
    };
    let Some((_, target)) = open_candidate(proxy, candidates, receiver.0) else {
        let why = "the receiver's breaker is open".to_owned();
        return HandOff::NotHandedOff(why, receiver);
    };
    let receiver_leg = (receiver.0, target, receiver.1);
    let legs = (&source_leg, &receiver_leg);
    let detail = match send_both(proxy, candidates, legs, request).await {
        Ok(Legs::Answered(answers)) if answers.1.status().is_success() => {
            record(proxy, candidates, (receiver_leg.0, 0), request, why);
            let legs = (source_leg, receiver_leg);
            let answer = respond(proxy, candidates, legs, *answers, *request).await;
            return HandOff::Answered(answer);
        }
        Ok(Legs::Answered(answers)) => format!("the receiver answered {}", answers.1.status()),
        Ok(Legs::PrefillRefused(message)) => format!("the holder refused its leg: {message}"),
        Ok(Legs::DecodeRefused(message)) => format!("the receiver refused its leg: {message}"),
        Err(e) => e.message(),
    };
    HandOff::NotHandedOff(detail, (receiver_leg.0, receiver_leg.2))
}

/// Sends both legs at once, in fresh rooms of the prefill worker's
/// bootstrap server, the prefill leg bounded by `--prefill-timeout-secs`.
async fn send_both(
    proxy: &Arc<Proxy>,
    candidates: &Candidates,
    (prefill, decode): (&Leg<'_>, &Leg<'_>),
    request: &Request<'_>,
) -> Result<Legs, ProxyError> {
    let (bootstrap, batch) = sglang_bootstrap(proxy, prefill.1, request.body)?;
    let legs = |i: usize| {
        let bootstrap = bootstrap.clone();
        leg(proxy, candidates, i, request, move |body| {
            handoff::sglang_body(body, &bootstrap, batch)
        })
    };
    let (prefill_out, decode_out) = (legs(prefill.0).await?, legs(decode.0).await?);
    let added_usage = decode_out.added_usage;
    let (endpoint, headers, id) = (request.endpoint, request.headers, request.request_id);
    let (prefill_span, decode_span) = (phase("kvroute.prefill"), phase("kvroute.decode"));
    let prefill_sent = tokio::time::timeout(
        proxy.router.config().prefill_timeout,
        within(
            prefill_span,
            send(proxy, prefill.1, endpoint, prefill_out, headers, id),
        ),
    );
    let decode_sent = within(
        decode_span,
        send(proxy, decode.1, endpoint, decode_out, headers, id),
    );
    match both(prefill_sent, decode_sent).await {
        Both::Heads(heads) => Ok(Legs::Answered(Box::new((heads.0, heads.1, added_usage)))),
        Both::PrefillRefused(message) => Ok(Legs::PrefillRefused(message)),
        Both::DecodeRefused(message) => Ok(Legs::DecodeRefused(message)),
        Both::PrefillTimedOut => Err(prefill_timed_out(proxy, prefill.1, id)),
        Both::Failed(error) => Err(error),
    }
}

/// How waiting for both legs' heads ended.
enum Both {
    /// Both heads, the prefill's a success.
    Heads(Box<(reqwest::Response, reqwest::Response)>),
    /// The prefill leg was refused before any work.
    PrefillRefused(String),
    /// The decode leg was refused before any work.
    DecodeRefused(String),
    /// The prefill leg got no head in time.
    PrefillTimedOut,
    /// The request ends with this error.
    Failed(ProxyError),
}

/// Waits for both legs' heads; the first leg to fail drops (cancels) the
/// other, which would otherwise wait for a bootstrap room that never fills.
async fn both(
    prefill: impl Future<Output = Result<Sent, Elapsed>>,
    decode: impl Future<Output = Sent>,
) -> Both {
    tokio::pin!(prefill);
    tokio::pin!(decode);
    let (mut p, mut d) = (None, None);
    loop {
        tokio::select! {
            sent = &mut prefill, if p.is_none() => match sent {
                Err(_) => return Both::PrefillTimedOut,
                Ok(Sent::Answer(resp)) if !resp.status().is_success() => {
                    let message = format!("the prefill leg answered {}", resp.status());
                    return Both::Failed(ProxyError::UpstreamUnreachable(message));
                }
                Ok(Sent::Answer(resp)) => p = Some(resp),
                Ok(Sent::Refused(message)) => return Both::PrefillRefused(message),
                Ok(Sent::Failed(error)) => return Both::Failed(error),
            },
            sent = &mut decode, if d.is_none() => match sent {
                Sent::Answer(resp) => d = Some(resp),
                Sent::Refused(message) => return Both::DecodeRefused(message),
                Sent::Failed(error) => return Both::Failed(error),
            },
        }
        if let (Some(_), Some(_)) = (&p, &d) {
            if let (Some(p), Some(d)) = (p.take(), d.take()) {
                return Both::Heads(Box::new((p, d)));
            }
        }
    }
}

/// The client's answer from both legs' heads: the decode's relayed (with
/// the prefill's prompt log-probabilities merged in when asked for and not
/// streamed), the prefill's read to its end in the background.
async fn respond(
    proxy: &Arc<Proxy>,
    candidates: &Candidates,
    (prefill, decode): (Leg<'_>, Leg<'_>),
    (prefill_resp, decode_resp, added_usage): (reqwest::Response, reqwest::Response, bool),
    request: Request<'_>,
) -> Result<Response, ProxyError> {
    let (d, decode_target, decode_guard) = decode;
    let (_, prefill_target, prefill_guard) = prefill;
    if request.req.body.input_logprobs && !request.req.body.stream {
        let rank = candidates.scored[d].key.rank.0;
        let prefill = merge::LegAnswer {
            target: prefill_target,
            resp: prefill_resp,
            guard: prefill_guard,
        };
        let decode = merge::LegAnswer {
            target: decode_target,
            resp: decode_resp,
            guard: decode_guard,
        };
        let answer = merge::respond(proxy, prefill, decode, (rank, request.request_id)).await;
        proxy.router.timed(request.arrived, None);
        return answer;
    }
    drain_prefill(
        proxy,
        prefill_target.name.clone(),
        prefill_resp,
        prefill_guard,
        request.request_id,
    );
    let answer = (decode_resp, decode_guard, added_usage);
    respond_decode(proxy, candidates, (d, decode_target), answer, &request).await
}

/// The bootstrap both SGLang legs name: the prefill worker's host and
/// bootstrap port, and one fresh room per prompt of the body (at most
/// [`MAX_BATCH`]); with the body's prompt count when it is a batch.
fn sglang_bootstrap(
    proxy: &Proxy,
    prefill_target: &Target,
    body: &[u8],
) -> Result<(Bootstrap, Option<usize>), ProxyError> {
    let batch = handoff::batch_size(body).map_err(|e| ProxyError::bad_request(e.to_string()))?;
    if batch.is_some_and(|n| n > MAX_BATCH) {
        return Err(ProxyError::bad_request(format!(
            "at most {MAX_BATCH} prompts per disaggregated request"
        )));
    }
    let bootstrap = Bootstrap {
        host: host_of(&prefill_target.url),
        port: Some(
            prefill_target
                .bootstrap_port
                .unwrap_or(handoff::DEFAULT_BOOTSTRAP_PORT),
        ),
        rooms: (0..batch.unwrap_or(1))
            .map(|_| Bootstrap::room(proxy.router.random_u64()))
            .collect(),
    };
    Ok((bootstrap, batch))
}

/// Reads an SGLang prefill leg's answer to its end in the background, then
/// settles the worker's breaker and frees its prefill load.
fn drain_prefill(
    proxy: &Arc<Proxy>,
    worker: Arc<str>,
    resp: reqwest::Response,
    guard: ActiveGuard,
    request_id: &str,
) {
    let (proxy, request_id) = (proxy.clone(), request_id.to_owned());
    let timeout = proxy.router.config().prefill_timeout;
    tokio::spawn(async move {
        let status = resp.status();
        let ending = match tokio::time::timeout(timeout, answer::drain(resp)).await {
            Ok(Ok(())) => Ending::Complete(status),
            Ok(Err(_)) | Err(_) => Ending::CutOff,
        };
        outcome::settle(&proxy.router, &worker, ending, &request_id);
        drop(guard);
    });
}
