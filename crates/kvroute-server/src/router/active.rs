//! The load this router has put on each (worker, rank): requests sent there
//! and not yet finished. A request holds an [`ActiveGuard`] from the moment
//! it is sent; the guard marks its prefill done at the first byte back and
//! frees its place when dropped, whether the request ended, failed or the
//! client went away.

use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::Duration;

use kvroute_core::hash::SequenceHash;
use kvroute_core::index::WorkerRank;
use kvroute_core::scheduler::ActiveSequences;
use prometheus_client::collector::Collector;
use prometheus_client::encoding::DescriptorEncoder;

use super::candidates::Target;
use super::load::ActiveRanks;
use super::Router;
use crate::metrics::{
    encode_rank_family, encode_rank_ratios, RankLabels, ACTIVE_DECODE_BLOCKS,
    ACTIVE_PREFILL_TOKENS, ACTIVE_REQUESTS, RANK_SPEED,
};
use crate::replica::message::RequestRef;
use crate::replica::outbox::Outbox;
use crate::replica::peers::tagged_id;
use crate::replica::speeds::SpeedObservation;

/// A request's place in its rank's load, freed when dropped.
#[derive(Debug)]
pub struct ActiveGuard {
    router: Arc<Router>,
    key: WorkerRank,
    id: u64,
    /// The worker's name, when peer replicas are told of the request.
    shared_as: Option<Arc<str>>,
}

impl ActiveGuard {
    /// Adds a request with these blocks and uncached prompt tokens to the
    /// load of `key` (a rank of worker `name`) in `ranks`, the router's table
    /// held by the caller, and tells the peer replicas.
    pub fn add(
        router: &Arc<Router>,
        ranks: &mut ActiveRanks,
        (key, name): (WorkerRank, &Arc<str>),
        blocks: &[SequenceHash],
        prefill: u64,
    ) -> Self {
        let id = tagged_id(0, router.next_id.fetch_add(1, Ordering::Relaxed));
        let now = router.now_ms();
        ranks.entry(key).or_default().add(id, blocks, prefill, now);
        let outbox = router.outbox();
        if let Some(outbox) = outbox {
            let ttl = router.config.active_expiry.as_millis() as u64;
            let hashes = blocks.iter().map(|b| b.0).collect();
            outbox.admitted(request_ref(id, name, key), hashes, prefill, ttl);
        }
        ActiveGuard {
            router: router.clone(),
            key,
            id,
            shared_as: outbox.map(|_| name.clone()),
        }
    }

    fn reference(&self) -> Option<(&Outbox, RequestRef)> {
        let name = self.shared_as.as_ref()?;
        Some((self.router.outbox()?, request_ref(self.id, name, self.key)))
    }

    /// The router the request runs in.
    pub fn router(&self) -> &Router {
        &self.router
    }

    /// The request's prefill is over (its first byte came back); returns
    /// the blocks in flight on its rank now.
    pub fn prefill_done(&self) -> u64 {
        let mut load = 0;
        if let Some(a) = self.router.active.lock().get_mut(&self.key) {
            a.prefill_done(self.id);
            load = a.active_blocks();
        }
        if let Some((outbox, at)) = self.reference() {
            outbox.prefilled(at);
        }
        self.router.load_dropped.notify_waiters();
        load
    }

    /// The response ended `decoding` after its first byte, with `tokens`
    /// generated, its rank having had `load_then` blocks in flight at the
    /// first byte: an observation of the rank's speed, when learning.
    pub fn decoded(&self, decoding: Duration, load_then: u64, tokens: u64) {
        let Some(book) = &self.router.speeds else {
            return;
        };
        let now = self
            .router
            .active
            .lock()
            .get(&self.key)
            .map_or(load_then, ActiveSequences::active_blocks);
        book.observe(self.key, (load_then, now), decoding, tokens);
        if let (Some(share), Some(worker)) = (self.router.speed_share.as_ref(), &self.shared_as) {
            share.push(SpeedObservation {
                worker: worker.to_string(),
                rank: self.key.rank,
                load_first: load_then,
                load_end: now,
                decoding_us: u64::try_from(decoding.as_micros()).unwrap_or(u64::MAX),
                tokens,
            });
        }
    }

    /// Whether the router learns speeds, so the response's token count matters.
    pub fn learns_speeds(&self) -> bool {
        self.router.learns_speeds()
    }
}

impl Drop for ActiveGuard {
    fn drop(&mut self) {
        if let Some(a) = self.router.active.lock().get_mut(&self.key) {
            a.free(self.id);
        }
        if let Some((outbox, at)) = self.reference() {
            outbox.released(at);
        }
        self.router.load_dropped.notify_waiters();
    }
}

fn request_ref(id: u64, name: &str, key: WorkerRank) -> RequestRef {
    RequestRef {
        id,
        worker: name.to_owned(),
        rank: key.rank,
    }
}

/// The load gauges (`kvroute_active_*`), read from the table at scrape time.
#[derive(Debug)]
pub struct ActiveCollector {
    router: Arc<Router>,
}

impl ActiveCollector {
    /// A collector over `router`'s load.
    pub fn new(router: Arc<Router>) -> Self {
        ActiveCollector { router }
    }
}

impl Collector for ActiveCollector {
    fn encode(&self, mut encoder: DescriptorEncoder) -> Result<(), std::fmt::Error> {
        let targets = self.router.targets();
        let rows: Vec<(RankLabels, [u64; 3])> = self
            .router
            .active
            .snapshot()
            .into_iter()
            .map(|(key, requests, prefill, blocks)| {
                let worker = targets
                    .iter()
                    .find(|t| t.id == key.worker)
                    .map_or_else(|| Arc::from(""), |t| t.name.clone());
                let labels = RankLabels {
                    worker,
                    dp_rank: key.rank.0,
                };
                (labels, [requests, prefill, blocks])
            })
            .collect();
        for (i, info) in [ACTIVE_REQUESTS, ACTIVE_PREFILL_TOKENS, ACTIVE_DECODE_BLOCKS]
            .iter()
            .enumerate()
        {
            encode_rank_family(&mut encoder, info, rows.iter().map(|(l, v)| (l, v[i])))?;
        }
        self.encode_speeds(&mut encoder, &targets)
    }
}

impl ActiveCollector {
    /// `kvroute_rank_speed`: every rank of every worker routing knows.
    fn encode_speeds(
        &self,
        encoder: &mut DescriptorEncoder,
        targets: &[Target],
    ) -> Result<(), std::fmt::Error> {
        let learned = self.router.learned_speeds();
        let rows = targets.iter().flat_map(|t| {
            t.ranks.iter().map(|&rank| {
                let key = WorkerRank { worker: t.id, rank };
                let speed = learned.as_ref().and_then(|l| l.get(&key).copied());
                let labels = RankLabels {
                    worker: t.name.clone(),
                    dp_rank: rank.0,
                };
                (labels, speed.unwrap_or(t.speed))
            })
        });
        encode_rank_ratios(encoder, &RANK_SPEED, rows)
    }
}
