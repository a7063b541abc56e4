//! kvroute's load generation and measurement, used by `kvroute load`,
//! `kvroute bench` and the crates built on it: seeded workloads sent at any
//! OpenAI-compatible endpoint, or through the oracle, in open or closed
//! loop, summarised per routing policy.
//!
//! | entry point | what it runs |
//! | --- | --- |
//! | [`measure`] / [`run`] | one workload against one endpoint ([`driver`]) |
//! | [`engines`] / [`embedded_router`] | a fleet of mock engines and a router with a given policy ([`contender`]), in this process, to measure against |
//! | [`nats`] | a NATS server with JetStream for router replicas, as a child process |
//!
//! Inside: [`workload`] (the traffic, [`image`] for its PNGs, [`mooncake`]
//! for traces), [`driver`] (arrivals, bounds, samples), the oracle
//! ([`oracle`], [`event_oracle`]), [`stats`] (every percentile), [`report`]
//! and [`plot`], [`preset`] (the named workloads and their fleets),
//! [`metrics`] (counters read from a router's or an engine's `/metrics`).
//!
//! Built on it, one crate per concern: `kvroute-sim` (the discrete-event
//! simulator, `kvroute bench sim`), `kvroute-bench` (the benchmarks of
//! kvroute's own parts) and `kvroute-demo` (`kvroute demo`).
//!
//! No clap: the binary turns its flags into these config structs.
//!
//! ```ignore
//! let options = LoadOptions {
//!     workload: WorkloadSpec { kind: WorkloadKind::SharedPrefix, scale: 0.1, ..WorkloadSpec::default() },
//!     arrival: Arrival::Closed { concurrency: 16 },
//!     requests: 200,
//!     max_duration: None,
//!     progress: true,
//!     label: "kv".into(),
//! };
//! let endpoint = Endpoint::OpenAi { base_url: "http://127.0.0.1:8000".into() };
//! let report = measure(&endpoint, &options).await?;
//! print!("{}", table(&report));
//! ```
//!
//! See `docs/bench.md` for the workloads' sizes, arrival modes and fields.

mod balancer;
pub mod contender;
pub mod driver;
pub mod embedded_router;
pub mod engines;
pub mod error;
pub mod event_oracle;
mod exchange;
pub mod image;
pub mod metrics;
pub mod mooncake;
pub mod nats;
pub mod oracle;
pub mod plot;
pub mod preset;
mod progress;
pub mod report;
pub mod stats;
pub mod workload;

pub use driver::{measure, run, Arrival, Endpoint, LoadOptions};
pub use embedded_router::RouterTokenizer;
pub use error::{Error, Result};
pub use nats::NatsServer;
pub use plot::write_svg_plot;
pub use preset::{PdLayout, Preset};
pub use report::{table, Fetches, PolicyReport, Report, ORACLE};
pub use workload::{TextRenderer, WorkloadKind, WorkloadSpec};
