//! The request fields of prefill/decode disaggregation, validated as the
//! engines read them, and the modelled transfer time. Pure: no I/O.
//!
//! * vLLM (NixlConnector): `kv_transfer_params`, an object. A prefill leg
//!   carries `do_remote_decode: true`; a decode leg carries the prefill's
//!   answer verbatim: `do_remote_prefill: true`, `remote_block_ids`,
//!   `remote_engine_id`, `remote_request_id`, `remote_host`, `remote_port`,
//!   `tp_size`. vLLM types it `dict[str, Any]`, so a non-object is a 400;
//!   the mocker also answers 400 for a known key of the wrong type (vLLM
//!   would fail later, inside its connector). Keys it does not know
//!   (Mooncake's `transfer_id`, …) are ignored.
//! * SGLang: `bootstrap_host`, `bootstrap_port`, `bootstrap_room`, each a
//!   scalar or an array of one per prompt (SMG's batches); the mocker takes
//!   one prompt, so an array must have exactly one entry.

use std::time::Duration;

use serde_json::{Map, Value};

/// Longest modelled transfer: a cap so that no product of flags overflows.
pub const MAX_TRANSFER_DELAY: Duration = Duration::from_secs(3600);

/// SGLang's message when a disaggregated engine gets no room (its DP
/// controller asserts it; the mocker answers 400 with it instead of dying).
pub const SGLANG_MISSING_ROOM: &str = "req.bootstrap_room should not be None. Do not send \
     requests directly to prefill or decode instances; send to the router instead.";

/// A transfer field that is malformed or missing: a 400 naming it.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{message}")]
pub struct FieldError {
    /// The offending field (`kv_transfer_params.remote_port`, `bootstrap_room`, …).
    pub field: &'static str,
    /// What is wrong with it.
    pub message: String,
}

impl FieldError {
    fn new(field: &'static str, message: impl Into<String>) -> Self {
        FieldError {
            field,
            message: message.into(),
        }
    }
}

/// The transfer fields of a request body, taken out unparsed: which apply
/// depends on the engine's flavour and role.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct TransferFields {
    /// vLLM's `kv_transfer_params`.
    pub kv_transfer_params: Option<Value>,
    /// SGLang's `bootstrap_host`.
    pub bootstrap_host: Option<Value>,
    /// SGLang's `bootstrap_port`.
    pub bootstrap_port: Option<Value>,
    /// SGLang's `bootstrap_room`.
    pub bootstrap_room: Option<Value>,
}

impl TransferFields {
    /// Removes the transfer fields from a request body object.
    pub fn take(obj: &mut Map<String, Value>) -> Self {
        TransferFields {
            kv_transfer_params: obj.remove("kv_transfer_params"),
            bootstrap_host: obj.remove("bootstrap_host"),
            bootstrap_port: obj.remove("bootstrap_port"),
            bootstrap_room: obj.remove("bootstrap_room"),
        }
    }
}

/// vLLM's `kv_transfer_params`, validated (absent keys and nulls are `None`).
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct KvTransferParams {
    /// A prefill leg: hold the blocks and answer how to read them.
    pub do_remote_decode: bool,
    /// A decode leg: read the prompt's blocks from the remote prefill.
    pub do_remote_prefill: bool,
    /// The prefill engine's id.
    pub remote_engine_id: Option<String>,
    /// The prefill's id of the request.
    pub remote_request_id: Option<String>,
    /// Where the prefill's side channel listens.
    pub remote_host: Option<String>,
    /// Its port.
    pub remote_port: Option<u16>,
    /// Block ids held by the prefill (the longest KV-cache group); 0 when absent.
    pub remote_blocks: usize,
    /// The prefill's tensor-parallel size.
    pub tp_size: Option<u64>,
}

/// The prefill a decode leg reads its blocks from: every field vLLM needs.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct RemotePrefill<'a> {
    /// `remote_engine_id`.
    pub engine_id: &'a str,
    /// `remote_request_id`.
    pub request_id: &'a str,
    /// `remote_host`.
    pub host: &'a str,
    /// `remote_port`.
    pub port: u16,
    /// Blocks in `remote_block_ids`.
    pub blocks: usize,
}

fn opt_bool(
    obj: &Map<String, Value>,
    key: &'static str,
    field: &'static str,
) -> Result<bool, FieldError> {
    match obj.get(key) {
        None | Some(Value::Null) => Ok(false),
        Some(Value::Bool(b)) => Ok(*b),
        Some(_) => Err(FieldError::new(
            field,
            format!("`{field}` must be a boolean"),
        )),
    }
}

fn opt_string(
    obj: &Map<String, Value>,
    key: &'static str,
    field: &'static str,
) -> Result<Option<String>, FieldError> {
    match obj.get(key) {
        None | Some(Value::Null) => Ok(None),
        Some(Value::String(s)) => Ok(Some(s.clone())),
        Some(_) => Err(FieldError::new(
            field,
            format!("`{field}` must be a string"),
        )),
    }
}

/// The number of block ids in `remote_block_ids`: per-group lists
/// (`[[1, 2], [3]]`, current vLLM) or one flat list (`[1, 2]`, older).
fn block_count(value: Option<&Value>) -> Result<usize, FieldError> {
    const FIELD: &str = "kv_transfer_params.remote_block_ids";
    let is_id = |v: &Value| v.as_u64().is_some();
    let bad = || {
        FieldError::new(
            FIELD,
            format!("`{FIELD}` must be a list of block ids, or a list of such lists (one per KV-cache group)"),
        )
    };
    let list = match value {
        None | Some(Value::Null) => return Ok(0),
        Some(Value::Array(list)) => list,
        Some(_) => return Err(bad()),
    };
    if list.iter().all(is_id) {
        return Ok(list.len());
    }
    let mut most = 0;
    for group in list {
        match group {
            Value::Array(ids) if ids.iter().all(is_id) => most = most.max(ids.len()),
            _ => return Err(bad()),
        }
    }
    Ok(most)
}

impl KvTransferParams {
    /// Validates `kv_transfer_params`; `None` when absent or null.
    pub fn parse(value: Option<&Value>) -> Result<Option<Self>, FieldError> {
        let obj = match value {
            None | Some(Value::Null) => return Ok(None),
            Some(Value::Object(obj)) => obj,
            Some(_) => {
                return Err(FieldError::new(
                    "kv_transfer_params",
                    "kv_transfer_params: Input should be a valid dictionary",
                ))
            }
        };
        let remote_port =
            match obj.get("remote_port") {
                None | Some(Value::Null) => None,
                Some(v) => Some(v.as_u64().and_then(|p| u16::try_from(p).ok()).ok_or_else(
                    || {
                        FieldError::new(
                            "kv_transfer_params.remote_port",
                            "`kv_transfer_params.remote_port` must be a port number (0 to 65535)",
                        )
                    },
                )?),
            };
        let tp_size = match obj.get("tp_size") {
            None | Some(Value::Null) => None,
            Some(v) => Some(v.as_u64().filter(|&n| n > 0).ok_or_else(|| {
                FieldError::new(
                    "kv_transfer_params.tp_size",
                    "`kv_transfer_params.tp_size` must be a positive integer",
                )
            })?),
        };
        Ok(Some(KvTransferParams {
            do_remote_decode: opt_bool(
                obj,
                "do_remote_decode",
                "kv_transfer_params.do_remote_decode",
            )?,
            do_remote_prefill: opt_bool(
                obj,
                "do_remote_prefill",
                "kv_transfer_params.do_remote_prefill",
            )?,
            remote_engine_id: opt_string(
                obj,
                "remote_engine_id",
                "kv_transfer_params.remote_engine_id",
            )?,
            remote_request_id: opt_string(
                obj,
                "remote_request_id",
                "kv_transfer_params.remote_request_id",
            )?,
            remote_host: opt_string(obj, "remote_host", "kv_transfer_params.remote_host")?,
            remote_port,
            remote_blocks: block_count(obj.get("remote_block_ids"))?,
            tp_size,
        }))
    }

    /// The prefill to read from, when this is a decode leg vLLM would
    /// schedule a transfer for: `do_remote_prefill`, some `remote_block_ids`,
    /// and all of `remote_engine_id`, `remote_request_id`, `remote_host`,
    /// `remote_port`. A decode leg without them is what vLLM logs as
    /// "Got invalid KVTransferParams" and computes locally.
    pub fn remote(&self) -> Option<RemotePrefill<'_>> {
        if !self.do_remote_prefill || self.remote_blocks == 0 {
            return None;
        }
        Some(RemotePrefill {
            engine_id: self.remote_engine_id.as_deref()?,
            request_id: self.remote_request_id.as_deref()?,
            host: self.remote_host.as_deref()?,
            port: self.remote_port?,
            blocks: self.remote_blocks,
        })
    }
}

/// SGLang's bootstrap triple, validated (absent or null entries are `None`).
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Bootstrap {
    /// `bootstrap_host`: the prefill engine's host.
    pub host: Option<String>,
    /// `bootstrap_port`: its bootstrap server's port.
    pub port: Option<u16>,
    /// `bootstrap_room`: the rendezvous of the request's two legs.
    pub room: Option<u64>,
}

/// A scalar, or the one entry of an array of one per prompt.
fn single<'a>(
    value: Option<&'a Value>,
    field: &'static str,
) -> Result<Option<&'a Value>, FieldError> {
    match value {
        None | Some(Value::Null) => Ok(None),
        Some(Value::Array(items)) if items.len() == 1 => match &items[0] {
            Value::Null => Ok(None),
            v => Ok(Some(v)),
        },
        Some(Value::Array(items)) => Err(FieldError::new(
            field,
            format!(
                "`{field}` has {} entries: batched requests are not supported (one prompt, one entry)",
                items.len()
            ),
        )),
        Some(v) => Ok(Some(v)),
    }
}

impl Bootstrap {
    /// Validates the bootstrap fields of a request.
    pub fn parse(fields: &TransferFields) -> Result<Self, FieldError> {
        let host = match single(fields.bootstrap_host.as_ref(), "bootstrap_host")? {
            None => None,
            Some(Value::String(s)) if !s.is_empty() => Some(s.clone()),
            Some(_) => {
                return Err(FieldError::new(
                    "bootstrap_host",
                    "`bootstrap_host` must be a non-empty string",
                ))
            }
        };
        let port = match single(fields.bootstrap_port.as_ref(), "bootstrap_port")? {
            None => None,
            Some(v) => Some(
                v.as_u64()
                    .and_then(|p| u16::try_from(p).ok())
                    .filter(|&p| p > 0)
                    .ok_or_else(|| {
                        FieldError::new(
                            "bootstrap_port",
                            "`bootstrap_port` must be a port number (1 to 65535)",
                        )
                    })?,
            ),
        };
        let room = match single(fields.bootstrap_room.as_ref(), "bootstrap_room")? {
            None => None,
            Some(v) => Some(v.as_u64().ok_or_else(|| {
                FieldError::new(
                    "bootstrap_room",
                    "`bootstrap_room` must be a non-negative integer",
                )
            })?),
        };
        Ok(Bootstrap { host, port, room })
    }

    /// The room a prefill engine needs.
    pub fn prefill_room(&self) -> Result<u64, FieldError> {
        self.room
            .ok_or_else(|| FieldError::new("bootstrap_room", SGLANG_MISSING_ROOM))
    }

    /// The host, port and room a decode engine needs.
    pub fn decode_target(&self) -> Result<(&str, u16, u64), FieldError> {
        let room = self.prefill_room()?;
        let host = self.host.as_deref().ok_or_else(|| {
            FieldError::new(
                "bootstrap_host",
                "`bootstrap_host` is required on a decode engine: send requests through the router",
            )
        })?;
        let port = self.port.ok_or_else(|| {
            FieldError::new(
                "bootstrap_port",
                "`bootstrap_port` is required on a decode engine: send requests through the router",
            )
        })?;
        Ok((host, port, room))
    }
}

/// The modelled time to move `blocks` KV blocks at `us_per_block`
/// microseconds each, divided by the speedup like every simulated time;
/// capped at [`MAX_TRANSFER_DELAY`].
pub fn transfer_delay(blocks: usize, us_per_block: u64, speedup: f64) -> Duration {
    let nanos = (blocks as u128)
        .saturating_mul(u128::from(us_per_block))
        .saturating_mul(1000) as f64
        / speedup;
    if !(nanos.is_finite() && nanos > 0.0) {
        return Duration::ZERO;
    }
    let cap = MAX_TRANSFER_DELAY.as_nanos() as f64;
    Duration::from_nanos(nanos.round().min(cap) as u64)
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn params(v: Value) -> Result<Option<KvTransferParams>, FieldError> {
        KvTransferParams::parse(Some(&v))
    }

    fn field_of(v: Value) -> &'static str {
        params(v).expect_err("malformed").field
    }

    #[test]
    fn a_prefill_answer_relayed_verbatim_is_a_readable_remote() {
        let p = params(json!({
            "do_remote_prefill": true, "do_remote_decode": false,
            "remote_block_ids": [[4, 5, 6]], "remote_engine_id": "w0@127.0.0.1:8100",
            "remote_request_id": "w0-0-7", "remote_host": "127.0.0.1", "remote_port": 8100,
            "tp_size": 1, "transfer_id": "ignored",
        }))
        .expect("valid")
        .expect("present");
        assert_eq!(
            p.remote(),
            Some(RemotePrefill {
                engine_id: "w0@127.0.0.1:8100",
                request_id: "w0-0-7",
                host: "127.0.0.1",
                port: 8100,
                blocks: 3,
            })
        );
        assert_eq!(p.tp_size, Some(1));
        // The flat layout of older releases counts the same.
        let flat = params(json!({"remote_block_ids": [4, 5]}))
            .expect("ok")
            .expect("some");
        assert_eq!(flat.remote_blocks, 2);
    }

    #[test]
    fn a_router_prefill_leg_with_nulls_is_valid_and_asks_for_a_hold() {
        let p = params(json!({
            "do_remote_decode": true, "do_remote_prefill": false, "remote_engine_id": null,
            "remote_block_ids": null, "remote_host": null, "remote_port": null,
        }))
        .expect("valid")
        .expect("present");
        assert!(p.do_remote_decode && !p.do_remote_prefill);
        assert_eq!(p.remote(), None);
        assert_eq!(KvTransferParams::parse(None), Ok(None));
        assert_eq!(KvTransferParams::parse(Some(&Value::Null)), Ok(None));
    }

    #[test]
    fn a_decode_leg_missing_a_field_has_no_remote() {
        let full = json!({
            "do_remote_prefill": true, "remote_block_ids": [[1]], "remote_engine_id": "e",
            "remote_request_id": "r", "remote_host": "h", "remote_port": 1,
        });
        for key in [
            "remote_engine_id",
            "remote_request_id",
            "remote_host",
            "remote_port",
            "remote_block_ids",
        ] {
            let mut v = full.clone();
            v.as_object_mut().expect("object").remove(key);
            let p = params(v).expect("valid").expect("present");
            assert_eq!(p.remote(), None, "without {key}");
        }
        let mut v = full.clone();
        v["remote_block_ids"] = json!([[]]);
        assert_eq!(params(v).expect("ok").expect("some").remote(), None);
        assert!(params(full).expect("ok").expect("some").remote().is_some());
    }

    #[test]
    fn malformed_transfer_params_name_the_field() {
        assert_eq!(field_of(json!("x")), "kv_transfer_params");
        assert_eq!(field_of(json!([1])), "kv_transfer_params");
        assert_eq!(
            params(json!(true)).expect_err("bad").message,
            "kv_transfer_params: Input should be a valid dictionary"
        );
        for (key, bad, field) in [
            (
                "do_remote_decode",
                json!("yes"),
                "kv_transfer_params.do_remote_decode",
            ),
            (
                "do_remote_prefill",
                json!(1),
                "kv_transfer_params.do_remote_prefill",
            ),
            (
                "remote_engine_id",
                json!(5),
                "kv_transfer_params.remote_engine_id",
            ),
            (
                "remote_request_id",
                json!([]),
                "kv_transfer_params.remote_request_id",
            ),
            ("remote_host", json!({}), "kv_transfer_params.remote_host"),
            (
                "remote_port",
                json!("8100"),
                "kv_transfer_params.remote_port",
            ),
            (
                "remote_port",
                json!(70000),
                "kv_transfer_params.remote_port",
            ),
            ("remote_port", json!(-1), "kv_transfer_params.remote_port"),
            (
                "remote_block_ids",
                json!([["a"]]),
                "kv_transfer_params.remote_block_ids",
            ),
            (
                "remote_block_ids",
                json!([1, [2]]),
                "kv_transfer_params.remote_block_ids",
            ),
            (
                "remote_block_ids",
                json!(3),
                "kv_transfer_params.remote_block_ids",
            ),
            ("tp_size", json!(0), "kv_transfer_params.tp_size"),
        ] {
            assert_eq!(field_of(json!({ key: bad })), field, "{key}: {bad}");
        }
    }

    fn bootstrap(host: Value, port: Value, room: Value) -> Result<Bootstrap, FieldError> {
        let mut obj = json!({"bootstrap_host": host, "bootstrap_port": port, "bootstrap_room": room, "prompt": "x"});
        let fields = TransferFields::take(obj.as_object_mut().expect("object"));
        assert_eq!(obj, json!({"prompt": "x"}), "the fields are taken out");
        Bootstrap::parse(&fields)
    }

    #[test]
    fn bootstrap_fields_are_scalars_or_arrays_of_one() {
        let b = bootstrap(json!("127.0.0.1"), json!(8998), json!(42)).expect("valid");
        assert_eq!(b.decode_target(), Ok(("127.0.0.1", 8998, 42)));
        let b = bootstrap(json!(["h"]), json!([9]), json!([7])).expect("valid");
        assert_eq!(b.decode_target(), Ok(("h", 9, 7)));
        assert_eq!(b.prefill_room(), Ok(7));
        let b = bootstrap(json!(null), json!(null), json!((1u64 << 63) - 1)).expect("valid");
        assert_eq!(b.prefill_room(), Ok((1 << 63) - 1));
        assert_eq!(
            b.decode_target().expect_err("no host").field,
            "bootstrap_host"
        );
        let b = bootstrap(json!("h"), json!(null), json!(1)).expect("valid");
        assert_eq!(
            b.decode_target().expect_err("no port").field,
            "bootstrap_port"
        );
        let b = bootstrap(json!("h"), json!(1), json!(null)).expect("valid");
        let missing = b.prefill_room().expect_err("no room");
        assert_eq!(missing.message, SGLANG_MISSING_ROOM);
        assert_eq!(
            b.decode_target().expect_err("no room").field,
            "bootstrap_room"
        );
    }

    #[test]
    fn malformed_bootstrap_fields_name_the_field() {
        let ok = (json!("h"), json!(1), json!(1));
        let cases = [
            (json!(5), ok.1.clone(), ok.2.clone(), "bootstrap_host"),
            (json!(""), ok.1.clone(), ok.2.clone(), "bootstrap_host"),
            (ok.0.clone(), json!("8998"), ok.2.clone(), "bootstrap_port"),
            (ok.0.clone(), json!(0), ok.2.clone(), "bootstrap_port"),
            (ok.0.clone(), json!(65536), ok.2.clone(), "bootstrap_port"),
            (ok.0.clone(), ok.1.clone(), json!("abc"), "bootstrap_room"),
            (ok.0.clone(), ok.1.clone(), json!(-1), "bootstrap_room"),
            (ok.0.clone(), ok.1.clone(), json!(1.5), "bootstrap_room"),
            (ok.0.clone(), ok.1.clone(), json!([1, 2]), "bootstrap_room"),
            (ok.0.clone(), ok.1.clone(), json!([]), "bootstrap_room"),
        ];
        for (host, port, room, field) in cases {
            let e = bootstrap(host, port, room).expect_err("malformed");
            assert_eq!(e.field, field, "{}", e.message);
        }
        let e = bootstrap(ok.0, ok.1, json!([1, 2])).expect_err("batch");
        assert!(e.message.contains("2 entries"), "{}", e.message);
    }

    #[test]
    fn the_transfer_delay_is_blocks_times_the_rate_over_the_speedup() {
        assert_eq!(transfer_delay(7, 20, 1.0), Duration::from_micros(140));
        assert_eq!(
            transfer_delay(7, 50_000_000, 1000.0),
            Duration::from_millis(350)
        );
        assert_eq!(transfer_delay(0, 20, 1.0), Duration::ZERO);
        assert_eq!(
            transfer_delay(usize::MAX, u64::MAX, 1.0),
            MAX_TRANSFER_DELAY
        );
        assert_eq!(transfer_delay(3, 20, f64::INFINITY), Duration::ZERO);
    }
}
