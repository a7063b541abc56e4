//! The NATS side of the in-flight sync: publishes this replica's outbox,
//! applies its peers' messages to the shared load, and keeps both sides
//! whole across losses, restarts and outages.
//!
//! * Publishing: woken by the first pending event, the publisher waits one
//!   batch window (250 µs) for more, then sends them in as few messages as
//!   fit; a heartbeat goes out every second when nothing else did.
//! * Receiving: every message runs through [`Peers`], which says whose it
//!   is and whether any was lost; a loss, a new peer or a restarted one is
//!   answered with a resync request, and the peer resends its whole state
//!   after a `Reset`.
//! * Outages: while NATS is down events are dropped (counted) and routing
//!   goes on from this replica's own state; at reconnection this replica
//!   sends its whole state and forgets its peers', which they resend.
//!   A peer silent for [`SILENCE`] is forgotten with its requests.

use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex, PoisonError, Weak};
use std::time::{Duration, Instant};

use async_nats::connection::State;
use futures_util::StreamExt;
use prometheus_client::metrics::histogram::Histogram;
use tokio::runtime::Handle;
use tracing::{debug, info, warn};

use super::delays::{Reservoir, Summary};
use super::message::{Batcher, Body, Envelope, Event};
use super::outbox::{unix_us, Outbox};
use super::peers::{Peer, Peers, Verdict};
use super::ReplicaConfig;

/// How long a batch gathers events while they come.
const BATCH_WINDOW: Duration = Duration::from_micros(250);
/// Empty batch windows after which the publisher sleeps until an event.
const QUIET_ROUNDS: u32 = 40;
/// A heartbeat goes out when nothing else did for this long.
const HEARTBEAT: Duration = Duration::from_secs(1);
/// A peer not heard from for this long is forgotten, with its requests.
pub const SILENCE: Duration = Duration::from_millis(3_500);

/// What the sync does to the load table: the proxy implements it, so this
/// module never reaches into the proxy.
pub trait SharedLoad: Send + Sync + 'static {
    /// Applies one message's events of a peer under its slot; returns how
    /// many named a worker or rank this replica does not have.
    fn apply_peer(&self, slot: u32, events: &[Event]) -> u64;
    /// Drops every request of the peer in `slot`; returns how many.
    fn forget_slot(&self, slot: u32) -> usize;
    /// This replica's own requests in flight, as admissions (with
    /// `admitted_us` 0: they are not fresh and measure no delay).
    fn own_state(&self) -> Vec<Event>;
}

/// Counts of what the sync did.
#[derive(Debug, Default)]
pub struct SyncCounters {
    /// Messages published.
    pub sent: AtomicU64,
    /// Peer messages received.
    pub received: AtomicU64,
    /// Peer messages that never arrived (sequence gaps).
    pub lost: AtomicU64,
    /// Messages that could not be decoded.
    pub undecodable: AtomicU64,
    /// Peer events about a worker or rank this replica does not have.
    pub unknown_workers: AtomicU64,
    /// Times the NATS connection went down.
    pub outages: AtomicU64,
    /// Whole states this replica sent (after a reset request, an outage or an overflow).
    pub resyncs_sent: AtomicU64,
    /// Resyncs this replica asked of its peers.
    pub resyncs_asked: AtomicU64,
    /// Peers forgotten after their silence.
    pub peers_expired: AtomicU64,
    /// Publishes NATS refused.
    pub publish_errors: AtomicU64,
    /// Messages from another process using this replica's id.
    pub id_conflicts: AtomicU64,
    /// Index snapshots written to the object store.
    pub snapshots_written: AtomicU64,
    /// Index snapshots the object store did not take.
    pub snapshot_failures: AtomicU64,
    /// Times the snapshots' object store was found gone and made again.
    pub buckets_recreated: AtomicU64,
}

/// One replica's in-flight sync.
pub struct ReplicaSync {
    config: ReplicaConfig,
    epoch: u64,
    outbox: Arc<Outbox>,
    peers: Mutex<Peers>,
    delays: Mutex<Reservoir>,
    delay: Histogram,
    need_reset: AtomicBool,
    /// The connection was lost: forget the peers' requests until they resend them.
    peers_stale: AtomicBool,
    /// The publisher is to end.
    stopped: AtomicBool,
    /// Peers to ask for their whole state.
    asks: Mutex<Vec<String>>,
    /// Connections made so far (each reconnection one more), for what must
    /// be checked after NATS came back ([`ReplicaSync::connections`]).
    connections: tokio::sync::watch::Sender<u64>,
    /// What the sync did.
    pub counters: SyncCounters,
    started: Instant,
}

impl std::fmt::Debug for ReplicaSync {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ReplicaSync")
            .field("replica", &self.config.replica_id)
            .field("epoch", &self.epoch)
            .finish_non_exhaustive()
    }
}

/// `/workers`' view of the sync.
#[derive(Debug, Clone, serde::Serialize)]
pub struct SyncView {
    /// This replica.
    pub replica_id: String,
    /// The NATS server.
    pub nats_url: String,
    /// Whether it is connected now.
    pub connected: bool,
    /// Times the connection went down.
    pub outages: u64,
    /// Peer messages lost.
    pub lost_messages: u64,
    /// Events dropped while NATS was down or slow.
    pub dropped_events: u64,
    /// Delay from a peer's admission to its application here.
    pub peer_delay: Option<Summary>,
    /// What handing an event to the outbox costs a request.
    pub publish_cost: Option<Summary>,
    /// The peers heard.
    pub peers: Vec<PeerView>,
}

/// One peer in `/workers`.
#[derive(Debug, Clone, serde::Serialize)]
pub struct PeerView {
    /// Its replica id.
    pub replica_id: String,
    /// Milliseconds since it was last heard.
    pub last_heard_ms_ago: u64,
    /// Its messages received.
    pub messages: u64,
    /// Its messages lost.
    pub lost: u64,
}

impl ReplicaSync {
    /// The sync of `config`'s replica; nothing runs until [`ReplicaSync::run`].
    pub fn new(config: ReplicaConfig) -> Arc<Self> {
        let epoch = unix_us() ^ u64::from(std::process::id()).rotate_left(48);
        Arc::new(ReplicaSync {
            peers: Mutex::new(Peers::new(config.replica_id.clone(), epoch)),
            config,
            epoch,
            outbox: Arc::new(Outbox::default()),
            delays: Mutex::new(Reservoir::new(65_536)),
            delay: Histogram::new([
                50e-6, 100e-6, 200e-6, 500e-6, 1e-3, 2e-3, 5e-3, 10e-3, 50e-3, 0.25,
            ]),
            need_reset: AtomicBool::new(true),
            peers_stale: AtomicBool::new(false),
            stopped: AtomicBool::new(false),
            asks: Mutex::new(Vec::new()),
            connections: tokio::sync::watch::Sender::new(0),
            counters: SyncCounters::default(),
            started: Instant::now(),
        })
    }

    /// Counts the connections to NATS as they are made: what a replica
    /// keeps in JetStream (the pins bucket) is checked at each, since a
    /// NATS server that restarted may have come back without it.
    pub fn connections(&self) -> tokio::sync::watch::Receiver<u64> {
        self.connections.subscribe()
    }

    /// Where requests hand their events.
    pub fn outbox(&self) -> &Arc<Outbox> {
        &self.outbox
    }

    /// The configuration.
    pub fn config(&self) -> &ReplicaConfig {
        &self.config
    }

    /// The delay histogram (admission at a peer → applied here).
    pub fn delay_histogram(&self) -> &Histogram {
        &self.delay
    }

    fn now_ms(&self) -> u64 {
        self.started.elapsed().as_millis() as u64
    }

    fn subject(&self) -> String {
        format!("{}.active", self.config.prefix)
    }

    /// Starts connecting (in the background, retrying for ever).
    pub async fn connect(self: &Arc<Self>) -> Result<async_nats::Client, async_nats::ConnectError> {
        let weak: Weak<ReplicaSync> = Arc::downgrade(self);
        async_nats::ConnectOptions::new()
            .name(format!("kvroute {}", self.config.replica_id))
            .retry_on_initial_connect()
            .max_reconnects(None)
            .connection_timeout(Duration::from_secs(2))
            .ping_interval(Duration::from_secs(5))
            .reconnect_delay_callback(|attempts| {
                Duration::from_millis((attempts as u64 * 250).clamp(100, 2_000))
            })
            .event_callback(move |event| {
                let sync = weak.upgrade();
                async move {
                    if let Some(sync) = sync {
                        sync.on_connection_event(event);
                    }
                }
            })
            .connect(self.config.nats_url.as_str())
            .await
    }

    /// Runs the subscriber (a task, returned) and the publisher with the
    /// peer watch (a thread, until [`ReplicaSync::stop`]) over `client`.
    pub fn run(
        self: &Arc<Self>,
        client: async_nats::Client,
        load: Arc<dyn SharedLoad>,
    ) -> Vec<tokio::task::JoinHandle<()>> {
        let subscriber = {
            let (sync, client, load) = (self.clone(), client.clone(), load.clone());
            tokio::spawn(async move { sync.receive(client, load).await })
        };
        let (sync, runtime) = (self.clone(), Handle::current());
        let spawned = std::thread::Builder::new()
            .name("kvroute-replica".into())
            .spawn(move || sync.publish(&client, load.as_ref(), &runtime));
        if let Err(e) = spawned {
            warn!(error = %e, "the replica publisher thread could not start: peers will not hear this replica");
        }
        vec![subscriber]
    }

    fn on_connection_event(&self, event: async_nats::Event) {
        match event {
            async_nats::Event::Connected => {
                info!(url = %self.config.nats_url, "NATS connected; sending this replica's state");
                self.need_reset.store(true, Ordering::Relaxed);
                self.outbox.set_connected(true);
                self.connections.send_modify(|n| *n += 1);
            }
            async_nats::Event::Disconnected => {
                self.outbox.set_connected(false);
                self.peers_stale.store(true, Ordering::Relaxed);
                self.counters.outages.fetch_add(1, Ordering::Relaxed);
                warn!(
                    url = %self.config.nats_url,
                    "NATS unreachable: routing from this replica's own state until it returns"
                );
            }
            other => debug!(event = %other, "NATS"),
        }
    }

    /// Publishes the outbox, the whole state when needed, and heartbeats,
    /// on its own thread until [`ReplicaSync::stop`]: a batch window every
    /// [`BATCH_WINDOW`] while events come, asleep after [`QUIET_ROUNDS`]
    /// empty ones (std sleeps: tokio's timers tick by the millisecond).
    fn publish(&self, client: &async_nats::Client, load: &dyn SharedLoad, runtime: &Handle) {
        self.outbox.attach_publisher();
        let mut batcher = Batcher::new(self.config.replica_id.clone(), self.epoch);
        let subject = self.subject();
        let mut last_sent = Instant::now();
        let mut quiet = 0u32;
        while !self.stopped.load(Ordering::Relaxed) {
            if quiet >= QUIET_ROUNDS {
                self.outbox.sleep(HEARTBEAT);
                quiet = 0;
            } else {
                std::thread::sleep(BATCH_WINDOW);
            }
            let (events, overflowed) = self.outbox.take();
            quiet = if events.is_empty() {
                quiet.saturating_add(1)
            } else {
                0
            };
            if client.connection_state() != State::Connected {
                continue;
            }
            let mut envelopes: Vec<Envelope> = self
                .take_asks()
                .into_iter()
                .map(|replica| batcher.envelope(Body::ResyncRequest { replica }))
                .collect();
            if overflowed || self.need_reset.swap(false, Ordering::Relaxed) {
                // What was pending is in the state; the state goes after a reset.
                self.counters.resyncs_sent.fetch_add(1, Ordering::Relaxed);
                envelopes.push(batcher.envelope(Body::Reset));
                envelopes.extend(batcher.events(load.own_state()));
            } else if !events.is_empty() || last_sent.elapsed() >= HEARTBEAT {
                envelopes.extend(batcher.events(events));
            }
            for envelope in envelopes {
                runtime.block_on(self.send(client, &subject, &envelope));
                last_sent = Instant::now();
            }
            self.watch_peers(load);
        }
    }

    /// Stops the publisher thread.
    pub fn stop(&self) {
        self.stopped.store(true, Ordering::Relaxed);
        self.outbox.nudge();
    }

    async fn send(&self, client: &async_nats::Client, subject: &str, envelope: &Envelope) {
        let bytes = envelope.encode();
        match client.publish(subject.to_owned(), bytes.into()).await {
            Ok(()) => {
                self.counters.sent.fetch_add(1, Ordering::Relaxed);
            }
            Err(e) => {
                self.counters.publish_errors.fetch_add(1, Ordering::Relaxed);
                self.need_reset.store(true, Ordering::Relaxed);
                debug!(error = %e, "a replica message was not published");
            }
        }
    }

    fn take_asks(&self) -> Vec<String> {
        let mut asks =
            std::mem::take(&mut *self.asks.lock().unwrap_or_else(PoisonError::into_inner));
        asks.sort_unstable();
        asks.dedup();
        self.counters
            .resyncs_asked
            .fetch_add(asks.len() as u64, Ordering::Relaxed);
        asks
    }

    /// Forgets peers silent for too long, with their requests (all of them
    /// after an outage).
    fn watch_peers(&self, load: &dyn SharedLoad) {
        if self.peers_stale.swap(false, Ordering::Relaxed) {
            self.forget_peers(load);
        }
        let gone = self
            .peers
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .expire(self.now_ms(), SILENCE.as_millis() as u64);
        for (replica, slot) in gone {
            let requests = load.forget_slot(slot);
            self.counters.peers_expired.fetch_add(1, Ordering::Relaxed);
            warn!(peer = %replica, requests, "a peer replica fell silent; its requests are forgotten");
        }
    }

    /// Applies every peer message until the subscription ends.
    async fn receive(self: Arc<Self>, client: async_nats::Client, load: Arc<dyn SharedLoad>) {
        let subject = self.subject();
        let mut messages = loop {
            match client.subscribe(subject.clone()).await {
                Ok(s) => break s,
                Err(e) => {
                    warn!(error = %e, "subscribing to the replicas' subject failed; retrying");
                    tokio::time::sleep(Duration::from_secs(1)).await;
                }
            }
        };
        while let Some(message) = messages.next().await {
            if self.peers_stale.swap(false, Ordering::Relaxed) {
                self.forget_peers(load.as_ref());
            }
            match Envelope::decode(&message.payload) {
                Ok(envelope) => {
                    if let Some(peer) = self.apply(envelope, load.as_ref()) {
                        self.asks
                            .lock()
                            .unwrap_or_else(PoisonError::into_inner)
                            .push(peer);
                        self.outbox.nudge();
                    }
                }
                Err(e) => {
                    if self.counters.undecodable.fetch_add(1, Ordering::Relaxed) == 0 {
                        warn!(error = %e, "an undecodable replica message was skipped (further ones are only counted)");
                    }
                }
            }
        }
    }

    /// After an outage: what peers said meanwhile is unknown, so their
    /// requests go until they resend them.
    fn forget_peers(&self, load: &dyn SharedLoad) {
        let slots = self
            .peers
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .forget_all();
        for slot in slots {
            load.forget_slot(slot);
        }
    }

    /// Applies one message; returns the peer to ask for a resync, if any.
    fn apply(&self, envelope: Envelope, load: &dyn SharedLoad) -> Option<String> {
        let verdict = self
            .peers
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .receive(
                &envelope.replica,
                envelope.epoch,
                envelope.seq,
                self.now_ms(),
            );
        let (slot, lost, replaced, first) = match verdict {
            Verdict::Own => return None,
            Verdict::SameId => {
                if self.counters.id_conflicts.fetch_add(1, Ordering::Relaxed) == 0 {
                    warn!(
                        replica = %envelope.replica,
                        "another router uses this replica's --replica-id; its messages are skipped: give each replica its own"
                    );
                }
                return None;
            }
            Verdict::Apply {
                slot,
                lost,
                replaced,
                first,
            } => (slot, lost, replaced, first),
        };
        self.counters.received.fetch_add(1, Ordering::Relaxed);
        if let Some(old) = replaced {
            load.forget_slot(old);
            info!(peer = %envelope.replica, "a peer replica restarted; its old requests are forgotten");
        }
        if lost > 0 && self.counters.lost.fetch_add(lost, Ordering::Relaxed) == 0 {
            warn!(peer = %envelope.replica, lost, "messages from a peer replica were lost; asking for its state");
        }
        let mut resync = (lost > 0 || first).then(|| envelope.replica.clone());
        match envelope.body {
            Body::Reset => {
                load.forget_slot(slot);
                resync = None;
            }
            Body::ResyncRequest { replica } => {
                let me = self
                    .peers
                    .lock()
                    .unwrap_or_else(PoisonError::into_inner)
                    .addressed_to_me(&replica);
                if me {
                    self.need_reset.store(true, Ordering::Relaxed);
                    self.outbox.nudge();
                }
            }
            Body::Events(events) => self.apply_events(slot, &events, load),
        }
        resync
    }

    fn apply_events(&self, slot: u32, events: &[Event], load: &dyn SharedLoad) {
        let unknown = load.apply_peer(slot, events);
        self.counters
            .unknown_workers
            .fetch_add(unknown, Ordering::Relaxed);
        let now = unix_us();
        let mut delays = events
            .iter()
            .filter_map(|e| match e {
                Event::Admit(a) if a.admitted_us > 0 => Some(now.saturating_sub(a.admitted_us)),
                _ => None,
            })
            .peekable();
        if delays.peek().is_none() {
            return;
        }
        let mut reservoir = self.delays.lock().unwrap_or_else(PoisonError::into_inner);
        for us in delays {
            reservoir.record(us);
            self.delay.observe(us as f64 / 1e6);
        }
    }

    /// The sync as `/workers` shows it.
    pub fn view(&self) -> SyncView {
        let now = self.now_ms();
        let peers: Vec<Peer> = self
            .peers
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .list();
        SyncView {
            replica_id: self.config.replica_id.clone(),
            nats_url: self.config.nats_url.clone(),
            connected: self.outbox.connected(),
            outages: self.counters.outages.load(Ordering::Relaxed),
            lost_messages: self.counters.lost.load(Ordering::Relaxed),
            dropped_events: self.outbox.dropped(),
            peer_delay: self
                .delays
                .lock()
                .unwrap_or_else(PoisonError::into_inner)
                .summary(),
            publish_cost: self.outbox.cost_summary(),
            peers: peers
                .into_iter()
                .map(|p| PeerView {
                    replica_id: p.replica,
                    last_heard_ms_ago: now.saturating_sub(p.last_heard_ms),
                    messages: p.messages,
                    lost: p.lost,
                })
                .collect(),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::replica::message::{Admission, RequestRef};
    use kvroute_core::index::DpRank;

    /// A load table that records what the sync does to it.
    #[derive(Default)]
    struct Recorder {
        applied: Mutex<Vec<(u32, Event)>>,
        forgotten: Mutex<Vec<u32>>,
    }

    impl SharedLoad for Recorder {
        fn apply_peer(&self, slot: u32, events: &[Event]) -> u64 {
            let mut unknown = 0;
            for event in events {
                let worker = match event {
                    Event::Admit(a) => &a.at.worker,
                    Event::Prefilled(r) | Event::Release(r) => &r.worker,
                };
                unknown += u64::from(worker != "w0");
                self.applied
                    .lock()
                    .expect("lock")
                    .push((slot, event.clone()));
            }
            unknown
        }
        fn forget_slot(&self, slot: u32) -> usize {
            self.forgotten.lock().expect("lock").push(slot);
            0
        }
        fn own_state(&self) -> Vec<Event> {
            Vec::new()
        }
    }

    fn admission(worker: &str, admitted_us: u64) -> Event {
        Event::Admit(Admission {
            at: RequestRef {
                id: 1,
                worker: worker.into(),
                rank: DpRank(0),
            },
            prefill_tokens: 64,
            prefilling: true,
            blocks: vec![1, 2, 3, 4],
            ttl_ms: 1_000,
            admitted_us,
        })
    }

    fn from_b(seq: u64, body: Body) -> Envelope {
        Envelope {
            replica: "b".into(),
            epoch: 7,
            seq,
            body,
        }
    }

    #[test]
    fn peer_messages_are_applied_gaps_ask_for_a_resync_and_a_reset_clears() {
        let sync = ReplicaSync::new(ReplicaConfig::new("nats://127.0.0.1:1", "a"));
        let load = Recorder::default();
        let joined = sync.apply(
            from_b(3, Body::Events(vec![admission("w0", unix_us())])),
            &load,
        );
        assert_eq!(
            joined.as_deref(),
            Some("b"),
            "a peer heard mid-stream is asked for its state"
        );
        let reset = sync.apply(from_b(4, Body::Reset), &load);
        assert_eq!(reset, None, "its reset is the answer");
        assert_eq!(*load.forgotten.lock().expect("lock"), vec![1]);
        let fine = sync.apply(from_b(5, Body::Events(vec![admission("w9", 0)])), &load);
        assert_eq!(fine, None);
        let gap = sync.apply(from_b(9, Body::Events(Vec::new())), &load);
        assert_eq!(gap.as_deref(), Some("b"), "three lost messages");
        let view = sync.view();
        assert_eq!((view.lost_messages, view.peers.len()), (3, 1));
        assert_eq!(sync.counters.unknown_workers.load(Ordering::Relaxed), 1);
        assert_eq!(
            view.peer_delay.map(|d| d.count),
            Some(1),
            "only fresh admissions measure a delay"
        );
        assert_eq!(load.applied.lock().expect("lock").len(), 2);
        assert!(load
            .applied
            .lock()
            .expect("lock")
            .iter()
            .all(|(slot, _)| *slot == 1));
        let own = Envelope {
            replica: "a".into(),
            epoch: sync.epoch,
            seq: 0,
            body: Body::Events(vec![admission("w0", 1)]),
        };
        assert_eq!(sync.apply(own, &load), None);
        assert_eq!(
            load.applied.lock().expect("lock").len(),
            2,
            "own messages are not applied"
        );
    }

    #[test]
    fn a_resync_request_for_this_replica_schedules_its_state() {
        let sync = ReplicaSync::new(ReplicaConfig::new("nats://127.0.0.1:1", "a"));
        let load = Recorder::default();
        sync.need_reset.store(false, Ordering::Relaxed);
        let other = Body::ResyncRequest {
            replica: "c".into(),
        };
        sync.apply(from_b(0, other), &load);
        assert!(!sync.need_reset.load(Ordering::Relaxed));
        let mine = Body::ResyncRequest {
            replica: "a".into(),
        };
        sync.apply(from_b(1, mine), &load);
        assert!(sync.need_reset.load(Ordering::Relaxed));
    }
}
