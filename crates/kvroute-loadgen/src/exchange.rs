//! One request on the wire: POST the body, read the answer (an SSE stream or
//! a plain JSON body), and measure it.
//!
//! TTFT is the time to the first chunk with non-empty text
//! (`choices[].text`, `choices[].delta.content` or `choices[].message.content`),
//! latency the time to `[DONE]` (or to the end of a JSON body); prompt,
//! completion and cached tokens come from the last `usage` object seen.

use std::time::{Duration, Instant};

use serde_json::Value;

/// What one exchange measured (times from the scheduled start).
#[derive(Debug, Default, Clone, Copy, PartialEq)]
pub(crate) struct Measured {
    /// Time to the first chunk with text (`None`: no text came).
    pub ttft: Option<Duration>,
    /// Time to the end of the answer.
    pub latency: Duration,
    /// `usage.prompt_tokens`.
    pub prompt_tokens: u64,
    /// `usage.completion_tokens`, when given.
    pub completion_tokens: Option<u64>,
    /// `usage.prompt_tokens_details.cached_tokens`.
    pub cached_tokens: u64,
    /// Chunks that carried text.
    pub text_chunks: u64,
}

/// Why an exchange failed, and whether no answer of the target began.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct Failure {
    /// What went wrong, for the log.
    pub message: String,
    /// No response head came back: the connection could not be made
    /// (refused, unreachable, connect timeout) or it closed before the
    /// target answered (the process died). Nothing reached the client, so
    /// a balancer may send the request elsewhere, as Envoy's
    /// `connect-failure` and `reset` retry policies do. A request that timed
    /// out waiting is not one: it may still be running.
    pub no_response: bool,
}

impl Failure {
    /// A failure after the request may have reached the target.
    pub fn other(message: impl Into<String>) -> Self {
        Failure {
            message: message.into(),
            no_response: false,
        }
    }
}

impl From<String> for Failure {
    fn from(message: String) -> Self {
        Failure::other(message)
    }
}

impl From<&str> for Failure {
    fn from(message: &str) -> Self {
        Failure::other(message)
    }
}

/// POSTs a body and reads the answer (SSE or a plain JSON body).
pub(crate) async fn exchange(
    client: &reqwest::Client,
    url: &str,
    body: &Value,
    rank: Option<u32>,
    scheduled: Instant,
) -> Result<Measured, Failure> {
    let mut request = client.post(url).json(body);
    if let Some(rank) = rank {
        request = request.header("X-data-parallel-rank", rank.to_string());
    }
    let mut resp = request.send().await.map_err(|e| Failure {
        no_response: e.is_connect() || !e.is_timeout(),
        message: e.to_string(),
    })?;
    let status = resp.status();
    if !status.is_success() {
        let text = resp.text().await.unwrap_or_default();
        let text: String = text.chars().take(300).collect();
        return Err(format!("{url} answered {status}: {text}").into());
    }
    let sse = resp
        .headers()
        .get(reqwest::header::CONTENT_TYPE)
        .and_then(|v| v.to_str().ok())
        .is_some_and(|v| v.contains("event-stream"));
    let mut m = Measured::default();
    if !sse {
        let bytes = resp.bytes().await.map_err(|e| Failure {
            message: e.to_string(),
            no_response: true,
        })?;
        let v: Value = serde_json::from_slice(&bytes).map_err(|e| format!("not JSON: {e}"))?;
        m.latency = scheduled.elapsed();
        m.ttft = Some(m.latency);
        read_usage(&v, &mut m);
        return Ok(m);
    }
    let mut sse = SseParser::default();
    // A stream cut before its first text showed the client nothing: as
    // retryable as an answer that never began.
    let cut = |m: &Measured, message: String| Failure {
        message,
        no_response: m.text_chunks == 0,
    };
    while let Some(chunk) = resp.chunk().await.map_err(|e| cut(&m, e.to_string()))? {
        for event in sse.push(&chunk) {
            if event == "[DONE]" {
                m.latency = scheduled.elapsed();
                return Ok(m);
            }
            let v: Value = serde_json::from_str(&event)
                .map_err(|e| format!("bad SSE chunk ({e}): {event}"))?;
            if let Some(error) = v.get("error").filter(|e| !e.is_null()) {
                return Err(format!("error chunk: {error}").into());
            }
            if has_text(&v) {
                m.text_chunks += 1;
                m.ttft.get_or_insert_with(|| scheduled.elapsed());
            }
            read_usage(&v, &mut m);
        }
    }
    Err(cut(&m, "the stream ended before [DONE]".into()))
}

/// True when a chunk carries generated text.
fn has_text(v: &Value) -> bool {
    v["choices"].as_array().is_some_and(|choices| {
        choices.iter().any(|c| {
            let text = c["text"]
                .as_str()
                .or_else(|| c["delta"]["content"].as_str())
                .or_else(|| c["message"]["content"].as_str());
            text.is_some_and(|t| !t.is_empty())
        })
    })
}

fn read_usage(v: &Value, m: &mut Measured) {
    let usage = &v["usage"];
    if !usage.is_object() {
        return;
    }
    if let Some(p) = usage["prompt_tokens"].as_u64() {
        m.prompt_tokens = p;
    }
    if let Some(c) = usage["completion_tokens"].as_u64() {
        m.completion_tokens = Some(c);
    }
    if let Some(c) = usage["prompt_tokens_details"]["cached_tokens"].as_u64() {
        m.cached_tokens = c;
    }
}

/// Splits an SSE byte stream into the `data:` payloads of its events.
#[derive(Debug, Default)]
struct SseParser {
    buf: Vec<u8>,
}

impl SseParser {
    /// Feeds bytes; returns the data of every event completed by them.
    fn push(&mut self, bytes: &[u8]) -> Vec<String> {
        self.buf
            .extend(bytes.iter().copied().filter(|&b| b != b'\r'));
        let mut out = Vec::new();
        while let Some(end) = self.buf.windows(2).position(|w| w == b"\n\n") {
            let event: Vec<u8> = self.buf.drain(..end + 2).collect();
            let text = String::from_utf8_lossy(&event);
            let data: Vec<&str> = text
                .lines()
                .filter_map(|l| l.strip_prefix("data:"))
                .map(|d| d.strip_prefix(' ').unwrap_or(d))
                .collect();
            if !data.is_empty() {
                out.push(data.join("\n"));
            }
        }
        out
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sse_events_are_split_across_chunk_boundaries() {
        let mut p = SseParser::default();
        assert!(p.push(b"data: {\"a\":").is_empty());
        assert_eq!(p.push(b"1}\n\ndata: [DO"), ["{\"a\":1}"]);
        assert_eq!(p.push(b"NE]\r\n\r\n: comment\n\n"), ["[DONE]"]);
        assert!(p.push(b"").is_empty());
    }

    #[test]
    fn chunks_with_text_and_usage_are_read() {
        let chunk: Value =
            serde_json::from_str(r#"{"choices":[{"index":0,"text":" lorem"}],"usage":null}"#)
                .expect("json");
        assert!(has_text(&chunk));
        let chat: Value =
            serde_json::from_str(r#"{"choices":[{"delta":{"role":"assistant","content":""}}]}"#)
                .expect("json");
        assert!(!has_text(&chat));
        let usage: Value = serde_json::from_str(
            r#"{"choices":[],"usage":{"prompt_tokens":100,"completion_tokens":4,"prompt_tokens_details":{"cached_tokens":96}}}"#,
        )
        .expect("json");
        let mut m = Measured::default();
        read_usage(&chunk, &mut m);
        assert_eq!(m, Measured::default());
        read_usage(&usage, &mut m);
        assert_eq!(
            (m.prompt_tokens, m.completion_tokens, m.cached_tokens),
            (100, Some(4), 96)
        );
    }
}
