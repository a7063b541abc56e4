//! Relaying a worker's answer to the client: SSE streams chunk by chunk
//! (holding the request's place in the load until the stream ends), and on
//! the way reading the engine's `cached_tokens` for the accuracy metric and
//! removing the usage chunk that the proxy asked for on the client's behalf.
//! How a stream ends, whole or cut off, goes through the retry rule of
//! [`super::outcome`] like every other end of an attempt.

use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll};
use std::time::Instant;

use axum::body::Bytes;
use axum::http::StatusCode;
use futures_util::Stream;
use serde_json::Value;

use kvroute_core::index::WorkerRank;

use super::migrate::{Leg, Migration, PendingLeg, Step, Upstream};
use super::outcome::{self, Ending};
use crate::api::{error_chain, ErrorKind, ProxyError};
use crate::dialect::Dialect;
use crate::router::accuracy::Prediction;
use crate::router::active::ActiveGuard;
use crate::router::continuations::ResponseIdScanner;

/// What an engine's `usage` reports, of what the router reads.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Usage {
    /// `prompt_tokens_details.cached_tokens`: what the engine had cached.
    pub cached: Option<u64>,
    /// `completion_tokens`: the tokens it generated.
    pub completion: Option<u64>,
}

/// The `usage` of a JSON document in any of the dialects — chat's
/// `prompt_tokens_details.cached_tokens` and `completion_tokens`, the
/// Responses API's `input_tokens_details.cached_tokens` and
/// `output_tokens` (also inside a stream's `response`), Anthropic's
/// `cache_read_input_tokens` and `output_tokens` (also inside a stream's
/// `message`) — or the `meta_info` of SGLang's native `/generate` answers.
fn usage_of(doc: &Value) -> Usage {
    let usage = doc
        .get("usage")
        .filter(|u| u.is_object())
        .or_else(|| doc.get("response")?.get("usage"))
        .or_else(|| doc.get("message")?.get("usage"))
        .filter(|u| u.is_object());
    let meta = doc.get("meta_info");
    let meta_u64 = |key: &str| meta.and_then(|m| m.get(key)?.as_u64());
    let in_usage = |path: &[&str]| {
        path.iter()
            .try_fold(usage?, |v, key| v.get(key))
            .and_then(Value::as_u64)
    };
    Usage {
        cached: in_usage(&["prompt_tokens_details", "cached_tokens"])
            .or_else(|| in_usage(&["input_tokens_details", "cached_tokens"]))
            .or_else(|| in_usage(&["cache_read_input_tokens"]))
            .or_else(|| meta_u64("cached_tokens")),
        completion: in_usage(&["completion_tokens"])
            .or_else(|| in_usage(&["output_tokens"]))
            .or_else(|| meta_u64("completion_tokens")),
    }
}

#[derive(serde::Deserialize)]
struct UsageDoc {
    usage: Option<UsageOnly>,
    meta_info: Option<Details>,
}

#[derive(serde::Deserialize)]
struct UsageOnly {
    prompt_tokens_details: Option<Details>,
    input_tokens_details: Option<Details>,
    cache_read_input_tokens: Option<u64>,
}

#[derive(serde::Deserialize)]
struct Details {
    cached_tokens: Option<u64>,
}

/// The cached tokens a whole answer reports (`usage` in any of the three
/// APIs, or `meta_info.cached_tokens` of a native `/generate` answer), read
/// without building the rest of the document.
pub fn reported_cached_tokens(body: &[u8]) -> Option<u64> {
    let doc = serde_json::from_slice::<UsageDoc>(body).ok()?;
    doc.usage
        .and_then(|u| {
            u.prompt_tokens_details
                .and_then(|d| d.cached_tokens)
                .or(u.input_tokens_details.and_then(|d| d.cached_tokens))
                .or(u.cache_read_input_tokens)
        })
        .or_else(|| doc.meta_info?.cached_tokens)
}

/// The usage reported in an SSE chunk, if it has one with cached or
/// completion tokens.
fn usage_in_sse(chunk: &[u8]) -> Option<Usage> {
    let text = std::str::from_utf8(chunk).ok()?;
    text.lines()
        .filter_map(|l| l.strip_prefix("data: "))
        .filter(|d| {
            [
                "cached_tokens",
                "completion_tokens",
                "output_tokens",
                "cache_read_input_tokens",
            ]
            .iter()
            .any(|key| d.contains(key))
        })
        .filter_map(|d| serde_json::from_str::<Value>(d).ok())
        .map(|d| usage_of(&d))
        .find(|u| u.cached.is_some() || u.completion.is_some())
}

/// Whether JSON text has `"choices"` followed by an empty array.
fn has_empty_choices(text: &[u8]) -> bool {
    let key = b"\"choices\"";
    let mut from = 0;
    while let Some(i) = text[from..].windows(key.len()).position(|w| w == key) {
        let rest = text[from + i + key.len()..]
            .iter()
            .copied()
            .filter(|b| !b.is_ascii_whitespace());
        let mut rest = rest.take(3);
        if rest.next() == Some(b':') && rest.next() == Some(b'[') && rest.next() == Some(b']') {
            return true;
        }
        from += i + key.len();
    }
    false
}

/// If one SSE event is a usage-only chunk (`"choices": []` and a `usage`
/// object, what an engine sends last for `include_usage`), its usage;
/// otherwise `None`.
fn usage_only_event(event: &[u8]) -> Option<Usage> {
    if !has_empty_choices(event) {
        return None;
    }
    let text = std::str::from_utf8(event).ok()?;
    let data: String = text
        .lines()
        .filter_map(|l| l.strip_prefix("data:"))
        .map(|d| d.strip_prefix(' ').unwrap_or(d))
        .collect::<Vec<_>>()
        .join("\n");
    let doc: Value = serde_json::from_str(&data).ok()?;
    let empty = doc.get("choices")?.as_array()?.is_empty();
    (empty && doc.get("usage")?.is_object()).then(|| usage_of(&doc))
}

/// Removes usage-only chunks from an SSE stream that kvroute asked for
/// (`stream_options.include_usage` added by the proxy), reading their
/// `cached_tokens` first. Holds at most one incomplete event: every complete
/// event is passed on as soon as its blank line arrives.
#[derive(Debug, Default)]
pub struct UsageStripper {
    pending: Vec<u8>,
}

impl UsageStripper {
    /// Takes the next upstream bytes; returns what to pass on now and the
    /// usage of a usage chunk removed from them, if any.
    pub fn feed(&mut self, chunk: &[u8]) -> (Vec<u8>, Option<Usage>) {
        self.pending.extend_from_slice(chunk);
        let mut out = Vec::with_capacity(self.pending.len());
        let mut reported = None;
        let mut start = 0;
        while let Some(len) = crate::sse::event_end(&self.pending[start..]) {
            let event = &self.pending[start..start + len];
            match usage_only_event(event) {
                Some(usage) => reported = reported.or(Some(usage)),
                None => out.extend_from_slice(event),
            }
            start += len;
        }
        self.pending.drain(..start);
        (out, reported)
    }

    /// What is left when the upstream ends (an unterminated event), passed on as is.
    pub fn finish(&mut self) -> Vec<u8> {
        std::mem::take(&mut self.pending)
    }
}

/// Which request a relayed stream answers, for its failure event and logs.
#[derive(Debug, Clone)]
pub struct StreamOrigin {
    /// The worker streaming.
    pub worker: Arc<str>,
    /// The request's id.
    pub request_id: String,
    /// The stream is SSE, so a failure can be told to the client in-band.
    pub sse: bool,
    /// The status of the answer (relayed before the stream).
    pub status: StatusCode,
    /// The API whose conventions the stream follows (how a failure ends it).
    pub dialect: Dialect,
}

/// The upstream body, passed through chunk by chunk; holds the active entry.
pub struct Passthrough {
    inner: Upstream,
    guard: Option<ActiveGuard>,
    first: bool,
    prediction: Option<Prediction>,
    /// Set when the proxy added `include_usage`: drop the usage-only chunk.
    strip: Option<UsageStripper>,
    origin: StreamOrigin,
    /// When the request arrived, and when its first chunk came.
    arrived: Instant,
    first_chunk: Option<Instant>,
    /// The blocks in flight on the rank at the first chunk.
    load_at_first: u64,
    /// The tokens generated, as the engine's usage reported them.
    completion_tokens: Option<u64>,
    /// What was passed on so far ends an SSE event (or nothing was).
    at_boundary: bool,
    done: bool,
    /// A Responses API stream: finds its response id, to remember which
    /// rank produced it.
    response: Option<(ResponseIdScanner, WorkerRank, [u8; 32])>,
    /// Where the stream goes on if its worker cuts it off.
    migration: Option<Box<Migration>>,
    /// A continuation being placed and sent.
    pending: Option<PendingLeg>,
}

impl Passthrough {
    /// Relays `inner`, holding `guard` until it ends; compares `prediction`
    /// with the engine's `cached_tokens`; removes the usage-only chunk when
    /// `strip_usage` (the client did not ask for it). If the worker fails
    /// mid-stream, an SSE stream ends with an `error` event and `[DONE]`.
    pub fn new(
        inner: Upstream,
        guard: ActiveGuard,
        prediction: Option<Prediction>,
        strip_usage: bool,
        (origin, arrived): (StreamOrigin, Instant),
    ) -> Self {
        Passthrough {
            inner,
            guard: Some(guard),
            first: true,
            prediction,
            strip: strip_usage.then(UsageStripper::default),
            origin,
            arrived,
            first_chunk: None,
            load_at_first: 0,
            completion_tokens: None,
            at_boundary: true,
            done: false,
            response: None,
            migration: None,
            pending: None,
        }
    }

    /// The same relay, continuing the answer on another rank if its
    /// worker cuts it off ([`super::migrate`]).
    pub fn migrating(mut self, migration: Migration) -> Self {
        self.migration = Some(Box::new(migration));
        self
    }

    /// The same relay, remembering that `rank` produced the response the
    /// stream names (for a later `previous_response_id` of `owner`'s).
    pub fn remembering_response(mut self, rank: WorkerRank, owner: [u8; 32]) -> Self {
        self.response = Some((ResponseIdScanner::default(), rank, owner));
        self
    }

    /// The worker cut the stream off: the retry rule's verdict (its breaker
    /// opens, the failure is counted), and an SSE client gets the error as a
    /// last `data: {"error": …}` event and `data: [DONE]`.
    fn failed(&mut self, error: &reqwest::Error) -> Option<Bytes> {
        let origin = &self.origin;
        let g = self.guard.take()?;
        let router = g.router();
        // Out of time while tokens were coming: a long answer, not a
        // failing worker.
        let ending = if error.is_timeout() && !self.first {
            Ending::OutOfTime { flowing: true }
        } else {
            Ending::CutOff
        };
        let verdict = outcome::settle(router, &origin.worker, ending, &origin.request_id);
        let kind = verdict
            .next
            .error()
            .unwrap_or(ErrorKind::UpstreamIncomplete);
        router.metrics.answered(kind);
        self.end_with(kind, format!("mid-stream: {}", error_chain(error)))
    }

    /// The client's last event for an answer lost with `kind` (an SSE
    /// stream's error event and `[DONE]`; nothing for other streams).
    fn end_with(&self, kind: ErrorKind, detail: String) -> Option<Bytes> {
        let origin = &self.origin;
        if !origin.sse {
            return None;
        }
        let lost = ProxyError::lost(kind, &origin.worker, &origin.request_id, detail);
        Some(Bytes::from(
            lost.stream_end(origin.dialect, self.at_boundary),
        ))
    }

    /// The worker cut the stream off with `error`: the migration's next
    /// step, the failed worker's breaker opened and its load released;
    /// `None` when the stream does not move (then [`Passthrough::failed`]).
    fn migrate(&mut self, error: &reqwest::Error) -> Option<Step> {
        if error.is_timeout() {
            return None;
        }
        let m = self.migration.as_mut()?;
        let worker = self.origin.worker.clone();
        let step = m.after_failure(&worker, &error_chain(error)).ok()?;
        let proxy = m.proxy().clone();
        outcome::settle(
            &proxy.router,
            &worker,
            Ending::CutOff,
            &self.origin.request_id,
        );
        self.guard = None;
        self.prediction = None;
        Some(step)
    }

    /// A continuation answered (`Ok`: relay it from now on) or could not
    /// be had (`Err`: the client's stream ends with the error).
    fn resumed(&mut self, leg: Result<Leg, String>) -> Option<Bytes> {
        match leg {
            Ok(leg) => {
                self.inner = leg.stream;
                self.guard = Some(leg.guard);
                self.origin.worker = leg.worker;
                None
            }
            Err(why) => {
                self.done = true;
                let proxy = self.migration.as_ref()?.proxy().clone();
                let kind = ErrorKind::UpstreamIncomplete;
                proxy.router.metrics.migrations_failed.inc();
                proxy.router.metrics.answered(kind);
                let detail = format!("mid-stream, and no other rank continued it: {why}");
                self.end_with(kind, detail)
            }
        }
    }
}

impl Passthrough {
    fn report(&mut self, reported: Option<Usage>) {
        let Some(usage) = reported else {
            return;
        };
        self.completion_tokens = usage.completion.or(self.completion_tokens);
        if let (Some(p), Some(g), Some(cached)) = (&self.prediction, &self.guard, usage.cached) {
            p.settle(g.router(), cached);
            self.prediction = None;
        }
    }

    /// Reads the response id off a Responses API stream's first event.
    fn remember(&mut self, out: &[u8]) {
        let Some((scanner, rank, owner)) = &mut self.response else {
            return;
        };
        if let (Some(id), Some(g)) = (scanner.feed(out), &self.guard) {
            g.router().record_response(&id, owner, *rank);
        }
    }

    /// The stream ended whole: the retry rule's verdict on the answer (the
    /// breaker's success, or its failure for a 5xx), its timings, and how
    /// fast its rank decoded it.
    fn ended(&mut self) {
        let Some(g) = self.guard.take() else {
            return;
        };
        let origin = &self.origin;
        let ending = Ending::Complete(origin.status);
        outcome::settle(g.router(), &origin.worker, ending, &origin.request_id);
        let moved = self.migration.as_ref().is_some_and(|m| m.moves() > 0);
        if let (Some(first), Some(tokens), false) =
            (self.first_chunk, self.completion_tokens, moved)
        {
            g.decoded(first.elapsed(), self.load_at_first, tokens);
        }
        g.router().timed(self.arrived, self.first_chunk);
    }
}

impl Stream for Passthrough {
    type Item = Result<Bytes, reqwest::Error>;

    fn poll_next(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Option<Self::Item>> {
        let this = &mut *self;
        if this.done {
            return Poll::Ready(None);
        }
        loop {
            if let Some(pending) = &mut this.pending {
                let Poll::Ready(leg) = pending.as_mut().poll(cx) else {
                    return Poll::Pending;
                };
                this.pending = None;
                if let Some(last) = this.resumed(leg) {
                    return Poll::Ready(Some(Ok(last)));
                }
                if this.done {
                    return Poll::Ready(None);
                }
                continue;
            }
            match Pin::new(&mut this.inner).poll_next(cx) {
                Poll::Ready(Some(Ok(chunk))) => {
                    if this.first {
                        this.first = false;
                        this.first_chunk = Some(Instant::now());
                        if let Some(g) = &this.guard {
                            this.load_at_first = g.prefill_done();
                        }
                    }
                    let chunk = match &mut this.migration {
                        Some(m) => m.pass(chunk),
                        None => chunk,
                    };
                    let (out, reported) = match &mut this.strip {
                        Some(strip) => {
                            let (out, reported) = strip.feed(&chunk);
                            (Bytes::from(out), reported)
                        }
                        None => {
                            let learns =
                                this.guard.as_ref().is_some_and(ActiveGuard::learns_speeds);
                            let reported = (this.prediction.is_some() || learns)
                                .then(|| usage_in_sse(&chunk))
                                .flatten();
                            (chunk, reported)
                        }
                    };
                    this.report(reported);
                    this.remember(&out);
                    if out.is_empty() {
                        continue;
                    }
                    this.at_boundary = out.ends_with(b"\n\n") || out.ends_with(b"\r\n\r\n");
                    return Poll::Ready(Some(Ok(out)));
                }
                Poll::Ready(Some(Err(e))) => match this.migrate(&e) {
                    Some(Step::Resume(leg)) => this.pending = Some(leg),
                    Some(Step::Finished) => {
                        this.done = true;
                        let done = this
                            .origin
                            .sse
                            .then_some(Bytes::from_static(b"data: [DONE]\n\n"));
                        return Poll::Ready(done.map(Ok));
                    }
                    None => {
                        this.done = true;
                        return Poll::Ready(this.failed(&e).map(Ok));
                    }
                },
                Poll::Ready(None) => {
                    this.ended();
                    this.done = true;
                    let rest = this.strip.as_mut().map(UsageStripper::finish);
                    return match rest {
                        Some(rest) if !rest.is_empty() => Poll::Ready(Some(Ok(Bytes::from(rest)))),
                        _ => Poll::Ready(None),
                    };
                }
                Poll::Pending => return Poll::Pending,
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn usage_is_read_in_the_responses_and_messages_dialects() {
        let responses = json!({"object": "response", "usage": {
            "input_tokens": 80, "input_tokens_details": {"cached_tokens": 64}, "output_tokens": 9}});
        assert_eq!(
            reported_cached_tokens(responses.to_string().as_bytes()),
            Some(64)
        );
        let anthropic = json!({"type": "message", "usage": {
            "input_tokens": 16, "cache_read_input_tokens": 48, "output_tokens": 5}});
        assert_eq!(
            reported_cached_tokens(anthropic.to_string().as_bytes()),
            Some(48)
        );
        let completed = "event: response.completed\ndata: {\"type\":\"response.completed\",\"response\":{\"usage\":{\"input_tokens_details\":{\"cached_tokens\":32},\"output_tokens\":7}}}\n\n";
        assert_eq!(
            usage_in_sse(completed.as_bytes()),
            Some(Usage {
                cached: Some(32),
                completion: Some(7)
            })
        );
        let created = "event: response.created\ndata: {\"type\":\"response.created\",\"response\":{\"usage\":null}}\n\n";
        assert_eq!(usage_in_sse(created.as_bytes()), None);
        let start = "event: message_start\ndata: {\"type\":\"message_start\",\"message\":{\"usage\":{\"input_tokens\":3,\"cache_read_input_tokens\":16,\"output_tokens\":0}}}\n\n";
        assert_eq!(
            usage_in_sse(start.as_bytes()).and_then(|u| u.cached),
            Some(16)
        );
        let delta = "event: message_delta\ndata: {\"type\":\"message_delta\",\"usage\":{\"output_tokens\":12}}\n\n";
        assert_eq!(
            usage_in_sse(delta.as_bytes()),
            Some(Usage {
                cached: None,
                completion: Some(12)
            })
        );
    }

    #[test]
    fn usage_is_found_in_documents_and_sse_chunks() {
        let doc = json!({"usage": {"prompt_tokens_details": {"cached_tokens": 48}}});
        assert_eq!(usage_of(&doc).cached, Some(48));
        assert_eq!(reported_cached_tokens(doc.to_string().as_bytes()), Some(48));
        assert_eq!(reported_cached_tokens(b"{\"id\":1}"), None);
        let chunk = b"data: {\"choices\":[],\"usage\":{\"prompt_tokens_details\":{\"cached_tokens\":32}}}\n\ndata: [DONE]\n\n";
        assert_eq!(usage_in_sse(chunk).and_then(|u| u.cached), Some(32));
        assert_eq!(usage_in_sse(b"data: {\"choices\":[]}\n\n"), None);
        let done = b"data: {\"choices\":[],\"usage\":{\"completion_tokens\":7}}\n\n";
        let usage = usage_in_sse(done);
        assert_eq!(
            usage.map(|u| (u.cached, u.completion)),
            Some((None, Some(7)))
        );
        // SGLang's native answers: `meta_info`.
        let native =
            json!({"text": "a", "meta_info": {"cached_tokens": 16, "completion_tokens": 2}});
        assert_eq!(
            reported_cached_tokens(native.to_string().as_bytes()),
            Some(16)
        );
        let last = format!("data: {native}\n\ndata: [DONE]\n\n");
        let usage = usage_in_sse(last.as_bytes()).map(|u| (u.cached, u.completion));
        assert_eq!(usage, Some((Some(16), Some(2))));
    }

    const ROLE: &[u8] =
        b"data: {\"id\":\"c\",\"choices\":[{\"index\":0,\"text\":\"a\"}],\"usage\":null}\n\n";
    const USAGE: &[u8] = b"data: {\"id\":\"c\",\"choices\":[],\"usage\":{\"prompt_tokens\":64,\"prompt_tokens_details\":{\"cached_tokens\":48}}}\n\n";
    const DONE: &[u8] = b"data: [DONE]\n\n";

    #[test]
    fn the_usage_chunk_is_removed_whatever_the_chunk_boundaries() {
        let stream: Vec<u8> = [ROLE, ROLE, USAGE, DONE].concat();
        let expected: Vec<u8> = [ROLE, ROLE, DONE].concat();
        // Every way of cutting the stream in two, and byte by byte.
        for cut in 0..=stream.len() {
            let mut f = UsageStripper::default();
            let (mut out, a) = f.feed(&stream[..cut]);
            let (rest, b) = f.feed(&stream[cut..]);
            out.extend(rest);
            out.extend(f.finish());
            assert_eq!(out, expected, "cut at {cut}");
            assert_eq!(a.or(b).and_then(|u| u.cached), Some(48), "cut at {cut}");
        }
        let mut f = UsageStripper::default();
        let mut out = Vec::new();
        let mut reported = None;
        for byte in &stream {
            let (o, r) = f.feed(std::slice::from_ref(byte));
            // Nothing is held beyond the event in progress.
            assert!(f.pending.len() <= USAGE.len());
            out.extend(o);
            reported = reported.or(r);
        }
        let reported = reported.and_then(|u| u.cached);
        assert_eq!((out, reported), (expected, Some(48)));
    }

    #[test]
    fn complete_events_pass_at_once_and_other_chunks_stay() {
        let mut f = UsageStripper::default();
        // A whole event and half of the next: the whole one passes now.
        let (out, _) = f.feed(&[ROLE, &ROLE[..10]].concat());
        assert_eq!(out, ROLE);
        let (out, _) = f.feed(&ROLE[10..]);
        assert_eq!(out, ROLE);
        // CRLF framing, and a chunk with choices and usage is kept.
        let crlf = b"data: {\"choices\": [ ], \"usage\": {\"prompt_tokens_details\": {\"cached_tokens\": 16}}}\r\n\r\n";
        let (out, usage) = f.feed(crlf);
        assert_eq!((out, usage.and_then(|u| u.cached)), (Vec::new(), Some(16)));
        let with_choices =
            b"data: {\"choices\":[{\"text\":\"\"}],\"usage\":{\"prompt_tokens\":1}}\n\n";
        assert_eq!(f.feed(with_choices).0, with_choices);
        // An unterminated tail is passed on at the end.
        assert_eq!(f.feed(b"data: [DO").0, b"");
        assert_eq!(f.finish(), b"data: [DO");
        assert!(has_empty_choices(b"{\"choices\" :\n[]}"));
        assert!(!has_empty_choices(b"{\"choices\":[1]}"));
    }
}
