//! Admission: a request placed on its candidates while the loads they
//! were scored on are held — the core's `Placer` orders them (with the
//! session's and the continued response's ranks) and the first is charged
//! with the request — or a bounded wait in the overload queue while every
//! rank is busy. Both doors admit here: the forwarder then tries the
//! candidates in order ([`crate::router`]), the endpoint picker names the
//! first (`Admitted::pick`).

use std::borrow::Cow;
use std::sync::atomic::Ordering;
use std::sync::Arc;

use kvroute_core::hash::{sequence_hashes, LocalBlockHash, SequenceHash};
use kvroute_core::scheduler::{Fetch, PlaceRequest, Policy, Replicate, Scored};

use super::accuracy::Prediction;
use super::active::ActiveGuard;
use super::candidates::{Candidates, Target};
use super::intake::RoutedRequest;
use super::load::ActiveRanks;
use super::observe::{CandidateView, Decision, CANDIDATES_KEPT};
use super::queue::QueueWait;
use super::{on_cpu, unix_ms, Router};
use crate::api::ProxyError;
use crate::ingest::stats::RankState;

/// A request's candidates, in the order they will be tried.
#[derive(Debug)]
pub struct Admitted {
    candidates: Candidates,
    ordered: Vec<usize>,
    /// The first candidate, already charged with the request.
    first: Option<(usize, ActiveGuard)>,
    /// The first runs the request with its prefix moved from another rank.
    fetch: Option<Fetch>,
    /// A copy of the request's hot prefix to make beside it.
    replicate: Option<Replicate>,
}

impl Admitted {
    /// Its candidates, their order, and the first already charged.
    pub(crate) fn into_parts(self) -> (Candidates, Vec<usize>, Option<(usize, ActiveGuard)>) {
        (self.candidates, self.ordered, self.first)
    }

    /// Candidates to try in `ordered`, the first already charged (`first`).
    pub(crate) fn new(
        candidates: Candidates,
        ordered: Vec<usize>,
        first: Option<(usize, ActiveGuard)>,
    ) -> Self {
        Admitted {
            candidates,
            ordered,
            first,
            fetch: None,
            replicate: None,
        }
    }

    /// The placer's fetch for the first candidate, taken out (`None`: it
    /// computes what it does not hold).
    pub(crate) fn take_fetch(&mut self) -> Option<Fetch> {
        self.fetch.take()
    }

    /// The placer's copy ahead of demand, taken out (`None`: none due),
    /// with the candidates its positions refer to.
    pub(crate) fn take_replicate(&mut self) -> Option<(Replicate, &Candidates)> {
        Some((self.replicate.take()?, &self.candidates))
    }
}

/// Scores the request and orders its candidates; when every rank is busy,
/// waits (woken as load drops) in the bounded queue, or refuses with 503.
pub async fn admit(
    router: &Arc<Router>,
    req: &Arc<RoutedRequest>,
    large: bool,
) -> Result<Admitted, ProxyError> {
    admit_among(router, req, large, None).await
}

/// Which workers a request may go to (the endpoint picker's subset hint);
/// `None`: any.
pub(crate) type Eligible = Option<Arc<dyn Fn(&Target) -> bool + Send + Sync>>;

/// [`admit`] among the workers `eligible` keeps: none of them available is
/// [`ProxyError::NoWorkers`], all of them busy the queue or its 503.
pub(crate) async fn admit_among(
    router: &Arc<Router>,
    req: &Arc<RoutedRequest>,
    large: bool,
    eligible: Eligible,
) -> Result<Admitted, ProxyError> {
    let mut wait = QueueWait::new(router, req);
    let mut count = 0;
    let since = crate::otel::enabled().then(std::time::Instant::now);
    loop {
        if wait.may_try() {
            let (admitted, ranks) = {
                let (router, req, eligible) = (router.clone(), req.clone(), eligible.clone());
                on_cpu(large, move || place(&router, &req, eligible.as_deref())).await?
            };
            if ranks == 0 {
                return Err(ProxyError::NoWorkers);
            }
            if !admitted.ordered.is_empty() {
                if let Some(since) = since {
                    crate::otel::spans::queued(since.elapsed());
                }
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
    router: &Arc<Router>,
    req: &RoutedRequest,
    eligible: Option<&(dyn Fn(&Target) -> bool + Send + Sync)>,
) -> (Admitted, usize) {
    let (candidates, (ordered, first, count, (fetch, replicate))) =
        router.candidates_for(&req.body, |candidates, ranks| {
            let targets = &candidates.targets;
            let keep =
                eligible.map(|keep| move |s: &Scored| targets.get(s.worker).is_some_and(keep));
            let text = || req.body.text_symbols();
            let ask = PlaceRequest {
                tokens: req.body.tokens.as_deref(),
                text_symbols: Some(&text),
                now_ms: router.now_ms(),
                session: router.session_entry(req),
                continuation: router.continued_rank(req),
                eligible: keep.as_ref().map(|k| k as &dyn Fn(&Scored) -> bool),
            };
            let mut placer = router.placer();
            let ordered = placer.order(&candidates.scored, &ask);
            router.count_session(ordered.session);
            router.count_continuation(req, ordered.continuation);
            let first = ordered
                .order
                .first()
                .and_then(|&i| Some((i, charge(router, ranks, candidates, req, i)?)));
            if let Some((i, _)) = &first {
                router.record_session(req, candidates, *i);
                placer.record(&ordered, &candidates.scored[*i], ask.token_count());
            }
            let fetch = ordered.fetch.filter(|_| first.is_some());
            let replicate = ordered.replicate.filter(|_| first.is_some());
            (ordered.order, first, ordered.among, (fetch, replicate))
        });
    let admitted = Admitted {
        candidates,
        ordered,
        first,
        fetch,
        replicate,
    };
    (admitted, count)
}

/// The candidate the endpoint picker names for a request: charged with it
/// (the guard holds its place in the rank's load until the answer ends),
/// with what the answer's `cached_tokens` will be compared against.
#[cfg_attr(not(feature = "epp"), allow(dead_code))] // the endpoint picker's
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
    #[cfg_attr(not(feature = "epp"), allow(dead_code))] // the endpoint picker's
    pub(crate) fn pick(
        self,
        router: &Arc<Router>,
        req: &RoutedRequest,
        request_id: &str,
    ) -> Option<Picked> {
        let Admitted {
            candidates,
            ordered,
            first,
            ..
        } = self;
        let (index, guard) = first.or_else(|| {
            let mut ranks = router.active.lock();
            ordered
                .iter()
                .find_map(|&i| Some((i, charge(router, &mut ranks, &candidates, req, i)?)))
        })?;
        let s = candidates.scored.get(index)?;
        let target = candidates.targets.get(s.worker)?;
        let (locals, _) = hashes_for(&candidates, req, s);
        remember_for_approx(router, s, &locals);
        let chosen = Chosen {
            candidates: &candidates,
            ordered: &ordered,
            index,
            retries: 0,
        };
        router
            .observed
            .routed(decision(router, req, request_id, target, chosen));
        let prediction = req
            .body
            .tokens
            .as_ref()
            .map(|t| super::accuracy::prediction(s, target, t.len() as u64, &locals));
        Some(Picked {
            target: target.clone(),
            scored: s.clone(),
            guard,
            prediction,
        })
    }
}

/// Adds the request to the load of candidate `i` in `ranks`, the router's
/// table held by the caller (`None`: its worker is gone).
pub(crate) fn charge(
    router: &Arc<Router>,
    ranks: &mut ActiveRanks,
    candidates: &Candidates,
    req: &RoutedRequest,
    i: usize,
) -> Option<ActiveGuard> {
    charge_as(router, ranks, (candidates, req, i), true)
}

/// [`charge`] for a candidate tried after the first (its worker refused
/// before any work): the active table locked here.
pub(crate) fn charge_later(
    router: &Arc<Router>,
    candidates: &Candidates,
    req: &RoutedRequest,
    i: usize,
) -> Option<ActiveGuard> {
    charge(router, &mut router.active.lock(), candidates, req, i)
}

/// [`charge_later`] for a split request's decode rank tried after the first
/// (the first refused the decode leg): no prefill load, as the prefill ran
/// on a prefill worker.
pub(crate) fn charge_decode_later(
    router: &Arc<Router>,
    candidates: &Candidates,
    req: &RoutedRequest,
    i: usize,
) -> Option<ActiveGuard> {
    charge_as(
        router,
        &mut router.active.lock(),
        (candidates, req, i),
        false,
    )
}

/// [`charge`], with the prompt's uncached tokens in the rank's prefill load
/// only when it `prefills` (a decode rank of a split request does not).
pub(crate) fn charge_as(
    router: &Arc<Router>,
    ranks: &mut ActiveRanks,
    (candidates, req, i): (&Candidates, &RoutedRequest, usize),
    prefills: bool,
) -> Option<ActiveGuard> {
    let s = candidates.scored.get(i)?;
    let target = candidates.targets.get(s.worker)?;
    let request_tokens = req.body.tokens.as_ref().map_or(0, |t| t.len() as u64);
    let (_, seqs) = hashes_for(candidates, req, s);
    let prefill = if prefills {
        s.uncached_prefill_tokens(request_tokens)
    } else {
        0
    };
    Some(ActiveGuard::add(
        router,
        ranks,
        (s.key, &target.name),
        &seqs,
        prefill,
    ))
}

/// Under `--policy approx`, records that the request's blocks went to
/// `s`'s rank: the index's stand-in for the events the engine does not send.
pub(crate) fn remember_for_approx(router: &Router, s: &Scored, locals: &[LocalBlockHash]) {
    if router.config().policy == Policy::Approx && !locals.is_empty() {
        let now = router.now_ms();
        router.index().record_routing_decision(s.key, locals, now);
    }
}

/// The request's local and sequence hashes for candidate `s`'s block size
/// and flavour, as scoring computed them (or computed now if it did not).
pub(crate) fn hashes_for<'a>(
    candidates: &'a Candidates,
    req: &RoutedRequest,
    s: &Scored,
) -> (Cow<'a, [LocalBlockHash]>, Cow<'a, [SequenceHash]>) {
    match candidates.hashes.get(s.block_size, s.flavor) {
        Some(set) => (Cow::Borrowed(&set.locals), Cow::Borrowed(&set.seqs)),
        None => {
            let locals = req.body.local_hashes(s.block_size, s.flavor);
            let seqs = sequence_hashes(&locals);
            (Cow::Owned(locals), Cow::Owned(seqs))
        }
    }
}

/// The candidate a request was sent to, among those it was scored against.
pub(crate) struct Chosen<'a> {
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
/// the order they would be tried (and the chosen one), and why it won;
/// also set on the current trace span (a no-op while tracing is off).
pub(crate) fn decision(
    router: &Router,
    req: &RoutedRequest,
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
    let policy = router.config().policy;
    let s = &candidates.scored[index];
    let stats = target.stats_of(s.key.rank);
    let state = stats.map_or(RankState::Live, |st| st.state());
    let doubted = stats.is_some_and(|st| st.in_doubt.load(Ordering::Relaxed));
    let prompt_tokens = req.body.tokens.as_ref().map_or(0, |t| t.len() as u64);
    let load_only = if req.body.tokens.is_none() {
        Some("no tokens: no tokenizer for this request".to_owned())
    } else if !matches!(policy, Policy::Kv | Policy::Approx) {
        Some(format!("policy {}", policy.as_str()))
    } else if doubted {
        Some(format!(
            "rank {}: its engine may have restarted since its blocks were indexed",
            state.as_str()
        ))
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
    let decision = Decision {
        at_ms: unix_ms(),
        request_id: request_id.to_owned(),
        prompt_tokens,
        policy: policy.as_str(),
        chosen: chosen_at,
        retries,
        load_only,
        candidates: views,
        disagg: None,
        migrated: None,
    };
    crate::otel::spans::decided(&decision);
    decision
}
