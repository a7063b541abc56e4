//! HTTP engines played by the test, whose answers it holds: each tells the
//! test which request reached it (by `x-request-id`), answers its head at
//! once, its first event when the test says its prefill is over, and its
//! end when the test releases it, so the load a router sees at every
//! decision is the test's choice, not the machine's timing. A vLLM prefill
//! leg (`kv_transfer_params` with `do_remote_decode`) is answered whole
//! when the test releases `ID/prefill`. Answers report no
//! usage, so the router learns nothing from them beyond their ends.

use std::collections::HashMap;
use std::io::{Read, Write};
use std::net::{TcpListener, TcpStream};
use std::sync::mpsc::{self, Receiver, Sender};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use serde_json::Value;

/// How a request reached an engine.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Leg {
    /// A vLLM prefill leg, answered whole when released.
    Prefill,
    /// A whole request or a decode leg, held.
    Held,
}

/// A request that reached engine `engine`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Arrival {
    /// The engine's position in the fleet.
    pub engine: usize,
    /// The request's `x-request-id`.
    pub id: String,
    /// How it came.
    pub leg: Leg,
}

type Holds = Arc<Mutex<HashMap<String, Sender<()>>>>;

/// A fleet of held engines on ports of 127.0.0.1.
pub struct HeldFleet {
    /// Each engine's `host:port`.
    pub addrs: Vec<String>,
    arrivals: Receiver<Arrival>,
    holds: Holds,
}

impl HeldFleet {
    /// `engines` engines, each on its own port.
    pub fn start(engines: usize) -> HeldFleet {
        let (tx, arrivals) = mpsc::channel();
        let holds: Holds = Arc::default();
        let addrs = (0..engines)
            .map(|engine| {
                let listener = TcpListener::bind("127.0.0.1:0").expect("bind");
                let addr = listener.local_addr().expect("addr").to_string();
                let (tx, holds) = (tx.clone(), holds.clone());
                std::thread::spawn(move || {
                    for stream in listener.incoming().map_while(Result::ok) {
                        let (tx, holds) = (tx.clone(), holds.clone());
                        std::thread::spawn(move || serve(stream, engine, &tx, &holds));
                    }
                });
                addr
            })
            .collect();
        HeldFleet {
            addrs,
            arrivals,
            holds,
        }
    }

    /// The next request to reach an engine, if one does within `wait`.
    pub fn next_arrival(&self, wait: Duration) -> Option<Arrival> {
        self.arrivals.recv_timeout(wait).ok()
    }

    /// Sends the first event of request `id`'s held answer (a prefill
    /// leg's is all of it: see [`HeldFleet::release`]).
    pub fn first_token(&self, id: &str) {
        let holds = self.holds.lock().expect("holds");
        let tx = holds.get(id).expect("a held request");
        tx.send(()).expect("its engine waits");
    }

    /// Ends request `id`'s held answer (after its first event), or answers
    /// the prefill leg `ID/prefill`.
    pub fn release(&self, id: &str) {
        let tx = self.holds.lock().expect("holds").remove(id);
        tx.expect("a held request")
            .send(())
            .expect("its engine waits");
    }
}

/// Answers one connection's request (`Connection: close`).
fn serve(mut stream: TcpStream, engine: usize, tx: &Sender<Arrival>, holds: &Holds) {
    let Some((head, body)) = read_request(&mut stream) else {
        return;
    };
    if !head.starts_with("post ") {
        let _ = stream
            .write_all(b"HTTP/1.1 404 Not Found\r\ncontent-length: 0\r\nconnection: close\r\n\r\n");
        return;
    }
    let id = header(&head, "x-request-id").unwrap_or_default();
    let json: Value = serde_json::from_slice(&body).unwrap_or(Value::Null);
    if json["kv_transfer_params"]["do_remote_decode"] == true {
        let (release, held) = mpsc::channel();
        holds
            .lock()
            .expect("holds")
            .insert(format!("{id}/prefill"), release);
        let _ = tx.send(Arrival {
            engine,
            id: id.clone(),
            leg: Leg::Prefill,
        });
        let _ = held.recv();
        let answer = serde_json::json!({
            "id": id, "object": "text_completion",
            "choices": [{"index": 0, "text": "x", "finish_reason": "length"}],
            "kv_transfer_params": {"do_remote_prefill": true, "remote_engine_id": format!("e{engine}"),
                "remote_block_ids": [], "remote_host": "127.0.0.1", "remote_port": 1},
        })
        .to_string();
        let _ = write!(
            stream,
            "HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ncontent-length: {}\r\nconnection: close\r\n\r\n{answer}",
            answer.len()
        );
        return;
    }
    let (release, held) = mpsc::channel();
    holds.lock().expect("holds").insert(id.clone(), release);
    let _ = tx.send(Arrival {
        engine,
        id,
        leg: Leg::Held,
    });
    let head = "HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\nconnection: close\r\n\r\n";
    let _ = stream.write_all(head.as_bytes());
    let _ = held.recv();
    let chunk = r#"{"id":"c","object":"text_completion","choices":[{"index":0,"text":"x","finish_reason":null}]}"#;
    let _ = write!(stream, "data: {chunk}\n\n");
    let _ = held.recv();
    let _ = stream.write_all(b"data: [DONE]\n\n");
}

/// A request's head (lower-cased) and its `content-length` body.
fn read_request(stream: &mut TcpStream) -> Option<(String, Vec<u8>)> {
    let mut data = Vec::new();
    let mut buf = [0u8; 16 << 10];
    let end = loop {
        let n = stream.read(&mut buf).ok().filter(|&n| n > 0)?;
        data.extend_from_slice(&buf[..n]);
        if let Some(at) = data.windows(4).position(|w| w == b"\r\n\r\n") {
            break at + 4;
        }
    };
    let head = String::from_utf8_lossy(&data[..end]).to_ascii_lowercase();
    let length: usize = header(&head, "content-length").map_or(0, |v| v.parse().unwrap_or(0));
    while data.len() < end + length {
        let n = stream.read(&mut buf).ok().filter(|&n| n > 0)?;
        data.extend_from_slice(&buf[..n]);
    }
    Some((head, data[end..end + length].to_vec()))
}

/// A header's value in a lower-cased head.
fn header(head: &str, name: &str) -> Option<String> {
    let prefix = format!("{name}:");
    head.lines()
        .find_map(|l| l.strip_prefix(&prefix).map(|v| v.trim().to_owned()))
}
