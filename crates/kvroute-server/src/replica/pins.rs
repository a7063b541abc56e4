//! Where conversations are pinned, shared by the replicas: the rank each
//! session's last turn went to (`x-session-id`) and the rank that produced
//! each Responses API answer (for `previous_response_id`), so that a
//! conversation's next turn lands on its rank whichever replica takes it.
//!
//! The pins live in a JetStream key-value bucket (`{prefix}-pins`, in
//! memory, every entry kept at most the bucket's age): a replica puts each
//! pin it makes, watches the bucket for its peers' pins (applied to its own
//! tables as they come), and asks the bucket for a pin it does not have —
//! one made before it started — before it places the turn. A key is the
//! pin's kind and a hash of its id; the value names the worker (the same
//! at every replica) and the rank, and repeats the id, so a hash collision
//! is never taken for a match. Best effort: with NATS down a replica pins
//! from its own tables, and a lost pin costs a turn its cache, not its
//! answer.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, OnceLock, PoisonError};
use std::time::Duration;

use async_nats::jetstream::{kv, stream};
use futures_util::StreamExt;
use kvroute_core::index::DpRank;
use serde::{Deserialize, Serialize};
use tracing::{debug, warn};

use super::message::{decode_message, encode_message};
use super::outbox::{push_bounded, sender_id};

/// Pins waiting to be put while NATS is slow; more are dropped (counted).
const MAX_PENDING: usize = 4_096;
/// How long a turn waits for a pin it does not have.
const FETCH_WITHIN: Duration = Duration::from_millis(150);
/// The bucket's size bound; the oldest pins go first past it.
const MAX_BUCKET_BYTES: i64 = 256 << 20;

/// What a pin pins.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub enum PinKind {
    /// A session's last turn (`x-session-id`).
    Session,
    /// A Responses API answer (`previous_response_id`).
    Response,
}

impl PinKind {
    fn key_prefix(self) -> &'static str {
        match self {
            PinKind::Session => "s",
            PinKind::Response => "r",
        }
    }
}

/// One pin, as replicas share it.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Pin {
    /// What it pins.
    pub kind: PinKind,
    /// The session or response id.
    pub id: String,
    /// The worker's name.
    pub worker: String,
    /// Its data-parallel rank.
    pub rank: DpRank,
    /// The history the rank caches for it, in tokens (sessions).
    pub tokens: u64,
}

/// What a peer's pin does here: the proxy implements it, so this module
/// never reaches into the proxy.
pub trait SharedPins: Send + Sync + 'static {
    /// Applies a peer's pin; `false` when it names a worker or rank this
    /// replica does not have.
    fn apply_pin(&self, pin: &Pin) -> bool;
}

/// A pin with its sender, as stored in the bucket.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
struct Stored {
    sender: u64,
    pin: Pin,
}

/// Counts of what the sharing did.
#[derive(Debug, Default)]
pub struct PinCounters {
    /// Pins put in the bucket.
    pub sent: AtomicU64,
    /// Peers' pins applied here (watched or fetched).
    pub received: AtomicU64,
    /// Pins not put: NATS was down or too slow.
    pub dropped: AtomicU64,
    /// Entries skipped as undecodable, or naming an unknown worker.
    pub skipped: AtomicU64,
}

/// This replica's side of the sharing.
#[derive(Debug)]
pub struct PinShare {
    bucket: String,
    max_age: Duration,
    sender: u64,
    store: OnceLock<kv::Store>,
    pending: Mutex<Vec<Pin>>,
    wake: tokio::sync::Notify,
    /// What the sharing did.
    pub counters: PinCounters,
}

/// The bucket key of pin `id` of `kind`: JetStream keys take a narrow
/// alphabet, so the id is hashed (FNV-1a, 64 bits) and kept in the value.
fn key_of(kind: PinKind, id: &str) -> String {
    let hash = id.bytes().fold(0xcbf2_9ce4_8422_2325_u64, |h, b| {
        (h ^ u64::from(b)).wrapping_mul(0x0100_0000_01b3)
    });
    format!("{}.{hash:016x}", kind.key_prefix())
}

impl PinShare {
    /// Sharing in the bucket of `prefix`, each pin kept at most `max_age`.
    pub fn new(prefix: &str, max_age: Duration) -> Self {
        PinShare {
            bucket: format!("{prefix}-pins"),
            max_age,
            sender: sender_id(),
            store: OnceLock::new(),
            pending: Mutex::new(Vec::new()),
            wake: tokio::sync::Notify::new(),
            counters: PinCounters::default(),
        }
    }

    /// Queues one of this replica's pins for its peers.
    pub fn push(&self, pin: Pin) {
        if push_bounded(&self.pending, pin, MAX_PENDING, &self.counters.dropped) {
            self.wake.notify_one();
        }
    }

    /// The bucket's pin of `kind` for `id`, asked for at most
    /// 150 ms; `None` when it has none, or NATS is not there.
    pub async fn fetch(&self, kind: PinKind, id: &str) -> Option<Pin> {
        let store = self.store.get()?;
        let got = tokio::time::timeout(FETCH_WITHIN, store.get(key_of(kind, id))).await;
        let bytes = match got {
            Ok(Ok(Some(bytes))) => bytes,
            Ok(Ok(None)) => return None,
            Ok(Err(e)) => {
                debug!(error = %e, "a pin could not be read from the bucket");
                return None;
            }
            Err(_) => return None,
        };
        let stored: Stored = decode_message(&bytes).ok()?;
        (stored.pin.kind == kind && stored.pin.id == id).then_some(stored.pin)
    }

    /// Opens the bucket, then puts this replica's pins and applies its
    /// peers' to `pins`, until the tasks are aborted.
    pub fn run(
        self: &Arc<Self>,
        client: async_nats::Client,
        pins: Arc<dyn SharedPins>,
    ) -> Vec<tokio::task::JoinHandle<()>> {
        let share = self.clone();
        vec![tokio::spawn(async move {
            let store = share.open(client).await;
            let _ = share.store.set(store.clone());
            let watcher = {
                let (share, store) = (share.clone(), store.clone());
                tokio::spawn(async move { share.watch(store, pins).await })
            };
            share.publish(store).await;
            watcher.abort();
        })]
    }

    async fn open(&self, client: async_nats::Client) -> kv::Store {
        let js = async_nats::jetstream::new(client);
        loop {
            if let Ok(store) = js.get_key_value(&self.bucket).await {
                return store;
            }
            // The bucket's stream, made as a key-value bucket's is (the
            // client's own `create_key_value` first asks for account
            // details that the nats-server 2.9 of Debian answers in a shape
            // it cannot read). Oldest pins go first when it is full.
            let config = stream::Config {
                name: format!("KV_{}", self.bucket),
                description: Some(
                    "kvroute: the rank each session and response is pinned to".into(),
                ),
                subjects: vec![format!("$KV.{}.>", self.bucket)],
                max_messages_per_subject: 1,
                max_bytes: MAX_BUCKET_BYTES,
                max_age: self.max_age,
                duplicate_window: self.max_age.min(Duration::from_secs(120)),
                storage: stream::StorageType::Memory,
                allow_rollup: true,
                deny_delete: true,
                allow_direct: true,
                discard: stream::DiscardPolicy::Old,
                ..stream::Config::default()
            };
            if let Err(e) = js.get_or_create_stream(config).await {
                warn!(bucket = %self.bucket, error = %e, "the pins bucket could not be opened; retrying");
                tokio::time::sleep(Duration::from_secs(1)).await;
            }
        }
    }

    async fn publish(&self, store: kv::Store) {
        loop {
            let pins =
                std::mem::take(&mut *self.pending.lock().unwrap_or_else(PoisonError::into_inner));
            if pins.is_empty() {
                self.wake.notified().await;
                continue;
            }
            for pin in pins {
                let key = key_of(pin.kind, &pin.id);
                let value = encode_message(&Stored {
                    sender: self.sender,
                    pin,
                });
                let counter = match store.put(key, value.into()).await {
                    Ok(_) => &self.counters.sent,
                    Err(e) => {
                        debug!(error = %e, "a pin was not put in the bucket");
                        &self.counters.dropped
                    }
                };
                counter.fetch_add(1, Ordering::Relaxed);
            }
        }
    }

    async fn watch(&self, store: kv::Store, pins: Arc<dyn SharedPins>) {
        loop {
            let mut updates = match store.watch_all().await {
                Ok(w) => w,
                Err(e) => {
                    warn!(error = %e, "watching the pins bucket failed; retrying");
                    tokio::time::sleep(Duration::from_secs(1)).await;
                    continue;
                }
            };
            while let Some(entry) = updates.next().await {
                let Ok(entry) = entry else {
                    break;
                };
                if entry.operation == kv::Operation::Put {
                    self.apply(&entry.value, pins.as_ref());
                }
            }
            tokio::time::sleep(Duration::from_millis(200)).await;
        }
    }

    /// Applies one bucket value (this replica's own are skipped).
    fn apply(&self, value: &[u8], pins: &dyn SharedPins) {
        let stored: Stored = match decode_message(value) {
            Ok(s) => s,
            Err(e) => {
                if self.counters.skipped.fetch_add(1, Ordering::Relaxed) == 0 {
                    warn!(error = %e, "an undecodable pin was skipped (further ones are only counted)");
                }
                return;
            }
        };
        if stored.sender == self.sender {
            return;
        }
        let counter = if pins.apply_pin(&stored.pin) {
            &self.counters.received
        } else {
            &self.counters.skipped
        };
        counter.fetch_add(1, Ordering::Relaxed);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[derive(Default)]
    struct Tables(Mutex<Vec<Pin>>);

    impl SharedPins for Tables {
        fn apply_pin(&self, pin: &Pin) -> bool {
            self.0
                .lock()
                .unwrap_or_else(PoisonError::into_inner)
                .push(pin.clone());
            pin.worker == "w0"
        }
    }

    fn pin(worker: &str) -> Pin {
        Pin {
            kind: PinKind::Session,
            id: "chat-1".into(),
            worker: worker.into(),
            rank: DpRank(1),
            tokens: 300,
        }
    }

    #[test]
    fn keys_take_the_buckets_alphabet_whatever_the_id() {
        let k = key_of(PinKind::Response, "resp_…/ with spaces");
        assert!(k.starts_with("r.") && k.len() == 18, "{k}");
        assert!(k[2..].bytes().all(|b| b.is_ascii_hexdigit()));
        assert_ne!(
            key_of(PinKind::Session, "a"),
            key_of(PinKind::Response, "a")
        );
    }

    #[test]
    fn peers_pins_are_applied_and_own_and_damaged_ones_skipped() {
        let share = PinShare::new("kvroute", Duration::from_secs(60));
        let tables = Tables::default();
        let peer = encode_message(&Stored {
            sender: share.sender ^ 1,
            pin: pin("w0"),
        });
        share.apply(&peer, &tables);
        let own = encode_message(&Stored {
            sender: share.sender,
            pin: pin("w0"),
        });
        share.apply(&own, &tables);
        share.apply(b"\x01garbage", &tables);
        let unknown = encode_message(&Stored {
            sender: 7,
            pin: pin("elsewhere"),
        });
        share.apply(&unknown, &tables);
        assert_eq!(
            tables
                .0
                .lock()
                .unwrap_or_else(PoisonError::into_inner)
                .len(),
            2
        );
        assert_eq!(share.counters.received.load(Ordering::Relaxed), 1);
        assert_eq!(share.counters.skipped.load(Ordering::Relaxed), 2);
    }

    #[test]
    fn a_full_queue_drops_and_counts() {
        let share = PinShare::new("kvroute", Duration::from_secs(60));
        for _ in 0..MAX_PENDING + 3 {
            share.push(pin("w0"));
        }
        assert_eq!(share.counters.dropped.load(Ordering::Relaxed), 3);
    }
}
