//! The bodies of a disaggregated request's two legs, in each engine's
//! protocol for handing a prompt's KV blocks from the prefill worker to the
//! decode worker.
//!
//! * vLLM (NIXL): the prefill leg is the request cut to one token, not
//!   streamed, asking for a remote decode (`kv_transfer_params` with
//!   `do_remote_decode: true`); its answer's `kv_transfer_params` say where
//!   the blocks are, and the decode leg is the client's request with them
//!   copied in unchanged. The two legs run one after the other.
//! * SGLang (bootstrap): both legs are the client's request with the same
//!   `bootstrap_host`, `bootstrap_port` and `bootstrap_room` (one room per
//!   prompt of a batch), sent at once; the engines meet in the room.
//!
//! Pure functions of bytes and values, so every field is unit-tested; the
//! proxy sends what they build.

use serde_json::{Map, Value};

/// Why a leg's body could not be built.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum HandoffError {
    /// The client's body is not a JSON object.
    #[error("the body must be a JSON object: {0}")]
    NotAnObject(String),
    /// The prefill worker's `kv_transfer_params` are neither an object nor
    /// `null`.
    #[error("the prefill worker's kv_transfer_params are not an object")]
    NoTransferParams,
}

/// `kv_transfer_params` of a vLLM prefill leg: compute the prompt, keep its
/// blocks for a remote decode, and say where they are.
fn remote_decode_request() -> Value {
    serde_json::json!({
        "do_remote_decode": true,
        "do_remote_prefill": false,
        "remote_engine_id": null,
        "remote_block_ids": null,
        "remote_host": null,
        "remote_port": null,
    })
}

fn object(body: &[u8]) -> Result<Map<String, Value>, HandoffError> {
    match serde_json::from_slice(body) {
        Ok(Value::Object(map)) => Ok(map),
        Ok(_) => Err(HandoffError::NotAnObject("not an object".into())),
        Err(e) => Err(HandoffError::NotAnObject(e.to_string())),
    }
}

fn bytes(map: Map<String, Value>) -> Vec<u8> {
    // A map of JSON values always serializes.
    serde_json::to_vec(&Value::Object(map)).unwrap_or_default()
}

/// vLLM's prefill leg: the client's request with `kv_transfer_params`
/// asking for a remote decode, `max_tokens: 1` (and
/// `max_completion_tokens: 1` where the client used it), `stream: false`,
/// and no `stream_options`, `min_tokens` or `min_completion_tokens`.
pub fn vllm_prefill_body(body: &[u8]) -> Result<Vec<u8>, HandoffError> {
    let mut map = one_token(object(body)?);
    map.insert("kv_transfer_params".into(), remote_decode_request());
    Ok(bytes(map))
}

/// A copy ahead of demand's body ([`super::replicate`]): the client's
/// request cut to one token, unstreamed, as [`vllm_prefill_body`] cuts it
/// but asking for no hand-off (each leg adds its own).
pub fn one_token_body(body: &[u8]) -> Result<Vec<u8>, HandoffError> {
    Ok(bytes(one_token(object(body)?)))
}

/// `map` asking for one token, unstreamed.
fn one_token(mut map: serde_json::Map<String, Value>) -> serde_json::Map<String, Value> {
    map.insert("max_tokens".into(), Value::from(1));
    if map.contains_key("max_completion_tokens") {
        map.insert("max_completion_tokens".into(), Value::from(1));
    }
    map.insert("stream".into(), Value::Bool(false));
    for dropped in ["stream_options", "min_tokens", "min_completion_tokens"] {
        map.remove(dropped);
    }
    map
}

/// The `kv_transfer_params` object of a vLLM prefill worker's answer;
/// `None` when it names none (absent or `null`): a connector that hands KV
/// over by the prompt itself (vLLM's `ExampleConnector` through a shared
/// folder, LMCache through its store) needs none, and its decode engine
/// finds the blocks from the request alone. Anything else there is an
/// error.
pub fn vllm_transfer_params(answer: &[u8]) -> Result<Option<Value>, HandoffError> {
    let map = object(answer)?;
    match map.get("kv_transfer_params") {
        Some(params @ Value::Object(_)) => Ok(Some(params.clone())),
        None | Some(Value::Null) => Ok(None),
        Some(_) => Err(HandoffError::NoTransferParams),
    }
}

/// vLLM's decode leg: the client's request, unchanged but for the prefill
/// answer's `kv_transfer_params`, copied as they came.
///
/// The body is one the router has already parsed. Where it names no
/// `kv_transfer_params` (the usual case) the field is appended before its
/// closing brace, byte for byte the rest, instead of parsing and writing
/// the whole prompt again; otherwise the field is replaced in a re-parse.
pub fn vllm_decode_body(body: &[u8], params: Option<&Value>) -> Result<Vec<u8>, HandoffError> {
    let Some(params) = params else {
        return Ok(body.to_vec());
    };
    if let Some(spliced) =
        super::rewrite::append_field(body, "kv_transfer_params", &params.to_string())
    {
        return Ok(spliced);
    }
    let mut map = object(body)?;
    map.insert("kv_transfer_params".into(), params.clone());
    Ok(bytes(map))
}

/// Where an SGLang decode engine fetches a request's blocks: the prefill
/// engine's host and bootstrap port, and one room per prompt.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Bootstrap {
    /// The prefill engine's host, as the decode engine reaches it.
    pub host: String,
    /// Its bootstrap server's port (`None`: the engine's default).
    pub port: Option<u16>,
    /// One room per prompt of the request, each below 2^63.
    pub rooms: Vec<u64>,
}

/// SGLang's bootstrap port when a prefill worker's spec names none.
pub const DEFAULT_BOOTSTRAP_PORT: u16 = 8998;

impl Bootstrap {
    /// A room from a random 64-bit number: below 2^63, as SGLang's rooms are.
    pub fn room(random: u64) -> u64 {
        random >> 1
    }
}

/// The prompts in an SGLang-bound body: `Some(n)` for a batch of `n`
/// (`prompt` or `text` a list of strings, or `prompt` or `input_ids` a
/// list of token lists), `None` for one prompt.
pub fn batch_size(body: &[u8]) -> Result<Option<usize>, HandoffError> {
    let map = object(body)?;
    let batch = |key: &str, item: fn(&Value) -> bool| match map.get(key) {
        Some(Value::Array(items)) if !items.is_empty() && items.iter().all(item) => {
            Some(items.len())
        }
        _ => None,
    };
    Ok(batch("prompt", |v| v.is_string() || v.is_array())
        .or_else(|| batch("text", Value::is_string))
        .or_else(|| batch("input_ids", Value::is_array)))
}

/// Both SGLang legs' body: the client's request with `bootstrap_host`,
/// `bootstrap_port` and `bootstrap_room` set, each a list of one value per
/// prompt when `batch` is `Some`.
pub fn sglang_body(
    body: &[u8],
    bootstrap: &Bootstrap,
    batch: Option<usize>,
) -> Result<Vec<u8>, HandoffError> {
    let mut map = object(body)?;
    let host = Value::from(bootstrap.host.as_str());
    let port = bootstrap.port.map_or(Value::Null, Value::from);
    let rooms: Vec<Value> = bootstrap.rooms.iter().map(|&r| Value::from(r)).collect();
    let (host, port, room) = match batch {
        None => (host, port, rooms.first().cloned().unwrap_or(Value::Null)),
        Some(n) => (
            Value::Array(vec![host; n]),
            Value::Array(vec![port; n]),
            Value::Array(rooms.into_iter().take(n).collect()),
        ),
    };
    map.insert("bootstrap_host".into(), host);
    map.insert("bootstrap_port".into(), port);
    map.insert("bootstrap_room".into(), room);
    Ok(bytes(map))
}

/// SGLang's native answers carry each prompt token's log-probability in
/// `meta_info.input_token_logprobs`; a decode engine reports only those it
/// computed, so the prefill engine's come first. Prepends them in `decode`
/// (an answer, or one streamed chunk) when both have the list.
pub fn merge_input_logprobs(prefill: &Value, decode: &mut Value) {
    let path = |v: &Value| v.get("meta_info")?.get("input_token_logprobs").cloned();
    let Some(Value::Array(mut merged)) = path(prefill) else {
        return;
    };
    let Some(Value::Array(own)) = decode
        .get_mut("meta_info")
        .and_then(|m| m.get_mut("input_token_logprobs"))
    else {
        return;
    };
    merged.append(own);
    *own = merged;
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn parse(bytes: &[u8]) -> Value {
        serde_json::from_slice(bytes).expect("JSON")
    }

    #[test]
    fn the_vllm_prefill_leg_is_the_request_cut_to_one_unstreamed_token() {
        let client = json!({"model": "m", "prompt": [1, 2, 3], "max_tokens": 300, "stream": true,
            "stream_options": {"include_usage": true}, "min_tokens": 5, "temperature": 0.5});
        let leg = parse(&vllm_prefill_body(client.to_string().as_bytes()).expect("leg"));
        assert_eq!(
            leg,
            json!({"model": "m", "prompt": [1, 2, 3], "max_tokens": 1, "stream": false,
                "temperature": 0.5, "kv_transfer_params": {"do_remote_decode": true,
                "do_remote_prefill": false, "remote_engine_id": null, "remote_block_ids": null,
                "remote_host": null, "remote_port": null}})
        );
        let chat = json!({"messages": [], "max_completion_tokens": 50, "min_completion_tokens": 2});
        let leg = parse(&vllm_prefill_body(chat.to_string().as_bytes()).expect("leg"));
        assert_eq!(leg["max_completion_tokens"], 1);
        assert_eq!(leg["max_tokens"], 1);
        assert!(leg.get("min_completion_tokens").is_none());
        assert!(vllm_prefill_body(b"[1]").is_err());
        assert!(vllm_prefill_body(b"{").is_err());
    }

    #[test]
    fn the_vllm_decode_leg_is_the_request_with_the_prefills_params_verbatim() {
        let answer = json!({"id": "x", "choices": [], "kv_transfer_params": {
            "do_remote_prefill": true, "do_remote_decode": false, "remote_block_ids": [[1, 2, 3]],
            "remote_engine_id": "e0", "remote_request_id": "r", "remote_host": "127.0.0.1",
            "remote_port": 5600, "tp_size": 1}});
        let params = vllm_transfer_params(answer.to_string().as_bytes())
            .expect("params")
            .expect("named");
        assert_eq!(params, answer["kv_transfer_params"]);
        let params = &params;
        let client = json!({"prompt": "hi", "max_tokens": 300, "stream": true});
        let leg =
            parse(&vllm_decode_body(client.to_string().as_bytes(), Some(params)).expect("leg"));
        assert_eq!(leg["kv_transfer_params"], answer["kv_transfer_params"]);
        assert_eq!(
            (leg["max_tokens"].clone(), leg["stream"].clone()),
            (json!(300), json!(true))
        );
        // Appended to the client's bytes, or replacing a field it sent.
        let spaced = b" {\"prompt\": [1, 2],\n \"stream\": false }\n";
        let leg = vllm_decode_body(spaced, Some(params)).expect("leg");
        assert!(leg.starts_with(b" {\"prompt\": [1, 2],\n \"stream\": false ,"));
        assert_eq!(parse(&leg)["kv_transfer_params"], *params);
        let leg = parse(&vllm_decode_body(b"{ }", Some(params)).expect("leg"));
        assert_eq!(leg, json!({"kv_transfer_params": *params}));
        let stale = json!({"prompt": "hi", "kv_transfer_params": {"do_remote_prefill": false}});
        let leg =
            parse(&vllm_decode_body(stale.to_string().as_bytes(), Some(params)).expect("leg"));
        assert_eq!(leg["kv_transfer_params"], *params);
        assert!(vllm_decode_body(b"[1]", Some(params)).is_err());
        // A connector that hands KV over by the prompt names none: the
        // decode leg is the client's request as it came.
        for missing in [json!({"choices": []}), json!({"kv_transfer_params": null})] {
            assert_eq!(
                vllm_transfer_params(missing.to_string().as_bytes()),
                Ok(None)
            );
        }
        let client = br#"{"prompt": "hi", "max_tokens": 3}"#;
        assert_eq!(
            vllm_decode_body(client, None).expect("leg"),
            client.to_vec()
        );
        let bad = json!({"kv_transfer_params": "elsewhere"});
        assert_eq!(
            vllm_transfer_params(bad.to_string().as_bytes()),
            Err(HandoffError::NoTransferParams)
        );
    }

    #[test]
    fn sglang_legs_share_the_bootstrap_triple_with_a_room_per_prompt() {
        let bootstrap = Bootstrap {
            host: "10.0.0.5".into(),
            port: Some(8998),
            rooms: vec![Bootstrap::room(u64::MAX), 7],
        };
        assert_eq!(bootstrap.rooms[0], (1 << 63) - 1);
        let one = json!({"prompt": "hello", "max_tokens": 8});
        let body = one.to_string();
        assert_eq!(batch_size(body.as_bytes()), Ok(None));
        let leg = parse(&sglang_body(body.as_bytes(), &bootstrap, None).expect("leg"));
        assert_eq!(leg["bootstrap_host"], "10.0.0.5");
        assert_eq!(leg["bootstrap_port"], 8998);
        assert_eq!(leg["bootstrap_room"], json!((1u64 << 63) - 1));
        assert_eq!(leg["prompt"], "hello");
        let two = json!({"prompt": ["a", "b"]}).to_string();
        assert_eq!(batch_size(two.as_bytes()), Ok(Some(2)));
        let leg = parse(&sglang_body(two.as_bytes(), &bootstrap, Some(2)).expect("leg"));
        assert_eq!(leg["bootstrap_host"], json!(["10.0.0.5", "10.0.0.5"]));
        assert_eq!(leg["bootstrap_port"], json!([8998, 8998]));
        assert_eq!(leg["bootstrap_room"], json!([(1u64 << 63) - 1, 7]));
        let no_port = Bootstrap {
            port: None,
            ..bootstrap
        };
        let leg = parse(&sglang_body(body.as_bytes(), &no_port, None).expect("leg"));
        assert_eq!(leg["bootstrap_port"], Value::Null);
    }

    #[test]
    fn batches_are_lists_of_prompts_not_one_prompt_of_token_ids() {
        let size = |v: Value| batch_size(v.to_string().as_bytes()).expect("object");
        assert_eq!(size(json!({"prompt": [1, 2, 3]})), None);
        assert_eq!(size(json!({"prompt": [[1, 2], [3]]})), Some(2));
        assert_eq!(size(json!({"text": ["a", "b", "c"]})), Some(3));
        assert_eq!(size(json!({"input_ids": [[1], [2]]})), Some(2));
        assert_eq!(size(json!({"input_ids": [1, 2]})), None);
        assert_eq!(size(json!({"messages": [{"role": "user"}]})), None);
        assert_eq!(size(json!({"prompt": []})), None);
    }

    #[test]
    fn the_prefills_input_logprobs_come_first() {
        let prefill = json!({"meta_info": {"input_token_logprobs": [[-0.1, 1], [-0.2, 2]]}});
        let mut decode = json!({"meta_info": {"input_token_logprobs": [[-0.3, 3]]}, "text": "x"});
        merge_input_logprobs(&prefill, &mut decode);
        assert_eq!(
            decode["meta_info"]["input_token_logprobs"],
            json!([[-0.1, 1], [-0.2, 2], [-0.3, 3]])
        );
        let mut openai = json!({"choices": []});
        merge_input_logprobs(&prefill, &mut openai);
        assert_eq!(openai, json!({"choices": []}));
    }
}
