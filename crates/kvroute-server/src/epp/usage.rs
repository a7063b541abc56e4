//! The engine's `usage.prompt_tokens_details.cached_tokens`, read from a
//! worker's answer as it passes through the picker untouched: each SSE
//! `data:` line once it is complete (a line may be cut across chunks), or a
//! whole JSON body at its end. Both are bounded: a line, or a body, longer
//! than its bound is not read (its answer is then simply not compared).

use serde::Deserialize;

/// The longest SSE line read for usage.
pub const MAX_LINE_BYTES: usize = 1 << 20;
/// The longest non-streamed answer read for usage.
pub const MAX_BODY_BYTES: usize = 4 << 20;

#[derive(Deserialize)]
struct Doc {
    usage: Option<UsageDoc>,
}

#[derive(Deserialize)]
struct UsageDoc {
    prompt_tokens_details: Option<Details>,
}

#[derive(Deserialize)]
struct Details {
    cached_tokens: Option<u64>,
}

/// `usage.prompt_tokens_details.cached_tokens` of a JSON document.
fn cached_tokens(json: &[u8]) -> Option<u64> {
    serde_json::from_slice::<Doc>(json)
        .ok()?
        .usage?
        .prompt_tokens_details?
        .cached_tokens
}

fn mentions_cached_tokens(bytes: &[u8]) -> bool {
    let key = b"cached_tokens";
    bytes.windows(key.len()).any(|w| w == key)
}

/// The usage of one SSE line, if it is a `data:` line that reports it.
fn cached_in_line(line: &[u8]) -> Option<u64> {
    let line = line.strip_suffix(b"\r").unwrap_or(line);
    let data = line.strip_prefix(b"data:")?;
    let data = data.strip_prefix(b" ").unwrap_or(data);
    mentions_cached_tokens(data)
        .then(|| cached_tokens(data))
        .flatten()
}

/// Watches one answer for the engine's cached tokens.
#[derive(Debug)]
pub struct UsageWatch {
    sse: bool,
    /// SSE: the line not yet ended; otherwise the body so far.
    pending: Vec<u8>,
    /// Past its bound: the rest of this line (SSE) or body is not read.
    skipping: bool,
}

impl UsageWatch {
    /// A watch over an SSE stream (`sse`) or a JSON body.
    pub fn new(sse: bool) -> Self {
        UsageWatch {
            sse,
            pending: Vec::new(),
            skipping: false,
        }
    }

    /// Takes the next bytes of the answer; the cached tokens when an SSE
    /// line completed by them reports them.
    pub fn feed(&mut self, chunk: &[u8]) -> Option<u64> {
        if !self.sse {
            if !self.skipping && chunk.len() <= MAX_BODY_BYTES.saturating_sub(self.pending.len()) {
                self.pending.extend_from_slice(chunk);
            } else {
                self.skipping = true;
                self.pending = Vec::new();
            }
            return None;
        }
        let mut found = None;
        let mut rest = chunk;
        while let Some(end) = rest.iter().position(|&b| b == b'\n') {
            let (line, after) = rest.split_at(end);
            rest = &after[1..];
            if !self.skipping {
                let reported = if self.pending.is_empty() {
                    cached_in_line(line)
                } else {
                    self.pending.extend_from_slice(line);
                    cached_in_line(&self.pending)
                };
                found = reported.or(found);
            }
            self.pending.clear();
            self.skipping = false;
        }
        if !self.skipping && rest.len() <= MAX_LINE_BYTES.saturating_sub(self.pending.len()) {
            self.pending.extend_from_slice(rest);
        } else {
            self.skipping = true;
            self.pending = Vec::new();
        }
        found
    }

    /// The answer ended: the cached tokens of a JSON body, or of an SSE
    /// line the stream left unterminated.
    pub fn finish(&mut self) -> Option<u64> {
        if self.skipping {
            return None;
        }
        let rest = std::mem::take(&mut self.pending);
        if self.sse {
            cached_in_line(&rest)
        } else {
            cached_tokens(&rest)
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const USAGE: &str = "data: {\"choices\":[],\"usage\":{\"prompt_tokens\":40,\"prompt_tokens_details\":{\"cached_tokens\":32}}}\n\n";

    #[test]
    fn sse_usage_is_found_whatever_the_chunk_boundaries() {
        let stream =
            format!("data: {{\"choices\":[{{\"text\":\"a\"}}]}}\n\n{USAGE}data: [DONE]\n\n");
        let bytes = stream.as_bytes();
        for cut in 1..bytes.len() {
            let mut watch = UsageWatch::new(true);
            let mut found = watch.feed(&bytes[..cut]);
            found = watch.feed(&bytes[cut..]).or(found);
            found = watch.finish().or(found);
            assert_eq!(found, Some(32), "cut at {cut}");
        }
        let mut watch = UsageWatch::new(true);
        assert_eq!(watch.feed(b"data: {\"choices\":[]}\n\n"), None);
        assert_eq!(watch.finish(), None);
    }

    #[test]
    fn a_json_body_is_read_at_its_end() {
        let body = br#"{"choices":[],"usage":{"prompt_tokens_details":{"cached_tokens":16}}}"#;
        let mut watch = UsageWatch::new(false);
        assert_eq!(watch.feed(&body[..10]), None);
        assert_eq!(watch.feed(&body[10..]), None);
        assert_eq!(watch.finish(), Some(16));
        let mut none = UsageWatch::new(false);
        none.feed(br#"{"usage":{}}"#);
        assert_eq!(none.finish(), None);
    }

    #[test]
    fn lines_and_bodies_past_their_bounds_are_not_kept() {
        let mut watch = UsageWatch::new(true);
        watch.feed(b"data: ");
        watch.feed(&vec![b'x'; MAX_LINE_BYTES + 1]);
        assert!(watch.pending.is_empty() && watch.skipping);
        // The next line is read again.
        assert_eq!(watch.feed(format!("\n{USAGE}").as_bytes()), Some(32));
        let mut body = UsageWatch::new(false);
        body.feed(&vec![b' '; MAX_BODY_BYTES]);
        body.feed(b"{}");
        assert!(body.pending.is_empty());
        assert_eq!(body.finish(), None);
    }
}
