//! The load peer replicas put on the same workers, folded into this
//! replica's: what [`crate::replica`] applies from their messages, and this
//! replica's own requests as it tells them after a reset.
//!
//! A peer's request is kept under an id tagged with the peer's slot, next
//! to this replica's own, so the cost sees one load per rank whichever
//! replica routed it; it expires like a local one (at the owner's expiry)
//! or with its owner. A peer's speed observation feeds this replica's
//! learner as its own responses do.

use std::time::Duration;

use kvroute_core::hash::SequenceHash;
use kvroute_core::index::{DpRank, WorkerRank};

use super::candidates::Target;
use super::Router;
use crate::replica::bus::SharedLoad;
use crate::replica::message::{Admission, Event, RequestRef};
use crate::replica::peers::{slot_of, tagged_id};
use crate::replica::speeds::{SharedSpeeds, SpeedObservation};

impl Router {
    fn expiry_ms(&self) -> u64 {
        self.config.active_expiry.as_millis() as u64
    }
}

/// The index key of `worker`'s `rank` among `targets`, if this replica has them.
fn key_of(targets: &[Target], worker: &str, rank: DpRank) -> Option<WorkerRank> {
    targets
        .iter()
        .find(|t| &*t.name == worker && t.ranks.contains(&rank))
        .map(|t| WorkerRank { worker: t.id, rank })
}

impl SharedLoad for Router {
    fn apply_peer(&self, slot: u32, events: &[Event]) -> u64 {
        // One read of the workers and one lock of the table per message.
        let targets = self.targets();
        let (now, max) = (self.now_ms(), self.expiry_ms());
        let mut unknown = 0;
        let mut load_dropped = false;
        let mut table = self.active.lock();
        for event in events {
            let at = match event {
                Event::Admit(a) => &a.at,
                Event::Prefilled(r) | Event::Release(r) => r,
            };
            let Some(key) = key_of(&targets, &at.worker, at.rank) else {
                unknown += 1;
                continue;
            };
            let id = tagged_id(slot, at.id);
            match event {
                Event::Admit(a) => {
                    let blocks: Vec<SequenceHash> =
                        a.blocks.iter().map(|&h| SequenceHash(h)).collect();
                    // Expires here when it would at its owner: `ttl_ms` from now.
                    let started = (now + a.ttl_ms.min(max)).saturating_sub(max);
                    let entry = table.entry(key).or_default();
                    entry.add(id, &blocks, a.prefill_tokens, started);
                    if !a.prefilling {
                        entry.prefill_done(id);
                    }
                }
                Event::Prefilled(_) => {
                    if let Some(entry) = table.get_mut(&key) {
                        entry.prefill_done(id);
                    }
                    load_dropped = true;
                }
                Event::Release(_) => {
                    if let Some(entry) = table.get_mut(&key) {
                        entry.free(id);
                    }
                    load_dropped = true;
                }
            }
        }
        drop(table);
        if load_dropped {
            self.load_dropped.notify_waiters();
        }
        unknown
    }

    fn forget_slot(&self, slot: u32) -> usize {
        let forgotten = self
            .active
            .lock()
            .values_mut()
            .map(|a| a.free_where(|id| slot_of(id) == slot))
            .sum();
        self.load_dropped.notify_waiters();
        forgotten
    }

    fn own_state(&self) -> Vec<Event> {
        let targets = self.targets();
        let (now, max) = (self.now_ms(), self.expiry_ms());
        let table = self.active.lock();
        let mut events = Vec::new();
        for (key, active) in table.iter() {
            let Some(target) = targets.iter().find(|t| t.id == key.worker) else {
                continue;
            };
            for r in active.requests().filter(|r| slot_of(r.id) == 0) {
                events.push(Event::Admit(Admission {
                    at: RequestRef {
                        id: r.id,
                        worker: target.name.to_string(),
                        rank: key.rank,
                    },
                    prefill_tokens: r.prefill_tokens,
                    prefilling: r.prefilling,
                    blocks: r.blocks.iter().map(|b| b.0).collect(),
                    ttl_ms: max.saturating_sub(now.saturating_sub(r.started_ms)),
                    admitted_us: 0,
                }));
            }
        }
        events
    }
}

impl SharedSpeeds for Router {
    fn observe_peer(&self, observations: &[SpeedObservation]) -> u64 {
        // One read of the workers per message.
        let targets = self.targets();
        let mut unknown = 0;
        for o in observations {
            let Some(key) = key_of(&targets, &o.worker, o.rank) else {
                unknown += 1;
                continue;
            };
            if let Some(book) = &self.speeds {
                let decoding = Duration::from_micros(o.decoding_us);
                book.observe(key, (o.load_first, o.load_end), decoding, o.tokens);
            }
        }
        unknown
    }
}
