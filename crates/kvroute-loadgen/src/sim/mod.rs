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

pub mod bound;
mod clock;
pub mod routing;

use kvroute_mocker::engine::EngineConfig;

pub use crate::contender::{Contender, Routing};
use crate::driver::Arrival;
use crate::error::{Error, Result};
use crate::report::PolicyReport;
use crate::workload::WorkloadSpec;
pub use routing::{Pins, Placement, SimRouter};

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
    /// Requests routed to each engine.
    pub per_engine: Vec<u64>,
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
    clock::Sim::new(config, load).run()
}

#[cfg(test)]
mod tests;
