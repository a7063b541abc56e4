//! SGLang's native `/generate`, as SGLang engines serve it: `text` or
//! `input_ids` in, `sampling_params.max_new_tokens`, `stream`,
//! `return_logprob`; answers of `text` and `meta_info` (token counts,
//! `cached_tokens`, `finish_reason` and, when asked, the prompt's
//! `input_token_logprobs`). Served by SGLang-flavoured engines only.
//!
//! A prefill engine of a disaggregated fleet reports the log-probability of
//! every prompt token it computed; a decode engine, which received the
//! prompt's KV, reports none, so a router in front of both merges the two
//! (prefill's first).

use serde_json::{json, Map, Value};

use crate::engine::Usage;

use super::openai::DEFAULT_MAX_TOKENS;
use super::ApiError;

fn bad(message: impl Into<String>) -> ApiError {
    ApiError::bad_request(message)
}

/// The prompt field of a `/generate` body: `input_ids` when given, else `text`.
pub fn prompt_field(obj: &Map<String, Value>) -> Result<&Value, ApiError> {
    let given = |key: &str| obj.get(key).filter(|v| !v.is_null());
    given("input_ids")
        .or_else(|| given("text"))
        .ok_or_else(|| bad("`text` or `input_ids` is required"))
}

/// `sampling_params.max_new_tokens`, at least 1.
pub fn max_new_tokens(obj: &Map<String, Value>) -> Result<usize, ApiError> {
    let params = match obj.get("sampling_params") {
        None | Some(Value::Null) => return Ok(DEFAULT_MAX_TOKENS),
        Some(Value::Object(p)) => p,
        Some(_) => return Err(bad("`sampling_params` must be an object")),
    };
    match params.get("max_new_tokens") {
        None | Some(Value::Null) => Ok(DEFAULT_MAX_TOKENS),
        Some(v) => match v.as_u64() {
            Some(0) => Err(bad("`sampling_params.max_new_tokens` must be at least 1")),
            Some(n) => {
                usize::try_from(n).map_err(|_| bad("`sampling_params.max_new_tokens` is too large"))
            }
            None => Err(bad(
                "`sampling_params.max_new_tokens` must be a non-negative integer",
            )),
        },
    }
}

/// `return_logprob`.
pub fn return_logprob(obj: &Map<String, Value>) -> Result<bool, ApiError> {
    match obj.get("return_logprob") {
        None | Some(Value::Null) => Ok(false),
        Some(Value::Bool(b)) => Ok(*b),
        Some(_) => Err(bad("`return_logprob` must be a boolean")),
    }
}

/// `input_token_logprobs` of `prompt` as SGLang lists them: one
/// `[logprob, token_id, null]` per token, the first token's log-probability
/// null (nothing precedes it). The values are the mock's, a fixed function
/// of each id, so that two engines agree on them.
pub fn input_token_logprobs(prompt: &[u64]) -> Value {
    let entries = prompt.iter().enumerate().map(|(i, &id)| {
        let logprob = if i == 0 {
            Value::Null
        } else {
            json!(-((id % 97 + 1) as f64) / 10.0)
        };
        json!([logprob, id, null])
    });
    Value::Array(entries.collect())
}

/// `meta_info` of an answer or a chunk: `usage` when finished.
fn meta_info(id: &str, usage: Option<&Usage>, input_logprobs: Option<&Value>) -> Value {
    let mut meta = json!({"id": id, "finish_reason": null});
    if let Some(u) = usage {
        meta["prompt_tokens"] = json!(u.prompt_tokens);
        meta["completion_tokens"] = json!(u.completion_tokens);
        meta["cached_tokens"] = json!(u.cached_tokens);
        meta["finish_reason"] = json!({"type": "length", "length": u.completion_tokens});
    }
    if let Some(list) = input_logprobs {
        meta["input_token_logprobs"] = list.clone();
    }
    meta
}

/// The non-streamed answer.
pub fn full(id: &str, text: &str, usage: &Usage, input_logprobs: Option<&Value>) -> Value {
    json!({"text": text, "meta_info": meta_info(id, Some(usage), input_logprobs)})
}

/// One streamed chunk: the text so far (SGLang streams it whole each
/// time), the usage on the last; the prompt's log-probabilities ride on
/// every chunk, as SGLang sends them.
pub fn chunk(id: &str, text: &str, usage: Option<&Usage>, input_logprobs: Option<&Value>) -> Value {
    json!({"text": text, "meta_info": meta_info(id, usage, input_logprobs)})
}

#[cfg(test)]
mod tests {
    use super::*;

    fn obj(v: Value) -> Map<String, Value> {
        match v {
            Value::Object(m) => m,
            _ => Map::new(),
        }
    }

    #[test]
    fn bodies_read_as_sglang_reads_them() {
        let ids = obj(
            json!({"input_ids": [1, 2], "text": "x", "sampling_params": {"max_new_tokens": 7}}),
        );
        assert_eq!(prompt_field(&ids).ok(), Some(&json!([1, 2])));
        assert_eq!(max_new_tokens(&ids).ok(), Some(7));
        let text = obj(json!({"text": "hello", "input_ids": null, "return_logprob": true}));
        assert_eq!(prompt_field(&text).ok(), Some(&json!("hello")));
        assert_eq!(max_new_tokens(&text).ok(), Some(DEFAULT_MAX_TOKENS));
        assert_eq!(return_logprob(&text).ok(), Some(true));
        for (body, message) in [
            (json!({}), "`text` or `input_ids` is required"),
            (
                json!({"text": "a", "sampling_params": 3}),
                "must be an object",
            ),
            (
                json!({"text": "a", "sampling_params": {"max_new_tokens": 0}}),
                "at least 1",
            ),
            (
                json!({"text": "a", "return_logprob": "yes"}),
                "must be a boolean",
            ),
        ] {
            let o = obj(body);
            let e = prompt_field(&o)
                .err()
                .or_else(|| max_new_tokens(&o).err())
                .or_else(|| return_logprob(&o).err())
                .map(|e| e.message().to_owned());
            assert!(e.as_deref().is_some_and(|m| m.contains(message)), "{e:?}");
        }
    }

    #[test]
    fn answers_carry_meta_info_and_the_prompts_logprobs() {
        let usage = Usage {
            prompt_tokens: 3,
            completion_tokens: 2,
            cached_tokens: 1,
        };
        let logprobs = input_token_logprobs(&[5, 96, 97]);
        assert_eq!(
            logprobs,
            json!([[null, 5, null], [-9.7, 96, null], [-0.1, 97, null]])
        );
        let answer = full("g-1", "ab", &usage, Some(&logprobs));
        assert_eq!(answer["text"], "ab");
        let meta = &answer["meta_info"];
        assert_eq!(
            (meta["prompt_tokens"].clone(), meta["cached_tokens"].clone()),
            (json!(3), json!(1))
        );
        assert_eq!(
            meta["finish_reason"],
            json!({"type": "length", "length": 2})
        );
        assert_eq!(meta["input_token_logprobs"], logprobs);
        let first = chunk("g-1", "a", None, None);
        assert_eq!(
            first["meta_info"],
            json!({"id": "g-1", "finish_reason": null})
        );
    }
}
