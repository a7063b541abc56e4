//! The endpoints-file watcher: polls the file's size and modification time
//! (a ConfigMap update swaps a symlink, which file-event watchers miss),
//! parses a changed file off the runtime and hands its workers to the
//! [`Applier`]. A file that cannot be read or parsed changes nothing.

use std::collections::BTreeMap;
use std::io::Read as _;
use std::path::PathBuf;
use std::sync::Arc;
use std::time::{Duration, SystemTime};

use tracing::warn;

use super::endpoints::{self, EndpointDefaults};
use super::{Applier, DiscoveryCounters};
use crate::ingest::registry::Registry;
use crate::ingest::spec::WorkerSpec;
use crate::proxy::Proxy;

/// `--endpoints-file` and what completes its entries.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct FileDiscovery {
    /// The file.
    pub path: PathBuf,
    /// How often its size and modification time are checked.
    pub every: Duration,
    /// What an endpoint's labels do not say.
    pub defaults: EndpointDefaults,
}

impl FileDiscovery {
    /// How often the file is checked unless told otherwise.
    pub const DEFAULT_EVERY: Duration = Duration::from_secs(1);
}

/// The file's identity between two looks: a change in either is a change.
type Stamp = (u64, Option<SystemTime>);

/// Watches the file for as long as the task runs; the proxy routes to
/// the file's workers from the moment they are registered.
pub fn spawn(
    config: FileDiscovery,
    (registry, proxy): (Arc<Registry>, Arc<Proxy>),
    default_block_size: Option<u32>,
    counters: DiscoveryCounters,
) -> tokio::task::JoinHandle<()> {
    tokio::spawn(async move {
        let mut watcher = Watcher {
            applier: Applier::new(registry, proxy, counters, "the endpoints file"),
            config,
            default_block_size,
            seen: None,
        };
        let mut tick = tokio::time::interval(watcher.config.every);
        loop {
            tick.tick().await;
            watcher = match tokio::task::spawn_blocking(move || {
                watcher.look();
                watcher
            })
            .await
            {
                Ok(w) => w,
                Err(e) => {
                    warn!(error = %e, "the endpoints-file watcher stopped");
                    return;
                }
            };
        }
    })
}

/// The watcher's state between looks.
struct Watcher {
    config: FileDiscovery,
    default_block_size: Option<u32>,
    /// The file's workers as registered, and the counts.
    applier: Applier,
    /// The file as last read.
    seen: Option<Stamp>,
}

impl Watcher {
    /// Reads and applies the file when it changed since the last look.
    fn look(&mut self) {
        let stamp = std::fs::metadata(&self.config.path)
            .map(|m| (m.len(), m.modified().ok()))
            .map_err(|e| format!("reading {}: {e}", self.config.path.display()));
        let stamp = match stamp {
            Ok(stamp) if Some(stamp) == self.seen => return,
            Ok(stamp) => stamp,
            Err(problem) => return self.applier.failed(problem),
        };
        self.seen = Some(stamp);
        match self.read() {
            Ok(desired) => self.applier.apply(desired),
            Err(problem) => self.applier.failed(problem),
        }
    }

    /// The file's workers.
    fn read(&self) -> Result<BTreeMap<String, WorkerSpec>, String> {
        let path = &self.config.path;
        let file =
            std::fs::File::open(path).map_err(|e| format!("reading {}: {e}", path.display()))?;
        let mut text = String::new();
        file.take(endpoints::MAX_FILE_BYTES as u64 + 1)
            .read_to_string(&mut text)
            .map_err(|e| format!("reading {}: {e}", path.display()))?;
        endpoints::parse_endpoints(&text, &self.config.defaults, self.default_block_size)
            .map_err(|e| format!("{}: {e}", path.display()))
    }
}
