//! Helpers: a fleet on ephemeral ports, a raw HTTP/1.1 client, ZeroMQ clients,
//! and engine hashes recomputed from their definitions (independently of the crate).

use std::io::{Read, Write};
use std::net::{SocketAddr, TcpStream};
use std::time::{Duration, Instant};

use kvroute_core::event::KvEvent;
use kvroute_core::event::WorkerFlavor;
use kvroute_core::wire::{decode_batch, DecodedBatch, DecoderConfig};
use kvroute_mocker::{Fleet, MockerConfig, ReplayFrames, TsSource, WorkerInfo};
use serde_json::Value;
use sha2::{Digest, Sha256};

/// The golden samples' timestamp; simulated time starts here in tests.
pub const TS0: f64 = 1767225600.25;

/// A small, fast fleet on ephemeral ports with deterministic timestamps.
pub fn config(flavor: WorkerFlavor) -> MockerConfig {
    let mut c = MockerConfig {
        flavor,
        port: 0,
        kv_events_port: 0,
        replay_port: 0,
        num_gpu_blocks: 256,
        block_size: 16,
        ts_source: TsSource::Simulated { start: TS0 },
        ..MockerConfig::default()
    };
    c.timing.speedup = 1000.0;
    c
}

/// A running fleet with its own runtime; shut down on drop.
pub struct TestFleet {
    fleet: Option<Fleet>,
    rt: tokio::runtime::Runtime,
}

impl TestFleet {
    pub fn start(config: MockerConfig) -> Self {
        let rt = tokio::runtime::Builder::new_multi_thread()
            .worker_threads(2)
            .enable_all()
            .build()
            .expect("runtime");
        let fleet = rt.block_on(Fleet::start(config)).expect("fleet starts");
        TestFleet {
            fleet: Some(fleet),
            rt,
        }
    }

    pub fn worker(&self, k: usize) -> &WorkerInfo {
        &self.fleet.as_ref().expect("running").workers()[k]
    }

    pub fn http(&self, k: usize) -> SocketAddr {
        self.worker(k).http_addr
    }

    pub fn events(&self, k: usize, rank: usize) -> String {
        self.worker(k).events[rank].clone()
    }

    pub fn replay(&self, k: usize, rank: usize) -> String {
        self.worker(k).replay[rank].clone()
    }
}

impl Drop for TestFleet {
    fn drop(&mut self) {
        if let Some(fleet) = self.fleet.take() {
            self.rt.block_on(fleet.shutdown());
        }
    }
}

/// An HTTP response, body de-chunked.
pub struct HttpResponse {
    pub status: u16,
    pub headers: Vec<(String, String)>,
    pub body: Vec<u8>,
}

impl HttpResponse {
    pub fn json(&self) -> Value {
        serde_json::from_slice(&self.body)
            .unwrap_or_else(|e| panic!("not JSON ({e}): {}", String::from_utf8_lossy(&self.body)))
    }

    pub fn text(&self) -> String {
        String::from_utf8_lossy(&self.body).into_owned()
    }

    pub fn header(&self, name: &str) -> Option<&str> {
        self.headers
            .iter()
            .find(|(k, _)| k.eq_ignore_ascii_case(name))
            .map(|(_, v)| v.as_str())
    }

    /// The `data:` payloads of an SSE body, in order.
    pub fn sse_data(&self) -> Vec<String> {
        self.text()
            .split("\n\n")
            .filter_map(|event| event.strip_prefix("data: "))
            .map(str::to_owned)
            .collect()
    }
}

/// One HTTP/1.1 exchange with `Connection: close`.
pub fn http(
    addr: SocketAddr,
    method: &str,
    path: &str,
    headers: &[(&str, &str)],
    body: Option<&[u8]>,
) -> HttpResponse {
    let mut stream = TcpStream::connect(addr).expect("connect");
    stream
        .set_read_timeout(Some(Duration::from_secs(20)))
        .expect("timeout");
    let mut req = format!("{method} {path} HTTP/1.1\r\nHost: {addr}\r\nConnection: close\r\n");
    for (k, v) in headers {
        req.push_str(&format!("{k}: {v}\r\n"));
    }
    if let Some(body) = body {
        req.push_str(&format!(
            "Content-Type: application/json\r\nContent-Length: {}\r\n",
            body.len()
        ));
    }
    req.push_str("\r\n");
    stream.write_all(req.as_bytes()).expect("write");
    if let Some(body) = body {
        stream.write_all(body).expect("write body");
    }
    let mut raw = Vec::new();
    stream.read_to_end(&mut raw).expect("read");
    let split = raw
        .windows(4)
        .position(|w| w == b"\r\n\r\n")
        .expect("header end");
    let head = String::from_utf8_lossy(&raw[..split]).into_owned();
    let mut lines = head.split("\r\n");
    let status: u16 = lines
        .next()
        .and_then(|l| l.split(' ').nth(1))
        .and_then(|s| s.parse().ok())
        .expect("status line");
    let headers: Vec<(String, String)> = lines
        .filter_map(|l| l.split_once(": "))
        .map(|(k, v)| (k.to_owned(), v.to_owned()))
        .collect();
    let mut body = raw[split + 4..].to_vec();
    let chunked = headers.iter().any(|(k, v)| {
        k.eq_ignore_ascii_case("transfer-encoding") && v.eq_ignore_ascii_case("chunked")
    });
    if chunked {
        body = dechunk(&body);
    }
    HttpResponse {
        status,
        headers,
        body,
    }
}

fn dechunk(mut b: &[u8]) -> Vec<u8> {
    let mut out = Vec::new();
    loop {
        let line_end = b.windows(2).position(|w| w == b"\r\n").expect("chunk size");
        let size_text = String::from_utf8_lossy(&b[..line_end]);
        let size = usize::from_str_radix(size_text.trim(), 16).expect("hex chunk size");
        b = &b[line_end + 2..];
        if size == 0 {
            return out;
        }
        out.extend_from_slice(&b[..size]);
        b = &b[size + 2..];
    }
}

pub fn post(addr: SocketAddr, path: &str, body: &Value) -> HttpResponse {
    let bytes = serde_json::to_vec(body).expect("json");
    http(addr, "POST", path, &[], Some(&bytes))
}

pub fn get(addr: SocketAddr, path: &str) -> HttpResponse {
    http(addr, "GET", path, &[], None)
}

/// `usage.prompt_tokens_details.cached_tokens` of a JSON response.
pub fn cached_tokens(response: &Value) -> u64 {
    response["usage"]["prompt_tokens_details"]["cached_tokens"]
        .as_u64()
        .unwrap_or_else(|| panic!("no cached_tokens in {response}"))
}

/// A SUB socket subscribed to everything, returned once its connection to
/// the PUB has completed the ZMTP handshake (at most 10 s): a PUB drops what
/// it sends before a subscriber is there (the slow-joiner window), and the
/// subscription, queued before the connection, is the SUB's first message
/// on it.
pub fn subscribe(endpoint: &str) -> zmq::Socket {
    let ctx = zmq::Context::new();
    let sub = ctx.socket(zmq::SUB).expect("SUB");
    sub.set_rcvtimeo(5000).expect("timeout");
    sub.set_subscribe(b"").expect("subscribe");
    let monitor_endpoint = format!("inproc://sub-monitor-{}", next_id());
    sub.monitor(
        &monitor_endpoint,
        zmq::SocketEvent::HANDSHAKE_SUCCEEDED as i32,
    )
    .expect("monitor");
    let monitor = ctx.socket(zmq::PAIR).expect("PAIR");
    monitor.set_rcvtimeo(100).expect("timeout");
    monitor.connect(&monitor_endpoint).expect("monitor connect");
    sub.connect(endpoint).expect("connect");
    let deadline = Instant::now() + Duration::from_secs(10);
    loop {
        // [event id (u16 LE) + value (u32 LE), endpoint]
        if let Ok(frames) = monitor.recv_multipart(0) {
            let event = frames
                .first()
                .and_then(|f| f.get(..2))
                .map(|b| u16::from_le_bytes([b[0], b[1]]));
            if event == Some(zmq::SocketEvent::HANDSHAKE_SUCCEEDED as u16) {
                break;
            }
        }
        assert!(
            Instant::now() < deadline,
            "the SUB never completed its handshake with {endpoint} within 10 s"
        );
    }
    sub
}

/// A number no other call in this process got (names of inproc endpoints).
fn next_id() -> u64 {
    static NEXT: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(0);
    NEXT.fetch_add(1, std::sync::atomic::Ordering::Relaxed)
}

/// One live message `[topic, seq, payload]`; `None` after the receive timeout.
pub fn recv_live(sub: &zmq::Socket) -> Option<(Vec<u8>, u64, Vec<u8>)> {
    let frames = sub.recv_multipart(0).ok()?;
    assert_eq!(frames.len(), 3, "live frames are [topic, seq, payload]");
    let seq = u64::from_be_bytes(frames[1].as_slice().try_into().expect("8-byte seq"));
    Some((frames[0].clone(), seq, frames[2].clone()))
}

/// Live messages until `n` arrived or a receive times out.
pub fn recv_n(sub: &zmq::Socket, n: usize) -> Vec<(u64, Vec<u8>)> {
    let mut out = Vec::new();
    while out.len() < n {
        match recv_live(sub) {
            Some((topic, seq, payload)) => {
                assert!(topic.is_empty(), "topic is the empty string");
                out.push((seq, payload));
            }
            None => break,
        }
    }
    out
}

/// A full replay from `start` through a DEALER, checking the reply layout frame by frame.
pub fn replay(endpoint: &str, start: u64, layout: ReplayFrames) -> Vec<(u64, Vec<u8>)> {
    let ctx = zmq::Context::new();
    let dealer = ctx.socket(zmq::DEALER).expect("DEALER");
    dealer.set_rcvtimeo(5000).expect("timeout");
    dealer.set_linger(0).expect("linger");
    dealer.connect(endpoint).expect("connect");
    let start_bytes = start.to_be_bytes();
    dealer
        .send_multipart([&b""[..], &start_bytes[..]], 0)
        .expect("send");
    let mut out = Vec::new();
    loop {
        let frames = dealer
            .recv_multipart(0)
            .expect("replay reply before the timeout");
        assert!(frames[0].is_empty(), "empty delimiter first");
        let (seq, payload) = match layout {
            ReplayFrames::Four => {
                assert_eq!(frames.len(), 4, "[b\"\", topic, seq, payload]");
                assert!(frames[1].is_empty(), "empty topic");
                (&frames[2], &frames[3])
            }
            ReplayFrames::Three => {
                assert_eq!(frames.len(), 3, "[b\"\", seq, payload]");
                (&frames[1], &frames[2])
            }
        };
        let seq: [u8; 8] = seq.as_slice().try_into().expect("8-byte seq");
        if seq == [0xff; 8] {
            assert!(payload.is_empty(), "end marker has an empty payload");
            return out;
        }
        out.push((u64::from_be_bytes(seq), payload.clone()));
    }
}

/// Decodes with kvroute's decoder (worker block size, tokens kept); asserts nothing was skipped.
pub fn decode_clean(payload: &[u8], block_size: u32) -> DecodedBatch {
    let config = DecoderConfig {
        block_size: Some(block_size),
        keep_tokens: true,
        ..DecoderConfig::default()
    };
    let batch = decode_batch(payload, &config).expect("envelope decodes");
    let skipped: Vec<String> = batch.skipped().map(|(i, s)| format!("{i}: {s}")).collect();
    assert!(skipped.is_empty(), "skipped events: {skipped:?}");
    assert_eq!(batch.lost_events, 0);
    batch
}

/// Every decoded event of a list of payloads, in order.
pub fn all_events(payloads: &[(u64, Vec<u8>)], block_size: u32) -> Vec<KvEvent> {
    payloads
        .iter()
        .flat_map(|(_, p)| {
            decode_clean(p, block_size)
                .decoded()
                .cloned()
                .collect::<Vec<_>>()
        })
        .collect()
}

/// vLLM `sha256_cbor`, written out from the definition: CBOR of
/// `(parent_digest, tuple(tokens), None)`, SHA-256; NONE_HASH = sha256(cbor("vllm-none-hash")).
pub fn vllm_digest(parent: Option<[u8; 32]>, tokens: &[u64]) -> [u8; 32] {
    let parent = parent.unwrap_or_else(|| {
        let mut none = vec![0x60 | 14];
        none.extend_from_slice(b"vllm-none-hash");
        Sha256::digest(&none).into()
    });
    let mut cbor = vec![0x83, 0x58, 0x20];
    cbor.extend_from_slice(&parent);
    assert!(tokens.len() < 256);
    if tokens.len() < 24 {
        cbor.push(0x80 | tokens.len() as u8);
    } else {
        cbor.extend_from_slice(&[0x98, tokens.len() as u8]);
    }
    for &t in tokens {
        match t {
            0..=23 => cbor.push(t as u8),
            24..=0xff => cbor.extend_from_slice(&[0x18, t as u8]),
            0x100..=0xffff => {
                cbor.push(0x19);
                cbor.extend_from_slice(&(t as u16).to_be_bytes());
            }
            _ => {
                cbor.push(0x1a);
                cbor.extend_from_slice(&(t as u32).to_be_bytes());
            }
        }
    }
    cbor.push(0xf6);
    Sha256::digest(&cbor).into()
}

/// vLLM's published int: the digest's last 8 bytes, big-endian.
pub fn vllm_int(d: &[u8; 32]) -> u64 {
    u64::from_be_bytes(d[24..].try_into().expect("8 bytes"))
}

/// SGLang's page digest: sha256(prior ‖ LE u32 ids) or sha256(prior ‖ ff ‖ LE u64 ids).
pub fn sglang_digest(prior: Option<[u8; 32]>, tokens: &[u64]) -> [u8; 32] {
    let mut h = Sha256::new();
    if let Some(p) = prior {
        h.update(p);
    }
    if tokens.iter().any(|&t| t > u64::from(u32::MAX)) {
        h.update([0xff]);
        tokens.iter().for_each(|t| h.update(t.to_le_bytes()));
    } else {
        tokens
            .iter()
            .for_each(|&t| h.update((t as u32).to_le_bytes()));
    }
    h.finalize().into()
}

/// SGLang's published int: the digest's first 8 bytes, big-endian, signed (as bits).
pub fn sglang_int(d: &[u8; 32]) -> u64 {
    u64::from_be_bytes(d[..8].try_into().expect("8 bytes"))
}

/// A TensorRT-LLM V2 radix key: SHA-256 of the parent key (the reuse scope's
/// digest, `SHA-256([0])`, for the first block) and each id as 8 LE bytes.
pub fn trtllm_key(parent: Option<[u8; 32]>, tokens: &[u64]) -> [u8; 32] {
    let root: [u8; 32] = Sha256::digest([0u8]).into();
    let mut h = Sha256::new();
    h.update(parent.unwrap_or(root));
    tokens.iter().for_each(|t| h.update(t.to_le_bytes()));
    h.finalize().into()
}

/// The engine hashes of every full block of `tokens`, chained from the start.
pub fn engine_chain(flavor: WorkerFlavor, tokens: &[u64], bs: usize) -> Vec<u64> {
    let mut parent = None;
    tokens
        .chunks_exact(bs)
        .map(|block| {
            let (d, int) = match flavor {
                WorkerFlavor::Vllm => {
                    let d = vllm_digest(parent, block);
                    (d, vllm_int(&d))
                }
                WorkerFlavor::Sglang => {
                    let d = sglang_digest(parent, block);
                    (d, sglang_int(&d))
                }
                WorkerFlavor::Trtllm => {
                    let d = trtllm_key(parent, block);
                    (d, sglang_int(&d))
                }
            };
            parent = Some(d);
            int
        })
        .collect()
}

/// A completion body with a token-id prompt.
pub fn ids_prompt(ids: &[u64], max_tokens: usize) -> Value {
    serde_json::json!({"model": "mock-model", "prompt": ids, "max_tokens": max_tokens})
}
