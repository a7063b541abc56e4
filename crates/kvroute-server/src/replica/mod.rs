//! Router replicas that route as one, over NATS (`--nats`).
//!
//! Every replica ingests every engine itself; what the replicas share is
//! what the engines cannot tell them: the requests each one has in flight
//! (so two replicas never herd a burst onto one worker, and each sees the
//! prefix the other just sent) and a durable index snapshot in a JetStream
//! object store (so a replica that starts comes back complete even when the
//! engines' replay rings have wrapped). NATS is never needed for a correct
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
}

impl ReplicaConfig {
    /// A configuration with the default prefix and snapshot interval.
    pub fn new(nats_url: impl Into<String>, replica_id: impl Into<String>) -> Self {
        ReplicaConfig {
            nats_url: nats_url.into(),
            replica_id: replica_id.into(),
            prefix: "kvroute".into(),
            snapshot_every: Duration::from_secs(10),
        }
    }
}
