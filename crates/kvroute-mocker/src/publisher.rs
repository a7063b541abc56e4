//! The event publisher of one rank: ZeroMQ PUB for live batches, ROUTER for replay.
//!
//! Transport as both engines' `ZmqEventPublisher`:
//! * PUB frames `[topic, seq (u64 big-endian), payload]`, topic `""`, seq from 0
//!   per publisher, +1 per batch; send high-water mark 100,000;
//! * the replay ROUTER keeps the last `buffer_steps` (10,000) batches; a DEALER
//!   sends `[b"", start_seq (8 bytes BE)]` and receives every retained batch
//!   with `seq ≥ start_seq`, then the end marker (seq −1 = `ff×8`, empty
//!   payload). `--replay-frames 4` (default) answers `[b"", topic, seq,
//!   payload]` and ends with `[b"", b"", ff×8, b""]`; `--replay-frames 3`
//!   answers `[b"", seq, payload]` and ends with `[b"", ff×8, b""]`. Requests
//!   of another shape are logged and ignored, as the engines do. The ROUTER's
//!   send high-water mark is `2·(buffer_steps + 1)` (vLLM's), so a whole
//!   replay fits;
//! * one OS thread owns both sockets (they are not `Sync`): it waits up to
//!   [`POLL_INTERVAL`] for the next batch from the engine and serves pending
//!   replay requests in between, so live batches keep flowing during a replay.
//!
//! [`Sequencer`] is the socket-free part (seq numbers, encoding, fault
//! injection, the ring) and is tested without ZeroMQ.

use std::collections::VecDeque;
use std::net::IpAddr;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::mpsc::{self, RecvTimeoutError, SyncSender, TrySendError};
use std::sync::Arc;
use std::thread::JoinHandle;
use std::time::Duration;

use crate::config::ReplayFrames;
use crate::encode::{encode_batch, EncodeOptions};
use crate::event::KvCacheEvent;
use crate::faults::FaultConfig;

/// Longest wait for a batch before pending replay requests are served.
pub const POLL_INTERVAL: Duration = Duration::from_millis(5);
/// The replay end marker: seq −1 as 8 big-endian bytes.
pub const END_SEQ: [u8; 8] = [0xff; 8];
/// The topic of every frame (both engines default to the empty topic).
pub const TOPIC: &[u8] = b"";
/// Send high-water mark of the PUB socket (both engines' `hwm`).
const PUB_HWM: i32 = 100_000;
/// Batches the engine may queue for the publisher thread (both engines' `max_queue_size`).
const QUEUE_CAPACITY: usize = 100_000;

/// One published batch.
#[derive(Debug, Clone, PartialEq)]
pub struct Published {
    /// Its sequence number.
    pub seq: u64,
    /// The msgpack payload (the same bytes live and in replay).
    pub payload: Arc<[u8]>,
    /// False when `--drop-every` keeps it off the live socket.
    pub live: bool,
}

/// Sequence numbers, encoding, faults and the replay ring of one publisher.
#[derive(Debug, Clone)]
pub struct Sequencer {
    options: EncodeOptions,
    dp_rank: u32,
    faults: FaultConfig,
    capacity: usize,
    next_seq: u64,
    ring: VecDeque<(u64, Arc<[u8]>)>,
}

impl Sequencer {
    /// A publisher at seq 0 with an empty ring of `capacity` batches.
    pub fn new(options: EncodeOptions, dp_rank: u32, faults: FaultConfig, capacity: usize) -> Self {
        Sequencer {
            options,
            dp_rank,
            faults,
            capacity: capacity.max(1),
            next_seq: 0,
            ring: VecDeque::new(),
        }
    }

    /// Encodes the next batch, numbers it and keeps it for replay.
    pub fn publish(&mut self, ts: f64, events: &[KvCacheEvent]) -> Published {
        let seq = self.next_seq;
        self.next_seq += 1;
        let bad_at = self.faults.corrupts(seq).then_some(events.len() / 2);
        let payload: Arc<[u8]> =
            encode_batch(self.options, ts, events, Some(self.dp_rank), bad_at).into();
        if self.ring.len() == self.capacity {
            self.ring.pop_front();
        }
        self.ring.push_back((seq, payload.clone()));
        Published {
            seq,
            payload,
            live: !self.faults.drops(seq),
        }
    }

    /// The retained batches with `seq ≥ start`, oldest first.
    pub fn replay_from(&self, start: u64) -> impl Iterator<Item = &(u64, Arc<[u8]>)> {
        self.ring.iter().filter(move |(seq, _)| *seq >= start)
    }

    /// A new publisher object: seq back to 0, ring emptied.
    pub fn restart(&mut self) {
        self.next_seq = 0;
        self.ring.clear();
    }

    /// The seq the next batch gets.
    pub fn next_seq(&self) -> u64 {
        self.next_seq
    }
}

/// Counters of one publisher, shared with `/metrics`.
#[derive(Debug, Default)]
pub struct PublisherStats {
    /// Batches numbered (live or dropped).
    pub batches: AtomicU64,
    /// Batches kept off the live socket by `--drop-every`.
    pub dropped: AtomicU64,
    /// Events in numbered batches.
    pub events: AtomicU64,
    /// Replay requests answered.
    pub replays: AtomicU64,
    /// Batches lost because the publisher's queue was full.
    pub queue_full: AtomicU64,
    /// Publisher restarts.
    pub restarts: AtomicU64,
}

/// Everything one publisher thread needs.
#[derive(Debug, Clone)]
pub struct PublisherSettings {
    /// Address to bind.
    pub host: IpAddr,
    /// PUB port (0: an ephemeral port).
    pub events_port: u16,
    /// ROUTER port (0: an ephemeral port).
    pub replay_port: u16,
    /// Reply layout.
    pub replay_frames: ReplayFrames,
    /// Encoding of batches.
    pub encode: EncodeOptions,
    /// Rank written into every batch.
    pub dp_rank: u32,
    /// `--drop-every` and `--bad-event-every`.
    pub faults: FaultConfig,
    /// Batches kept for replay.
    pub buffer_steps: usize,
}

/// A socket the publisher could not set up.
#[derive(Debug, thiserror::Error)]
#[error("cannot bind {what} on {endpoint}")]
pub struct BindError {
    /// `"KV-event PUB"` or `"replay ROUTER"`.
    pub what: &'static str,
    /// The endpoint.
    pub endpoint: String,
    /// libzmq's error.
    #[source]
    pub source: zmq::Error,
}

/// Why a publisher could not start.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum PublisherError {
    /// A socket could not be bound.
    #[error(transparent)]
    Bind(#[from] BindError),
    /// The OS refused a thread.
    #[error("cannot start the publisher thread")]
    Thread(#[source] std::io::Error),
}

enum Command {
    Batch { ts: f64, events: Vec<KvCacheEvent> },
    Restart,
}

/// The engine side of a publisher thread.
#[derive(Debug)]
pub struct PublisherHandle {
    tx: SyncSender<Command>,
    thread: Option<JoinHandle<()>>,
    events_endpoint: String,
    replay_endpoint: String,
    stats: Arc<PublisherStats>,
}

impl std::fmt::Debug for Command {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Command::Batch { events, .. } => write!(f, "Batch({} events)", events.len()),
            Command::Restart => f.write_str("Restart"),
        }
    }
}

struct Sockets {
    publisher: zmq::Socket,
    router: zmq::Socket,
}

fn endpoint(host: IpAddr, port: u16) -> String {
    let port = if port == 0 {
        "*".to_owned()
    } else {
        port.to_string()
    };
    match host {
        IpAddr::V4(ip) => format!("tcp://{ip}:{port}"),
        IpAddr::V6(ip) => format!("tcp://[{ip}]:{port}"),
    }
}

fn bind(
    ctx: &zmq::Context,
    kind: zmq::SocketType,
    what: &'static str,
    endpoint: &str,
    hwm: i32,
    ipv6: bool,
) -> Result<(zmq::Socket, String), BindError> {
    let err = |source| BindError {
        what,
        endpoint: endpoint.to_owned(),
        source,
    };
    let socket = ctx.socket(kind).map_err(err)?;
    socket.set_linger(0).map_err(err)?;
    socket.set_sndhwm(hwm).map_err(err)?;
    socket.set_ipv6(ipv6).map_err(err)?;
    socket.bind(endpoint).map_err(err)?;
    let bound = match socket.get_last_endpoint() {
        Ok(Ok(bound)) => bound,
        _ => endpoint.to_owned(),
    };
    Ok((socket, bound))
}

fn bind_both(
    ctx: &zmq::Context,
    s: &PublisherSettings,
    events: &str,
    replay: &str,
) -> Result<(Sockets, String, String), BindError> {
    let ipv6 = s.host.is_ipv6();
    let (publisher, events_bound) = bind(ctx, zmq::PUB, "KV-event PUB", events, PUB_HWM, ipv6)?;
    let replay_hwm = i32::try_from(2 * (s.buffer_steps + 1)).unwrap_or(i32::MAX);
    let (router, replay_bound) = bind(ctx, zmq::ROUTER, "replay ROUTER", replay, replay_hwm, ipv6)?;
    Ok((Sockets { publisher, router }, events_bound, replay_bound))
}

impl PublisherHandle {
    /// Binds both sockets (errors are returned here) and starts the thread.
    pub fn spawn(ctx: &zmq::Context, settings: PublisherSettings) -> Result<Self, PublisherError> {
        let (sockets, events_endpoint, replay_endpoint) = bind_both(
            ctx,
            &settings,
            &endpoint(settings.host, settings.events_port),
            &endpoint(settings.host, settings.replay_port),
        )?;
        let (tx, rx) = mpsc::sync_channel(QUEUE_CAPACITY);
        let stats = Arc::new(PublisherStats::default());
        let worker = Worker {
            ctx: ctx.clone(),
            sequencer: Sequencer::new(
                settings.encode,
                settings.dp_rank,
                settings.faults.clone(),
                settings.buffer_steps,
            ),
            events_endpoint: events_endpoint.clone(),
            replay_endpoint: replay_endpoint.clone(),
            cuts_left: settings.faults.cut_replay,
            settings,
            stats: stats.clone(),
        };
        let thread = std::thread::Builder::new()
            .name(format!("kv-publisher-{}", worker.settings.dp_rank))
            .spawn(move || worker.run(sockets, rx))
            .map_err(PublisherError::Thread)?;
        Ok(PublisherHandle {
            tx,
            thread: Some(thread),
            events_endpoint,
            replay_endpoint,
            stats,
        })
    }

    /// The PUB endpoint actually bound (`tcp://host:port`).
    pub fn events_endpoint(&self) -> &str {
        &self.events_endpoint
    }

    /// The ROUTER endpoint actually bound.
    pub fn replay_endpoint(&self) -> &str {
        &self.replay_endpoint
    }

    /// The counters.
    pub fn stats(&self) -> &Arc<PublisherStats> {
        &self.stats
    }

    /// Queues a batch; never blocks (a full queue drops it, counted and logged).
    pub fn publish(&self, ts: f64, events: Vec<KvCacheEvent>) {
        if events.is_empty() {
            return;
        }
        match self.tx.try_send(Command::Batch { ts, events }) {
            Ok(()) => {}
            Err(TrySendError::Full(_)) => {
                self.stats.queue_full.fetch_add(1, Ordering::Relaxed);
                tracing::warn!("KV-event queue full: batch lost");
            }
            Err(TrySendError::Disconnected(_)) => {
                tracing::warn!("KV-event publisher thread is gone: batch lost");
            }
        }
    }

    /// Restarts the publisher: sockets re-bound, seq back to 0, ring emptied.
    pub fn restart(&self) {
        if self.tx.send(Command::Restart).is_err() {
            tracing::warn!("KV-event publisher thread is gone: restart ignored");
        }
    }

    /// Stops the thread after it has sent everything queued, and waits for it.
    pub fn shutdown(mut self) {
        let thread = self.thread.take();
        drop(self);
        if let Some(thread) = thread {
            if thread.join().is_err() {
                tracing::error!("KV-event publisher thread panicked");
            }
        }
    }
}

struct Worker {
    ctx: zmq::Context,
    sequencer: Sequencer,
    settings: PublisherSettings,
    events_endpoint: String,
    replay_endpoint: String,
    stats: Arc<PublisherStats>,
    /// Replay answers still to be cut before their end marker.
    cuts_left: u64,
}

impl Worker {
    fn run(mut self, sockets: Sockets, rx: mpsc::Receiver<Command>) {
        let mut sockets = Some(sockets);
        loop {
            if let Some(s) = &sockets {
                let frames = self.settings.replay_frames;
                let served =
                    serve_replays_cut(&s.router, &self.sequencer, frames, &mut self.cuts_left);
                self.stats.replays.fetch_add(served, Ordering::Relaxed);
            }
            match rx.recv_timeout(POLL_INTERVAL) {
                Ok(Command::Batch { ts, events }) => {
                    let published = self.sequencer.publish(ts, &events);
                    self.stats.batches.fetch_add(1, Ordering::Relaxed);
                    self.stats
                        .events
                        .fetch_add(events.len() as u64, Ordering::Relaxed);
                    if !published.live {
                        self.stats.dropped.fetch_add(1, Ordering::Relaxed);
                        continue;
                    }
                    if let Some(s) = &sockets {
                        if let Err(e) = send_live(&s.publisher, &published, 0) {
                            tracing::warn!(seq = published.seq, "PUB send failed: {e}");
                        }
                    }
                }
                Ok(Command::Restart) => {
                    // Close first: the new sockets take the same ports.
                    drop(sockets.take());
                    self.sequencer.restart();
                    self.stats.restarts.fetch_add(1, Ordering::Relaxed);
                    sockets = self.rebind();
                }
                Err(RecvTimeoutError::Timeout) => {}
                Err(RecvTimeoutError::Disconnected) => break,
            }
        }
    }

    /// Binds the same endpoints again, retrying while the old ports are released.
    fn rebind(&self) -> Option<Sockets> {
        let mut last_error = None;
        for _ in 0..100 {
            match bind_both(
                &self.ctx,
                &self.settings,
                &self.events_endpoint,
                &self.replay_endpoint,
            ) {
                Ok((sockets, _, _)) => return Some(sockets),
                Err(e) => last_error = Some(e),
            }
            std::thread::sleep(Duration::from_millis(20));
        }
        if let Some(e) = last_error {
            tracing::error!(
                cause = %e.source,
                "publisher restart failed, events are no longer published: {e}"
            );
        }
        None
    }
}

/// Sends one batch on the PUB socket as the engines do: `[topic, seq (8
/// bytes big-endian), payload]` (`flags`: `zmq::DONTWAIT` or 0; a PUB
/// drops rather than blocks when a subscriber's queue is full).
pub fn send_live(publisher: &zmq::Socket, published: &Published, flags: i32) -> zmq::Result<()> {
    let seq = published.seq.to_be_bytes();
    let frames: [&[u8]; 3] = [TOPIC, &seq, &published.payload];
    publisher.send_multipart(frames, flags)
}

/// Answers every replay request already waiting on `router` from
/// `sequencer`'s ring, as the engines do: each retained batch with
/// `seq ≥ start` in the `frames` layout, then the end marker; requests of
/// another shape are logged and ignored. Never blocks on an empty socket.
/// Returns the requests answered.
pub fn serve_replays(router: &zmq::Socket, sequencer: &Sequencer, frames: ReplayFrames) -> u64 {
    serve_replays_cut(router, sequencer, frames, &mut 0)
}

/// [`serve_replays`], except that while `cut` is above 0 an answer goes
/// without its end marker, and `cut` goes down by one (`--cut-replay`).
pub fn serve_replays_cut(
    router: &zmq::Socket,
    sequencer: &Sequencer,
    frames: ReplayFrames,
    cut: &mut u64,
) -> u64 {
    let mut served = 0;
    while let Ok(n) = router.poll(zmq::POLLIN, 0) {
        if n == 0 {
            break;
        }
        let request = match router.recv_multipart(zmq::DONTWAIT) {
            Ok(request) => request,
            Err(zmq::Error::EAGAIN) => break,
            Err(e) => {
                tracing::warn!("replay receive failed: {e}");
                break;
            }
        };
        let start = match request.as_slice() {
            [_, delimiter, start] if delimiter.is_empty() => {
                <[u8; 8]>::try_from(start.as_slice()).map(u64::from_be_bytes)
            }
            _ => {
                tracing::warn!(frames = request.len(), "Invalid replay request");
                continue;
            }
        };
        let Ok(start) = start else {
            tracing::warn!("Invalid replay request: start seq is not 8 bytes");
            continue;
        };
        served += 1;
        let identity = &request[0];
        for (seq, payload) in sequencer.replay_from(start) {
            reply(router, frames, identity, &seq.to_be_bytes(), payload);
        }
        if *cut > 0 {
            *cut -= 1;
            tracing::info!(
                start,
                left = *cut,
                "replay answer cut before its end marker"
            );
            continue;
        }
        reply(router, frames, identity, &END_SEQ, &[]);
    }
    served
}

fn reply(router: &zmq::Socket, frames: ReplayFrames, identity: &[u8], seq: &[u8], payload: &[u8]) {
    let result = match frames {
        ReplayFrames::Four => router.send_multipart([identity, b"", TOPIC, seq, payload], 0),
        ReplayFrames::Three => router.send_multipart([identity, b"", seq, payload], 0),
    };
    if let Err(e) = result {
        tracing::warn!("replay send failed: {e}");
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config::EventFormat;
    use kvroute_core::event::WorkerFlavor;
    use kvroute_core::wire::{decode_batch, DecoderConfig, SkipReason};

    fn sequencer(faults: FaultConfig, capacity: usize) -> Sequencer {
        Sequencer::new(
            EncodeOptions {
                flavor: WorkerFlavor::Vllm,
                format: EventFormat::Map,
            },
            2,
            faults,
            capacity,
        )
    }

    #[test]
    fn seqs_count_from_zero_and_the_ring_keeps_the_newest_batches() {
        let mut s = sequencer(FaultConfig::default(), 3);
        let seqs: Vec<u64> = (0..5)
            .map(|_| s.publish(1.0, &[KvCacheEvent::AllBlocksCleared]).seq)
            .collect();
        assert_eq!(seqs, [0, 1, 2, 3, 4]);
        let kept: Vec<u64> = s.replay_from(0).map(|(seq, _)| *seq).collect();
        assert_eq!(kept, [2, 3, 4]);
        assert_eq!(s.replay_from(4).count(), 1);
        assert_eq!(s.replay_from(9).count(), 0);
        s.restart();
        assert_eq!((s.next_seq(), s.replay_from(0).count()), (0, 0));
    }

    #[test]
    fn dropped_batches_stay_in_the_ring_and_bad_events_are_skipped_alone() {
        let faults = FaultConfig {
            drop_every: Some(2),
            bad_event_every: Some(3),
            ..FaultConfig::default()
        };
        let mut s = sequencer(faults, 10);
        let events = [
            KvCacheEvent::AllBlocksCleared,
            KvCacheEvent::AllBlocksCleared,
        ];
        let out: Vec<Published> = (0..3).map(|_| s.publish(1.0, &events)).collect();
        assert_eq!(
            out.iter().map(|p| p.live).collect::<Vec<_>>(),
            [true, false, true]
        );
        assert_eq!(s.replay_from(0).count(), 3);
        let batch = decode_batch(&out[2].payload, &DecoderConfig::default()).expect("envelope");
        assert_eq!(batch.dp_rank, 2);
        assert_eq!(batch.decoded().count(), 2);
        let skipped: Vec<(u32, SkipReason)> = batch.skipped().map(|(i, s)| (i, s.reason)).collect();
        assert_eq!(skipped, [(1, SkipReason::InvalidField)]);
        let clean = decode_batch(&out[0].payload, &DecoderConfig::default()).expect("envelope");
        assert_eq!(clean.skipped().count(), 0);
    }

    #[test]
    fn cut_replays_send_their_batches_but_not_their_end_marker() {
        let ctx = zmq::Context::new();
        let router = ctx.socket(zmq::ROUTER).expect("router");
        router.bind("inproc://cut-replay").expect("bind");
        let dealer = ctx.socket(zmq::DEALER).expect("dealer");
        dealer.connect("inproc://cut-replay").expect("connect");
        let mut s = sequencer(FaultConfig::default(), 10);
        for _ in 0..3 {
            s.publish(1.0, &[KvCacheEvent::AllBlocksCleared]);
        }
        let mut cut = 1;
        for _ in 0..2 {
            dealer
                .send_multipart([&b""[..], &1u64.to_be_bytes()[..]], 0)
                .expect("request");
            assert!(matches!(router.poll(zmq::POLLIN, 30_000), Ok(1..)));
            assert_eq!(
                serve_replays_cut(&router, &s, ReplayFrames::Four, &mut cut),
                1
            );
        }
        assert_eq!(cut, 0);
        // One connection keeps order: the first answer's end marker would
        // come before the second answer's batches.
        let mut seqs = Vec::new();
        loop {
            assert!(matches!(dealer.poll(zmq::POLLIN, 30_000), Ok(1..)));
            let frames = dealer.recv_multipart(0).expect("reply");
            let seq: [u8; 8] = frames[2].as_slice().try_into().expect("8 bytes");
            if seq == END_SEQ {
                break;
            }
            seqs.push(u64::from_be_bytes(seq));
        }
        assert_eq!(seqs, [1, 2, 1, 2]);
    }

    #[test]
    fn endpoints_use_a_wildcard_port_for_zero() {
        assert_eq!(
            endpoint("127.0.0.1".parse().expect("ip"), 0),
            "tcp://127.0.0.1:*"
        );
        assert_eq!(
            endpoint("::1".parse().expect("ip"), 5557),
            "tcp://[::1]:5557"
        );
    }
}
