//! `kvroute bench sim`: a fleet, its router and its clients on a virtual
//! clock, so that a routing configuration is measured in milliseconds of
//! CPU instead of a minute of real time, and a sweep of hundreds of them
//! takes seconds.
//!
//! Nothing is imitated that can be run: each engine is the mocker's own
//! engine core ([`kvroute_mocker::engine::Engine`]: its scheduler, prefix
//! cache, events and step times), the router is kvroute's index, decoder,
//! scoring and in-flight accounting ([`routing`]), and the clients are the
//! load generator's workloads and arrival modes, or a Mooncake trace
//! ([`crate::mooncake`]). Only the sockets and the sleeping are replaced:
//! an engine's step takes its modelled time on the clock, a message takes
//! a fixed delay ([`Delays`]), and the run ends when the last request does.
//!
//! The order of things follows `kvroute mocker`'s driver: a step's work is
//! chosen when it starts, requests that arrive during a step join the next
//! one, and a step's events and tokens go out when it ends. The simulated
//! figures are checked against real-time runs in `docs/bench.md`.
//!
//! A disaggregated fleet ([`SimConfig::layout`]) is served as `kvroute
//! serve` serves vLLM prefill and decode engines: the router places the
//! decode rank, then the prefill rank unless the decode rank prefills
//! locally ([`routing::Split`]); the prefill leg (one output token, its
//! blocks held) runs on the prefill engine, its answer goes back to the
//! router, the decode leg to the decode engine, which waits the modelled
//! transfer of the blocks it lacks, tells the prefill engine it read them
//! (the blocks are released there) and runs the request with its prompt
//! arrived computed. The client sees the decode leg's stream.

pub mod bound;
pub mod caps;
mod clock;
pub mod frontier;
pub mod plan;
pub mod routing;
pub mod runs;

mod plot;

// The load generator's modules the simulator builds on, under their own
// names: its clients, the policies, the presets, the reports.
use kvroute_loadgen::{
    contender, driver, error, mooncake, oracle, preset, report, stats, workload,
};

use kvroute_mocker::engine::EngineConfig;

use crate::contender::Disagg;
pub use crate::contender::{Contender, Routing};
use crate::driver::Arrival;
use crate::error::{Error, Result};
use crate::preset::PdLayout;
use crate::report::PolicyReport;
use crate::workload::WorkloadSpec;
pub use routing::{Pins, Placement, SimRouter, Split};

/// Modelled microseconds to move one KV block from a prefill engine to a
/// decode engine, as `kvroute mocker --transfer-us-per-block` defaults to.
pub const DEFAULT_TRANSFER_US_PER_BLOCK: u64 =
    kvroute_mocker::config::DEFAULT_TRANSFER_US_PER_BLOCK;

/// Fixed delays of the messages between the parts, in microseconds.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Delays {
    /// Client to router, and router to client (each way).
    pub client_us: u64,
    /// Router to engine, and engine to router (each way).
    pub engine_us: u64,
    /// From the end of an engine's step to its events in the router's index.
    pub event_us: u64,
    /// Added to every step that computes something: the real driver's
    /// wake-up after each step's sleep.
    pub step_us: u64,
}

impl Default for Delays {
    /// What one HTTP hop and one ZeroMQ batch take on 127.0.0.1, measured
    /// against real-time runs (docs/bench.md, "The simulator").
    fn default() -> Self {
        Delays {
            client_us: 600,
            engine_us: 400,
            event_us: 400,
            step_us: 1_200,
        }
    }
}

/// The simulated engines' configuration: `kvroute mocker`'s defaults with
/// `num_gpu_blocks` blocks of KV cache (`None`: the mocker's default) and
/// its step times divided by `speedup`. The command line reaches the engine
/// model through here, never through the mocker crate itself.
pub fn engine_config(num_gpu_blocks: Option<usize>, speedup: f64) -> EngineConfig {
    let defaults = kvroute_mocker::MockerConfig::default();
    let mut mocker = kvroute_mocker::MockerConfig {
        num_gpu_blocks: num_gpu_blocks.unwrap_or(defaults.num_gpu_blocks),
        ..defaults
    };
    mocker.timing.speedup = speedup;
    mocker.engine_config()
}

/// The fleet and the router of a simulation.
#[derive(Debug, Clone)]
pub struct SimConfig {
    /// Engines (one rank each).
    pub engines: usize,
    /// Every engine's configuration ([`engine_config`]).
    pub engine: EngineConfig,
    /// Engine `i`'s speed relative to `engine`'s timing (its speedup is
    /// multiplied by `engine_speeds[i]`; missing entries are 1).
    pub engine_speeds: Vec<f64>,
    /// The speeds the router is told, as an operator declares them with a
    /// worker's `speed` (missing entries are 1; they need not be the
    /// engines' own).
    pub worker_speeds: Vec<f64>,
    /// Learn the engines' speeds from their decode times instead
    /// (`None`: the declared speeds stand).
    pub learn_speeds: Option<kvroute_core::scheduler::SpeedConfig>,
    /// Who routes.
    pub policy: Contender,
    /// A fixed placement of prefix groups in place of `policy` (see
    /// [`Pins`]): the `k`-th group to arrive goes to engine `pins[k]`.
    pub pins: Option<Vec<usize>>,
    /// Message delays.
    pub delays: Delays,
    /// Seed of the router's random choices.
    pub seed: u64,
    /// A disaggregated fleet: its first `prefill` engines have
    /// `role=prefill`, the rest `role=decode` (`engines` must be its
    /// [`PdLayout::engines`]). `None`: every engine serves whole requests.
    /// The contender's [`Disagg`] says how the router uses the roles.
    pub layout: Option<PdLayout>,
    /// Modelled microseconds per KV block a decode engine reads from a
    /// prefill engine, divided by the engines' speedup as the mocker
    /// divides it ([`DEFAULT_TRANSFER_US_PER_BLOCK`]).
    pub transfer_us_per_block: u64,
    /// A fetch runs as vLLM's two legs (the holder answers a one-token leg
    /// in its own steps, then the receiver reads the blocks and decodes),
    /// instead of a push of the blocks that takes no step of the holder's.
    pub fetch_legs: bool,
}

impl SimConfig {
    /// Whether requests are split into prefill and decode legs: the fleet
    /// has roles and the contender uses them.
    pub fn splits(&self) -> bool {
        match (self.layout, self.policy) {
            (Some(_), Contender::Router(r)) => r.disagg != Disagg::Aggregated,
            _ => false,
        }
    }
}

/// The traffic of a simulation: the load generator's own options.
#[derive(Debug, Clone)]
pub struct SimLoad {
    /// The requests (token-id workloads and traces; text and images need a
    /// tokenizer and are not simulated).
    pub workload: WorkloadSpec,
    /// Closed loop, Poisson or the trace's own times.
    pub arrival: Arrival,
    /// Requests to send (a trace stops at its end).
    pub requests: usize,
}

/// What a simulation measured.
#[derive(Debug, Clone, PartialEq)]
pub struct SimReport {
    /// The load generator's report (times are virtual).
    pub report: PolicyReport,
    /// Requests routed to each engine; a split request counts on its
    /// prefill engine and on its decode engine.
    pub per_engine: Vec<u64>,
    /// Prompt tokens each engine computed (its prefix-cache lookups less
    /// their hits and the KV it received: the engine's own counters). A
    /// decode engine computes one token of a split request, the last,
    /// which vLLM computes on both sides.
    pub prefilled_tokens: Vec<u64>,
    /// KV blocks decode engines read from prefill engines.
    pub transferred_blocks: u64,
    /// Requests that fetched their prefix from another engine before
    /// running (an aggregated fleet with the fetch lever).
    pub fetches: u64,
    /// Blocks those fetches moved.
    pub fetched_blocks: u64,
    /// Requests placed with a fetch whose source no longer held more of
    /// the prefix than the receiver when they arrived: recomputed there.
    pub fetch_misses: u64,
    /// Copies of hot prefixes made ahead of demand, and their blocks (each
    /// computes one token on its target, counted in `prefilled_tokens`).
    pub replicas: u64,
    /// Blocks those copies moved.
    pub replicated_blocks: u64,
    /// Prompt tokens the engines received from fetches instead of
    /// computing them: counted in `report`'s hit rate (the engines report
    /// them as cached, and they were not recomputed), and apart here.
    pub fetched_tokens: u64,
    /// Engine steps simulated.
    pub steps: u64,
    /// Events the router's decoder skipped (0 unless something is wrong).
    pub skipped_events: u64,
}

/// Runs the load through the fleet and its router to the end.
pub fn simulate(config: &SimConfig, load: &SimLoad) -> Result<SimReport> {
    if config.engines == 0 {
        return Err(Error::Invalid(
            "a simulation needs at least one engine".into(),
        ));
    }
    if load.workload.text || load.workload.text_renderer.is_some() {
        return Err(Error::Invalid(
            "the simulator sends token ids: text prompts are not simulated".into(),
        ));
    }
    match load.arrival {
        Arrival::Closed { concurrency: 0 } => {
            return Err(Error::Invalid("concurrency must be at least 1".into()))
        }
        Arrival::Trace if load.workload.trace.is_none() => {
            return Err(Error::Invalid("a trace arrival needs a trace".into()))
        }
        _ => {}
    }
    if let Some(layout) = config.layout {
        check_layout(config, layout)?;
    }
    clock::Sim::new(config, load).run()
}

/// Refuses what a disaggregated fleet cannot be simulated with.
fn check_layout(config: &SimConfig, layout: PdLayout) -> Result<()> {
    if config.engines != usize::from(layout.engines()) {
        return Err(Error::Invalid(format!(
            "a {layout} fleet has {} engines, not {}",
            layout.engines(),
            config.engines
        )));
    }
    if config.policy == Contender::Oracle {
        return Err(Error::Invalid(
            "the oracle sends whole requests to one engine: it has no prefill/decode mode \
             (compare `aggregated`, the same engines without roles)"
                .into(),
        ));
    }
    if config.pins.is_some() {
        return Err(Error::Invalid(
            "pinned groups place whole requests: not on a prefill/decode fleet".into(),
        ));
    }
    if config.splits() && config.engine.flavor == kvroute_core::event::WorkerFlavor::Sglang {
        return Err(Error::Invalid(
            "the simulator hands KV off as vLLM does (two legs in turn): SGLang's \
             bootstrap rooms are not simulated"
                .into(),
        ));
    }
    Ok(())
}

#[cfg(test)]
mod tests;
