//! Where conversations are pinned, shared by the replicas: the rank each
//! session's last turn went to (`x-session-id`) and the rank that produced
//! each Responses API answer (for `previous_response_id`), so that a
//! conversation's next turn lands on its rank whichever replica takes it.
//!
//! The pins live in a JetStream key-value bucket (`{prefix}-pins`, in
//! memory, every entry kept at most the bucket's age): a replica puts each
//! pin it makes, watches the bucket for its peers' pins (every key's last
//! one when the watch opens, then each as it comes, applied to its own
//! tables), and asks the bucket for a pin it does not have —
//! one made before it started — before it places the turn. Best effort:
//! with NATS down a replica pins from its own tables, and a lost pin costs
//! a session's turn its cache (a continuation its answer: see below).
//!
//! **No id in the clear.** A pin is stored under a keyed hash
//! ([`PinKeys`], HMAC-SHA256) of its kind, its owner (the client it is
//! bound to, `crate::router::owners`) and its session or response id, and
//! its value names only the worker, the rank and the history in tokens: a
//! NATS client that reads the bucket learns no id it could use. The key is
//! the `--nats-pins-key` every replica shares; without one it is a public
//! constant, and the hashes still cannot be turned back into ids (response
//! ids are 128-bit random), but anyone may compute them. The local tables
//! are keyed by the same hashes, so a peer's pin applies as it comes.
//!
//! **Made again after NATS loses it.** The bucket's stream is in memory, so
//! a NATS server that restarts comes back without it. At every
//! reconnection, and after a pin could not be put, the replica checks the
//! stream, makes it again when it is gone (or finds that a peer did:
//! its creation time changed), and then watches the new one afresh
//! (`kvroute_replica_buckets_recreated_total`, and a log line).

use std::path::Path;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, OnceLock, PoisonError};
use std::time::Duration;

use async_nats::jetstream::{self, kv, stream};
use futures_util::StreamExt;
use kvroute_core::index::DpRank;
use ring::hmac;
use serde::{Deserialize, Serialize};
use tokio::sync::watch;
use tracing::{debug, info, warn};

use super::message::{decode_message, encode_message};
use super::outbox::{push_bounded, sender_id};

/// Pins waiting to be put while NATS is slow; more are dropped (counted).
const MAX_PENDING: usize = 4_096;
/// How long a turn waits for a pin it does not have.
const FETCH_WITHIN: Duration = Duration::from_millis(150);
/// The bucket's size bound; the oldest pins go first past it.
const MAX_BUCKET_BYTES: i64 = 256 << 20;
/// The least time between two checks of the bucket, and between two tries
/// to make it while NATS refuses.
const RECHECK_EVERY: Duration = Duration::from_secs(1);
/// The fewest bytes a `--nats-pins-key` may have.
pub const MIN_SECRET: usize = 16;
/// The most bytes a `--nats-pins-key` may have.
pub const MAX_SECRET: usize = 4_096;
/// The HMAC key without `--nats-pins-key`: public, so its hashes only hide
/// the ids (they cannot be reversed), and the replicas still agree on them.
const PUBLIC_KEY: &[u8] = b"kvroute pins v1, no --nats-pins-key";

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

/// The secret the replicas key their pins' hashes with (`--nats-pins-key`
/// or `--nats-pins-key-file`); never printed.
#[derive(Clone, PartialEq, Eq)]
pub struct PinsSecret(Vec<u8>);

impl std::fmt::Debug for PinsSecret {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("PinsSecret(…)")
    }
}

/// Why a pins key was refused.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum PinsSecretError {
    /// Too short to be a secret, or too long to be one.
    #[error(
        "the pins key must be {MIN_SECRET} to {MAX_SECRET} bytes, not {0} \
         (make one with `openssl rand -hex 32`)"
    )]
    Length(usize),
    /// Both `--nats-pins-key` and `--nats-pins-key-file`.
    #[error("give --nats-pins-key or --nats-pins-key-file, not both")]
    Both,
    /// The key file could not be read.
    #[error("reading the pins key file {path}: {source}")]
    Read {
        /// The file.
        path: String,
        /// Why.
        source: std::io::Error,
    },
}

impl PinsSecret {
    /// `bytes` as a secret (whitespace at either end dropped); an error
    /// when it is not [`MIN_SECRET`] to [`MAX_SECRET`] bytes.
    pub fn new(bytes: &[u8]) -> Result<Self, PinsSecretError> {
        let bytes = bytes.trim_ascii();
        if !(MIN_SECRET..=MAX_SECRET).contains(&bytes.len()) {
            return Err(PinsSecretError::Length(bytes.len()));
        }
        Ok(PinsSecret(bytes.to_vec()))
    }

    /// The secret `--nats-pins-key` gives (`value`) or
    /// `--nats-pins-key-file` holds (`file`), if either (not both).
    pub fn from_flags(
        value: Option<&str>,
        file: Option<&Path>,
    ) -> Result<Option<Self>, PinsSecretError> {
        match (value, file) {
            (Some(_), Some(_)) => Err(PinsSecretError::Both),
            (Some(value), None) => PinsSecret::new(value.as_bytes()).map(Some),
            (None, Some(file)) => PinsSecret::read_file(file).map(Some),
            (None, None) => Ok(None),
        }
    }

    /// The secret in the file at `path` (at most [`MAX_SECRET`] bytes read,
    /// and one more to tell a longer file).
    pub fn read_file(path: &Path) -> Result<Self, PinsSecretError> {
        use std::io::Read as _;
        let read_error = |source| PinsSecretError::Read {
            path: path.display().to_string(),
            source,
        };
        let file = std::fs::File::open(path).map_err(read_error)?;
        let mut bytes = Vec::new();
        file.take(MAX_SECRET as u64 + 1)
            .read_to_end(&mut bytes)
            .map_err(read_error)?;
        PinsSecret::new(&bytes)
    }
}

/// The keyed hash pins are stored and looked up under: HMAC-SHA256 over the
/// pin's kind, its owner's digest and its id, as 64 hex digits.
pub struct PinKeys {
    key: hmac::Key,
}

impl std::fmt::Debug for PinKeys {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("PinKeys(…)")
    }
}

impl PinKeys {
    /// The keys replicas share: under `secret`, else the public key.
    pub fn shared(secret: Option<&PinsSecret>) -> Self {
        let key = secret.map_or(PUBLIC_KEY, |s| s.0.as_slice());
        PinKeys {
            key: hmac::Key::new(hmac::HMAC_SHA256, key),
        }
    }

    /// Keys of this process alone (a router without `--nats`): a random
    /// key, so not even the hashes mean anything outside it.
    pub fn random() -> Self {
        let rng = ring::rand::SystemRandom::new();
        match hmac::Key::generate(hmac::HMAC_SHA256, &rng) {
            Ok(key) => PinKeys { key },
            Err(_) => {
                warn!("no randomness for the pins' key; using the public one");
                PinKeys::shared(None)
            }
        }
    }

    /// The key of `owner`'s pin of `kind` for `id`.
    pub fn key(&self, kind: PinKind, owner: &[u8; 32], id: &str) -> String {
        let mut ctx = hmac::Context::with_key(&self.key);
        ctx.update(kind.key_prefix().as_bytes());
        ctx.update(owner);
        ctx.update(id.as_bytes());
        let tag = ctx.sign();
        let mut hex = String::with_capacity(64);
        for byte in tag.as_ref() {
            hex.push(char::from(HEX[usize::from(byte >> 4)]));
            hex.push(char::from(HEX[usize::from(byte & 0xf)]));
        }
        hex
    }
}

const HEX: &[u8; 16] = b"0123456789abcdef";

/// Whether `key` is one [`PinKeys::key`] makes: 64 lower-case hex digits.
pub fn is_pin_key(key: &str) -> bool {
    key.len() == 64 && key.bytes().all(|b| HEX.contains(&b))
}

/// One pin, as replicas share it.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Pin {
    /// What it pins.
    pub kind: PinKind,
    /// Its keyed hash ([`PinKeys::key`]): never the id itself.
    pub key: String,
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
    /// Times the bucket was found gone and made again (by this replica or
    /// a peer).
    pub recreated: AtomicU64,
}

/// This replica's side of the sharing.
#[derive(Debug)]
pub struct PinShare {
    bucket: String,
    max_age: Duration,
    sender: u64,
    keys: PinKeys,
    store: OnceLock<kv::Store>,
    pending: Mutex<Vec<Pin>>,
    wake: tokio::sync::Notify,
    /// A pin could not be put: the bucket may be gone.
    check: tokio::sync::Notify,
    /// What the sharing did.
    pub counters: PinCounters,
}

/// The bucket key of pin `key` of `kind`.
fn bucket_key(kind: PinKind, key: &str) -> String {
    format!("{}.{key}", kind.key_prefix())
}

/// A task aborted when this is dropped (with the task that holds it).
struct AbortOnDrop(tokio::task::JoinHandle<()>);

impl Drop for AbortOnDrop {
    fn drop(&mut self) {
        self.0.abort();
    }
}

impl PinShare {
    /// Sharing in the bucket of `prefix`, each pin kept at most `max_age`
    /// and stored under `keys`.
    pub fn new(prefix: &str, max_age: Duration, keys: PinKeys) -> Self {
        PinShare {
            bucket: format!("{prefix}-pins"),
            max_age,
            sender: sender_id(),
            keys,
            store: OnceLock::new(),
            pending: Mutex::new(Vec::new()),
            wake: tokio::sync::Notify::new(),
            check: tokio::sync::Notify::new(),
            counters: PinCounters::default(),
        }
    }

    /// The keys pins are stored under (the proxy keys its tables by them).
    pub fn keys(&self) -> &PinKeys {
        &self.keys
    }

    /// Queues one of this replica's pins for its peers.
    pub fn push(&self, pin: Pin) {
        if push_bounded(&self.pending, pin, MAX_PENDING, &self.counters.dropped) {
            self.wake.notify_one();
        }
    }

    /// The bucket's pin of `kind` under `key`, asked for at most 150 ms;
    /// `None` when it has none, or NATS is not there.
    pub async fn fetch(&self, kind: PinKind, key: &str) -> Option<Pin> {
        let store = self.store.get()?;
        let got = tokio::time::timeout(FETCH_WITHIN, store.get(bucket_key(kind, key))).await;
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
        (stored.pin.kind == kind && stored.pin.key == key).then_some(stored.pin)
    }

    /// Opens (or makes) the bucket, then puts this replica's pins, applies
    /// its peers' to `pins`, and checks the bucket again at every
    /// reconnection `connections` counts, until the task is aborted.
    pub fn run(
        self: &Arc<Self>,
        client: async_nats::Client,
        pins: Arc<dyn SharedPins>,
        connections: watch::Receiver<u64>,
    ) -> Vec<tokio::task::JoinHandle<()>> {
        let share = self.clone();
        vec![tokio::spawn(async move {
            share.keep(client, pins, connections).await;
        })]
    }

    /// The bucket's life: made, watched, put to, and made again when NATS
    /// lost it.
    async fn keep(
        self: Arc<Self>,
        client: async_nats::Client,
        pins: Arc<dyn SharedPins>,
        mut connections: watch::Receiver<u64>,
    ) {
        let js = jetstream::new(client);
        connections.borrow_and_update();
        let mut made = self.ensure(&js).await;
        let store = loop {
            match js.get_key_value(&self.bucket).await {
                Ok(store) => break store,
                Err(e) => {
                    debug!(bucket = %self.bucket, error = %e, "the pins bucket could not be opened; retrying");
                    tokio::time::sleep(RECHECK_EVERY).await;
                }
            }
        };
        let _ = self.store.set(store.clone());
        let watcher = |share: &Arc<Self>| {
            let (share, store, pins) = (share.clone(), store.clone(), pins.clone());
            AbortOnDrop(tokio::spawn(async move { share.watch(store, pins).await }))
        };
        let mut _watching = watcher(&self);
        let _publishing = {
            let (share, store) = (self.clone(), store.clone());
            AbortOnDrop(tokio::spawn(async move { share.publish(store).await }))
        };
        loop {
            tokio::select! {
                changed = connections.changed() => {
                    if changed.is_err() {
                        return;
                    }
                }
                () = self.check.notified() => {}
            }
            let now = self.ensure(&js).await;
            if now.created != made.created {
                self.counters.recreated.fetch_add(1, Ordering::Relaxed);
                warn!(
                    bucket = %self.bucket,
                    "the pins bucket was gone (NATS restarted without it) and is made again; watching it afresh"
                );
                // The old watch resumes past the old stream's last
                // sequence, which the new stream has not reached.
                _watching = watcher(&self);
            }
            made = now;
            tokio::time::sleep(RECHECK_EVERY).await;
        }
    }

    /// The bucket's stream, made as a key-value bucket's is (the client's
    /// own `create_key_value` first asks for account details that the
    /// nats-server 2.9 of Debian answers in a shape it cannot read). Oldest
    /// pins go first when it is full.
    fn stream_config(&self) -> stream::Config {
        stream::Config {
            name: format!("KV_{}", self.bucket),
            description: Some("kvroute: the rank each session and response is pinned to".into()),
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
        }
    }

    /// The bucket's stream, made when it is not there; retried every second
    /// until NATS answers (logged once).
    async fn ensure(&self, js: &jetstream::Context) -> stream::Info {
        let mut failed = false;
        loop {
            match js.get_or_create_stream(self.stream_config()).await {
                Ok(stream) => {
                    if failed {
                        info!(bucket = %self.bucket, "the pins bucket is open");
                    }
                    return stream.cached_info().clone();
                }
                Err(e) if !failed => {
                    failed = true;
                    warn!(bucket = %self.bucket, error = %e, "the pins bucket could not be opened or made; retrying every second, and pins are not shared meanwhile");
                }
                Err(e) => {
                    debug!(bucket = %self.bucket, error = %e, "the pins bucket is still not there")
                }
            }
            tokio::time::sleep(RECHECK_EVERY).await;
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
                let key = bucket_key(pin.kind, &pin.key);
                let value = encode_message(&Stored {
                    sender: self.sender,
                    pin,
                });
                let counter = match store.put(key, value.into()).await {
                    Ok(_) => &self.counters.sent,
                    Err(e) => {
                        debug!(error = %e, "a pin was not put in the bucket");
                        self.check.notify_one();
                        &self.counters.dropped
                    }
                };
                counter.fetch_add(1, Ordering::Relaxed);
            }
        }
    }

    async fn watch(&self, store: kv::Store, pins: Arc<dyn SharedPins>) {
        let mut failures = 0u64;
        loop {
            // Every key's last pin first, then each new one: a replica that
            // starts late, or watches again after a reconnection or a
            // remade bucket, has every pin its peers made meanwhile.
            let mut updates = match store.watch_with_history(">").await {
                Ok(w) => w,
                Err(e) => {
                    if failures == 0 {
                        warn!(error = %e, "watching the pins bucket failed; retrying every second");
                    }
                    failures += 1;
                    tokio::time::sleep(RECHECK_EVERY).await;
                    continue;
                }
            };
            failures = 0;
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

    /// Applies one bucket value (this replica's own are skipped, and a key
    /// that is not a hash is undecodable).
    fn apply(&self, value: &[u8], pins: &dyn SharedPins) {
        let stored: Stored = match decode_message::<Stored>(value) {
            Ok(s) if is_pin_key(&s.pin.key) => s,
            Ok(_) => {
                self.counters.skipped.fetch_add(1, Ordering::Relaxed);
                return;
            }
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

    const ALICE: [u8; 32] = [1; 32];
    const BOB: [u8; 32] = [2; 32];

    fn pin(worker: &str) -> Pin {
        Pin {
            kind: PinKind::Session,
            key: PinKeys::shared(None).key(PinKind::Session, &ALICE, "chat-1"),
            worker: worker.into(),
            rank: DpRank(1),
            tokens: 300,
        }
    }

    #[test]
    fn keys_hide_the_id_and_bind_the_kind_the_owner_and_the_secret() {
        let public = PinKeys::shared(None);
        let k = public.key(PinKind::Response, &ALICE, "resp_…/ with spaces");
        assert!(is_pin_key(&k), "{k}");
        assert!(bucket_key(PinKind::Response, &k).starts_with("r."));
        assert_eq!(
            k,
            PinKeys::shared(None).key(PinKind::Response, &ALICE, "resp_…/ with spaces"),
            "every replica computes the same key"
        );
        let id = "resp_1d0d853e";
        let of = |keys: &PinKeys, kind, owner| keys.key(kind, owner, id);
        let base = of(&public, PinKind::Response, &ALICE);
        assert!(!base.contains("1d0d853e"));
        assert_ne!(base, of(&public, PinKind::Session, &ALICE));
        assert_ne!(base, of(&public, PinKind::Response, &BOB));
        let secret = PinsSecret::new(b"0123456789abcdef0123").expect("a secret");
        let keyed = PinKeys::shared(Some(&secret));
        assert_ne!(base, of(&keyed, PinKind::Response, &ALICE));
        assert_ne!(
            of(&PinKeys::random(), PinKind::Response, &ALICE),
            of(&PinKeys::random(), PinKind::Response, &ALICE)
        );
        assert!(!is_pin_key("resp_1d0d853e"));
        assert!(!is_pin_key(&base.to_uppercase()));
    }

    #[test]
    fn a_secret_is_16_to_4096_bytes_and_never_printed() {
        assert!(matches!(
            PinsSecret::new(b"short\n"),
            Err(PinsSecretError::Length(5))
        ));
        let secret = PinsSecret::new(b"  0123456789abcdef\n").expect("trimmed to 16");
        assert_eq!(secret, PinsSecret::new(b"0123456789abcdef").expect("16"));
        assert!(!format!("{secret:?}").contains("0123"));
        let dir = std::env::temp_dir().join(format!("kvroute-pins-key-{}", std::process::id()));
        std::fs::create_dir_all(&dir).expect("a directory");
        let long = dir.join("long");
        std::fs::write(&long, vec![b'k'; 10_000]).expect("written");
        assert!(matches!(
            PinsSecret::read_file(&long),
            Err(PinsSecretError::Length(n)) if n == MAX_SECRET + 1
        ));
        let good = dir.join("good");
        std::fs::write(&good, "0123456789abcdef0123456789abcdef\n").expect("written");
        let from_file = PinsSecret::from_flags(None, Some(&good)).expect("read");
        let given = PinsSecret::from_flags(Some("0123456789abcdef0123456789abcdef"), None);
        assert_eq!(
            from_file,
            given.expect("given"),
            "the same secret either way"
        );
        assert!(matches!(
            PinsSecret::from_flags(Some("0123456789abcdef"), Some(&good)),
            Err(PinsSecretError::Both)
        ));
        assert!(matches!(PinsSecret::from_flags(None, None), Ok(None)));
        assert!(matches!(
            PinsSecret::read_file(&dir.join("missing")),
            Err(PinsSecretError::Read { .. })
        ));
        let _ = std::fs::remove_dir_all(&dir);
    }

    #[test]
    fn peers_pins_are_applied_and_own_and_damaged_ones_skipped() {
        let share = PinShare::new("kvroute", Duration::from_secs(60), PinKeys::shared(None));
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
        // An id in the clear where the hash belongs (an older replica's pin).
        let clear = encode_message(&Stored {
            sender: 7,
            pin: Pin {
                key: "chat-1".into(),
                ..pin("w0")
            },
        });
        share.apply(&clear, &tables);
        assert_eq!(
            tables
                .0
                .lock()
                .unwrap_or_else(PoisonError::into_inner)
                .len(),
            2
        );
        assert_eq!(share.counters.received.load(Ordering::Relaxed), 1);
        assert_eq!(share.counters.skipped.load(Ordering::Relaxed), 3);
    }

    #[test]
    fn a_full_queue_drops_and_counts() {
        let share = PinShare::new("kvroute", Duration::from_secs(60), PinKeys::shared(None));
        for _ in 0..MAX_PENDING + 3 {
            share.push(pin("w0"));
        }
        assert_eq!(share.counters.dropped.load(Ordering::Relaxed), 3);
    }
}
