//! kvroute's load generation and measurement, used by `kvroute bench` and
//! `kvroute demo`: seeded workloads sent at any OpenAI-compatible endpoint,
//! or through the oracle, in open or closed loop, summarised per routing
//! policy.
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
//! let mut report = Report::new(options.workload.describe());
//! let endpoint = Endpoint::OpenAi { base_url: "http://127.0.0.1:8000".into() };
//! report.push("kv", run(&reqwest::Client::new(), &endpoint, &options).await?);
//! print!("{}", table(&report));
//! ```
//!
//! See `docs/bench.md` for the workloads' sizes, arrival modes and fields.

pub mod driver;
pub mod error;
pub mod report;
pub mod stats;
pub mod trace;
pub mod workload;

pub use driver::{measure, run, Arrival, Endpoint, LoadOptions};
pub use error::{Error, Result};
pub use report::{table, write_svg_plot, PolicyReport, Report, ORACLE};
pub use workload::{TextRenderer, WorkloadKind, WorkloadSpec};
