//! Priorities in the overload queue: while every rank is busy, the waiting
//! requests take a freed rank in `x-priority` order (lower first), then in
//! arrival order, whatever order they came in; a client the router does not
//! trust cannot ask to go before the default, a key granted a range can.

use std::sync::{Arc, Mutex};

use serde_json::json;

use crate::support::http::{count, request_with, Reply};
use crate::support::{eventually, start_mocker, start_serve_with_env};

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

/// Sends one long request (400 tokens) that holds the router's only rank,
/// and waits until it runs; the thread gives its status.
pub(super) fn hold_the_only_rank(serve: &str) -> std::thread::JoinHandle<u16> {
    let router = serve.to_owned();
    let holder = std::thread::spawn(move || complete_with(&router, None, (20_000, 0), 400).status);
    eventually("the long request runs", || {
        count(serve, "kvroute_proxy_requests_total") == 1
    });
    holder
}

fn complete(serve: &str, priority: Option<&str>, seed: u32, max_tokens: u32) -> u16 {
    let header = priority.map(|p| ("x-priority", p));
    complete_with(serve, header, (30_000, seed), max_tokens).status
}

#[test]
fn queued_requests_take_a_freed_rank_by_priority_then_arrival() {
    let (_mocker, lines) = start_mocker(1, "1");
    let flags = [
        "--busy-requests",
        "1",
        "--queue-capacity",
        "8",
        "--queue-timeout-ms",
        "60000",
    ];
    let (_serve, serve) = start_serve_with_env(&lines, &flags, &[TRUST_HEADERS]);
    let holder = hold_the_only_rank(&serve);
    let done: Arc<Mutex<Vec<&'static str>>> = Arc::default();
    let mut waiting = Vec::new();
    for (k, (name, priority)) in [
        ("high", "0"),
        ("low", "5"),
        ("urgent", "-1"),
        ("high-later", "0"),
    ]
    .into_iter()
    .enumerate()
    {
        let (router, done) = (serve.clone(), done.clone());
        waiting.push(std::thread::spawn(move || {
            let status = complete(&router, Some(priority), 1 + k as u32, 1);
            done.lock().expect("the list").push(name);
            status
        }));
        eventually("it queued", || {
            count(&serve, "kvroute_proxy_queued_total") == k as u64 + 1
        });
    }
    assert_eq!(holder.join().expect("the long request"), 200);
    for w in waiting {
        assert_eq!(w.join().expect("a queued request"), 200);
    }
    assert_eq!(
        *done.lock().expect("the list"),
        ["urgent", "high", "high-later", "low"]
    );
    // A priority that is not an integer is the client's error.
    assert_eq!(complete(&serve, Some("soon"), 9, 1), 400);
}

/// The probe's flood at `x-priority: -2147483648` from a client the router
/// does not trust: clamped to the default 0, so another client's request
/// still takes its turn (the build before served the flood first, and under
/// a steady flood the other client got 0 of 8 served); a key granted
/// `-10..0` still goes first, clamped to -10.
#[test]
fn an_untrusted_priority_is_clamped_and_a_key_granted_one_still_goes_first() {
    let (_mocker, lines) = start_mocker(1, "1");
    let flags = [
        "--busy-requests",
        "1",
        "--queue-capacity",
        "8",
        "--queue-timeout-ms",
        "60000",
    ];
    // printf %s sk-gold | sha256sum
    let gold = "gold=83a9d60338d134e3e8f33851f115498635f1090262307ce959b86e5eee88bb90";
    let env = [
        ("KVROUTE_TENANT_KEYS", gold),
        ("KVROUTE_TENANT_PRIORITIES", "gold=-10..0"),
    ];
    let (_serve, serve) = start_serve_with_env(&lines, &flags, &env);
    let holder = hold_the_only_rank(&serve);
    let done: Arc<Mutex<Vec<&'static str>>> = Arc::default();
    let mut waiting = Vec::new();
    let lowest = "-2147483648";
    let sent: [(&str, &str, Option<&str>); 5] = [
        ("flood-1", "Bearer sk-flood", Some(lowest)),
        ("flood-2", "Bearer sk-flood", Some(lowest)),
        ("flood-3", "Bearer sk-flood", Some(lowest)),
        ("other", "Bearer sk-other", None),
        ("gold", "Bearer sk-gold", Some(lowest)),
    ];
    for (k, (name, key, priority)) in sent.into_iter().enumerate() {
        let (router, done) = (serve.clone(), done.clone());
        waiting.push(std::thread::spawn(move || {
            let mut headers = vec![("authorization", key)];
            headers.extend(priority.map(|p| ("x-priority", p)));
            let reply = complete_with_headers(&router, &headers, (50_000, 1 + k as u32), 1);
            done.lock().expect("the list").push(name);
            reply.status
        }));
        eventually("it queued", || {
            count(&serve, "kvroute_proxy_queued_total") == k as u64 + 1
        });
    }
    assert_eq!(holder.join().expect("the long request"), 200);
    for w in waiting {
        assert_eq!(w.join().expect("a queued request"), 200);
    }
    // gold at -10; then the flood's first, the other client's (its first
    // request, as early in the fair order as the flood's first), the rest.
    assert_eq!(
        *done.lock().expect("the list"),
        ["gold", "flood-1", "other", "flood-2", "flood-3"]
    );
    assert_eq!(count(&serve, "kvroute_priority_clamped_total"), 4);
}
