//! What one `kvroute bench sim` run simulates, apart from its flags: the
//! contenders compared by default, the sweep's combinations of the `kv`
//! policy's knobs, the traffic of each seed (a preset, a trace or a
//! workload, and their defaults), and the pin search's
//! experiment (the baselines, their better tail as the target, the best
//! fixed placement found against it). The binary parses the flags into
//! these and prints what comes back.

use std::time::Instant;

use crate::bound::{search_pins, PinBound, PinSearch, Targets};
use crate::contender::Routing;
use crate::driver::Arrival;
use crate::error::{Error, Result};
use crate::mooncake::Trace;
use crate::preset::{PdLayout, Preset};
use crate::workload::{WorkloadKind, WorkloadSpec};
use crate::{simulate, Contender, SimConfig, SimLoad, SimReport};

/// The contenders compared when none are named.
pub const DEFAULT_POLICIES: [&str; 5] = ["kv", "dynamo", "least-loaded", "round-robin", "oracle"];

/// The same on a prefill/decode fleet: conditional and forced
/// disaggregation, a load-only baseline, and the engines without roles.
pub const PD_POLICIES: [&str; 4] = ["kv", "kv-split", "round-robin", "aggregated"];

/// The contenders compared by default on a fleet with `layout`.
pub fn default_policies(layout: Option<PdLayout>) -> &'static [&'static str] {
    if layout.is_some() {
        &PD_POLICIES
    } else {
        &DEFAULT_POLICIES
    }
}

/// The most runs one command makes (policies × sweep points × seeds).
pub const MAX_RUNS: usize = 100_000;

/// One axis of a sweep: its short name (in each run's label), its values,
/// and how a value sets a routing.
pub type SweepAxis<'a> = (&'static str, &'a [f64], fn(&mut Routing, f64));

/// Every combination of the axes' values applied to `base`, each labelled
/// `name=value,…` (one unlabelled `base` without axes); an error past
/// [`MAX_RUNS`] combinations.
pub fn sweep(base: Routing, axes: &[SweepAxis<'_>]) -> Result<Vec<(String, Routing)>> {
    let mut out = vec![(String::new(), base)];
    for &(name, values, set) in axes {
        if out.len().saturating_mul(values.len()) > MAX_RUNS {
            return Err(Error::Invalid(format!(
                "the sweep asks for more than {MAX_RUNS} runs; split it"
            )));
        }
        let mut next = Vec::with_capacity(out.len() * values.len());
        for (label, routing) in &out {
            for &v in values {
                let mut r = *routing;
                set(&mut r, v);
                let sep = if label.is_empty() { "" } else { "," };
                next.push((format!("{label}{sep}{name}={v}"), r));
            }
        }
        out = next;
    }
    Ok(out)
}

/// Where a run's requests come from: a preset, else a trace, else
/// `workload` (whose seed each run sets); a rate makes arrivals Poisson,
/// else they are a closed loop (a trace keeps its own times).
#[derive(Debug, Clone)]
pub struct Traffic<'a> {
    /// A named workload (its requests, concurrency and groups).
    pub preset: Option<Preset>,
    /// A Mooncake-format trace, replayed at its own times.
    pub trace: Option<&'a Trace>,
    /// The workload when neither a preset nor a trace is given.
    pub workload: WorkloadSpec,
    /// Requests per run (`None`: the preset's, all of a trace's, or 1 000).
    pub requests: Option<usize>,
    /// Requests in flight in a closed loop (`None`: the preset's, or 16).
    pub concurrency: Option<usize>,
    /// Poisson arrivals per second instead of a closed loop.
    pub rate: Option<f64>,
}

impl Traffic<'_> {
    /// The traffic of one seed.
    pub fn load(&self, seed: u64) -> SimLoad {
        let concurrency = self
            .concurrency
            .or(self.preset.map(|p| p.concurrency()))
            .unwrap_or(16);
        let arrival = match (self.trace, self.rate) {
            (Some(_), _) => Arrival::Trace,
            (None, Some(rate)) => Arrival::Poisson { rate },
            (None, None) => Arrival::Closed { concurrency },
        };
        let workload = match (self.preset, self.trace) {
            (Some(p), _) => p.workload(seed),
            (None, Some(t)) => WorkloadSpec {
                kind: WorkloadKind::Trace,
                trace: Some(t.clone()),
                seed,
                ..WorkloadSpec::default()
            },
            (None, None) => WorkloadSpec {
                seed,
                ..self.workload.clone()
            },
        };
        let requests = self.requests.unwrap_or(match (self.preset, self.trace) {
            (Some(p), _) => p.requests(),
            (None, Some(_)) => 0,
            (None, None) => 1_000,
        });
        SimLoad {
            workload,
            arrival,
            requests,
        }
    }
}

/// The baselines of the pin search, in order; the first two set the
/// target (the better of their tails), `kv` is shown beside them.
pub const PIN_BASELINES: [&str; 3] = ["least-loaded", "dynamo", "kv"];

/// One seed of the pin search: each baseline's run, the target they set,
/// and the best fixed placement of the groups found against it.
#[derive(Debug)]
pub struct PinOutcome {
    /// Each of [`PIN_BASELINES`] with its run.
    pub baselines: Vec<(&'static str, SimReport)>,
    /// The better of the first two baselines' tails.
    pub targets: Targets,
    /// The best placement found, its run and how the search went.
    pub bound: PinBound,
    /// CPU time of the search, in milliseconds.
    pub search_ms: f64,
}

/// Runs the baselines of `load`, then searches the pins of the `kv`
/// contender against the better of the first two (`config` makes a seed's
/// configuration for a contender; `search.seed` is the seed).
pub fn pin_outcome(
    config: &dyn Fn(Contender, u64) -> SimConfig,
    load: &SimLoad,
    search: &PinSearch,
) -> Result<PinOutcome> {
    let seed = search.seed;
    let mut baselines = Vec::new();
    for name in PIN_BASELINES {
        let contender: Contender = name.parse()?;
        baselines.push((name, simulate(&config(contender, seed), load)?));
    }
    let targets = Targets::better_of(baselines[..2].iter().map(|(_, r)| r));
    let started = Instant::now();
    let kv = config("kv".parse()?, seed);
    let bound = search_pins(&kv, load, &targets, search)?;
    let search_ms = started.elapsed().as_secs_f64() * 1e3;
    Ok(PinOutcome {
        baselines,
        targets,
        bound,
        search_ms,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn traffic() -> Traffic<'static> {
        Traffic {
            preset: None,
            trace: None,
            workload: WorkloadSpec {
                kind: WorkloadKind::MultiTurn,
                scale: 0.5,
                ..WorkloadSpec::default()
            },
            requests: None,
            concurrency: None,
            rate: None,
        }
    }

    #[test]
    fn a_workload_runs_a_closed_loop_of_16_for_1000_requests_with_each_seed() {
        let load = traffic().load(7);
        assert_eq!(load.arrival, Arrival::Closed { concurrency: 16 });
        assert_eq!(load.requests, 1_000);
        assert_eq!(load.workload.kind, WorkloadKind::MultiTurn);
        assert_eq!((load.workload.seed, load.workload.scale), (7, 0.5));
    }

    #[test]
    fn a_rate_makes_arrivals_poisson_and_a_preset_sets_its_own_sizes() {
        let poisson = Traffic {
            rate: Some(20.0),
            ..traffic()
        };
        assert_eq!(poisson.load(1).arrival, Arrival::Poisson { rate: 20.0 });
        let preset = Preset::Short;
        let short = Traffic {
            preset: Some(preset),
            ..traffic()
        };
        let load = short.load(3);
        assert_eq!(load.requests, preset.requests());
        assert_eq!(
            load.arrival,
            Arrival::Closed {
                concurrency: preset.concurrency()
            }
        );
        assert_eq!(load.workload.kind, preset.workload(3).kind);
    }

    #[test]
    fn a_sweep_runs_every_combination_of_its_axes_labelled_in_order() {
        let base = Routing::new(kvroute_core::scheduler::Policy::Kv);
        assert_eq!(sweep(base, &[]).expect("no axes"), [(String::new(), base)]);
        let axes: [SweepAxis<'_>; 2] = [
            ("t", &[0.0, 0.5], |r, v| r.temperature = v),
            ("stick", &[1.0, 1.5, 2.0], |r, v| r.stickiness = v),
        ];
        let runs = sweep(base, &axes).expect("six runs");
        let labels: Vec<&str> = runs.iter().map(|(l, _)| l.as_str()).collect();
        assert_eq!(labels.len(), 6);
        assert_eq!(labels[0], "t=0,stick=1");
        assert_eq!(labels[5], "t=0.5,stick=2");
        assert_eq!((runs[5].1.temperature, runs[5].1.stickiness), (0.5, 2.0));
        let many = vec![0.0; 1_000];
        let huge: [SweepAxis<'_>; 2] = [("t", &many, |r, v| r.temperature = v); 2];
        assert!(sweep(base, &huge).is_err());
    }

    #[test]
    fn a_pd_fleet_compares_its_own_contenders_by_default() {
        assert_eq!(default_policies(None), DEFAULT_POLICIES);
        assert_eq!(default_policies(Some(PdLayout::DEFAULT)), PD_POLICIES);
    }
}
