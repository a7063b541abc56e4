//! `kvroute bench sim`: the fleet, the router and the clients on a virtual
//! clock (see `kvroute_sim`), for each named policy, each seed and
//! each combination of the cost weights given as lists: a sweep. With a
//! prefill/decode layout (`--pd P:D`, or `--preset pd`), the fleet's first
//! P engines prefill and the rest decode.

use std::path::PathBuf;
use std::process::ExitCode;

use anyhow::{bail, Context, Result};
use clap::Args;
use kvroute_core::scheduler::{CostWeights, Policy, SpeedConfig};
use kvroute_loadgen as load;
use kvroute_loadgen::contender::Contender;
use kvroute_loadgen::mooncake::Trace;
use kvroute_loadgen::PdLayout;
use kvroute_sim::bound::PinSearch;
use kvroute_sim::plan::{self, PinOutcome, Traffic};
use kvroute_sim::runs;
use kvroute_sim::{Delays, SimConfig, SimReport, DEFAULT_TRANSFER_US_PER_BLOCK};
use serde_json::json;

mod sweep;
use kvroute_sim::plan::MAX_RUNS;
use sweep::SweepArgs;

/// Arguments of `kvroute bench sim`.
#[derive(Debug, Args)]
pub struct SimArgs {
    /// A named workload and its engines' cache (`long`, `short`, `pd`: on a
    /// 2:2 prefill/decode fleet unless `--pd` says otherwise).
    #[arg(long, value_parser = crate::cmd::args::parse_preset, conflicts_with_all = ["workload", "trace", "max_tokens"])]
    preset: Option<load::Preset>,
    /// A Mooncake-format trace (JSONL: timestamp, input_length,
    /// output_length, hash_ids), replayed at its own times.
    #[arg(long, value_name = "FILE", conflicts_with = "workload")]
    trace: Option<PathBuf>,
    /// The traffic (token-id workloads: shared-prefix, multi-turn, long-doc, random).
    #[arg(long, default_value = "shared-prefix", value_parser = crate::cmd::args::workload_parser())]
    workload: load::WorkloadKind,
    /// Requests per run (a trace: at most this many; 0: all of it).
    #[arg(long)]
    requests: Option<usize>,
    /// Closed loop: requests in flight at once.
    #[arg(long)]
    concurrency: Option<usize>,
    /// Open loop: Poisson arrivals at this many requests per second.
    #[arg(long, conflicts_with = "concurrency")]
    rate: Option<f64>,
    /// Multiplies every workload size.
    #[arg(long, default_value_t = 1.0)]
    scale: f64,
    /// Prefix groups, conversations or documents.
    #[arg(long, default_value_t = 8)]
    groups: usize,
    /// `shared-prefix`: tokens per question.
    #[arg(long)]
    question_tokens: Option<usize>,
    /// Tokens generated per request (a trace sets its own).
    #[arg(long, default_value_t = 32)]
    max_tokens: u32,
    /// Seeds of the workload and the router; one run each.
    #[arg(long, value_delimiter = ',', default_value = "1")]
    seeds: Vec<u64>,
    /// Engines (one rank each; default 4, or the `--pd` layout's).
    #[arg(long)]
    engines: Option<usize>,
    /// A prefill/decode disaggregated fleet: P prefill engines, then D
    /// decode engines (`2:2`). `kv` prefills a request on its decode
    /// engine when that engine caches all but a short part of it,
    /// `kv-split` never does, `aggregated` serves whole requests on every
    /// engine, roles ignored.
    #[arg(long, value_name = "P:D", value_parser = crate::cmd::args::parse_layout, conflicts_with_all = ["pin_search", "pins"])]
    pd: Option<PdLayout>,
    /// Modelled microseconds per KV block a decode engine reads from a
    /// prefill engine (divided by `--speedup`, as `kvroute mocker
    /// --transfer-us-per-block`).
    #[arg(long, default_value_t = DEFAULT_TRANSFER_US_PER_BLOCK)]
    transfer_us_per_block: u64,
    /// A fetch runs as vLLM's two legs: the holder answers a one-token
    /// leg in its own steps (the prompt's uncached rest computed there),
    /// then the receiver reads the blocks and decodes. Without it, the
    /// blocks are pushed to the receiver without a step of the holder's.
    #[arg(long)]
    fetch_legs: bool,
    /// KV-cache blocks per engine (a preset sets its own).
    #[arg(long)]
    gpu_blocks: Option<usize>,
    /// Divides the engines' step times, as `kvroute mocker --speedup`.
    #[arg(long, default_value_t = 1.0)]
    speedup: f64,
    /// Each engine's own speedup, multiplying `--speedup` (a fleet of
    /// unequal engines: `1,1,1,0.5` makes the last one half as fast).
    #[arg(long, value_delimiter = ',')]
    engine_speeds: Vec<f64>,
    /// The speeds the router is told for each engine, as `kvroute serve`
    /// is with a worker's `speed=` (default: every engine the reference, 1).
    #[arg(long, value_delimiter = ',')]
    worker_speeds: Vec<f64>,
    /// Learn the engines' speeds from their decode times, as `kvroute
    /// serve --learn-speeds` does (the declared ones stand until then).
    #[arg(long)]
    learn_speeds: bool,
    /// A learned speed this close to 1 (relatively) counts as 1.
    #[arg(long, default_value_t = SpeedConfig::default().dead_band)]
    speed_dead_band: f64,
    /// Responses of an engine (their forgetting weight) before its speed is
    /// learned.
    #[arg(long, default_value_t = SpeedConfig::default().min_observations)]
    speed_min_observations: f64,
    /// Weight an engine's earlier responses keep at each new one.
    #[arg(long, default_value_t = SpeedConfig::default().forget)]
    speed_forget: f64,
    /// What routes, in order: router policies (with the peers' `sglang-cache-aware`
    /// and `dynamo`), `kv-tail` (kv set for the latency tail), `kv-fetch` (kv moving busy holders' prefixes instead of their work), `kv-dynamo-weights`
    /// (kv with Dynamo's weights), `kv-split` and `aggregated` (kv always splitting,
    /// or ignoring the roles, on a P/D fleet) and `oracle` (not on a P/D
    /// fleet). Default: kv,dynamo,least-loaded,round-robin,oracle; on a
    /// P/D fleet kv,kv-split,round-robin,aggregated.
    #[arg(long, value_delimiter = ',')]
    policies: Vec<String>,
    #[command(flatten)]
    sweep: SweepArgs,
    /// Microseconds each way between client and router.
    #[arg(long, default_value_t = Delays::default().client_us)]
    client_us: u64,
    /// Microseconds each way between router and engine.
    #[arg(long, default_value_t = Delays::default().engine_us)]
    engine_us: u64,
    /// Microseconds from an engine's step end to its events in the index.
    #[arg(long, default_value_t = Delays::default().event_us)]
    event_us: u64,
    /// Microseconds added to each engine step (the real driver's wake-up).
    #[arg(long, default_value_t = Delays::default().step_us)]
    step_us: u64,
    /// Print one JSON object per run (one per line) instead of a table.
    #[arg(long)]
    json: bool,
    /// Instead of `--policies`: for each seed, run least-loaded and
    /// `dynamo`, then simulate this many fixed placements of the prefix
    /// groups (each group on one engine, so the hit rate is the
    /// workload's ceiling), searching for the lowest TTFT and latency p99
    /// against the better of the two: the bound of a router that keeps
    /// the hit rate at the ceiling.
    #[arg(long, value_name = "N", conflicts_with = "trace")]
    pin_search: Option<usize>,
    /// Instead of `--policies`: one fixed placement of the prefix groups,
    /// the engine of each group in their order of arrival (as
    /// `--pin-search` prints its best).
    #[arg(long, value_delimiter = ',', conflicts_with_all = ["trace", "pin_search"])]
    pins: Vec<usize>,
    /// Instead of `--policies`: the `kv` policy's knobs swept on `long`,
    /// `short` and the Mooncake trace (or `--preset` / `--trace` alone), per
    /// seed: each (hit, TTFT p99, latency p99) Pareto frontier, with
    /// `sglang-cache-aware` and `dynamo` beside it.
    #[arg(long, conflicts_with_all = ["pin_search", "pins", "pd"])]
    frontier: bool,
    /// With `--frontier`: also draw it as an SVG here.
    #[arg(long, value_name = "FILE", requires = "frontier")]
    frontier_svg: Option<PathBuf>,
    /// With `--pin-search`: placements below this hit rate do not count.
    #[arg(long, requires = "pin_search")]
    pin_min_hit: Option<f64>,
    /// With `--pin-search`: how readily the search takes a worse placement
    /// at its start (0: a plain hill climb).
    #[arg(long, default_value_t = 0.03, requires = "pin_search")]
    pin_temperature: f64,
}

impl SimArgs {
    /// The fleet's prefill/decode layout: `--pd`, else the preset's.
    fn layout(&self) -> Option<PdLayout> {
        self.pd.or(self.preset.and_then(|p| p.layout()))
    }

    /// Engines in the fleet: `--engines`, which a layout must agree with.
    fn engines(&self) -> Result<usize> {
        match (self.layout(), self.engines) {
            (Some(l), Some(n)) if n != usize::from(l.engines()) => {
                bail!("--engines {n} disagrees with the {l} prefill/decode layout")
            }
            (Some(l), _) => Ok(usize::from(l.engines())),
            (None, n) => Ok(n.unwrap_or(4)),
        }
    }

    /// The contenders' names: `--policies`, or the fleet's default list.
    fn policy_names(&self) -> Vec<String> {
        if !self.policies.is_empty() {
            return self.policies.clone();
        }
        plan::default_policies(self.layout())
            .iter()
            .map(|n| n.to_string())
            .collect()
    }
}

/// The contenders of the run: each named policy, the `kv` one once per
/// combination of the sweep.
fn contenders(a: &SimArgs) -> Result<Vec<(String, Contender)>> {
    let mut out = Vec::new();
    for name in &a.policy_names() {
        let contender: Contender = name.parse().context("--policies")?;
        if let (Some(layout), Contender::Oracle) = (a.layout(), contender) {
            bail!(
                "the oracle sends whole requests to one engine: it has no prefill/decode mode \
                 (the {layout} fleet of --pd or --preset pd); compare `aggregated`, the same \
                 engines without roles"
            );
        }
        match contender {
            Contender::Router(base)
                if base.policy == Policy::Kv && base.weights == CostWeights::default() =>
            {
                for (label, routing) in a.sweep.expand(base)? {
                    let label = if label.is_empty() {
                        name.clone()
                    } else {
                        format!("{name}[{label}]")
                    };
                    out.push((label, Contender::Router(routing)));
                }
            }
            c => out.push((name.clone(), c)),
        }
    }
    if out.is_empty() {
        bail!("--policies is empty");
    }
    if out.len().saturating_mul(a.seeds.len()) > MAX_RUNS {
        bail!("the sweep asks for more than {MAX_RUNS} runs; split it");
    }
    if !a.sweep.axes().is_empty() && !out.iter().any(|(name, _)| name.contains('[')) {
        bail!("the weight lists sweep the `kv` policy: add kv to --policies");
    }
    Ok(out)
}

/// Where the runs' requests come from.
fn traffic<'a>(a: &SimArgs, trace: Option<&'a Trace>) -> Traffic<'a> {
    Traffic {
        preset: a.preset,
        trace,
        workload: load::WorkloadSpec {
            kind: a.workload,
            scale: a.scale,
            groups: a.groups,
            max_tokens: a.max_tokens,
            question_tokens: a.question_tokens,
            ..load::WorkloadSpec::default()
        },
        requests: a.requests,
        concurrency: a.concurrency,
        rate: a.rate,
    }
}

/// Runs `kvroute bench sim`.
pub fn run(a: &SimArgs) -> Result<ExitCode> {
    if !(a.speedup.is_finite() && a.speedup > 0.0) {
        bail!("--speedup must be a positive number");
    }
    for (flag, speeds) in [
        ("--engine-speeds", &a.engine_speeds),
        ("--worker-speeds", &a.worker_speeds),
    ] {
        if speeds.iter().any(|s| !(s.is_finite() && *s > 0.0)) {
            bail!("{flag} must be positive numbers");
        }
    }
    let trace = a.trace.as_deref().map(Trace::read).transpose()?;
    let engine =
        kvroute_sim::engine_config(a.gpu_blocks.or(a.preset.map(|p| p.gpu_blocks())), a.speedup);
    let delays = Delays {
        client_us: a.client_us,
        engine_us: a.engine_us,
        event_us: a.event_us,
        step_us: a.step_us,
    };
    let (engines, layout) = (a.engines()?, a.layout());
    if layout.is_some() && (a.pin_search.is_some() || !a.pins.is_empty()) {
        bail!("--pin-search and --pins place whole requests: not on a prefill/decode fleet");
    }
    let config = |policy: Contender, seed: u64| SimConfig {
        engines,
        engine: engine.clone(),
        engine_speeds: a.engine_speeds.clone(),
        worker_speeds: a.worker_speeds.clone(),
        learn_speeds: a.learn_speeds.then_some(SpeedConfig {
            dead_band: a.speed_dead_band,
            min_observations: a.speed_min_observations,
            forget: a.speed_forget,
            ..SpeedConfig::default()
        }),
        policy,
        pins: None,
        delays,
        seed,
        layout,
        transfer_us_per_block: a.transfer_us_per_block,
        fetch_legs: a.fetch_legs,
    };
    if let Some(evaluations) = a.pin_search {
        return pin_search(a, evaluations, &config);
    }
    if a.frontier {
        use kvroute_sim::frontier::{command, Options};
        let kv: Contender = "kv".parse()?;
        let options = Options {
            preset: a.preset,
            trace: a.trace.as_deref(),
            gpu_blocks: a.gpu_blocks,
            seeds: &a.seeds,
            speedup: a.speedup,
            requests: a.requests,
            json: a.json,
            svg: a.frontier_svg.as_deref(),
        };
        print!("{}", command(&options, &|seed| config(kv, seed))?);
        return Ok(ExitCode::SUCCESS);
    }
    let contenders = if a.pins.is_empty() {
        contenders(a)?
    } else {
        vec![("pinned".to_string(), "kv".parse()?)]
    };
    let pins = (!a.pins.is_empty()).then(|| a.pins.clone());
    let mut jobs = Vec::new();
    for (name, contender) in contenders {
        for &seed in &a.seeds {
            jobs.push((
                name.clone(),
                seed,
                SimConfig {
                    pins: pins.clone(),
                    ..config(contender, seed)
                },
                traffic(a, trace.as_ref()).load(seed),
            ));
        }
    }
    let rows = runs::run_all(&jobs)?;
    if a.json {
        for r in &rows {
            println!("{r}");
        }
    } else {
        print!("{}", runs::table(&rows, a.seeds.len()));
    }
    Ok(ExitCode::SUCCESS)
}

/// `--pin-search`: per seed, the two baselines and the best fixed
/// placement of the groups found against the better of their tails.
fn pin_search(
    a: &SimArgs,
    evaluations: usize,
    config: &dyn Fn(Contender, u64) -> SimConfig,
) -> Result<ExitCode> {
    let groups = a.preset.map_or(a.groups, |p| p.groups());
    if !a.json {
        println!(
            "{:<14}{:>6}{:>8}{:>10}{:>10}{:>8}  per engine",
            "policy", "seed", "hit", "ttft p99", "lat p99", "ratio"
        );
    }
    for &seed in &a.seeds {
        let load = traffic(a, None).load(seed);
        let search = PinSearch {
            groups,
            evaluations,
            min_hit: a.pin_min_hit,
            seed,
            temperature: a.pin_temperature,
        };
        let PinOutcome {
            baselines,
            targets,
            bound,
            search_ms: cpu_ms,
        } = plan::pin_outcome(config, &load, &search)?;
        let mut rows: Vec<(&str, &SimReport)> = baselines.iter().map(|(n, r)| (*n, r)).collect();
        rows.push(("pinned-best", &bound.report));
        for (name, r) in rows {
            let ratio = targets.ratio(r);
            if a.json {
                let mut v = runs::row(name, seed, r, 0.0);
                v["ratio"] = json!(ratio);
                if name == "pinned-best" {
                    v["pins"] = json!(bound.pins);
                    v["start_ratio"] = json!(bound.start_ratio);
                    v["evaluations"] = json!(bound.evaluations);
                    v["improvements"] = json!(bound.improvements);
                    v["sim_cpu_ms"] = json!(cpu_ms);
                }
                println!("{v}");
            } else {
                println!(
                    "{name:<14}{seed:>6}{:>8.4}{:>10.1}{:>10.1}{:>8.3}  {:?}",
                    r.report.hit_rate,
                    r.report.ttft_ms.p99,
                    r.report.latency_ms.p99,
                    ratio,
                    r.per_engine
                );
            }
        }
        if !a.json {
            println!(
                "{:<14}{seed:>6}  from ratio {:.3} (groups dealt in turn) in {} placements, {} improvements, {:.1} s; pins {:?}",
                "", bound.start_ratio, bound.evaluations, bound.improvements, cpu_ms / 1e3, bound.pins
            );
        }
    }
    Ok(ExitCode::SUCCESS)
}

/// Arguments of `kvroute bench synth-trace`.
#[derive(Debug, Args)]
pub struct SynthTraceArgs {
    /// Requests in the trace.
    #[arg(long, default_value_t = 1_000)]
    requests: usize,
    /// Mean arrivals per second.
    #[arg(long, default_value_t = 8.0)]
    rate: f64,
    /// Shared system prompts.
    #[arg(long, default_value_t = 16)]
    system_prompts: usize,
    /// Conversations open at a time.
    #[arg(long, default_value_t = 24)]
    conversations: usize,
    /// Seed of every choice.
    #[arg(long, default_value_t = 7)]
    seed: u64,
}

/// Prints a synthesized Mooncake-format trace (JSONL) on stdout.
pub fn synth_trace(a: &SynthTraceArgs) -> Result<ExitCode> {
    if !(a.rate.is_finite() && a.rate > 0.0) {
        bail!("--rate must be a positive number");
    }
    let trace = load::mooncake::synthesize(&load::mooncake::SynthesisConfig {
        requests: a.requests,
        rate: a.rate,
        system_prompts: a.system_prompts,
        conversations: a.conversations,
        seed: a.seed,
    });
    print!("{}", trace.to_jsonl());
    Ok(ExitCode::SUCCESS)
}

#[cfg(test)]
mod tests {
    use super::*;
    use clap::Parser;

    #[derive(Debug, Parser)]
    struct Cli {
        #[command(flatten)]
        sim: SimArgs,
    }

    fn args(flags: &[&str]) -> SimArgs {
        Cli::try_parse_from(std::iter::once("sim").chain(flags.iter().copied()))
            .expect("parses")
            .sim
    }

    fn names(a: &SimArgs) -> Vec<String> {
        contenders(a)
            .expect("valid")
            .into_iter()
            .map(|(n, _)| n)
            .collect()
    }

    #[test]
    fn a_pd_layout_sets_the_fleet_and_the_contenders_compared_on_it() {
        let preset = args(&["--preset", "pd"]);
        assert_eq!(preset.layout(), Some(PdLayout::DEFAULT));
        assert_eq!(preset.engines().expect("valid"), 4);
        assert_eq!(names(&preset), plan::PD_POLICIES);
        let given = args(&["--workload", "multi-turn", "--pd", "1:3"]);
        assert_eq!(
            given.layout(),
            Some(PdLayout {
                prefill: 1,
                decode: 3
            })
        );
        let wide = args(&["--preset", "pd", "--pd", "3:1"]);
        assert_eq!(
            wide.layout(),
            Some(PdLayout {
                prefill: 3,
                decode: 1
            })
        );
        let plain = args(&[]);
        assert_eq!((plain.layout(), plain.engines().expect("valid")), (None, 4));
        assert_eq!(names(&plain), plan::DEFAULT_POLICIES);
        assert!(args(&["--pd", "2:2", "--engines", "6"]).engines().is_err());
        assert_eq!(
            args(&["--pd", "2:2", "--engines", "4"]).engines().ok(),
            Some(4)
        );
        for bad in [&["--pd", "3"][..], &["--pd", "2:2", "--pin-search", "4"]] {
            assert!(
                Cli::try_parse_from(std::iter::once("sim").chain(bad.iter().copied())).is_err()
            );
        }
    }

    #[test]
    fn the_oracle_is_refused_on_a_pd_fleet_with_what_to_compare_instead() {
        let e = contenders(&args(&["--preset", "pd", "--policies", "kv,oracle"]))
            .expect_err("no P/D oracle");
        assert!(e.to_string().contains("aggregated"), "{e}");
        let plain = args(&["--policies", "kv,oracle,kv-split,aggregated"]);
        assert_eq!(names(&plain), ["kv", "oracle", "kv-split", "aggregated"]);
    }
}
