//! SGLang prefill/decode roles over real sockets: the bootstrap server, a
//! decode that arrives before its prefill, rooms that never fill, and
//! SGLang's 400s for malformed or missing bootstrap fields.

use std::net::SocketAddr;
use std::time::{Duration, Instant};

use kvroute_core::event::WorkerFlavor;
use kvroute_mocker::config::ConfigError;
use kvroute_mocker::{MockerConfig, ReplayFrames, Role};
use serde_json::{json, Value};

use super::common::*;
use super::pd_vllm::{engine, metric, prompt, stored_hashes};

/// Both legs' body: the request plus the bootstrap triple.
fn leg(prompt: &[u64], port: u16, room: u64) -> Value {
    let mut body = ids_prompt(prompt, 4);
    body["bootstrap_host"] = json!("127.0.0.1");
    body["bootstrap_port"] = json!(port);
    body["bootstrap_room"] = json!(room);
    body
}

/// The bootstrap port an SGLang prefill engine printed in its `--worker` line.
fn bootstrap_port(fleet: &TestFleet) -> u16 {
    let line = fleet.worker(0).worker_arg();
    line.split(',')
        .find_map(|kv| kv.strip_prefix("bootstrap_port="))
        .and_then(|p| p.parse().ok())
        .unwrap_or_else(|| panic!("no bootstrap_port in {line}"))
}

/// Asserts SGLang's flat error shape; returns the message.
fn sglang_error(r: &HttpResponse, status: u16) -> String {
    assert_eq!(r.status, status, "{}", r.text());
    let v = r.json();
    assert_eq!(v["object"], "error", "{v}");
    assert_eq!(v["code"], status);
    assert!(v.get("error").is_none(), "flat, not nested: {v}");
    v["message"].as_str().expect("message").to_owned()
}

#[test]
fn an_sglang_decode_sent_before_its_prefill_completes_once_the_prefill_arrives() {
    let p = TestFleet::start(engine(WorkerFlavor::Sglang, Role::Prefill));
    let d = TestFleet::start(engine(WorkerFlavor::Sglang, Role::Decode));
    let port = bootstrap_port(&p);
    assert_ne!(port, 0, "port 0 is replaced by the bound port");
    assert!(p
        .worker(0)
        .worker_arg()
        .contains(",role=prefill,bootstrap_port="));
    assert!(d.worker(0).worker_arg().ends_with(",role=decode"));
    assert_eq!(
        get(SocketAddr::from(([127, 0, 0, 1], port)), "/health").status,
        200
    );
    let (paddr, daddr) = (p.http(0), d.http(0));
    let prompt = prompt();
    let body = leg(&prompt, port, 42);

    let decode_body = body.clone();
    let decode = std::thread::spawn(move || post(daddr, "/v1/completions", &decode_body));
    std::thread::sleep(Duration::from_millis(300));
    assert!(!decode.is_finished(), "the decode waits for its room");
    let pre = post(paddr, "/v1/completions", &body);
    assert_eq!(pre.status, 200, "{}", pre.text());
    assert_eq!(
        pre.json()["usage"]["completion_tokens"],
        1,
        "a prefill generates one token"
    );
    let r = decode.join().expect("decode thread");
    assert_eq!(r.status, 200, "{}", r.text());
    let v = r.json();
    assert_eq!(cached_tokens(&v), 99);
    assert_eq!(v["usage"]["completion_tokens"], 4);

    let events = all_events(&replay(&d.replay(0, 0), 0, ReplayFrames::Four), 16);
    let chain = engine_chain(WorkerFlavor::Sglang, &prompt, 16);
    assert_eq!(stored_hashes(&events), chain[..6]);
    assert_eq!(
        metric(daddr, "kvroute_mocker_kv_transfers_received_total"),
        1.0
    );
    assert_eq!(
        metric(daddr, "kvroute_mocker_kv_transfer_blocks_total"),
        7.0
    );
    // The decode said it was done: the room is closed, the blocks released.
    assert_eq!(metric(paddr, "kvroute_mocker_kv_transfers_sent_total"), 1.0);
    assert_eq!(metric(paddr, "kvroute_mocker_held_blocks"), 0.0);
    assert_eq!(metric(paddr, "kvroute_mocker_bootstrap_rooms"), 0.0);
    // A prefill sent first works the same; streaming legs too.
    let mut body = leg(&prompt, port, 43);
    body["stream"] = json!(true);
    assert_eq!(post(paddr, "/v1/completions", &body).status, 200);
    let r = post(daddr, "/v1/completions", &body);
    assert_eq!(r.status, 200);
    assert!(r.sse_data().last().is_some_and(|d| d == "[DONE]"));
    assert_eq!(
        metric(daddr, "kvroute_mocker_kv_transfers_received_total"),
        2.0
    );
}

#[test]
fn a_room_that_never_fills_times_out_with_an_error() {
    let p = TestFleet::start(engine(WorkerFlavor::Sglang, Role::Prefill));
    let d = TestFleet::start(MockerConfig {
        kv_lease: Duration::from_millis(500),
        ..engine(WorkerFlavor::Sglang, Role::Decode)
    });
    let port = bootstrap_port(&p);
    let started = Instant::now();
    let r = post(d.http(0), "/v1/completions", &leg(&prompt(), port, 7));
    assert!(started.elapsed() >= Duration::from_millis(500));
    let message = sglang_error(&r, 500);
    assert!(
        message.starts_with("KVTransferError(bootstrap_room=7): "),
        "{message}"
    );
    assert!(message.contains("never arrived"), "{message}");
    // Nobody at the bootstrap port at all: the same error after the wait.
    let closed = std::net::TcpListener::bind("127.0.0.1:0")
        .and_then(|l| l.local_addr())
        .expect("port")
        .port();
    let r = post(d.http(0), "/v1/completions", &leg(&prompt(), closed, 8));
    let message = sglang_error(&r, 500);
    assert!(message.contains("not reached"), "{message}");
    assert_eq!(
        metric(d.http(0), "kvroute_mocker_kv_transfer_failures_total"),
        2.0
    );
}

#[test]
fn a_decode_refuses_a_room_its_prefill_filled_with_another_prompt() {
    let p = TestFleet::start(engine(WorkerFlavor::Sglang, Role::Prefill));
    let d = TestFleet::start(engine(WorkerFlavor::Sglang, Role::Decode));
    let port = bootstrap_port(&p);
    let prompt = prompt();
    assert_eq!(
        post(p.http(0), "/v1/completions", &leg(&prompt, port, 9)).status,
        200
    );
    // The same room again is a second request: refused.
    let again = post(p.http(0), "/v1/completions", &leg(&prompt, port, 9));
    assert!(sglang_error(&again, 400).contains("already in use"));
    let other: Vec<u64> = prompt.iter().map(|t| t + 1).collect();
    let r = post(d.http(0), "/v1/completions", &leg(&other, port, 9));
    assert!(sglang_error(&r, 500).contains("another prompt"));
}

#[test]
fn malformed_or_missing_bootstrap_fields_get_sglang_400s() {
    let p = TestFleet::start(engine(WorkerFlavor::Sglang, Role::Prefill));
    let d = TestFleet::start(engine(WorkerFlavor::Sglang, Role::Decode));
    let ok = leg(&[1, 2, 3], 8998, 1);
    let with = |key: &str, value: Value| {
        let mut body = ok.clone();
        match value {
            Value::Null => {
                body.as_object_mut().expect("object").remove(key);
            }
            v => body[key] = v,
        }
        body
    };
    let malformed = [
        (
            "bootstrap_room",
            json!("abc"),
            "`bootstrap_room` must be a non-negative integer",
        ),
        (
            "bootstrap_room",
            json!(-1),
            "`bootstrap_room` must be a non-negative integer",
        ),
        (
            "bootstrap_room",
            json!([1, 2]),
            "`bootstrap_room` has 2 entries",
        ),
        (
            "bootstrap_room",
            Value::Null,
            "bootstrap_room should not be None",
        ),
        (
            "bootstrap_host",
            json!(5),
            "`bootstrap_host` must be a non-empty string",
        ),
        (
            "bootstrap_port",
            json!("x"),
            "`bootstrap_port` must be a port number",
        ),
        (
            "bootstrap_port",
            json!([1, 2]),
            "`bootstrap_port` has 2 entries",
        ),
    ];
    for engine in [&p, &d] {
        for (key, value, says) in &malformed {
            let r = post(engine.http(0), "/v1/completions", &with(key, value.clone()));
            let message = sglang_error(&r, 400);
            assert!(message.contains(says), "{key}={value}: {message}");
            assert_eq!(r.json()["type"], "BadRequestError");
        }
    }
    // A decode needs the prefill's address too; a prefill only its room.
    for key in ["bootstrap_host", "bootstrap_port"] {
        let r = post(d.http(0), "/v1/completions", &with(key, Value::Null));
        assert!(sglang_error(&r, 400).contains(&format!("`{key}` is required")));
    }
    let mut only_room = ids_prompt(&[1, 2, 3], 1);
    only_room["bootstrap_room"] = json!([77]);
    assert_eq!(post(p.http(0), "/v1/completions", &only_room).status, 200);
    // Chat bodies are checked the same way.
    let chat = json!({"messages": [{"role": "user", "content": "hi"}], "bootstrap_room": "x"});
    let r = post(p.http(0), "/v1/chat/completions", &chat);
    sglang_error(&r, 400);
    // An ordinary SGLang engine ignores the fields, as before.
    let both = TestFleet::start(engine(WorkerFlavor::Sglang, Role::Both));
    assert!(!both.worker(0).worker_arg().contains("role="));
    let r = post(
        both.http(0),
        "/v1/completions",
        &with("bootstrap_room", json!("abc")),
    );
    assert_eq!(r.status, 200);
}

/// SGLang `both` engines with `--kv-both` are both ends of a bootstrap
/// hand-off: the engine whose own server the legs name is the source (one
/// token, its blocks held), the other reads the blocks it lacks after the
/// modelled transfer, publishes them as stored and reports them cached.
#[test]
fn sglang_both_engines_with_kv_both_hand_a_prefix_over() {
    let both = || {
        TestFleet::start(MockerConfig {
            kv_both: true,
            ..engine(WorkerFlavor::Sglang, Role::Both)
        })
    };
    let (holder, receiver) = (both(), both());
    let line = holder.worker(0).worker_arg();
    assert!(!line.contains("role="), "{line}");
    let port = bootstrap_port(&holder);
    let (haddr, raddr) = (holder.http(0), receiver.http(0));
    let prompt = prompt();
    // Without a room a request is an ordinary one: the holder caches the prompt.
    let plain = post(haddr, "/v1/completions", &ids_prompt(&prompt, 2));
    assert_eq!(plain.json()["usage"]["completion_tokens"], 2);

    let body = leg(&prompt, port, 9);
    let receiver_body = body.clone();
    let read = std::thread::spawn(move || post(raddr, "/v1/completions", &receiver_body));
    let source = post(haddr, "/v1/completions", &body);
    assert_eq!(source.status, 200, "{}", source.text());
    let source = source.json();
    assert_eq!(source["usage"]["completion_tokens"], 1, "the source leg");
    assert_eq!(
        cached_tokens(&source),
        96,
        "the holder had the prompt cached"
    );
    let r = read.join().expect("receiver thread");
    assert_eq!(r.status, 200, "{}", r.text());
    let v = r.json();
    assert_eq!(cached_tokens(&v), 99, "the prompt arrived: {v}");
    assert_eq!(v["usage"]["completion_tokens"], 4);
    let events = all_events(&replay(&receiver.replay(0, 0), 0, ReplayFrames::Four), 16);
    let chain = engine_chain(WorkerFlavor::Sglang, &prompt, 16);
    assert_eq!(stored_hashes(&events), chain[..6], "announced as stored");
    let received = "kvroute_mocker_kv_transfers_received_total";
    assert_eq!(metric(raddr, received), 1.0);
    assert_eq!(
        metric(raddr, "kvroute_mocker_kv_transfer_blocks_total"),
        7.0
    );
    assert_eq!(metric(haddr, "kvroute_mocker_kv_transfers_sent_total"), 1.0);
    assert_eq!(metric(haddr, "kvroute_mocker_bootstrap_rooms"), 0.0);
    // Only SGLang `both` engines take the flag.
    for (flavor, role) in [
        (WorkerFlavor::Vllm, Role::Both),
        (WorkerFlavor::Sglang, Role::Prefill),
    ] {
        let config = MockerConfig {
            kv_both: true,
            ..engine(flavor, role)
        };
        assert_eq!(config.validate(), Err(ConfigError::KvBoth));
    }
}
