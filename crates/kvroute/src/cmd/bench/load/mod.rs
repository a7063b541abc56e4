//! The load generator of `kvroute bench` (also used by `kvroute demo`):
//! seeded workloads sent at any OpenAI-compatible endpoint, or through the
//! oracle, in open or closed loop, summarised per routing policy.
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
//! print_table(&report);
//! ```
//!
//! See `docs/bench.md` for the workloads' sizes, arrival modes and fields.

pub mod driver;
pub mod report;
pub mod stats;
pub mod workload;

// The API `kvroute bench` and `kvroute demo` share; a binary crate warns
// about re-exports one of them does not use.
#[allow(unused_imports)]
pub use driver::{run, Arrival, Endpoint, LoadOptions};
#[allow(unused_imports)]
pub use report::{print_table, write_svg_plot, PolicyReport, Report, ORACLE};
#[allow(unused_imports)]
pub use stats::{Percentiles2, Percentiles3};
#[allow(unused_imports)]
pub use workload::{TextRenderer, WorkloadKind, WorkloadSpec};
