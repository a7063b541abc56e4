//! Tenants in the overload queue: while every rank is busy, tenants share
//! the freed ranks fairly (weighted fair queueing, not arrival order), and a
//! full queue refuses the tenant most over its share with a 429 — a small
//! tenant arriving at a queue the big one filled takes the place of the big
//! one's newest request.

use std::sync::{Arc, Mutex};

use super::priority::{complete_with, hold_the_only_rank};
use crate::support::http::{count, metric_where, Reply};
use crate::support::{eventually, start_mocker, start_serve};

fn complete(serve: &str, tenant: &str, seed: u32, max_tokens: u32) -> Reply {
    complete_with(
        serve,
        Some(("x-tenant", tenant)),
        (40_000, seed),
        max_tokens,
    )
}

#[test]
fn a_small_tenant_at_a_full_queue_takes_the_big_ones_place_and_goes_before_its_backlog() {
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
    let (_serve, serve) = start_serve(&lines, &flags);
    let holder = hold_the_only_rank(&serve);
    let done: Arc<Mutex<Vec<String>>> = Arc::default();
    let mut waiting = Vec::new();
    let mut send = |name: &'static str, tenant: &'static str, seed: u32| {
        let (router, done) = (serve.clone(), done.clone());
        waiting.push(std::thread::spawn(move || {
            let reply = complete(&router, tenant, seed, 1);
            done.lock().expect("the list").push(name.to_owned());
            reply
        }));
    };
    // The big tenant fills the queue's four places.
    for (k, name) in ["big-1", "big-2", "big-3", "big-4"].into_iter().enumerate() {
        send(name, "big", 1 + k as u32);
        eventually("it queued", || {
            count(&serve, "kvroute_proxy_queued_total") == k as u64 + 1
        });
    }
    // The small tenant's request takes the place of the big one's newest.
    send("small-1", "small", 9);
    eventually("the small tenant queued", || {
        count(&serve, "kvroute_proxy_queued_total") == 5
    });
    // The big tenant, over its share of the full queue, is refused at once.
    let refused = complete(&serve, "big", 10, 1);
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
    let order = done.lock().expect("the list").clone();
    assert_eq!(order, ["big-4", "big-1", "small-1", "big-2", "big-3"]);
    let refused = |tenant: &str| {
        let label = format!("tenant=\"{tenant}\"");
        metric_where(&serve, "kvroute_tenant_refused_over_share_total", &label)
    };
    assert_eq!(refused("big"), Some(2.0));
    assert_eq!(refused("small"), Some(0.0));
    assert_eq!(refused("other"), Some(0.0));
    let label = "tenant=\"small\"";
    assert_eq!(
        metric_where(&serve, "kvroute_tenant_queued_total", label),
        Some(1.0)
    );
}
