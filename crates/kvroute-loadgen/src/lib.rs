//! kvroute's load generation and measurement, used by `kvroute bench` and
//! `kvroute demo`: seeded workloads sent at any OpenAI-compatible endpoint,
//! or through the oracle, in open or closed loop, summarised per routing
//! policy; the demo that compares policies on a mock fleet; and the
//! benchmarks of kvroute's own parts.
//!
//! | entry point | what it runs |
//! | --- | --- |
//! | [`measure`] / [`run`] | one workload against one endpoint ([`driver`]) |
//! | [`demo::run`] | a mock fleet, a router per policy and the oracle |
//! | [`bench::index::run`], [`bench::ingest::run`], [`bench::proxy::run`] | the index alone; a router process ingesting thousands of ranks; the latency a router process adds |
//! | [`bench::replicas::run`] | one router, two synced replicas, two unsynced routers, a replica killed under load |
//!
//! Inside: [`workload`] (the traffic, [`image`] for its PNGs), [`driver`]
//! (arrivals, bounds, samples), the oracle, [`stats`] (every percentile),
//! [`report`] and [`plot`], [`trace`] (the index bench's synthetic events),
//! [`nats`] (a NATS server with JetStream for router replicas, as a child
//! process).
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
pub mod bench;
pub mod contender;
pub mod demo;
pub mod driver;
mod embedded_router;
mod engines;
pub mod error;
pub mod event_oracle;
mod exchange;
pub mod image;
mod metrics;
pub mod mooncake;
pub mod nats;
mod oracle;
pub mod plot;
pub mod preset;
mod progress;
pub mod real_engines;
pub mod report;
pub mod sim;
pub mod stats;
pub mod trace;
pub mod workload;

pub use driver::{measure, run, Arrival, Endpoint, LoadOptions};
pub use embedded_router::RouterTokenizer;
pub use error::{Error, Result};
pub use nats::NatsServer;
pub use plot::write_svg_plot;
pub use preset::{PdLayout, Preset};
pub use report::{table, PolicyReport, Report, ORACLE};
pub use workload::{TextRenderer, WorkloadKind, WorkloadSpec};
