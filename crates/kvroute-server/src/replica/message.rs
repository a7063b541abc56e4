//! What replicas say to each other on NATS, as bytes.
//!
//! Every message is one [`Envelope`]: who sent it (replica id and the
//! epoch of its process, so a restarted replica is told apart from its old
//! self), its place in that replica's sequence (so a peer sees a lost
//! message), when it was sent, and a [`Body`]. Encoded as MessagePack with
//! a leading version byte; a message of another version or a damaged one
//! is refused whole, and the receiver counts it.

use kvroute_core::index::DpRank;
use serde::{Deserialize, Serialize};

const VERSION: u8 = 1;

/// Bytes above which [`Batcher`] starts a new envelope: NATS refuses
/// messages over its `max_payload` (1 MiB by default).
pub const MAX_MESSAGE_BYTES: usize = 256 << 10;

/// One message from one replica.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Envelope {
    /// The sender's replica id.
    pub replica: String,
    /// The sender's process: random at its start.
    pub epoch: u64,
    /// The sender's message number in this epoch, from 0, one per message.
    pub seq: u64,
    /// What it says.
    pub body: Body,
}

/// What a message says.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub enum Body {
    /// Changes to the sender's requests in flight (none: a heartbeat).
    Events(Vec<Event>),
    /// Forget every request of the sender: its whole state follows as
    /// `Events` (sent after a reconnection, an overflow, or when asked).
    Reset,
    /// Asks `replica` (or every replica, for `*`) for a `Reset` and its state.
    ResyncRequest {
        /// Whose state is wanted.
        replica: String,
    },
}

/// A change to one request in flight at the sender.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub enum Event {
    /// The sender routed a request.
    Admit(Admission),
    /// The request's prefill is over (its first token came back).
    Prefilled(RequestRef),
    /// The request ended, failed or was abandoned.
    Release(RequestRef),
}

/// A routed request, as peers need it to price the same ranks.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Admission {
    /// Which request, and where it went.
    pub at: RequestRef,
    /// Prompt tokens it still had to prefill (0 when already prefilled:
    /// sent as part of a state after a reset).
    pub prefill_tokens: u64,
    /// Whether its prefill is still running.
    pub prefilling: bool,
    /// Its blocks' sequence hashes, in prompt order.
    pub blocks: Vec<u64>,
    /// How much longer, in milliseconds, peers may keep it if no release
    /// comes.
    pub ttl_ms: u64,
    /// When the sender admitted it, in microseconds since the Unix epoch:
    /// how the peer measures its delay.
    pub admitted_us: u64,
}

/// A request of the sender and the rank it went to.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct RequestRef {
    /// The sender's id for it.
    pub id: u64,
    /// The worker's name (the same at every replica).
    pub worker: String,
    /// Its data-parallel rank.
    pub rank: DpRank,
}

/// Why a message could not be read.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum MessageError {
    /// Empty, or of another version.
    #[error("not a kvroute replica message of version {VERSION}")]
    Version,
    /// The MessagePack is damaged or not an envelope.
    #[error("undecodable replica message: {0}")]
    Decode(#[from] rmp_serde::decode::Error),
}

/// `message` as bytes: the version byte, then MessagePack.
pub(super) fn encode_message<T: Serialize>(message: &T) -> Vec<u8> {
    let mut out = vec![VERSION];
    // Writing into a Vec cannot fail, and every field serializes.
    let _ = rmp_serde::encode::write(&mut out, message);
    out
}

/// Reads [`encode_message`] output.
pub(super) fn decode_message<T: serde::de::DeserializeOwned>(
    bytes: &[u8],
) -> Result<T, MessageError> {
    match bytes.split_first() {
        Some((&VERSION, rest)) => Ok(rmp_serde::from_slice(rest)?),
        _ => Err(MessageError::Version),
    }
}

impl Envelope {
    /// The message as bytes.
    pub fn encode(&self) -> Vec<u8> {
        encode_message(self)
    }

    /// Reads [`Envelope::encode`] output.
    pub fn decode(bytes: &[u8]) -> Result<Envelope, MessageError> {
        decode_message(bytes)
    }
}

impl Event {
    /// Roughly how many bytes it takes encoded.
    fn size_hint(&self) -> usize {
        match self {
            Event::Admit(a) => 48 + a.at.worker.len() + 9 * a.blocks.len(),
            Event::Prefilled(r) | Event::Release(r) => 24 + r.worker.len(),
        }
    }
}

/// Numbers one replica's messages and cuts its events into envelopes of at
/// most [`MAX_MESSAGE_BYTES`].
#[derive(Debug, Clone)]
pub struct Batcher {
    replica: String,
    epoch: u64,
    next_seq: u64,
}

impl Batcher {
    /// The numbering of `replica`'s messages in process `epoch`.
    pub fn new(replica: impl Into<String>, epoch: u64) -> Self {
        Batcher {
            replica: replica.into(),
            epoch,
            next_seq: 0,
        }
    }

    /// The next envelope, carrying `body`.
    pub fn envelope(&mut self, body: Body) -> Envelope {
        let seq = self.next_seq;
        self.next_seq += 1;
        Envelope {
            replica: self.replica.clone(),
            epoch: self.epoch,
            seq,
            body,
        }
    }

    /// `events` in as few envelopes as fit the size limit (one, empty, for
    /// no events: a heartbeat).
    pub fn events(&mut self, events: Vec<Event>) -> Vec<Envelope> {
        let mut out = Vec::new();
        let mut current = Vec::new();
        let mut bytes = 0;
        for event in events {
            let size = event.size_hint();
            if !current.is_empty() && bytes + size > MAX_MESSAGE_BYTES {
                out.push(self.envelope(Body::Events(std::mem::take(&mut current))));
                bytes = 0;
            }
            bytes += size;
            current.push(event);
        }
        if !current.is_empty() || out.is_empty() {
            out.push(self.envelope(Body::Events(current)));
        }
        out
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn admit(id: u64, blocks: usize) -> Event {
        Event::Admit(Admission {
            at: RequestRef {
                id,
                worker: "w0".into(),
                rank: DpRank(1),
            },
            prefill_tokens: 512,
            prefilling: true,
            blocks: (0..blocks as u64)
                .map(|b| b.wrapping_mul(0x9e37_79b9_7f4a_7c15))
                .collect(),
            ttl_ms: 600_000,
            admitted_us: 1_700_000_000_000_000,
        })
    }

    #[test]
    fn an_envelope_round_trips_and_a_damaged_one_is_refused() {
        let mut batcher = Batcher::new("r1", 7);
        let reference = RequestRef {
            id: 3,
            worker: "w0".into(),
            rank: DpRank(0),
        };
        let events = vec![
            admit(3, 20),
            Event::Prefilled(reference.clone()),
            Event::Release(reference),
        ];
        let sent = batcher.events(events.clone());
        assert_eq!(sent.len(), 1);
        let bytes = sent[0].encode();
        let back = Envelope::decode(&bytes).expect("decodes");
        assert_eq!(back, sent[0]);
        assert_eq!((back.replica.as_str(), back.epoch, back.seq), ("r1", 7, 0));
        assert_eq!(back.body, Body::Events(events));
        for cut in [0, 1, bytes.len() / 2, bytes.len() - 1] {
            assert!(Envelope::decode(&bytes[..cut]).is_err(), "cut at {cut}");
        }
        let mut other = bytes.clone();
        other[0] = 2;
        assert!(matches!(
            Envelope::decode(&other),
            Err(MessageError::Version)
        ));
        let control = batcher.envelope(Body::ResyncRequest {
            replica: "*".into(),
        });
        assert_eq!(control.seq, 1);
        assert_eq!(
            Envelope::decode(&control.encode()).expect("control"),
            control
        );
    }

    #[test]
    fn big_batches_are_cut_under_the_limit_and_numbered_in_order() {
        let mut batcher = Batcher::new("r1", 1);
        assert_eq!(batcher.events(Vec::new()).len(), 1, "a heartbeat");
        let events: Vec<Event> = (0..200).map(|i| admit(i, 400)).collect();
        let sent = batcher.events(events);
        assert!(sent.len() > 1);
        let seqs: Vec<u64> = sent.iter().map(|e| e.seq).collect();
        assert_eq!(seqs, (1..=sent.len() as u64).collect::<Vec<_>>());
        let mut ids = Vec::new();
        for envelope in &sent {
            let bytes = envelope.encode();
            assert!(bytes.len() <= MAX_MESSAGE_BYTES, "{} bytes", bytes.len());
            if let Body::Events(events) = &envelope.body {
                for e in events {
                    if let Event::Admit(a) = e {
                        ids.push(a.at.id);
                    }
                }
            }
        }
        assert_eq!(ids, (0..200).collect::<Vec<_>>());
    }
}
