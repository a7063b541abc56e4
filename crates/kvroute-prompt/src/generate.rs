//! SGLang's native `/generate` body, read for routing: `input_ids` or
//! `text` (one prompt; a list of them is a batch, routed by load only, as a
//! batch has no single prefix), `sampling_params.max_new_tokens`, `stream`,
//! `return_logprob` and `lora_path`.

use serde_json::{Map, Value};

use crate::body::{bad, handoff_field_in, token_list, ParseError, RoutingRequest, TextPrompt};
use crate::responses::flag;

/// Reads a `/generate` body. Its answers carry their usage in every
/// `meta_info`, so nothing is asked of a stream (`include_usage` is set).
pub fn parse_generate(body: &[u8]) -> Result<RoutingRequest, ParseError> {
    let value: Value =
        serde_json::from_slice(body).map_err(|e| bad(format!("invalid JSON body: {e}")))?;
    let Value::Object(obj) = value else {
        return Err(bad("the body must be a JSON object"));
    };
    let mut req = RoutingRequest {
        stream: flag(&obj, "stream")?,
        input_logprobs: flag(&obj, "return_logprob")?,
        include_usage: true,
        max_tokens: max_new_tokens(&obj)?,
        handoff_field: handoff_field_in(&obj),
        engine_priority: crate::body::priority_value(obj.get("priority"))?,
        lora_name: match obj.get("lora_path") {
            None | Some(Value::Null) => None,
            Some(Value::String(s)) => Some(s.clone()),
            Some(_) => return Err(bad("`lora_path` must be a string")),
        },
        ..RoutingRequest::default()
    };
    let given = |key: &str| obj.get(key).filter(|v| !v.is_null());
    match (given("input_ids"), given("text")) {
        (Some(Value::Array(items)), _) if items.iter().all(Value::is_array) => {}
        (Some(Value::Array(items)), _) => req.tokens = Some(token_list(items, "input_ids")?),
        (Some(_), _) => return Err(bad("`input_ids` must be a list of token ids")),
        (None, Some(Value::String(text))) => {
            req.text = Some(TextPrompt::Completion(Value::String(text.clone())));
        }
        (None, Some(Value::Array(texts))) if texts.iter().all(Value::is_string) => {}
        (None, Some(_)) => return Err(bad("`text` must be a string or a list of strings")),
        (None, None) => return Err(bad("`text` or `input_ids` is required")),
    }
    Ok(req)
}

fn max_new_tokens(obj: &Map<String, Value>) -> Result<Option<u64>, ParseError> {
    let params = match obj.get("sampling_params") {
        None | Some(Value::Null) => return Ok(None),
        Some(Value::Object(p)) => p,
        Some(_) => return Err(bad("`sampling_params` must be an object")),
    };
    match params.get("max_new_tokens") {
        None | Some(Value::Null) => Ok(None),
        Some(v) => v
            .as_u64()
            .map(Some)
            .ok_or_else(|| bad("`sampling_params.max_new_tokens` must be a non-negative integer")),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn parse(v: Value) -> Result<RoutingRequest, ParseError> {
        parse_generate(v.to_string().as_bytes())
    }

    #[test]
    fn a_generate_body_reads_as_sglang_reads_it() {
        let ids = parse(
            json!({"input_ids": [1, 2, 3], "text": "ignored", "stream": true,
            "return_logprob": true, "sampling_params": {"max_new_tokens": 9}, "lora_path": "a"}),
        )
        .expect("valid");
        assert_eq!(ids.tokens, Some(vec![1, 2, 3]));
        assert!(ids.stream && ids.input_logprobs && ids.include_usage);
        assert_eq!(
            (ids.max_tokens, ids.lora_name.as_deref()),
            (Some(9), Some("a"))
        );
        let text = parse(json!({"text": "hello", "input_ids": null})).expect("valid");
        assert_eq!(text.text, Some(TextPrompt::Completion(json!("hello"))));
        assert!(!text.input_logprobs && text.tokens.is_none());
        // Batches route by load: no single prompt.
        for batch in [
            json!({"input_ids": [[1], [2]]}),
            json!({"text": ["a", "b"]}),
        ] {
            let r = parse(batch).expect("valid");
            assert!(r.tokens.is_none() && r.text.is_none());
        }
    }

    #[test]
    fn malformed_generate_bodies_name_the_field() {
        for (body, field) in [
            (json!({}), "`text` or `input_ids` is required"),
            (json!({"input_ids": "1 2"}), "`input_ids` must be"),
            (json!({"input_ids": [1, -2]}), "`input_ids` must hold"),
            (json!({"text": 5}), "`text` must be"),
            (
                json!({"text": "a", "stream": "yes"}),
                "`stream` must be a boolean",
            ),
            (
                json!({"text": "a", "sampling_params": []}),
                "`sampling_params` must be",
            ),
            (
                json!({"text": "a", "sampling_params": {"max_new_tokens": -1}}),
                "max_new_tokens",
            ),
            (json!({"text": "a", "lora_path": 1}), "`lora_path` must be"),
            (json!([1]), "must be a JSON object"),
        ] {
            let e = parse(body).expect_err(field);
            assert!(e.0.contains(field), "{e:?} for {field}");
        }
    }
}
