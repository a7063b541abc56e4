//! Tenants in the overload queue: while every rank is busy, tenants share
//! the freed ranks fairly (weighted fair queueing, not arrival order), and a
//! full queue refuses the tenant most over its share with a 429 — a small
//! tenant arriving at a queue the big one filled takes the place of the big
//! one's newest request; and names made up per request (a Sybil flood)
//! cannot crowd out a tenant bound to its API key. At both front doors
//! (HTTP and the endpoint picker).

use std::sync::{Arc, Mutex};

use super::priority::{complete_with, complete_with_headers, hold_the_only_rank, TRUST_HEADERS};
use crate::support::door::{admission_of, Door};
use crate::support::http::{count, metric_where, Reply};
use crate::support::{eventually, start_mocker};

fn complete(serve: &str, tenant: &str, seed: u32, max_tokens: u32) -> Reply {
    complete_with(
        serve,
        Some(("x-tenant", tenant)),
        (40_000, seed),
        max_tokens,
    )
}

fn a_small_tenant_at_a_full_queue_takes_the_big_ones_place_and_goes_before_its_backlog(door: Door) {
    let (_mocker, lines) = start_mocker(1, "1");
    let flags = [
        "--busy-requests",
        "1",
        "--queue-capacity",
        "4",
        "--queue-timeout-ms",
        "60000",
        "--tenant-weight",
        "big=1",
        "--tenant-weight",
        "small=1",
    ];
    let front = door.start(&lines, &flags, &[TRUST_HEADERS]);
    let (addr, serve) = (&front.addr, &front.router);
    let holder = hold_the_only_rank(&front);
    // Each answer with the engine's admission number (its id's suffix,
    // `cmpl-w0-N`): the order the router let requests out of the queue,
    // whatever order the client threads wake up in on a loaded machine.
    let done: Arc<Mutex<Vec<(u64, String)>>> = Arc::default();
    let mut waiting = Vec::new();
    let mut send = |name: &'static str, tenant: &'static str, seed: u32| {
        let (router, done) = (addr.clone(), done.clone());
        waiting.push(std::thread::spawn(move || {
            let reply = complete(&router, tenant, seed, 1);
            let admitted = if reply.status == 200 {
                admission_of(&reply)
            } else {
                u64::MAX
            };
            done.lock()
                .expect("the list")
                .push((admitted, name.to_owned()));
            reply
        }));
    };
    // The big tenant fills the queue's four places.
    for (k, name) in ["big-1", "big-2", "big-3", "big-4"].into_iter().enumerate() {
        send(name, "big", 1 + k as u32);
        eventually("it queued", || {
            count(serve, "kvroute_proxy_queued_total") == k as u64 + 1
        });
    }
    // The small tenant's request takes the place of the big one's newest.
    send("small-1", "small", 9);
    eventually("the small tenant queued", || {
        count(serve, "kvroute_proxy_queued_total") == 5
    });
    // The big tenant, over its share of the full queue, is refused at once.
    let refused = complete(addr, "big", 10, 1);
    assert_eq!(refused.status, 429, "{}", refused.body);
    assert_eq!(refused.header("retry-after").as_deref(), Some("1"));
    let error = &refused.json()["error"];
    assert_eq!(error["type"], "rate_limit_exceeded", "{error}");
    assert_eq!(error["code"], 429, "{error}");
    assert!(error["message"]
        .as_str()
        .is_some_and(|m| m.contains("`big`")));
    assert_eq!(holder.join().expect("the long request"), 200);
    let replies: Vec<Reply> = waiting
        .into_iter()
        .map(|w| w.join().expect("a queued request"))
        .collect();
    // big-4 left the queue with a 429 when small-1 came.
    let statuses: Vec<u16> = replies.iter().map(|r| r.status).collect();
    assert_eq!(statuses, [200, 200, 200, 429, 200], "{}", replies[3].body);
    assert_eq!(replies[3].json()["error"]["type"], "rate_limit_exceeded");
    // small-1 goes right after the big tenant's first, not after its backlog.
    let mut order = done.lock().expect("the list").clone();
    order.sort();
    let order: Vec<String> = order.into_iter().map(|(_, name)| name).collect();
    assert_eq!(order, ["big-1", "small-1", "big-2", "big-3", "big-4"]);
    let refused = |tenant: &str| {
        let label = format!("tenant=\"{tenant}\"");
        metric_where(serve, "kvroute_tenant_refused_over_share_total", &label)
    };
    assert_eq!(refused("big"), Some(2.0));
    assert_eq!(refused("small"), Some(0.0));
    assert_eq!(refused("other"), Some(0.0));
    let label = "tenant=\"small\"";
    assert_eq!(
        metric_where(serve, "kvroute_tenant_queued_total", label),
        Some(1.0)
    );
}

#[test]
fn a_small_tenant_at_a_full_queue_takes_the_big_ones_place_and_goes_before_its_backlog_over_http() {
    a_small_tenant_at_a_full_queue_takes_the_big_ones_place_and_goes_before_its_backlog(Door::Http);
}

#[cfg(feature = "epp")]
#[test]
fn a_small_tenant_at_a_full_queue_takes_the_big_ones_place_and_goes_before_its_backlog_through_the_picker(
) {
    a_small_tenant_at_a_full_queue_takes_the_big_ones_place_and_goes_before_its_backlog(
        Door::Picker,
    );
}

/// The probe's Sybil flood: every request under a new `x-tenant` name and a
/// new API key fills the queue (eight places) while the only rank is busy;
/// then the honest tenant, its key bound to `small`, sends six requests.
/// The build before took each made-up name for a tenant, so every honest
/// request tied with eight one-request tenants and was refused (6 of 6;
/// the probe: 35 of 39 under a steady flood). Now the header is ignored
/// (it is not trusted), the queue tells at most two unbound keys apart and
/// the other six flood requests wait as one tenant, `other`: each honest
/// request takes the place of the pool's newest until `small` holds as
/// many places as the pool (3 and 3); only then is it refused. The bound:
/// at most 3 of 6 refused, and every one queued is served.
fn made_up_tenant_names_cannot_crowd_out_a_tenant_bound_to_its_key(door: Door) {
    let (_mocker, lines) = start_mocker(1, "1");
    let flags = [
        "--busy-requests",
        "1",
        "--queue-capacity",
        "8",
        "--queue-timeout-ms",
        "60000",
    ];
    // printf %s sk-small | sha256sum
    let small = "small=0e1e7070976c78df9c4611e515b270eaa83c91125567d008c7e4aa38c76efafc";
    let env = [
        ("KVROUTE_TENANT_KEYS", small),
        ("KVROUTE_QUEUE_MAX_TENANTS", "2"),
    ];
    let front = door.start(&lines, &flags, &env);
    let (addr, serve) = (&front.addr, &front.router);
    let holder = hold_the_only_rank(&front);
    let send = |headers: Vec<(String, String)>, seed: u32| {
        let router = addr.clone();
        std::thread::spawn(move || {
            let headers: Vec<(&str, &str)> = headers
                .iter()
                .map(|(k, v)| (k.as_str(), v.as_str()))
                .collect();
            complete_with_headers(&router, &headers, (60_000, seed), 1).status
        })
    };
    // Sends one request and waits until it is queued or answered: the
    // thread, if it was queued.
    let mut flood = Vec::new();
    let admit = |headers: Vec<(String, String)>, seed: u32| {
        let before = count(serve, "kvroute_proxy_queued_total");
        let thread = send(headers, seed);
        eventually("the request queued or answered", || {
            count(serve, "kvroute_proxy_queued_total") > before || thread.is_finished()
        });
        thread
    };
    for i in 0..8u32 {
        // One of them names itself after the honest tenant.
        let name = if i == 3 {
            "small".to_owned()
        } else {
            format!("sybil-{i}")
        };
        let headers = vec![
            ("x-tenant".to_owned(), name),
            ("authorization".to_owned(), format!("Bearer sybil-{i}")),
        ];
        flood.push(admit(headers, 1 + i));
    }
    assert_eq!(count(serve, "kvroute_proxy_queued_total"), 8);
    let honest_key = vec![("authorization".to_owned(), "Bearer sk-small".to_owned())];
    let mut honest = Vec::new();
    let mut refused = 0;
    for i in 0..6u32 {
        let thread = admit(honest_key.clone(), 20 + i);
        if thread.is_finished() {
            let status = thread.join().expect("an honest request");
            assert_eq!(
                status, 429,
                "an honest request answered while the rank is held"
            );
            refused += 1;
        } else {
            honest.push(thread);
        }
    }
    assert!(
        refused <= 3,
        "{refused} of 6 honest requests refused at a queue full of made-up tenants"
    );
    // The flood's next request is refused: the pool is the most over its share.
    let next = vec![("authorization".to_owned(), "Bearer sybil-99".to_owned())];
    assert_eq!(admit(next, 99).join().expect("a flood request"), 429);
    assert_eq!(holder.join().expect("the long request"), 200);
    for h in honest {
        assert_eq!(h.join().expect("an honest request"), 200);
    }
    let flood: Vec<u16> = flood
        .into_iter()
        .map(|f| f.join().expect("a flood request"))
        .collect();
    assert_eq!(flood.iter().filter(|&&s| s == 429).count(), 3, "{flood:?}");
    assert!(count(serve, "kvroute_tenant_pooled_total") >= 6);
    let label = "tenant=\"small\"";
    assert_eq!(
        metric_where(serve, "kvroute_tenant_requests_total", label),
        Some(6.0),
        "only the key's requests are `small`"
    );
}

#[test]
fn made_up_tenant_names_cannot_crowd_out_a_tenant_bound_to_its_key_over_http() {
    made_up_tenant_names_cannot_crowd_out_a_tenant_bound_to_its_key(Door::Http);
}

#[cfg(feature = "epp")]
#[test]
fn made_up_tenant_names_cannot_crowd_out_a_tenant_bound_to_its_key_through_the_picker() {
    made_up_tenant_names_cannot_crowd_out_a_tenant_bound_to_its_key(Door::Picker);
}
