//! Sessions: turns naming the same `x-session-id` go back to the rank the
//! last one went to while the cost agrees, and move when that rank is busy,
//! at both front doors (HTTP and the endpoint picker).

use serde_json::json;

use crate::support::door::{Door, Front};
use crate::support::http::{count, request_with};
use crate::support::{eventually, start_mocker};

/// Turn `k` of a conversation: its history and a new question.
fn turn(k: u32) -> Vec<u32> {
    (0..64 * (k + 1)).map(|i| 9_000 + i).collect()
}

/// Sends one turn through `front`; the worker that answered.
fn send(front: &Front, session: Option<&str>, tokens: &[u32], max_tokens: u32) -> String {
    let body = json!({"model": "mock-model", "prompt": tokens, "max_tokens": max_tokens});
    let headers: Vec<(&str, &str)> = session.map(|s| ("x-session-id", s)).into_iter().collect();
    let body = body.to_string();
    let reply = request_with(&front.addr, "POST", "/v1/completions", &headers, &body);
    assert_eq!(reply.status, 200, "{}", reply.body);
    front.worker_of(&reply)
}

fn a_sessions_turns_stay_on_its_rank_until_it_is_busy(door: Door) {
    let (_mocker, lines) = start_mocker(2, "1");
    // Round-robin alternates requests that name no session: the session
    // alone keeps a conversation in place.
    let flags = ["--policy", "round-robin", "--busy-requests", "1"];
    let front = std::sync::Arc::new(door.start(&lines, &flags, &[]));
    let (addr, router) = (&front.addr, &front.router);
    let plain: Vec<String> = (0..4).map(|k| send(&front, None, &turn(k), 1)).collect();
    assert_ne!(plain[0], plain[1], "round-robin alternates: {plain:?}");
    let kept: Vec<String> = (0..4)
        .map(|k| send(&front, Some("conv-1"), &turn(k), 1))
        .collect();
    assert!(kept.iter().all(|w| *w == kept[0]), "{kept:?}");
    assert_eq!(count(router, "kvroute_proxy_session_kept_total"), 3);
    // Its rank busy with a long request: the next turn moves.
    let home = kept[0].clone();
    let blocker = {
        let front = front.clone();
        // Sent on the session's rank by the same session.
        std::thread::spawn(move || send(&front, Some("conv-1"), &turn(5), 600))
    };
    eventually("the long turn is in flight", || {
        count(router, "kvroute_proxy_session_kept_total") == 4
    });
    let moved = send(&front, Some("conv-1"), &turn(6), 1);
    assert_ne!(moved, home, "the busy rank is left");
    assert_eq!(count(router, "kvroute_proxy_session_moved_total"), 1);
    // The long turn itself ran where the session was, and ended well.
    assert_eq!(blocker.join().expect("the long turn"), home);
    // A malformed session id is the client's error.
    let reply = request_with(
        addr,
        "POST",
        "/v1/completions",
        &[("x-session-id", &"x".repeat(300))],
        &json!({"prompt": [1, 2], "max_tokens": 1}).to_string(),
    );
    assert_eq!(reply.status, 400, "{}", reply.body);
}

#[test]
fn a_sessions_turns_stay_on_its_rank_until_it_is_busy_over_http() {
    a_sessions_turns_stay_on_its_rank_until_it_is_busy(Door::Http);
}

#[cfg(feature = "epp")]
#[test]
fn a_sessions_turns_stay_on_its_rank_until_it_is_busy_through_the_picker() {
    a_sessions_turns_stay_on_its_rank_until_it_is_busy(Door::Picker);
}
