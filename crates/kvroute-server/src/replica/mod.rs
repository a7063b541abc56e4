//! Router replicas that route as one, over NATS (`--nats`).
//!
//! Every replica ingests every engine itself; what the replicas share is
//! what the engines cannot tell them: the requests each one has in flight
//! (so two replicas never herd a burst onto one worker, and each sees the
//! prefix the other just sent) and a durable index snapshot in a JetStream
//! object store (so a replica that starts comes back complete even when the
//! engines' replay rings have wrapped). Replicas that learn speeds also
//! share what each response taught them. NATS is never needed for a correct
//! answer: without it a replica routes from its own state.

use std::time::Duration;

/// `--nats`, `--replica-id` and what goes with them.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ReplicaConfig {
    /// The NATS server, e.g. `nats://127.0.0.1:4222`.
    pub nats_url: String,
    /// This replica's name among its peers (default: host name and port).
    pub replica_id: String,
    /// First token of every subject and bucket name, so that several router
    /// fleets can share one NATS server.
    pub prefix: String,
    /// How often the index snapshot is written to the object store.
    pub snapshot_every: Duration,
    /// The secret the pins' hashes are keyed with (`--nats-pins-key`;
    /// `None`: a public key, see [`pins`]).
    pub pins_secret: Option<pins::PinsSecret>,
}

impl ReplicaConfig {
    /// A configuration with the default prefix and snapshot interval.
    pub fn new(nats_url: impl Into<String>, replica_id: impl Into<String>) -> Self {
        ReplicaConfig {
            nats_url: nats_url.into(),
            replica_id: replica_id.into(),
            prefix: "kvroute".into(),
            snapshot_every: crate::StateConfig::DEFAULT_EVERY,
            pins_secret: None,
        }
    }
}

pub mod bus;
pub mod delays;
pub mod message;
pub mod outbox;
pub mod peers;
pub mod pins;
pub mod snapshots;
pub mod speeds;

use std::sync::Arc;

use futures_util::StreamExt;
use tracing::{debug, info, warn};

use crate::ingest::registry::Registry;
use crate::state::Snapshot;
use bus::{ReplicaSync, SharedLoad};
use snapshots::SnapshotStore;
use speeds::{SharedSpeeds, SpeedShare};

/// Longest a starting replica spends getting its peers' snapshot (asking
/// for a fresh one included); past it, it starts without.
const START_WITHIN: Duration = Duration::from_secs(8);

/// A replica's connection to its peers: the sync of requests in flight and
/// the snapshot store, over one NATS client.
#[derive(Debug, Clone)]
pub struct Replica {
    /// The in-flight sync (its outbox is what requests publish to).
    pub sync: Arc<ReplicaSync>,
    /// The speed observations shared with the peers (`--learn-speeds`).
    pub speeds: Arc<SpeedShare>,
    client: async_nats::Client,
}

impl Replica {
    /// Starts connecting to `config`'s NATS server (in the background,
    /// retrying for ever: the router starts whether NATS is up or not).
    pub async fn connect(config: ReplicaConfig) -> Result<Self, async_nats::ConnectError> {
        let speeds = Arc::new(SpeedShare::new(&config.prefix));
        let sync = ReplicaSync::new(config);
        let client = sync.connect().await?;
        Ok(Replica {
            sync,
            speeds,
            client,
        })
    }

    /// The configuration.
    pub fn config(&self) -> &ReplicaConfig {
        self.sync.config()
    }

    /// The NATS client the replica's sharing goes through.
    pub fn client(&self) -> &async_nats::Client {
        &self.client
    }

    /// Waits at most `within` for the connection; whether it is up.
    pub async fn wait_connected(&self, within: Duration) -> bool {
        let deadline = tokio::time::Instant::now() + within;
        loop {
            if self.client.connection_state() == async_nats::connection::State::Connected {
                return true;
            }
            if tokio::time::Instant::now() >= deadline {
                return false;
            }
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
    }

    /// The snapshot a starting replica resumes from, if NATS is up and has
    /// one; any failure is logged and the replica starts without it.
    pub async fn snapshot_at_start(&self) -> Option<Snapshot> {
        if !self.wait_connected(Duration::from_secs(2)).await {
            warn!(url = %self.config().nats_url, "NATS unreachable at start: no snapshot to resume from");
            return None;
        }
        let fetch = snapshots::fetch_at_start(&self.client, self.config());
        let Ok(fetched) = tokio::time::timeout(START_WITHIN, fetch).await else {
            warn!(
                secs = START_WITHIN.as_secs(),
                "the object store did not give a snapshot in time; starting without it"
            );
            return None;
        };
        let fetched = match fetched {
            Ok(Some(f)) => f,
            Ok(None) => {
                info!("no index snapshot in the object store yet; starting cold");
                return None;
            }
            Err(e) => {
                warn!(error = %e, "the object store could not be read; starting cold");
                return None;
            }
        };
        match Snapshot::decode(&fetched.bytes) {
            Ok(snapshot) => Some(snapshot),
            Err(e) => {
                warn!(object = %fetched.object, error = %e, "an unreadable snapshot in the object store was skipped");
                None
            }
        }
    }

    /// Runs the sync over `load`, the periodic snapshots of `registry`, the
    /// answers to peers asking for a fresh one, and, given a learner of
    /// speeds, the sharing of speed observations.
    pub fn run(
        &self,
        load: Arc<dyn SharedLoad>,
        registry: Arc<Registry>,
        speeds: Option<Arc<dyn SharedSpeeds>>,
    ) -> Vec<tokio::task::JoinHandle<()>> {
        let mut tasks = self.sync.run(self.client.clone(), load);
        if let Some(speeds) = speeds {
            tasks.extend(self.speeds.run(self.client.clone(), speeds));
        }
        let (client, sync) = (self.client.clone(), self.sync.clone());
        tasks.push(tokio::spawn(snapshot_loop(client, sync, registry)));
        tasks
    }

    /// Stops the publisher (the tasks of [`Replica::run`] are aborted by their caller).
    pub fn stop(&self) {
        self.sync.stop();
    }

    /// Writes one snapshot now (at shutdown), if NATS is up.
    pub async fn save_now(&self, registry: &Arc<Registry>) {
        if self.client.connection_state() != async_nats::connection::State::Connected {
            return;
        }
        if let Ok(store) = SnapshotStore::open(&self.client, self.config()).await {
            write_snapshot(&store, registry, &self.sync).await;
        }
    }
}

/// Writes the snapshot every `snapshot_every` and whenever a starting peer
/// asks (answering once it is written).
async fn snapshot_loop(
    client: async_nats::Client,
    sync: Arc<ReplicaSync>,
    registry: Arc<Registry>,
) {
    let config = sync.config().clone();
    let mut store = loop {
        match SnapshotStore::open(&client, &config).await {
            Ok(store) => break store,
            Err(e) => {
                debug!(error = %e, "the snapshot bucket is not available yet");
                tokio::time::sleep(Duration::from_secs(1)).await;
            }
        }
    };
    let mut asks = loop {
        match client.subscribe(snapshots::request_subject(&config)).await {
            Ok(s) => break s,
            Err(e) => {
                debug!(error = %e, "subscribing to snapshot requests failed; retrying");
                tokio::time::sleep(Duration::from_secs(1)).await;
            }
        }
    };
    let mut tick = tokio::time::interval(config.snapshot_every);
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    loop {
        let reply = tokio::select! {
            _ = tick.tick() => None,
            ask = asks.next() => match ask {
                Some(message) => message.reply,
                None => return,
            },
        };
        let written = write_snapshot(&store, &registry, &sync).await;
        if !written {
            store = reopen(&client, &config, &sync).await.unwrap_or(store);
        }
        if let (Some(reply), true) = (reply, written) {
            let _ = client
                .publish(reply, store.object().to_owned().into())
                .await;
        }
    }
}

/// The snapshot bucket opened again after a write failed, and made again
/// when NATS lost it (counted and logged); `None` when NATS is not there.
async fn reopen(
    client: &async_nats::Client,
    config: &ReplicaConfig,
    sync: &ReplicaSync,
) -> Option<SnapshotStore> {
    let (store, made) = SnapshotStore::open_or_make(client, config).await.ok()?;
    if made {
        use std::sync::atomic::Ordering::Relaxed;
        sync.counters.buckets_recreated.fetch_add(1, Relaxed);
        warn!(prefix = %config.prefix, "the index snapshots' object store was gone (NATS lost its store) and is made again");
    }
    Some(store)
}

/// Writes one snapshot; whether it was written.
async fn write_snapshot(
    store: &SnapshotStore,
    registry: &Arc<Registry>,
    sync: &ReplicaSync,
) -> bool {
    use std::sync::atomic::Ordering::Relaxed;
    let started = std::time::Instant::now();
    let registry = registry.clone();
    let taken = tokio::task::spawn_blocking(move || {
        let snapshot = registry.snapshot();
        let knows = snapshot.knows_anything();
        (knows.then(|| snapshot.encode()), snapshot.complete())
    });
    let Ok((bytes, complete)) = taken.await else {
        return false;
    };
    // Nothing applied yet (a replica just started): nothing worth a peer's load.
    let Some(bytes) = bytes else {
        return true;
    };
    match store.put(&bytes, complete).await {
        Ok(()) => {
            sync.counters.snapshots_written.fetch_add(1, Relaxed);
            debug!(
                bytes = bytes.len(),
                ms = started.elapsed().as_millis() as u64,
                "snapshot written to the object store"
            );
            true
        }
        Err(e) => {
            if sync.counters.snapshot_failures.fetch_add(1, Relaxed) == 0 {
                warn!(error = %e, "writing the snapshot to the object store failed (further failures are only counted)");
            } else {
                debug!(error = %e, "writing the snapshot to the object store failed");
            }
            false
        }
    }
}
