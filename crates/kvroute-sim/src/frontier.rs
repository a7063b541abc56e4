//! `kvroute bench sim --frontier`: kvroute's `kv` policy over a grid of its
//! knobs (cost weights, temperature, a busy threshold, the fetch lever) on each case (a
//! preset or a trace, one seed), the Pareto frontier of (hit rate ↑,
//! TTFT p99 ↓, latency p99 ↓) among those settings, and the peers'
//! baselines (`sglang-cache-aware`, `dynamo`) run on the same case beside
//! it, with whether kvroute's default and the frontier dominate each by the
//! goals of docs/serving.md ("Against the peers").

use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Mutex;

use kvroute_core::scheduler::policy::DEFAULT_STICKINESS;
use kvroute_core::scheduler::{FetchConfig, Policy};

use super::{simulate, SimConfig, SimLoad, SimReport};
use crate::contender::{deal_from_value, Contender, Routing};
use crate::driver::Arrival;
use crate::error::{Error, Result};
use crate::mooncake::Trace;
use crate::preset::Preset;
use crate::workload::{WorkloadKind, WorkloadSpec};

/// The baselines each case runs beside kvroute's grid.
pub const BASELINES: [&str; 2] = ["sglang-cache-aware", "dynamo"];

/// The hit rate kvroute may lose against `sglang-cache-aware` and still
/// dominate it (rounding of one request's blocks on a run of 1 000).
pub const SGLANG_HIT_SLACK: f64 = 0.002;

/// How much longer kvroute's tails may be than `dynamo`'s and still
/// dominate it (×).
pub const DYNAMO_TAIL_SLACK: f64 = 1.02;

/// One case: a fleet and its traffic, for one seed.
#[derive(Debug, Clone)]
pub struct Case {
    /// The preset's or trace's name.
    pub name: String,
    /// The seed of the traffic and the router.
    pub seed: u64,
    /// The fleet (its `policy` is replaced by each contender's).
    pub config: SimConfig,
    /// The traffic.
    pub load: SimLoad,
}

impl Case {
    /// The same case with at most `requests` requests (`None`: as it is).
    pub fn with_requests(mut self, requests: Option<usize>) -> Case {
        if let Some(n) = requests {
            self.load.requests = n;
        }
        self
    }
}

/// A preset's case for one seed: `config`'s fleet with the preset's
/// engine cache (step times divided by `speedup`) and its traffic.
pub fn preset_case(preset: Preset, seed: u64, config: SimConfig, speedup: f64) -> Case {
    Case {
        name: preset.name().into(),
        seed,
        config: SimConfig {
            engine: super::engine_config(Some(preset.gpu_blocks()), speedup),
            ..config
        },
        load: SimLoad {
            workload: preset.workload(seed),
            arrival: Arrival::Closed {
                concurrency: preset.concurrency(),
            },
            requests: preset.requests(),
        },
    }
}

/// A trace's case (named `name`) for one seed: `config`'s fleet with
/// `gpu_blocks` blocks per engine (step times divided by `speedup`),
/// replaying the trace at its own times.
pub fn trace_case(
    (name, trace): (&str, &Trace),
    seed: u64,
    config: SimConfig,
    (gpu_blocks, speedup): (usize, f64),
) -> Case {
    Case {
        name: name.into(),
        seed,
        config: SimConfig {
            engine: super::engine_config(Some(gpu_blocks), speedup),
            ..config
        },
        load: SimLoad {
            workload: WorkloadSpec {
                kind: WorkloadKind::Trace,
                trace: Some(trace.clone()),
                seed,
                ..WorkloadSpec::default()
            },
            arrival: Arrival::Trace,
            requests: 0,
        },
    }
}

/// What `kvroute bench sim --frontier` runs.
#[derive(Debug, Clone)]
pub struct Plan<'a> {
    /// The presets.
    pub presets: Vec<Preset>,
    /// A trace: its name, itself and its engines' KV blocks.
    pub trace: Option<(&'a str, &'a Trace, usize)>,
    /// One case per seed of each.
    pub seeds: &'a [u64],
    /// Divides the engines' step times.
    pub speedup: f64,
    /// At most this many requests per case (`None`: each case's own).
    pub requests: Option<usize>,
}

/// The cases of `plan`, each on `config(seed)`'s fleet.
pub fn cases(plan: &Plan<'_>, config: &dyn Fn(u64) -> SimConfig) -> Vec<Case> {
    let mut out = Vec::new();
    for &p in &plan.presets {
        for &seed in plan.seeds {
            out.push(preset_case(p, seed, config(seed), plan.speedup));
        }
    }
    if let Some((name, trace, blocks)) = plan.trace {
        for &seed in plan.seeds {
            let speed = (blocks, plan.speedup);
            out.push(trace_case((name, trace), seed, config(seed), speed));
        }
    }
    out.into_iter()
        .map(|c| c.with_requests(plan.requests))
        .collect()
}

/// The synthetic Mooncake trace `--frontier` runs when no case is named.
pub const MOONCAKE_TRACE: &str = "bench/traces/synthetic-mooncake.jsonl";

/// `kvroute bench sim --frontier`'s options.
#[derive(Debug, Clone, Copy)]
pub struct Options<'a> {
    /// Only this preset (no trace).
    pub preset: Option<Preset>,
    /// Only this trace (with no preset); neither: `long`, `short` and
    /// [`MOONCAKE_TRACE`].
    pub trace: Option<&'a Path>,
    /// A trace's KV blocks per engine (default 2 048).
    pub gpu_blocks: Option<usize>,
    /// One case per seed.
    pub seeds: &'a [u64],
    /// Divides the engines' step times.
    pub speedup: f64,
    /// At most this many requests per case.
    pub requests: Option<usize>,
    /// Every point as JSON instead of the table.
    pub json: bool,
    /// Where to draw the frontiers.
    pub svg: Option<&'a Path>,
}

/// Runs `--frontier` with each case on `config(seed)`'s fleet; returns what
/// to print.
pub fn command(o: &Options<'_>, config: &dyn Fn(u64) -> SimConfig) -> Result<String> {
    let path = o.preset.is_none().then(|| {
        o.trace
            .map_or_else(|| PathBuf::from(MOONCAKE_TRACE), Path::to_path_buf)
    });
    let trace = path.as_deref().map(Trace::read).transpose()?;
    let name = path.as_deref().and_then(|p| p.file_stem());
    let name = name.map_or(String::new(), |s| s.to_string_lossy().into_owned());
    let plan = Plan {
        presets: match (o.preset, o.trace) {
            (Some(p), _) => vec![p],
            (None, Some(_)) => Vec::new(),
            (None, None) => vec![Preset::Long, Preset::Short],
        },
        trace: trace
            .as_ref()
            .map(|t| (name.as_str(), t, o.gpu_blocks.unwrap_or(2_048))),
        seeds: o.seeds,
        speedup: o.speedup,
        requests: o.requests,
    };
    let results = run(&cases(&plan, config), &kv_grid())?;
    let mut out = report(&results, o.json);
    if let Some(svg) = o.svg {
        crate::plot::write_frontier_svg(svg, &results)?;
        out.push_str(&format!("frontier drawn in {}\n", svg.display()));
    }
    Ok(out)
}

/// One setting's result on one case.
#[derive(Debug, Clone, PartialEq)]
pub struct Point {
    /// The setting (`kv[pls=12,…]`, `kv`, or a baseline's name).
    pub label: String,
    /// Hit rate.
    pub hit: f64,
    /// TTFT p99, ms.
    pub ttft_p99: f64,
    /// Latency p99, ms.
    pub latency_p99: f64,
}

impl Point {
    fn of(label: &str, r: &SimReport) -> Point {
        Point {
            label: label.to_string(),
            hit: r.report.hit_rate,
            ttft_p99: r.report.ttft_ms.p99,
            latency_p99: r.report.latency_ms.p99,
        }
    }

    /// At least as good as `other` on all three, better on one.
    pub fn dominates(&self, other: &Point) -> bool {
        let ge = self.hit >= other.hit
            && self.ttft_p99 <= other.ttft_p99
            && self.latency_p99 <= other.latency_p99;
        let gt = self.hit > other.hit
            || self.ttft_p99 < other.ttft_p99
            || self.latency_p99 < other.latency_p99;
        ge && gt
    }

    /// The goal against `sglang-cache-aware`: hit within
    /// [`SGLANG_HIT_SLACK`], both tails no longer.
    pub fn beats_sglang(&self, s: &Point) -> bool {
        self.hit >= s.hit - SGLANG_HIT_SLACK
            && self.ttft_p99 <= s.ttft_p99
            && self.latency_p99 <= s.latency_p99
    }

    /// The goal against `dynamo`: hit no lower, both tails within
    /// [`DYNAMO_TAIL_SLACK`].
    pub fn beats_dynamo(&self, d: &Point) -> bool {
        self.hit >= d.hit
            && self.ttft_p99 <= d.ttft_p99 * DYNAMO_TAIL_SLACK
            && self.latency_p99 <= d.latency_p99 * DYNAMO_TAIL_SLACK
    }
}

/// The positions of the points no other point dominates, by TTFT p99.
pub fn pareto(points: &[Point]) -> Vec<usize> {
    let mut front: Vec<usize> = (0..points.len())
        .filter(|&i| !points.iter().any(|p| p.dominates(&points[i])))
        .collect();
    front.sort_by(|&a, &b| points[a].ttft_p99.total_cmp(&points[b].ttft_p99));
    front.dedup_by(|a, b| {
        let (p, q) = (&points[*a], &points[*b]);
        (p.hit, p.ttft_p99, p.latency_p99) == (q.hit, q.ttft_p99, q.latency_p99)
    });
    front
}

/// One axis of the grid: its short name (as `bench sim`'s sweep labels
/// it), its values, and how it sets a routing.
type Axis = (&'static str, &'static [f64], fn(&mut Routing, f64));

/// The knobs swept, each around kvroute's default (listed first).
const AXES: [Axis; 8] = [
    ("pls", &[12.0, 4.0, 24.0], |r, v| {
        r.weights.prefill_load_scale = v
    }),
    ("apw", &[2.0, 0.0], |r, v| {
        r.weights.active_prefix_weight = v
    }),
    ("kvw", &[0.25, 0.0, 1.0], |r, v| {
        r.weights.request_kv_weight = v
    }),
    ("t", &[0.0, 0.05], |r, v| r.temperature = v),
    ("busy", &[0.0, 8.0], |r, v| {
        r.busy.requests = (v > 0.0).then_some(v as u64)
    }),
    ("deal", &[2.0, 0.0], |r, v| {
        r.deal_new_prefixes = deal_from_value(v)
    }),
    ("stick", &[DEFAULT_STICKINESS, 0.0], |r, v| r.stickiness = v),
    // The fetch lever: off, or on at this transfer cost (µs per block).
    ("fetch", &[0.0, 20.0], |r, v| {
        r.fetch = (v > 0.0).then_some(FetchConfig {
            transfer_us_per_block: v,
            ..FetchConfig::default()
        })
    }),
];

/// kvroute's `kv` policy at every combination of the swept axes; the first is
/// the default (`kv`).
pub fn kv_grid() -> Vec<(String, Routing)> {
    let mut out = vec![(Vec::<String>::new(), Routing::new(Policy::Kv))];
    for (name, values, set) in AXES {
        let mut next = Vec::with_capacity(out.len() * values.len());
        for (labels, routing) in &out {
            for (k, &v) in values.iter().enumerate() {
                let mut r = *routing;
                set(&mut r, v);
                let mut l = labels.clone();
                if k > 0 {
                    l.push(format!("{name}={v}"));
                }
                next.push((l, r));
            }
        }
        out = next;
    }
    out.into_iter()
        .map(|(l, r)| {
            let label = if l.is_empty() {
                "kv".to_string()
            } else {
                format!("kv[{}]", l.join(","))
            };
            (label, r)
        })
        .collect()
}

/// One case's results.
#[derive(Debug, Clone)]
pub struct CaseResult {
    /// The case's name.
    pub name: String,
    /// Its seed.
    pub seed: u64,
    /// Every `kv` setting's point, the default first.
    pub points: Vec<Point>,
    /// The positions in `points` of the Pareto frontier.
    pub frontier: Vec<usize>,
    /// The baselines' points, in [`BASELINES`]' order.
    pub baselines: Vec<Point>,
}

impl CaseResult {
    /// kvroute's default setting.
    pub fn default_point(&self) -> Option<&Point> {
        self.points.first()
    }

    fn baseline(&self, name: &str) -> Option<&Point> {
        self.baselines.iter().find(|p| p.label == name)
    }

    /// Whether the default meets the goal against `sglang-cache-aware`
    /// and against `dynamo` (`None`: the baseline did not run).
    pub fn default_beats(&self) -> (Option<bool>, Option<bool>) {
        let d = self.default_point();
        let s = self.baseline(BASELINES[0]);
        let y = self.baseline(BASELINES[1]);
        (
            d.zip(s).map(|(d, s)| d.beats_sglang(s)),
            d.zip(y).map(|(d, y)| d.beats_dynamo(y)),
        )
    }

    /// The settings of the grid that meet both goals at once.
    pub fn beating_both(&self) -> Vec<&Point> {
        let (Some(s), Some(y)) = (self.baseline(BASELINES[0]), self.baseline(BASELINES[1])) else {
            return Vec::new();
        };
        self.points
            .iter()
            .filter(|p| p.beats_sglang(s) && p.beats_dynamo(y))
            .collect()
    }
}

/// Runs every case under the grid and the baselines on every core.
pub fn run(cases: &[Case], grid: &[(String, Routing)]) -> Result<Vec<CaseResult>> {
    let mut contenders: Vec<(String, Contender)> = grid
        .iter()
        .map(|(l, r)| (l.clone(), Contender::Router(*r)))
        .collect();
    for b in BASELINES {
        contenders.push((b.to_string(), b.parse()?));
    }
    let jobs: Vec<(usize, usize)> = (0..cases.len())
        .flat_map(|c| (0..contenders.len()).map(move |k| (c, k)))
        .collect();
    let reports = run_jobs(jobs.len(), |j| {
        let (c, k) = jobs[j];
        let config = SimConfig {
            policy: contenders[k].1,
            ..cases[c].config.clone()
        };
        simulate(&config, &cases[c].load)
    })?;
    let per_case = contenders.len();
    Ok(cases
        .iter()
        .zip(reports.chunks(per_case))
        .map(|(case, rs)| {
            let points: Vec<Point> = rs[..grid.len()]
                .iter()
                .zip(grid)
                .map(|(r, (l, _))| Point::of(l, r))
                .collect();
            let baselines = rs[grid.len()..]
                .iter()
                .zip(BASELINES)
                .map(|(r, l)| Point::of(l, r))
                .collect();
            CaseResult {
                name: case.name.clone(),
                seed: case.seed,
                frontier: pareto(&points),
                points,
                baselines,
            }
        })
        .collect())
}

/// Runs `n` jobs on every core; results in the jobs' order.
fn run_jobs(n: usize, job: impl Fn(usize) -> Result<SimReport> + Sync) -> Result<Vec<SimReport>> {
    let next = AtomicUsize::new(0);
    let slots: Mutex<Vec<Option<Result<SimReport>>>> = Mutex::new((0..n).map(|_| None).collect());
    let threads = std::thread::available_parallelism()
        .map_or(1, |c| c.get())
        .min(n.max(1));
    std::thread::scope(|s| {
        for _ in 0..threads {
            s.spawn(|| loop {
                let i = next.fetch_add(1, Ordering::Relaxed);
                if i >= n {
                    break;
                }
                let out = job(i);
                if let Ok(mut slots) = slots.lock() {
                    slots[i] = Some(out);
                }
            });
        }
    });
    let slots = slots
        .into_inner()
        .map_err(|_| Error::Invalid("a simulation panicked".into()))?;
    slots
        .into_iter()
        .map(|r| r.unwrap_or_else(|| Err(Error::Invalid("a simulation did not finish".into()))))
        .collect()
}

/// Every point of every case as a JSON object (`--frontier --json`):
/// case, seed, kind (`kv` or `baseline`), setting, hit and both p99.
pub fn json_lines(results: &[CaseResult]) -> Vec<serde_json::Value> {
    let mut out = Vec::new();
    for r in results {
        let kv = r.points.iter().map(|p| (p, "kv"));
        for (p, kind) in kv.chain(r.baselines.iter().map(|p| (p, "baseline"))) {
            out.push(serde_json::json!({
                "case": r.name, "seed": r.seed, "kind": kind, "setting": p.label,
                "hit": p.hit, "ttft_p99": p.ttft_p99, "latency_p99": p.latency_p99,
            }));
        }
    }
    out
}

/// [`json_lines`] one per line when `json`, else [`table`].
pub fn report(results: &[CaseResult], json: bool) -> String {
    if !json {
        return table(results);
    }
    json_lines(results)
        .iter()
        .map(|row| format!("{row}\n"))
        .collect()
}

/// The frontier of each case with the baselines beside it, and the goals'
/// verdicts, as text.
pub fn table(results: &[CaseResult]) -> String {
    use std::fmt::Write as _;
    let mut out = String::new();
    let yes = |b: Option<bool>| match b {
        Some(true) => "yes",
        Some(false) => "no",
        None => "-",
    };
    for r in results {
        let _ = writeln!(
            out,
            "== {} seed {} ({} settings, {} on the frontier)",
            r.name,
            r.seed,
            r.points.len(),
            r.frontier.len()
        );
        let _ = writeln!(
            out,
            "{:<44}{:>8}{:>10}{:>10}",
            "setting", "hit", "ttft p99", "lat p99"
        );
        let line = |out: &mut String, mark: &str, p: &Point| {
            let _ = writeln!(
                out,
                "{mark}{:<42}{:>8.4}{:>10.1}{:>10.1}",
                p.label, p.hit, p.ttft_p99, p.latency_p99
            );
        };
        for &i in &r.frontier {
            line(&mut out, "  ", &r.points[i]);
        }
        if let Some(d) = r.default_point() {
            if !r.frontier.contains(&0) {
                line(&mut out, "d ", d);
            }
        }
        for b in &r.baselines {
            line(&mut out, "b ", b);
        }
        let (s, y) = r.default_beats();
        let both = r.beating_both();
        let _ = writeln!(
            out,
            "default dominates sglang-cache-aware: {}, dynamo: {}; settings meeting both goals: {}{}",
            yes(s),
            yes(y),
            both.len(),
            both.first()
                .map_or(String::new(), |p| format!(" (e.g. {})", p.label))
        );
    }
    out.push_str(
        "d = kvroute's default when off the frontier, b = baseline; times in ms; goals: \
         vs sglang hit ≥ its − 0.002 and both p99 ≤ its; vs dynamo hit ≥ its and both p99 ≤ 1.02 × its\n",
    );
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    fn p(label: &str, hit: f64, ttft: f64, lat: f64) -> Point {
        Point {
            label: label.into(),
            hit,
            ttft_p99: ttft,
            latency_p99: lat,
        }
    }

    #[test]
    fn the_frontier_keeps_only_undominated_points() {
        let points = [
            p("a", 0.9, 100.0, 500.0),
            p("b", 0.8, 90.0, 450.0),
            p("c", 0.8, 120.0, 600.0), // dominated by a
            p("d", 0.9, 100.0, 500.0), // a's twin: listed once
            p("e", 0.95, 200.0, 700.0),
        ];
        assert_eq!(pareto(&points), [1, 0, 4]);
        assert!(!points[0].dominates(&points[3]));
    }

    #[test]
    fn the_goals_allow_their_slack_and_no_more() {
        let s = p("sglang", 0.94, 160.0, 619.0);
        assert!(p("kv", 0.938, 160.0, 619.0).beats_sglang(&s));
        assert!(!p("kv", 0.937, 150.0, 600.0).beats_sglang(&s));
        assert!(!p("kv", 0.95, 150.0, 620.0).beats_sglang(&s));
        let d = p("dynamo", 0.9, 158.0, 486.0);
        assert!(p("kv", 0.9, 161.0, 495.0).beats_dynamo(&d));
        assert!(!p("kv", 0.9, 161.0, 496.0).beats_dynamo(&d));
        assert!(!p("kv", 0.89, 100.0, 400.0).beats_dynamo(&d));
    }

    #[test]
    fn the_grid_starts_with_the_default_and_labels_what_differs() {
        let grid = kv_grid();
        assert_eq!(grid.len(), 3 * 2 * 3 * 2 * 2 * 2 * 2 * 2);
        assert_eq!(grid[0], ("kv".to_string(), Routing::new(Policy::Kv)));
        assert!(grid.iter().any(|(l, r)| l == "kv[kvw=1]"
            && r.weights.request_kv_weight == 1.0
            && r.busy.requests.is_none()));
        assert!(grid
            .iter()
            .any(|(l, r)| l == "kv[busy=8]" && r.busy.requests == Some(8)));
        assert!(grid.iter().any(|(l, r)| l == "kv[deal=0,stick=0]"
            && r.deal_new_prefixes.is_none()
            && r.stickiness == 0.0));
    }
}
