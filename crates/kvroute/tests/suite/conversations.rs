//! Conversations belong to the client that started them, at one router and
//! across replicas: another tenant or API key that names someone's
//! `previous_response_id` gets the same 404 as for an id no one made (the
//! engine, which keeps every response for whoever names it, never sees
//! the request), and a session id named by another client is another
//! session. The replicas' pins bucket, which NATS loses when it restarts,
//! is made again, and pins are shared again. Real `kvroute serve`,
//! `kvroute mocker` and `nats-server` processes.

use kvroute_loadgen::nats::NatsServer;
use serde_json::{json, Value};

use super::priority::TRUST_HEADERS;
use crate::support::http::{count, request_with, Reply};
use crate::support::{
    eventually, spawn_serve_with_env, start_mocker_with, start_serve_with_env, Proc,
};

/// A client: its tenant header and its API key, if any.
struct Who {
    tenant: &'static str,
    key: Option<&'static str>,
}

const ALICE: Who = Who {
    tenant: "alice",
    key: Some("sk-alice"),
};
const BOB: Who = Who {
    tenant: "bob",
    key: Some("sk-bob"),
};

/// One request of `who`'s, with `session` if any.
fn post(serve: &str, who: &Who, session: Option<&str>, path: &str, body: &Value) -> Reply {
    let auth = who.key.map(|k| format!("Bearer {k}"));
    let mut headers = vec![("x-tenant", who.tenant)];
    headers.extend(auth.as_deref().map(|a| ("authorization", a)));
    headers.extend(session.map(|s| ("x-session-id", s)));
    request_with(serve, "POST", path, &headers, &body.to_string())
}

/// A Responses API turn of `who`'s, continuing `previous` if given.
fn respond(serve: &str, who: &Who, previous: Option<&str>) -> Reply {
    let mut body = json!({"model": "mock-model", "input": "My PIN is 4921. Noted?",
        "max_output_tokens": 4});
    if let Some(p) = previous {
        body["previous_response_id"] = json!(p);
        body["input"] = json!("What did I say my PIN was?");
    }
    post(serve, who, None, "/v1/responses", &body)
}

/// A turn that must succeed: its response id and the worker it went to.
fn turn(serve: &str, who: &Who, previous: Option<&str>) -> (String, String) {
    let reply = respond(serve, who, previous);
    assert_eq!(reply.status, 200, "{}", reply.body);
    let id = reply.json()["id"].as_str().expect("an id").to_owned();
    (id, reply.header("x-kvroute-worker").expect("routed"))
}

/// A continuation that must be refused as an unknown id is: 404 in the
/// Responses API's error shape, from the router (no worker named).
fn refused(reply: &Reply, id: &str, what: &str) {
    assert_eq!(reply.status, 404, "{what}: {}", reply.body);
    assert_eq!(reply.header("x-kvroute-worker"), None, "{what}: forwarded");
    let error = &reply.json()["error"];
    assert_eq!(error["type"], "invalid_request_error", "{what}: {error}");
    assert_eq!(error["param"], "previous_response_id", "{what}: {error}");
    assert_eq!(
        error["message"],
        format!("Response with id '{id}' not found."),
        "{what}"
    );
}

/// The probe's cross-tenant continuation (bob, another tenant and another
/// key, named alice's response id) and its variants: each refused exactly
/// as an id no one made, while alice's own turns stay on her engine.
#[test]
fn another_owners_continuation_is_refused_like_an_unknown_id() {
    let (_mocker, lines) = start_mocker_with(3, &["--speedup", "50"]);
    // Round-robin moves every request but a pinned continuation.
    let (_serve, serve) =
        start_serve_with_env(&lines, &["--policy", "round-robin"], &[TRUST_HEADERS]);
    let (mut id, home) = turn(&serve, &ALICE, None);
    let stolen = respond(&serve, &BOB, Some(&id));
    refused(&stolen, &id, "bob continued alice's response");
    let nobody = "resp_0123456789abcdef0123456789abcdef";
    let unknown = respond(&serve, &BOB, Some(nobody));
    refused(&unknown, nobody, "an id no one made");
    assert_eq!(
        stolen.body.replace(&id, "ID"),
        unknown.body.replace(nobody, "ID"),
        "the two refusals differ"
    );
    // Bob naming alice's tenant still has his own key.
    let spoofed = Who {
        tenant: "alice",
        key: Some("sk-bob"),
    };
    refused(
        &respond(&serve, &spoofed, Some(&id)),
        &id,
        "alice's tenant, bob's key",
    );
    // Without keys the tenant header is the owner.
    let (carols, _) = turn(
        &serve,
        &Who {
            tenant: "carol",
            key: None,
        },
        None,
    );
    let dave = Who {
        tenant: "dave",
        key: None,
    };
    refused(
        &respond(&serve, &dave, Some(&carols)),
        &carols,
        "dave continued carol's",
    );
    assert_eq!(count(&serve, "kvroute_proxy_continuation_refused_total"), 4);
    for k in 0..3 {
        let (next, worker) = turn(&serve, &ALICE, Some(&id));
        assert_eq!(worker, home, "alice's turn {k} left her engine");
        id = next;
    }
}

/// A replica named `id` on `nats`, routing round-robin.
fn replica(lines: &[String], nats: &NatsServer, id: &str) -> (Proc, String) {
    let url = nats.url();
    let env = [
        ("KVROUTE_NATS", url.as_str()),
        ("KVROUTE_REPLICA_ID", id),
        TRUST_HEADERS,
    ];
    let (proc, serve) = spawn_serve_with_env(lines, &["--policy", "round-robin"], &env);
    eventually("the replica routes", || {
        std::net::TcpStream::connect(&serve).is_ok()
            && respond(
                &serve,
                &Who {
                    tenant: "probe",
                    key: None,
                },
                None,
            )
            .status
                == 200
    });
    (proc, serve)
}

const PINS_SENT: &str = "kvroute_replica_pins_sent_total";
const PINS_DROPPED: &str = "kvroute_replica_pins_dropped_total";
const PINS_RECEIVED: &str = "kvroute_replica_pins_received_total";

/// Alice's response made at `a`, once its pin is put in the bucket and
/// applied at `b` (a pin `a` could not put, counted as dropped, is tried
/// again with a new response, while the bucket is not there): its id and
/// worker.
fn pinned_across(a: &str, b: &str) -> (String, String) {
    let received = count(b, PINS_RECEIVED);
    let mut pinned = None;
    eventually("a pin made at A is put in the pins bucket", || {
        let (sent, dropped) = (count(a, PINS_SENT), count(a, PINS_DROPPED));
        let made = turn(a, &ALICE, None);
        eventually("the pin is put in the bucket or dropped", || {
            count(a, PINS_SENT) > sent || count(a, PINS_DROPPED) > dropped
        });
        let put = count(a, PINS_SENT) > sent;
        pinned = put.then_some(made);
        put
    });
    eventually("the peer applied the pin", || {
        count(b, PINS_RECEIVED) > received
    });
    pinned.expect("pinned")
}

/// The same refusal when the response was made at another replica: the
/// peer that bob asks knows alice's pin (it applied it) and still refuses
/// him, and serves alice on her engine.
#[test]
fn a_peers_pin_is_refused_to_another_owner() {
    let nats = NatsServer::start().expect("nats-server starts");
    let (_mocker, lines) = start_mocker_with(3, &["--speedup", "50"]);
    let ((_a, a), (_b, b)) = (replica(&lines, &nats, "a"), replica(&lines, &nats, "b"));
    let (id, home) = pinned_across(&a, &b);
    refused(&respond(&b, &BOB, Some(&id)), &id, "bob at the peer");
    for k in 0..2 {
        let (_, worker) = turn(&b, &ALICE, Some(&id));
        assert_eq!(worker, home, "alice's turn {k} at the peer left her engine");
    }
}

/// A plain NATS client (the text protocol over TCP) subscribed to
/// `subject`: each message's subject and payload, as any client allowed on
/// the server reads them. Returns once the server confirmed the
/// subscription (its `PONG` after the `SUB`).
fn nats_listener(port: u16, subject: &str) -> std::sync::mpsc::Receiver<(String, Vec<u8>)> {
    use std::io::{BufRead, BufReader, Read, Write};
    let mut socket = std::net::TcpStream::connect(("127.0.0.1", port)).expect("NATS");
    let hello = format!("CONNECT {{\"verbose\":false}}\r\nSUB {subject} 1\r\nPING\r\n");
    socket.write_all(hello.as_bytes()).expect("subscribed");
    let mut reader = BufReader::new(socket);
    let mut line = String::new();
    while !line.starts_with("PONG") {
        line.clear();
        assert!(
            reader.read_line(&mut line).expect("NATS answers") > 0,
            "NATS closed"
        );
    }
    let (tx, rx) = std::sync::mpsc::channel();
    std::thread::spawn(move || loop {
        let mut line = String::new();
        if reader.read_line(&mut line).unwrap_or(0) == 0 {
            return;
        }
        let words: Vec<&str> = line.split_whitespace().collect();
        if words.first() != Some(&"MSG") {
            continue;
        }
        let size: usize = words.last().and_then(|n| n.parse().ok()).unwrap_or(0);
        let mut payload = vec![0; size + 2];
        if reader.read_exact(&mut payload).is_err() {
            return;
        }
        payload.truncate(size);
        let _ = tx.send((words[1].to_owned(), payload));
    });
    rx
}

/// The probe's other half: a NATS client reading the pins bucket's
/// subjects saw every response and session id in the clear, enough to
/// continue anyone's conversation. Now it sees keyed hashes and values
/// without ids.
#[test]
fn the_pins_bucket_holds_no_id_in_the_clear() {
    let nats = NatsServer::start().expect("nats-server starts");
    // Listening from the start: every pin put is seen.
    let pins = nats_listener(nats.port(), "$KV.kvroute-pins.>");
    let (_mocker, lines) = start_mocker_with(2, &["--speedup", "50"]);
    let (_a, a) = replica(&lines, &nats, "a");
    let sent = count(&a, PINS_SENT);
    let (id, _) = turn(&a, &ALICE, None);
    let session = "conv-4921-secret";
    session_turn(&a, &ALICE, session, 0);
    eventually("both pins are put", || count(&a, PINS_SENT) >= sent + 2);
    let put = count(&a, PINS_SENT);
    let seen: Vec<(String, Vec<u8>)> = (0..put)
        .map(|_| {
            let got = pins.recv_timeout(std::time::Duration::from_secs(30));
            got.expect("every pin put is seen by a subscriber")
        })
        .collect();
    let id_hex = id.trim_start_matches("resp_");
    for (subject, payload) in &seen {
        let text = format!("{subject} {}", String::from_utf8_lossy(payload));
        assert!(
            !text.contains(id_hex) && !text.contains(session),
            "an id in the clear: {text:?}"
        );
    }
    for (subject, _) in &seen {
        let key = subject.rsplit('.').next().unwrap_or_default();
        assert!(
            key.len() == 64 && key.bytes().all(|b| b.is_ascii_hexdigit()),
            "not a keyed hash: {subject}"
        );
    }
}

/// A completion of `who`'s in session `session`: the worker it went to.
fn session_turn(serve: &str, who: &Who, session: &str, k: u32) -> String {
    let tokens: Vec<u32> = (0..64 * (k + 1)).map(|i| 9_000 + i).collect();
    let body = json!({"model": "mock-model", "prompt": tokens, "max_tokens": 1});
    let reply = post(serve, who, Some(session), "/v1/completions", &body);
    assert_eq!(reply.status, 200, "{}", reply.body);
    reply.header("x-kvroute-worker").expect("routed")
}

/// Bob naming alice's session id (even under her tenant) starts a session
/// of his own: the router does not steer him to her rank.
#[test]
fn a_session_id_named_by_another_owner_is_another_session() {
    let (_mocker, lines) = start_mocker_with(2, &["--speedup", "50"]);
    let (_serve, serve) =
        start_serve_with_env(&lines, &["--policy", "round-robin"], &[TRUST_HEADERS]);
    let kept = || count(&serve, "kvroute_proxy_session_kept_total");
    let moved = || count(&serve, "kvroute_proxy_session_moved_total");
    let home = session_turn(&serve, &ALICE, "conv-1", 0);
    for k in 1..3 {
        assert_eq!(session_turn(&serve, &ALICE, "conv-1", k), home);
    }
    assert_eq!((kept(), moved()), (2, 0), "alice's session is kept");
    let spoofed = Who {
        tenant: "alice",
        key: Some("sk-bob"),
    };
    for who in [&BOB, &spoofed] {
        session_turn(&serve, who, "conv-1", 0);
        assert_eq!(
            (kept(), moved()),
            (2, 0),
            "bob's first turn as {} found alice's session",
            who.tenant
        );
    }
    // Bob's own session is kept as alice's is.
    session_turn(&serve, &BOB, "conv-1", 1);
    assert_eq!(kept(), 3);
}

/// The probe's NATS restart: nats-server killed (SIGKILL) and started again
/// on the same port and store comes back without the in-memory pins
/// bucket. The replicas make it again, and a response made at one is
/// continued at the other on its engine.
#[test]
fn pins_are_shared_again_after_nats_restarts_without_them() {
    let mut nats = NatsServer::start().expect("nats-server starts");
    let (_mocker, lines) = start_mocker_with(3, &["--speedup", "50"]);
    let ((_a, a), (_b, b)) = (replica(&lines, &nats, "a"), replica(&lines, &nats, "b"));
    pinned_across(&a, &b);
    let outages = |s: &str| count(s, "kvroute_replica_nats_outages_total");
    nats.kill().expect("nats killed");
    for s in [&a, &b] {
        eventually("the replica counts the outage", || outages(s) >= 1);
    }
    nats.restart()
        .expect("nats restarts on the same port and store");
    for s in [&a, &b] {
        eventually("the replica is connected again", || {
            crate::support::http::metric(s, "kvroute_replica_nats_connected") == Some(1.0)
        });
    }
    let (id, home) = pinned_across(&a, &b);
    for k in 0..2 {
        let (_, worker) = turn(&b, &ALICE, Some(&id));
        assert_eq!(worker, home, "turn {k} at the peer left the engine");
    }
    let remade = count(&a, "kvroute_replica_buckets_recreated_total")
        + count(&b, "kvroute_replica_buckets_recreated_total");
    assert!(remade >= 1, "no replica counted the bucket made again");
}
