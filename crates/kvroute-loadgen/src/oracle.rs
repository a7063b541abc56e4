//! The oracle: a router that knows every engine's true cache.
//!
//! Per request it asks every mocker's `POST /internal/cache_match` at once,
//! then sends the request straight to the (worker, rank) holding the longest
//! prefix, with `X-data-parallel-rank`. Its hit rate is the reference the
//! policies' hit rates are reported against (`hit_rate_vs_oracle`). It is
//! greedy: it never misses a cached prefix, but it plans no placement ahead.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::Instant;

use kvroute_core::rng::SplitMix64;
use serde_json::Value;
use tokio::task::JoinSet;

use crate::driver::lock;
use crate::exchange::{exchange, Failure, Measured};
use crate::workload::PlannedRequest;

/// The (worker, rank) picks of the oracle and their requests in flight.
#[derive(Debug)]
pub(crate) struct Oracle {
    workers: Vec<String>,
    in_flight: Mutex<HashMap<(usize, u32), usize>>,
    rng: Mutex<SplitMix64>,
}

impl Oracle {
    /// An oracle over the mockers at `workers` (base URLs), breaking ties
    /// with a coin seeded from `seed`.
    pub(crate) fn new(workers: Vec<String>, seed: u64) -> Self {
        Oracle {
            workers,
            in_flight: Mutex::new(HashMap::new()),
            rng: Mutex::new(SplitMix64::new(seed ^ 0x0AC1E)),
        }
    }

    /// Picks the (worker, rank) for `planned`, sends it there and measures it.
    pub(crate) async fn send(
        &self,
        client: &reqwest::Client,
        planned: &PlannedRequest,
        scheduled: Instant,
    ) -> Result<Measured, Failure> {
        let (worker, rank) = pick(client, self, planned).await?;
        // Released on every exit, the request timeout's cancellation included.
        let _in_flight = InFlight {
            oracle: self,
            key: (worker, rank),
        };
        let url = format!("{}{}", self.workers[worker], planned.path);
        exchange(client, &url, &planned.body, Some(rank), scheduled).await
    }
}

/// One request the oracle sent to a (worker, rank); uncounted when dropped.
struct InFlight<'a> {
    oracle: &'a Oracle,
    key: (usize, u32),
}

impl Drop for InFlight<'_> {
    fn drop(&mut self) {
        if let Some(n) = lock(&self.oracle.in_flight).get_mut(&self.key) {
            *n = n.saturating_sub(1);
        }
    }
}

/// Asks every worker's `/internal/cache_match` at once and picks the (worker,
/// rank) with the most matched tokens; ties go to the fewest requests in
/// flight from this run, then to a seeded coin. Counts the pick as in flight.
async fn pick(
    client: &reqwest::Client,
    oracle: &Oracle,
    planned: &PlannedRequest,
) -> Result<(usize, u32), String> {
    let mut query = planned.body.clone();
    query["endpoint"] = Value::from(if planned.path.ends_with("chat/completions") {
        "chat"
    } else {
        "completions"
    });
    let query = Arc::new(query);
    let mut asks = JoinSet::new();
    for (i, worker) in oracle.workers.iter().enumerate() {
        let (client, query) = (client.clone(), query.clone());
        let url = format!("{worker}/internal/cache_match");
        asks.spawn(async move { (i, cache_match(&client, &url, &query).await) });
    }
    let mut candidates: Vec<(usize, u32, u64)> = Vec::new();
    let mut last_error = None;
    while let Some(joined) = asks.join_next().await {
        match joined {
            Ok((i, Ok(ranks))) => candidates.extend(ranks.into_iter().map(|(r, m)| (i, r, m))),
            Ok((i, Err(e))) => last_error = Some(format!("{}: {e}", oracle.workers[i])),
            Err(e) => last_error = Some(e.to_string()),
        }
    }
    let mut in_flight = lock(&oracle.in_flight);
    let load = |w: usize, r: u32| in_flight.get(&(w, r)).copied().unwrap_or(0);
    let pick = choose(&candidates, load, &mut lock(&oracle.rng)).ok_or_else(|| {
        format!(
            "no worker answered /internal/cache_match ({})",
            last_error.unwrap_or_else(|| "no ranks".into())
        )
    })?;
    *in_flight.entry(pick).or_insert(0) += 1;
    Ok(pick)
}

/// The oracle's rule, given each (worker, rank, matched tokens) and each
/// (worker, rank)'s requests in flight: the most matched tokens, then the
/// fewest in flight, then `rng`'s coin among what is left. `None` when
/// there is no candidate. `kvroute bench sim` routes its oracle by it too.
pub fn choose(
    candidates: &[(usize, u32, u64)],
    in_flight: impl Fn(usize, u32) -> usize,
    rng: &mut SplitMix64,
) -> Option<(usize, u32)> {
    let best = candidates.iter().map(|c| c.2).max()?;
    let load = |c: &(usize, u32, u64)| in_flight(c.0, c.1);
    let tied: Vec<(usize, u32, u64)> = candidates.iter().copied().filter(|c| c.2 == best).collect();
    let least = tied.iter().map(load).min().unwrap_or(0);
    let mut tied: Vec<(usize, u32)> = tied
        .iter()
        .filter(|c| load(c) == least)
        .map(|c| (c.0, c.1))
        .collect();
    tied.sort_unstable();
    Some(tied[rng.below(tied.len())])
}

/// One worker's `/internal/cache_match` answer: (rank, matched tokens).
async fn cache_match(
    client: &reqwest::Client,
    url: &str,
    query: &Value,
) -> Result<Vec<(u32, u64)>, String> {
    let resp = client
        .post(url)
        .json(query)
        .send()
        .await
        .map_err(|e| e.to_string())?;
    let status = resp.status();
    let body: Value = resp.json().await.map_err(|e| e.to_string())?;
    if !status.is_success() {
        return Err(format!("{status}: {body}"));
    }
    let ranks = body["ranks"].as_array().ok_or("no `ranks` in the answer")?;
    Ok(ranks
        .iter()
        .filter_map(|r| {
            let rank = u32::try_from(r["rank"].as_u64()?).ok()?;
            Some((rank, r["matched_tokens"].as_u64()?))
        })
        .collect())
}
