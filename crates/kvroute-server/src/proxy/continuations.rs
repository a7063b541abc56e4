//! Responses API continuations: a request naming `previous_response_id`
//! goes to the rank that produced that response.
//!
//! An engine that serves `/v1/responses` keeps each response it answered
//! (the conversation so far) and builds a continuation's prompt from it, so
//! only the engine that wrote the previous response can serve the next one
//! at all — and its cache holds the conversation's blocks. The router learns
//! each response's id from the answer as it passes (a JSON body's `id`, or
//! a stream's `response.created` event) and remembers its rank in a table
//! bounded in entries and time, shared with the other replicas
//! ([`crate::replica::pins`]). A continuation's known rank is tried first
//! whatever its cost; the others follow as usual.

use std::sync::{Mutex, PoisonError};

use kvroute_core::index::WorkerRank;
use kvroute_core::scheduler::session::SessionTable;
use kvroute_prompt::body::RoutingRequest;

use super::candidates::Candidates;
use super::Proxy;
use crate::replica::pins::{Pin, PinKind, SharedPins};

/// The longest response id taken from an answer or a request.
pub const MAX_RESPONSE_ID: usize = 256;

/// Bytes of a stream's start searched for its `response.created` event.
const SCAN_LIMIT: usize = 64 << 10;

/// Whether `id` is a response id kvroute keeps: 1 to [`MAX_RESPONSE_ID`]
/// printable ASCII bytes.
pub fn valid_response_id(id: &str) -> bool {
    (1..=MAX_RESPONSE_ID).contains(&id.len()) && id.bytes().all(|b| b.is_ascii_graphic())
}

/// The ranks that produced recent responses, by response id.
#[derive(Debug)]
pub struct Continuations {
    owners: Mutex<SessionTable>,
}

impl Continuations {
    /// An empty table of at most `capacity` responses, each kept `ttl_ms`.
    pub fn new(capacity: usize, ttl_ms: u64) -> Self {
        Continuations {
            owners: Mutex::new(SessionTable::new(capacity, ttl_ms)),
        }
    }

    /// The rank that produced response `id`, if known and not expired.
    pub fn owner(&self, id: &str, now_ms: u64) -> Option<WorkerRank> {
        self.lock().get(id, now_ms).map(|e| e.rank)
    }

    /// Records that `rank` produced response `id`.
    pub fn record(&self, id: &str, rank: WorkerRank, now_ms: u64) {
        if valid_response_id(id) {
            self.lock().put(id, rank, 0, now_ms);
        }
    }

    /// Responses remembered now.
    pub fn len(&self) -> usize {
        self.lock().len()
    }

    /// Whether none is.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, SessionTable> {
        self.owners.lock().unwrap_or_else(PoisonError::into_inner)
    }
}

/// The `id` of a whole Responses API answer (`"object": "response"`).
pub fn response_id_in_body(body: &[u8]) -> Option<String> {
    #[derive(serde::Deserialize)]
    struct Answer {
        id: String,
        object: Option<String>,
    }
    let answer: Answer = serde_json::from_slice(body).ok()?;
    (answer.object.as_deref() == Some("response") && valid_response_id(&answer.id))
        .then_some(answer.id)
}

/// Finds a Responses stream's id in its `response.created` event, reading
/// no more than the stream's first 64 KiB.
#[derive(Debug, Default)]
pub struct ResponseIdScanner {
    pending: Vec<u8>,
    done: bool,
}

impl ResponseIdScanner {
    /// Takes the next bytes of the stream; the response id once found
    /// (then nothing more is read).
    pub fn feed(&mut self, chunk: &[u8]) -> Option<String> {
        if self.done {
            return None;
        }
        let room = SCAN_LIMIT.saturating_sub(self.pending.len());
        self.pending
            .extend_from_slice(&chunk[..chunk.len().min(room)]);
        let mut start = 0;
        while let Some(len) = super::relay::sse_event_end(&self.pending[start..]) {
            let event = &self.pending[start..start + len];
            start += len;
            if let Some(id) = created_id(event) {
                self.done = true;
                self.pending = Vec::new();
                return Some(id);
            }
        }
        self.pending.drain(..start);
        if self.pending.len() >= SCAN_LIMIT {
            self.done = true;
            self.pending = Vec::new();
        }
        None
    }
}

/// The response id of a `response.created` SSE event.
fn created_id(event: &[u8]) -> Option<String> {
    #[derive(serde::Deserialize)]
    struct Created {
        #[serde(rename = "type")]
        kind: String,
        response: Option<Inner>,
    }
    #[derive(serde::Deserialize)]
    struct Inner {
        id: String,
    }
    let text = std::str::from_utf8(event).ok()?;
    let data = text
        .lines()
        .find_map(|l| l.strip_prefix("data:"))
        .map(str::trim_start)?;
    let created: Created = serde_json::from_str(data).ok()?;
    let id = created.response?.id;
    (created.kind == "response.created" && valid_response_id(&id)).then_some(id)
}

impl Proxy {
    /// `ordered` with the rank that produced the request's
    /// `previous_response_id` first, when it is among the candidates.
    pub(super) fn order_for_continuation(
        &self,
        req: &RoutingRequest,
        candidates: &Candidates,
        mut ordered: Vec<usize>,
    ) -> Vec<usize> {
        let Some(id) = req.previous_response_id.as_deref() else {
            return ordered;
        };
        let Some(owner) = self.continuations.owner(id, self.now_ms()) else {
            self.metrics.continuation_unknown.inc();
            return ordered;
        };
        let at = ordered
            .iter()
            .position(|&i| candidates.scored.get(i).is_some_and(|s| s.key == owner));
        if let Some(at) = at {
            let i = ordered.remove(at);
            ordered.insert(0, i);
            self.metrics.continuation_kept.inc();
        } else {
            self.metrics.continuation_unknown.inc();
        }
        ordered
    }

    /// Records that `rank` produced response `id`, here and at the other
    /// replicas.
    pub(super) fn record_response(&self, id: &str, rank: WorkerRank) {
        self.continuations.record(id, rank, self.now_ms());
        self.share_pin(PinKind::Response, id, rank, 0);
    }

    /// Tells the other replicas (`--nats`) where `id` is pinned.
    pub(super) fn share_pin(&self, kind: PinKind, id: &str, rank: WorkerRank, tokens: u64) {
        let Some(share) = self.pin_share.get() else {
            return;
        };
        let targets = self.targets();
        let Some(target) = targets.iter().find(|t| t.route.id == rank.worker) else {
            return;
        };
        share.push(Pin {
            kind,
            id: id.to_owned(),
            worker: target.name.to_string(),
            rank: rank.rank,
            tokens,
        });
    }

    /// Looks up in the replicas' bucket the request's session and previous
    /// response when this replica has not seen them (pinned before it
    /// started), so the turn is placed as if it had.
    pub async fn fetch_pins(&self, req: &RoutingRequest) {
        let Some(share) = self.pin_share.get() else {
            return;
        };
        let now = self.now_ms();
        if let Some(id) = req.session.as_deref() {
            if !self.sessions.contains(id, now) {
                if let Some(pin) = share.fetch(PinKind::Session, id).await {
                    self.apply_pin(&pin);
                }
            }
        }
        if let Some(id) = req.previous_response_id.as_deref() {
            if self.continuations.owner(id, now).is_none() {
                if let Some(pin) = share.fetch(PinKind::Response, id).await {
                    self.apply_pin(&pin);
                }
            }
        }
    }
}

impl SharedPins for Proxy {
    fn apply_pin(&self, pin: &Pin) -> bool {
        let targets = self.targets();
        let Some(target) = targets.iter().find(|t| *t.name == *pin.worker) else {
            return false;
        };
        if !target.route.ranks.contains(&pin.rank) {
            return false;
        }
        let rank = WorkerRank {
            worker: target.route.id,
            rank: pin.rank,
        };
        let now = self.now_ms();
        match pin.kind {
            PinKind::Session => self.sessions.put(&pin.id, rank, pin.tokens, now),
            PinKind::Response => self.continuations.record(&pin.id, rank, now),
        }
        true
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn an_answer_names_its_response_id_in_its_body_or_its_first_event() {
        let body = br#"{"id":"resp_1","object":"response","output":[]}"#;
        assert_eq!(response_id_in_body(body).as_deref(), Some("resp_1"));
        assert_eq!(
            response_id_in_body(br#"{"id":"chatcmpl-1","object":"chat.completion"}"#),
            None
        );
        let stream = b"event: response.created\ndata: {\"type\":\"response.created\",\"sequence_number\":0,\"response\":{\"id\":\"resp_9\",\"status\":\"in_progress\"}}\n\nevent: response.in_progress\n";
        for cut in 1..stream.len() {
            let mut scanner = ResponseIdScanner::default();
            let (a, b) = stream.split_at(cut);
            let found = scanner.feed(a).or_else(|| scanner.feed(b));
            assert_eq!(found.as_deref(), Some("resp_9"), "cut at {cut}");
        }
    }

    #[test]
    fn a_stream_without_the_event_is_read_no_further_than_the_limit() {
        let mut scanner = ResponseIdScanner::default();
        let filler = vec![b'x'; SCAN_LIMIT / 4];
        for _ in 0..8 {
            assert_eq!(scanner.feed(&filler), None);
        }
        assert!(scanner.done && scanner.pending.is_empty());
        let late = b"data: {\"type\":\"response.created\",\"response\":{\"id\":\"r\"}}\n\n";
        assert_eq!(scanner.feed(late), None, "gave up");
    }

    #[test]
    fn owners_are_kept_by_id_within_their_time() {
        let t = Continuations::new(2, 1_000);
        let rank = WorkerRank::new(3, 1);
        t.record("resp_a", rank, 0);
        t.record("bad id", rank, 0);
        assert_eq!(t.owner("resp_a", 999), Some(rank));
        assert_eq!(t.owner("resp_a", 1_000), None);
        assert_eq!(t.owner("bad id", 0), None);
        assert_eq!(t.len(), 1);
    }
}
