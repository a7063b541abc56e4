//! Responses API continuations: a request naming `previous_response_id`
//! goes to the rank that produced that response, and only when the client
//! that made the response asks.
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
//!
//! The engine continues any response for whoever names its id, so the
//! router is the only check: each response is remembered under a keyed
//! hash of its owner ([`super::owners`]) and its id, and a continuation
//! whose owner and id no replica knows — an unknown or expired id, or
//! another owner's — is answered the engine's own 404 by the router
//! ([`ProxyError::ResponseNotFound`]), the same answer in every case, so
//! that ids cannot be probed. Never forwarded: a pin evicted from the
//! bounded table must not reopen the conversation to anyone.

use std::sync::{Mutex, PoisonError};

use kvroute_core::index::WorkerRank;
use kvroute_core::scheduler::session::SessionTable;
use kvroute_prompt::body::RoutingRequest;

use super::candidates::Candidates;
use super::Proxy;
use crate::api::ProxyError;
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

/// The ranks that produced recent responses, by the keyed hash of their
/// owner and id ([`crate::replica::pins::PinKeys`]).
#[derive(Debug)]
pub struct Continuations {
    ranks: Mutex<SessionTable>,
}

impl Continuations {
    /// An empty table of at most `capacity` responses, each kept `ttl_ms`.
    pub fn new(capacity: usize, ttl_ms: u64) -> Self {
        Continuations {
            ranks: Mutex::new(SessionTable::new(capacity, ttl_ms)),
        }
    }

    /// The rank that produced the response pinned under `key`, if known
    /// and not expired.
    pub fn rank(&self, key: &str, now_ms: u64) -> Option<WorkerRank> {
        self.lock().get(key, now_ms).map(|e| e.rank)
    }

    /// Records that `rank` produced the response pinned under `key`.
    pub fn record(&self, key: &str, rank: WorkerRank, now_ms: u64) {
        self.lock().put(key, rank, 0, now_ms);
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
        self.ranks.lock().unwrap_or_else(PoisonError::into_inner)
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
    /// The key the request's previous response is pinned under: `None`
    /// without one, or without an owner (the endpoint picker), or for an id
    /// no engine writes.
    fn previous_key(&self, req: &RoutingRequest) -> Option<String> {
        let id = req.previous_response_id.as_deref()?;
        let owner = req.owner.as_ref()?;
        valid_response_id(id).then(|| self.pin_keys().key(PinKind::Response, owner, id))
    }

    /// Refuses a continuation whose previous response no replica knows as
    /// this owner's, with the engine's 404 for an unknown id (see the
    /// module docs); anything else passes.
    pub(super) fn check_continuation(&self, req: &RoutingRequest) -> Result<(), ProxyError> {
        let Some(id) = req.previous_response_id.as_deref() else {
            return Ok(());
        };
        let known = self
            .previous_key(req)
            .is_some_and(|key| self.continuations.rank(&key, self.now_ms()).is_some());
        if known {
            return Ok(());
        }
        self.metrics.continuation_refused.inc();
        let shown: String = id.chars().take(MAX_RESPONSE_ID).collect();
        Err(ProxyError::ResponseNotFound(shown))
    }

    /// `ordered` with the rank that produced the request's
    /// `previous_response_id` first, when it is among the candidates.
    pub(super) fn order_for_continuation(
        &self,
        req: &RoutingRequest,
        candidates: &Candidates,
        mut ordered: Vec<usize>,
    ) -> Vec<usize> {
        if req.previous_response_id.is_none() {
            return ordered;
        }
        let rank = self
            .previous_key(req)
            .and_then(|key| self.continuations.rank(&key, self.now_ms()));
        let Some(rank) = rank else {
            self.metrics.continuation_unknown.inc();
            return ordered;
        };
        let at = ordered
            .iter()
            .position(|&i| candidates.scored.get(i).is_some_and(|s| s.key == rank));
        if let Some(at) = at {
            let i = ordered.remove(at);
            ordered.insert(0, i);
            self.metrics.continuation_kept.inc();
        } else {
            self.metrics.continuation_unknown.inc();
        }
        ordered
    }

    /// Records that `rank` produced response `id` for `owner`, here and at
    /// the other replicas.
    pub(super) fn record_response(&self, id: &str, owner: &[u8; 32], rank: WorkerRank) {
        if !valid_response_id(id) {
            return;
        }
        let key = self.pin_keys().key(PinKind::Response, owner, id);
        self.continuations.record(&key, rank, self.now_ms());
        self.share_pin(PinKind::Response, key, rank, 0);
    }

    /// Tells the other replicas (`--nats`) where the pin under `key` goes.
    pub(super) fn share_pin(&self, kind: PinKind, key: String, rank: WorkerRank, tokens: u64) {
        let Some(share) = self.pin_share.get() else {
            return;
        };
        let targets = self.targets();
        let Some(target) = targets.iter().find(|t| t.route.id == rank.worker) else {
            return;
        };
        share.push(Pin {
            kind,
            key,
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
        if let Some(key) = req.session.as_deref() {
            if !self.sessions.contains(key, now) {
                if let Some(pin) = share.fetch(PinKind::Session, key).await {
                    self.apply_pin(&pin);
                }
            }
        }
        if let Some(key) = self.previous_key(req) {
            if self.continuations.rank(&key, now).is_none() {
                if let Some(pin) = share.fetch(PinKind::Response, &key).await {
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
            PinKind::Session => self.sessions.put(&pin.key, rank, pin.tokens, now),
            PinKind::Response => self.continuations.record(&pin.key, rank, now),
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
    fn a_continuation_passes_only_for_the_owner_that_made_the_response() {
        use kvroute_core::index::SharedIndex;
        let index = std::sync::Arc::new(SharedIndex::default());
        let proxy = Proxy::new(super::super::ProxyConfig::default(), index).expect("a proxy");
        let (alice, bob) = ([1u8; 32], [2u8; 32]);
        proxy.record_response("resp_a", &alice, WorkerRank::new(0, 0));
        let ask = |owner: Option<[u8; 32]>, id: &str| RoutingRequest {
            owner,
            previous_response_id: Some(id.to_owned()),
            ..RoutingRequest::default()
        };
        assert!(proxy
            .check_continuation(&ask(Some(alice), "resp_a"))
            .is_ok());
        assert!(proxy.check_continuation(&RoutingRequest::default()).is_ok());
        let theirs = proxy
            .check_continuation(&ask(Some(bob), "resp_a"))
            .expect_err("another owner's");
        let unknown = proxy
            .check_continuation(&ask(Some(alice), "resp_b"))
            .expect_err("an unknown id");
        let no_owner = proxy.check_continuation(&ask(None, "resp_a"));
        assert!(
            no_owner.is_err(),
            "a request of no owner's continues nothing"
        );
        assert_eq!(theirs.status().as_u16(), 404);
        let body = theirs.body();
        assert_eq!(
            body["error"],
            serde_json::json!({"message": "Response with id 'resp_a' not found.",
                "type": "invalid_request_error", "param": "previous_response_id", "code": 404})
        );
        assert_eq!(
            unknown.body()["error"]["message"],
            "Response with id 'resp_b' not found.",
            "the same answer, whoever made the id"
        );
        let long = "r".repeat(10 * MAX_RESPONSE_ID);
        let refused = proxy.check_continuation(&ask(Some(alice), &long));
        assert!(refused.is_err_and(|e| e.message().len() < 2 * MAX_RESPONSE_ID));
        assert_eq!(proxy.metrics.continuation_refused.get(), 4);
    }

    #[test]
    fn ranks_are_kept_by_key_within_their_time() {
        let t = Continuations::new(2, 1_000);
        let rank = WorkerRank::new(3, 1);
        t.record("k1", rank, 0);
        assert_eq!(t.rank("k1", 999), Some(rank));
        assert_eq!(t.rank("k1", 1_000), None);
        assert_eq!(t.rank("k2", 0), None);
        assert_eq!(t.len(), 1);
    }
}
