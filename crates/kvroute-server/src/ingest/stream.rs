//! One thread per (worker, rank): subscribe to the engine's events, keep the
//! sequence cursor, replay what was missed, decode, and apply to the index.
//!
//! ZeroMQ sockets are blocking and not `Sync`, so each rank owns an OS thread
//! with its SUB (live events), a DEALER (replay requests, created on demand)
//! and a PAIR reading the SUB's connection monitor. Everything the thread
//! decides comes from the pure core: [`StreamCursor`] says what to apply,
//! replay or clear; [`StreamDecoder`] turns bytes into events. Decoding and
//! index writes therefore never run on the HTTP runtime, and one rank's writes
//! stay in order.

use std::collections::VecDeque;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;
use std::thread::JoinHandle;
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use kvroute_core::cursor::{Action, CursorStats, StreamCursor, MAX_SEQ};
use kvroute_core::index::{SharedIndex, WorkerRank};
use kvroute_core::wire::{DecoderConfig, StreamDecoder};
use tracing::{debug, info, warn};

use super::spec::RankEndpoints;

/// The replay end marker's sequence number (`-1` as 8 big-endian bytes).
const END_SEQ: [u8; 8] = [0xff; 8];

/// Ingestion settings shared by every rank.
#[derive(Debug, Clone)]
pub struct IngestConfig {
    /// How long to wait for the next replay reply before giving up on a replay.
    pub replay_timeout: Duration,
    /// Live batches kept while a replay runs.
    pub max_buffered: usize,
    /// How often the thread wakes to check for shutdown.
    pub poll_interval: Duration,
}

impl Default for IngestConfig {
    fn default() -> Self {
        IngestConfig {
            replay_timeout: Duration::from_secs(2),
            max_buffered: 10_000,
            poll_interval: Duration::from_millis(100),
        }
    }
}

/// Live counters of one rank's stream, read by `/workers` and `/metrics`.
#[derive(Debug, Default)]
pub struct RankStats {
    /// The SUB socket is connected to the engine.
    pub connected: AtomicBool,
    /// Milliseconds since the epoch when the connection was last seen up.
    pub last_connected_ms: AtomicU64,
    /// Last applied sequence number + 1 (0: none yet).
    pub next_seq: AtomicU64,
    /// Milliseconds between a batch's timestamp and its application (last batch).
    pub lag_ms: AtomicU64,
    /// Batches received live.
    pub batches: AtomicU64,
    /// Events applied to the index.
    pub events: AtomicU64,
    /// Events skipped as malformed (bad input).
    pub decode_errors: AtomicU64,
    /// Events skipped on purpose (filters, block size).
    pub events_filtered: AtomicU64,
    /// Batches whose envelope could not be decoded.
    pub envelope_errors: AtomicU64,
    /// Messages that were not `[topic, seq, payload]`.
    pub bad_frames: AtomicU64,
    /// Gaps detected.
    pub gaps: AtomicU64,
    /// Replays asked for on (re)connection.
    pub resyncs: AtomicU64,
    /// Replays that filled their gap.
    pub replays_ok: AtomicU64,
    /// Replays that could not.
    pub replays_incomplete: AtomicU64,
    /// Engine restarts seen.
    pub restarts: AtomicU64,
    /// Times the rank was cleared.
    pub clears: AtomicU64,
    /// Stale batches dropped.
    pub stale: AtomicU64,
}

/// A snapshot of a rank's counters (see [`RankStats`] for their meaning).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, serde::Serialize)]
pub struct RankCounters {
    /// Batches received live.
    pub batches: u64,
    /// Events applied to the index.
    pub events: u64,
    /// Events skipped as malformed.
    pub decode_errors: u64,
    /// Events skipped on purpose.
    pub events_filtered: u64,
    /// Batches whose envelope could not be decoded.
    pub envelope_errors: u64,
    /// Messages that were not `[topic, seq, payload]`.
    pub bad_frames: u64,
    /// Gaps detected.
    pub gaps: u64,
    /// Replays asked for on (re)connection.
    pub resyncs: u64,
    /// Replays that filled their gap.
    pub replays_ok: u64,
    /// Replays that could not.
    pub replays_incomplete: u64,
    /// Engine restarts seen.
    pub restarts: u64,
    /// Times the rank was cleared.
    pub clears: u64,
    /// Stale batches dropped.
    pub stale: u64,
}

impl RankStats {
    /// The counters as they are now.
    pub fn counters(&self) -> RankCounters {
        let get = |c: &AtomicU64| c.load(Ordering::Relaxed);
        RankCounters {
            batches: get(&self.batches),
            events: get(&self.events),
            decode_errors: get(&self.decode_errors),
            events_filtered: get(&self.events_filtered),
            envelope_errors: get(&self.envelope_errors),
            bad_frames: get(&self.bad_frames),
            gaps: get(&self.gaps),
            resyncs: get(&self.resyncs),
            replays_ok: get(&self.replays_ok),
            replays_incomplete: get(&self.replays_incomplete),
            restarts: get(&self.restarts),
            clears: get(&self.clears),
            stale: get(&self.stale),
        }
    }

    fn copy_cursor(&self, s: &CursorStats) {
        self.gaps.store(s.gaps, Ordering::Relaxed);
        self.resyncs.store(s.resyncs, Ordering::Relaxed);
        self.replays_ok.store(s.replays_ok, Ordering::Relaxed);
        self.replays_incomplete
            .store(s.replays_incomplete, Ordering::Relaxed);
        self.restarts.store(s.restarts, Ordering::Relaxed);
        self.clears.store(s.clears, Ordering::Relaxed);
        self.stale.store(s.stale, Ordering::Relaxed);
    }
}

fn now_ms() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| d.as_millis() as u64)
}

/// Which stream a rank thread follows.
#[derive(Debug, Clone, Copy)]
pub struct RankTarget<'a> {
    /// The worker's name (for logs).
    pub worker: &'a str,
    /// The worker's index id and the rank.
    pub key: WorkerRank,
    /// The rank's sockets.
    pub endpoints: &'a RankEndpoints,
    /// ZMQ topic to subscribe to.
    pub topic: &'a str,
    /// The worker's block size.
    pub block_size: u32,
}

/// A running rank thread; dropping it does not stop it, [`RankIngest::stop`] does.
#[derive(Debug)]
pub struct RankIngest {
    /// The rank's counters.
    pub stats: Arc<RankStats>,
    stop: Arc<AtomicBool>,
    thread: Option<JoinHandle<()>>,
}

impl RankIngest {
    /// Starts ingesting one rank into `index` under `key`.
    pub fn start(
        zmq: &zmq::Context,
        target: RankTarget<'_>,
        index: Arc<SharedIndex>,
        config: IngestConfig,
    ) -> std::io::Result<Self> {
        let RankTarget {
            worker: worker_name,
            key,
            endpoints,
            topic,
            block_size,
        } = target;
        let stats = Arc::new(RankStats::default());
        let stop = Arc::new(AtomicBool::new(false));
        let stream = Stream {
            zmq: zmq.clone(),
            worker: worker_name.to_owned(),
            key,
            endpoints: endpoints.clone(),
            topic: topic.to_owned(),
            index,
            stats: stats.clone(),
            stop: stop.clone(),
            config,
            decoder: StreamDecoder::new(DecoderConfig {
                block_size: Some(block_size),
                registered_rank: key.rank,
                ..DecoderConfig::default()
            }),
            cursor: StreamCursor::new(10_000, fingerprint),
            dealer: None,
        };
        let thread = std::thread::Builder::new()
            .name(format!("ingest-{worker_name}-{}", key.rank))
            .spawn(move || stream.run())?;
        Ok(RankIngest {
            stats,
            stop,
            thread: Some(thread),
        })
    }

    /// Asks the thread to stop and waits for it (at most one poll interval).
    pub fn stop(&mut self) {
        self.stop.store(true, Ordering::Relaxed);
        if let Some(thread) = self.thread.take() {
            let _ = thread.join();
        }
    }
}

impl Drop for RankIngest {
    fn drop(&mut self) {
        self.stop();
    }
}

/// The state of one rank's thread.
struct Stream {
    zmq: zmq::Context,
    worker: String,
    key: WorkerRank,
    endpoints: RankEndpoints,
    topic: String,
    index: Arc<SharedIndex>,
    stats: Arc<RankStats>,
    stop: Arc<AtomicBool>,
    config: IngestConfig,
    decoder: StreamDecoder,
    cursor: StreamCursor<Vec<u8>>,
    dealer: Option<zmq::Socket>,
}

/// Socket options that survive real networks: bounded reconnect backoff, TCP
/// keepalive, ZMTP heartbeats to notice a dead peer, and no linger on close.
fn harden(socket: &zmq::Socket) -> zmq::Result<()> {
    socket.set_linger(0)?;
    socket.set_reconnect_ivl(100)?;
    socket.set_reconnect_ivl_max(5_000)?;
    socket.set_tcp_keepalive(1)?;
    socket.set_heartbeat_ivl(5_000)?;
    socket.set_heartbeat_timeout(15_000)?;
    socket.set_heartbeat_ttl(15_000)?;
    Ok(())
}

impl Stream {
    fn run(mut self) {
        if let Err(e) = self.run_inner() {
            warn!(worker = %self.worker, rank = self.key.rank, error = %e, "event stream stopped");
        }
        self.stats.connected.store(false, Ordering::Relaxed);
    }

    fn run_inner(&mut self) -> zmq::Result<()> {
        let sub = self.zmq.socket(zmq::SUB)?;
        harden(&sub)?;
        sub.set_rcvhwm(100_000)?;
        sub.set_subscribe(self.topic.as_bytes())?;
        let monitor_addr = format!(
            "inproc://kvroute-monitor-{}-{}-{}",
            self.key.worker.0,
            self.key.rank,
            now_ms()
        );
        sub.monitor(
            &monitor_addr,
            (zmq::SocketEvent::CONNECTED as i32) | (zmq::SocketEvent::DISCONNECTED as i32),
        )?;
        let monitor = self.zmq.socket(zmq::PAIR)?;
        monitor.connect(&monitor_addr)?;
        sub.connect(&self.endpoints.events)?;
        info!(worker = %self.worker, rank = self.key.rank, endpoint = %self.endpoints.events, "subscribed");
        let poll_ms = self.config.poll_interval.as_millis() as i64;
        let mut actions = VecDeque::new();
        while !self.stop.load(Ordering::Relaxed) {
            let mut items = [
                sub.as_poll_item(zmq::POLLIN),
                monitor.as_poll_item(zmq::POLLIN),
            ];
            zmq::poll(&mut items, poll_ms)?;
            if items[1].is_readable()
                && self.read_monitor(&monitor)?
                && self.endpoints.replay.is_some()
            {
                // Batches published before the engine saw our subscription are
                // only in its ring: fetch them now rather than at the next gap.
                let mut out = Vec::new();
                self.cursor.resync(&mut out);
                actions.extend(out);
                self.run_actions(&mut actions)?;
            }
            if !items[0].is_readable() {
                continue;
            }
            // Drain what is queued, then go back to polling.
            loop {
                let frames = match sub.recv_multipart(zmq::DONTWAIT) {
                    Ok(frames) => frames,
                    Err(zmq::Error::EAGAIN) => break,
                    Err(e) => return Err(e),
                };
                let Some((seq, payload)) = split_live(frames) else {
                    self.stats.bad_frames.fetch_add(1, Ordering::Relaxed);
                    continue;
                };
                self.stats.batches.fetch_add(1, Ordering::Relaxed);
                let mut out = Vec::new();
                self.cursor.live(seq, payload, &mut out);
                actions.extend(out);
                self.run_actions(&mut actions)?;
                if self.stop.load(Ordering::Relaxed) {
                    break;
                }
            }
        }
        Ok(())
    }

    /// Reads connection events; true when the subscription (re)connected.
    fn read_monitor(&self, monitor: &zmq::Socket) -> zmq::Result<bool> {
        let mut connected = false;
        while let Ok(frames) = monitor.recv_multipart(zmq::DONTWAIT) {
            let Some(event) = frames.first().and_then(|f| f.get(..2)) else {
                continue;
            };
            let event = u16::from_le_bytes([event[0], event[1]]);
            if event == zmq::SocketEvent::CONNECTED as u16 {
                self.stats.connected.store(true, Ordering::Relaxed);
                self.stats
                    .last_connected_ms
                    .store(now_ms(), Ordering::Relaxed);
                debug!(worker = %self.worker, rank = self.key.rank, "connected");
                connected = true;
            } else if event == zmq::SocketEvent::DISCONNECTED as u16 {
                self.stats.connected.store(false, Ordering::Relaxed);
                self.stats
                    .last_connected_ms
                    .store(now_ms(), Ordering::Relaxed);
                info!(worker = %self.worker, rank = self.key.rank, "disconnected");
            }
        }
        Ok(connected)
    }

    fn run_actions(&mut self, actions: &mut VecDeque<Action<Vec<u8>>>) -> zmq::Result<()> {
        while let Some(action) = actions.pop_front() {
            let mut more = Vec::new();
            match action {
                Action::Apply { seq, payload } => self.apply(seq, &payload, &mut more),
                Action::Clear(reason) => self.clear(reason),
                Action::Replay { from } => {
                    let complete = self.replay(from, &mut more)?;
                    self.cursor.replay_finished(complete, &mut more);
                }
            }
            actions.extend(more);
            self.stats.copy_cursor(&self.cursor.stats());
            self.stats
                .next_seq
                .store(self.cursor.next_seq().unwrap_or(0), Ordering::Relaxed);
        }
        Ok(())
    }

    fn clear(&mut self, reason: kvroute_core::cursor::ClearReason) {
        warn!(worker = %self.worker, rank = self.key.rank, reason = reason.as_str(), "clearing the rank's blocks");
        self.index.write().clear_rank(self.key);
        self.decoder.reset();
    }

    fn apply(&mut self, seq: u64, payload: &[u8], more: &mut Vec<Action<Vec<u8>>>) {
        match self.decoder.decode(payload) {
            Ok(batch) => {
                if let Some(ts) = batch.ts {
                    let lag = (now_ms() as f64 - ts * 1000.0).max(0.0);
                    self.stats.lag_ms.store(lag as u64, Ordering::Relaxed);
                }
                let key = WorkerRank {
                    worker: self.key.worker,
                    rank: batch.dp_rank,
                };
                let mut applied = 0;
                for event in &batch.events {
                    match &event.outcome {
                        Ok(e) => {
                            self.index.apply(key, e);
                            applied += 1;
                        }
                        Err(skipped) if skipped.reason.is_error() => {
                            self.stats.decode_errors.fetch_add(1, Ordering::Relaxed);
                            warn!(worker = %self.worker, rank = self.key.rank, seq, event = event.index, error = %skipped, "malformed event skipped");
                        }
                        Err(skipped) => {
                            self.stats.events_filtered.fetch_add(1, Ordering::Relaxed);
                            debug!(worker = %self.worker, rank = self.key.rank, seq, event = event.index, reason = %skipped, "event filtered");
                        }
                    }
                }
                self.stats.events.fetch_add(applied, Ordering::Relaxed);
            }
            Err(e) => {
                self.stats.envelope_errors.fetch_add(1, Ordering::Relaxed);
                warn!(worker = %self.worker, rank = self.key.rank, seq, error = %e, "undecodable batch");
                self.cursor.undecodable(seq, more);
            }
        }
    }

    /// Asks the engine's replay socket for every batch from `from` on and
    /// applies each as it arrives. Returns true when the end marker arrived.
    fn replay(&mut self, from: u64, out: &mut Vec<Action<Vec<u8>>>) -> zmq::Result<bool> {
        let Some(endpoint) = self.endpoints.replay.clone() else {
            info!(worker = %self.worker, rank = self.key.rank, from, "gap and no replay endpoint");
            return Ok(false);
        };
        let dealer = match self.dealer.take() {
            Some(dealer) => dealer,
            None => {
                let dealer = self.zmq.socket(zmq::DEALER)?;
                harden(&dealer)?;
                dealer.connect(&endpoint)?;
                dealer
            }
        };
        info!(worker = %self.worker, rank = self.key.rank, from, "requesting replay");
        dealer.send_multipart([&b""[..], &from.to_be_bytes()[..]], 0)?;
        let timeout_ms = self.config.replay_timeout.as_millis() as i64;
        let started = Instant::now();
        let mut replayed = Vec::new();
        let complete = loop {
            if self.stop.load(Ordering::Relaxed) {
                break false;
            }
            let mut items = [dealer.as_poll_item(zmq::POLLIN)];
            zmq::poll(&mut items, timeout_ms)?;
            if !items[0].is_readable() {
                let waited_ms = started.elapsed().as_millis() as u64;
                warn!(worker = %self.worker, rank = self.key.rank, from, waited_ms, "replay timed out");
                break false;
            }
            match split_replay(dealer.recv_multipart(0)?) {
                Some(Replayed::End) => break true,
                Some(Replayed::Batch(seq, payload)) => {
                    self.cursor.replayed(seq, payload, &mut replayed);
                    for action in replayed.drain(..) {
                        match action {
                            Action::Apply { seq, payload } => self.apply(seq, &payload, out),
                            Action::Clear(reason) => self.clear(reason),
                            // The cursor never starts a replay during one.
                            Action::Replay { .. } => {}
                        }
                    }
                }
                None => {
                    self.stats.bad_frames.fetch_add(1, Ordering::Relaxed);
                    break false;
                }
            }
        };
        // After a cut-short replay, late replies must not be read as the next
        // replay's: that socket is dropped and a fresh one made next time.
        if complete {
            self.dealer = Some(dealer);
        }
        Ok(complete)
    }
}

/// A hash of a payload's bytes, to tell a duplicate batch from a new one.
fn fingerprint(payload: &Vec<u8>) -> u64 {
    use std::hash::{Hash, Hasher};
    let mut hasher = std::collections::hash_map::DefaultHasher::new();
    payload.hash(&mut hasher);
    hasher.finish()
}

/// `[topic, seq (8 bytes BE), payload]` → `(seq, payload)`.
/// `[topic, seq, payload]` with a sequence number an engine can publish
/// (at most [`MAX_SEQ`]; `u64::MAX` is the replay's end marker).
fn split_live(mut frames: Vec<Vec<u8>>) -> Option<(u64, Vec<u8>)> {
    if frames.len() != 3 {
        return None;
    }
    let payload = frames.pop()?;
    let seq = <[u8; 8]>::try_from(frames.pop()?.as_slice()).ok()?;
    let seq = u64::from_be_bytes(seq);
    (seq <= MAX_SEQ).then_some((seq, payload))
}

enum Replayed {
    Batch(u64, Vec<u8>),
    End,
}

/// A replay reply after the DEALER's empty delimiter: `[topic, seq, payload]`
/// (vLLM ≥ 0.26, SGLang ≥ 0.5.22) or `[seq, payload]` (older); seq −1 ends it.
fn split_replay(mut frames: Vec<Vec<u8>>) -> Option<Replayed> {
    if frames.first().map(Vec::len) != Some(0) || !(3..=4).contains(&frames.len()) {
        return None;
    }
    let payload = frames.pop()?;
    let seq = <[u8; 8]>::try_from(frames.pop()?.as_slice()).ok()?;
    if seq == END_SEQ {
        return Some(Replayed::End);
    }
    Some(Replayed::Batch(u64::from_be_bytes(seq), payload))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn live_frames_need_three_parts_and_an_eight_byte_seq() {
        assert_eq!(
            split_live(vec![vec![], 7u64.to_be_bytes().to_vec(), vec![1]]),
            Some((7, vec![1]))
        );
        assert_eq!(split_live(vec![vec![], vec![1, 2], vec![1]]), None);
        assert_eq!(split_live(vec![vec![], vec![0xff; 8], vec![1]]), None);
        assert_eq!(split_live(vec![vec![], 7u64.to_be_bytes().to_vec()]), None);
    }

    #[test]
    fn replay_replies_are_read_in_both_layouts() {
        let seq = 5u64.to_be_bytes().to_vec();
        assert!(matches!(
            split_replay(vec![vec![], b"t".to_vec(), seq.clone(), vec![9]]),
            Some(Replayed::Batch(5, _))
        ));
        assert!(matches!(
            split_replay(vec![vec![], seq, vec![9]]),
            Some(Replayed::Batch(5, _))
        ));
        assert!(matches!(
            split_replay(vec![vec![], vec![], END_SEQ.to_vec(), vec![]]),
            Some(Replayed::End)
        ));
        assert!(matches!(
            split_replay(vec![vec![], END_SEQ.to_vec(), vec![]]),
            Some(Replayed::End)
        ));
        assert!(split_replay(vec![vec![1], END_SEQ.to_vec(), vec![]]).is_none());
    }
}
