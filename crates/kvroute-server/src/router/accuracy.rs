//! How well the router predicted: an engine's `cached_tokens` compared
//! with the prediction its index made for the rank the request went to
//! (the accuracy metrics, the dashboard's totals), and what the report
//! teaches the index of the request's leading blocks. Both doors settle
//! their answers here.

use std::sync::atomic::Ordering;
use std::sync::Arc;

use kvroute_core::hash::LocalBlockHash;
use kvroute_core::index::WorkerRank;

use kvroute_core::scheduler::Scored;

use super::candidates::Target;
use super::Router;
use crate::ingest::stats::{RankState, RankStats};

/// What the accuracy check needs after the response.
#[derive(Debug, Clone)]
pub struct Prediction {
    /// The cached tokens the index predicted.
    pub predicted: u64,
    /// The request's prompt tokens.
    pub prompt_tokens: u64,
    /// The state of the rank the prediction came from, when it was made.
    pub state: RankState,
    /// What to learn from the engine's answer.
    pub learn: Option<Arc<Learn>>,
}

/// What an engine's `cached_tokens` can teach the index: which of the
/// request's leading blocks the rank holds (the only source for blocks a
/// degraded rank's event history lost).
#[derive(Debug)]
pub struct Learn {
    /// The rank.
    pub key: WorkerRank,
    /// The request's local block hashes at the worker's block size.
    pub locals: Vec<LocalBlockHash>,
    /// Tokens per block.
    pub block_size: u32,
    /// The rank's shared state (its run of exact predictions).
    pub stats: Arc<RankStats>,
}

impl Prediction {
    /// Compares the prediction with the engine's report, and teaches the
    /// index what the report says about the request's leading blocks (see
    /// `Index::learn_cached_prefix`: guesses that expire unless confirmed).
    /// On a degraded rank, exact predictions of a cache hit count towards
    /// trusting its history again.
    pub fn settle(&self, router: &Router, reported: u64) {
        router.metrics.compare(self.predicted, reported, self.state);
        router
            .observed
            .compared(self.prompt_tokens, self.predicted, reported);
        let Some(learn) = &self.learn else {
            return;
        };
        if self.state == RankState::Degraded {
            if self.predicted != reported {
                learn.stats.exact_streak.store(0, Ordering::Relaxed);
            } else if reported > 0 {
                learn.stats.exact_streak.fetch_add(1, Ordering::Relaxed);
            }
        }
        if self.predicted != reported && learn.block_size > 0 {
            let held = usize::try_from(reported / u64::from(learn.block_size)).unwrap_or(0);
            let now = router.now_ms();
            router
                .index()
                .learn_cached_prefix(learn.key, &learn.locals, held, now);
        }
    }
}

/// What the response will be checked against: the prediction, the state of
/// the rank it came from, and what to learn from the answer.
pub fn prediction(
    s: &Scored,
    target: &Target,
    tokens: u64,
    locals: &[LocalBlockHash],
) -> Prediction {
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
