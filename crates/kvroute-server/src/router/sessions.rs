//! Sessions at the router: the session a request names in its header
//! (`--session-header`, default `x-session-id`), looked up before its
//! candidates are ordered (the placer prefers its rank:
//! `kvroute_core::scheduler::session`) and recorded once it is placed.
//!
//! A session is its owner's ([`super::owners`]): the table is keyed by a
//! keyed hash of the owner and the session id
//! ([`crate::replica::pins::PinKeys`], [`Router::session_key`]), so the same
//! id named by another client is another session, and no client can steer
//! its requests to the rank of someone else's conversation.

use std::sync::{Mutex, PoisonError};
use std::time::Duration;

use axum::http::HeaderMap;
use kvroute_core::index::WorkerRank;
use kvroute_core::scheduler::placer::Preference;
use kvroute_core::scheduler::session::{SessionEntry, SessionTable};

use super::candidates::Candidates;
use super::intake::RoutedRequest;
use super::Router;
use crate::api::ProxyError;
use crate::replica::pins::PinKind;
use kvroute_prompt::body::{RoutingRequest, TextPrompt};

/// The longest session id taken.
pub const MAX_SESSION_ID: usize = 256;

/// `--session-header`, `--session-capacity` and `--session-ttl-secs`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SessionConfig {
    /// The header naming a request's session (lower case).
    pub header: String,
    /// Sessions remembered at most.
    pub capacity: usize,
    /// How long a session is remembered after its last turn.
    pub ttl: Duration,
}

impl Default for SessionConfig {
    fn default() -> Self {
        SessionConfig {
            header: "x-session-id".to_owned(),
            capacity: 100_000,
            ttl: Duration::from_secs(3_600),
        }
    }
}

/// The router's session table.
#[derive(Debug)]
pub struct Sessions {
    table: Mutex<SessionTable>,
}

impl Sessions {
    /// An empty table sized by `config`.
    pub fn new(config: &SessionConfig) -> Self {
        let ttl_ms = u64::try_from(config.ttl.as_millis()).unwrap_or(u64::MAX);
        Sessions {
            table: Mutex::new(SessionTable::new(config.capacity, ttl_ms)),
        }
    }

    /// Whether the session under `key` ([`Router::session_key`]) is
    /// remembered and not expired.
    pub fn contains(&self, key: &str, now_ms: u64) -> bool {
        self.lock().get(key, now_ms).is_some()
    }

    /// Records that the turn of `tokens` of the session under `key` went
    /// to `rank`.
    pub fn put(&self, key: &str, rank: WorkerRank, tokens: u64, now_ms: u64) {
        self.lock().put(key, rank, tokens, now_ms);
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, SessionTable> {
        self.table.lock().unwrap_or_else(PoisonError::into_inner)
    }
}

/// The tokens a request leaves in its rank's cache: its prompt's, or for a
/// prompt routed on load alone (text without `--tokenizer`) an estimate of
/// four bytes of its JSON text a token, so that its session's next turn is
/// still priced with the history its rank holds.
pub(super) fn history_tokens(req: &RoutingRequest) -> u64 {
    if let Some(tokens) = &req.tokens {
        return tokens.len() as u64;
    }
    let text = match &req.text {
        Some(TextPrompt::Completion(v) | TextPrompt::Chat(v)) => v,
        None => return 0,
    };
    serde_json::to_vec(text).map_or(0, |b| b.len() as u64 / 4)
}

impl Router {
    /// The session a request's headers name: `None` without the header; a
    /// 400 when it is not printable ASCII of 1 to [`MAX_SESSION_ID`] bytes.
    pub fn session_of(&self, headers: &HeaderMap) -> Result<Option<String>, ProxyError> {
        let Some(value) = headers.get(self.config.sessions.header.as_str()) else {
            return Ok(None);
        };
        match value.to_str() {
            Ok(id)
                if (1..=MAX_SESSION_ID).contains(&id.len())
                    && id.bytes().all(|b| b.is_ascii_graphic()) =>
            {
                Ok(Some(id.to_owned()))
            }
            _ => Err(ProxyError::bad_request(format!(
                "`{}` must be 1 to {MAX_SESSION_ID} printable ASCII characters",
                self.config.sessions.header
            ))),
        }
    }

    /// The key session `id` of `owner` is pinned under: what the router puts
    /// in [`RoutedRequest::session`] (never the id itself).
    pub fn session_key(&self, owner: &[u8; 32], id: &str) -> String {
        self.pin_keys().key(PinKind::Session, owner, id)
    }

    /// Where the request's session went last, if it names one this
    /// router remembers: what the placer prefers
    /// ([`kvroute_core::scheduler::session::prefer_session`]).
    pub(super) fn session_entry(&self, req: &RoutedRequest) -> Option<SessionEntry> {
        let id = req.session.as_deref()?;
        self.sessions.lock().get(id, self.now_ms())
    }

    /// Counts how the request's session fared in its placement.
    pub(super) fn count_session(&self, outcome: Preference) {
        match outcome {
            Preference::Kept => _ = self.metrics.session_kept.inc(),
            Preference::Moved => _ = self.metrics.session_moved.inc(),
            Preference::None => {}
        }
    }

    /// Records where the request's session went: candidate `chosen`.
    pub(super) fn record_session(
        &self,
        req: &RoutedRequest,
        candidates: &Candidates,
        chosen: usize,
    ) {
        let (Some(id), Some(s)) = (req.session.as_deref(), candidates.scored.get(chosen)) else {
            return;
        };
        let tokens = history_tokens(&req.body);
        self.sessions.put(id, s.key, tokens, self.now_ms());
        self.share_pin(PinKind::Session, id.to_owned(), s.key, tokens);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn a_turns_history_is_its_tokens_or_an_estimate_of_its_text() {
        let ids = RoutingRequest {
            tokens: Some(vec![1; 300]),
            ..RoutingRequest::default()
        };
        assert_eq!(history_tokens(&ids), 300);
        let chat = RoutingRequest {
            text: Some(TextPrompt::Chat(
                json!([{"role": "user", "content": "x".repeat(400)}]),
            )),
            ..RoutingRequest::default()
        };
        let estimate = history_tokens(&chat);
        assert!((100..=115).contains(&estimate), "{estimate}");
        assert_eq!(history_tokens(&RoutingRequest::default()), 0);
    }
}
