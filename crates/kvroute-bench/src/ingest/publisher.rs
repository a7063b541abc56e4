//! One publisher process of `kvroute bench ingest` (the hidden
//! `kvroute bench-publisher`): many engine ranks served by one thread.
//!
//! Each rank speaks the engines' wire format through the mocker's own code:
//! a PUB socket sending `[topic, seq (8 bytes BE), msgpack batch]`
//! ([`send_live`]), batches encoded and kept for replay by a [`Sequencer`],
//! and a ROUTER answering `[identity, "", start seq]` with the retained
//! batches and the end marker ([`serve_replays`], the current engines'
//! four-frame layout). One thread owns every socket; idle, it blocks in
//! `zmq::poll` over the ROUTERs and its stdin, so quiet ranks cost nothing.
//!
//! The parent drives it through lines on stdin and stdout:
//! * the child prints `ready RANKS` once every socket is bound;
//! * `flood MILLIS`: every rank publishes batches round-robin as fast as the
//!   thread can for that long (replays are answered between rounds); the
//!   child answers `flooded BATCHES STORED_BLOCKS REMOVED_BLOCKS REPLAYS`;
//! * `quit`, or the end of stdin, ends the process.

use std::collections::VecDeque;
use std::io::{BufRead, Write};
use std::os::fd::AsRawFd;
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use kvroute_core::event::WorkerFlavor;
use kvroute_core::rng::SplitMix64;
use kvroute_mocker::config::{EventFormat, ReplayFrames};
use kvroute_mocker::encode::EncodeOptions;
use kvroute_mocker::event::{BlockRemoved, BlockStored, KvCacheEvent, MEDIUM_GPU};
use kvroute_mocker::faults::FaultConfig;
use kvroute_mocker::publisher::{send_live, serve_replays, Sequencer};

use crate::error::{Error, Result};

/// At most this many ranks per publisher: each takes two sockets, and a
/// ZeroMQ context holds at most 1 023 by default.
pub const MAX_RANKS_PER_PUBLISHER: u32 = 500;
/// Send high-water mark of each PUB socket (both engines').
const PUB_HWM: i32 = 100_000;
/// Batches whose blocks a rank keeps before the removal event drops them,
/// so the index stays at a steady size during a flood.
const KEEP_BATCHES: usize = 4;
/// Longest idle wait in `zmq::poll` (ms); stdin and replay requests wake it.
const IDLE_POLL_MS: i64 = 60_000;

/// What one publisher process serves and publishes.
#[derive(Debug, Clone)]
pub struct PublisherConfig {
    /// `(events base port, replay base port)` of each worker it serves; rank
    /// r of a worker binds base + r on 127.0.0.1.
    pub workers: Vec<(u16, u16)>,
    /// Ranks per worker.
    pub dp: u32,
    /// Stored events per batch.
    pub events_per_batch: u32,
    /// Blocks per stored event.
    pub blocks_per_event: u32,
    /// Tokens per block.
    pub block_size: u32,
    /// Batches each rank keeps for replay.
    pub replay_buffer: usize,
    /// Seed of the hashes and tokens.
    pub seed: u64,
}

/// What a flood published, summed over the process's ranks.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct FloodCounts {
    /// Batches sent.
    pub batches: u64,
    /// Blocks in stored events.
    pub stored_blocks: u64,
    /// Blocks in removal events.
    pub removed_blocks: u64,
    /// Replay requests answered meanwhile.
    pub replays: u64,
}

/// One engine rank: its two sockets, its ring and its block generator.
struct Rank {
    publisher: zmq::Socket,
    router: zmq::Socket,
    sequencer: Sequencer,
    rng: SplitMix64,
    /// The block hashes of the last batches, oldest first.
    held: VecDeque<Vec<u64>>,
}

impl Rank {
    /// The next batch: `events` stored events of `blocks` random blocks, and
    /// the removal of the blocks stored [`KEEP_BATCHES`] batches ago.
    fn next_batch(&mut self, c: &PublisherConfig) -> (Vec<KvCacheEvent>, u64, u64) {
        let mut events = Vec::with_capacity(c.events_per_batch as usize + 1);
        let mut stored = Vec::new();
        for _ in 0..c.events_per_batch {
            let hashes: Vec<u64> = (0..c.blocks_per_event)
                .map(|_| self.rng.next_u64() >> 1)
                .collect();
            let tokens = u64::from(c.blocks_per_event) * u64::from(c.block_size);
            let token_ids = (0..tokens)
                .map(|_| self.rng.below(150_000) as u64)
                .collect();
            stored.extend_from_slice(&hashes);
            events.push(KvCacheEvent::BlockStored(BlockStored {
                block_hashes: hashes,
                parent_block_hash: None,
                token_ids,
                block_size: c.block_size,
                lora_id: None,
                medium: Some(MEDIUM_GPU.to_owned()),
                lora_name: None,
                extra_keys: None,
                cache_salt: None,
                session_id: None,
                trtllm_images: None,
            }));
        }
        let stored_blocks = stored.len() as u64;
        self.held.push_back(stored);
        let mut removed_blocks = 0;
        if self.held.len() > KEEP_BATCHES {
            if let Some(gone) = self.held.pop_front() {
                removed_blocks = gone.len() as u64;
                events.push(KvCacheEvent::BlockRemoved(BlockRemoved {
                    block_hashes: gone,
                    medium: Some(MEDIUM_GPU.to_owned()),
                }));
            }
        }
        (events, stored_blocks, removed_blocks)
    }
}

/// A socket of `kind` bound to `tcp://127.0.0.1:port`.
fn bind(ctx: &zmq::Context, kind: zmq::SocketType, port: u16, hwm: i32) -> Result<zmq::Socket> {
    let endpoint = format!("tcp://127.0.0.1:{port}");
    let fail = |e: zmq::Error| Error::Unexpected(format!("binding {endpoint}: {e}"));
    let socket = ctx.socket(kind).map_err(fail)?;
    socket.set_linger(0).map_err(fail)?;
    socket.set_sndhwm(hwm).map_err(fail)?;
    socket.bind(&endpoint).map_err(fail)?;
    Ok(socket)
}

/// Binds every rank's PUB and ROUTER.
fn bind_ranks(ctx: &zmq::Context, c: &PublisherConfig) -> Result<Vec<Rank>> {
    let replay_hwm = i32::try_from(2 * (c.replay_buffer + 1)).unwrap_or(i32::MAX);
    let options = EncodeOptions {
        flavor: WorkerFlavor::Vllm,
        format: EventFormat::Map,
    };
    let mut ranks = Vec::new();
    for (w, &(events, replay)) in c.workers.iter().enumerate() {
        for r in 0..c.dp {
            let port = |base: u16| {
                u16::try_from(u32::from(base) + r)
                    .map_err(|_| Error::Invalid(format!("port {base} + {r} is above 65535")))
            };
            ranks.push(Rank {
                publisher: bind(ctx, zmq::PUB, port(events)?, PUB_HWM)?,
                router: bind(ctx, zmq::ROUTER, port(replay)?, replay_hwm)?,
                sequencer: Sequencer::new(options, r, FaultConfig::default(), c.replay_buffer),
                rng: SplitMix64::new(c.seed ^ (((w as u64) << 32) | u64::from(r))),
                held: VecDeque::new(),
            });
        }
    }
    Ok(ranks)
}

/// Raises the soft open-file limit to the hard one (each rank takes a
/// listening descriptor per socket and one per connection).
fn raise_fd_limit() {
    if let Err(e) = rlimit::increase_nofile_limit(u64::MAX) {
        tracing::warn!("cannot raise the open-file limit: {e}");
    }
}

/// Wall-clock seconds, the batches' `ts`.
fn now_ts() -> f64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0.0, |d| d.as_secs_f64())
}

/// Answers the replay requests waiting on any rank's ROUTER, waiting up to
/// `timeout_ms` for one (or for `extra_fd` to become readable). Returns the
/// requests answered and whether `extra_fd` is readable.
fn serve_ready(ranks: &[Rank], extra_fd: Option<i32>, timeout_ms: i64) -> Result<(u64, bool)> {
    let mut items: Vec<zmq::PollItem> = ranks
        .iter()
        .map(|r| r.router.as_poll_item(zmq::POLLIN))
        .collect();
    if let Some(fd) = extra_fd {
        items.push(zmq::PollItem::from_fd(fd, zmq::POLLIN));
    }
    zmq::poll(&mut items, timeout_ms).map_err(|e| Error::Unexpected(format!("zmq_poll: {e}")))?;
    let readable: Vec<bool> = items.iter().map(zmq::PollItem::is_readable).collect();
    drop(items);
    let mut served = 0;
    for (rank, _) in ranks.iter().zip(&readable).filter(|(_, &r)| r) {
        served += serve_replays(&rank.router, &rank.sequencer, ReplayFrames::Four);
    }
    let extra = extra_fd.is_some() && readable.last().copied().unwrap_or(false);
    Ok((served, extra))
}

/// Every rank publishes round-robin until `duration` is up, at most
/// `batches_per_sec` batches a second in all (0: as fast as possible).
fn flood(
    ranks: &mut [Rank],
    c: &PublisherConfig,
    duration: Duration,
    batches_per_sec: u64,
) -> Result<FloodCounts> {
    let start = Instant::now();
    let until = start + duration;
    let mut counts = FloodCounts::default();
    while Instant::now() < until {
        if batches_per_sec > 0 {
            let due = Duration::from_secs_f64(counts.batches as f64 / batches_per_sec as f64);
            if let Some(ahead) = due.checked_sub(start.elapsed()) {
                std::thread::sleep(ahead.min(Duration::from_millis(50)));
                counts.replays += serve_ready(ranks, None, 0)?.0;
                continue;
            }
        }
        let ts = now_ts();
        for rank in ranks.iter_mut() {
            let (events, stored, removed) = rank.next_batch(c);
            let published = rank.sequencer.publish(ts, &events);
            // A PUB never blocks: a subscriber that is behind loses the
            // batch (the router sees a gap and replays it).
            let _ = send_live(&rank.publisher, &published, zmq::DONTWAIT);
            counts.batches += 1;
            counts.stored_blocks += stored;
            counts.removed_blocks += removed;
        }
        counts.replays += serve_ready(ranks, None, 0)?.0;
    }
    Ok(counts)
}

/// Runs a publisher process: binds, says `ready`, then obeys stdin.
pub fn run(c: &PublisherConfig) -> Result<()> {
    raise_fd_limit();
    let ctx = zmq::Context::new();
    let mut ranks = bind_ranks(&ctx, c)?;
    let mut out = std::io::stdout().lock();
    let say = |out: &mut std::io::StdoutLock, line: String| {
        writeln!(out, "{line}")
            .and_then(|()| out.flush())
            .map_err(Error::io("writing to the parent"))
    };
    say(&mut out, format!("ready {}", ranks.len()))?;
    let stdin = std::io::stdin();
    let fd = stdin.as_raw_fd();
    let mut line = String::new();
    loop {
        let (_, command) = serve_ready(&ranks, Some(fd), IDLE_POLL_MS)?;
        if !command {
            continue;
        }
        line.clear();
        let n = stdin
            .lock()
            .read_line(&mut line)
            .map_err(Error::io("reading the parent's command"))?;
        let words: Vec<&str> = line.split_whitespace().collect();
        match words.as_slice() {
            [] if n == 0 => return Ok(()),
            ["quit"] => return Ok(()),
            ["flood", ms, rate] => {
                let ms: u64 = ms
                    .parse()
                    .map_err(|_| Error::Invalid(format!("bad flood duration {ms:?}")))?;
                let rate: u64 = rate
                    .parse()
                    .map_err(|_| Error::Invalid(format!("bad flood rate {rate:?}")))?;
                let f = flood(&mut ranks, c, Duration::from_millis(ms), rate)?;
                let (b, s, r, p) = (f.batches, f.stored_blocks, f.removed_blocks, f.replays);
                say(&mut out, format!("flooded {b} {s} {r} {p}"))?;
            }
            _ => return Err(Error::Invalid(format!("unknown command {line:?}"))),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use kvroute_core::wire::{decode_batch, DecoderConfig};

    fn config(events: u16, replay: u16) -> PublisherConfig {
        PublisherConfig {
            workers: vec![(events, replay)],
            dp: 2,
            events_per_batch: 2,
            blocks_per_event: 3,
            block_size: 4,
            replay_buffer: 8,
            seed: 5,
        }
    }

    /// Four free ports from `start` (each test its own range).
    fn free_port_block(start: u16) -> u16 {
        super::super::ports::allocate(1, 2, start)
            .expect("free ports")
            .first()
            .expect("one worker")
            .0
    }

    #[test]
    fn batches_keep_the_index_steady_and_count_their_blocks() {
        let ctx = zmq::Context::new();
        let base = free_port_block(24_000);
        let c = config(base, base + 2);
        let mut ranks = bind_ranks(&ctx, &c).expect("binds");
        assert_eq!(ranks.len(), 2);
        let ops: Vec<(u64, u64)> = (0..6)
            .map(|_| {
                let (_, s, r) = ranks[0].next_batch(&c);
                (s, r)
            })
            .collect();
        assert_eq!(ops, [(6, 0), (6, 0), (6, 0), (6, 0), (6, 6), (6, 6)]);
    }

    #[test]
    fn a_subscriber_receives_live_batches_and_a_replay_ends_with_the_marker() {
        let ctx = zmq::Context::new();
        let base = free_port_block(24_100);
        let c = config(base, base + 2);
        let mut ranks = bind_ranks(&ctx, &c).expect("binds");
        let sub = ctx.socket(zmq::SUB).expect("sub");
        sub.set_subscribe(b"").expect("subscribe");
        sub.connect(&format!("tcp://127.0.0.1:{}", base + 1))
            .expect("connect");
        std::thread::sleep(Duration::from_millis(300));
        let counts = flood(&mut ranks[1..], &c, Duration::from_millis(50), 0).expect("floods");
        assert!(counts.batches > 0 && counts.stored_blocks == counts.batches * 6);
        let frames = sub.recv_multipart(0).expect("a live batch");
        assert_eq!(frames.len(), 3);
        let first_seq = u64::from_be_bytes(frames[1].as_slice().try_into().expect("8 bytes"));
        let batch = decode_batch(&frames[2], &DecoderConfig::default()).expect("decodes");
        assert_eq!(batch.dp_rank, 1);
        assert_eq!(batch.decoded().count(), 2);

        let dealer = ctx.socket(zmq::DEALER).expect("dealer");
        dealer
            .connect(&format!("tcp://127.0.0.1:{}", base + 3))
            .expect("connect");
        let last = counts.batches - 1;
        dealer
            .send_multipart([&b""[..], &(last - 1).to_be_bytes()], 0)
            .expect("request");
        let mut answered = 0;
        while answered == 0 {
            answered = serve_ready(&ranks, None, 1_000).expect("polls").0;
        }
        let mut seqs = Vec::new();
        loop {
            let reply = dealer.recv_multipart(0).expect("reply");
            assert_eq!(reply.len(), 4, "[\"\", topic, seq, payload]");
            if reply[2] == [0xff; 8] {
                assert!(reply[3].is_empty());
                break;
            }
            seqs.push(u64::from_be_bytes(
                reply[2].as_slice().try_into().expect("8"),
            ));
        }
        assert_eq!(seqs, [last - 1, last]);
        assert!(first_seq <= last);
    }
}
