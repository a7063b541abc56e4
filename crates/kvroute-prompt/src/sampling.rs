//! The request fields an engine would refuse, checked before a request is
//! forwarded, by the engines' own rules and in their words: a request that
//! no worker will take never reaches one (a `max_tokens` of 10^11 once made a
//! worker allocate for it and die, and the retries took the next workers
//! down with it).

use serde_json::value::RawValue;
use serde_json::Value;

/// The sampling fields of a body, as the scanner found them (raw JSON).
#[derive(Debug, Clone, Copy, Default)]
pub struct SamplingFields<'a> {
    /// `max_tokens`.
    pub max_tokens: Option<&'a RawValue>,
    /// `max_completion_tokens` (chat).
    pub max_completion_tokens: Option<&'a RawValue>,
    /// `n`.
    pub n: Option<&'a RawValue>,
    /// `temperature`.
    pub temperature: Option<&'a RawValue>,
    /// `logprobs`: an integer for completions, a boolean for chat.
    pub logprobs: Option<&'a RawValue>,
}

fn value(raw: Option<&RawValue>) -> Option<Value> {
    raw.and_then(|r| serde_json::from_str::<Value>(r.get()).ok())
        .filter(|v| !v.is_null())
}

/// An integer field at least `min`: its value, or the engines' message.
fn integer_at_least(field: &str, raw: Option<&RawValue>, min: u64) -> Result<Option<u64>, String> {
    let Some(v) = value(raw) else {
        return Ok(None);
    };
    match (v.as_u64(), v.as_i64()) {
        (Some(n), _) if n >= min => Ok(Some(n)),
        (Some(n), _) => Err(format!("{field} must be at least {min}, got {n}")),
        (None, Some(n)) => Err(format!("{field} must be at least {min}, got {n}")),
        (None, None) => Err(format!("{field}: Input should be a valid integer, got {v}")),
    }
}

/// Checks the fields' types and ranges as vLLM and SGLang do; the output
/// budget the request asks for (`max_completion_tokens`, then `max_tokens`).
pub fn check(fields: &SamplingFields<'_>, chat: bool) -> Result<Option<u64>, String> {
    let max_completion = if chat {
        integer_at_least("max_completion_tokens", fields.max_completion_tokens, 1)?
    } else {
        None
    };
    let max_tokens = integer_at_least("max_tokens", fields.max_tokens, 1)?;
    integer_at_least("n", fields.n, 1)?;
    if let Some(t) = value(fields.temperature) {
        match t.as_f64() {
            Some(t) if t >= 0.0 => {}
            Some(t) => return Err(format!("temperature must be non-negative, got {t}")),
            None => {
                return Err(format!(
                    "temperature: Input should be a valid number, got {t}"
                ))
            }
        }
    }
    if let Some(l) = value(fields.logprobs) {
        match (chat, &l) {
            (true, Value::Bool(_)) => {}
            (true, _) => {
                return Err(format!(
                    "logprobs: Input should be a valid boolean, got {l}"
                ))
            }
            (false, _) => {
                integer_at_least("logprobs", fields.logprobs, 0)?;
            }
        }
    }
    Ok(max_completion.or(max_tokens))
}

/// Whether a prompt of `prompt_tokens` with an output budget of `max_tokens`
/// fits a worker's context of `max_model_len` tokens; the engines' message
/// when it does not.
pub fn check_context(
    prompt_tokens: u64,
    max_tokens: Option<u64>,
    max_model_len: u64,
) -> Result<(), String> {
    if prompt_tokens >= max_model_len {
        return Err(format!(
            "This model's maximum context length is {max_model_len} tokens. However, your \
             request has {prompt_tokens} input tokens. Please reduce the length of the input."
        ));
    }
    match max_tokens {
        Some(out) if out > max_model_len - prompt_tokens => Err(format!(
            "'max_tokens' or 'max_completion_tokens' is too large: {out}. This model's maximum \
             context length is {max_model_len} tokens and your request has {prompt_tokens} \
             input tokens ({out} > {max_model_len} - {prompt_tokens})."
        )),
        _ => Ok(()),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn raw(json: &str) -> Box<RawValue> {
        RawValue::from_string(json.to_owned()).expect("valid JSON")
    }

    #[test]
    fn engines_refuse_what_the_router_refuses() {
        let (zero, big, neg) = (raw("0"), raw("99999999999"), raw("-3"));
        let (text, float, yes, null) = (raw("\"5\""), raw("2.5"), raw("true"), raw("null"));
        let none = SamplingFields::default;
        let max_tokens = |v| SamplingFields {
            max_tokens: Some(v),
            ..none()
        };
        assert_eq!(check(&max_tokens(&big), false), Ok(Some(99_999_999_999)));
        let err = check(&max_tokens(&zero), false).expect_err("0");
        assert_eq!(err, "max_tokens must be at least 1, got 0");
        for bad in [&neg, &text, &float] {
            assert!(check(&max_tokens(bad), false).is_err(), "{bad}");
        }
        assert_eq!(check(&max_tokens(&null), false), Ok(None));
        let n = SamplingFields {
            n: Some(&zero),
            ..none()
        };
        assert!(check(&n, false).is_err());
        let temperature = |v| SamplingFields {
            temperature: Some(v),
            ..none()
        };
        assert!(check(&temperature(&neg), false).is_err());
        assert!(check(&temperature(&text), false).is_err());
        assert_eq!(check(&temperature(&float), false), Ok(None));
        let logprobs = |v| SamplingFields {
            logprobs: Some(v),
            ..none()
        };
        assert!(check(&logprobs(&yes), true).is_ok());
        assert!(check(&logprobs(&yes), false).is_err());
        assert!(check(&logprobs(&zero), false).is_ok());
        assert!(check(&logprobs(&zero), true).is_err());
        let both = SamplingFields {
            max_tokens: Some(&big),
            max_completion_tokens: Some(&float),
            ..none()
        };
        assert!(
            check(&both, true).is_err(),
            "chat reads max_completion_tokens too"
        );
    }

    #[test]
    fn the_prompt_and_its_output_budget_must_fit_the_context() {
        assert_eq!(check_context(100, Some(28), 128), Ok(()));
        assert_eq!(check_context(100, None, 128), Ok(()));
        let err = check_context(100, Some(29), 128).expect_err("too long");
        assert!(
            err.contains("'max_tokens' or 'max_completion_tokens' is too large: 29"),
            "{err}"
        );
        assert!(err.contains("(29 > 128 - 100)"), "{err}");
        let err = check_context(128, Some(1), 128).expect_err("prompt too long");
        assert!(err.contains("your request has 128 input tokens"), "{err}");
        assert!(check_context(3, Some(99_999_999_999), 4096).is_err());
    }
}
