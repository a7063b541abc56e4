//! The oracle over real engines, which have no `/internal/cache_match`:
//! each engine's cache as the engine's own KV events tell it.
//!
//! One thread per engine subscribes to the engine's event stream, reads its
//! whole history from the replay socket first (and again over any gap in
//! the sequence numbers), and keeps the blocks the engine stored and has
//! not removed, by the engine's own hashes and tokens: each block under its
//! parent's hash and its token ids. A request (a token-id prompt) goes to
//! the engine whose blocks hold its longest prefix, ties to the fewest
//! requests in flight from this run, then a seeded coin — the mock oracle's
//! rule (`oracle::choose`). It shares only the wire decoder with
//! kvroute's router; its blocks are its own, not the router's index. It is
//! as late as the events are: a block stored a few milliseconds ago may not
//! be known yet.

use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{mpsc, Arc, Mutex};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use kvroute_core::event::{KvEvent, Tier};
use kvroute_core::rng::SplitMix64;
use kvroute_core::wire::{decode_batch, DecoderConfig};
use serde_json::Value;

use crate::driver::lock;
use crate::error::{Error, Result};
use crate::exchange::{exchange, Failure, Measured};
use crate::workload::PlannedRequest;

/// How long the first replay of an engine's history may take.
const FIRST_REPLAY: Duration = Duration::from_secs(20);
/// How long one replay message may take to arrive.
const REPLAY_WAIT_MS: i64 = 2_000;
/// How often a tracker looks at its stop flag while no event arrives.
const POLL_MS: i64 = 100;

/// An engine the oracle routes to: its HTTP base URL and its KV-event
/// publisher and replay socket (`tcp://host:port`).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct EventSource {
    /// The engine's base URL.
    pub url: String,
    /// Its ZeroMQ event publisher.
    pub events: String,
    /// Its ZeroMQ replay socket.
    pub replay: String,
}

/// The blocks one engine holds, by its events.
#[derive(Debug, Default)]
pub(crate) struct Blocks {
    /// Each block's parent and tokens, by the engine's hash.
    by_hash: HashMap<u64, (Option<u64>, Vec<u32>)>,
    /// Each block's hash, by its parent and tokens.
    by_link: HashMap<(Option<u64>, Vec<u32>), u64>,
    /// The block size the events declared.
    block_size: usize,
}

impl Blocks {
    /// Applies one decoded event.
    pub(crate) fn apply(&mut self, event: &KvEvent) {
        match event {
            KvEvent::Stored(s) if s.tier == Tier::Device => {
                let size = s.block_size as usize;
                let Some(tokens) = &s.token_ids else {
                    return;
                };
                if size == 0 {
                    return;
                }
                self.block_size = size;
                let mut parent = s.parent.map(|p| p.0);
                for (block, chunk) in s.blocks.iter().zip(tokens.chunks_exact(size)) {
                    let hash = block.external.0;
                    self.by_link.insert((parent, chunk.to_vec()), hash);
                    self.by_hash.insert(hash, (parent, chunk.to_vec()));
                    parent = Some(hash);
                }
            }
            KvEvent::Stored(_) => {}
            KvEvent::Removed(r) => {
                if r.tier != Tier::Device {
                    return;
                }
                for hash in &r.blocks {
                    if let Some(link) = self.by_hash.remove(&hash.0) {
                        self.by_link.remove(&link);
                    }
                }
            }
            KvEvent::Cleared => {
                self.by_hash.clear();
                self.by_link.clear();
            }
            // A hybrid model's window and state groups cap what its full
            // attention blocks give; the oracle follows full attention only.
            KvEvent::Group(_) => {}
        }
    }

    /// Tokens of `prompt`'s longest prefix of whole blocks held here.
    pub(crate) fn matched(&self, prompt: &[u32]) -> u64 {
        if self.block_size == 0 {
            return 0;
        }
        let mut parent = None;
        let mut matched = 0;
        for chunk in prompt.chunks_exact(self.block_size) {
            match self.by_link.get(&(parent, chunk.to_vec())) {
                Some(&hash) => {
                    parent = Some(hash);
                    matched += self.block_size as u64;
                }
                None => break,
            }
        }
        matched
    }
}

/// The oracle: one tracker per engine, and the picks in flight.
#[derive(Debug)]
pub(crate) struct EventOracle {
    engines: Vec<EventSource>,
    blocks: Vec<Arc<Mutex<Blocks>>>,
    stop: Arc<AtomicBool>,
    trackers: Vec<JoinHandle<()>>,
    in_flight: Mutex<HashMap<usize, usize>>,
    rng: Mutex<SplitMix64>,
}

impl EventOracle {
    /// Subscribes to every engine and reads its history; returns once each
    /// tracker is up to date with its replay.
    pub(crate) fn start(engines: Vec<EventSource>, seed: u64) -> Result<EventOracle> {
        let stop = Arc::new(AtomicBool::new(false));
        let context = zmq::Context::new();
        let mut blocks = Vec::new();
        let mut trackers = Vec::new();
        let mut ready = Vec::new();
        for engine in &engines {
            let held = Arc::new(Mutex::new(Blocks::default()));
            let (tx, rx) = mpsc::channel();
            let tracker = Tracker {
                engine: engine.clone(),
                blocks: held.clone(),
                stop: stop.clone(),
                context: context.clone(),
            };
            trackers.push(std::thread::spawn(move || tracker.run(tx)));
            blocks.push(held);
            ready.push((engine.events.clone(), rx));
        }
        let oracle = EventOracle {
            engines,
            blocks,
            stop,
            trackers,
            in_flight: Mutex::new(HashMap::new()),
            rng: Mutex::new(SplitMix64::new(seed ^ 0x0AC1E)),
        };
        for (events, rx) in ready {
            match rx.recv_timeout(FIRST_REPLAY) {
                Ok(Ok(())) => {}
                Ok(Err(e)) => {
                    return Err(Error::Unexpected(format!("the oracle on {events}: {e}")))
                }
                Err(_) => {
                    return Err(Error::Unexpected(format!(
                        "the oracle on {events}: no replay of the engine's history within {} s",
                        FIRST_REPLAY.as_secs()
                    )))
                }
            }
        }
        Ok(oracle)
    }

    /// Picks the engine for `planned`, sends it there and measures it.
    pub(crate) async fn send(
        &self,
        client: &reqwest::Client,
        planned: &PlannedRequest,
        scheduled: Instant,
    ) -> Result<Measured, Failure> {
        let pick = self.pick(planned);
        let _in_flight = InFlight { oracle: self, pick };
        let url = format!("{}{}", self.engines[pick].url, planned.path);
        exchange(client, &url, &planned.body, None, scheduled).await
    }

    /// The engine holding the longest prefix of `planned`'s token-id
    /// prompt (a text prompt matches nothing: the oracle has no tokenizer).
    fn pick(&self, planned: &PlannedRequest) -> usize {
        let prompt: Vec<u32> = planned.body["prompt"]
            .as_array()
            .map(|ids| {
                ids.iter()
                    .filter_map(Value::as_u64)
                    .map(|t| t as u32)
                    .collect()
            })
            .unwrap_or_default();
        let candidates: Vec<(usize, u32, u64)> = self
            .blocks
            .iter()
            .enumerate()
            .map(|(i, b)| (i, 0, lock(b).matched(&prompt)))
            .collect();
        let mut in_flight = lock(&self.in_flight);
        let load = |w: usize, _: u32| in_flight.get(&w).copied().unwrap_or(0);
        let pick =
            crate::oracle::choose(&candidates, load, &mut lock(&self.rng)).map_or(0, |(w, _)| w);
        *in_flight.entry(pick).or_insert(0) += 1;
        pick
    }
}

impl Drop for EventOracle {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::Relaxed);
        for tracker in self.trackers.drain(..) {
            let _ = tracker.join();
        }
    }
}

/// One request the oracle sent to an engine; uncounted when dropped.
struct InFlight<'a> {
    oracle: &'a EventOracle,
    pick: usize,
}

impl Drop for InFlight<'_> {
    fn drop(&mut self) {
        if let Some(n) = lock(&self.oracle.in_flight).get_mut(&self.pick) {
            *n = n.saturating_sub(1);
        }
    }
}

/// One engine's subscription.
struct Tracker {
    engine: EventSource,
    blocks: Arc<Mutex<Blocks>>,
    stop: Arc<AtomicBool>,
    context: zmq::Context,
}

impl Tracker {
    /// Subscribes, replays the history (then says so on `ready`), and
    /// applies live batches until stopped, replaying over any gap.
    fn run(self, ready: mpsc::Sender<std::result::Result<(), String>>) {
        let sockets = (|| -> std::result::Result<(zmq::Socket, zmq::Socket), zmq::Error> {
            let sub = self.context.socket(zmq::SUB)?;
            sub.set_linger(0)?;
            sub.set_subscribe(b"")?;
            sub.connect(&self.engine.events)?;
            let dealer = self.context.socket(zmq::DEALER)?;
            dealer.set_linger(0)?;
            dealer.connect(&self.engine.replay)?;
            Ok((sub, dealer))
        })();
        let (sub, dealer) = match sockets {
            Ok(s) => s,
            Err(e) => {
                let _ = ready.send(Err(e.to_string()));
                return;
            }
        };
        let mut last = match self.replay(&dealer, 0, None) {
            Ok(last) => last,
            Err(e) => {
                let _ = ready.send(Err(e));
                return;
            }
        };
        let _ = ready.send(Ok(()));
        while !self.stop.load(Ordering::Relaxed) {
            if !matches!(sub.poll(zmq::POLLIN, POLL_MS), Ok(n) if n > 0) {
                continue;
            }
            let Ok(frames) = sub.recv_multipart(zmq::DONTWAIT) else {
                continue;
            };
            let Some((seq, payload)) = live_frames(&frames) else {
                continue;
            };
            if last.is_some_and(|l| seq <= l) {
                continue;
            }
            if last.map_or(seq > 0, |l| seq > l + 1) {
                // A gap: what it missed, from the replay, up to this batch.
                if let Err(e) = self.replay(&dealer, last.map_or(0, |l| l + 1), Some(seq)) {
                    tracing::warn!(engine = %self.engine.url, error = %e, "oracle replay failed");
                }
            }
            self.apply(payload);
            last = Some(seq);
        }
    }

    /// Applies the replayed batches from `from` (below `until`, when given);
    /// returns the last sequence number applied.
    fn replay(
        &self,
        dealer: &zmq::Socket,
        from: u64,
        until: Option<u64>,
    ) -> std::result::Result<Option<u64>, String> {
        let ask = |from: u64| {
            let start = from.to_be_bytes();
            dealer
                .send_multipart([&b""[..], &start[..]], 0)
                .map_err(|e| e.to_string())
        };
        ask(from)?;
        let mut last: Option<u64> = None;
        let mut asked_after = None;
        loop {
            match dealer.poll(zmq::POLLIN, REPLAY_WAIT_MS) {
                Ok(n) if n > 0 => {}
                _ if last.is_some() && last != asked_after => {
                    // vLLM's replay socket drops what a slow reader has not
                    // taken past 1,000 queued messages, its end marker
                    // too: ask for the rest.
                    asked_after = last;
                    ask(last.map_or(from, |l| l + 1))?;
                    continue;
                }
                _ => return Err(format!("no replay answer from {}", self.engine.replay)),
            }
            let frames = dealer.recv_multipart(0).map_err(|e| e.to_string())?;
            let [.., seq, payload] = frames.as_slice() else {
                return Err("a replay message of fewer than two frames".into());
            };
            let seq = i64::from_be_bytes(
                seq.as_slice()
                    .try_into()
                    .map_err(|_| "a bad sequence frame")?,
            );
            let Ok(seq) = u64::try_from(seq) else {
                return Ok(last); // -1: the end.
            };
            if until.is_none_or(|u| seq < u) && last.is_none_or(|l| seq > l) {
                self.apply(payload);
                last = Some(seq);
            }
        }
    }

    fn apply(&self, payload: &[u8]) {
        let config = DecoderConfig {
            keep_tokens: true,
            ..DecoderConfig::default()
        };
        let Ok(batch) = decode_batch(payload, &config) else {
            return;
        };
        let mut blocks = lock(&self.blocks);
        for event in batch.decoded() {
            blocks.apply(event);
        }
    }
}

/// A live message's sequence number and payload: `[topic, seq, payload]`.
fn live_frames(frames: &[Vec<u8>]) -> Option<(u64, &[u8])> {
    let [.., seq, payload] = frames else {
        return None;
    };
    let seq = u64::from_be_bytes(seq.as_slice().try_into().ok()?);
    Some((seq, payload))
}

#[cfg(test)]
mod tests {
    use super::*;
    use kvroute_core::event::{ExternalHash, Removed, Stored, StoredBlock};
    use kvroute_core::hash::LocalBlockHash;

    fn stored(parent: Option<u64>, hashes: &[u64], tokens: Vec<u32>) -> KvEvent {
        let blocks = hashes
            .iter()
            .map(|&h| StoredBlock {
                external: ExternalHash(h),
                local: LocalBlockHash(h),
            })
            .collect();
        let mut s = Stored::plain(parent.map(ExternalHash), blocks, Tier::Device, 2);
        s.token_ids = Some(tokens);
        KvEvent::Stored(s)
    }

    #[test]
    fn blocks_match_prefixes_by_parent_and_tokens_until_removed_or_cleared() {
        let mut b = Blocks::default();
        b.apply(&stored(None, &[10, 11], vec![1, 2, 3, 4]));
        b.apply(&stored(Some(11), &[12], vec![5, 6]));
        b.apply(&stored(None, &[20], vec![7, 8]));
        assert_eq!(b.matched(&[1, 2, 3, 4, 5, 6, 9]), 6);
        assert_eq!(
            b.matched(&[1, 2, 5, 6]),
            2,
            "the same tokens under another parent"
        );
        assert_eq!(b.matched(&[7, 8, 3, 4]), 2);
        b.apply(&KvEvent::Removed(Removed {
            blocks: vec![ExternalHash(11)],
            tier: Tier::Device,
        }));
        assert_eq!(
            b.matched(&[1, 2, 3, 4, 5, 6]),
            2,
            "the chain ends where a block went"
        );
        b.apply(&KvEvent::Cleared);
        assert_eq!(b.matched(&[1, 2, 3, 4]), 0);
    }
}
