//! An InferencePool's members as its watches report them: the pool's spec,
//! each serving pod's workers, and a relist under way. Pure: the watch
//! events' objects (JSON) in, the whole set of workers out; the watches
//! themselves are in `discovery::kubernetes` (feature `kube`).
//!
//! A watch that restarts lists every pod again (`Init`, `InitApply`…,
//! `InitDone`): the pods listed then replace those known before at once,
//! so a pod deleted while the watch was down is removed, and the workers
//! do not drop to none while the list arrives.

use std::collections::BTreeMap;

use serde_json::Value;

use super::endpoints::EndpointDefaults;
use super::pool::{pod_workers, PodFacts, PoolError, PoolSpec, MAX_POOL_WORKERS};
use crate::ingest::spec::WorkerSpec;

/// The pool's spec and its serving pods' workers.
#[derive(Debug, Clone)]
pub struct PoolMembers {
    defaults: EndpointDefaults,
    default_block_size: Option<u32>,
    /// The pool's spec, while the pool exists.
    spec: Option<PoolSpec>,
    /// The workers of each pod that has some, by `namespace/name`.
    pods: BTreeMap<String, Vec<WorkerSpec>>,
    /// The pods listed so far by a relist under way.
    relist: Option<BTreeMap<String, Vec<WorkerSpec>>>,
    /// The problem last reported for each pod, so that it is reported once.
    problems: BTreeMap<String, String>,
}

impl PoolMembers {
    /// No pool known yet; `defaults` and `default_block_size` complete its pods.
    pub fn new(defaults: EndpointDefaults, default_block_size: Option<u32>) -> Self {
        PoolMembers {
            defaults,
            default_block_size,
            spec: None,
            pods: BTreeMap::new(),
            relist: None,
            problems: BTreeMap::new(),
        }
    }

    /// The pool's spec, while the pool exists.
    pub fn spec(&self) -> Option<&PoolSpec> {
        self.spec.as_ref()
    }

    /// The pool as the API now has it. True when its spec changed: its pods
    /// must then be listed again (with the new selector and ports); until
    /// that list is done, the workers known stay.
    pub fn set_pool(&mut self, object: &Value) -> Result<bool, PoolError> {
        let spec = PoolSpec::from_json(object)?;
        if self.spec.as_ref() == Some(&spec) {
            return Ok(false);
        }
        self.spec = Some(spec);
        Ok(true)
    }

    /// The pool is gone: it has no workers until it comes back.
    pub fn clear_pool(&mut self) {
        self.spec = None;
        self.pods.clear();
        self.relist = None;
        self.problems.clear();
    }

    /// A relist of the pods begins.
    pub fn relist_begin(&mut self) {
        self.relist = Some(BTreeMap::new());
    }

    /// A pod of the relist under way; a problem new for this pod is
    /// returned (the pod is then left out).
    pub fn pod_listed(&mut self, object: &Value) -> Option<String> {
        let (key, workers) = match self.read(object) {
            Ok(read) => read,
            Err((key, problem)) => return self.problem(key, problem),
        };
        let listed = self.relist.get_or_insert_with(BTreeMap::new);
        if !workers.is_empty() {
            listed.insert(key, workers);
        }
        None
    }

    /// The relist is done: the pods it listed are the pool's pods.
    pub fn relist_done(&mut self) {
        let listed = self.relist.take().unwrap_or_default();
        self.problems.retain(|key, _| listed.contains_key(key));
        self.pods = listed;
    }

    /// A pod was added or changed; a problem new for this pod is returned
    /// (the pod is then left out).
    pub fn pod_changed(&mut self, object: &Value) -> Option<String> {
        match self.read(object) {
            Ok((key, workers)) if workers.is_empty() => {
                self.pods.remove(&key);
                None
            }
            Ok((key, workers)) => {
                self.problems.remove(&key);
                self.pods.insert(key, workers);
                None
            }
            Err((key, problem)) => {
                if let Some(key) = &key {
                    self.pods.remove(key);
                }
                self.problem(key, problem)
            }
        }
    }

    /// A pod was deleted.
    pub fn pod_deleted(&mut self, object: &Value) {
        if let Ok(facts) = PodFacts::from_json(object) {
            let key = facts.key();
            self.pods.remove(&key);
            self.problems.remove(&key);
        }
    }

    /// Every worker of the pool's pods, by name; past [`MAX_POOL_WORKERS`],
    /// the first ones by name and the problem.
    pub fn desired(&self) -> (BTreeMap<String, WorkerSpec>, Option<String>) {
        let mut desired = BTreeMap::new();
        let total: usize = self.pods.values().map(Vec::len).sum();
        for spec in self.pods.values().flatten().take(MAX_POOL_WORKERS) {
            desired.insert(spec.name.clone(), spec.clone());
        }
        let problem = (total > MAX_POOL_WORKERS).then(|| {
            format!("the pool's pods give {total} workers; the first {MAX_POOL_WORKERS} are used")
        });
        (desired, problem)
    }

    /// A pod's key and workers (none while it does not serve), or its key
    /// (when it has one) and the problem.
    #[allow(clippy::type_complexity)]
    fn read(
        &self,
        object: &Value,
    ) -> Result<(String, Vec<WorkerSpec>), (Option<String>, PoolError)> {
        let facts = PodFacts::from_json(object).map_err(|e| (None, e))?;
        let key = facts.key();
        let Some(spec) = &self.spec else {
            return Ok((key, Vec::new()));
        };
        match pod_workers(&facts, spec, &self.defaults, self.default_block_size) {
            Ok(workers) => Ok((key, workers)),
            Err(e) => Err((Some(key), e)),
        }
    }

    /// Remembers a pod's problem; returns it unless it was reported last
    /// for this pod.
    fn problem(&mut self, key: Option<String>, problem: PoolError) -> Option<String> {
        let Some(key) = key else {
            return Some(problem.0);
        };
        if self.problems.get(&key) == Some(&problem.0) {
            return None;
        }
        self.problems.insert(key, problem.0.clone());
        Some(problem.0)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn pool(ports: &[u16]) -> Value {
        let ports: Vec<Value> = ports.iter().map(|p| json!({"number": p})).collect();
        json!({
            "apiVersion": "inference.networking.k8s.io/v1",
            "kind": "InferencePool",
            "metadata": {"name": "llama", "namespace": "ns"},
            "spec": {"selector": {"matchLabels": {"app": "llama"}}, "targetPorts": ports}
        })
    }

    fn pod(name: &str, ip: &str, ready: bool) -> Value {
        json!({
            "metadata": {"name": name, "namespace": "ns", "labels": {"app": "llama"}},
            "status": {"podIP": ip, "conditions": [{"type": "Ready", "status": if ready {"True"} else {"False"}}]}
        })
    }

    fn names(members: &PoolMembers) -> Vec<String> {
        members.desired().0.into_keys().collect()
    }

    #[test]
    fn a_relist_replaces_the_pods_and_events_follow_them() {
        let mut m = PoolMembers::new(EndpointDefaults::default(), None);
        assert_eq!(m.set_pool(&pool(&[8000])), Ok(true));
        assert_eq!(m.set_pool(&pool(&[8000])), Ok(false), "the same spec");
        m.relist_begin();
        assert_eq!(m.pod_listed(&pod("a", "10.0.0.1", true)), None);
        assert_eq!(m.pod_listed(&pod("b", "10.0.0.2", true)), None);
        assert_eq!(m.pod_listed(&pod("c", "10.0.0.3", false)), None);
        assert!(names(&m).is_empty(), "nothing until the list is done");
        m.relist_done();
        assert_eq!(names(&m), ["ns/a", "ns/b"]);
        m.pod_changed(&pod("c", "10.0.0.3", true));
        m.pod_changed(&pod("a", "10.0.0.1", false));
        m.pod_deleted(&pod("b", "10.0.0.2", true));
        assert_eq!(names(&m), ["ns/c"]);
        // A restarted watch lists d only: c went while it was down.
        m.relist_begin();
        m.pod_listed(&pod("d", "10.0.0.4", true));
        assert_eq!(names(&m), ["ns/c"], "the known pods stay during a relist");
        m.relist_done();
        assert_eq!(names(&m), ["ns/d"]);
        // Two ports now: listed again, one worker per port.
        assert_eq!(m.set_pool(&pool(&[8000, 8001])), Ok(true));
        m.relist_begin();
        m.pod_listed(&pod("d", "10.0.0.4", true));
        m.relist_done();
        assert_eq!(names(&m), ["ns/d:8000", "ns/d:8001"]);
        m.clear_pool();
        assert!(names(&m).is_empty() && m.spec().is_none());
    }

    #[test]
    fn a_bad_pod_is_left_out_and_reported_once() {
        let mut m = PoolMembers::new(EndpointDefaults::default(), None);
        m.set_pool(&pool(&[8000])).expect("valid");
        m.relist_begin();
        m.pod_listed(&pod("a", "10.0.0.1", true));
        m.relist_done();
        let mut bad = pod("a", "10.0.0.1", true);
        bad["metadata"]["annotations"] = json!({"kvroute.io/events-port": "many"});
        let problem = m.pod_changed(&bad).expect("reported");
        assert!(
            problem.contains("ns/a") && problem.contains("not a port"),
            "{problem}"
        );
        assert!(names(&m).is_empty(), "left out");
        assert_eq!(m.pod_changed(&bad), None, "reported once");
        m.pod_changed(&pod("a", "10.0.0.1", true));
        assert_eq!(names(&m), ["ns/a"]);
        assert!(
            m.pod_changed(&bad).is_some(),
            "reported again after a good spell"
        );
        assert!(m.pod_changed(&json!({"metadata": {}})).is_some());
        assert!(m.set_pool(&json!({"spec": {}})).is_err());
        assert_eq!(m.spec().map(|s| s.target_ports.clone()), Some(vec![8000]));
    }
}
