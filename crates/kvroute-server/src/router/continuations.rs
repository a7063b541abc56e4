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

use super::intake::RoutedRequest;
use kvroute_core::index::WorkerRank;
use kvroute_core::scheduler::placer::Preference;
use kvroute_core::scheduler::session::SessionTable;

use super::Router;
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
    #[cfg(test)]
    pub fn len(&self) -> usize {
        self.lock().len()
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
        while let Some(len) = crate::sse::event_end(&self.pending[start..]) {
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

/// An answer watched for the response it names, as it passes the
/// endpoint picker (the router's relay does the same with
/// [`ResponseIdScanner`] and [`response_id_in_body`]): a stream's
/// `response.created` event, or a whole body's `id` (read up to
/// `--max-answer-mib`), remembered as produced by `rank` for `owner`.
#[derive(Debug)]
#[cfg_attr(not(feature = "epp"), allow(dead_code))] // the endpoint picker's
pub struct ResponseWatch {
    rank: WorkerRank,
    owner: [u8; 32],
    /// `None` until the head says whether it streams; then `Some(sse)`.
    sse: Option<bool>,
    scanner: ResponseIdScanner,
    whole: Vec<u8>,
    /// Nothing more to look for: found, over the bound, or not a success.
    done: bool,
}

#[cfg_attr(not(feature = "epp"), allow(dead_code))] // the endpoint picker's
impl ResponseWatch {
    /// A watch for an answer from `rank` to a request of `owner`'s.
    pub fn new(rank: WorkerRank, owner: [u8; 32]) -> Self {
        ResponseWatch {
            rank,
            owner,
            sse: None,
            scanner: ResponseIdScanner::default(),
            whole: Vec::new(),
            done: false,
        }
    }

    /// The answer's head: whether it streams, and whether it succeeded
    /// (only a success names a response to remember).
    pub fn head(&mut self, sse: bool, success: bool) {
        self.sse = Some(sse);
        self.done |= !success;
    }

    /// A piece of the answer.
    pub fn feed(&mut self, router: &Router, bytes: &[u8]) {
        if self.done {
            return;
        }
        if self.sse == Some(true) {
            if let Some(id) = self.scanner.feed(bytes) {
                self.done = true;
                router.record_response(&id, &self.owner, self.rank);
            }
            return;
        }
        if self.whole.len() + bytes.len() > router.config().max_answer_bytes {
            self.done = true;
            self.whole = Vec::new();
            return;
        }
        self.whole.extend_from_slice(bytes);
    }

    /// The answer ended: a whole body's id is remembered.
    pub fn end(&mut self, router: &Router) {
        if self.done || self.sse == Some(true) {
            return;
        }
        self.done = true;
        if let Some(id) = response_id_in_body(&std::mem::take(&mut self.whole)) {
            router.record_response(&id, &self.owner, self.rank);
        }
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

impl Router {
    /// The key the request's previous response is pinned under: `None`
    /// without one, or without an owner (the endpoint picker), or for an id
    /// no engine writes.
    fn previous_key(&self, req: &RoutedRequest) -> Option<String> {
        let id = req.body.previous_response_id.as_deref()?;
        let owner = &req.owner;
        valid_response_id(id).then(|| self.pin_keys().key(PinKind::Response, owner, id))
    }

    /// Refuses a continuation whose previous response no replica knows as
    /// this owner's, with the engine's 404 for an unknown id (see the
    /// module docs); anything else passes.
    pub(super) fn check_continuation(&self, req: &RoutedRequest) -> Result<(), ProxyError> {
        let Some(id) = req.body.previous_response_id.as_deref() else {
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

    /// The rank that produced the request's `previous_response_id`, if
    /// this router knows it: what the placer puts first.
    pub(super) fn continued_rank(&self, req: &RoutedRequest) -> Option<WorkerRank> {
        req.body.previous_response_id.as_ref()?;
        let key = self.previous_key(req)?;
        self.continuations.rank(&key, self.now_ms())
    }

    /// Counts how a continuation fared in its placement: kept on its rank,
    /// or its rank unknown or not among the candidates.
    pub(super) fn count_continuation(&self, req: &RoutedRequest, outcome: Preference) {
        if req.body.previous_response_id.is_none() {
            return;
        }
        match outcome {
            Preference::Kept => _ = self.metrics.continuation_kept.inc(),
            Preference::Moved | Preference::None => _ = self.metrics.continuation_unknown.inc(),
        }
    }

    /// Records that `rank` produced response `id` for `owner`, here and at
    /// the other replicas.
    pub(crate) fn record_response(&self, id: &str, owner: &[u8; 32], rank: WorkerRank) {
        if !valid_response_id(id) {
            return;
        }
        let key = self.pin_keys().key(PinKind::Response, owner, id);
        self.continuations.record(&key, rank, self.now_ms());
        self.share_pin(PinKind::Response, key, rank, 0);
    }

    /// Tells the other replicas (`--nats`) where the pin under `key` goes.
    pub(super) fn share_pin(&self, kind: PinKind, key: String, rank: WorkerRank, tokens: u64) {
        let Some(share) = self.pin_share.as_ref() else {
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
    pub async fn fetch_pins(&self, req: &RoutedRequest) {
        let Some(share) = self.pin_share.as_ref() else {
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

impl SharedPins for Router {
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
    use kvroute_prompt::body::RoutingRequest;

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
        let router = Router::builder(super::super::ProxyConfig::default(), index)
            .build()
            .expect("a router");
        let (alice, bob) = ([1u8; 32], [2u8; 32]);
        router.record_response("resp_a", &alice, WorkerRank::new(0, 0));
        let ask = |owner: [u8; 32], id: &str| RoutedRequest {
            owner,
            body: RoutingRequest {
                previous_response_id: Some(id.to_owned()),
                ..RoutingRequest::default()
            },
            ..RoutedRequest::default()
        };
        assert!(router.check_continuation(&ask(alice, "resp_a")).is_ok());
        assert!(router.check_continuation(&RoutedRequest::default()).is_ok());
        let theirs = router
            .check_continuation(&ask(bob, "resp_a"))
            .expect_err("another owner's");
        let unknown = router
            .check_continuation(&ask(alice, "resp_b"))
            .expect_err("an unknown id");
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
        let refused = router.check_continuation(&ask(alice, &long));
        assert!(refused.is_err_and(|e| e.message().len() < 2 * MAX_RESPONSE_ID));
        assert_eq!(router.metrics.continuation_refused.get(), 3);
    }

    #[test]
    fn an_answer_watched_at_the_picker_remembers_the_response_it_names() {
        use kvroute_core::index::SharedIndex;
        let index = std::sync::Arc::new(SharedIndex::default());
        let router = Router::builder(super::super::ProxyConfig::default(), index)
            .build()
            .expect("a router");
        let (owner, rank) = ([7u8; 32], WorkerRank::new(0, 1));
        let continues = |id: &str| RoutedRequest {
            owner,
            body: RoutingRequest {
                previous_response_id: Some(id.to_owned()),
                ..RoutingRequest::default()
            },
            ..RoutedRequest::default()
        };
        let mut stream = ResponseWatch::new(rank, owner);
        stream.head(true, true);
        let event = b"data: {\"type\":\"response.created\",\"response\":{\"id\":\"resp_s\"}}\n\n";
        let (a, b) = event.split_at(20);
        stream.feed(&router, a);
        stream.feed(&router, b);
        assert_eq!(router.continued_rank(&continues("resp_s")), Some(rank));
        let mut whole = ResponseWatch::new(rank, owner);
        whole.head(false, true);
        whole.feed(&router, br#"{"id":"resp_w","object":"#);
        whole.feed(&router, br#""response","output":[]}"#);
        assert_eq!(
            router.continued_rank(&continues("resp_w")),
            None,
            "not before its end"
        );
        whole.end(&router);
        assert_eq!(router.continued_rank(&continues("resp_w")), Some(rank));
        let mut failed = ResponseWatch::new(rank, owner);
        failed.head(false, false);
        failed.feed(&router, br#"{"id":"resp_f","object":"response"}"#);
        failed.end(&router);
        assert!(router.check_continuation(&continues("resp_f")).is_err());
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
