//! What a stream relayed so far, kept so that a migration can tell what was
//! generated: the events passed on whole (an event the worker had not
//! finished is held back, so the client never sees half of one), and
//! [`Generated`], read from them only when a migration needs it.

use axum::body::Bytes;
use serde_json::Value;

use crate::router::Endpoint;

/// The events a stream passed on to its client, kept (as shared buffers,
/// never copied) up to a bound; past it the stream cannot be continued.
#[derive(Debug, Default)]
pub struct Transcript {
    chunks: Vec<Bytes>,
    bytes: usize,
    cap: usize,
    over: bool,
    /// The start of an event not yet complete, held back from the client.
    held: Vec<u8>,
}

impl Transcript {
    /// An empty transcript keeping at most `cap` bytes.
    pub fn new(cap: usize) -> Self {
        Transcript {
            cap,
            ..Transcript::default()
        }
    }

    /// Takes the next upstream bytes; returns what to pass on: every whole
    /// event so far (the rest is held until its blank line arrives). A chunk
    /// of whole events, the usual case, is passed on as it is.
    pub fn feed(&mut self, chunk: Bytes) -> Bytes {
        let out = if self.held.is_empty() && ends_an_event(&chunk) {
            chunk
        } else {
            self.held.extend_from_slice(&chunk);
            let mut end = 0;
            while let Some(len) = crate::sse::event_end(&self.held[end..]) {
                end += len;
            }
            let whole: Vec<u8> = self.held.drain(..end).collect();
            Bytes::from(whole)
        };
        self.keep(&out);
        out
    }

    /// What the worker sent of an event it never finished.
    pub fn unfinished(&self) -> &[u8] {
        &self.held
    }

    fn keep(&mut self, out: &Bytes) {
        if out.is_empty() || self.over {
            return;
        }
        self.bytes += out.len();
        if self.bytes > self.cap {
            self.over = true;
            self.chunks = Vec::new();
            return;
        }
        self.chunks.push(out.clone());
    }

    /// The stream went past the bound: it cannot be continued.
    pub fn over(&self) -> bool {
        self.over
    }

    /// What the events passed on so far say was generated.
    pub fn generated(&self, endpoint: Endpoint) -> Generated {
        let whole: Vec<u8> = self.chunks.concat();
        Generated::read(&whole, endpoint)
    }
}

/// Whether `chunk` ends with an event's blank line.
fn ends_an_event(chunk: &[u8]) -> bool {
    chunk.ends_with(b"\n\n") || chunk.ends_with(b"\r\n\r\n")
}

/// What a stream's events say its worker generated.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct Generated {
    /// The answer's id (`cmpl-…`, `chatcmpl-…`), which its continuation keeps.
    pub id: Option<String>,
    /// The generated text so far.
    pub text: String,
    /// The generated token ids, when the engine sent them (vLLM's
    /// `return_token_ids`): the continuation is then token-exact.
    pub token_ids: Option<Vec<u64>>,
    /// Events that carried generated output: the tokens generated, when the
    /// engine sent no ids (vLLM and SGLang stream one token an event).
    pub pieces: u64,
    /// A choice said why it finished: nothing is left to generate.
    pub finished: bool,
    /// The stream's `[DONE]` came.
    pub done: bool,
}

impl Generated {
    /// Reads the events of `stream` (whole events only) as `endpoint`'s.
    pub fn read(stream: &[u8], endpoint: Endpoint) -> Generated {
        let mut generated = Generated::default();
        let mut ids: Vec<u64> = Vec::new();
        let mut all_had_ids = true;
        let mut at = 0;
        while let Some(len) = crate::sse::event_end(&stream[at..]) {
            let event = &stream[at..at + len];
            at += len;
            for data in data_lines(event) {
                if data.trim() == "[DONE]" {
                    generated.done = true;
                    continue;
                }
                let Ok(doc) = serde_json::from_str::<Value>(data) else {
                    continue;
                };
                generated.take(&doc, endpoint, &mut ids, &mut all_had_ids);
            }
        }
        if all_had_ids && generated.pieces > 0 {
            generated.token_ids = Some(ids);
        }
        generated
    }

    fn take(&mut self, doc: &Value, endpoint: Endpoint, ids: &mut Vec<u64>, all: &mut bool) {
        if self.id.is_none() {
            self.id = doc.get("id").and_then(Value::as_str).map(str::to_owned);
        }
        let Some(choice) = doc.get("choices").and_then(|c| c.get(0)) else {
            return;
        };
        let piece = match endpoint {
            Endpoint::Chat => choice.get("delta").and_then(|d| d.get("content")),
            _ => choice.get("text"),
        };
        let piece = piece.and_then(Value::as_str).unwrap_or("");
        let piece_ids = choice.get("token_ids").and_then(Value::as_array);
        if !piece.is_empty() || piece_ids.is_some_and(|a| !a.is_empty()) {
            self.pieces += 1;
            self.text.push_str(piece);
            match piece_ids {
                Some(a) => ids.extend(a.iter().filter_map(Value::as_u64)),
                None => *all = false,
            }
        }
        if choice.get("finish_reason").is_some_and(|f| !f.is_null()) {
            self.finished = true;
        }
    }

    /// The tokens generated: the ids sent, else one per event.
    pub fn tokens(&self) -> u64 {
        self.token_ids
            .as_ref()
            .map_or(self.pieces, |ids| ids.len() as u64)
    }
}

/// The `data:` payloads of one SSE event.
pub(super) fn data_lines(event: &[u8]) -> impl Iterator<Item = &str> {
    std::str::from_utf8(event)
        .unwrap_or("")
        .lines()
        .filter_map(|l| l.strip_prefix("data:"))
        .map(|d| d.strip_prefix(' ').unwrap_or(d))
}

#[cfg(test)]
mod tests {
    use super::*;

    const CHAT: &str = "data: {\"id\":\"chatcmpl-1\",\"choices\":[{\"index\":0,\"delta\":{\"role\":\"assistant\",\"content\":\"\"}}]}\n\n\
        data: {\"id\":\"chatcmpl-1\",\"choices\":[{\"index\":0,\"delta\":{\"content\":\"Hel\"}}]}\n\n\
        data: {\"id\":\"chatcmpl-1\",\"choices\":[{\"index\":0,\"delta\":{\"content\":\"lo\"}}]}\n\n";

    #[test]
    fn a_chat_stream_says_what_was_generated() {
        let g = Generated::read(CHAT.as_bytes(), Endpoint::Chat);
        assert_eq!(g.id.as_deref(), Some("chatcmpl-1"));
        assert_eq!((g.text.as_str(), g.pieces, g.tokens()), ("Hello", 2, 2));
        assert_eq!(g.token_ids, None);
        assert!(!g.finished && !g.done);
    }

    #[test]
    fn token_ids_make_the_count_exact_and_a_finish_is_seen() {
        let s = "data: {\"id\":\"c\",\"choices\":[{\"text\":\"a b\",\"token_ids\":[5,6]}]}\n\n\
                 data: {\"id\":\"c\",\"choices\":[{\"text\":\"\",\"token_ids\":[],\"finish_reason\":\"length\"}]}\n\n\
                 data: [DONE]\n\n";
        let g = Generated::read(s.as_bytes(), Endpoint::Completions);
        assert_eq!(g.token_ids, Some(vec![5, 6]));
        assert_eq!(g.tokens(), 2);
        assert!(g.finished && g.done);
    }

    #[test]
    fn only_whole_events_pass_and_are_kept() {
        let mut t = Transcript::new(1 << 20);
        let bytes = CHAT.as_bytes();
        let mut out = Vec::new();
        // Cut anywhere: what passes is whole events, in order.
        let cut = 70;
        out.extend_from_slice(&t.feed(Bytes::copy_from_slice(&bytes[..cut])));
        assert!(out.ends_with(b"\n\n") || out.is_empty());
        assert!(!t.unfinished().is_empty());
        out.extend_from_slice(&t.feed(Bytes::copy_from_slice(&bytes[cut..])));
        assert_eq!(out, bytes);
        assert!(t.unfinished().is_empty());
        assert_eq!(t.generated(Endpoint::Chat).text, "Hello");
    }

    #[test]
    fn past_the_bound_nothing_is_kept() {
        let mut t = Transcript::new(10);
        let out = t.feed(Bytes::from_static(CHAT.as_bytes()));
        assert_eq!(out.len(), CHAT.len(), "the client still gets it all");
        assert!(t.over());
        assert_eq!(t.generated(Endpoint::Chat), Generated::default());
    }
}
