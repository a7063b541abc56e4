//! Workers found without being registered one by one, from one of two
//! sources:
//!
//! * an endpoints file in llm-d's `endpoints.yaml` shape ([`endpoints`],
//!   watched by [`mod@file`]), read at start and again whenever it changes, so
//!   that a deployment tool (or a Kubernetes ConfigMap) can add and remove
//!   engines with nothing but a file;
//! * a Gateway API Inference Extension `InferencePool` (feature `kube`):
//!   its ready pods, followed through the Kubernetes API's watches
//!   (`kubernetes`), each read into workers by the pure [`pool`] and
//!   gathered by the pure [`members`].
//!
//! Both hand their whole set of workers to one [`Applier`], which applies
//! it as a difference: workers gone from the set are unregistered, new ones
//! registered, changed ones registered again; then the router is refreshed
//! and `kvroute_discovery_*` counted. A source that cannot be read changes
//! nothing: the workers it gave before keep serving, and the problem is
//! counted and logged once until it changes.

pub mod bounded_yaml;
pub mod endpoints;
pub mod file;
#[cfg(feature = "kube")]
mod kubernetes;
pub mod members;
pub mod pool;

use std::collections::BTreeMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;

use prometheus_client::collector::Collector;
use prometheus_client::encoding::DescriptorEncoder;
use tracing::{info, warn};

use crate::ingest::registry::Registry;
use crate::ingest::spec::WorkerSpec;
use crate::metrics::catalogue::{DISCOVERY_ENDPOINTS, DISCOVERY_ERRORS, DISCOVERY_RELOADS};
use crate::metrics::encode_single;
use crate::router::Router;
pub use endpoints::{EndpointDefaults, EndpointsError};
pub use file::{spawn, FileDiscovery};
pub use pool::{PoolDiscovery, PoolError, PoolRef};

/// Where discovered workers come from (`serve --endpoints-file` or
/// `serve --inference-pool`).
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Discovery {
    /// An endpoints file.
    File(FileDiscovery),
    /// An InferencePool's pods, through the Kubernetes API.
    #[cfg(feature = "kube")]
    Pool(PoolDiscovery),
}

impl From<FileDiscovery> for Discovery {
    fn from(file: FileDiscovery) -> Self {
        Discovery::File(file)
    }
}

/// Why discovery could not start (for a pool: no way to reach the API
/// server, or a kubeconfig that does not read).
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{0}")]
pub struct DiscoveryError(pub String);

/// Starts following `source`; its workers are registered in the registry
/// and routed to by the router of `watched` as they come and go, and
/// counted in `counters`.
pub async fn start(
    source: Discovery,
    watched: (Arc<Registry>, Arc<Router>),
    default_block_size: Option<u32>,
    counters: DiscoveryCounters,
) -> Result<tokio::task::JoinHandle<()>, DiscoveryError> {
    match source {
        Discovery::File(file) => Ok(spawn(file, watched, default_block_size, counters)),
        #[cfg(feature = "kube")]
        Discovery::Pool(pool) => {
            kubernetes::spawn(pool, watched, default_block_size, counters).await
        }
    }
}

/// The discovery source's counts, shared with `/metrics`; clones count
/// into the same figures.
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

/// Makes the registered workers of one source the set it last gave: the
/// part both sources share. Its calls may block (registering starts
/// ingestion; unregistering drops a worker's blocks from the index): call
/// them off the async runtime.
pub struct Applier {
    registry: Arc<Registry>,
    router: Arc<Router>,
    counters: DiscoveryCounters,
    /// The source, as logs name it ("the endpoints file").
    source: &'static str,
    /// The workers registered from the source, as registered.
    current: BTreeMap<String, WorkerSpec>,
    /// The last problem logged, so that it is logged once.
    last_error: Option<String>,
}

impl Applier {
    /// An applier that has registered nothing yet; `source` names the
    /// source in its logs.
    pub fn new(
        registry: Arc<Registry>,
        router: Arc<Router>,
        counters: DiscoveryCounters,
        source: &'static str,
    ) -> Self {
        Applier {
            registry,
            router,
            counters,
            source,
            current: BTreeMap::new(),
            last_error: None,
        }
    }

    /// The workers registered from the source now.
    pub fn current(&self) -> &BTreeMap<String, WorkerSpec> {
        &self.current
    }

    /// Makes the registered workers `desired`: unregisters those gone,
    /// registers new and changed ones (a refused one is counted as an
    /// error), refreshes the router and counts a reload.
    pub fn apply(&mut self, desired: BTreeMap<String, WorkerSpec>) {
        let source = self.source;
        let gone: Vec<String> = self
            .current
            .keys()
            .filter(|name| !desired.contains_key(*name))
            .cloned()
            .collect();
        for name in gone {
            self.registry.unregister(&name);
            self.current.remove(&name);
            info!(worker = %name, "removed: no longer in {source}");
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
                    info!(worker = %name, url = %spec.url, "registered from {source}");
                    self.current.insert(name, spec);
                }
                Err(e) => {
                    refused += 1;
                    warn!(worker = %name, error = %e, "a worker of {source} was refused");
                }
            }
        }
        self.router.refresh(&self.registry);
        self.counters.reloads.fetch_add(1, Ordering::Relaxed);
        self.counters.errors.fetch_add(refused, Ordering::Relaxed);
        self.counters
            .endpoints
            .store(self.current.len() as u64, Ordering::Relaxed);
        self.last_error = None;
    }

    /// Counts a problem that changed nothing; logs it unless it is the one
    /// logged last.
    pub fn failed(&mut self, problem: String) {
        if self.last_error.as_ref() == Some(&problem) {
            return;
        }
        self.counters.errors.fetch_add(1, Ordering::Relaxed);
        warn!(problem = %problem, workers = self.current.len(), "{} was not applied; its workers so far stay", self.source);
        self.last_error = Some(problem);
    }
}
