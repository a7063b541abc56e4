//! `kvroute serve`'s endpoints-file flags: workers listed in a file of
//! llm-d's `endpoints.yaml` shape, followed as it changes
//! (`kvroute_server::discovery`).

use std::path::PathBuf;
use std::time::Duration;

use clap::Args;
use kvroute_server::discovery::{EndpointDefaults, FileDiscovery};
use kvroute_server::ingest::spec::WorkerFlavor;

/// The endpoints-file flags of `kvroute serve`.
#[derive(Debug, Args)]
pub struct EndpointsArgs {
    /// A file of workers in llm-d's `endpoints.yaml` shape (`endpoints:` a
    /// list of `name`, `namespace`, `address`, `port`, `labels`), read at
    /// start and again whenever it changes: workers gone from it are
    /// removed, new ones added. Labels `kvroute.io/events-port`,
    /// `kvroute.io/replay-port`, `kvroute.io/flavor`, `kvroute.io/dp-size`,
    /// `kvroute.io/role` (or `llm-d.ai/role`), `kvroute.io/bootstrap-port`,
    /// `kvroute.io/block-size` and `kvroute.io/model` complete each entry.
    /// A file that cannot be read or parsed changes nothing (docs/serving.md)
    #[arg(long, value_name = "FILE", env = "KVROUTE_ENDPOINTS_FILE")]
    endpoints_file: Option<PathBuf>,
    /// The KV-event port of endpoints whose labels name none.
    #[arg(long, default_value_t = EndpointDefaults::default().events_port, env = "KVROUTE_ENDPOINTS_EVENTS_PORT")]
    endpoints_events_port: u16,
    /// The replay port of endpoints whose labels name none (default: none).
    #[arg(long, env = "KVROUTE_ENDPOINTS_REPLAY_PORT")]
    endpoints_replay_port: Option<u16>,
    /// The engine of endpoints whose labels name none: vllm or sglang.
    #[arg(long, default_value_t = EndpointDefaults::default().flavor, env = "KVROUTE_ENDPOINTS_FLAVOR")]
    endpoints_flavor: WorkerFlavor,
    /// How often the file's size and modification time are checked, in ms.
    #[arg(long, default_value_t = FileDiscovery::DEFAULT_EVERY.as_millis() as u64, value_parser = clap::value_parser!(u64).range(50..=3_600_000), env = "KVROUTE_ENDPOINTS_POLL_MS")]
    endpoints_poll_ms: u64,
}

impl EndpointsArgs {
    /// The file discovery these flags ask for, if any.
    pub fn discovery(&self) -> Option<FileDiscovery> {
        let path = self.endpoints_file.clone()?;
        Some(FileDiscovery {
            path,
            every: Duration::from_millis(self.endpoints_poll_ms),
            defaults: EndpointDefaults {
                events_port: self.endpoints_events_port,
                replay_port: self.endpoints_replay_port,
                flavor: self.endpoints_flavor,
            },
        })
    }
}
