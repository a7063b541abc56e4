//! Getting a request to a worker: admission (the candidates in the policy's
//! order, or a bounded wait while every rank is over its busy thresholds),
//! then attempts on the candidates in that order.
//!
//! Which failures move a request on, what each worker's breaker records
//! and what the client is told is the retry rule of [`super::outcome`],
//! applied here as each attempt ends: when it is sent, and when a whole
//! (non-streamed) answer has been read; [`super::relay`] applies it when a
//! stream ends. In short: a request moves on only when it provably did not
//! reach the worker or was refused before any work (no connection, 503,
//! 429); a worker that took it and then failed (the connection dropped, the
//! answer cut off) gets no other worker the request, and its breaker opens;
//! any other answer, a 500 included, is the worker's and goes to the client.

use std::borrow::Cow;
use std::sync::Arc;
use std::time::Instant;

use axum::body::{Body, Bytes};
use axum::http::{header, HeaderMap, HeaderValue};
use axum::response::Response;
use futures_util::StreamExt as _;
use kvroute_core::event::WorkerFlavor;
use kvroute_core::hash::{sequence_hashes, LocalBlockHash, SequenceHash};
use kvroute_core::index::WorkerRank;
use kvroute_core::scheduler::{order, Policy, Scored};

use super::active::{ActiveGuard, ActiveRanks};
use super::answer::{self, UpTo};
use super::candidates::{request_hashes, Candidates, Target};
use super::continuations::response_id_in_body;
use super::observe::{CandidateView, Decision, CANDIDATES_KEPT};
use super::outcome::{self, Ending, Next};
use super::queue::QueueWait;
use super::relay::{reported_cached_tokens, Learn, Passthrough, Prediction, StreamOrigin};
use super::rewrite::{inject_dp_rank, inject_include_usage, inject_mm_hashes};
use super::{on_cpu, Endpoint, Proxy};
use crate::api::{error_chain, ErrorKind, ProxyError};
use crate::ingest::stats::RankState;
use kvroute_prompt::body::{ParseError, RoutingRequest};
use kvroute_prompt::sampling::check_context;

/// The header naming a request in logs, upstream and in the answer.
pub const REQUEST_ID: &str = "x-request-id";

/// A request's candidates, in the order they will be tried.
#[derive(Debug)]
pub struct Admitted {
    candidates: Candidates,
    ordered: Vec<usize>,
    /// The first candidate, already charged with the request.
    first: Option<(usize, ActiveGuard)>,
}

impl Admitted {
    /// Candidates to try in `ordered`, the first already charged (`first`).
    pub(super) fn new(
        candidates: Candidates,
        ordered: Vec<usize>,
        first: Option<(usize, ActiveGuard)>,
    ) -> Self {
        Admitted {
            candidates,
            ordered,
            first,
        }
    }
}

/// Scores the request and orders its candidates; when every rank is busy,
/// waits (woken as load drops) in the bounded queue, or refuses with 503.
pub async fn admit(
    proxy: &Arc<Proxy>,
    req: &Arc<RoutingRequest>,
    large: bool,
) -> Result<Admitted, ProxyError> {
    admit_among(proxy, req, large, None).await
}

/// Which workers a request may go to (the endpoint picker's subset hint);
/// `None`: any.
pub(crate) type Eligible = Option<Arc<dyn Fn(&Target) -> bool + Send + Sync>>;

/// [`admit`] among the workers `eligible` keeps: none of them available is
/// [`ProxyError::NoWorkers`], all of them busy the queue or its 503.
pub(crate) async fn admit_among(
    proxy: &Arc<Proxy>,
    req: &Arc<RoutingRequest>,
    large: bool,
    eligible: Eligible,
) -> Result<Admitted, ProxyError> {
    let mut wait = QueueWait::new(proxy, req);
    let mut count = 0;
    loop {
        if wait.may_try() {
            let (admitted, ranks) = {
                let (proxy, req, eligible) = (proxy.clone(), req.clone(), eligible.clone());
                on_cpu(large, move || place(&proxy, &req, eligible.as_deref())).await?
            };
            if ranks == 0 {
                return Err(ProxyError::NoWorkers);
            }
            if !admitted.ordered.is_empty() {
                return Ok(admitted);
            }
            count = ranks;
        }
        wait.busy(count).await?;
    }
}

/// Scores and orders the request's candidates and charges the first of
/// them while the loads they were scored on are held, so that requests
/// arriving together are placed one after another, each against the load
/// of those placed before it (a request of a cold burst sees its group's
/// prefix in flight).
fn place(
    proxy: &Arc<Proxy>,
    req: &RoutingRequest,
    eligible: Option<&(dyn Fn(&Target) -> bool + Send + Sync)>,
) -> (Admitted, usize) {
    let config = proxy.config();
    let (candidates, (ordered, first, count)) = proxy.candidates_for(req, |candidates, ranks| {
        let turn = proxy
            .turn
            .fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        let scored = &candidates.scored;
        let kept: Option<Vec<usize>> = eligible.map(|keep| {
            (0..scored.len())
                .filter(|&i| candidates.targets.get(scored[i].worker).is_some_and(keep))
                .collect()
        });
        let sub: Option<Vec<Scored>> = kept
            .as_ref()
            .map(|kept| kept.iter().map(|&i| scored[i].clone()).collect());
        let among = sub.as_deref().unwrap_or(scored);
        let ordered = order(
            among,
            config.policy,
            config.temperature,
            proxy.random(),
            turn,
        );
        let (ordered, dealt) = super::candidates::kv_rules(proxy, among, ordered);
        let ordered = super::candidates::peer_order(proxy, req, among).unwrap_or(ordered);
        let ordered: Vec<usize> = match &kept {
            Some(kept) => ordered.into_iter().map(|j| kept[j]).collect(),
            None => ordered,
        };
        let ordered = proxy.order_for_session(req, candidates, ordered);
        let ordered = proxy.order_for_continuation(req, candidates, ordered);
        let first = ordered
            .first()
            .and_then(|&i| Some((i, charge(proxy, ranks, candidates, req, i)?)));
        if let Some((i, _)) = &first {
            proxy.record_session(req, candidates, *i);
            let request_tokens = req.tokens.as_ref().map_or(0, |t| t.len() as u64);
            let s = &scored[*i];
            super::candidates::record_dealt(proxy, s, request_tokens, dealt == Some(s.worker));
        }
        (ordered, first, among.len())
    });
    let admitted = Admitted {
        candidates,
        ordered,
        first,
    };
    (admitted, count)
}

/// The candidate the endpoint picker names for a request: charged with it
/// (the guard holds its place in the rank's load until the answer ends),
/// with what the answer's `cached_tokens` will be compared against.
pub(crate) struct Picked {
    /// Its worker.
    pub target: Target,
    /// Its score.
    pub scored: Scored,
    /// The request's place in the rank's load.
    pub guard: ActiveGuard,
    /// The prediction to compare the engine's report with (requests with
    /// token ids only).
    pub prediction: Option<Prediction>,
}

impl Admitted {
    /// The first candidate that can be charged, with the decision recorded
    /// as [`forward`] records a sent attempt (the dashboard's ring, the
    /// routed totals, the approximate index); `None` when every worker
    /// left meanwhile. Nothing is sent: the gateway sends the request.
    pub(crate) fn pick(
        self,
        proxy: &Arc<Proxy>,
        req: &RoutingRequest,
        request_id: &str,
    ) -> Option<Picked> {
        let Admitted {
            candidates,
            ordered,
            first,
        } = self;
        let (index, guard) = first.or_else(|| {
            let mut ranks = proxy.active.lock();
            ordered
                .iter()
                .find_map(|&i| Some((i, charge(proxy, &mut ranks, &candidates, req, i)?)))
        })?;
        let s = candidates.scored.get(index)?;
        let target = candidates.targets.get(s.worker)?;
        let (locals, _) = hashes_for(&candidates, req, s);
        remember_for_approx(proxy, s, &locals);
        let chosen = Chosen {
            candidates: &candidates,
            ordered: &ordered,
            index,
            retries: 0,
        };
        proxy
            .observed
            .routed(decision(proxy, req, request_id, target, chosen));
        let prediction = req
            .tokens
            .as_ref()
            .map(|t| prediction(s, target, t.len() as u64, &locals));
        Some(Picked {
            target: target.clone(),
            scored: s.clone(),
            guard,
            prediction,
        })
    }
}

/// Adds the request to the load of candidate `i` in `ranks`, the proxy's
/// table held by the caller (`None`: its worker is gone).
pub(super) fn charge(
    proxy: &Arc<Proxy>,
    ranks: &mut ActiveRanks,
    candidates: &Candidates,
    req: &RoutingRequest,
    i: usize,
) -> Option<ActiveGuard> {
    charge_as(proxy, ranks, (candidates, req, i), true)
}

/// [`charge`], with the prompt's uncached tokens in the rank's prefill load
/// only when it `prefills` (a decode rank of a split request does not).
pub(super) fn charge_as(
    proxy: &Arc<Proxy>,
    ranks: &mut ActiveRanks,
    (candidates, req, i): (&Candidates, &RoutingRequest, usize),
    prefills: bool,
) -> Option<ActiveGuard> {
    let s = candidates.scored.get(i)?;
    let target = candidates.targets.get(s.worker)?;
    let request_tokens = req.tokens.as_ref().map_or(0, |t| t.len() as u64);
    let (_, seqs) = hashes_for(candidates, req, s);
    let prefill = if prefills {
        s.uncached_prefill_tokens(request_tokens)
    } else {
        0
    };
    Some(ActiveGuard::add(
        proxy,
        ranks,
        (s.key, &target.name),
        &seqs,
        prefill,
    ))
}

/// Under `--policy approx`, records that the request's blocks went to
/// `s`'s rank: the index's stand-in for the events the engine does not send.
fn remember_for_approx(proxy: &Proxy, s: &Scored, locals: &[LocalBlockHash]) {
    if proxy.config().policy == Policy::Approx && !locals.is_empty() {
        let now = proxy.now_ms();
        proxy.index().record_routing_decision(s.key, locals, now);
    }
}

/// What one attempt sends, besides the client's headers.
pub(super) struct Outgoing {
    /// The body to send.
    pub payload: Bytes,
    /// The rank goes in the `X-data-parallel-rank` header.
    pub rank_header: Option<u32>,
    /// The proxy asked for the usage chunk on the client's behalf.
    pub added_usage: bool,
}

/// The body for candidate `s` of a worker with `ranks` ranks, with the
/// rewrites it needs (`dp_rank_in_body`: the rank always goes in the body).
pub(super) fn outgoing(
    dp_rank_in_body: bool,
    req: &RoutingRequest,
    s: &Scored,
    ranks: usize,
    body: &Bytes,
) -> Result<Outgoing, ProxyError> {
    let bad = |e: ParseError| ProxyError::bad_request(e.0);
    let multi_rank = ranks > 1;
    let rank_in_body = dp_rank_in_body || s.flavor == WorkerFlavor::Sglang;
    let mut payload = body.clone();
    if multi_rank && rank_in_body {
        payload = Bytes::from(inject_dp_rank(&payload, s.key.rank).map_err(bad)?);
    }
    let added_usage = req.stream && !req.include_usage && req.tokens.is_some();
    if added_usage {
        payload = Bytes::from(inject_include_usage(&payload).map_err(bad)?);
    }
    if s.flavor == WorkerFlavor::Sglang && !req.images.is_empty() && req.mm_hashes.is_none() {
        let hashes: Vec<u64> = req.images.iter().map(|i| i.identity.hash).collect();
        payload = Bytes::from(inject_mm_hashes(&payload, &hashes).map_err(bad)?);
    }
    Ok(Outgoing {
        payload,
        rank_header: (multi_rank && !rank_in_body).then_some(s.key.rank.0),
        added_usage,
    })
}

/// A request being forwarded: what the client sent and what was read of it.
#[derive(Debug, Clone, Copy)]
pub struct Request<'a> {
    /// What routing read of the body.
    pub req: &'a Arc<RoutingRequest>,
    /// The client's headers.
    pub headers: &'a HeaderMap,
    /// The client's body.
    pub body: &'a Bytes,
    /// The endpoint it came in on.
    pub endpoint: Endpoint,
    /// Its id in logs and answers.
    pub request_id: &'a str,
    /// Its body is large: rewrites run on the blocking pool.
    pub large: bool,
    /// When it arrived.
    pub arrived: Instant,
    /// In a disaggregated fleet: where each phase went and why.
    pub disagg: Option<&'a str>,
}

/// Tries the admitted candidates in order; the first worker that answers
/// (see the module docs for which failures move on) gives the response.
pub async fn forward(
    proxy: &Arc<Proxy>,
    admitted: Admitted,
    request: Request<'_>,
) -> Result<Response, ProxyError> {
    let Admitted {
        candidates,
        ordered,
        mut first,
    } = admitted;
    let Request {
        req,
        headers,
        body,
        endpoint,
        request_id,
        large,
        arrived,
        disagg,
    } = request;
    let request_tokens = req.tokens.as_ref().map_or(0, |t| t.len() as u64);
    let mut last_error = String::new();
    let max_attempts = proxy.config().max_attempts.max(1);
    for (attempt, &i) in ordered.iter().take(max_attempts).enumerate() {
        let Some((s, target)) = open_candidate(proxy, &candidates, i) else {
            continue;
        };
        if let Some(limit) = proxy.context_length(target) {
            if let Err(message) = check_context(request_tokens, req.max_tokens, limit) {
                return Err(ProxyError::ContextTooLong(message));
            }
        }
        if attempt > 0 {
            proxy.metrics.retries.inc();
        }
        let (locals, _) = hashes_for(&candidates, req, s);
        // The first candidate was charged when it was chosen; a candidate
        // tried after it is charged now (and the first's charge dropped).
        let guard = match first.take() {
            Some((charged, guard)) if charged == i => guard,
            _ => match charge(proxy, &mut proxy.active.lock(), &candidates, req, i) {
                Some(guard) => guard,
                None => continue,
            },
        };
        let rewritten = {
            let (req, s, body) = (req.clone(), s.clone(), body.clone());
            let (in_body, ranks) = (proxy.config().dp_rank_in_body, target.ranks.len());
            on_cpu(large, move || outgoing(in_body, &req, &s, ranks, &body)).await
        };
        let out = rewritten??;
        let added_usage = out.added_usage;
        let resp = match send(proxy, target, endpoint, out, headers, request_id).await {
            Sent::Answer(resp) => resp,
            Sent::Refused(message) => {
                last_error = message;
                continue;
            }
            Sent::Failed(error) => return Err(error),
        };
        remember_for_approx(proxy, s, &locals);
        let chosen = Chosen {
            candidates: &candidates,
            ordered: &ordered,
            index: i,
            retries: attempt,
        };
        let mut decision = decision(proxy, req, request_id, target, chosen);
        decision.disagg = disagg.map(str::to_owned);
        proxy.observed.routed(decision);
        let relay = Relay {
            guard,
            added_usage,
            request_id,
            locals: &locals,
            arrived,
            predict: true,
            endpoint,
        };
        return respond(proxy, req, s, target, resp, relay).await;
    }
    Err(ProxyError::UpstreamUnreachable(last_error))
}

/// Candidate `i` and its worker, when the worker is still known and its
/// circuit breaker lets an attempt through (the attempt is then begun).
pub(super) fn open_candidate<'c>(
    proxy: &Proxy,
    candidates: &'c Candidates,
    i: usize,
) -> Option<(&'c Scored, &'c Target)> {
    let s = candidates.scored.get(i)?;
    let target = candidates.targets.get(s.worker)?;
    proxy
        .breakers
        .begin_attempt(&target.name)
        .then_some((s, target))
}

/// The request's local and sequence hashes for candidate `s`'s block size
/// and flavour, as scoring computed them (or computed now if it did not).
pub(super) fn hashes_for<'a>(
    candidates: &'a Candidates,
    req: &RoutingRequest,
    s: &Scored,
) -> (Cow<'a, [LocalBlockHash]>, Cow<'a, [SequenceHash]>) {
    match candidates.hashes.get(s.block_size, s.flavor) {
        Some(set) => (Cow::Borrowed(&set.locals), Cow::Borrowed(&set.seqs)),
        None => {
            let locals = request_hashes(req, s.block_size, s.flavor);
            let seqs = sequence_hashes(&locals);
            (Cow::Owned(locals), Cow::Owned(seqs))
        }
    }
}

/// What relaying the chosen worker's answer needs besides the answer.
pub(super) struct Relay<'a> {
    /// The request's place in its rank's load.
    pub guard: ActiveGuard,
    /// The proxy asked for the usage chunk on the client's behalf.
    pub added_usage: bool,
    /// The request's id.
    pub request_id: &'a str,
    /// The request's local block hashes at the target's block size.
    pub locals: &'a [LocalBlockHash],
    /// When the request arrived.
    pub arrived: Instant,
    /// Compare the engine's `cached_tokens` with the index's prediction
    /// (not for a decode leg, whose blocks came from a prefill worker).
    pub predict: bool,
    /// The endpoint the request came in on (its stream's conventions, and
    /// whether the answer names a response to remember).
    pub endpoint: Endpoint,
}

/// The candidate a request was sent to, among those it was scored against.
pub(super) struct Chosen<'a> {
    /// What it was scored against.
    pub candidates: &'a Candidates,
    /// The order the candidates would be tried in.
    pub ordered: &'a [usize],
    /// Its index in `candidates.scored`.
    pub index: usize,
    /// Candidates that refused before it.
    pub retries: usize,
}

/// The routing decision as the dashboard shows it: the first candidates in
/// the order they would be tried (and the chosen one), and why it won.
pub(super) fn decision(
    proxy: &Proxy,
    req: &RoutingRequest,
    request_id: &str,
    target: &Target,
    chosen: Chosen<'_>,
) -> Decision {
    let Chosen {
        candidates,
        ordered,
        index,
        retries,
    } = chosen;
    let name_of = |s: &Scored| {
        candidates
            .targets
            .get(s.worker)
            .map_or_else(|| Arc::from(""), |t| t.name.clone())
    };
    let mut shown: Vec<usize> = ordered.iter().copied().take(CANDIDATES_KEPT).collect();
    if !shown.contains(&index) {
        shown.push(index);
    }
    let views: Vec<CandidateView> = shown
        .iter()
        .filter_map(|&i| candidates.scored.get(i))
        .map(|s| CandidateView::of(s, name_of(s)))
        .collect();
    let chosen_at = shown.iter().position(|&i| i == index).unwrap_or(0);
    let policy = proxy.config().policy;
    let s = &candidates.scored[index];
    let state = target
        .stats_of(s.key.rank)
        .map_or(RankState::Live, |st| st.state());
    let prompt_tokens = req.tokens.as_ref().map_or(0, |t| t.len() as u64);
    let load_only = if req.tokens.is_none() {
        Some("no tokens: no tokenizer for this request".to_owned())
    } else if !matches!(policy, Policy::Kv | Policy::Approx) {
        Some(format!("policy {}", policy.as_str()))
    } else if matches!(
        state,
        RankState::Degraded | RankState::Disconnected | RankState::Error
    ) {
        Some(format!(
            "rank {}: its cache history is incomplete",
            state.as_str()
        ))
    } else {
        None
    };
    Decision {
        at_ms: unix_ms(),
        request_id: request_id.to_owned(),
        prompt_tokens,
        policy: policy.as_str(),
        chosen: chosen_at,
        retries,
        load_only,
        candidates: views,
        disagg: None,
    }
}

/// Milliseconds since the Unix epoch.
pub fn unix_ms() -> u64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_millis() as u64)
}

/// How sending one attempt ended, as the retry rule sorted it.
pub(super) enum Sent {
    /// The worker answered (any status but 503 and 429): relay it.
    Answer(reqwest::Response),
    /// The request never reached the worker, or the worker refused it
    /// before doing any work: try the next candidate.
    Refused(String),
    /// The worker took the request and failed: answer the client, try no one else.
    Failed(ProxyError),
}

/// The client's headers passed on to the worker: its credentials (OpenAI's
/// bearer token, Anthropic's `x-api-key`) and the Anthropic API version
/// and betas the engine may check.
const FORWARDED_HEADERS: [&str; 4] = [
    "authorization",
    "x-api-key",
    "anthropic-version",
    "anthropic-beta",
];

/// Sends one attempt and sorts out how it ended (see the module docs).
pub(super) async fn send(
    proxy: &Proxy,
    target: &Target,
    endpoint: Endpoint,
    out: Outgoing,
    headers: &HeaderMap,
    request_id: &str,
) -> Sent {
    let mut upstream = proxy
        .client
        .post(format!("{}{}", target.url, endpoint.path()))
        .timeout(proxy.config().request_timeout)
        .header(header::CONTENT_TYPE, "application/json")
        .header(REQUEST_ID, request_id)
        .body(out.payload);
    if let Some(rank) = out.rank_header {
        upstream = upstream.header("X-data-parallel-rank", rank.to_string());
    }
    for name in FORWARDED_HEADERS {
        if let Some(value) = headers.get(name) {
            upstream = upstream.header(name, value.clone());
        }
    }
    let sent = upstream.send().await;
    let ending = match &sent {
        Err(e) if e.is_connect() => Ending::NotConnected,
        Err(_) => Ending::LostBeforeAnswer,
        Ok(resp) => Ending::Head(resp.status()),
    };
    let verdict = outcome::settle(proxy, &target.name, ending, request_id);
    match (verdict.next, sent) {
        (Next::Retry, Err(e)) => {
            Sent::Refused(format!("worker `{}`: {}", target.name, error_chain(&e)))
        }
        (Next::Retry, Ok(resp)) => Sent::Refused(format!(
            "worker `{}` answered {}",
            target.name,
            resp.status()
        )),
        // The rule relays every answer it does not retry, and fails every
        // request that was sent and got none.
        (_, Ok(resp)) => Sent::Answer(resp),
        (next, Err(e)) => {
            let kind = next.error().unwrap_or(ErrorKind::UpstreamFailed);
            let error = ProxyError::lost(kind, &target.name, request_id, error_chain(&e));
            Sent::Failed(error)
        }
    }
}

/// The client's response from the worker's: streams relayed as they come,
/// whole bodies read, and in both the engine's `cached_tokens` compared
/// with the prediction.
pub(super) async fn respond(
    proxy: &Proxy,
    req: &RoutingRequest,
    s: &Scored,
    target: &Target,
    resp: reqwest::Response,
    relay: Relay<'_>,
) -> Result<Response, ProxyError> {
    let Relay {
        guard,
        added_usage,
        request_id,
        locals,
        arrived,
        predict,
        endpoint,
    } = relay;
    let status = resp.status();
    // A continuation's prompt holds turns the router never saw.
    let continues = req.previous_response_id.is_some();
    let remembers = endpoint == Endpoint::Responses && status.is_success();
    let prediction = req
        .tokens
        .as_ref()
        .filter(|_| predict && !continues && status.is_success())
        .map(|t| prediction(s, target, t.len() as u64, locals));
    let mut builder = Response::builder()
        .status(status.as_u16())
        .header("x-kvroute-worker", &*target.name)
        .header("x-kvroute-dp-rank", s.key.rank.0);
    let content_type = resp.headers().get(header::CONTENT_TYPE);
    if let Some(v) = content_type.and_then(|ct| HeaderValue::from_bytes(ct.as_bytes()).ok()) {
        builder = builder.header(header::CONTENT_TYPE, v);
    }
    let sse = content_type.is_some_and(|v| v.as_bytes().starts_with(b"text/event-stream"));
    let origin = StreamOrigin {
        worker: target.name.clone(),
        request_id: request_id.to_owned(),
        sse,
        status,
        dialect: endpoint.dialect(),
    };
    let remember = remembers.then_some((s.key, req.owner));
    let body = if req.stream || sse {
        let strip = added_usage && status.is_success();
        let stream = Box::pin(resp.bytes_stream());
        let relayed = Passthrough::new(stream, guard, prediction, strip, (origin, arrived));
        relayed_body(relayed, remember)
    } else {
        let cap = proxy.config().max_answer_bytes;
        let read = match answer::read_up_to(resp, cap).await {
            Ok(UpTo::Over(read, rest)) => {
                // Too long to hold: passed on as it comes, unread.
                let head = futures_util::stream::once(async move { Ok(read) });
                let stream = Box::pin(head.chain(rest.bytes_stream()));
                let relayed = Passthrough::new(stream, guard, None, false, (origin, arrived));
                let built = builder.body(relayed_body(relayed, remember));
                return built.map_err(|e| ProxyError::internal(e.to_string()));
            }
            Ok(UpTo::Whole(bytes)) => Ok(bytes),
            Err(e) => Err(e),
        };
        guard.prefill_done();
        let ending = match &read {
            Ok(_) => Ending::Complete(status),
            Err(_) => Ending::CutOff,
        };
        let verdict = outcome::settle(proxy, &target.name, ending, request_id);
        let bytes = match read {
            Ok(b) => b,
            Err(e) => {
                let kind = verdict
                    .next
                    .error()
                    .unwrap_or(ErrorKind::UpstreamIncomplete);
                let detail = format!("reading the answer: {}", error_chain(&e));
                return Err(ProxyError::lost(kind, &target.name, request_id, detail));
            }
        };
        drop(guard);
        let id = remembers.then(|| response_id_in_body(&bytes)).flatten();
        if let (Some(id), Some(owner)) = (id, &req.owner) {
            proxy.record_response(&id, owner, s.key);
        }
        if let (Some(p), Some(reported)) = (prediction, reported_cached_tokens(&bytes)) {
            p.settle(proxy, reported);
        }
        proxy.timed(arrived, None);
        Body::from(bytes)
    };
    builder
        .body(body)
        .map_err(|e| ProxyError::internal(e.to_string()))
}

/// The client's body relaying `relayed`, which remembers the response it
/// names as produced by `remember`'s rank for its owner, if given.
fn relayed_body<S>(
    relayed: Passthrough<S>,
    remember: Option<(WorkerRank, Option<[u8; 32]>)>,
) -> Body
where
    S: futures_util::Stream<Item = Result<Bytes, reqwest::Error>> + Unpin + Send + 'static,
{
    match remember {
        Some((rank, owner)) => Body::from_stream(relayed.remembering_response(rank, owner)),
        None => Body::from_stream(relayed),
    }
}

/// What the response will be checked against: the prediction, the state of
/// the rank it came from, and what to learn from the answer.
fn prediction(s: &Scored, target: &Target, tokens: u64, locals: &[LocalBlockHash]) -> Prediction {
    let stats = target.stats_of(s.key.rank);
    let state = stats.map_or(RankState::Live, |st| st.state());
    let learn = stats.filter(|_| !locals.is_empty()).map(|stats| {
        Arc::new(Learn {
            key: s.key,
            locals: locals.to_vec(),
            block_size: target.block_size,
            stats: stats.clone(),
        })
    });
    Prediction {
        predicted: s.predicted_cached_tokens(tokens),
        prompt_tokens: tokens,
        state,
        learn,
    }
}
