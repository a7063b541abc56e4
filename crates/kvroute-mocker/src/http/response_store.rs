//! The Responses API's stored conversations of one engine, so that a
//! request naming a `previous_response_id` continues it (as vLLM's response
//! store does).
//!
//! Each entry is a whole conversation as chat messages — the prompt's
//! messages after its `instructions`, then the assistant's answer — so a
//! continuation renders `instructions`, the entry, then its own input, and
//! its prompt extends the previous one: on this engine it hits the prefix
//! cache. Bounded in entries and in bytes; the oldest entries go first.

use std::collections::{HashMap, VecDeque};
use std::sync::{Arc, Mutex, MutexGuard};

use serde_json::Value;

/// Entries kept by default.
pub const DEFAULT_MAX_ENTRIES: usize = 4096;

/// Bytes of stored conversations kept by default (their JSON, estimated).
pub const DEFAULT_MAX_BYTES: usize = 256 * 1024 * 1024;

/// One stored conversation.
#[derive(Debug, Clone, PartialEq)]
pub struct Stored {
    /// The conversation as chat messages, without `instructions`.
    pub messages: Arc<[Value]>,
    /// Its estimated size, counted against the store's byte bound.
    pub bytes: usize,
}

/// Conversations by response id, bounded.
#[derive(Debug)]
pub struct ResponseStore {
    inner: Mutex<Inner>,
    max_entries: usize,
    max_bytes: usize,
}

#[derive(Debug, Default)]
struct Inner {
    entries: HashMap<String, Stored>,
    /// Ids oldest first.
    order: VecDeque<String>,
    bytes: usize,
}

impl Default for ResponseStore {
    fn default() -> Self {
        ResponseStore::new(DEFAULT_MAX_ENTRIES, DEFAULT_MAX_BYTES)
    }
}

impl ResponseStore {
    /// A store of at most `max_entries` conversations and `max_bytes` bytes.
    pub fn new(max_entries: usize, max_bytes: usize) -> Self {
        ResponseStore {
            inner: Mutex::new(Inner::default()),
            max_entries,
            max_bytes,
        }
    }

    fn lock(&self) -> MutexGuard<'_, Inner> {
        self.inner
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
    }

    /// The conversation stored under `id`.
    pub fn get(&self, id: &str) -> Option<Stored> {
        self.lock().entries.get(id).cloned()
    }

    /// Keeps `stored` under `id`, dropping the oldest entries past the
    /// bounds; a conversation larger than the whole byte bound is not kept.
    pub fn insert(&self, id: String, stored: Stored) {
        if stored.bytes > self.max_bytes || self.max_entries == 0 {
            return;
        }
        let mut inner = self.lock();
        if let Some(old) = inner.entries.remove(&id) {
            inner.bytes -= old.bytes;
            inner.order.retain(|o| o != &id);
        }
        while inner.entries.len() >= self.max_entries || inner.bytes + stored.bytes > self.max_bytes
        {
            let Some(oldest) = inner.order.pop_front() else {
                break;
            };
            if let Some(gone) = inner.entries.remove(&oldest) {
                inner.bytes -= gone.bytes;
            }
        }
        inner.bytes += stored.bytes;
        inner.order.push_back(id.clone());
        inner.entries.insert(id, stored);
    }

    /// How many conversations are kept.
    pub fn len(&self) -> usize {
        self.lock().entries.len()
    }

    /// Whether none is kept.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn stored(text: &str, bytes: usize) -> Stored {
        Stored {
            messages: vec![json!({"role": "user", "content": text})].into(),
            bytes,
        }
    }

    #[test]
    fn the_oldest_entries_go_first_past_the_entry_bound() {
        let store = ResponseStore::new(2, 100);
        store.insert("a".into(), stored("a", 10));
        store.insert("b".into(), stored("b", 10));
        store.insert("c".into(), stored("c", 10));
        assert_eq!(store.len(), 2);
        assert!(store.get("a").is_none());
        assert_eq!(store.get("b"), Some(stored("b", 10)));
        // The same id again replaces its entry.
        store.insert("c".into(), stored("c2", 5));
        assert_eq!(store.get("c"), Some(stored("c2", 5)));
        assert_eq!(store.len(), 2);
    }

    #[test]
    fn the_oldest_entries_go_first_past_the_byte_bound() {
        let store = ResponseStore::new(10, 100);
        for id in ["a", "b", "c"] {
            store.insert(id.into(), stored(id, 30));
        }
        // 90 + 30 exceed 100: a goes.
        store.insert("d".into(), stored("d", 30));
        assert!(store.get("a").is_none());
        assert_eq!(store.len(), 3);
        // Only 5 bytes may stay beside 95: b, c and d go.
        store.insert("e".into(), stored("e", 95));
        assert_eq!(
            (store.len(), store.get("e").map(|s| s.bytes)),
            (1, Some(95))
        );
        // Larger than the whole store: not kept, and nothing dropped for it.
        store.insert("f".into(), stored("f", 101));
        assert!(store.get("f").is_none() && store.get("e").is_some());
    }
}
