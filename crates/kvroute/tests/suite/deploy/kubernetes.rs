//! `deploy/kubernetes/`: kvroute as an InferencePool's endpoint picker. No
//! API server runs here, so the manifests are read as YAML and checked as
//! the API server and kustomize would read them (required fields, the
//! InferencePool's v1 fields and no others), against each other (the pool
//! names the Service, the Service selects the Deployment's pods and names
//! its container ports, the flags use those ports, the Role grants what
//! discovery watches, the kustomization lists every file) and against the
//! code (every flag is one `kvroute serve --help` lists, the probes ask for
//! health names the picker serves). The core kinds are also validated
//! against Kubernetes' own schemas by `kubernetes-validate`, which
//! `scripts/test` installs.

use std::collections::BTreeMap;
use std::path::PathBuf;

use kvroute_server::discovery::pool::{PoolRef, POOL_GROUP, POOL_PLURAL, POOL_VERSION};
use kvroute_server::epp::health::{EXT_PROC_SERVICE, READY_NAMES};
use yaml_rust2::{Yaml, YamlLoader};

use crate::support::kvroute;

fn dir() -> PathBuf {
    PathBuf::from(format!(
        "{}/../../deploy/kubernetes",
        env!("CARGO_MANIFEST_DIR")
    ))
}

fn read(name: &str) -> String {
    let path = dir().join(name);
    std::fs::read_to_string(&path).unwrap_or_else(|e| panic!("{}: {e}", path.display()))
}

/// The resources the kustomization lists, each file's documents by kind.
fn resources() -> BTreeMap<String, Yaml> {
    let kustomization = &YamlLoader::load_from_str(&read("kustomization.yaml")).expect("YAML")[0];
    let mut by_kind = BTreeMap::new();
    for file in list(&kustomization["resources"]) {
        let file = file.as_str().expect("a file name");
        for doc in YamlLoader::load_from_str(&read(file)).expect("YAML") {
            let kind = text(&doc, "kind").to_owned();
            let previous = by_kind.insert(kind.clone(), doc);
            assert!(previous.is_none(), "two {kind}s");
        }
    }
    by_kind
}

fn text<'a>(y: &'a Yaml, key: &str) -> &'a str {
    y[key]
        .as_str()
        .unwrap_or_else(|| panic!("`{key}` missing or not a string in {y:?}"))
}

fn number(y: &Yaml, key: &str) -> i64 {
    y[key]
        .as_i64()
        .unwrap_or_else(|| panic!("`{key}` missing or not a number in {y:?}"))
}

fn list(y: &Yaml) -> &[Yaml] {
    y.as_vec()
        .unwrap_or_else(|| panic!("not a list: {y:?}"))
        .as_slice()
}

/// A map of strings (labels, selectors).
fn labels(y: &Yaml) -> BTreeMap<String, String> {
    let map = y.as_hash().unwrap_or_else(|| panic!("not a map: {y:?}"));
    map.iter()
        .map(|(k, v)| {
            let value = v
                .as_str()
                .unwrap_or_else(|| panic!("{k:?}: {v:?} is not a string"));
            (
                k.as_str().expect("a string key").to_owned(),
                value.to_owned(),
            )
        })
        .collect()
}

/// The keys of a map, which must all be among `allowed`.
fn only_keys(y: &Yaml, allowed: &[&str], what: &str) {
    let map = y.as_hash().unwrap_or_else(|| panic!("{what} is not a map"));
    for key in map.keys() {
        let key = key.as_str().expect("a string key");
        assert!(
            allowed.contains(&key),
            "{what}: `{key}` is not one of {allowed:?}"
        );
    }
}

/// A DNS-1123 label, as Kubernetes object and port names are.
fn dns_label(name: &str) -> bool {
    !name.is_empty()
        && name.len() <= 63
        && name
            .chars()
            .all(|c| c.is_ascii_lowercase() || c.is_ascii_digit() || c == '-')
        && !name.starts_with('-')
        && !name.ends_with('-')
}

#[test]
fn the_kustomization_lists_every_manifest_and_each_is_a_kubernetes_object() {
    let kustomization = &YamlLoader::load_from_str(&read("kustomization.yaml")).expect("YAML")[0];
    assert_eq!(text(kustomization, "kind"), "Kustomization");
    assert_eq!(
        text(kustomization, "apiVersion"),
        "kustomize.config.k8s.io/v1beta1"
    );
    let listed: Vec<&str> = list(&kustomization["resources"])
        .iter()
        .map(|f| f.as_str().expect("a file name"))
        .collect();
    let mut on_disk: Vec<String> = std::fs::read_dir(dir())
        .expect("deploy/kubernetes")
        .map(|e| {
            e.expect("an entry")
                .file_name()
                .to_string_lossy()
                .into_owned()
        })
        .filter(|n| n.ends_with(".yaml") && n != "kustomization.yaml")
        .collect();
    on_disk.sort();
    let mut sorted = listed.clone();
    sorted.sort_unstable();
    assert_eq!(
        sorted, on_disk,
        "the kustomization's resources are the folder's manifests"
    );
    let images = list(&kustomization["images"]);
    assert!(
        images.iter().any(|i| text(i, "name") == "kvroute"),
        "the image is kvroute's"
    );
    let kinds = resources();
    let wanted = [
        "Deployment",
        "InferencePool",
        "Role",
        "RoleBinding",
        "Service",
        "ServiceAccount",
    ];
    assert_eq!(kinds.keys().map(String::as_str).collect::<Vec<_>>(), wanted);
    for (kind, doc) in &kinds {
        assert!(!text(doc, "apiVersion").is_empty(), "{kind}");
        let name = text(&doc["metadata"], "name");
        assert!(dns_label(name), "{kind} `{name}`");
        assert!(
            doc["metadata"]["namespace"].is_badvalue(),
            "{kind}: the kustomization's `namespace` sets it"
        );
    }
    // The image builds every feature (--inference-pool and --epp-port need theirs).
    let dockerfile = std::fs::read_to_string(dir().join("Dockerfile")).expect("the Dockerfile");
    assert!(dockerfile.contains("--features full") && dockerfile.contains("--locked"));
}

#[test]
fn the_inference_pool_has_gies_v1_fields_and_names_the_pickers_service() {
    let kinds = resources();
    let pool = &kinds["InferencePool"];
    assert_eq!(
        text(pool, "apiVersion"),
        format!("{POOL_GROUP}/{POOL_VERSION}")
    );
    only_keys(
        pool,
        &["apiVersion", "kind", "metadata", "spec"],
        "the pool",
    );
    let spec = &pool["spec"];
    only_keys(
        spec,
        &[
            "selector",
            "targetPorts",
            "appProtocol",
            "endpointPickerRef",
        ],
        "spec",
    );
    only_keys(&spec["selector"], &["matchLabels"], "spec.selector");
    let selector = labels(&spec["selector"]["matchLabels"]);
    assert!(!selector.is_empty() && selector.len() <= 64, "{selector:?}");
    let ports: Vec<i64> = list(&spec["targetPorts"])
        .iter()
        .map(|p| {
            only_keys(p, &["number"], "a target port");
            number(p, "number")
        })
        .collect();
    assert!((1..=8).contains(&ports.len()), "{ports:?}");
    assert!(ports.iter().all(|p| (1..=65_535).contains(p)), "{ports:?}");
    let picker = &spec["endpointPickerRef"];
    only_keys(
        picker,
        &["group", "kind", "name", "port", "failureMode"],
        "endpointPickerRef",
    );
    assert_eq!(
        (text(picker, "group"), text(picker, "kind")),
        ("", "Service")
    );
    assert!(["FailOpen", "FailClose"].contains(&text(picker, "failureMode")));
    only_keys(&picker["port"], &["number"], "endpointPickerRef.port");
    let service = &kinds["Service"];
    assert_eq!(text(picker, "name"), text(&service["metadata"], "name"));
    let port = number(&picker["port"], "number");
    let ext_proc = list(&service["spec"]["ports"])
        .iter()
        .find(|p| number(p, "port") == port)
        .unwrap_or_else(|| panic!("the Service has no port {port}"));
    assert_eq!(
        text(ext_proc, "appProtocol"),
        "http2",
        "Envoy speaks gRPC to it"
    );
    // The picker's own pods are not the pool's.
    let epp_pods = labels(&kinds["Deployment"]["spec"]["template"]["metadata"]["labels"]);
    assert!(
        !selector.iter().all(|(k, v)| epp_pods.get(k) == Some(v)),
        "the pool's selector must not select kvroute itself"
    );
}

/// The container's `--flag=value` arguments, by flag.
fn flags(container: &Yaml) -> BTreeMap<String, String> {
    let args = list(&container["args"]);
    assert_eq!(args[0].as_str(), Some("serve"));
    args[1..]
        .iter()
        .map(|a| {
            let a = a.as_str().expect("a string argument");
            let (flag, value) = a
                .strip_prefix("--")
                .and_then(|f| f.split_once('='))
                .unwrap_or_else(|| panic!("`{a}`: write flags as --flag=value"));
            (flag.to_owned(), value.to_owned())
        })
        .collect()
}

#[test]
fn the_deployment_serves_on_the_ports_its_service_and_probes_use() {
    let kinds = resources();
    let (deployment, service) = (&kinds["Deployment"], &kinds["Service"]);
    let template = &deployment["spec"]["template"];
    let pod_labels = labels(&template["metadata"]["labels"]);
    for selector in [
        labels(&deployment["spec"]["selector"]["matchLabels"]),
        labels(&service["spec"]["selector"]),
    ] {
        assert!(
            selector.iter().all(|(k, v)| pod_labels.get(k) == Some(v)),
            "{selector:?}"
        );
    }
    let containers = list(&template["spec"]["containers"]);
    let container = &containers[0];
    let ports: BTreeMap<&str, i64> = list(&container["ports"])
        .iter()
        .map(|p| (text(p, "name"), number(p, "containerPort")))
        .collect();
    for p in list(&service["spec"]["ports"]) {
        let target = text(p, "targetPort");
        assert!(
            ports.contains_key(target),
            "the Service's {target} is no container port"
        );
    }
    let flags = flags(container);
    let flag = |name: &str| flags.get(name).unwrap_or_else(|| panic!("no --{name}"));
    assert_eq!(flag("host"), "0.0.0.0", "reachable from other pods");
    for (name, port) in [
        ("epp-port", "grpc"),
        ("epp-health-port", "grpc-health"),
        ("port", "metrics"),
    ] {
        assert_eq!(
            flag(name).parse::<i64>().ok(),
            Some(ports[port]),
            "--{name} and port {port}"
        );
    }
    for (probe, names) in [
        ("livenessProbe", vec!["liveness"]),
        ("readinessProbe", READY_NAMES.to_vec()),
    ] {
        let grpc = &container[probe]["grpc"];
        assert_eq!(number(grpc, "port"), ports["grpc-health"], "{probe}");
        let asked = text(grpc, "service");
        assert!(
            names.contains(&asked) && asked != EXT_PROC_SERVICE,
            "{probe}: {asked}"
        );
    }
    // --inference-pool is the pool of this folder, in the pod's namespace.
    let pool = flag("inference-pool");
    let (ns, name) = pool.split_once('/').expect("NAMESPACE/NAME");
    assert_eq!(ns, "$(NAMESPACE)");
    assert_eq!(name, text(&kinds["InferencePool"]["metadata"], "name"));
    let env = list(&container["env"]);
    let namespace = env
        .iter()
        .find(|e| text(e, "name") == "NAMESPACE")
        .expect("NAMESPACE");
    assert_eq!(
        text(&namespace["valueFrom"]["fieldRef"], "fieldPath"),
        "metadata.namespace"
    );
    assert!(
        format!("inference/{name}").parse::<PoolRef>().is_ok(),
        "{pool}"
    );
    // Every flag is one `kvroute serve` knows.
    let help = kvroute()
        .args(["serve", "--help"])
        .output()
        .expect("kvroute runs");
    let help = String::from_utf8_lossy(&help.stdout);
    for name in flags.keys() {
        assert!(
            help.contains(&format!("--{name} ")),
            "`kvroute serve` has no --{name}"
        );
    }
    assert_eq!(
        text(&template["spec"], "serviceAccountName"),
        text(&kinds["ServiceAccount"]["metadata"], "name")
    );
}

#[test]
fn the_role_grants_what_discovery_watches_to_the_pickers_account() {
    let kinds = resources();
    let account = text(&kinds["ServiceAccount"]["metadata"], "name");
    let (role, binding) = (&kinds["Role"], &kinds["RoleBinding"]);
    let subject = &list(&binding["subjects"])[0];
    assert_eq!(
        (text(subject, "kind"), text(subject, "name")),
        ("ServiceAccount", account)
    );
    let role_ref = &binding["roleRef"];
    assert_eq!(text(role_ref, "kind"), "Role");
    assert_eq!(text(role_ref, "name"), text(&role["metadata"], "name"));
    let grants = |group: &str, resource: &str| {
        list(&role["rules"]).iter().any(|rule| {
            let has =
                |key: &str, want: &str| list(&rule[key]).iter().any(|v| v.as_str() == Some(want));
            has("apiGroups", group)
                && has("resources", resource)
                && has("verbs", "list")
                && has("verbs", "watch")
        })
    };
    assert!(grants("", "pods"), "pods: list and watch");
    assert!(
        grants(POOL_GROUP, POOL_PLURAL),
        "inferencepools: list and watch"
    );
}

/// `kubernetes-validate`: $KVROUTE_KUBERNETES_VALIDATE (scripts/test sets
/// it), else on PATH.
fn kubernetes_validate() -> std::process::Command {
    let program = std::env::var_os("KVROUTE_KUBERNETES_VALIDATE")
        .unwrap_or_else(|| "kubernetes-validate".into());
    std::process::Command::new(program)
}

#[test]
fn the_core_manifests_pass_kubernetes_own_schemas() {
    let files = ["rbac.yaml", "epp-service.yaml", "epp-deployment.yaml"];
    // The oldest Kubernetes kvroute's client is built for (k8s-openapi's v1_33).
    let run = kubernetes_validate()
        .args(["--strict", "--kubernetes-version", "1.33.0"])
        .args(files.iter().map(|f| dir().join(f)))
        .output()
        .unwrap_or_else(|e| {
            panic!(
                "kubernetes-validate: {e}; run scripts/test, or `python3 -m pip install kubernetes-validate` \
                 (or set KVROUTE_KUBERNETES_VALIDATE)"
            )
        });
    let said =
        String::from_utf8_lossy(&run.stdout).into_owned() + &String::from_utf8_lossy(&run.stderr);
    assert!(run.status.success(), "{said}");
    assert_eq!(
        said.matches("INFO").count(),
        5,
        "every document validated: {said}"
    );
}
