//! vLLM prefill/decode roles over real sockets: a prefill engine's
//! `kv_transfer_params`, a decode engine reading them (events, cached
//! tokens, the modelled delay), invalid and malformed fields.

use std::net::SocketAddr;
use std::time::{Duration, Instant};

use kvroute_core::event::{KvEvent, WorkerFlavor};
use kvroute_mocker::{MockerConfig, Role};
use serde_json::{json, Value};

use super::common::*;

/// A fast engine of `flavor` in `role` on ephemeral ports.
pub(super) fn engine(flavor: WorkerFlavor, role: Role) -> MockerConfig {
    MockerConfig {
        role,
        bootstrap_port: 0,
        ..config(flavor)
    }
}

/// The value of the first sample of `name` (`name{…} value`) on `/metrics`.
pub(super) fn metric(addr: SocketAddr, name: &str) -> f64 {
    let text = get(addr, "/metrics").text();
    let prefix = format!("{name}{{");
    text.lines()
        .find(|l| l.starts_with(&prefix))
        .and_then(|l| l.rsplit(' ').next())
        .and_then(|v| v.parse().ok())
        .unwrap_or_else(|| panic!("no {name} in\n{text}"))
}

/// Polls `name` until it equals `want` (at most 10 s).
pub(super) fn await_metric(addr: SocketAddr, name: &str, want: f64) {
    let deadline = Instant::now() + Duration::from_secs(10);
    while metric(addr, name) != want {
        assert!(Instant::now() < deadline, "{name} never reached {want}");
        std::thread::sleep(Duration::from_millis(10));
    }
}

/// The published hashes of every `BlockStored` in `events`, in order.
pub(super) fn stored_hashes(events: &[KvEvent]) -> Vec<u64> {
    events
        .iter()
        .filter_map(|e| match e {
            KvEvent::Stored(s) => Some(s.blocks.iter().map(|b| b.external.0).collect::<Vec<_>>()),
            _ => None,
        })
        .flatten()
        .collect()
}

/// A 100-token prompt (7 blocks of 16, 6 of them full).
pub(super) fn prompt() -> Vec<u64> {
    (5000..5100).collect()
}

/// The prefill leg as the router sends it.
fn prefill_leg(prompt: &[u64]) -> Value {
    let mut body = ids_prompt(prompt, 1);
    body["stream"] = json!(false);
    body["kv_transfer_params"] = json!({
        "do_remote_decode": true, "do_remote_prefill": false, "remote_engine_id": null,
        "remote_block_ids": null, "remote_host": null, "remote_port": null,
    });
    body
}

/// The decode leg: the original request plus the prefill's answer verbatim.
fn decode_leg(prompt: &[u64], params: &Value) -> Value {
    let mut body = ids_prompt(prompt, 4);
    body["kv_transfer_params"] = params.clone();
    body
}

/// Runs the prefill leg; its `kv_transfer_params`.
fn prefill(addr: SocketAddr, prompt: &[u64]) -> Value {
    let r = post(addr, "/v1/completions", &prefill_leg(prompt));
    assert_eq!(r.status, 200, "{}", r.text());
    r.json()["kv_transfer_params"].clone()
}

#[test]
fn a_vllm_prefill_hands_off_its_blocks_and_the_decode_publishes_and_caches_them() {
    let p = TestFleet::start(engine(WorkerFlavor::Vllm, Role::Prefill));
    let d = TestFleet::start(engine(WorkerFlavor::Vllm, Role::Decode));
    assert!(p
        .worker(0)
        .worker_arg()
        .ends_with(",block_size=16,role=prefill"));
    assert!(d
        .worker(0)
        .worker_arg()
        .ends_with(",block_size=16,role=decode"));
    let prompt = prompt();

    let answer = post(p.http(0), "/v1/completions", &prefill_leg(&prompt)).json();
    assert_eq!(answer["usage"]["completion_tokens"], 1);
    let params = &answer["kv_transfer_params"];
    let paddr = p.http(0);
    assert_eq!(params["do_remote_prefill"], true);
    assert_eq!(params["do_remote_decode"], false);
    assert_eq!(
        params["remote_engine_id"],
        format!("w0@127.0.0.1:{}", paddr.port())
    );
    assert_eq!(params["remote_host"], "127.0.0.1");
    assert_eq!(params["remote_port"], paddr.port());
    assert_eq!(params["tp_size"], 1);
    assert!(params["remote_request_id"]
        .as_str()
        .is_some_and(|s| s.starts_with("w0-0-")));
    let groups = params["remote_block_ids"].as_array().expect("groups");
    assert_eq!(groups.len(), 1, "one KV-cache group");
    assert_eq!(
        groups[0].as_array().expect("ids").len(),
        7,
        "ceil(100 / 16) blocks"
    );
    assert_eq!(metric(paddr, "kvroute_mocker_held_blocks"), 7.0);
    assert_eq!(metric(paddr, "kvroute_mocker_kv_transfers_sent_total"), 1.0);

    let sub = subscribe(&d.events(0, 0));
    let r = post(d.http(0), "/v1/completions", &decode_leg(&prompt, params));
    assert_eq!(r.status, 200, "{}", r.text());
    let v = r.json();
    // vLLM counts every transferred token but the last as cached.
    assert_eq!(cached_tokens(&v), 99);
    assert_eq!(v["usage"]["completion_tokens"], 4);
    assert!(
        v.get("kv_transfer_params").is_none(),
        "a decode leg hands nothing on"
    );
    let events = all_events(&recv_n(&sub, 1), 16);
    let chain = engine_chain(WorkerFlavor::Vllm, &prompt, 16);
    assert_eq!(
        stored_hashes(&events),
        chain[..6],
        "the 6 full blocks, as one store"
    );
    assert_eq!(events.len(), 1);
    // The read released the prefill's blocks.
    assert_eq!(metric(paddr, "kvroute_mocker_held_blocks"), 0.0);
    let daddr = d.http(0);
    assert_eq!(
        metric(daddr, "kvroute_mocker_kv_transfers_received_total"),
        1.0
    );
    assert_eq!(
        metric(daddr, "kvroute_mocker_kv_received_tokens_total"),
        99.0,
        "every prompt token but the last arrived computed"
    );
    assert_eq!(
        metric(daddr, "kvroute_mocker_kv_transfer_blocks_total"),
        7.0
    );
    assert_eq!(
        metric(daddr, "kvroute_mocker_kv_transfer_failures_total"),
        0.0
    );
    // The decode engine now serves the prompt from its own cache.
    let again = post(daddr, "/v1/completions", &ids_prompt(&prompt, 1)).json();
    assert_eq!(cached_tokens(&again), 96);
}

#[test]
fn a_vllm_decode_waits_the_modelled_transfer_of_the_blocks_it_lacks() {
    let p = TestFleet::start(engine(WorkerFlavor::Vllm, Role::Prefill));
    // 50 s per block at speedup 1000: 50 ms per block.
    let d = TestFleet::start(MockerConfig {
        transfer_us_per_block: 50_000_000,
        ..engine(WorkerFlavor::Vllm, Role::Decode)
    });
    let (paddr, daddr) = (p.http(0), d.http(0));
    let prompt = prompt();
    let params = prefill(paddr, &prompt);
    let started = Instant::now();
    let r = post(daddr, "/v1/completions", &decode_leg(&prompt, &params));
    assert_eq!(r.status, 200);
    assert!(
        started.elapsed() >= Duration::from_millis(350),
        "7 blocks × 50 ms"
    );
    let waited = metric(daddr, "kvroute_mocker_kv_transfer_wait_seconds_total");
    assert!((waited - 0.35).abs() < 1e-9, "{waited}");
    // A second request for the prompt: 6 blocks are cached here, 1 moves.
    let params = prefill(paddr, &prompt);
    let started = Instant::now();
    let v = post(daddr, "/v1/completions", &decode_leg(&prompt, &params)).json();
    assert!(started.elapsed() >= Duration::from_millis(50));
    assert_eq!(cached_tokens(&v), 99);
    assert_eq!(
        metric(daddr, "kvroute_mocker_kv_transfer_blocks_total"),
        8.0
    );
    let waited = metric(daddr, "kvroute_mocker_kv_transfer_wait_seconds_total");
    assert!((waited - 0.40).abs() < 1e-9, "{waited}");
}

#[test]
fn invalid_or_unreadable_transfers_are_computed_locally_and_counted() {
    let d = TestFleet::start(engine(WorkerFlavor::Vllm, Role::Decode));
    let daddr = d.http(0);
    let prompt = prompt();
    // do_remote_prefill without remote_host: vLLM's "invalid KVTransferParams".
    let params = json!({
        "do_remote_prefill": true, "do_remote_decode": false, "remote_block_ids": [[1, 2]],
        "remote_engine_id": "e", "remote_request_id": "r", "remote_port": 1,
    });
    let v = post(daddr, "/v1/completions", &decode_leg(&prompt, &params)).json();
    assert_eq!(cached_tokens(&v), 0, "computed here");
    assert_eq!(v["usage"]["completion_tokens"], 4);
    assert_eq!(
        metric(daddr, "kvroute_mocker_kv_transfer_params_invalid_total"),
        1.0
    );
    // Every field, but nobody listens there: the read fails, computed here.
    let closed = std::net::TcpListener::bind("127.0.0.1:0")
        .and_then(|l| l.local_addr())
        .expect("port")
        .port();
    let mut params = params;
    params["remote_host"] = json!("127.0.0.1");
    params["remote_port"] = json!(closed);
    let other: Vec<u64> = (1..=50).collect();
    let v = post(daddr, "/v1/completions", &decode_leg(&other, &params)).json();
    assert_eq!(cached_tokens(&v), 0);
    assert_eq!(
        metric(daddr, "kvroute_mocker_kv_transfer_failures_total"),
        1.0
    );
    assert_eq!(
        metric(daddr, "kvroute_mocker_kv_transfers_received_total"),
        0.0
    );
}

#[test]
fn held_blocks_are_released_by_one_read_or_when_the_lease_ends() {
    let p = TestFleet::start(MockerConfig {
        kv_lease: Duration::from_secs(1),
        ..engine(WorkerFlavor::Vllm, Role::Prefill)
    });
    let paddr = p.http(0);
    let read = |params: &Value| {
        let body = json!({
            "remote_engine_id": params["remote_engine_id"],
            "remote_request_id": params["remote_request_id"],
        });
        post(paddr, "/internal/nixl/read", &body)
    };
    let params = prefill(paddr, &prompt());
    let r = read(&params);
    assert_eq!(
        (r.status, r.json()["released_blocks"].clone()),
        (200, json!(7))
    );
    assert_eq!(read(&params).status, 404, "released once");
    let mut wrong = params.clone();
    wrong["remote_engine_id"] = json!("w0@elsewhere:1");
    assert_eq!(read(&wrong).status, 404);
    assert_eq!(post(paddr, "/internal/nixl/read", &json!({})).status, 400);

    let params = prefill(paddr, &(1..=40).collect::<Vec<u64>>());
    let held_at = Instant::now();
    assert_eq!(metric(paddr, "kvroute_mocker_held_blocks"), 3.0);
    await_metric(paddr, "kvroute_mocker_held_blocks", 0.0);
    assert!(
        held_at.elapsed() >= Duration::from_millis(500),
        "held for the lease"
    );
    assert_eq!(read(&params).status, 404, "the lease ended");
}

#[test]
fn malformed_kv_transfer_params_get_vllm_400s_on_prefill_and_decode_engines() {
    let cases = [
        (
            json!("x"),
            "kv_transfer_params: Input should be a valid dictionary",
        ),
        (
            json!([1]),
            "kv_transfer_params: Input should be a valid dictionary",
        ),
        (
            json!({"do_remote_decode": "yes"}),
            "kv_transfer_params.do_remote_decode",
        ),
        (
            json!({"do_remote_prefill": 1}),
            "kv_transfer_params.do_remote_prefill",
        ),
        (
            json!({"remote_engine_id": 5}),
            "kv_transfer_params.remote_engine_id",
        ),
        (
            json!({"remote_request_id": []}),
            "kv_transfer_params.remote_request_id",
        ),
        (json!({"remote_host": {}}), "kv_transfer_params.remote_host"),
        (
            json!({"remote_port": "8100"}),
            "kv_transfer_params.remote_port",
        ),
        (
            json!({"remote_port": 65536}),
            "kv_transfer_params.remote_port",
        ),
        (
            json!({"remote_block_ids": [["a"]]}),
            "kv_transfer_params.remote_block_ids",
        ),
        (json!({"tp_size": 0}), "kv_transfer_params.tp_size"),
    ];
    for role in [Role::Prefill, Role::Decode] {
        let fleet = TestFleet::start(engine(WorkerFlavor::Vllm, role));
        for (params, names) in &cases {
            for path in ["/v1/completions", "/v1/chat/completions"] {
                let mut body = if path == "/v1/completions" {
                    ids_prompt(&[1, 2, 3], 1)
                } else {
                    json!({"messages": [{"role": "user", "content": "hi"}], "max_tokens": 1})
                };
                body["kv_transfer_params"] = params.clone();
                let r = post(fleet.http(0), path, &body);
                assert_eq!(r.status, 400, "{role}: {params}");
                let error = &r.json()["error"];
                assert_eq!(error["type"], "BadRequestError");
                assert_eq!(error["code"], 400);
                let message = error["message"].as_str().expect("message");
                assert!(message.contains(names), "{message}");
            }
        }
    }
    // A vLLM `both` engine is both ends of its connector: it reads the
    // field, answers a `do_remote_decode` leg with the params to read its
    // blocks by, and serves its side channel; its `/metrics` are unchanged.
    let both = TestFleet::start(engine(WorkerFlavor::Vllm, Role::Both));
    let mut body = ids_prompt(&[1, 2, 3], 1);
    body["kv_transfer_params"] = json!("x");
    assert_eq!(post(both.http(0), "/v1/completions", &body).status, 400);
    body["kv_transfer_params"] = json!({"do_remote_decode": true});
    let r = post(both.http(0), "/v1/completions", &body);
    assert_eq!(r.status, 200);
    let params = r.json()["kv_transfer_params"].clone();
    assert_eq!(params["do_remote_prefill"], true, "{params}");
    let read = json!({
        "remote_engine_id": params["remote_engine_id"],
        "remote_request_id": params["remote_request_id"],
    });
    assert_eq!(post(both.http(0), "/internal/nixl/read", &read).status, 200);
    assert_eq!(post(both.http(0), "/internal/nixl/read", &read).status, 404);
    assert!(!get(both.http(0), "/metrics").text().contains("kv_transfer"));
}
