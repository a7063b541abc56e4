//! Discovery of SGLang workers from their `/server_info` `kv_events`
//! descriptor (endpoint host, port base, data-parallel size, block size,
//! replay port base), so an operator gives a URL instead of socket addresses.

use serde_json::Value;

use super::spec::{WorkerFlavor, WorkerSpec};

/// The engine flavour of every discovered worker: `/server_info` with a
/// `kv_events` descriptor is SGLang's, so its prompts carry SGLang's image pads.
pub const DISCOVERED_FLAVOR: WorkerFlavor = WorkerFlavor::Sglang;

/// Why a worker could not be discovered.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum DiscoverError {
    /// The HTTP request failed.
    #[error("GET {url}/server_info: {source}")]
    Http {
        /// The worker URL.
        url: String,
        /// Why.
        source: reqwest::Error,
    },
    /// The answer has no usable `kv_events` descriptor.
    #[error("{url}/server_info: {problem}")]
    Descriptor {
        /// The worker URL.
        url: String,
        /// What is missing.
        problem: String,
    },
}

/// Finds the `kv_events` object anywhere in a `/server_info` document.
fn find_descriptor(v: &Value) -> Option<&Value> {
    match v {
        Value::Object(map) => map
            .get("kv_events")
            .filter(|d| d.is_object())
            .or_else(|| map.values().find_map(find_descriptor)),
        Value::Array(items) => items.iter().find_map(find_descriptor),
        _ => None,
    }
}

/// Builds a worker from a `/server_info` document fetched from `url`.
pub fn spec_from_server_info(url: &str, info: &Value) -> Result<WorkerSpec, DiscoverError> {
    let bad = |problem: &str| DiscoverError::Descriptor {
        url: url.to_owned(),
        problem: problem.to_owned(),
    };
    let d = find_descriptor(info)
        .ok_or_else(|| bad("no `kv_events` descriptor (is --kv-events-config set?)"))?;
    let number = |key: &str| {
        d.get(key)
            .and_then(Value::as_u64)
            .and_then(|n| u32::try_from(n).ok())
    };
    let port = number("endpoint_port_base").ok_or_else(|| bad("`endpoint_port_base` missing"))?;
    let block_size = number("block_size")
        .filter(|&b| b > 0)
        .ok_or_else(|| bad("`block_size` missing"))?;
    let dp = number("dp_size").unwrap_or(1).max(1);
    let url_host = url
        .split("://")
        .nth(1)
        .and_then(|rest| rest.split(['/', ':']).next())
        .filter(|h| !h.is_empty())
        .unwrap_or("127.0.0.1");
    let host = match d.get("endpoint_host").and_then(Value::as_str) {
        None | Some("" | "*" | "0.0.0.0" | "::" | "[::]") => url_host,
        Some(h) => h,
    };
    let events = format!("tcp://{host}:{port}");
    let replay = number("replay_endpoint_port_base").map(|p| format!("tcp://{host}:{p}"));
    let name = url
        .split("://")
        .nth(1)
        .unwrap_or(url)
        .trim_end_matches('/')
        .to_owned();
    let mut spec = WorkerSpec::with_base_endpoints(
        name,
        url.trim_end_matches('/').to_owned(),
        &events,
        replay.as_deref(),
        dp,
        Some(block_size),
    )
    .map_err(|e| bad(&e.to_string()))?;
    spec.topic = d
        .get("topic")
        .and_then(Value::as_str)
        .unwrap_or_default()
        .to_owned();
    spec.model = info
        .get("model_path")
        .and_then(Value::as_str)
        .map(str::to_owned);
    spec.flavor = DISCOVERED_FLAVOR;
    Ok(spec)
}

/// The most of a `/server_info` answer read (SGLang's is a few KiB).
const MAX_SERVER_INFO_BYTES: usize = 4 << 20;

/// Fetches `url/server_info` and builds the worker it describes.
pub async fn discover_sglang(
    client: &reqwest::Client,
    url: &str,
) -> Result<WorkerSpec, DiscoverError> {
    let base = url.trim_end_matches('/');
    let http = |source| DiscoverError::Http {
        url: base.to_owned(),
        source,
    };
    let resp = client
        .get(format!("{base}/server_info"))
        .send()
        .await
        .map_err(http)?
        .error_for_status()
        .map_err(http)?;
    let descriptor = |problem: String| DiscoverError::Descriptor {
        url: base.to_owned(),
        problem,
    };
    let bytes = match crate::proxy::answer::read_capped(resp, MAX_SERVER_INFO_BYTES).await {
        Ok(bytes) => bytes,
        Err(crate::proxy::answer::AnswerError::Read(e)) => return Err(http(e)),
        Err(too_large) => return Err(descriptor(too_large.to_string())),
    };
    let info: Value =
        serde_json::from_slice(&bytes).map_err(|e| descriptor(format!("not JSON: {e}")))?;
    spec_from_server_info(base, &info)
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn a_descriptor_becomes_a_worker_with_the_wildcard_host_replaced() {
        let info = json!({"model_path": "m", "internal_states": [{"kv_events": {
            "publisher": "zmq", "endpoint_host": "*", "endpoint_port_base": 5557, "topic": "",
            "block_size": 16, "dp_size": 2, "replay_endpoint_port_base": 5657}}]});
        let spec = spec_from_server_info("http://10.0.0.5:30000", &info).expect("valid");
        assert_eq!(spec.ranks[1].events, "tcp://10.0.0.5:5558");
        assert_eq!(spec.ranks[1].replay.as_deref(), Some("tcp://10.0.0.5:5658"));
        assert_eq!(
            (spec.block_size, spec.model.as_deref()),
            (Some(16), Some("m"))
        );
    }

    #[test]
    fn a_missing_descriptor_is_a_clear_error() {
        let err = spec_from_server_info("http://h:1", &json!({"version": "0.5.23"}))
            .expect_err("no descriptor");
        assert!(err.to_string().contains("kv_events"));
    }
}
