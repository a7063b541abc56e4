//! Following an InferencePool through the Kubernetes API (feature `kube`):
//! a watch on the pool (by name) and, while it exists, a watch on the pods
//! its selector names, in its namespace. Each event goes to the pure
//! [`PoolMembers`]; each change of the workers they give goes to the
//! [`Applier`], as for an endpoints file.
//!
//! Pods, not EndpointSlices: an InferencePool is not a Service, so nothing
//! makes EndpointSlices for its selector; its pods carry the annotations
//! (events and replay ports, engine, role) that slices do not; and GIE's
//! endpoint pickers watch pods too. Both watches are kube-rs `watcher`s:
//! they list, then watch from the list's version, watch again when a watch
//! ends, list again when the version expired (a relist replaces the pods at
//! once), and back off (0.8 s doubling to 30 s) after an error, which is
//! counted and logged once.

use std::sync::{Arc, Mutex, PoisonError};

use futures_util::stream::BoxStream;
use futures_util::StreamExt as _;
use k8s_openapi::api::core::v1::Pod;
use kube::api::{ApiResource, DynamicObject};
use kube::config::{KubeConfigOptions, Kubeconfig};
use kube::runtime::watcher::{self, Event};
use kube::runtime::WatchStreamExt as _;
use kube::{Api, Client, Config};
use serde::Serialize;
use serde_json::Value;
use tracing::{info, warn};

use super::members::PoolMembers;
use super::pool::{PoolDiscovery, PoolSpec, POOL_GROUP, POOL_KIND, POOL_PLURAL, POOL_VERSION};
use super::{Applier, DiscoveryCounters, DiscoveryError};
use crate::ingest::registry::Registry;
use crate::router::Router;

/// The API client `config` asks for: its kubeconfig file, else kube-rs's
/// inference (`KUBECONFIG`, `~/.kube/config`, then the pod's service account).
async fn client(config: &PoolDiscovery) -> Result<Client, DiscoveryError> {
    let failed = |e: &dyn std::fmt::Display| DiscoveryError(format!("--inference-pool: {e}"));
    let kube_config = match &config.kubeconfig {
        Some(path) => {
            let file = Kubeconfig::read_from(path)
                .map_err(|e| failed(&format!("reading {}: {e}", path.display())))?;
            Config::from_custom_kubeconfig(file, &KubeConfigOptions::default())
                .await
                .map_err(|e| failed(&format!("{}: {e}", path.display())))?
        }
        None => Config::infer().await.map_err(|e| {
            failed(&format!(
                "no Kubernetes API to reach (in a pod: its service account; outside: --kubeconfig): {e}"
            ))
        })?,
    };
    Client::try_from(kube_config).map_err(|e| failed(&e))
}

/// Reaches the API server (failing at once when it cannot be configured),
/// then follows the pool for as long as the task runs.
pub(super) async fn spawn(
    config: PoolDiscovery,
    (registry, router): (Arc<Registry>, Arc<Router>),
    default_block_size: Option<u32>,
    counters: DiscoveryCounters,
) -> Result<tokio::task::JoinHandle<()>, DiscoveryError> {
    let client = client(&config).await?;
    let namespace = match &config.pool.namespace {
        Some(ns) => ns.clone(),
        None => client.default_namespace().to_owned(),
    };
    info!(pool = %format!("{namespace}/{}", config.pool.name), "following the InferencePool's pods");
    let follower = Follower {
        applier: Arc::new(Mutex::new(Applier::new(
            registry,
            router,
            counters,
            "the InferencePool",
        ))),
        members: PoolMembers::new(config.defaults.clone(), default_block_size),
        client,
        namespace,
        name: config.pool.name,
        pool_seen: false,
    };
    Ok(tokio::spawn(follower.run()))
}

/// The pod watch's events.
type PodEvents = BoxStream<'static, Result<Event<Pod>, watcher::Error>>;

/// One pool followed.
struct Follower {
    applier: Arc<Mutex<Applier>>,
    members: PoolMembers,
    client: Client,
    namespace: String,
    name: String,
    /// Whether the pool watch's list under way has shown the pool.
    pool_seen: bool,
}

/// An object as the JSON the API sent (kube-rs read it into its type).
fn json(object: &impl Serialize) -> Value {
    serde_json::to_value(object).unwrap_or(Value::Null)
}

impl Follower {
    /// Watches the pool and its pods until the task is dropped.
    async fn run(mut self) {
        let resource = ApiResource {
            group: POOL_GROUP.to_owned(),
            version: POOL_VERSION.to_owned(),
            api_version: format!("{POOL_GROUP}/{POOL_VERSION}"),
            kind: POOL_KIND.to_owned(),
            plural: POOL_PLURAL.to_owned(),
        };
        let pools: Api<DynamicObject> =
            Api::namespaced_with(self.client.clone(), &self.namespace, &resource);
        let by_name = watcher::Config::default().fields(&format!("metadata.name={}", self.name));
        let mut pool_events = watcher::watcher(pools, by_name).default_backoff().boxed();
        let mut pod_events: Option<PodEvents> = None;
        loop {
            let changed = tokio::select! {
                event = pool_events.next() => match event {
                    Some(event) => self.pool_event(event, &mut pod_events),
                    None => return,
                },
                Some(event) = next_pod(&mut pod_events) => self.pod_event(event),
            };
            if changed {
                self.apply().await;
            }
        }
    }

    /// A pool event; true when the workers may have changed.
    fn pool_event(
        &mut self,
        event: Result<Event<DynamicObject>, watcher::Error>,
        pods: &mut Option<PodEvents>,
    ) -> bool {
        match event {
            Ok(Event::Init) => {
                self.pool_seen = false;
                false
            }
            Ok(Event::InitApply(pool) | Event::Apply(pool)) => {
                self.pool_seen = true;
                match self.members.set_pool(&json(&pool)) {
                    Ok(true) => {
                        if let Some(spec) = self.members.spec() {
                            info!(selector = %spec.label_selector(), ports = ?spec.target_ports, "the InferencePool's spec");
                            *pods = Some(self.watch_pods(spec));
                        }
                    }
                    Ok(false) => {}
                    Err(e) => self.failed(format!("the InferencePool {}: {e}", self.target())),
                }
                false
            }
            Ok(Event::InitDone) if self.pool_seen => false,
            Ok(Event::InitDone | Event::Delete(_)) => {
                *pods = None;
                self.members.clear_pool();
                self.failed(format!(
                    "the InferencePool {} does not exist (waiting for it)",
                    self.target()
                ));
                true
            }
            Err(e) => {
                self.failed(format!("watching the InferencePool {}: {e}", self.target()));
                false
            }
        }
    }

    /// A pod event; true when the workers may have changed.
    fn pod_event(&mut self, event: Result<Event<Pod>, watcher::Error>) -> bool {
        let problem = match event {
            Ok(Event::Init) => {
                self.members.relist_begin();
                return false;
            }
            Ok(Event::InitApply(pod)) => {
                if let Some(problem) = self.members.pod_listed(&json(&pod)) {
                    self.failed(problem);
                }
                return false;
            }
            Ok(Event::InitDone) => {
                self.members.relist_done();
                return true;
            }
            Ok(Event::Apply(pod)) => self.members.pod_changed(&json(&pod)),
            Ok(Event::Delete(pod)) => {
                self.members.pod_deleted(&json(&pod));
                None
            }
            Err(e) => Some(format!("watching the pods of {}: {e}", self.target())),
        };
        if let Some(problem) = problem {
            self.failed(problem);
        }
        true
    }

    /// `namespace/name`.
    fn target(&self) -> String {
        format!("{}/{}", self.namespace, self.name)
    }

    /// The pods of the pool's selector, watched.
    fn watch_pods(&self, spec: &PoolSpec) -> PodEvents {
        let pods: Api<Pod> = Api::namespaced(self.client.clone(), &self.namespace);
        let selected = watcher::Config::default().labels(&spec.label_selector());
        watcher::watcher(pods, selected).default_backoff().boxed()
    }

    fn failed(&self, problem: String) {
        self.applier
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .failed(problem);
    }

    /// Applies the members' workers when they differ from those registered,
    /// off the runtime (registering may block).
    async fn apply(&self) {
        let (desired, problem) = self.members.desired();
        let applier = self.applier.clone();
        let applied = tokio::task::spawn_blocking(move || {
            let mut applier = applier.lock().unwrap_or_else(PoisonError::into_inner);
            if applier.current() != &desired {
                applier.apply(desired);
            }
            if let Some(problem) = problem {
                applier.failed(problem);
            }
        })
        .await;
        if let Err(e) = applied {
            warn!(error = %e, "applying the InferencePool's workers failed");
        }
    }
}

/// The next pod event, or never while no pod watch runs.
async fn next_pod(pods: &mut Option<PodEvents>) -> Option<Result<Event<Pod>, watcher::Error>> {
    match pods {
        Some(events) => events.next().await,
        None => std::future::pending().await,
    }
}
