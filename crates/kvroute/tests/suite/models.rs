//! Many models on one router: each request goes only to workers that serve
//! the model it names (their `/v1/models`, LoRA adapters included), an
//! unknown model is OpenAI's 404, and an adapter's prompt is hashed with
//! the adapter, as the engines hash it. A worker's list is read within
//! bounds: one over them leaves the worker's models unknown (no catch-all),
//! and clients are answered from the lists learned, not by asking workers.
//! Models and adapters are checked at both front doors (HTTP and the
//! endpoint picker).

use std::io::{Read, Write};
use std::net::{TcpListener, TcpStream};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;

use serde_json::{json, Value};

use crate::support::door::{Door, Front};
use crate::support::http::{count, request};
use crate::support::{eventually, free_port, spawn_serve, start_mocker_with};

/// One mock engine serving `model` (and `adapters`), its `--worker` line named `name`.
fn engine(model: &str, adapters: &str, name: &str) -> (crate::support::Proc, String) {
    let mut args = vec!["--model", model];
    if !adapters.is_empty() {
        args.extend(["--lora-adapters", adapters]);
    }
    let (proc, mut lines) = start_mocker_with(1, &args);
    let line = lines
        .remove(0)
        .replacen("name=w0", &format!("name={name}"), 1);
    (proc, line)
}

/// A completion of `model` through `front`: its status, the worker that
/// answered and the answer.
fn complete(front: &Front, model: &str, seed: u32) -> (u16, String, Value) {
    let prompt: Vec<u32> = (0..128).map(|i| 7_000 + seed * 500 + i).collect();
    let body = json!({"model": model, "prompt": prompt, "max_tokens": 2});
    let reply = request(&front.addr, "POST", "/v1/completions", &body.to_string());
    // Whole, or chunked by the data plane.
    let doc = if reply.body.contains('{') {
        reply.json()
    } else {
        Value::Null
    };
    (reply.status, front.worker_of(&reply), doc)
}

/// [`complete`] straight at `kvroute serve` at `serve`.
fn complete_at(serve: &str, model: &str, seed: u32) -> (u16, Option<String>, Value) {
    let prompt: Vec<u32> = (0..128).map(|i| 7_000 + seed * 500 + i).collect();
    let body = json!({"model": model, "prompt": prompt, "max_tokens": 2});
    let reply = request(serve, "POST", "/v1/completions", &body.to_string());
    let doc: Value = serde_json::from_str(&reply.body).unwrap_or(Value::Null);
    (reply.status, reply.header("x-kvroute-worker"), doc)
}

fn requests_reach_only_workers_that_serve_their_model(door: Door) {
    let (_a, a) = engine("alpha", "sql", "a");
    let (_b, b) = engine("beta", "", "b");
    let front = door.start(&[a, b], &["--public-introspection"], &[]);
    let serve = front.router.clone();
    eventually("both workers' models learned", || {
        let doc: Value = request(&serve, "GET", "/workers", "").json();
        let models = |name: &str| {
            doc["workers"]
                .as_array()
                .into_iter()
                .flatten()
                .find(|w| w["name"] == name)
                .map(|w| w["models"].clone())
        };
        models("a") == Some(json!(["alpha", "sql"])) && models("b") == Some(json!(["beta"]))
    });
    for seed in 0..6 {
        for (model, worker) in [("alpha", "a"), ("beta", "b"), ("sql", "a")] {
            let (status, served_by, doc) = complete(&front, model, seed);
            assert_eq!(status, 200, "{model}: {doc}");
            assert_eq!(served_by, worker, "{model} went to the wrong worker");
        }
    }
    // Unknown: OpenAI's answer.
    let (status, _, doc) = complete(&front, "gamma", 0);
    assert_eq!(status, 404, "{doc}");
    assert_eq!(doc["error"]["code"], "model_not_found", "{doc}");
    assert_eq!(doc["error"]["param"], "model", "{doc}");
    // The adapter's repeat hits its own blocks, and the router, hashing
    // with the adapter, predicted exactly what the engine reported.
    let (before_exact, before_all) = (
        count(&serve, "kvroute_accuracy_exact_total"),
        count(&serve, "kvroute_accuracy_comparisons_total"),
    );
    eventually("the adapter's blocks are indexed", || {
        let (_, _, doc) = complete(&front, "sql", 0);
        doc["usage"]["prompt_tokens_details"]["cached_tokens"].as_u64() >= Some(112)
    });
    eventually("its prediction compared", || {
        count(&serve, "kvroute_accuracy_comparisons_total") > before_all
    });
    let (exact, all) = (
        count(&serve, "kvroute_accuracy_exact_total") - before_exact,
        count(&serve, "kvroute_accuracy_comparisons_total") - before_all,
    );
    assert!(
        all > 0 && exact == all,
        "{exact} of {all} predictions exact"
    );
    let models: Value = request(&serve, "GET", "/v1/models", "").json();
    let mut ids: Vec<&str> = models["data"]
        .as_array()
        .into_iter()
        .flatten()
        .filter_map(|m| m["id"].as_str())
        .collect();
    ids.sort_unstable();
    assert_eq!(ids, ["alpha", "beta", "sql"], "the union");
}

#[test]
fn requests_reach_only_workers_that_serve_their_model_over_http() {
    requests_reach_only_workers_that_serve_their_model(Door::Http);
}

#[cfg(feature = "epp")]
#[test]
fn requests_reach_only_workers_that_serve_their_model_through_the_picker() {
    requests_reach_only_workers_that_serve_their_model(Door::Picker);
}

/// What a [`FakeWorker`] answers to `GET /v1/models`.
#[derive(Clone, Copy)]
enum ListShape {
    /// This JSON document.
    Small(&'static str),
    /// A list of as many models as fill `bytes` (chunked, quickly), then
    /// nothing more until the router hangs up: a list too long to read.
    Endless { bytes: usize },
    /// One model whose card carries a `pad` of `bytes` (chunked, quickly),
    /// then the end of the list.
    Padded { bytes: usize },
}

/// An HTTP "worker" that answers `/v1/models` as its [`ListShape`] says and
/// every completion with a one-token answer, counting both.
struct FakeWorker {
    addr: String,
    lists: Arc<AtomicUsize>,
    completions: Arc<AtomicUsize>,
}

impl FakeWorker {
    fn start(shape: ListShape) -> Self {
        let listener = TcpListener::bind("127.0.0.1:0").expect("bind");
        let addr = listener.local_addr().expect("addr").to_string();
        let (lists, completions) = (Arc::<AtomicUsize>::default(), Arc::<AtomicUsize>::default());
        let counters = (lists.clone(), completions.clone());
        std::thread::spawn(move || {
            for stream in listener.incoming().map_while(Result::ok) {
                let counters = counters.clone();
                std::thread::spawn(move || fake_answer(stream, shape, &counters.0, &counters.1));
            }
        });
        FakeWorker {
            addr,
            lists,
            completions,
        }
    }

    /// Its `--worker` line, named `name` (its events socket is never served).
    fn line(&self, name: &str) -> String {
        let dead = free_port();
        format!(
            "name={name},url=http://{},events=tcp://127.0.0.1:{dead},dp=1,block_size=16",
            self.addr
        )
    }

    fn lists(&self) -> usize {
        self.lists.load(Ordering::SeqCst)
    }

    fn completions(&self) -> usize {
        self.completions.load(Ordering::SeqCst)
    }
}

/// Answers one request on `stream` (then closes it).
fn fake_answer(mut stream: TcpStream, shape: ListShape, lists: &AtomicUsize, done: &AtomicUsize) {
    let mut raw = Vec::new();
    let mut buf = [0u8; 8192];
    let head_end = loop {
        if let Some(end) = raw.windows(4).position(|w| w == b"\r\n\r\n") {
            break end;
        }
        match stream.read(&mut buf) {
            Ok(0) | Err(_) => return,
            Ok(n) => raw.extend_from_slice(&buf[..n]),
        }
    };
    let head = String::from_utf8_lossy(&raw[..head_end]).to_ascii_lowercase();
    let length: usize = head
        .lines()
        .find_map(|l| l.strip_prefix("content-length:"))
        .and_then(|v| v.trim().parse().ok())
        .unwrap_or(0);
    while raw.len() < head_end + 4 + length {
        match stream.read(&mut buf) {
            Ok(0) | Err(_) => return,
            Ok(n) => raw.extend_from_slice(&buf[..n]),
        }
    }
    if head.starts_with("get /v1/models") {
        lists.fetch_add(1, Ordering::SeqCst);
        let _ = send_list(&mut stream, shape);
    } else if head.starts_with("post /v1/completions") {
        done.fetch_add(1, Ordering::SeqCst);
        let body = json!({"id": "cmpl-fake", "object": "text_completion", "model": "x",
            "choices": [{"index": 0, "text": "x", "finish_reason": "length"}],
            "usage": {"prompt_tokens": 1, "completion_tokens": 1, "total_tokens": 2}})
        .to_string();
        let _ = write!(
            stream,
            "HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ncontent-length: {}\r\nconnection: close\r\n\r\n{body}",
            body.len()
        );
    } else {
        let _ = stream
            .write_all(b"HTTP/1.1 404 Not Found\r\ncontent-length: 0\r\nconnection: close\r\n\r\n");
    }
}

/// Writes `shape`'s answer, chunked; an error once the router hangs up.
fn send_list(stream: &mut TcpStream, shape: ListShape) -> std::io::Result<()> {
    let chunk = |stream: &mut TcpStream, data: &[u8]| -> std::io::Result<()> {
        write!(stream, "{:x}\r\n", data.len())?;
        stream.write_all(data)?;
        stream.write_all(b"\r\n")
    };
    let json = |stream: &mut TcpStream| {
        stream.write_all(
            b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ntransfer-encoding: chunked\r\nconnection: close\r\n\r\n",
        )
    };
    match shape {
        ListShape::Small(doc) => {
            json(stream)?;
            chunk(stream, doc.as_bytes())?;
        }
        ListShape::Endless { bytes } => {
            json(stream)?;
            chunk(stream, br#"{"object":"list","data":["#)?;
            let (mut sent, mut i) = (0, 0);
            while sent < bytes {
                let part: String = (0..1_000)
                    .map(|k| format!(r#"{{"id":"model-{:07}","object":"model"}},"#, i + k))
                    .collect();
                chunk(stream, part.as_bytes())?;
                (sent, i) = (sent + part.len(), i + 1_000);
            }
            // Nothing more until the router hangs up.
            let mut byte = [0u8; 1];
            while stream.read(&mut byte)? > 0 {}
            return Ok(());
        }
        ListShape::Padded { bytes } => {
            json(stream)?;
            chunk(
                stream,
                br#"{"object":"list","data":[{"id":"padded","object":"model","pad":""#,
            )?;
            let pad = vec![b'x'; 1 << 20];
            for _ in 0..bytes.div_ceil(pad.len()) {
                chunk(stream, &pad)?;
            }
            chunk(stream, br#""}]}"#)?;
        }
    }
    stream.write_all(b"0\r\n\r\n")
}

/// The `models` `/workers` shows for worker `name` (null: unknown).
fn models_of(serve: &str, name: &str) -> Value {
    let doc: Value = request(serve, "GET", "/workers", "").json();
    doc["workers"]
        .as_array()
        .into_iter()
        .flatten()
        .find(|w| w["name"] == name)
        .map_or(Value::Null, |w| w["models"].clone())
}

/// The probe's worker listing a million models (57 MB, sent slowly): the
/// build before never finished reading it, took "no answer" for "serves
/// every model" and sent a request for a model no one serves to it (200
/// from the fake instead of the 404). Now the list is refused once it
/// passes 4 MiB, the worker's models are unknown, and while another
/// worker's list is known it gets no request naming a model: the unknown
/// model is the 404, and `alpha` goes to the worker that lists it.
#[test]
fn a_worker_whose_model_list_is_over_the_bound_is_no_catch_all() {
    let (_a, a) = engine("alpha", "", "a");
    let fake = FakeWorker::start(ListShape::Endless { bytes: 6 << 20 });
    let (_serve, serve) = spawn_serve(&[a, fake.line("huge")], &["--public-introspection"]);
    eventually("the huge list asked", || fake.lists() > 0);
    // The round of asking is over once clients are told of alpha.
    eventually("clients are told of alpha", || {
        request(&serve, "GET", "/v1/models", "")
            .body
            .contains("\"alpha\"")
    });
    let (status, worker, doc) = complete_at(&serve, "nonexistent-model", 0);
    assert_eq!(
        (status, worker.as_deref()),
        (404, None),
        "an unknown model went to a worker: {doc}"
    );
    assert_eq!(doc["error"]["code"], "model_not_found", "{doc}");
    for seed in 1..5 {
        let (status, worker, doc) = complete_at(&serve, "alpha", seed);
        assert_eq!((status, worker.as_deref()), (200, Some("a")), "{doc}");
    }
    assert_eq!(fake.completions(), 0, "the fake took a request");
    eventually("the list refused", || {
        count(&serve, "kvroute_proxy_model_lists_refused_total") >= 1
    });
    assert_eq!(models_of(&serve, "huge"), Value::Null);
}

/// Before any worker's list is known (a router just started, or engines
/// that answer no list), requests naming a model are routed as before,
/// not refused: the engine answers for itself.
#[test]
fn with_no_list_known_a_named_model_is_still_routed() {
    let fake = FakeWorker::start(ListShape::Small("not a list"));
    let (_serve, serve) = spawn_serve(&[fake.line("fake")], &["--public-introspection"]);
    eventually("its list asked", || fake.lists() > 0);
    let (status, worker, doc) = complete_at(&serve, "any-model", 0);
    assert_eq!((status, worker.as_deref()), (200, Some("fake")), "{doc}");
}

/// The probe's worker answering one model with a huge `pad` (150 MB there,
/// 64 MiB here) while six clients ask `GET /v1/models` at once: the build
/// before read the whole list for each client and the router peaked at
/// 1.11 GB. Now the router reads at most 4 MiB of it (and refuses it), and
/// clients get the lists learned: its peak resident memory stays under
/// 128 MiB (measured: see docs/serving.md).
#[test]
fn a_huge_model_list_does_not_bloat_the_router() {
    let (_a, a) = engine("alpha", "", "a");
    let fake = FakeWorker::start(ListShape::Padded { bytes: 64 << 20 });
    let (serve_proc, serve) = spawn_serve(&[a, fake.line("padded")], &["--public-introspection"]);
    eventually("a's models learned", || {
        models_of(&serve, "a") == json!(["alpha"])
    });
    eventually("the padded list asked", || fake.lists() > 0);
    eventually("clients are told of alpha", || {
        request(&serve, "GET", "/v1/models", "")
            .body
            .contains("\"alpha\"")
    });
    let clients: Vec<_> = (0..6)
        .map(|_| {
            let serve = serve.clone();
            std::thread::spawn(move || request(&serve, "GET", "/v1/models", ""))
        })
        .collect();
    let replies: Vec<_> = clients
        .into_iter()
        .map(|c| c.join().expect("a client"))
        .collect();
    let bound = 128 << 20;
    let peak = crate::support::peak_rss(serve_proc.0.id());
    assert!(peak < bound, "router peak RSS {} MiB", peak >> 20);
    for reply in replies {
        assert_eq!(reply.status, 200);
        assert!(
            reply.body.len() < 1 << 20,
            "{} bytes relayed",
            reply.body.len()
        );
        let ids: Vec<String> = reply.json()["data"]
            .as_array()
            .into_iter()
            .flatten()
            .filter_map(|m| m["id"].as_str().map(str::to_owned))
            .collect();
        assert_eq!(ids, ["alpha"]);
    }
    eventually("the list refused", || {
        count(&serve, "kvroute_proxy_model_lists_refused_total") >= 1
    });
    let peak = crate::support::peak_rss(serve_proc.0.id());
    assert!(peak < bound, "router peak RSS {} MiB", peak >> 20);
}

/// Clients' `GET /v1/models` is the union of the lists the router learned
/// (in the background, every 10 s), not a round of asking every worker
/// while the client waits (the build before asked each worker in turn, up
/// to 5 s each, for every client call).
#[test]
fn clients_get_the_learned_models_without_the_workers_being_asked() {
    let (_a, a) = engine("alpha", "", "a");
    let fake = FakeWorker::start(ListShape::Small(
        r#"{"object":"list","data":[{"id":"gamma","object":"model","max_model_len":4096}]}"#,
    ));
    let (_serve, serve) = spawn_serve(&[a, fake.line("g")], &["--public-introspection"]);
    eventually("both lists learned", || {
        models_of(&serve, "a") == json!(["alpha"]) && models_of(&serve, "g") == json!(["gamma"])
    });
    eventually("clients are told of both", || {
        let body = request(&serve, "GET", "/v1/models", "").body;
        body.contains("\"alpha\"") && body.contains("\"gamma\"")
    });
    let asked = fake.lists();
    for _ in 0..5 {
        let models: Value = request(&serve, "GET", "/v1/models", "").json();
        let ids: Vec<&str> = models["data"]
            .as_array()
            .into_iter()
            .flatten()
            .filter_map(|m| m["id"].as_str())
            .collect();
        assert_eq!(ids, ["alpha", "gamma"], "{models}");
        assert_eq!(
            models["data"][1]["max_model_len"], 4096,
            "the worker's card"
        );
    }
    // At most one background poll may have fallen in between.
    let more = fake.lists() - asked;
    assert!(
        more <= 1,
        "the worker was asked {more} times for 5 client calls"
    );
    let (status, worker, doc) = complete_at(&serve, "gamma", 0);
    assert_eq!((status, worker.as_deref()), (200, Some("g")), "{doc}");
}
