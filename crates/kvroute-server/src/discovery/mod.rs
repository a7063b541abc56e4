//! Workers found without being registered one by one: an endpoints file in
//! llm-d's `endpoints.yaml` shape ([`endpoints`]), read at start and again
//! whenever it changes, so that a deployment tool (or a Kubernetes
//! ConfigMap) can add and remove engines with nothing but a file.
//!
//! The watcher polls the file's size and modification time (a ConfigMap
//! update swaps a symlink, which file-event watchers miss); a change is
//! parsed off the runtime and applied as a difference: workers gone from
//! the file are unregistered, new ones registered, changed ones registered
//! again. A file that cannot be read or parsed changes nothing: the
//! workers it gave before keep serving, the error is counted and logged
//! once until it changes.

pub mod endpoints;

use std::collections::BTreeMap;
use std::io::Read as _;
use std::path::PathBuf;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, SystemTime};

use prometheus_client::collector::Collector;
use prometheus_client::encoding::DescriptorEncoder;
use tracing::{info, warn};

use crate::ingest::registry::Registry;
use crate::ingest::spec::WorkerSpec;
use crate::metrics::catalogue::{DISCOVERY_ENDPOINTS, DISCOVERY_ERRORS, DISCOVERY_RELOADS};
use crate::metrics::encode_single;
use crate::proxy::Proxy;
pub use endpoints::{EndpointDefaults, EndpointsError};

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

/// The file watcher's counts, shared with `/metrics`; clones count into
/// the same figures.
#[derive(Debug, Clone, Default)]
pub struct DiscoveryCounters {
    reloads: Arc<AtomicU64>,
    errors: Arc<AtomicU64>,
    endpoints: Arc<AtomicU64>,
}

/// [`DISCOVERY_RELOADS`], [`DISCOVERY_ERRORS`] and [`DISCOVERY_ENDPOINTS`].
impl Collector for DiscoveryCounters {
    fn encode(&self, mut encoder: DescriptorEncoder) -> Result<(), std::fmt::Error> {
        for (info, value) in [
            (DISCOVERY_RELOADS, &self.reloads),
            (DISCOVERY_ERRORS, &self.errors),
            (DISCOVERY_ENDPOINTS, &self.endpoints),
        ] {
            encode_single(&mut encoder, &info, value.load(Ordering::Relaxed))?;
        }
        Ok(())
    }
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
            config,
            registry,
            proxy,
            default_block_size,
            counters,
            current: BTreeMap::new(),
            seen: None,
            last_error: None,
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
    registry: Arc<Registry>,
    proxy: Arc<Proxy>,
    default_block_size: Option<u32>,
    counters: DiscoveryCounters,
    /// The workers registered from the file, as registered.
    current: BTreeMap<String, WorkerSpec>,
    /// The file as last read.
    seen: Option<Stamp>,
    /// The last problem logged, so that it is logged once.
    last_error: Option<String>,
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
            Err(problem) => return self.failed(problem),
        };
        self.seen = Some(stamp);
        match self.read() {
            Ok(desired) => self.apply(desired),
            Err(problem) => self.failed(problem),
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

    /// Makes the registered workers the file's.
    fn apply(&mut self, desired: BTreeMap<String, WorkerSpec>) {
        let gone: Vec<String> = self
            .current
            .keys()
            .filter(|name| !desired.contains_key(*name))
            .cloned()
            .collect();
        for name in gone {
            self.registry.unregister(&name);
            self.current.remove(&name);
            info!(worker = %name, "removed: no longer in the endpoints file");
        }
        let mut refused = 0;
        for (name, spec) in desired {
            if self.current.get(&name) == Some(&spec) {
                continue;
            }
            if self.current.remove(&name).is_some() {
                self.registry.unregister(&name);
            }
            match self.registry.register(spec.clone()) {
                Ok(_) => {
                    info!(worker = %name, url = %spec.url, "registered from the endpoints file");
                    self.current.insert(name, spec);
                }
                Err(e) => {
                    refused += 1;
                    warn!(worker = %name, error = %e, "an endpoint of the endpoints file was refused");
                }
            }
        }
        self.proxy.refresh(&self.registry);
        self.counters.reloads.fetch_add(1, Ordering::Relaxed);
        self.counters.errors.fetch_add(refused, Ordering::Relaxed);
        self.counters
            .endpoints
            .store(self.current.len() as u64, Ordering::Relaxed);
        self.last_error = None;
    }

    /// Counts a failed read; logs it unless it is the one logged last.
    fn failed(&mut self, problem: String) {
        if self.last_error.as_ref() == Some(&problem) {
            return;
        }
        self.counters.errors.fetch_add(1, Ordering::Relaxed);
        warn!(problem = %problem, workers = self.current.len(), "the endpoints file was not applied; its workers so far stay");
        self.last_error = Some(problem);
    }
}
