//! An InferencePool's pods as workers. Pure: the Gateway API Inference
//! Extension's `InferencePool` (group `inference.networking.k8s.io`, v1) and
//! Pods, as JSON in the shape the Kubernetes API returns them, in; worker
//! specs out. The watches that feed it are in `discovery::kubernetes`
//! (feature `kube`).
//!
//! A pool names its pods by `spec.selector.matchLabels` (in its own
//! namespace) and their serving ports by `spec.targetPorts[].number`. Each
//! ready pod with an IP becomes one worker per target port, named
//! `namespace/pod` (`namespace/pod:port` when the pool has several ports),
//! at `http://IP:port`. What else a worker needs comes from the pod's
//! annotations, or its labels of the same name, as an endpoints file's
//! labels give it: `kvroute.io/events-port`, `kvroute.io/replay-port`,
//! `kvroute.io/flavor` (else llm-d's `llm-d.ai/engine-type` when it says
//! `vllm` or `sglang`), `kvroute.io/dp-size`, `kvroute.io/role` (else
//! `llm-d.ai/role`), `kvroute.io/bootstrap-port`, `kvroute.io/block-size`,
//! `kvroute.io/model`; the serve flags' defaults complete the rest. The
//! i-th target port's events and replay ports are shifted by i × dp-size,
//! as vLLM shifts a data-parallel rank's.

use std::collections::BTreeMap;
use std::fmt;
use std::net::IpAddr;
use std::path::PathBuf;
use std::str::FromStr;

use serde_json::Value;

use super::endpoints::{worker_spec, EndpointDefaults, Engine};
use crate::ingest::spec::WorkerSpec;

/// The InferencePool's API group.
pub const POOL_GROUP: &str = "inference.networking.k8s.io";
/// The InferencePool's API version read.
pub const POOL_VERSION: &str = "v1";
/// The InferencePool's kind.
pub const POOL_KIND: &str = "InferencePool";
/// The InferencePool's resource name in API paths.
pub const POOL_PLURAL: &str = "inferencepools";

/// The most target ports a pool may list (GIE's own limit).
pub const MAX_TARGET_PORTS: usize = 8;
/// The most `matchLabels` a pool's selector may hold (GIE's own limit).
pub const MAX_MATCH_LABELS: usize = 64;
/// The most workers one pool may give, as for an endpoints file.
pub const MAX_POOL_WORKERS: usize = super::endpoints::MAX_ENDPOINTS;
/// The longest label key or value, annotation key, name or namespace read
/// (Kubernetes allows 253 for a prefixed key and 63 for a value).
const MAX_NAME: usize = 253;

/// Why a pool or a pod was not used (what it gave before stays, or the pod
/// is left out).
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{0}")]
pub struct PoolError(pub String);

fn bad(message: impl Into<String>) -> PoolError {
    PoolError(message.into())
}

/// `--inference-pool`: `NAMESPACE/NAME`, or `NAME` in the namespace the
/// client's configuration gives (in a cluster, the pod's own).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PoolRef {
    /// The pool's namespace, when given.
    pub namespace: Option<String>,
    /// The pool's name.
    pub name: String,
}

/// A DNS-1123 name, as namespaces and pool names are.
fn dns_name(text: &str, what: &str) -> Result<(), PoolError> {
    let ok = !text.is_empty()
        && text.len() <= MAX_NAME
        && text
            .chars()
            .all(|c| c.is_ascii_lowercase() || c.is_ascii_digit() || c == '-' || c == '.')
        && !text.starts_with(['-', '.'])
        && !text.ends_with(['-', '.']);
    if ok {
        Ok(())
    } else {
        Err(bad(format!(
            "{what} `{text}` is not a Kubernetes name (lower-case letters, digits, `-` and `.`)"
        )))
    }
}

impl FromStr for PoolRef {
    type Err = PoolError;

    fn from_str(text: &str) -> Result<Self, PoolError> {
        let (namespace, name) = match text.split_once('/') {
            Some((ns, name)) => (Some(ns), name),
            None => (None, text),
        };
        if let Some(ns) = namespace {
            dns_name(ns, "the namespace")?;
        }
        dns_name(name, "the pool name")?;
        Ok(PoolRef {
            namespace: namespace.map(str::to_owned),
            name: name.to_owned(),
        })
    }
}

impl fmt::Display for PoolRef {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match &self.namespace {
            Some(ns) => write!(f, "{ns}/{}", self.name),
            None => f.write_str(&self.name),
        }
    }
}

/// `--inference-pool` and what completes its pods.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PoolDiscovery {
    /// The pool followed.
    pub pool: PoolRef,
    /// A kubeconfig file to reach the API server with; without one, the
    /// in-cluster service account (or `KUBECONFIG`, or `~/.kube/config`).
    pub kubeconfig: Option<PathBuf>,
    /// What a pod's annotations and labels do not say.
    pub defaults: EndpointDefaults,
}

/// What kvroute reads of an InferencePool.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PoolSpec {
    /// `spec.selector.matchLabels`: a pod is in the pool when it carries
    /// every one of them.
    pub match_labels: BTreeMap<String, String>,
    /// `spec.targetPorts[].number`, in order.
    pub target_ports: Vec<u16>,
}

/// A JSON object of strings (labels, annotations), bounded.
fn strings(value: &Value, what: &str, max: usize) -> Result<BTreeMap<String, String>, PoolError> {
    let Some(map) = value.as_object() else {
        return match value {
            Value::Null => Ok(BTreeMap::new()),
            _ => Err(bad(format!("{what} is not an object"))),
        };
    };
    if map.len() > max {
        return Err(bad(format!("{what} has {} entries, over {max}", map.len())));
    }
    let mut out = BTreeMap::new();
    for (key, v) in map {
        let v = v
            .as_str()
            .ok_or_else(|| bad(format!("{what}[{key}] is not a string")))?;
        out.insert(key.clone(), v.to_owned());
    }
    Ok(out)
}

impl PoolSpec {
    /// The spec of an InferencePool object (`apiVersion`
    /// `inference.networking.k8s.io/v1`; GIE's older `x-k8s.io` versions
    /// have another shape and are refused).
    pub fn from_json(object: &Value) -> Result<Self, PoolError> {
        // A list's items may leave their apiVersion out; one given must be v1's.
        if let Some(version) = object["apiVersion"].as_str() {
            if version != format!("{POOL_GROUP}/{POOL_VERSION}") {
                return Err(bad(format!(
                    "apiVersion `{version}` is not {POOL_GROUP}/{POOL_VERSION}"
                )));
            }
        }
        let spec = &object["spec"];
        let match_labels = strings(
            &spec["selector"]["matchLabels"],
            "spec.selector.matchLabels",
            MAX_MATCH_LABELS,
        )?;
        if match_labels.is_empty() {
            return Err(bad(
                "spec.selector.matchLabels is empty: it would select every pod of the namespace",
            ));
        }
        if let Some((k, v)) = match_labels
            .iter()
            .find(|(k, v)| k.len() > MAX_NAME || v.len() > MAX_NAME)
        {
            return Err(bad(format!("the selector's label `{k}={v}` is too long")));
        }
        let ports = spec["targetPorts"]
            .as_array()
            .ok_or_else(|| bad("spec.targetPorts is missing"))?;
        if ports.is_empty() || ports.len() > MAX_TARGET_PORTS {
            return Err(bad(format!(
                "spec.targetPorts has {} ports; 1 to {MAX_TARGET_PORTS} are allowed",
                ports.len()
            )));
        }
        let mut target_ports = Vec::with_capacity(ports.len());
        for (i, port) in ports.iter().enumerate() {
            let number = port["number"]
                .as_u64()
                .and_then(|n| u16::try_from(n).ok())
                .filter(|&n| n > 0)
                .ok_or_else(|| bad(format!("spec.targetPorts[{i}].number is not a port")))?;
            if target_ports.contains(&number) {
                return Err(bad(format!("spec.targetPorts lists {number} twice")));
            }
            target_ports.push(number);
        }
        Ok(PoolSpec {
            match_labels,
            target_ports,
        })
    }

    /// The selector as the API's `labelSelector` parameter: `k=v,k2=v2`.
    pub fn label_selector(&self) -> String {
        let pairs: Vec<String> = self
            .match_labels
            .iter()
            .map(|(k, v)| format!("{k}={v}"))
            .collect();
        pairs.join(",")
    }

    /// Whether a pod with `labels` is in the pool.
    pub fn selects(&self, labels: &BTreeMap<String, String>) -> bool {
        self.match_labels
            .iter()
            .all(|(k, v)| labels.get(k) == Some(v))
    }
}

/// What kvroute reads of a Pod.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PodFacts {
    /// `metadata.namespace`.
    pub namespace: String,
    /// `metadata.name`.
    pub name: String,
    /// `metadata.labels`.
    pub labels: BTreeMap<String, String>,
    /// `metadata.annotations`.
    pub annotations: BTreeMap<String, String>,
    /// `status.podIP`, once the pod has one.
    pub ip: Option<IpAddr>,
    /// Whether its `Ready` condition is `True`.
    pub ready: bool,
    /// Whether it is being deleted (`metadata.deletionTimestamp`).
    pub deleting: bool,
}

/// The most annotations or labels read from one pod.
const MAX_POD_ENTRIES: usize = 512;

impl PodFacts {
    /// The facts of a Pod object.
    pub fn from_json(object: &Value) -> Result<Self, PoolError> {
        let meta = &object["metadata"];
        let text = |key: &str| meta[key].as_str().filter(|s| !s.is_empty());
        let name = text("name").ok_or_else(|| bad("a pod without metadata.name"))?;
        let namespace = text("namespace")
            .ok_or_else(|| bad(format!("pod {name} without metadata.namespace")))?;
        if name.len() > MAX_NAME || namespace.len() > MAX_NAME {
            return Err(bad(format!("pod {namespace}/{name}: the name is too long")));
        }
        let key = format!("{namespace}/{name}");
        let labels = strings(
            &meta["labels"],
            &format!("pod {key}: labels"),
            MAX_POD_ENTRIES,
        )?;
        let annotations = strings(
            &meta["annotations"],
            &format!("pod {key}: annotations"),
            MAX_POD_ENTRIES,
        )?;
        let status = &object["status"];
        let ip = match status["podIP"].as_str().filter(|s| !s.is_empty()) {
            None => None,
            Some(ip) => Some(
                ip.parse()
                    .map_err(|_| bad(format!("pod {key}: status.podIP `{ip}` is not an IP")))?,
            ),
        };
        let ready = status["conditions"].as_array().is_some_and(|conditions| {
            conditions
                .iter()
                .any(|c| c["type"] == "Ready" && c["status"] == "True")
        });
        Ok(PodFacts {
            namespace: namespace.to_owned(),
            name: name.to_owned(),
            labels,
            annotations,
            ip,
            ready,
            deleting: !meta["deletionTimestamp"].is_null(),
        })
    }

    /// `namespace/name`.
    pub fn key(&self) -> String {
        format!("{}/{}", self.namespace, self.name)
    }

    /// An annotation, else the label of the same name.
    fn setting(&self, key: &str) -> Option<String> {
        self.annotations
            .get(key)
            .or_else(|| self.labels.get(key))
            .cloned()
    }
}

/// The workers of `pod` in `pool`: none while it is not ready, has no IP,
/// is being deleted or is not selected by the pool; one per target port
/// otherwise. An annotation that does not make a worker spec is the error.
pub fn pod_workers(
    pod: &PodFacts,
    pool: &PoolSpec,
    defaults: &EndpointDefaults,
    default_block_size: Option<u32>,
) -> Result<Vec<WorkerSpec>, PoolError> {
    let Some(ip) = pod.ip else {
        return Ok(Vec::new());
    };
    if !pod.ready || pod.deleting || !pool.selects(&pod.labels) {
        return Ok(Vec::new());
    }
    let label = |key: &str| {
        pod.setting(key).or_else(|| {
            (key == "kvroute.io/flavor")
                .then(|| pod.setting("llm-d.ai/engine-type"))
                .flatten()
                .filter(|engine| engine == "vllm" || engine == "sglang")
        })
    };
    let several = pool.target_ports.len() > 1;
    let mut workers = Vec::with_capacity(pool.target_ports.len());
    for (index, &http) in (0u16..).zip(&pool.target_ports) {
        let name = match several {
            true => format!("{}:{http}", pod.key()),
            false => pod.key(),
        };
        let engine = Engine {
            name: &name,
            ip,
            http,
            index,
        };
        let spec = worker_spec(&engine, &label, defaults, default_block_size)
            .map_err(|e| bad(format!("pod {}: {e}", pod.key())))?;
        workers.push(spec);
    }
    Ok(workers)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::ingest::spec::{WorkerFlavor, WorkerRole};
    use serde_json::json;

    fn pool(ports: &[u16]) -> PoolSpec {
        let ports: Vec<Value> = ports.iter().map(|p| json!({"number": p})).collect();
        PoolSpec::from_json(&json!({
            "apiVersion": "inference.networking.k8s.io/v1",
            "kind": "InferencePool",
            "metadata": {"name": "llama", "namespace": "inference"},
            "spec": {
                "selector": {"matchLabels": {"app": "vllm-llama"}},
                "targetPorts": ports,
                "endpointPickerRef": {"name": "llama-epp", "port": {"number": 9002}}
            }
        }))
        .expect("a valid pool")
    }

    fn pod(name: &str, ready: bool, annotations: Value) -> Value {
        json!({
            "apiVersion": "v1",
            "kind": "Pod",
            "metadata": {
                "name": name,
                "namespace": "inference",
                "labels": {"app": "vllm-llama", "pod-template-hash": "7d9c"},
                "annotations": annotations,
            },
            "status": {
                "phase": "Running",
                "podIP": "10.4.0.7",
                "conditions": [
                    {"type": "Initialized", "status": "True"},
                    {"type": "Ready", "status": if ready { "True" } else { "False" }}
                ]
            }
        })
    }

    fn workers(object: &Value, pool: &PoolSpec) -> Result<Vec<WorkerSpec>, PoolError> {
        let facts = PodFacts::from_json(object)?;
        pod_workers(&facts, pool, &EndpointDefaults::default(), Some(16))
    }

    #[test]
    fn a_ready_pod_is_a_worker_completed_by_its_annotations_or_the_defaults() {
        let plain = workers(&pod("vllm-0", true, json!(null)), &pool(&[8000])).expect("valid");
        assert_eq!(plain.len(), 1);
        let w = &plain[0];
        assert_eq!(
            (w.name.as_str(), w.url.as_str()),
            ("inference/vllm-0", "http://10.4.0.7:8000")
        );
        assert_eq!(w.ranks[0].events, "tcp://10.4.0.7:5557");
        assert_eq!(
            (w.ranks[0].replay.clone(), w.flavor),
            (None, WorkerFlavor::Vllm)
        );
        let annotated = pod(
            "sgl-0",
            true,
            json!({
                "kvroute.io/events-port": "6000",
                "kvroute.io/replay-port": "7000",
                "kvroute.io/dp-size": "2",
                "kvroute.io/bootstrap-port": "8998",
                "kvroute.io/role": "prefill",
                "kvroute.io/model": "llama"
            }),
        );
        let mut annotated = annotated;
        annotated["metadata"]["labels"]["llm-d.ai/engine-type"] = json!("sglang");
        let s = &workers(&annotated, &pool(&[30000])).expect("valid")[0];
        assert_eq!(
            (s.flavor, s.role),
            (WorkerFlavor::Sglang, WorkerRole::Prefill)
        );
        assert_eq!(s.ranks.len(), 2);
        assert_eq!(s.ranks[1].events, "tcp://10.4.0.7:6001");
        assert_eq!(s.ranks[0].replay.as_deref(), Some("tcp://10.4.0.7:7000"));
        assert_eq!(
            (s.bootstrap_port, s.model.as_deref()),
            (Some(8998), Some("llama"))
        );
    }

    #[test]
    fn several_target_ports_are_several_workers_on_shifted_event_ports() {
        let specs = workers(
            &pod("vllm-0", true, json!({"kvroute.io/replay-port": "5657"})),
            &pool(&[8000, 8001]),
        )
        .expect("valid");
        let seen: Vec<(&str, &str, &str, Option<&str>)> = specs
            .iter()
            .map(|w| {
                let r = &w.ranks[0];
                (
                    w.name.as_str(),
                    w.url.as_str(),
                    r.events.as_str(),
                    r.replay.as_deref(),
                )
            })
            .collect();
        assert_eq!(
            seen,
            [
                (
                    "inference/vllm-0:8000",
                    "http://10.4.0.7:8000",
                    "tcp://10.4.0.7:5557",
                    Some("tcp://10.4.0.7:5657")
                ),
                (
                    "inference/vllm-0:8001",
                    "http://10.4.0.7:8001",
                    "tcp://10.4.0.7:5558",
                    Some("tcp://10.4.0.7:5658")
                ),
            ]
        );
    }

    #[test]
    fn pods_not_ready_deleting_without_ip_or_not_selected_give_no_worker() {
        let p = pool(&[8000]);
        assert!(workers(&pod("a", false, json!(null)), &p)
            .expect("valid")
            .is_empty());
        let mut deleting = pod("b", true, json!(null));
        deleting["metadata"]["deletionTimestamp"] = json!("2026-01-01T00:00:00Z");
        assert!(workers(&deleting, &p).expect("valid").is_empty());
        let mut pending = pod("c", true, json!(null));
        pending["status"] = json!({"phase": "Pending"});
        assert!(workers(&pending, &p).expect("valid").is_empty());
        let mut other = pod("d", true, json!(null));
        other["metadata"]["labels"] = json!({"app": "something-else"});
        assert!(workers(&other, &p).expect("valid").is_empty());
    }

    #[test]
    fn bad_pools_and_pods_name_their_problem() {
        let base = json!({
            "apiVersion": "inference.networking.k8s.io/v1",
            "spec": {"selector": {"matchLabels": {"app": "x"}}, "targetPorts": [{"number": 8000}]}
        });
        assert!(PoolSpec::from_json(&base).is_ok());
        for (path, value, problem) in [
            (
                "/apiVersion",
                json!("inference.networking.x-k8s.io/v1alpha2"),
                "apiVersion",
            ),
            ("/spec/selector/matchLabels", json!({}), "every pod"),
            (
                "/spec/selector/matchLabels",
                json!({"app": 3}),
                "not a string",
            ),
            ("/spec/targetPorts", json!([]), "1 to 8"),
            (
                "/spec/targetPorts",
                json!([{"number": 70000}]),
                "not a port",
            ),
            (
                "/spec/targetPorts",
                json!([{"number": 1}, {"number": 1}]),
                "twice",
            ),
            ("/spec/targetPorts", json!(null), "missing"),
        ] {
            let mut object = base.clone();
            if let Some(slot) = object.pointer_mut(path) {
                *slot = value;
            }
            let e = PoolSpec::from_json(&object).expect_err(problem);
            assert!(e.0.contains(problem), "{e} (wanted {problem})");
        }
        let p = pool(&[8000]);
        let e = workers(&pod("a", true, json!({"kvroute.io/events-port": "x"})), &p)
            .expect_err("a bad port");
        assert!(
            e.0.contains("pod inference/a") && e.0.contains("not a port"),
            "{e}"
        );
        let e = workers(&pod("a", true, json!({"kvroute.io/role": "chef"})), &p).expect_err("role");
        assert!(e.0.contains("role"), "{e}");
        let high = pod("a", true, json!({"kvroute.io/events-port": "65535"}));
        assert!(workers(&high, &pool(&[8000, 8001]))
            .expect_err("overflow")
            .0
            .contains("65535"));
        let mut bad_ip = pod("a", true, json!(null));
        bad_ip["status"]["podIP"] = json!("not-an-ip");
        assert!(PodFacts::from_json(&bad_ip).is_err());
        assert!(PodFacts::from_json(&json!({"metadata": {"name": "a"}})).is_err());
    }

    #[test]
    fn pool_references_and_selectors() {
        let r: PoolRef = "inference/llama-pool".parse().expect("valid");
        assert_eq!(
            (r.namespace.as_deref(), r.name.as_str()),
            (Some("inference"), "llama-pool")
        );
        assert_eq!(r.to_string(), "inference/llama-pool");
        let bare: PoolRef = "llama".parse().expect("valid");
        assert_eq!(bare.namespace, None);
        for wrong in ["", "a/", "/b", "A/b", "a/b/c", "a b", "-a"] {
            assert!(wrong.parse::<PoolRef>().is_err(), "{wrong}");
        }
        let mut p = pool(&[8000]);
        p.match_labels.insert("tier".into(), "gpu".into());
        assert_eq!(p.label_selector(), "app=vllm-llama,tier=gpu");
    }
}
