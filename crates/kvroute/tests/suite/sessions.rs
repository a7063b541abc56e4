//! Sessions: turns naming the same `x-session-id` go back to the rank the
//! last one went to while the cost agrees, and move when that rank is busy.

use serde_json::json;

use crate::support::http::{count, request_with};
use crate::support::{start_mocker, start_serve};

/// Turn `k` of a conversation: its history and a new question.
fn turn(k: u32) -> Vec<u32> {
    (0..64 * (k + 1)).map(|i| 9_000 + i).collect()
}

fn send(serve: &str, session: Option<&str>, tokens: &[u32], max_tokens: u32) -> String {
    let body = json!({"model": "mock-model", "prompt": tokens, "max_tokens": max_tokens});
    let headers: Vec<(&str, &str)> = session.map(|s| ("x-session-id", s)).into_iter().collect();
    let reply = request_with(
        serve,
        "POST",
        "/v1/completions",
        &headers,
        &body.to_string(),
    );
    assert_eq!(reply.status, 200, "{}", reply.body);
    reply.header("x-kvroute-worker").unwrap_or_default()
}

#[test]
fn a_sessions_turns_stay_on_its_rank_until_it_is_busy() {
    let (_mocker, lines) = start_mocker(2, "1");
    // Round-robin alternates requests that name no session: the session
    // alone keeps a conversation in place.
    let (_serve, serve) = start_serve(&lines, &["--policy", "round-robin", "--busy-requests", "1"]);
    let plain: Vec<String> = (0..4).map(|k| send(&serve, None, &turn(k), 1)).collect();
    assert_ne!(plain[0], plain[1], "round-robin alternates: {plain:?}");
    let kept: Vec<String> = (0..4)
        .map(|k| send(&serve, Some("conv-1"), &turn(k), 1))
        .collect();
    assert!(kept.iter().all(|w| *w == kept[0]), "{kept:?}");
    assert_eq!(count(&serve, "kvroute_proxy_session_kept_total"), 3);
    // Its rank busy with a long request: the next turn moves.
    let home = kept[0].clone();
    let blocker = {
        let serve = serve.clone();
        let home = home.clone();
        std::thread::spawn(move || {
            // Sent on the session's rank by the same session.
            send(&serve, Some("conv-1"), &turn(5), 2_000);
            home
        })
    };
    crate::support::eventually("the long turn is in flight", || {
        count(&serve, "kvroute_proxy_session_kept_total") == 4
    });
    let moved = send(&serve, Some("conv-1"), &turn(6), 1);
    assert_ne!(moved, home, "the busy rank is left");
    assert_eq!(count(&serve, "kvroute_proxy_session_moved_total"), 1);
    // A malformed session id is the client's error.
    let reply = request_with(
        &serve,
        "POST",
        "/v1/completions",
        &[("x-session-id", &"x".repeat(300))],
        &json!({"prompt": [1, 2], "max_tokens": 1}).to_string(),
    );
    assert_eq!(reply.status, 400, "{}", reply.body);
    drop(blocker);
}
