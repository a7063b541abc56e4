//! Priorities in the overload queue: while every rank is busy, the waiting
//! requests take a freed rank in `x-priority` order (lower first), then in
//! arrival order, whatever order they came in; a client the router does not
//! trust cannot ask to go before the default, a key granted a range can.
//! At both front doors (HTTP and the endpoint picker).

use serde_json::json;

use crate::support::door::{admission_of, Door, Front};
use crate::support::http::{count, metric, request_with, Reply};
use crate::support::{eventually, start_mocker};

/// A completion of 32 token ids from `base + 100 × seed`, with `header`.
pub(super) fn complete_with(
    serve: &str,
    header: Option<(&str, &str)>,
    (base, seed): (u32, u32),
    max_tokens: u32,
) -> Reply {
    let headers: Vec<(&str, &str)> = header.into_iter().collect();
    complete_with_headers(serve, &headers, (base, seed), max_tokens)
}

/// [`complete_with`] with any `headers`.
pub(super) fn complete_with_headers(
    serve: &str,
    headers: &[(&str, &str)],
    (base, seed): (u32, u32),
    max_tokens: u32,
) -> Reply {
    let prompt: Vec<u32> = (0..32).map(|i| base + seed * 100 + i).collect();
    let body = json!({"model": "mock-model", "prompt": prompt, "max_tokens": max_tokens});
    request_with(serve, "POST", "/v1/completions", headers, &body.to_string())
}

/// The router's setting that takes `x-tenant` and `x-priority` as a trusted
/// gateway's word (in the environment, which a build before it ignores).
pub(super) const TRUST_HEADERS: (&str, &str) = ("KVROUTE_TRUST_TENANT_HEADER", "true");

/// Sends one long request (400 tokens) through `front` that holds the
/// router's only rank, and waits until it runs; the thread gives its status.
pub(super) fn hold_the_only_rank(front: &Front) -> std::thread::JoinHandle<u16> {
    let addr = front.addr.clone();
    let holder = std::thread::spawn(move || complete_with(&addr, None, (20_000, 0), 400).status);
    eventually("the long request runs", || {
        metric(&front.router, "kvroute_active_requests") == Some(1.0)
    });
    holder
}

/// Sends `sent` (a name and its headers each) one after another while the
/// only rank is held, each waited for until queued; their names in the
/// order the engine admitted them, every one answered 200.
fn admitted_in_order(
    front: &Front,
    sent: &[(&'static str, Vec<(&'static str, &'static str)>)],
    base: u32,
) -> Vec<&'static str> {
    let holder = hold_the_only_rank(front);
    let mut waiting = Vec::new();
    for (k, (name, headers)) in sent.iter().cloned().enumerate() {
        let addr = front.addr.clone();
        waiting.push(std::thread::spawn(move || {
            let reply = complete_with_headers(&addr, &headers, (base, 1 + k as u32), 1);
            (name, reply)
        }));
        eventually("it queued", || {
            count(&front.router, "kvroute_proxy_queued_total") == k as u64 + 1
        });
    }
    assert_eq!(holder.join().expect("the long request"), 200);
    let mut done: Vec<(u64, &'static str)> = waiting
        .into_iter()
        .map(|w| {
            let (name, reply) = w.join().expect("a queued request");
            assert_eq!(reply.status, 200, "{name}: {}", reply.body);
            (admission_of(&reply), name)
        })
        .collect();
    done.sort();
    done.into_iter().map(|(_, name)| name).collect()
}

/// The flags of a fleet of one rank that takes one request at a time and
/// queues the rest.
const ONE_AT_A_TIME: [&str; 6] = [
    "--busy-requests",
    "1",
    "--queue-capacity",
    "8",
    "--queue-timeout-ms",
    "60000",
];

fn queued_requests_take_a_freed_rank_by_priority_then_arrival(door: Door) {
    let (_mocker, lines) = start_mocker(1, "1");
    let front = door.start(&lines, &ONE_AT_A_TIME, &[TRUST_HEADERS]);
    let sent = [
        ("high", vec![("x-priority", "0")]),
        ("low", vec![("x-priority", "5")]),
        ("urgent", vec![("x-priority", "-1")]),
        ("high-later", vec![("x-priority", "0")]),
    ];
    let order = admitted_in_order(&front, &sent, 30_000);
    assert_eq!(order, ["urgent", "high", "high-later", "low"]);
    // A priority that is not an integer is the client's error.
    let reply = complete_with(&front.addr, Some(("x-priority", "soon")), (30_000, 9), 1);
    assert_eq!(reply.status, 400, "{}", reply.body);
}

#[test]
fn queued_requests_take_a_freed_rank_by_priority_then_arrival_over_http() {
    queued_requests_take_a_freed_rank_by_priority_then_arrival(Door::Http);
}

#[cfg(feature = "epp")]
#[test]
fn queued_requests_take_a_freed_rank_by_priority_then_arrival_through_the_picker() {
    queued_requests_take_a_freed_rank_by_priority_then_arrival(Door::Picker);
}

/// The probe's flood at `x-priority: -2147483648` from a client the router
/// does not trust: clamped to the default 0, so another client's request
/// still takes its turn (the build before served the flood first, and under
/// a steady flood the other client got 0 of 8 served); a key granted
/// `-10..0` still goes first, clamped to -10.
fn an_untrusted_priority_is_clamped_and_a_key_granted_one_still_goes_first(door: Door) {
    let (_mocker, lines) = start_mocker(1, "1");
    // printf %s sk-gold | sha256sum
    let gold = "gold=83a9d60338d134e3e8f33851f115498635f1090262307ce959b86e5eee88bb90";
    let env = [
        ("KVROUTE_TENANT_KEYS", gold),
        ("KVROUTE_TENANT_PRIORITIES", "gold=-10..0"),
    ];
    let front = door.start(&lines, &ONE_AT_A_TIME, &env);
    let lowest = "-2147483648";
    let flood = vec![("authorization", "Bearer sk-flood"), ("x-priority", lowest)];
    let sent = [
        ("flood-1", flood.clone()),
        ("flood-2", flood.clone()),
        ("flood-3", flood),
        ("other", vec![("authorization", "Bearer sk-other")]),
        (
            "gold",
            vec![("authorization", "Bearer sk-gold"), ("x-priority", lowest)],
        ),
    ];
    let order = admitted_in_order(&front, &sent, 50_000);
    // gold at -10; then the flood's first, the other client's (its first
    // request, as early in the fair order as the flood's first), the rest.
    assert_eq!(order, ["gold", "flood-1", "other", "flood-2", "flood-3"]);
    assert_eq!(count(&front.router, "kvroute_priority_clamped_total"), 4);
}

#[test]
fn an_untrusted_priority_is_clamped_and_a_key_granted_one_still_goes_first_over_http() {
    an_untrusted_priority_is_clamped_and_a_key_granted_one_still_goes_first(Door::Http);
}

#[cfg(feature = "epp")]
#[test]
fn an_untrusted_priority_is_clamped_and_a_key_granted_one_still_goes_first_through_the_picker() {
    an_untrusted_priority_is_clamped_and_a_key_granted_one_still_goes_first(Door::Picker);
}
