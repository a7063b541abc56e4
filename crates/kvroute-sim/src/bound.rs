//! What a router that keeps every prefix group on one engine can reach at
//! best: a search over fixed placements of the groups ([`super::Pins`]),
//! each run through the simulator, for the lowest tails.
//!
//! A group's prefix is computed once when its requests all go to one
//! engine, so every such placement has the workload's ceiling hit rate;
//! and a router at the ceiling has no other choice to make (a request sent
//! anywhere else computes the prefix again). The search knows the whole
//! run in advance (which groups the clients will pick, and when), which no
//! online router does, so the tails it finds are a bound: if no placement
//! it finds meets a tail target, a router that keeps the hit rate at the
//! ceiling is not expected to either.

use std::sync::Mutex;

use kvroute_core::rng::SplitMix64;

use super::{simulate, SimConfig, SimLoad, SimReport};
use crate::error::{Error, Result};

/// The tails a placement is measured against (the routing goal's: the
/// better of two baselines run on the same seed).
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Targets {
    /// Time to first token, p99, ms.
    pub ttft_p99_ms: f64,
    /// Time to the end of the response, p99, ms.
    pub latency_p99_ms: f64,
}

impl Targets {
    /// The lower TTFT p99 and the lower latency p99 of `runs` (each may
    /// come from a different run).
    pub fn better_of<'a>(runs: impl IntoIterator<Item = &'a SimReport>) -> Targets {
        let mut t = Targets {
            ttft_p99_ms: f64::INFINITY,
            latency_p99_ms: f64::INFINITY,
        };
        for r in runs {
            t.ttft_p99_ms = t.ttft_p99_ms.min(r.report.ttft_ms.p99);
            t.latency_p99_ms = t.latency_p99_ms.min(r.report.latency_ms.p99);
        }
        t
    }

    /// How far `r`'s tails are above these: the larger of its TTFT p99 and
    /// latency p99 over the targets'. At most 1 meets both.
    pub fn ratio(&self, r: &SimReport) -> f64 {
        let ttft = r.report.ttft_ms.p99 / self.ttft_p99_ms.max(f64::MIN_POSITIVE);
        let latency = r.report.latency_ms.p99 / self.latency_p99_ms.max(f64::MIN_POSITIVE);
        ttft.max(latency)
    }
}

/// How the search runs.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct PinSearch {
    /// Prefix groups of the workload.
    pub groups: usize,
    /// Placements simulated in all, the first included.
    pub evaluations: usize,
    /// Placements whose hit rate is below this do not count (`None`: all do).
    pub min_hit: Option<f64>,
    /// Seed of the search's moves.
    pub seed: u64,
    /// How readily a worse placement is taken at the start (in units of
    /// the ratio; falls to 0 by the end): 0 is a plain hill climb.
    pub temperature: f64,
}

/// The best placement found.
#[derive(Debug, Clone, PartialEq)]
pub struct PinBound {
    /// Engine of each group, in the groups' order of arrival.
    pub pins: Vec<usize>,
    /// Its run.
    pub report: SimReport,
    /// Its [`Targets::ratio`].
    pub ratio: f64,
    /// The first placement's ratio (groups dealt to the engines in turn).
    pub start_ratio: f64,
    /// Placements simulated.
    pub evaluations: usize,
    /// Times a better placement was found.
    pub improvements: usize,
}

/// Searches the placements of `search.groups` groups on `config.engines`
/// engines for the lowest [`Targets::ratio`] on `load`: from the groups
/// dealt to the engines in turn, simulated annealing whose steps move one
/// group to another engine or swap two groups of different engines.
pub fn search_pins(
    config: &SimConfig,
    load: &SimLoad,
    targets: &Targets,
    search: &PinSearch,
) -> Result<PinBound> {
    let engines = config.engines;
    if engines == 0 || search.groups == 0 {
        return Err(Error::Invalid(
            "a placement search needs engines and groups".into(),
        ));
    }
    let start: Vec<usize> = (0..search.groups).map(|g| g % engines).collect();
    let score = |pins: &[usize]| -> Result<Scored> {
        let pinned = SimConfig {
            pins: Some(pins.to_vec()),
            ..config.clone()
        };
        let report = simulate(&pinned, load)?;
        let feasible = search.min_hit.is_none_or(|h| report.report.hit_rate >= h);
        let ratio = if feasible {
            targets.ratio(&report)
        } else {
            f64::INFINITY
        };
        Ok((ratio, report))
    };
    let (start_ratio, start_report) = score(&start)?;
    let mut best = PinBound {
        pins: start,
        report: start_report,
        ratio: start_ratio,
        start_ratio,
        evaluations: 1,
        improvements: 0,
    };
    let mut rng = SplitMix64::new(search.seed ^ 0x0B0A_4D5E);
    let (mut pins, mut ratio) = (best.pins.clone(), best.ratio);
    while best.evaluations < search.evaluations {
        let batch = PROPOSALS.min(search.evaluations - best.evaluations);
        let proposals: Vec<Vec<usize>> = (0..batch)
            .map(|_| neighbour(&pins, engines, &mut rng))
            .collect();
        let results = run_batch(&proposals, &score)?;
        let done = best.evaluations as f64 / search.evaluations.max(1) as f64;
        best.evaluations += batch;
        let Some((i, (next, report))) = results
            .into_iter()
            .enumerate()
            .min_by(|a, b| a.1 .0.total_cmp(&b.1 .0))
        else {
            continue;
        };
        // Annealing: a worse placement is taken now and then, less often
        // as the search goes on, so it can leave a local minimum.
        let temperature = search.temperature * (1.0 - done);
        let worse_ok = next.is_finite()
            && temperature > 0.0
            && rng.next_f64() < (-(next - ratio) / temperature).exp();
        if next <= ratio || worse_ok {
            (pins, ratio) = (proposals[i].clone(), next);
        }
        if next < best.ratio {
            best.improvements += 1;
            best.ratio = next;
            best.pins.clone_from(&proposals[i]);
            best.report = report;
        }
    }
    Ok(best)
}

/// Placements tried at each step of the search, simulated side by side: a
/// fixed number, so that a seed's search is the same on any machine.
const PROPOSALS: usize = 2;

/// `pins` with one group moved to another engine, or two groups of
/// different engines swapped (each half the time).
fn neighbour(pins: &[usize], engines: usize, rng: &mut SplitMix64) -> Vec<usize> {
    let mut next = pins.to_vec();
    if engines < 2 || next.is_empty() {
        return next;
    }
    let g = rng.below(next.len());
    if rng.next_u64() & 1 == 0 {
        let shift = 1 + rng.below(engines - 1);
        next[g] = (next[g] + shift) % engines;
    } else {
        let h = rng.below(next.len());
        if next[g] != next[h] {
            next.swap(g, h);
        } else {
            next[g] = (next[g] + 1 + rng.below(engines - 1)) % engines;
        }
    }
    next
}

/// A placement's ratio and its run.
type Scored = (f64, SimReport);

/// Scores every proposal, each on a thread of its own; results in the
/// proposals' order.
fn run_batch(
    proposals: &[Vec<usize>],
    score: &(dyn Fn(&[usize]) -> Result<Scored> + Sync),
) -> Result<Vec<Scored>> {
    let slots: Mutex<Vec<Option<Result<Scored>>>> =
        Mutex::new((0..proposals.len()).map(|_| None).collect());
    std::thread::scope(|s| {
        for (i, pins) in proposals.iter().enumerate() {
            let slots = &slots;
            s.spawn(move || {
                let out = score(pins);
                if let Ok(mut slots) = slots.lock() {
                    slots[i] = Some(out);
                }
            });
        }
    });
    slots
        .into_inner()
        .map_err(|_| Error::Invalid("a simulation panicked".into()))?
        .into_iter()
        .map(|r| r.unwrap_or_else(|| Err(Error::Invalid("a simulation did not finish".into()))))
        .collect()
}
