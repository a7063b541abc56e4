//! Which peers this replica hears, and whether it heard all they said.
//!
//! Each peer process (replica id and epoch) gets a *slot*: its requests sit
//! in the shared load table under ids tagged with that slot, so a peer that
//! restarts or falls silent is forgotten at once and whole. A peer's
//! messages are numbered; a jump in the numbers is a loss, which the peer
//! is then asked to repair by sending its whole state again. Pure: the
//! caller passes the clock and carries out what it is told.

use std::collections::HashMap;

/// Bits of a request id left to the owner's own id; the slot takes the rest.
const ID_BITS: u32 = 40;
/// The slots there are (slot 0 is this replica's own requests).
const SLOTS: u32 = 1 << (64 - ID_BITS);

/// The id under which request `id` of the replica in `slot` is kept.
pub fn tagged_id(slot: u32, id: u64) -> u64 {
    (u64::from(slot % SLOTS) << ID_BITS) | (id & ((1 << ID_BITS) - 1))
}

/// The slot a tagged id belongs to.
pub fn slot_of(tagged: u64) -> u32 {
    (tagged >> ID_BITS) as u32
}

/// What to do with a message just received.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Verdict {
    /// This replica's own message, back from the server: nothing.
    Own,
    /// Another process uses this replica's id: its messages cannot be told
    /// from a restart of this one, so they are skipped (and the operator told).
    SameId,
    /// Apply it under `slot`.
    Apply {
        /// The sender's slot.
        slot: u32,
        /// Messages of the sender that never arrived before this one
        /// (0: none lost). When not 0, the caller asks for a resync.
        lost: u64,
        /// The slot of the sender's previous process, whose requests are
        /// to be dropped (it restarted).
        replaced: Option<u32>,
        /// The sender was not heard from before (or restarted): its state
        /// so far is unknown, ask for it.
        first: bool,
    },
}

/// One peer process, as this replica knows it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Peer {
    /// Its replica id.
    pub replica: String,
    /// Its process.
    pub epoch: u64,
    /// Its slot here.
    pub slot: u32,
    /// The number its next message should carry.
    pub next_seq: u64,
    /// When it was last heard (the caller's clock, ms).
    pub last_heard_ms: u64,
    /// Its messages received.
    pub messages: u64,
    /// Its messages that never arrived.
    pub lost: u64,
}

/// Every peer heard and not yet given up on.
#[derive(Debug, Clone)]
pub struct Peers {
    me: String,
    my_epoch: u64,
    peers: HashMap<String, Peer>,
    next_slot: u32,
}

impl Peers {
    /// No peers yet; messages from (`me`, `my_epoch`) are this replica's own.
    pub fn new(me: impl Into<String>, my_epoch: u64) -> Self {
        Peers {
            me: me.into(),
            my_epoch,
            peers: HashMap::new(),
            next_slot: 1,
        }
    }

    fn new_slot(&mut self) -> u32 {
        let slot = self.next_slot;
        self.next_slot = if slot + 1 >= SLOTS { 1 } else { slot + 1 };
        slot
    }

    /// Takes note of message `seq` from (`replica`, `epoch`) at `now_ms`.
    pub fn receive(&mut self, replica: &str, epoch: u64, seq: u64, now_ms: u64) -> Verdict {
        if replica == self.me {
            return if epoch == self.my_epoch {
                Verdict::Own
            } else {
                Verdict::SameId
            };
        }
        let known = self.peers.get(replica).map(|p| (p.epoch, p.slot));
        let (replaced, first) = match known {
            Some((e, _)) if e == epoch => (None, false),
            Some((_, old)) => (Some(old), true),
            None => (None, true),
        };
        if first {
            let slot = self.new_slot();
            self.peers.insert(
                replica.to_owned(),
                Peer {
                    replica: replica.to_owned(),
                    epoch,
                    slot,
                    next_seq: seq,
                    last_heard_ms: now_ms,
                    messages: 0,
                    lost: 0,
                },
            );
        }
        let Some(peer) = self.peers.get_mut(replica) else {
            return Verdict::Own;
        };
        let lost = seq.saturating_sub(peer.next_seq);
        peer.lost += lost;
        peer.messages += 1;
        peer.next_seq = peer.next_seq.max(seq + 1);
        peer.last_heard_ms = now_ms;
        Verdict::Apply {
            slot: peer.slot,
            lost,
            replaced,
            first,
        }
    }

    /// Forgets the peers silent for more than `silence_ms`; returns their slots.
    pub fn expire(&mut self, now_ms: u64, silence_ms: u64) -> Vec<(String, u32)> {
        let gone: Vec<(String, u32)> = self
            .peers
            .values()
            .filter(|p| now_ms.saturating_sub(p.last_heard_ms) > silence_ms)
            .map(|p| (p.replica.clone(), p.slot))
            .collect();
        for (name, _) in &gone {
            self.peers.remove(name);
        }
        gone
    }

    /// Forgets every peer (this replica lost its connection: what they said
    /// meanwhile is unknown); returns their slots.
    pub fn forget_all(&mut self) -> Vec<u32> {
        self.peers.drain().map(|(_, p)| p.slot).collect()
    }

    /// Every peer, by replica id.
    pub fn list(&self) -> Vec<Peer> {
        let mut peers: Vec<Peer> = self.peers.values().cloned().collect();
        peers.sort_by(|a, b| a.replica.cmp(&b.replica));
        peers
    }

    /// Whether `replica` names this replica (or all, `*`).
    pub fn addressed_to_me(&self, replica: &str) -> bool {
        replica == "*" || replica == self.me
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn tagged_ids_keep_the_slot_and_the_owners_id_apart() {
        let t = tagged_id(3, 12_345);
        assert_eq!((slot_of(t), t & 0xff_ffff_ffff), (3, 12_345));
        assert_eq!(
            slot_of(tagged_id(0, u64::MAX)),
            0,
            "an id never spills into the slot"
        );
    }

    #[test]
    fn own_messages_gaps_restarts_and_silence() {
        let mut peers = Peers::new("a", 1);
        assert_eq!(peers.receive("a", 1, 0, 0), Verdict::Own);
        assert_eq!(peers.receive("a", 2, 0, 0), Verdict::SameId);
        let first = peers.receive("b", 9, 5, 10);
        assert_eq!(
            first,
            Verdict::Apply {
                slot: 1,
                lost: 0,
                replaced: None,
                first: true
            },
            "joining mid-stream loses nothing but asks for the state"
        );
        assert!(matches!(
            peers.receive("b", 9, 6, 11),
            Verdict::Apply {
                lost: 0,
                first: false,
                ..
            }
        ));
        assert!(matches!(
            peers.receive("b", 9, 9, 12),
            Verdict::Apply { lost: 2, .. }
        ));
        assert!(
            matches!(peers.receive("b", 9, 8, 12), Verdict::Apply { lost: 0, .. }),
            "late, not lost"
        );
        assert_eq!(peers.list()[0].lost, 2);
        let restarted = peers.receive("b", 10, 0, 20);
        assert_eq!(
            restarted,
            Verdict::Apply {
                slot: 2,
                lost: 0,
                replaced: Some(1),
                first: true
            }
        );
        peers.receive("c", 1, 0, 20);
        assert_eq!(peers.expire(2_400, 2_500), Vec::<(String, u32)>::new());
        peers.receive("c", 1, 1, 2_000);
        assert_eq!(peers.expire(4_000, 2_500), vec![("b".to_owned(), 2)]);
        assert_eq!(peers.list().len(), 1);
        assert_eq!(peers.forget_all(), vec![3]);
        assert!(
            peers.addressed_to_me("*") && peers.addressed_to_me("a") && !peers.addressed_to_me("b")
        );
    }
}
