//! The index's durable copy in a JetStream object store, so a replica that
//! starts comes back complete even when the engines' rings have wrapped.
//!
//! Every replica writes its snapshot (the `--state-dir` format: workers,
//! each rank's resume point, the index) as the object named after it, every
//! `--snapshot-secs` and on demand. A replica that starts first asks its
//! live peers for a fresh one (a request on `<prefix>.snapshot`, answered
//! once the object is written), then loads the newest *complete* object
//! in the bucket (every rank's history known up to its resume point; an
//! incomplete one only when there is no other) and resumes each rank from that snapshot's sequence number: what the
//! engines published since is replayed from their rings, which need only
//! reach back to the moment of that snapshot.

use std::time::{Duration, Instant};

use async_nats::jetstream::context::GetStreamErrorKind;
use async_nats::jetstream::object_store::{self, ObjectMetadata, ObjectStore};
use futures_util::StreamExt;
use tokio::io::AsyncReadExt;
use tracing::{debug, info, warn};

use super::ReplicaConfig;

/// The object metadata key saying whether a snapshot is complete.
const COMPLETE: &str = "complete";

/// Bytes per object-store chunk (a NATS message each).
const CHUNK_BYTES: usize = 256 << 10;
/// Objects older than this leave the bucket (replicas long gone).
const MAX_AGE: Duration = Duration::from_secs(24 * 3600);

/// Why the object store could not be used.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum SnapshotStoreError {
    /// The bucket could not be opened or created.
    #[error("object store bucket `{bucket}`: {message}")]
    Bucket {
        /// The bucket.
        bucket: String,
        /// Why.
        message: String,
    },
    /// Writing, listing or reading an object failed.
    #[error("object `{object}`: {message}")]
    Object {
        /// The object.
        object: String,
        /// Why.
        message: String,
    },
}

fn object_error(object: &str, e: impl std::fmt::Display) -> SnapshotStoreError {
    SnapshotStoreError::Object {
        object: object.to_owned(),
        message: e.to_string(),
    }
}

/// The bucket of index snapshots and this replica's object in it.
#[derive(Clone)]
pub struct SnapshotStore {
    store: ObjectStore,
    object: String,
    bucket: String,
}

impl std::fmt::Debug for SnapshotStore {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("SnapshotStore")
            .field("bucket", &self.bucket)
            .field("object", &self.object)
            .finish()
    }
}

/// A snapshot read back, with where it came from.
#[derive(Debug)]
pub struct Fetched {
    /// The object (the replica that wrote it).
    pub object: String,
    /// Its bytes.
    pub bytes: Vec<u8>,
}

impl SnapshotStore {
    /// Opens (or creates) `config`'s bucket.
    pub async fn open(
        client: &async_nats::Client,
        config: &ReplicaConfig,
    ) -> Result<Self, SnapshotStoreError> {
        Ok(Self::open_or_make(client, config).await?.0)
    }

    /// Opens `config`'s bucket, or makes it when it is not there (then
    /// `true`: a NATS server that lost its store has none).
    pub async fn open_or_make(
        client: &async_nats::Client,
        config: &ReplicaConfig,
    ) -> Result<(Self, bool), SnapshotStoreError> {
        let bucket = format!("{}_index", config.prefix);
        let js = async_nats::jetstream::new(client.clone());
        let (store, made) = match js.get_object_store(&bucket).await {
            Ok(store) => (store, false),
            Err(_) => {
                // Made only when NATS says it has no such bucket: a lost
                // request is not a missing bucket.
                let missing = match js.get_stream(format!("OBJ_{bucket}")).await {
                    Err(e) => {
                        matches!(e.kind(), GetStreamErrorKind::JetStream(j) if j.code() == 404)
                    }
                    Ok(_) => false,
                };
                let made = js
                    .create_object_store(object_store::Config {
                        bucket: bucket.clone(),
                        description: Some("kvroute index snapshots, one object per replica".into()),
                        max_age: MAX_AGE,
                        ..object_store::Config::default()
                    })
                    .await
                    .map_err(|e| SnapshotStoreError::Bucket {
                        bucket: bucket.clone(),
                        message: e.to_string(),
                    })?;
                (made, missing)
            }
        };
        let store = SnapshotStore {
            store,
            object: config.replica_id.clone(),
            bucket,
        };
        Ok((store, made))
    }

    /// The name of this replica's object.
    pub fn object(&self) -> &str {
        &self.object
    }

    /// Writes `bytes` as this replica's snapshot, replacing the last one;
    /// `complete` says whether every rank's history in it was complete.
    pub async fn put(&self, bytes: &[u8], complete: bool) -> Result<(), SnapshotStoreError> {
        let meta = ObjectMetadata {
            name: self.object.clone(),
            chunk_size: Some(CHUNK_BYTES),
            metadata: [(COMPLETE.to_owned(), complete.to_string())].into(),
            ..ObjectMetadata::default()
        };
        let mut reader = bytes;
        self.store
            .put(meta, &mut reader)
            .await
            .map_err(|e| object_error(&self.object, e))?;
        Ok(())
    }

    /// The snapshot to resume from: the newest complete one in the bucket,
    /// whoever wrote it, else the newest (a replica that started cold after
    /// a ring wrapped writes an incomplete one, which must not hide a peer's
    /// complete one).
    pub async fn best(&self) -> Result<Option<Fetched>, SnapshotStoreError> {
        let mut list = self.store.list().await.map_err(|e| object_error("*", e))?;
        let mut best: Option<object_store::ObjectInfo> = None;
        let rank = |i: &object_store::ObjectInfo| {
            let complete = i.metadata.get(COMPLETE).is_some_and(|c| c == "true");
            (complete, i.modified)
        };
        while let Some(info) = list.next().await {
            let info = info.map_err(|e| object_error("*", e))?;
            let better = best.as_ref().is_none_or(|b| rank(&info) > rank(b));
            if !info.deleted && better {
                best = Some(info);
            }
        }
        let Some(info) = best else {
            return Ok(None);
        };
        let mut object = self
            .store
            .get(&info.name)
            .await
            .map_err(|e| object_error(&info.name, e))?;
        let mut bytes = Vec::new();
        object
            .read_to_end(&mut bytes)
            .await
            .map_err(|e| object_error(&info.name, e))?;
        Ok(Some(Fetched {
            object: info.name,
            bytes,
        }))
    }
}

/// The subject on which a starting replica asks for a fresh snapshot.
pub fn request_subject(config: &ReplicaConfig) -> String {
    format!("{}.snapshot", config.prefix)
}

/// Asks the live peers for a fresh snapshot and waits (at most `within`)
/// for the first to say it is written; false when none answered.
pub async fn ask_for_fresh(
    client: &async_nats::Client,
    config: &ReplicaConfig,
    within: Duration,
) -> bool {
    let asked = client.request(request_subject(config), config.replica_id.clone().into());
    match tokio::time::timeout(within, asked).await {
        Ok(Ok(reply)) => {
            debug!(by = %String::from_utf8_lossy(&reply.payload), "a peer wrote a fresh snapshot");
            true
        }
        Ok(Err(e)) => {
            debug!(error = %e, "no peer wrote a fresh snapshot");
            false
        }
        Err(_) => {
            warn!("no peer wrote a fresh snapshot in time; loading the newest there is");
            false
        }
    }
}

/// Loads what a starting replica should resume from: fresh snapshots from
/// the live peers when there are any, then the best in the bucket.
pub async fn fetch_at_start(
    client: &async_nats::Client,
    config: &ReplicaConfig,
) -> Result<Option<Fetched>, SnapshotStoreError> {
    let started = Instant::now();
    let store = SnapshotStore::open(client, config).await?;
    ask_for_fresh(client, config, Duration::from_secs(2)).await;
    let fetched = store.best().await?;
    if let Some(f) = &fetched {
        info!(
            object = %f.object,
            bytes = f.bytes.len(),
            ms = started.elapsed().as_millis() as u64,
            "index snapshot fetched from the object store"
        );
    }
    Ok(fetched)
}
