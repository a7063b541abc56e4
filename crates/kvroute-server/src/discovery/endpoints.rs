//! The endpoints file: llm-d's `endpoints.yaml` shape, read into worker
//! specs. Pure: text in, specs (or the first problem) out.
//!
//! ```yaml
//! endpoints:
//!   - name: vllm-0              # required; with `namespace`, the worker is `namespace/name`
//!     namespace: inference      # optional
//!     address: 10.0.0.7         # required: an IP address
//!     port: "8000"              # required: the HTTP port (a string, as llm-d writes it, or a number)
//!     labels:                   # optional; kvroute reads these:
//!       kvroute.io/events-port: "5557"    # ZeroMQ KV events (default --endpoints-events-port)
//!       kvroute.io/replay-port: "5558"    # replay (default --endpoints-replay-port, none if unset)
//!       kvroute.io/flavor: sglang         # vllm | sglang (default --endpoints-flavor)
//!       kvroute.io/dp-size: "2"           # data-parallel ranks on consecutive ports
//!       kvroute.io/role: prefill          # prefill | decode | both (also llm-d.ai/role)
//!       kvroute.io/bootstrap-port: "8998" # SGLang prefill engines
//!       kvroute.io/block-size: "16"
//!       kvroute.io/model: my-model
//! ```

use std::collections::BTreeMap;
use std::net::IpAddr;

use yaml_rust2::Yaml;

use super::bounded_yaml;

use crate::ingest::spec::{WorkerFlavor, WorkerSpec};

/// The largest endpoints file read, as llm-d's file discovery allows.
pub const MAX_FILE_BYTES: usize = 1 << 20;

/// The most endpoints one file may list.
pub const MAX_ENDPOINTS: usize = 4_096;

/// What an endpoint's labels do not say.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct EndpointDefaults {
    /// The engines' KV-event port (vLLM's and SGLang's usual 5557).
    pub events_port: u16,
    /// Their replay port, if they have one.
    pub replay_port: Option<u16>,
    /// Their engine.
    pub flavor: WorkerFlavor,
}

impl Default for EndpointDefaults {
    fn default() -> Self {
        EndpointDefaults {
            events_port: 5557,
            replay_port: None,
            flavor: WorkerFlavor::Vllm,
        }
    }
}

/// Why a file with no `endpoints` list is refused, and how to mean "none".
pub const NO_ENDPOINTS: &str =
    "no `endpoints` list: a file that is empty, or was caught while it was written, \
is not applied (write `endpoints: []` to remove every worker)";

/// Why an endpoints file was not used (the workers it gave before stay).
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{0}")]
pub struct EndpointsError(pub String);

fn bad(message: impl Into<String>) -> EndpointsError {
    EndpointsError(message.into())
}

/// The workers `text` lists, by name, as `default_block_size` and
/// `defaults` complete them.
///
/// Only an explicit empty list (`endpoints: []`) gives no workers: a text
/// with no document (empty, blank, only comments), or whose `endpoints` is
/// missing or null (`endpoints:` with nothing after it, as a file cut short
/// after its first line reads), is an error, since a file caught while it is
/// being written reads exactly so, and applying it would remove every
/// worker. The YAML is built within [`bounded_yaml`]'s bounds (aliases
/// included), so no text costs more than those whatever it says.
pub fn parse_endpoints(
    text: &str,
    defaults: &EndpointDefaults,
    default_block_size: Option<u32>,
) -> Result<BTreeMap<String, WorkerSpec>, EndpointsError> {
    if text.len() > MAX_FILE_BYTES {
        return Err(bad(format!(
            "the file is {} bytes, over the {MAX_FILE_BYTES} allowed",
            text.len()
        )));
    }
    let doc = bounded_yaml::load_first(text).map_err(|e| bad(e.0))?;
    let list = match doc.as_ref().map(|doc| &doc["endpoints"]) {
        Some(Yaml::Array(list)) => list.as_slice(),
        None | Some(Yaml::BadValue | Yaml::Null) => return Err(bad(NO_ENDPOINTS)),
        Some(_) => return Err(bad("`endpoints` must be a list")),
    };
    if list.len() > MAX_ENDPOINTS {
        return Err(bad(format!(
            "{} endpoints, over the {MAX_ENDPOINTS} allowed",
            list.len()
        )));
    }
    let mut specs = BTreeMap::new();
    for (i, entry) in list.iter().enumerate() {
        let spec = endpoint(entry, defaults, default_block_size)
            .map_err(|e| bad(format!("endpoints[{i}]: {e}")))?;
        if specs.contains_key(&spec.name) {
            return Err(bad(format!(
                "endpoints[{i}]: `{}` is listed twice",
                spec.name
            )));
        }
        specs.insert(spec.name.clone(), spec);
    }
    Ok(specs)
}

/// A scalar as text: a string, or a number written as YAML reads it.
fn scalar(value: &Yaml) -> Option<String> {
    match value {
        Yaml::String(s) | Yaml::Real(s) => Some(s.clone()),
        Yaml::Integer(n) => Some(n.to_string()),
        Yaml::Boolean(b) => Some(b.to_string()),
        _ => None,
    }
}

fn port(value: Option<String>, what: &str) -> Result<Option<u16>, EndpointsError> {
    value
        .map(|v| {
            v.trim()
                .parse::<u16>()
                .ok()
                .filter(|&p| p > 0)
                .ok_or_else(|| bad(format!("{what} `{v}` is not a port")))
        })
        .transpose()
}

/// Characters a worker-spec value may hold (the spec line is `,`- and
/// `=`-separated).
fn plain(value: &str, what: &str) -> Result<(), EndpointsError> {
    let ok = !value.is_empty()
        && value.len() <= 253
        && value
            .chars()
            .all(|c| c.is_ascii_alphanumeric() || "-._/:".contains(c));
    if ok {
        Ok(())
    } else {
        Err(bad(format!(
            "{what} `{value}` must be 1 to 253 of [A-Za-z0-9-._/:]"
        )))
    }
}

/// One endpoint as a worker spec.
fn endpoint(
    entry: &Yaml,
    defaults: &EndpointDefaults,
    default_block_size: Option<u32>,
) -> Result<WorkerSpec, EndpointsError> {
    let field = |key: &str| scalar(&entry[key]);
    let name = field("name").ok_or_else(|| bad("`name` is required"))?;
    let name = match field("namespace") {
        Some(ns) => format!("{ns}/{name}"),
        None => name,
    };
    let address = field("address").ok_or_else(|| bad("`address` is required"))?;
    let ip: IpAddr = address
        .trim()
        .parse()
        .map_err(|_| bad(format!("`address` `{address}` is not an IP address")))?;
    let http = port(field("port"), "`port`")?.ok_or_else(|| bad("`port` is required"))?;
    let labels = &entry["labels"];
    let engine = Engine {
        name: &name,
        ip,
        http,
        index: 0,
    };
    worker_spec(
        &engine,
        &|key| scalar(&labels[key]),
        defaults,
        default_block_size,
    )
}

/// One engine found by a discovery source, before its labels complete it.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Engine<'a> {
    /// The worker's name.
    pub name: &'a str,
    /// Where it listens.
    pub ip: IpAddr,
    /// Its HTTP port.
    pub http: u16,
    /// Which of the pod's serving ports this is (0 for the first): its
    /// events and replay ports are the labels' (or defaults') plus
    /// `index` × its data-parallel size, as vLLM offsets a rank's ports.
    pub index: u16,
}

/// A port plus an offset, when it stays a port.
fn offset(base: u16, by: u32, what: &str) -> Result<u16, EndpointsError> {
    u16::try_from(u32::from(base) + by)
        .map_err(|_| bad(format!("{what} {base} + {by} is beyond 65535")))
}

/// The worker spec of `engine`, completed by `label` (an endpoint's labels
/// or a pod's annotations and labels), `defaults` and `default_block_size`.
pub(crate) fn worker_spec(
    engine: &Engine<'_>,
    label: &dyn Fn(&str) -> Option<String>,
    defaults: &EndpointDefaults,
    default_block_size: Option<u32>,
) -> Result<WorkerSpec, EndpointsError> {
    let name = engine.name;
    plain(name, "the name")?;
    let dp = label("kvroute.io/dp-size");
    let ranks = dp.as_deref().and_then(|d| d.trim().parse::<u32>().ok());
    let shift = u32::from(engine.index) * ranks.unwrap_or(1).max(1);
    let events = port(label("kvroute.io/events-port"), "kvroute.io/events-port")?
        .unwrap_or(defaults.events_port);
    let events = offset(events, shift, "the events port")?;
    let replay =
        port(label("kvroute.io/replay-port"), "kvroute.io/replay-port")?.or(defaults.replay_port);
    let replay = replay
        .map(|r| offset(r, shift, "the replay port"))
        .transpose()?;
    let host = match engine.ip {
        IpAddr::V4(v4) => v4.to_string(),
        IpAddr::V6(v6) => format!("[{v6}]"),
    };
    let mut line = format!(
        "name={name},url=http://{host}:{},events=tcp://{host}:{events},flavor={}",
        engine.http,
        defaults.flavor.as_str()
    );
    if let Some(replay) = replay {
        line.push_str(&format!(",replay=tcp://{host}:{replay}"));
    }
    let role = label("kvroute.io/role").or_else(|| label("llm-d.ai/role"));
    for (key, value) in [
        ("flavor", label("kvroute.io/flavor")),
        ("dp", dp),
        ("role", role),
        ("bootstrap_port", label("kvroute.io/bootstrap-port")),
        ("block_size", label("kvroute.io/block-size")),
        ("model", label("kvroute.io/model")),
    ] {
        if let Some(value) = value {
            plain(&value, key)?;
            line.push_str(&format!(",{key}={value}"));
        }
    }
    WorkerSpec::parse(&line, default_block_size).map_err(|e| bad(e.to_string()))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::ingest::spec::WorkerRole;

    fn parse(text: &str) -> Result<BTreeMap<String, WorkerSpec>, EndpointsError> {
        parse_endpoints(text, &EndpointDefaults::default(), Some(16))
    }

    #[test]
    fn llm_d_endpoints_become_workers_with_kvroutes_labels() {
        let text = r#"
endpoints:
  - name: vllm-0
    address: 10.0.0.7
    port: "8000"
  - name: sgl-p
    namespace: inference
    address: 10.0.0.8
    port: 30000
    labels:
      kvroute.io/flavor: sglang
      kvroute.io/events-port: "6000"
      kvroute.io/replay-port: 7000
      kvroute.io/dp-size: "2"
      llm-d.ai/role: prefill
      kvroute.io/bootstrap-port: "8998"
      app: ignored
"#;
        let specs = parse(text).expect("valid");
        let names: Vec<&str> = specs.keys().map(String::as_str).collect();
        assert_eq!(names, ["inference/sgl-p", "vllm-0"]);
        let v = &specs["vllm-0"];
        assert_eq!(v.url, "http://10.0.0.7:8000");
        assert_eq!(v.ranks[0].events, "tcp://10.0.0.7:5557");
        assert_eq!(
            (v.ranks[0].replay.clone(), v.flavor),
            (None, WorkerFlavor::Vllm)
        );
        let s = &specs["inference/sgl-p"];
        assert_eq!(
            (s.flavor, s.role),
            (WorkerFlavor::Sglang, WorkerRole::Prefill)
        );
        assert_eq!(s.ranks.len(), 2);
        assert_eq!(s.ranks[1].events, "tcp://10.0.0.8:6001");
        assert_eq!(s.ranks[0].replay.as_deref(), Some("tcp://10.0.0.8:7000"));
        assert_eq!(s.bootstrap_port, Some(8998));
        assert!(parse("endpoints: []\n").expect("none").is_empty());
    }

    #[test]
    fn only_an_explicit_empty_list_means_no_workers() {
        assert!(parse("endpoints: []\n").expect("drain").is_empty());
        assert!(parse("# drained\nendpoints: [ ]  # all gone\n")
            .expect("drain")
            .is_empty());
        let full = "endpoints:\n  - name: a\n    address: 10.0.0.1\n    port: \"8000\"\n";
        // What an in-place rewrite of `full` may be caught as, between truncating it and
        // writing its first entry: none of them removes the workers.
        for torn in [
            "",
            " \n\t\n",
            "# comment only\n",
            "---\n",
            "endpoints:",
            "endpoints:\n",
            "endpoints: ~\n",
            "other: 1\n",
            "just text",
        ] {
            let e = parse(torn).expect_err(torn);
            assert_eq!(e.0, NO_ENDPOINTS, "{torn:?}");
        }
        assert_eq!(parse(full).expect("full").len(), 1);
    }

    #[test]
    fn alias_bombs_are_refused_and_honest_anchors_read() {
        for levels in [5, 11] {
            let text = bounded_yaml::tests::bomb(levels);
            assert!(text.len() < 800, "{} bytes", text.len());
            let e = parse(&text).expect_err("a bomb");
            assert!(
                e.0.contains("an alias counts as the node it repeats"),
                "{e}"
            );
        }
        let shared = "common: &common\n  kvroute.io/flavor: sglang\n  kvroute.io/events-port: \"6000\"\n\
endpoints:\n  - {name: a, address: 10.0.0.1, port: 1, labels: *common}\n  - {name: b, address: 10.0.0.2, port: 1, labels: *common}\n";
        let specs = parse(shared).expect("anchors an operator may use");
        assert_eq!(specs["b"].flavor, WorkerFlavor::Sglang);
        assert_eq!(specs["b"].ranks[0].events, "tcp://10.0.0.2:6000");
    }

    #[test]
    fn a_bad_file_names_its_first_problem() {
        for (text, problem) in [
            ("endpoints: 3", "`endpoints` must be a list"),
            ("endpoints:\n  - address: 10.0.0.1\n    port: 1", "endpoints[0]: `name` is required"),
            ("endpoints:\n  - name: a\n    address: host.local\n    port: 1", "not an IP address"),
            ("endpoints:\n  - name: a\n    address: 10.0.0.1\n    port: \"0\"", "is not a port"),
            ("endpoints:\n  - name: a\n    address: 10.0.0.1", "`port` is required"),
            ("endpoints:\n  - {name: a, address: 10.0.0.1, port: 1}\n  - {name: a, address: 10.0.0.2, port: 1}", "listed twice"),
            ("endpoints:\n  - {name: 'a,b', address: 10.0.0.1, port: 1}", "must be 1 to 253"),
            ("endpoints:\n  - {name: a, address: 10.0.0.1, port: 1, labels: {kvroute.io/role: 'x=y'}}", "must be 1 to 253"),
            ("endpoints:\n  - {name: a, address: 10.0.0.1, port: 1, labels: {kvroute.io/role: chef}}", "role"),
            ("endpoints: [", "not YAML"),
        ] {
            let e = parse(text).expect_err(problem);
            assert!(e.0.contains(problem), "{e} (wanted {problem})");
        }
        let huge = "#".repeat(MAX_FILE_BYTES + 1);
        assert!(parse(&huge).expect_err("too big").0.contains("over the"));
    }
}
