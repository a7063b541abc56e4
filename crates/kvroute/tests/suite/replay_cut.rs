//! A replay answer cut short, end marker and all — what vLLM's replay
//! socket does to a reader slower than its send loop (it queues at most
//! 1,000 messages per reader and drops the rest) — is asked for again from
//! where it stopped, by a real `kvroute serve` against an engine played by
//! the test over real ZeroMQ; and an end marker that comes late, after
//! its replay timed out, does not end the replay asked for since.

use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;
use std::thread::JoinHandle;

use kvroute_core::wire::write as mp;

use crate::support::http::request;
use crate::support::{eventually, spawn_serve, spawn_serve_with_env};

/// Tokens per block of the played engine.
const BS: u64 = 4;
/// Batches in its ring before the router starts.
const RING: u64 = 300;
/// Where its first replay answer stops.
const CUT: u64 = 150;

/// Batch `seq`: one block of `BS` tokens, engine hash `seq + 1`, no parent.
fn batch(seq: u64) -> Vec<u8> {
    let mut out = vec![0x93, 0xcb];
    out.extend_from_slice(&1.5f64.to_be_bytes());
    mp::array(&mut out, 1);
    mp::map(&mut out, 5);
    mp::str(&mut out, "type");
    mp::str(&mut out, "BlockStored");
    mp::str(&mut out, "block_hashes");
    mp::array(&mut out, 1);
    mp::uint64(&mut out, seq + 1);
    mp::str(&mut out, "parent_block_hash");
    out.push(0xc0);
    mp::str(&mut out, "token_ids");
    mp::array(&mut out, BS as usize);
    for t in 0..BS {
        mp::uint64(&mut out, 1_000 + seq * BS + t);
    }
    mp::str(&mut out, "block_size");
    mp::uint64(&mut out, BS);
    mp::uint64(&mut out, 0);
    out
}

/// The next replay request on the played engine's ROUTER socket: the
/// asker's identity and the first seq it asks for (`None` after 50 ms of
/// nothing, or for a frame that is not a request).
fn next_request(router: &zmq::Socket) -> Option<(Vec<u8>, u64)> {
    if !matches!(router.poll(zmq::POLLIN, 50), Ok(n) if n > 0) {
        return None;
    }
    let req = router.recv_multipart(0).ok()?;
    let [id, _, start] = req.as_slice() else {
        return None;
    };
    let start = u64::from_be_bytes(start.as_slice().try_into().expect("8 bytes"));
    Some((id.clone(), start))
}

/// Answers `id` with batches `seqs`.
fn send_batches(router: &zmq::Socket, id: &[u8], seqs: std::ops::Range<u64>) {
    for seq in seqs {
        let reply = [id, b"", b"", &seq.to_be_bytes()[..], &batch(seq)[..]];
        router.send_multipart(reply, 0).expect("reply");
    }
}

/// Sends `id` a replay's end marker.
fn send_end(router: &zmq::Socket, id: &[u8]) {
    let reply = [id, b"", b"", &(-1i64).to_be_bytes()[..], b""];
    router.send_multipart(reply, 0).expect("end");
}

/// The played engine's replay socket: its first answer stops after
/// batch `CUT - 1` with no end marker; later ones are whole.
struct Replayer {
    stop: Arc<AtomicBool>,
    thread: Option<JoinHandle<()>>,
}

impl Replayer {
    fn start(router: zmq::Socket, ring: u64) -> Replayer {
        let stop = Arc::new(AtomicBool::new(false));
        let flag = stop.clone();
        let thread = std::thread::spawn(move || {
            let mut answers = 0;
            while !flag.load(Ordering::Relaxed) {
                let Some((id, start)) = next_request(&router) else {
                    continue;
                };
                answers += 1;
                let end = if answers == 1 { CUT.max(start) } else { ring };
                send_batches(&router, &id, start..end);
                if answers > 1 {
                    send_end(&router, &id);
                }
            }
        });
        Replayer {
            stop,
            thread: Some(thread),
        }
    }
}

impl Drop for Replayer {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::Relaxed);
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}

/// The router's only rank, as `/workers` shows it.
fn rank(serve: &str) -> serde_json::Value {
    request(serve, "GET", "/workers", "").json()["workers"][0]["ranks"][0].clone()
}

#[test]
fn a_replay_cut_short_without_its_end_marker_is_asked_again() {
    let ctx = zmq::Context::new();
    let publisher = ctx.socket(zmq::PUB).expect("pub");
    publisher.bind("tcp://127.0.0.1:*").expect("bind");
    let events = publisher.get_last_endpoint().expect("ep").expect("utf-8");
    let router = ctx.socket(zmq::ROUTER).expect("router");
    router.bind("tcp://127.0.0.1:*").expect("bind");
    let replay = router.get_last_endpoint().expect("ep").expect("utf-8");
    let _replayer = Replayer::start(router, RING + 1);
    let line =
        format!("name=w0,url=http://127.0.0.1:9,events={events},replay={replay},block_size={BS}");
    let (_serve, serve) = spawn_serve(&[line], &[]);
    // The router joins, replays from 0, gets 0..149 and no end marker.
    eventually("the first replay answer applied", || {
        rank(&serve)["last_seq"].as_u64() >= Some(CUT - 1)
    });
    // The engine publishes on; the router sees the batches it missed.
    let live = [&b""[..], &RING.to_be_bytes()[..], &batch(RING)[..]];
    support_publish(&publisher, &live, &serve);
    eventually("every batch applied", || {
        let r = rank(&serve);
        r["last_seq"] == RING && r["state"] == "live"
    });
    let r = rank(&serve);
    assert_eq!(r["blocks"]["device"], RING + 1, "{r}");
    assert_eq!(r["replays_incomplete"], 0, "{r}");
    assert_eq!(r["state_reason"], serde_json::Value::Null, "{r}");
}

/// Publishes `message` until the router has it (a SUB joining late misses
/// what was published before it subscribed).
fn support_publish(publisher: &zmq::Socket, message: &[&[u8]], serve: &str) {
    eventually("the router receives the live batch", || {
        publisher.send_multipart(message, 0).expect("publish");
        rank(serve)["batches"].as_u64() > Some(0)
    });
}

/// The played engine's replay socket for the late end marker: answer 2 (the
/// router's first check after its resync) is held until the next request
/// comes, then only its end marker is sent, before that request's whole
/// answer; other answers are whole. Answers hold the batches published so far.
fn late_end_replayer(router: zmq::Socket, published: Arc<AtomicU64>, stop: Arc<AtomicBool>) {
    let mut answers = 0;
    while !stop.load(Ordering::Relaxed) {
        let Some((id, start)) = next_request(&router) else {
            continue;
        };
        answers += 1;
        if answers == 2 {
            continue;
        }
        if answers == 3 {
            send_end(&router, &id);
        }
        send_batches(&router, &id, start..published.load(Ordering::Relaxed));
        send_end(&router, &id);
    }
}

#[test]
fn a_late_end_marker_of_a_timed_out_replay_does_not_end_the_next_one() {
    let ctx = zmq::Context::new();
    let publisher = ctx.socket(zmq::PUB).expect("pub");
    publisher.bind("tcp://127.0.0.1:*").expect("bind");
    let events = publisher.get_last_endpoint().expect("ep").expect("utf-8");
    let router = ctx.socket(zmq::ROUTER).expect("router");
    router.bind("tcp://127.0.0.1:*").expect("bind");
    let replay = router.get_last_endpoint().expect("ep").expect("utf-8");
    let published = Arc::new(AtomicU64::new(0));
    let stop = Arc::new(AtomicBool::new(false));
    let thread = {
        let (published, stop) = (published.clone(), stop.clone());
        std::thread::spawn(move || late_end_replayer(router, published, stop))
    };
    let line =
        format!("name=w0,url=http://127.0.0.1:9,events={events},replay={replay},block_size={BS}");
    // No periodic check during the test: the router's requests are its
    // resync, the early check after batch 0, and the gap's replay.
    let env = [("KVROUTE_VERIFY_SECS", "3600")];
    let (_serve, serve) = spawn_serve_with_env(&[line], &[], &env);
    eventually("the resync completes", || {
        let r = rank(&serve);
        r["connected"] == true && r["replays_ok"].as_u64() >= Some(1)
    });
    published.store(1, Ordering::Relaxed);
    let live = |seq: u64| [b"".to_vec(), seq.to_be_bytes().to_vec(), batch(seq)];
    let first = live(0);
    let frames: Vec<&[u8]> = first.iter().map(Vec::as_slice).collect();
    support_publish(&publisher, &frames, &serve);
    // The early check's answer is held: it times out.
    eventually("the early check's replay times out", || {
        rank(&serve)["replay_timeouts"].as_u64() >= Some(1)
    });
    // Batch 1 is lost live; batch 2 shows the gap. The replay it asks for
    // gets the held answer's end marker first, then its own answer.
    published.store(3, Ordering::Relaxed);
    eventually("the gap is replayed", || {
        publisher.send_multipart(live(2), 0).expect("publish");
        let r = rank(&serve);
        r["last_seq"] == 2 && r["state"] == "live"
    });
    let r = rank(&serve);
    assert_eq!(
        r["engine_restarts"], 0,
        "the late end marker ended the replay: {r}"
    );
    assert_eq!(r["clears"], 0, "{r}");
    assert_eq!(r["replay_timeouts"], 1, "{r}");
    assert_eq!(r["blocks"]["device"], 3, "{r}");
    stop.store(true, Ordering::Relaxed);
    let _ = thread.join();
}
