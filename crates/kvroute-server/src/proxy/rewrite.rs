//! The body rewrites the proxy makes before forwarding: the chosen
//! data-parallel rank (SGLang's body field), the router's image identities
//! (`mm_hashes`, for SGLang) and `stream_options.include_usage` (so a stream
//! ends with the usage the accuracy metric reads). A field the body lacks is
//! appended before its closing brace, without parsing the prompt again.

use kvroute_core::index::DpRank;
use serde_json::Value;

use kvroute_prompt::body::ParseError;

fn bad(message: impl Into<String>) -> ParseError {
    ParseError(message.into())
}

/// Adds `"data_parallel_rank": rank` to a JSON object body (SGLang's way of
/// choosing a rank).
pub fn inject_dp_rank(body: &[u8], rank: DpRank) -> Result<Vec<u8>, ParseError> {
    if let Some(b) = append_field(body, "data_parallel_rank", &rank.to_string()) {
        return Ok(b);
    }
    inject_field(body, "data_parallel_rank", Value::from(rank.0))
}

/// Adds `"mm_hashes": [h, …]` (one unsigned 64-bit integer per image, in
/// order) to a JSON object body, so an SGLang worker seeds each image's pad
/// ids with the identity the router hashed (SGLang honours client-supplied
/// hashes) instead of hashing the processed image itself.
pub fn inject_mm_hashes(body: &[u8], hashes: &[u64]) -> Result<Vec<u8>, ParseError> {
    let list: Vec<String> = hashes.iter().map(u64::to_string).collect();
    if let Some(b) = append_field(body, "mm_hashes", &format!("[{}]", list.join(","))) {
        return Ok(b);
    }
    inject_field(
        body,
        "mm_hashes",
        Value::Array(hashes.iter().map(|&h| Value::from(h)).collect()),
    )
}

/// Sets `stream_options.include_usage` to `true` (keeping any other stream
/// options), so a streaming engine ends with its usage chunk, whose
/// `cached_tokens` the accuracy metric reads; the proxy strips that chunk
/// again for clients that did not ask for it.
pub fn inject_include_usage(body: &[u8]) -> Result<Vec<u8>, ParseError> {
    if let Some(b) = append_field(body, "stream_options", r#"{"include_usage":true}"#) {
        return Ok(b);
    }
    let mut value: Value =
        serde_json::from_slice(body).map_err(|e| bad(format!("invalid JSON body: {e}")))?;
    let obj = value
        .as_object_mut()
        .ok_or_else(|| bad("the body must be a JSON object"))?;
    let options = obj
        .entry("stream_options")
        .or_insert_with(|| Value::Object(serde_json::Map::new()));
    if !options.is_object() {
        *options = Value::Object(serde_json::Map::new());
    }
    if let Some(o) = options.as_object_mut() {
        o.insert("include_usage".into(), Value::Bool(true));
    }
    serde_json::to_vec(&value).map_err(|e| bad(e.to_string()))
}

/// The cheap path of the injections above, for a body already validated as
/// a JSON object: `,"key":value` written before its closing brace, without
/// parsing the (possibly long) prompt again. `None` (use the full parse)
/// when `"key"` appears anywhere in the body, since it might be a top-level
/// key to merge with or replace, or when the body does not end in `}`.
pub(super) fn append_field(body: &[u8], key: &str, value_json: &str) -> Option<Vec<u8>> {
    let quoted = format!("\"{key}\"");
    if contains(body, quoted.as_bytes()) {
        return None;
    }
    let end = body.iter().rposition(|b| !b.is_ascii_whitespace())?;
    if body[end] != b'}' {
        return None;
    }
    let before = body[..end].iter().rposition(|b| !b.is_ascii_whitespace())?;
    let empty = body[before] == b'{';
    let mut out = Vec::with_capacity(body.len() + quoted.len() + value_json.len() + 2);
    out.extend_from_slice(&body[..end]);
    if !empty {
        out.push(b',');
    }
    out.extend_from_slice(quoted.as_bytes());
    out.push(b':');
    out.extend_from_slice(value_json.as_bytes());
    out.push(b'}');
    Some(out)
}

/// Whether `needle` (which starts with a quote) occurs in `haystack`.
fn contains(haystack: &[u8], needle: &[u8]) -> bool {
    let Some((&first, rest)) = needle.split_first() else {
        return true;
    };
    let mut at = 0;
    while let Some(i) = haystack[at..].iter().position(|&b| b == first) {
        let start = at + i + 1;
        if haystack[start..].starts_with(rest) {
            return true;
        }
        at = start;
    }
    false
}

fn inject_field(body: &[u8], key: &str, field: Value) -> Result<Vec<u8>, ParseError> {
    let mut value: Value =
        serde_json::from_slice(body).map_err(|e| bad(format!("invalid JSON body: {e}")))?;
    let obj = value
        .as_object_mut()
        .ok_or_else(|| bad("the body must be a JSON object"))?;
    obj.insert(key.into(), field);
    serde_json::to_vec(&value).map_err(|e| bad(e.to_string()))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn appended_fields_equal_the_parsed_rewrite_and_unsafe_bodies_fall_back() {
        let full = |body: &[u8], key: &str, v: Value| {
            let mut doc: Value = serde_json::from_slice(body).expect("json");
            doc.as_object_mut().expect("object").insert(key.into(), v);
            doc
        };
        let parse = |b: &[u8]| serde_json::from_slice::<Value>(b).expect("valid JSON out");
        for body in [
            &br#"{"prompt":[1,2,3],"stream":true}"#[..],
            br#"{}"#,
            b"{ \"prompt\": \"hi\" }\n  ",
            br#"{"messages":[{"role":"user","content":"}"}]}"#,
        ] {
            let out = inject_dp_rank(body, DpRank(3)).expect("injects");
            assert_eq!(
                parse(&out),
                full(body, "data_parallel_rank", serde_json::json!(3))
            );
            let out = inject_mm_hashes(body, &[u64::MAX, 7]).expect("injects");
            assert_eq!(
                parse(&out),
                full(body, "mm_hashes", serde_json::json!([u64::MAX, 7]))
            );
            let out = inject_include_usage(body).expect("injects");
            assert_eq!(
                parse(&out),
                full(
                    body,
                    "stream_options",
                    serde_json::json!({"include_usage": true})
                )
            );
        }
        // The key already present (or only mentioned): merged or replaced, never duplicated.
        let body = br#"{"stream_options":{"continuous_usage_stats":true},"prompt":"x"}"#;
        assert!(append_field(body, "stream_options", "{}").is_none());
        let out = parse(&inject_include_usage(body).expect("injects"));
        assert_eq!(
            out["stream_options"],
            serde_json::json!({"continuous_usage_stats": true, "include_usage": true})
        );
        let body = br#"{"prompt":"say \"data_parallel_rank\"","data_parallel_rank":0}"#;
        assert!(append_field(body, "data_parallel_rank", "1").is_none());
        assert_eq!(
            parse(&inject_dp_rank(body, DpRank(1)).expect("injects"))["data_parallel_rank"],
            1
        );
        assert!(append_field(b"[1]", "k", "1").is_none());
    }

    #[test]
    fn the_dp_rank_is_added_to_the_body_and_nothing_else_changes() {
        let out = inject_dp_rank(br#"{"model":"m","prompt":[1]}"#, DpRank(3)).expect("valid");
        assert_eq!(
            String::from_utf8(out).expect("utf8"),
            r#"{"model":"m","prompt":[1],"data_parallel_rank":3}"#
        );
        assert!(inject_dp_rank(b"[]", DpRank(0)).is_err());
        let out = inject_mm_hashes(br#"{"model":"m"}"#, &[u64::MAX, 7]).expect("valid");
        assert_eq!(
            String::from_utf8(out).expect("utf8"),
            r#"{"model":"m","mm_hashes":[18446744073709551615,7]}"#
        );
    }

    #[test]
    fn include_usage_is_injected_keeping_other_options() {
        let out = inject_include_usage(
            br#"{"prompt":[1],"stream_options":{"continuous_usage_stats":false}}"#,
        )
        .expect("valid");
        assert_eq!(
            String::from_utf8(out).expect("utf8"),
            r#"{"prompt":[1],"stream_options":{"continuous_usage_stats":false,"include_usage":true}}"#
        );
        let out = inject_include_usage(br#"{"stream_options":null}"#).expect("valid");
        assert_eq!(
            String::from_utf8(out).expect("utf8"),
            r#"{"stream_options":{"include_usage":true}}"#
        );
    }
}
