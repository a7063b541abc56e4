//! What a worker is, and the ways an operator describes one: the `--worker`
//! flag syntax, a TOML config file, and registration requests.

use std::collections::BTreeMap;

use serde::{Deserialize, Serialize};

pub use kvroute_core::event::WorkerFlavor;
use kvroute_core::index::DpRank;
pub use kvroute_core::scheduler::WorkerRole;

/// Why a worker description was rejected.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum SpecError {
    /// A `key=value` pair without `=`.
    #[error("`{0}` is not key=value")]
    NotKeyValue(String),
    /// A key this syntax does not know.
    #[error(
        "unknown key `{0}` (known: name, url, events, replay, dp, block_size, topic, model, flavor, speed, role, bootstrap_port)"
    )]
    UnknownKey(String),
    /// A required key is missing.
    #[error("missing `{0}`")]
    Missing(&'static str),
    /// A value that does not parse.
    #[error("`{key}={value}`: {problem}")]
    BadValue {
        /// The key.
        key: &'static str,
        /// The value given.
        value: String,
        /// What is wrong with it.
        problem: &'static str,
    },
    /// The config file is not valid TOML for a worker list.
    #[error("config file: {0}")]
    Config(String),
}

/// One data-parallel rank's sockets.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct RankEndpoints {
    /// The rank.
    pub rank: DpRank,
    /// Its event publisher (`tcp://host:port`).
    pub events: String,
    /// Its replay ROUTER, if the engine runs one.
    pub replay: Option<String>,
}

/// A worker: one engine serving HTTP, publishing KV events on one socket per rank.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct WorkerSpec {
    /// Unique name.
    pub name: String,
    /// HTTP base URL of the engine's OpenAI-compatible server.
    pub url: String,
    /// Event and replay endpoints of each rank.
    pub ranks: Vec<RankEndpoints>,
    /// Tokens per KV block; `None`: learned from the worker's first stored
    /// event (until then the worker is routed on load alone).
    pub block_size: Option<u32>,
    /// ZMQ topic to subscribe to (`""`: everything).
    pub topic: String,
    /// Model the engine serves, if known.
    pub model: Option<String>,
    /// How the engine lays images out in its prompts and writes its events
    /// (`flavor=vllm|sglang|trtllm`, default vLLM), and so how the router
    /// hashes requests with images for it.
    #[serde(default, with = "flavor_name")]
    pub flavor: WorkerFlavor,
    /// How fast the engine is against the fleet's reference engine
    /// (`speed=0.5`: half as fast; default 1), which the router cannot
    /// tell from the events: a request's cost there is its work divided by
    /// the speed, so a slower engine takes fewer prefixes and requests.
    #[serde(default)]
    pub speed: Speed,
    /// What the worker does in a disaggregated fleet (`role=prefill|decode|both`,
    /// default both: an aggregated engine), so that the router sends it only
    /// the legs it can serve. Specs saved before roles existed load as both.
    #[serde(default, with = "role_name")]
    pub role: WorkerRole,
    /// The port of the SGLang bootstrap server of a prefill (or both)
    /// worker (`bootstrap_port=`), which the router hands both legs of a
    /// disaggregated request; `None`: the engine's default. Only SGLang
    /// workers run one, so it is refused elsewhere ([`WorkerSpec::set_role`]).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub bootstrap_port: Option<u16>,
}

/// A worker's declared speed: a number from 1 / [`Speed::MAX`] to
/// [`Speed::MAX`], 1 for the reference engine.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
#[serde(try_from = "f64", into = "f64")]
pub struct Speed(f64);

// Always a finite number: `Speed::new` refuses the rest.
impl Eq for Speed {}

impl Default for Speed {
    fn default() -> Self {
        Speed(1.0)
    }
}

impl Speed {
    /// The largest speed accepted (and the inverse of the smallest).
    pub const MAX: f64 = 1000.0;

    /// A speed, if `value` is from `1 / MAX` to `MAX` (NaN is not).
    pub fn new(value: f64) -> Option<Speed> {
        (1.0 / Self::MAX..=Self::MAX)
            .contains(&value)
            .then_some(Speed(value))
    }

    /// The number.
    pub fn get(self) -> f64 {
        self.0
    }

    /// What a speed must be, for error messages.
    pub const EXPECTED: &'static str = "expected a number from 0.001 to 1000";

    /// A `speed` value of the worker syntax.
    pub fn parse(value: &str) -> Result<Speed, SpecError> {
        Self::checked(value.parse().unwrap_or(f64::NAN), value)
    }

    /// `value` as a speed; `shown` is how the operator wrote it.
    fn checked(value: f64, shown: &str) -> Result<Speed, SpecError> {
        Speed::new(value).ok_or_else(|| SpecError::BadValue {
            key: "speed",
            value: shown.to_owned(),
            problem: Self::EXPECTED,
        })
    }
}

impl TryFrom<f64> for Speed {
    type Error = &'static str;

    fn try_from(value: f64) -> Result<Self, Self::Error> {
        Speed::new(value).ok_or(Speed::EXPECTED)
    }
}

impl From<Speed> for f64 {
    fn from(speed: Speed) -> f64 {
        speed.0
    }
}

/// `tcp://host:port` with the port moved by `offset` (how engines place rank r).
pub fn offset_endpoint(endpoint: &str, offset: u32) -> Result<String, SpecError> {
    let bad = |problem| SpecError::BadValue {
        key: "events",
        value: endpoint.to_owned(),
        problem,
    };
    let (head, port) = endpoint
        .rsplit_once(':')
        .ok_or_else(|| bad("expected tcp://host:port"))?;
    if !endpoint.starts_with("tcp://") {
        return Err(bad("only tcp:// endpoints are supported"));
    }
    let port: u32 = port.parse().map_err(|_| bad("the port is not a number"))?;
    let moved = port
        .checked_add(offset)
        .filter(|p| *p <= u32::from(u16::MAX))
        .ok_or_else(|| bad("port out of range"))?;
    Ok(format!("{head}:{moved}"))
}

impl WorkerSpec {
    /// Builds a worker whose rank r publishes at `events` port + r and replays at
    /// `replay` port + r, as vLLM and SGLang place data-parallel ranks.
    pub fn with_base_endpoints(
        name: String,
        url: String,
        events: &str,
        replay: Option<&str>,
        dp: u32,
        block_size: Option<u32>,
    ) -> Result<Self, SpecError> {
        if dp == 0 {
            return Err(SpecError::BadValue {
                key: "dp",
                value: "0".into(),
                problem: "must be at least 1",
            });
        }
        if block_size == Some(0) {
            return Err(SpecError::BadValue {
                key: "block_size",
                value: "0".into(),
                problem: "must be at least 1",
            });
        }
        let ranks = (0..dp)
            .map(|rank| {
                Ok(RankEndpoints {
                    rank: DpRank(rank),
                    events: offset_endpoint(events, rank)?,
                    replay: replay.map(|r| offset_endpoint(r, rank)).transpose()?,
                })
            })
            .collect::<Result<Vec<_>, SpecError>>()?;
        Ok(WorkerSpec {
            name,
            url,
            ranks,
            block_size,
            topic: String::new(),
            model: None,
            flavor: WorkerFlavor::default(),
            speed: Speed::default(),
            role: WorkerRole::default(),
            bootstrap_port: None,
        })
    }

    /// Sets the worker's role and SGLang bootstrap port (set the flavour
    /// first). A bootstrap port is refused where no bootstrap server can be:
    /// on a vLLM worker (vLLM hands KV blocks over without one) and on a
    /// decode worker (the server is the prefill side's), rather than kept
    /// and silently never used.
    pub fn set_role(
        &mut self,
        role: WorkerRole,
        bootstrap_port: Option<u16>,
    ) -> Result<(), SpecError> {
        if self.flavor == WorkerFlavor::Trtllm && role != WorkerRole::Both {
            return Err(SpecError::BadValue {
                key: "role",
                value: role.to_string(),
                problem: "TensorRT-LLM workers (flavor=trtllm) serve aggregated only (role=both)",
            });
        }
        if let Some(port) = bootstrap_port {
            let refuse = |problem| SpecError::BadValue {
                key: "bootstrap_port",
                value: port.to_string(),
                problem,
            };
            if port == 0 {
                return Err(refuse(BOOTSTRAP_PORT_EXPECTED));
            }
            if self.flavor != WorkerFlavor::Sglang {
                return Err(refuse(
                    "only SGLang workers (flavor=sglang) run a bootstrap server",
                ));
            }
            if role == WorkerRole::Decode {
                return Err(refuse(
                    "a decode worker has no bootstrap server (prefill and both workers do)",
                ));
            }
        }
        self.role = role;
        self.bootstrap_port = bootstrap_port;
        Ok(())
    }

    /// Parses the `--worker` syntax: `name=w0,url=http://…,events=tcp://…:5557,
    /// replay=tcp://…:5657,dp=2,block_size=16` (keys in any order; `replay`,
    /// `dp` (default 1), `block_size` (default `default_block_size`; neither:
    /// learned from the stream), `topic`, `model`, `flavor` (`vllm|sglang|trtllm`,
    /// default `vllm`), `speed` (default 1), `role` (`prefill|decode|both`,
    /// default `both`; see [`parse_role`]) and `bootstrap_port` (SGLang
    /// prefill workers) optional).
    pub fn parse(text: &str, default_block_size: Option<u32>) -> Result<Self, SpecError> {
        let mut fields: BTreeMap<&str, &str> = BTreeMap::new();
        for pair in text.split(',').map(str::trim).filter(|p| !p.is_empty()) {
            let (key, value) = pair
                .split_once('=')
                .ok_or_else(|| SpecError::NotKeyValue(pair.to_owned()))?;
            let key = key.trim();
            if !matches!(
                key,
                "name"
                    | "url"
                    | "events"
                    | "replay"
                    | "dp"
                    | "block_size"
                    | "topic"
                    | "model"
                    | "flavor"
                    | "speed"
                    | "role"
                    | "bootstrap_port"
            ) {
                return Err(SpecError::UnknownKey(key.to_owned()));
            }
            fields.insert(key, value.trim());
        }
        let number = |key: &'static str, default: u32| -> Result<u32, SpecError> {
            match fields.get(key) {
                None => Ok(default),
                Some(v) => v.parse().map_err(|_| SpecError::BadValue {
                    key,
                    value: (*v).to_owned(),
                    problem: "not a whole number",
                }),
            }
        };
        let name = fields
            .get("name")
            .ok_or(SpecError::Missing("name"))?
            .to_string();
        let url = fields
            .get("url")
            .ok_or(SpecError::Missing("url"))?
            .to_string();
        let events = fields.get("events").ok_or(SpecError::Missing("events"))?;
        let flavor = parse_flavor(fields.get("flavor").copied())?;
        let mut spec = WorkerSpec::with_base_endpoints(
            name,
            url,
            events,
            fields.get("replay").copied(),
            number("dp", 1)?,
            match fields.get("block_size") {
                Some(_) => Some(number("block_size", 0)?),
                None => default_block_size,
            },
        )?;
        spec.topic = fields
            .get("topic")
            .map(|t| t.to_string())
            .unwrap_or_default();
        spec.model = fields.get("model").map(|m| m.to_string());
        spec.flavor = flavor;
        if let Some(speed) = fields.get("speed") {
            spec.speed = Speed::parse(speed)?;
        }
        let role = parse_role(fields.get("role").copied())?;
        let bootstrap_port = fields
            .get("bootstrap_port")
            .map(|p| parse_bootstrap_port(p))
            .transpose()?;
        spec.set_role(role, bootstrap_port)?;
        Ok(spec)
    }
}

/// A [`WorkerFlavor`] in serialized specs and views: its name (`vllm`, `sglang`).
pub(crate) mod flavor_name {
    use super::WorkerFlavor;
    use serde::{Deserialize, Deserializer, Serializer};

    /// Writes the flavour's name.
    pub fn serialize<S: Serializer>(f: &WorkerFlavor, s: S) -> Result<S::Ok, S::Error> {
        s.serialize_str(f.as_str())
    }

    /// Reads a flavour's name.
    pub fn deserialize<'de, D: Deserializer<'de>>(d: D) -> Result<WorkerFlavor, D::Error> {
        let name = String::deserialize(d)?;
        name.parse().map_err(serde::de::Error::custom)
    }
}

/// A [`WorkerRole`] in serialized specs and views: its name (`both`,
/// `prefill`, `decode`); reading takes every spelling [`parse_role`] does.
pub(crate) mod role_name {
    use super::WorkerRole;
    use serde::{Deserialize, Deserializer, Serializer};

    /// Writes the role's name.
    pub fn serialize<S: Serializer>(r: &WorkerRole, s: S) -> Result<S::Ok, S::Error> {
        s.serialize_str(r.as_str())
    }

    /// Reads a role's name.
    pub fn deserialize<'de, D: Deserializer<'de>>(d: D) -> Result<WorkerRole, D::Error> {
        let name = String::deserialize(d)?;
        super::parse_role(Some(&name)).map_err(serde::de::Error::custom)
    }
}

/// What a bootstrap port must be, for error messages.
const BOOTSTRAP_PORT_EXPECTED: &str = "expected a port from 1 to 65535";

/// What a role must be, for error messages.
const ROLE_EXPECTED: &str =
    "expected prefill, decode or both (also prefill-decode, regular, aggregated)";

/// A worker's `role` value; absent: both. Besides kvroute's `prefill`,
/// `decode` and `both` it takes `prefill-decode` (llm-d's name for both),
/// `regular` (SMG's) and `aggregated` (Dynamo's), in any case. Encode
/// workers are not supported.
pub fn parse_role(value: Option<&str>) -> Result<WorkerRole, SpecError> {
    parse_role_as("role", value)
}

/// [`parse_role`] for a value given under `key` (registrations also take
/// SMG's and Dynamo's `worker_type`), which error messages name.
pub fn parse_role_as(key: &'static str, value: Option<&str>) -> Result<WorkerRole, SpecError> {
    let Some(given) = value else {
        return Ok(WorkerRole::default());
    };
    let lower = given.trim().to_ascii_lowercase();
    let name = match lower.as_str() {
        "regular" | "aggregated" => "both",
        other => other,
    };
    name.parse().map_err(|_| SpecError::BadValue {
        key,
        value: given.to_owned(),
        problem: if name == "encode" {
            "encode workers are not supported (prefill, decode or both)"
        } else {
            ROLE_EXPECTED
        },
    })
}

/// A worker's `bootstrap_port` value: a port from 1 to 65535.
pub fn parse_bootstrap_port(value: &str) -> Result<u16, SpecError> {
    value
        .parse()
        .ok()
        .filter(|&p| p > 0)
        .ok_or_else(|| SpecError::BadValue {
            key: "bootstrap_port",
            value: value.to_owned(),
            problem: BOOTSTRAP_PORT_EXPECTED,
        })
}

/// A worker's `flavor` value (`vllm`, `sglang`, `trtllm`; absent: `vllm`).
pub fn parse_flavor(value: Option<&str>) -> Result<WorkerFlavor, SpecError> {
    match value {
        None => Ok(WorkerFlavor::default()),
        Some(v) => v.parse().map_err(|_| SpecError::BadValue {
            key: "flavor",
            value: v.to_owned(),
            problem: "expected vllm, sglang or trtllm",
        }),
    }
}

/// One worker in a TOML config file (`[[worker]]` tables).
#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct ConfigWorker {
    name: String,
    url: String,
    events: String,
    replay: Option<String>,
    dp: Option<u32>,
    block_size: Option<u32>,
    topic: Option<String>,
    model: Option<String>,
    flavor: Option<String>,
    speed: Option<f64>,
    role: Option<String>,
    bootstrap_port: Option<u16>,
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct ConfigFile {
    #[serde(default)]
    worker: Vec<ConfigWorker>,
}

/// Parses a TOML config file listing workers as `[[worker]]` tables with the
/// same keys as the `--worker` flag.
pub fn parse_config(
    text: &str,
    default_block_size: Option<u32>,
) -> Result<Vec<WorkerSpec>, SpecError> {
    let file: ConfigFile = toml::from_str(text).map_err(|e| SpecError::Config(e.to_string()))?;
    file.worker
        .into_iter()
        .map(|w| {
            let flavor = parse_flavor(w.flavor.as_deref())?;
            let mut spec = WorkerSpec::with_base_endpoints(
                w.name,
                w.url,
                &w.events,
                w.replay.as_deref(),
                w.dp.unwrap_or(1),
                w.block_size.or(default_block_size),
            )?;
            spec.topic = w.topic.unwrap_or_default();
            spec.model = w.model;
            spec.flavor = flavor;
            if let Some(speed) = w.speed {
                spec.speed = Speed::checked(speed, &speed.to_string())?;
            }
            spec.set_role(parse_role(w.role.as_deref())?, w.bootstrap_port)?;
            Ok(spec)
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_worker_flag_parses_with_keys_in_any_order() {
        let spec = WorkerSpec::parse(
            "block_size=16,name=w0,url=http://127.0.0.1:8000,events=tcp://127.0.0.1:5557,replay=tcp://127.0.0.1:5657,dp=2",
            Some(32),
        )
        .expect("valid");
        assert_eq!(spec.name, "w0");
        assert_eq!(spec.block_size, Some(16));
        assert_eq!(spec.ranks.len(), 2);
        assert_eq!(spec.ranks[1].events, "tcp://127.0.0.1:5558");
        assert_eq!(
            spec.ranks[1].replay.as_deref(),
            Some("tcp://127.0.0.1:5658")
        );
        let minimal =
            WorkerSpec::parse("name=a,url=http://h:1,events=tcp://h:2", Some(64)).expect("valid");
        assert_eq!(
            (
                minimal.block_size,
                minimal.ranks.len(),
                minimal.ranks[0].replay.clone()
            ),
            (Some(64), 1, None)
        );
        let learned =
            WorkerSpec::parse("name=a,url=http://h:1,events=tcp://h:2", None).expect("valid");
        assert_eq!(learned.block_size, None, "learned from the stream");
    }

    #[test]
    fn bad_worker_flags_say_what_is_wrong() {
        let err = |s: &str| {
            WorkerSpec::parse(s, Some(16))
                .expect_err("invalid")
                .to_string()
        };
        assert!(err("name=a,url=u").contains("missing `events`"));
        assert!(err("name=a,url=u,events=tcp://h:1,dp=x").contains("dp=x"));
        assert!(err("name=a,url=u,events=tcp://h:1,colour=red").contains("unknown key `colour`"));
        assert!(err("name=a,url=u,events=tcp://h:1,dp=0").contains("at least 1"));
        for bad in ["0", "-1", "nan", "inf", "fast", "1001"] {
            let e = err(&format!("name=a,url=u,events=tcp://h:1,speed={bad}"));
            assert!(e.contains(&format!("speed={bad}")), "{e}");
        }
        let half = WorkerSpec::parse("name=a,url=u,events=tcp://h:1,speed=0.5", None);
        assert_eq!(half.map(|s| s.speed.get()), Ok(0.5));
        assert!(err("name=a,url=u,events=ipc:///x").contains("tcp://"));
        assert!(err("name").contains("key=value"));
        assert!(err("name=a,url=u,events=tcp://h:1,flavor=trt").contains("sglang or trtllm"));
    }

    #[test]
    fn trtllm_workers_parse_and_serve_aggregated_only() {
        let spec = WorkerSpec::parse("name=t,url=u,events=tcp://h:1,flavor=trtllm", Some(16));
        assert_eq!(spec.map(|s| s.flavor), Ok(WorkerFlavor::Trtllm));
        for role in ["prefill", "decode"] {
            let line = format!("name=t,url=u,events=tcp://h:1,flavor=trtllm,role={role}");
            let e = WorkerSpec::parse(&line, Some(16)).expect_err("refused");
            assert!(e.to_string().contains("aggregated only"), "{e}");
        }
    }

    #[test]
    fn the_flavor_defaults_to_vllm_and_reads_from_flags_and_files() {
        let line = "name=a,url=http://h:1,events=tcp://h:2,flavor=sglang,dp=1,block_size=16";
        let spec = WorkerSpec::parse(line, Some(16)).expect("valid");
        assert_eq!(
            (spec.name.as_str(), spec.flavor),
            ("a", WorkerFlavor::Sglang)
        );
        assert_eq!(WorkerSpec::parse(line, Some(16)).expect("valid"), spec);
        let spec = WorkerSpec::parse("name=a,url=u,events=tcp://h:2", Some(16)).expect("valid");
        assert_eq!(spec.flavor, WorkerFlavor::Vllm);
        let text =
            "[[worker]]\nname = \"w\"\nurl = \"u\"\nevents = \"tcp://h:1\"\nflavor = \"sglang\"\n";
        let workers = parse_config(text, Some(16)).expect("valid");
        assert_eq!(workers[0].flavor, WorkerFlavor::Sglang);
        assert!(parse_config(
            "[[worker]]\nname = \"w\"\nurl = \"u\"\nevents = \"tcp://h:1\"\nflavor = \"x\"\n",
            Some(16)
        )
        .is_err());
    }

    #[test]
    fn a_config_file_lists_the_same_workers() {
        let text = r#"
            [[worker]]
            name = "w0"
            url = "http://127.0.0.1:8000"
            events = "tcp://127.0.0.1:5557"
            replay = "tcp://127.0.0.1:5657"
            dp = 2
            block_size = 16
            speed = 0.5
        "#;
        let from_file = parse_config(text, Some(32)).expect("valid");
        let from_flag = WorkerSpec::parse(
            "name=w0,url=http://127.0.0.1:8000,events=tcp://127.0.0.1:5557,replay=tcp://127.0.0.1:5657,dp=2,block_size=16,speed=0.5",
            Some(32),
        )
        .expect("valid");
        assert_eq!(from_file, vec![from_flag]);
        assert!(parse_config("[[worker]]\nname = 1", Some(16)).is_err());
        let slowest =
            "[[worker]]\nname = \"w\"\nurl = \"u\"\nevents = \"tcp://h:1\"\nspeed = 0.0\n";
        assert!(parse_config(slowest, Some(16)).is_err());
    }

    #[test]
    fn the_role_takes_every_spelling_and_defaults_to_both() {
        let base = "name=a,url=u,events=tcp://h:1";
        let spec = WorkerSpec::parse(base, Some(16)).expect("valid");
        assert_eq!((spec.role, spec.bootstrap_port), (WorkerRole::Both, None));
        for (given, role) in [
            ("both", WorkerRole::Both),
            ("prefill-decode", WorkerRole::Both),
            ("regular", WorkerRole::Both),
            ("aggregated", WorkerRole::Both),
            ("prefill", WorkerRole::Prefill),
            ("Prefill", WorkerRole::Prefill),
            ("decode", WorkerRole::Decode),
            ("DECODE", WorkerRole::Decode),
        ] {
            let spec = WorkerSpec::parse(&format!("{base},role={given}"), Some(16));
            assert_eq!(spec.map(|s| s.role), Ok(role), "{given}");
            assert_eq!(parse_role(Some(given)), Ok(role), "{given}");
        }
        assert_eq!(parse_role(None), Ok(WorkerRole::Both));
        let err = |s: &str| {
            WorkerSpec::parse(&format!("{base},{s}"), Some(16))
                .expect_err("invalid")
                .to_string()
        };
        let e = err("role=leader");
        assert!(
            e.contains("`role=leader`") && e.contains("prefill, decode or both"),
            "{e}"
        );
        let e = err("role=encode");
        assert!(e.contains("encode workers are not supported"), "{e}");
        let e = err("colour=red");
        assert!(e.contains("role, bootstrap_port"), "{e}");
    }

    #[test]
    fn a_bootstrap_port_is_only_for_sglang_prefill_workers() {
        let sglang = "name=a,url=u,events=tcp://h:1,flavor=sglang";
        for role in ["prefill", "both"] {
            let line = format!("{sglang},role={role},bootstrap_port=8998");
            let spec = WorkerSpec::parse(&line, Some(16)).expect("valid");
            assert_eq!(spec.bootstrap_port, Some(8998), "{role}");
        }
        let err = |s: &str| {
            WorkerSpec::parse(s, Some(16))
                .expect_err("invalid")
                .to_string()
        };
        let e = err("name=a,url=u,events=tcp://h:1,role=prefill,bootstrap_port=8998");
        assert!(
            e.contains("`bootstrap_port=8998`") && e.contains("only SGLang workers"),
            "{e}"
        );
        let e = err(&format!("{sglang},role=decode,bootstrap_port=8998"));
        assert!(e.contains("a decode worker has no bootstrap server"), "{e}");
        for bad in ["0", "65536", "-1", "x"] {
            let e = err(&format!("{sglang},role=prefill,bootstrap_port={bad}"));
            assert!(
                e.contains(&format!("bootstrap_port={bad}")) && e.contains("1 to 65535"),
                "{e}"
            );
        }
    }

    #[test]
    fn a_config_file_and_saved_specs_carry_the_role() {
        let text = r#"
            [[worker]]
            name = "p"
            url = "u"
            events = "tcp://h:1"
            flavor = "sglang"
            role = "prefill"
            bootstrap_port = 8998

            [[worker]]
            name = "d"
            url = "u"
            events = "tcp://h:2"
            role = "decode"
        "#;
        let workers = parse_config(text, Some(16)).expect("valid");
        let flags = [
            "name=p,url=u,events=tcp://h:1,flavor=sglang,role=prefill,bootstrap_port=8998",
            "name=d,url=u,events=tcp://h:2,role=decode",
        ]
        .map(|l| WorkerSpec::parse(l, Some(16)).expect("valid"));
        assert_eq!(workers, flags);
        let refused = "[[worker]]\nname = \"w\"\nurl = \"u\"\nevents = \"tcp://h:1\"\nbootstrap_port = 8998\n";
        let e = parse_config(refused, Some(16))
            .expect_err("vLLM")
            .to_string();
        assert!(e.contains("only SGLang workers"), "{e}");
        let bad = "[[worker]]\nname = \"w\"\nurl = \"u\"\nevents = \"tcp://h:1\"\nrole = \"x\"\n";
        assert!(parse_config(bad, Some(16)).is_err());

        // Serialized, the role is its name and an unset port is left out;
        // a spec saved before roles existed reads as both.
        let json = serde_json::to_value(&workers[0]).expect("serializes");
        assert_eq!(
            (&json["role"], &json["bootstrap_port"]),
            (&serde_json::json!("prefill"), &serde_json::json!(8998))
        );
        let decode = serde_json::to_value(&workers[1]).expect("serializes");
        assert!(decode.get("bootstrap_port").is_none(), "{decode}");
        let back: WorkerSpec = serde_json::from_value(json).expect("reads back");
        assert_eq!(back, workers[0]);
        let old = r#"{"name":"w","url":"u","ranks":[{"rank":0,"events":"tcp://h:1","replay":null}],
            "block_size":16,"topic":"","model":null,"flavor":"vllm","speed":1.0}"#;
        let old: WorkerSpec = serde_json::from_str(old).expect("an older spec reads");
        assert_eq!((old.role, old.bootstrap_port), (WorkerRole::Both, None));
    }
}
