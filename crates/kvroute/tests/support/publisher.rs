//! An engine rank's KV event stream played by the test: a live ZeroMQ PUB
//! socket and a replay ROUTER serving a ring of the batches published, and
//! the vLLM msgpack events they carry.

use std::collections::VecDeque;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::thread::JoinHandle;

use kvroute_core::index::DpRank;
use kvroute_core::wire::write as mp;
use kvroute_server::ingest::spec::RankEndpoints;

/// Appends a vLLM `BlockStored` event to `out`: `hashes` (the engine's
/// names of the blocks) of `tokens`, chained to `parent`, of `block_size`
/// tokens each.
pub fn stored(
    out: &mut Vec<u8>,
    hashes: &[u64],
    parent: Option<u64>,
    tokens: &[u32],
    block_size: usize,
) {
    mp::map(out, 5);
    mp::str(out, "type");
    mp::str(out, "BlockStored");
    mp::str(out, "block_hashes");
    mp::array(out, hashes.len());
    for &h in hashes {
        mp::uint64(out, h);
    }
    mp::str(out, "parent_block_hash");
    match parent {
        Some(p) => mp::uint64(out, p),
        None => out.push(0xc0),
    }
    mp::str(out, "token_ids");
    mp::array(out, tokens.len());
    for &t in tokens {
        mp::uint64(out, u64::from(t));
    }
    mp::str(out, "block_size");
    mp::uint64(out, block_size as u64);
}

/// A vLLM event batch of `events` (each already encoded) from DP rank `rank`.
pub fn batch(events: &[Vec<u8>], rank: u64) -> Vec<u8> {
    let mut out = vec![0x93, 0xcb];
    out.extend_from_slice(&1.5f64.to_be_bytes());
    mp::array(&mut out, events.len());
    for e in events {
        out.extend_from_slice(e);
    }
    mp::uint64(&mut out, rank);
    out
}

/// Appends a vLLM `BlockRemoved` event of `hashes` to `out`.
pub fn removed(out: &mut Vec<u8>, hashes: &[u64]) {
    mp::map(out, 2);
    mp::str(out, "type");
    mp::str(out, "BlockRemoved");
    mp::str(out, "block_hashes");
    mp::array(out, hashes.len());
    for &h in hashes {
        mp::uint64(out, h);
    }
}

/// The replay ring: `(seq, payload)`, oldest first.
pub type Ring = Arc<Mutex<VecDeque<(u64, Vec<u8>)>>>;

/// A fake engine rank: live PUB and a replay ROUTER serving its ring.
pub struct Publisher {
    publisher: zmq::Socket,
    /// The live PUB socket's endpoint.
    pub events: String,
    /// The replay ROUTER socket's endpoint.
    pub replay: String,
    ring: Ring,
    stop: Arc<AtomicBool>,
    router: Option<JoinHandle<()>>,
}

impl Publisher {
    /// Binds both sockets on 127.0.0.1 (replies in `frames`-frame layout, 3
    /// or 4; the ring is trimmed by [`Publisher::publish`]).
    pub fn start(ctx: &zmq::Context, frames: usize, ring_size: usize) -> Publisher {
        let publisher = ctx.socket(zmq::PUB).expect("pub");
        publisher.bind("tcp://127.0.0.1:*").expect("bind pub");
        let events = publisher
            .get_last_endpoint()
            .expect("endpoint")
            .expect("utf-8");
        let router = ctx.socket(zmq::ROUTER).expect("router");
        router.bind("tcp://127.0.0.1:*").expect("bind router");
        let replay = router
            .get_last_endpoint()
            .expect("endpoint")
            .expect("utf-8");
        let ring: Ring = Arc::new(Mutex::new(VecDeque::new()));
        let stop = Arc::new(AtomicBool::new(false));
        let thread = {
            let ring = ring.clone();
            let stop = stop.clone();
            std::thread::spawn(move || {
                let _ = ring_size;
                while !stop.load(Ordering::Relaxed) {
                    let mut items = [router.as_poll_item(zmq::POLLIN)];
                    if zmq::poll(&mut items, 50).is_err() || !items[0].is_readable() {
                        continue;
                    }
                    let Ok(req) = router.recv_multipart(0) else {
                        continue;
                    };
                    if req.len() != 3 || !req[1].is_empty() || req[2].len() != 8 {
                        continue;
                    }
                    let start = u64::from_be_bytes(req[2].as_slice().try_into().expect("8 bytes"));
                    let id = req[0].clone();
                    let entries: Vec<(u64, Vec<u8>)> = ring
                        .lock()
                        .expect("ring")
                        .iter()
                        .filter(|(s, _)| *s >= start)
                        .cloned()
                        .collect();
                    for (seq, payload) in entries {
                        let seq = seq.to_be_bytes().to_vec();
                        let reply: Vec<Vec<u8>> = if frames == 4 {
                            vec![id.clone(), vec![], vec![], seq, payload]
                        } else {
                            vec![id.clone(), vec![], seq, payload]
                        };
                        router.send_multipart(reply, 0).expect("reply");
                    }
                    let end: Vec<Vec<u8>> = if frames == 4 {
                        vec![id.clone(), vec![], vec![], vec![0xff; 8], vec![]]
                    } else {
                        vec![id.clone(), vec![], vec![0xff; 8], vec![]]
                    };
                    router.send_multipart(end, 0).expect("end");
                }
            })
        };
        Publisher {
            publisher,
            events,
            replay,
            ring,
            stop,
            router: Some(thread),
        }
    }

    /// Publishes `payload` as `seq`; `live: false` keeps it only in the ring (a lost batch).
    pub fn publish(&self, seq: u64, payload: &[u8], live: bool, ring_size: usize) {
        {
            let mut ring = self.ring.lock().expect("ring");
            ring.push_back((seq, payload.to_vec()));
            while ring.len() > ring_size {
                ring.pop_front();
            }
        }
        if live {
            let frames: [&[u8]; 3] = [b"", &seq.to_be_bytes(), payload];
            self.publisher.send_multipart(frames, 0).expect("publish");
        }
    }

    /// Forgets the ring, as a restarted engine does.
    pub fn restart_ring(&self) {
        self.ring.lock().expect("ring").clear();
    }

    /// Rank `rank`'s endpoints as a worker spec names them.
    pub fn endpoints(&self, rank: u32) -> RankEndpoints {
        RankEndpoints {
            rank: DpRank(rank),
            events: self.events.clone(),
            replay: Some(self.replay.clone()),
        }
    }
}

impl Drop for Publisher {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::Relaxed);
        if let Some(t) = self.router.take() {
            let _ = t.join();
        }
    }
}
