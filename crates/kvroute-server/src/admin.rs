//! The admin surface: health, the worker listing, and the endpoints that
//! register and unregister workers (shaped after Dynamo's standalone indexer
//! API so its tooling works against kvroute).

use std::sync::Arc;

use axum::extract::State;
use axum::http::{header, HeaderMap};
use axum::Json;
use kvroute_core::index::{DpRank, WorkerRank};
use serde_json::{json, Value};

use crate::api::ProxyError;
use crate::bodies::Body;
use crate::ingest::registry::{Registry, RegistryError};
use crate::ingest::spec::{
    parse_flavor, parse_role_as, RankEndpoints, Speed, WorkerFlavor, WorkerRole, WorkerSpec,
};
use crate::replica::bus::ReplicaSync;
use crate::router::Router;

/// Who may do what. Without an admin token the admin API (everything that
/// changes which workers exist) is closed; with one, it takes that bearer
/// token, and so do the endpoints that show the fleet's addresses and the
/// index's contents (`/workers`, `/query`, `/query_by_hash`) unless they are
/// made public. `/health` and `/metrics` are always open.
#[derive(Debug, Clone, Default)]
pub struct Access {
    /// The admin bearer token, if the admin API is enabled.
    pub admin_token: Option<String>,
    /// Introspection without the token, even when one is set.
    pub public_introspection: bool,
}

impl Access {
    /// Whether the request may change the fleet.
    pub fn admin(&self, headers: &HeaderMap) -> Result<(), ProxyError> {
        let Some(token) = &self.admin_token else {
            return Err(ProxyError::AdminDisabled);
        };
        check_bearer(token, headers)
    }

    /// Whether the request may see the fleet's addresses and the index.
    pub fn introspection(&self, headers: &HeaderMap) -> Result<(), ProxyError> {
        match &self.admin_token {
            Some(token) if !self.public_introspection => check_bearer(token, headers),
            _ => Ok(()),
        }
    }
}

/// The credentials of an `Authorization: Bearer …` header (the scheme is
/// case-insensitive, RFC 9110).
fn bearer(headers: &HeaderMap) -> Option<&[u8]> {
    let value = headers.get(header::AUTHORIZATION)?.as_bytes();
    let (scheme, rest) = value.split_at_checked(6)?;
    if !scheme.eq_ignore_ascii_case(b"bearer") || rest.first() != Some(&b' ') {
        return None;
    }
    Some(rest.trim_ascii())
}

/// 401 unless the request carries `token`, compared in constant time.
fn check_bearer(token: &str, headers: &HeaderMap) -> Result<(), ProxyError> {
    use subtle::ConstantTimeEq as _;
    let given = bearer(headers).unwrap_or_default();
    if bool::from(given.ct_eq(token.as_bytes())) {
        Ok(())
    } else {
        Err(ProxyError::Unauthorized)
    }
}

/// Answers 401 for an introspection request without the token.
pub async fn require_introspection(
    State(access): State<Access>,
    headers: HeaderMap,
    request: axum::extract::Request,
    next: axum::middleware::Next,
) -> axum::response::Response {
    use axum::response::IntoResponse as _;
    match access.introspection(&headers) {
        Ok(()) => next.run(request).await,
        Err(e) => e.into_response(),
    }
}

/// What the admin endpoints share.
#[derive(Debug, Clone)]
pub struct AdminState {
    /// Registered workers.
    pub registry: Arc<Registry>,
    /// The router, told when the workers change.
    pub router: Arc<Router>,
    /// Who may use the admin endpoints.
    pub access: Access,
    /// Block size for registrations that do not give one (`None`: learned
    /// from each such worker's stream).
    pub default_block_size: Option<u32>,
    /// The replica sync, when there are peer replicas (`--nats`).
    pub replica: Option<Arc<ReplicaSync>>,
    /// Routing quality second by second (the dashboard's charts).
    pub series: Arc<crate::dashboard::series::Series>,
}

/// `GET /health`.
pub async fn health(State(state): State<AdminState>) -> Json<Value> {
    Json(json!({"status": "ok", "workers": state.registry.len()}))
}

/// `GET /workers`: every worker and rank with its stream's state, and with
/// `--learn-speeds` each rank's `learned_speed` (null until learned).
pub async fn workers(State(state): State<AdminState>) -> Json<Value> {
    let replicas = state.replica.as_ref().map(|sync| sync.view());
    let views = state.registry.view();
    let mut workers = json!(views);
    if let Some(list) = workers.as_array_mut() {
        for (w, view) in list.iter_mut().zip(&views) {
            w["models"] = json!(state.router.listed_models(&view.name));
        }
    }
    if let (Some(learned), Some(list)) = (state.router.learned_speeds(), workers.as_array_mut()) {
        for (w, view) in list.iter_mut().zip(&views) {
            let ranks = w.get_mut("ranks").and_then(Value::as_array_mut);
            for (r, rank) in ranks.into_iter().flatten().zip(&view.ranks) {
                let key = WorkerRank {
                    worker: view.id,
                    rank: rank.dp_rank,
                };
                r["learned_speed"] = json!(learned.get(&key));
            }
        }
    }
    let tokenizers = crate::tokenizers::tokenizers_json(state.router.tokenizers());
    Json(json!({ "workers": workers, "replicas": replicas, "tokenizers": tokenizers }))
}

/// Parses a JSON body, answering 400 with serde's message when it is not JSON.
fn parse_body(body: &[u8]) -> Result<Value, ProxyError> {
    let value: Value = serde_json::from_slice(body)
        .map_err(|e| ProxyError::bad_request(format!("invalid JSON body: {e}")))?;
    if !value.is_object() {
        return Err(ProxyError::bad_request("the body must be a JSON object"));
    }
    Ok(value)
}

fn str_field<'a>(v: &'a Value, key: &str) -> Result<Option<&'a str>, ProxyError> {
    match v.get(key) {
        None | Some(Value::Null) => Ok(None),
        Some(Value::String(s)) => Ok(Some(s)),
        Some(Value::Number(n)) => Err(ProxyError::bad_request(format!(
            "`{key}` must be a string, found {n}"
        ))),
        Some(_) => Err(ProxyError::bad_request(format!("`{key}` must be a string"))),
    }
}

fn u32_field(v: &Value, key: &str) -> Result<Option<u32>, ProxyError> {
    match v.get(key) {
        None | Some(Value::Null) => Ok(None),
        Some(value) => value
            .as_u64()
            .and_then(|n| u32::try_from(n).ok())
            .map(Some)
            .ok_or_else(|| {
                ProxyError::bad_request(format!("`{key}` must be a non-negative integer"))
            }),
    }
}

/// A worker from a registration body: kvroute's own fields (`name`, `url`,
/// `events`, `replay`, `dp`, `block_size`, `topic`, `model`, `flavor`,
/// `speed`, `role`, `bootstrap_port`) or Dynamo's
/// standalone-indexer fields (`instance_id`, `endpoint`, `replay_endpoint`,
/// `dp_rank`, `block_size`, `model_name`), which register one rank. Either
/// shape may give the role as SMG's and Dynamo's `worker_type` and the
/// flavour as SMG's `runtime_type` ([`role_from_body`], [`flavor_from_body`]).
fn spec_from_body(v: &Value, default_block_size: Option<u32>) -> Result<WorkerSpec, ProxyError> {
    let block_size = u32_field(v, "block_size")?.or(default_block_size);
    let mut spec = if let Some(events) = str_field(v, "events")? {
        let name =
            str_field(v, "name")?.ok_or_else(|| ProxyError::bad_request("`name` is required"))?;
        let url =
            str_field(v, "url")?.ok_or_else(|| ProxyError::bad_request("`url` is required"))?;
        let mut spec = WorkerSpec::with_base_endpoints(
            name.to_owned(),
            url.to_owned(),
            events,
            str_field(v, "replay")?,
            u32_field(v, "dp")?.unwrap_or(1),
            block_size,
        )
        .map_err(|e| ProxyError::bad_request(e.to_string()))?;
        spec.topic = str_field(v, "topic")?.unwrap_or_default().to_owned();
        spec.model = str_field(v, "model")?.map(str::to_owned);
        spec
    } else if let Some(endpoint) = str_field(v, "endpoint")? {
        let name = match v.get("instance_id") {
            Some(Value::String(s)) => s.clone(),
            Some(Value::Number(n)) => n.to_string(),
            _ => {
                return Err(ProxyError::bad_request(
                    "`instance_id` is required with `endpoint`",
                ))
            }
        };
        if block_size == Some(0) {
            return Err(ProxyError::bad_request("`block_size` must be at least 1"));
        }
        let rank = u32_field(v, "dp_rank")?.unwrap_or(0);
        WorkerSpec {
            url: str_field(v, "url")?.unwrap_or_default().to_owned(),
            name,
            ranks: vec![RankEndpoints {
                rank: DpRank(rank),
                events: endpoint.to_owned(),
                replay: str_field(v, "replay_endpoint")?.map(str::to_owned),
            }],
            block_size,
            topic: String::new(),
            model: str_field(v, "model_name")?.map(str::to_owned),
            flavor: WorkerFlavor::default(),
            speed: Speed::default(),
            role: WorkerRole::default(),
            bootstrap_port: None,
        }
    } else {
        return Err(ProxyError::bad_request(
            "give `name`, `url` and `events` (or Dynamo's `instance_id` and `endpoint`)",
        ));
    };
    spec.flavor = flavor_from_body(v)?;
    spec.speed = speed_from_body(v)?;
    spec.set_role(role_from_body(v)?, bootstrap_port_from_body(v)?)
        .map_err(|e| ProxyError::bad_request(e.to_string()))?;
    Ok(spec)
}

/// The one value a registration gives under any of `keys` (names for the
/// same field), parsed by `parse`; 400 when two of them disagree.
fn aliased<T: PartialEq>(
    v: &Value,
    keys: [&'static str; 2],
    parse: impl Fn(&'static str, &str) -> Result<T, ProxyError>,
) -> Result<Option<T>, ProxyError> {
    let mut found: Option<(&str, T)> = None;
    for key in keys {
        let Some(text) = str_field(v, key)? else {
            continue;
        };
        let value = parse(key, text)?;
        match &found {
            Some((first, other)) if *other != value => {
                return Err(ProxyError::bad_request(format!(
                    "`{first}` and `{key}` disagree"
                )))
            }
            Some(_) => {}
            None => found = Some((key, value)),
        }
    }
    Ok(found.map(|(_, value)| value))
}

/// A registration's role: `role`, or `worker_type` as SMG
/// (`regular|prefill|decode`) and Dynamo (`aggregated|prefill|decode`)
/// name it; absent: both.
fn role_from_body(v: &Value) -> Result<WorkerRole, ProxyError> {
    let role = aliased(v, ["role", "worker_type"], |key, text| {
        parse_role_as(key, Some(text)).map_err(|e| ProxyError::bad_request(e.to_string()))
    })?;
    Ok(role.unwrap_or_default())
}

/// A registration's SGLang `bootstrap_port` (SMG's name too): a port from
/// 1 to 65535, or absent or null.
fn bootstrap_port_from_body(v: &Value) -> Result<Option<u16>, ProxyError> {
    match v.get("bootstrap_port") {
        None | Some(Value::Null) => Ok(None),
        Some(n) => n
            .as_u64()
            .and_then(|n| u16::try_from(n).ok())
            .filter(|&p| p > 0)
            .map(Some)
            .ok_or_else(|| {
                ProxyError::bad_request("`bootstrap_port` must be a port from 1 to 65535")
            }),
    }
}

/// A registration's `flavor`, or SMG's `runtime_type` (`vllm` or `sglang`;
/// absent: `vllm`).
fn flavor_from_body(v: &Value) -> Result<WorkerFlavor, ProxyError> {
    let flavor = aliased(v, ["flavor", "runtime_type"], |_, text| {
        parse_flavor(Some(text)).map_err(|e| ProxyError::bad_request(e.to_string()))
    })?;
    Ok(flavor.unwrap_or_default())
}

/// A registration's `speed` (a number; absent: 1).
fn speed_from_body(v: &Value) -> Result<Speed, ProxyError> {
    match v.get("speed") {
        None | Some(Value::Null) => Ok(Speed::default()),
        Some(n) => n
            .as_f64()
            .and_then(Speed::new)
            .ok_or_else(|| ProxyError::bad_request(format!("`speed`: {}", Speed::EXPECTED))),
    }
}

/// `POST /register`: a worker in kvroute's or Dynamo's fields (with SMG's
/// and Dynamo's names for its role).
pub async fn register(
    State(state): State<AdminState>,
    headers: HeaderMap,
    Body(body, _share): Body,
) -> Result<Json<Value>, ProxyError> {
    state.access.admin(&headers)?;
    let body = parse_body(&body)?;
    let spec = spec_from_body(&body, state.default_block_size)?;
    let (flavor, role) = (spec.flavor, spec.role);
    let name = spec.name.clone();
    let registry = state.registry.clone();
    let id = tokio::task::spawn_blocking(move || registry.register(spec))
        .await
        .map_err(|e| ProxyError::internal(e.to_string()))?
        .map_err(|e| match e {
            RegistryError::Address { .. } | RegistryError::HostNotAllowed { .. } => {
                ProxyError::bad_request(e.to_string())
            }
            _ => ProxyError::Conflict(e.to_string()),
        })?;
    state.router.refresh(&state.registry);
    Ok(Json(
        json!({"status": "registered", "name": name, "worker_id": id.0,
               "flavor": flavor.as_str(), "role": role.as_str()}),
    ))
}

/// `POST /unregister`: a worker by `name` (or Dynamo's `instance_id`).
pub async fn unregister(
    State(state): State<AdminState>,
    headers: HeaderMap,
    Body(body, _share): Body,
) -> Result<Json<Value>, ProxyError> {
    state.access.admin(&headers)?;
    let body = parse_body(&body)?;
    let name = match (body.get("name"), body.get("instance_id")) {
        (Some(Value::String(s)), _) | (None, Some(Value::String(s))) => s.clone(),
        (None, Some(Value::Number(n))) => n.to_string(),
        _ => {
            return Err(ProxyError::bad_request(
                "`name` (or `instance_id`) is required",
            ))
        }
    };
    let registry = state.registry.clone();
    let lookup = name.clone();
    let removed = tokio::task::spawn_blocking(move || registry.unregister(&lookup))
        .await
        .map_err(|e| ProxyError::internal(e.to_string()))?;
    state.router.refresh(&state.registry);
    if removed {
        Ok(Json(json!({"status": "unregistered", "name": name})))
    } else {
        Err(ProxyError::NotFound(format!("no worker named `{name}`")))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn registrations_accept_kvroute_and_dynamo_shapes() {
        let ours = json!({"name": "w0", "url": "http://h:1", "events": "tcp://h:5557", "replay": "tcp://h:5657", "dp": 2});
        let spec = spec_from_body(&ours, Some(16)).expect("valid");
        assert_eq!(spec.ranks.len(), 2);
        assert_eq!(spec.block_size, Some(16));
        let dynamo = json!({"instance_id": 7, "endpoint": "tcp://h:6000", "dp_rank": 1, "block_size": 32, "model_name": "m"});
        let spec = spec_from_body(&dynamo, Some(16)).expect("valid");
        assert_eq!(
            (spec.name.as_str(), spec.ranks[0].rank, spec.block_size),
            ("7", DpRank(1), Some(32))
        );
    }

    #[test]
    fn bad_registrations_get_clear_messages() {
        let err = |v: Value| {
            spec_from_body(&v, Some(16))
                .expect_err("invalid")
                .message()
                .to_owned()
        };
        assert!(err(json!({"url": "x"})).contains("give `name`"));
        assert!(err(json!({"name": "a", "events": "tcp://h:1"})).contains("`url` is required"));
        assert!(
            err(json!({"name": "a", "url": "u", "events": "tcp://h:1", "dp": -1})).contains("`dp`")
        );
        assert!(err(json!({"name": 5, "url": "u", "events": "tcp://h:1"}))
            .contains("`name` must be a string"));
        assert!(flavor_from_body(&json!({"flavor": "tgi"}))
            .expect_err("unknown")
            .message()
            .contains("sglang or trtllm"));
        assert_eq!(
            flavor_from_body(&json!({"flavor": "sglang"})).expect("valid"),
            WorkerFlavor::Sglang
        );
        assert_eq!(
            flavor_from_body(&json!({})).expect("valid"),
            WorkerFlavor::Vllm
        );
        assert_eq!(speed_from_body(&json!({})).map(Speed::get), Ok(1.0));
        assert_eq!(
            speed_from_body(&json!({"speed": 0.5})).map(Speed::get),
            Ok(0.5)
        );
        for bad in [json!(0), json!(-2), json!("fast"), json!(1e9)] {
            assert!(speed_from_body(&json!({ "speed": bad }))
                .expect_err("not a speed")
                .message()
                .contains("`speed`"));
        }
        assert!(parse_body(b"[1]").is_err());
        assert!(parse_body(b"{")
            .expect_err("not json")
            .message()
            .contains("invalid JSON"));
    }

    #[test]
    fn registrations_take_the_role_in_kvroute_smg_and_dynamo_names() {
        let ours = json!({"name": "p", "url": "http://h:1", "events": "tcp://h:5557",
                          "flavor": "sglang", "role": "prefill", "bootstrap_port": 8998});
        let spec = spec_from_body(&ours, Some(16)).expect("valid");
        assert_eq!(
            (spec.role, spec.bootstrap_port, spec.flavor),
            (WorkerRole::Prefill, Some(8998), WorkerFlavor::Sglang)
        );
        // SMG: `worker_type` regular|prefill|decode, `runtime_type`, `bootstrap_port`.
        let smg = json!({"name": "s", "url": "http://h:1", "events": "tcp://h:5557",
                         "worker_type": "prefill", "runtime_type": "sglang", "bootstrap_port": 9000});
        let spec = spec_from_body(&smg, Some(16)).expect("valid");
        assert_eq!(
            (spec.role, spec.bootstrap_port, spec.flavor),
            (WorkerRole::Prefill, Some(9000), WorkerFlavor::Sglang)
        );
        let regular = json!({"name": "r", "url": "http://h:1", "events": "tcp://h:1",
                             "worker_type": "regular", "bootstrap_port": null});
        let spec = spec_from_body(&regular, Some(16)).expect("valid");
        assert_eq!((spec.role, spec.bootstrap_port), (WorkerRole::Both, None));
        // Dynamo: `worker_type` aggregated|prefill|decode with its indexer's fields.
        for (given, role) in [
            ("decode", WorkerRole::Decode),
            ("prefill", WorkerRole::Prefill),
            ("aggregated", WorkerRole::Both),
        ] {
            let dynamo =
                json!({"instance_id": 7, "endpoint": "tcp://h:6000", "worker_type": given});
            let spec = spec_from_body(&dynamo, Some(16)).expect("valid");
            assert_eq!(spec.role, role, "{given}");
        }
        let spec = spec_from_body(&json!({"instance_id": 7, "endpoint": "tcp://h:6000"}), None);
        assert_eq!(spec.map(|s| s.role), Ok(WorkerRole::Both));
    }

    #[test]
    fn bad_roles_and_bootstrap_ports_get_clear_messages() {
        let err = |extra: Value| {
            let mut v = json!({"name": "a", "url": "http://h:1", "events": "tcp://h:1"});
            for (k, x) in extra.as_object().expect("object") {
                v[k] = x.clone();
            }
            spec_from_body(&v, Some(16))
                .expect_err("invalid")
                .message()
                .to_owned()
        };
        let e = err(json!({"worker_type": "encode"}));
        assert!(
            e.contains("`worker_type=encode`") && e.contains("not supported"),
            "{e}"
        );
        let e = err(json!({"role": "boss"}));
        assert!(
            e.contains("`role=boss`") && e.contains("prefill, decode or both"),
            "{e}"
        );
        let e = err(json!({"role": "prefill", "worker_type": "decode"}));
        assert!(e.contains("`role` and `worker_type` disagree"), "{e}");
        let e = err(json!({"role": 3}));
        assert!(e.contains("`role` must be a string"), "{e}");
        let e = err(json!({"role": "prefill", "bootstrap_port": 8998}));
        assert!(e.contains("only SGLang workers"), "{e}");
        let e = err(json!({"flavor": "sglang", "role": "decode", "bootstrap_port": 8998}));
        assert!(e.contains("a decode worker has no bootstrap server"), "{e}");
        for bad in [json!(0), json!(70000), json!(-1), json!("8998")] {
            let e = err(json!({"flavor": "sglang", "bootstrap_port": bad}));
            assert!(e.contains("`bootstrap_port` must be a port"), "{e}");
        }
        let e = err(json!({"flavor": "vllm", "runtime_type": "sglang"}));
        assert!(e.contains("`flavor` and `runtime_type` disagree"), "{e}");
        let same = json!({"name": "a", "url": "http://h:1", "events": "tcp://h:1",
                          "role": "decode", "worker_type": "decode"});
        assert!(spec_from_body(&same, Some(16)).is_ok());
    }
}
