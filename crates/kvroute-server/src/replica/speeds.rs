//! What replicas that learn speeds (`--learn-speeds`) teach each other:
//! every streamed response one replica relays is an observation of its
//! rank's speed, and its peers feed it to their own learners, so each
//! replica learns from the whole fleet's traffic rather than its share of
//! it, and all of them price a slow rank alike.
//!
//! Best effort, on a subject of its own (`{prefix}.speeds`): a lost message
//! costs a few observations, which the learner, forgetting as it goes,
//! does not miss; and a replica that does not share speeds never receives
//! a message it cannot read. A message is a version byte and MessagePack,
//! refused whole (and counted) when damaged or of another version.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, PoisonError};
use std::time::Duration;

use futures_util::StreamExt;
use kvroute_core::index::DpRank;
use serde::{Deserialize, Serialize};
use tracing::{debug, warn};

use super::message::{decode_message, encode_message, MessageError};
use super::outbox::{push_bounded, sender_id};

/// How often pending observations are published.
const PUBLISH_EVERY: Duration = Duration::from_millis(200);
/// Observations kept while NATS is slow or down; more are dropped (counted).
const MAX_PENDING: usize = 8_192;
/// Observations per message: about 60 bytes each, well under NATS's 1 MiB.
const PER_MESSAGE: usize = 2_048;

/// One response's lesson about its rank's speed, as
/// [`kvroute_core::scheduler::SpeedLearner::observe_response`] takes it.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct SpeedObservation {
    /// The worker's name (the same at every replica).
    pub worker: String,
    /// Its data-parallel rank.
    pub rank: DpRank,
    /// Blocks in flight on the rank at the response's first token.
    pub load_first: u64,
    /// Blocks in flight on the rank at its end.
    pub load_end: u64,
    /// Microseconds from the first token to the end.
    pub decoding_us: u64,
    /// Tokens the response generated.
    pub tokens: u64,
}

/// What a peer's observation does here: the proxy implements it, so this
/// module never reaches into the proxy.
pub trait SharedSpeeds: Send + Sync + 'static {
    /// Feeds one message's observations of a peer to this replica's
    /// learner; returns how many named a worker or rank this replica does
    /// not have.
    fn observe_peer(&self, observations: &[SpeedObservation]) -> u64;
}

/// One message: the sending process (random at its start, so a replica
/// skips its own) and its observations.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
struct SpeedNote {
    sender: u64,
    observations: Vec<SpeedObservation>,
}

impl SpeedNote {
    fn encode(&self) -> Vec<u8> {
        encode_message(self)
    }

    fn decode(bytes: &[u8]) -> Result<SpeedNote, MessageError> {
        decode_message(bytes)
    }
}

/// Counts of what the sharing did.
#[derive(Debug, Default)]
pub struct SpeedCounters {
    /// Observations published.
    pub sent: AtomicU64,
    /// Peers' observations fed to this replica's learner.
    pub received: AtomicU64,
    /// Peers' observations of workers or ranks this replica does not have.
    pub unknown: AtomicU64,
    /// Observations not published: NATS was down or too slow.
    pub dropped: AtomicU64,
    /// Messages skipped as undecodable.
    pub undecodable: AtomicU64,
}

/// This replica's side of the sharing: its pending observations, and the
/// tasks that publish them and apply its peers'.
#[derive(Debug)]
pub struct SpeedShare {
    subject: String,
    sender: u64,
    pending: Mutex<Vec<SpeedObservation>>,
    /// What the sharing did.
    pub counters: SpeedCounters,
}

impl SpeedShare {
    /// Sharing on the subjects of `prefix`.
    pub fn new(prefix: &str) -> Self {
        SpeedShare {
            subject: format!("{prefix}.speeds"),
            sender: sender_id(),
            pending: Mutex::new(Vec::new()),
            counters: SpeedCounters::default(),
        }
    }

    /// Queues one of this replica's observations for its peers.
    pub fn push(&self, observation: SpeedObservation) {
        push_bounded(
            &self.pending,
            observation,
            MAX_PENDING,
            &self.counters.dropped,
        );
    }

    fn take(&self) -> Vec<SpeedObservation> {
        std::mem::take(&mut *self.pending.lock().unwrap_or_else(PoisonError::into_inner))
    }

    /// Publishes this replica's observations and feeds its peers' to
    /// `speeds`, until the tasks are aborted.
    pub fn run(
        self: &Arc<Self>,
        client: async_nats::Client,
        speeds: Arc<dyn SharedSpeeds>,
    ) -> Vec<tokio::task::JoinHandle<()>> {
        let receiver = {
            let (share, client) = (self.clone(), client.clone());
            tokio::spawn(async move { share.receive(client, speeds).await })
        };
        let share = self.clone();
        let publisher = tokio::spawn(async move { share.publish(client).await });
        vec![receiver, publisher]
    }

    async fn publish(&self, client: async_nats::Client) {
        let mut tick = tokio::time::interval(PUBLISH_EVERY);
        tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        loop {
            tick.tick().await;
            let observations = self.take();
            if observations.is_empty() {
                continue;
            }
            if client.connection_state() != async_nats::connection::State::Connected {
                let lost = observations.len() as u64;
                self.counters.dropped.fetch_add(lost, Ordering::Relaxed);
                continue;
            }
            for chunk in observations.chunks(PER_MESSAGE) {
                let note = SpeedNote {
                    sender: self.sender,
                    observations: chunk.to_vec(),
                };
                let sent = client
                    .publish(self.subject.clone(), note.encode().into())
                    .await;
                let counter = match sent {
                    Ok(()) => &self.counters.sent,
                    Err(e) => {
                        debug!(error = %e, "speed observations were not published");
                        &self.counters.dropped
                    }
                };
                counter.fetch_add(chunk.len() as u64, Ordering::Relaxed);
            }
        }
    }

    async fn receive(&self, client: async_nats::Client, speeds: Arc<dyn SharedSpeeds>) {
        let mut messages = loop {
            match client.subscribe(self.subject.clone()).await {
                Ok(s) => break s,
                Err(e) => {
                    warn!(error = %e, "subscribing to the replicas' speed observations failed; retrying");
                    tokio::time::sleep(Duration::from_secs(1)).await;
                }
            }
        };
        while let Some(message) = messages.next().await {
            self.apply(&message.payload, speeds.as_ref());
        }
    }

    /// Applies one message of the subject (this replica's own are skipped).
    fn apply(&self, payload: &[u8], speeds: &dyn SharedSpeeds) {
        let note = match SpeedNote::decode(payload) {
            Ok(note) => note,
            Err(e) => {
                if self.counters.undecodable.fetch_add(1, Ordering::Relaxed) == 0 {
                    warn!(error = %e, "an undecodable speed message was skipped (further ones are only counted)");
                }
                return;
            }
        };
        if note.sender == self.sender {
            return;
        }
        let unknown = speeds.observe_peer(&note.observations);
        let received = note.observations.len() as u64 - unknown.min(note.observations.len() as u64);
        self.counters
            .received
            .fetch_add(received, Ordering::Relaxed);
        self.counters.unknown.fetch_add(unknown, Ordering::Relaxed);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Records what it is fed; knows only worker `w0`.
    #[derive(Default)]
    struct Learner(Mutex<Vec<SpeedObservation>>);

    impl SharedSpeeds for Learner {
        fn observe_peer(&self, observations: &[SpeedObservation]) -> u64 {
            let mut fed = self.0.lock().unwrap_or_else(PoisonError::into_inner);
            let known: Vec<_> = observations.iter().filter(|o| o.worker == "w0").collect();
            fed.extend(known.iter().map(|&o| o.clone()));
            (observations.len() - known.len()) as u64
        }
    }

    fn observation(worker: &str) -> SpeedObservation {
        SpeedObservation {
            worker: worker.into(),
            rank: DpRank(1),
            load_first: 130,
            load_end: 260,
            decoding_us: 75_000,
            tokens: 16,
        }
    }

    #[test]
    fn a_peers_observations_are_learned_and_a_replicas_own_or_damaged_ones_are_not() {
        let (here, peer) = (SpeedShare::new("kvroute"), SpeedShare::new("kvroute"));
        let learner = Learner::default();
        let note = |share: &SpeedShare, workers: &[&str]| SpeedNote {
            sender: share.sender,
            observations: workers.iter().map(|w| observation(w)).collect(),
        };
        here.apply(&note(&peer, &["w0", "gone", "w0"]).encode(), &learner);
        here.apply(&note(&here, &["w0"]).encode(), &learner);
        let mut damaged = note(&peer, &["w0"]).encode();
        damaged.truncate(damaged.len() / 2);
        here.apply(&damaged, &learner);
        here.apply(&[0xff], &learner);
        let fed = learner.0.lock().unwrap_or_else(PoisonError::into_inner);
        assert_eq!(*fed, vec![observation("w0"), observation("w0")]);
        let c = &here.counters;
        let count = |a: &AtomicU64| a.load(Ordering::Relaxed);
        assert_eq!(
            (count(&c.received), count(&c.unknown), count(&c.undecodable)),
            (2, 1, 2)
        );
    }

    #[test]
    fn every_cut_or_flipped_note_decodes_or_is_refused_without_a_panic() {
        let note = SpeedNote {
            sender: 7,
            observations: vec![observation("w0"), observation("slow")],
        };
        let bytes = note.encode();
        assert_eq!(SpeedNote::decode(&bytes).ok(), Some(note));
        for cut in 0..bytes.len() {
            assert!(SpeedNote::decode(&bytes[..cut]).is_err(), "cut at {cut}");
        }
        for at in 0..bytes.len() {
            for bit in 0..8 {
                let mut flipped = bytes.clone();
                flipped[at] ^= 1 << bit;
                let _ = SpeedNote::decode(&flipped);
            }
        }
    }

    #[test]
    fn pending_observations_are_bounded() {
        let share = SpeedShare::new("kvroute");
        for _ in 0..MAX_PENDING + 3 {
            share.push(observation("w0"));
        }
        assert_eq!(share.take().len(), MAX_PENDING);
        assert_eq!(share.counters.dropped.load(Ordering::Relaxed), 3);
        assert!(share.take().is_empty());
    }
}
