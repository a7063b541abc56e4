//! `/dashboard` in a real headless Chromium: a mock fleet, a real router with
//! an admin token, real traffic, then the page rendered by the browser and
//! its DOM checked (every worker named, a non-zero hit rate, a decision row
//! naming a worker). `/api/stats` wants the token; the page gets it from its
//! URL fragment, which never reaches the server.

use std::process::Command;

use serde_json::{json, Value};

use crate::support::http::*;
use crate::support::*;

const TOKEN: &str = "dashboard-secret";

/// The headless browser: `KVROUTE_CHROMIUM`, or the first of Debian's and
/// others' names on the `PATH` (`.ci/run` installs Debian's `chromium`).
pub fn chromium() -> String {
    if let Ok(path) = std::env::var("KVROUTE_CHROMIUM") {
        return path;
    }
    for name in [
        "chromium",
        "chromium-browser",
        "google-chrome",
        "google-chrome-stable",
    ] {
        let found = Command::new("sh")
            .args(["-c", &format!("command -v {name}")])
            .output()
            .is_ok_and(|o| o.status.success());
        if found {
            return name.to_owned();
        }
    }
    panic!(
        "no headless Chromium: install Debian's `chromium` (.ci/run does) or set KVROUTE_CHROMIUM"
    );
}

/// The DOM of `url` after the browser ran its scripts for `budget_ms` of
/// virtual time.
pub fn rendered_dom(url: &str, budget_ms: u32) -> String {
    let out = Command::new(chromium())
        .args([
            "--headless",
            "--no-sandbox",
            "--disable-gpu",
            "--disable-dev-shm-usage",
            "--no-first-run",
            "--window-size=1280,800",
            &format!("--virtual-time-budget={budget_ms}"),
            "--dump-dom",
            url,
        ])
        .output()
        .expect("chromium runs");
    assert!(
        out.status.success(),
        "chromium failed: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8_lossy(&out.stdout).into_owned()
}

fn stats(serve: &str) -> Reply {
    let auth = format!("Bearer {TOKEN}");
    request_with(serve, "GET", "/api/stats", &[("Authorization", &auth)], "")
}

/// The text of the element with `data-testid="{id}"` (the first one).
fn testid_text<'a>(dom: &'a str, id: &str) -> Option<&'a str> {
    let at = dom.find(&format!("data-testid=\"{id}\""))?;
    let start = at + dom[at..].find('>')? + 1;
    let end = start + dom[start..].find('<')?;
    Some(dom[start..end].trim())
}

#[test]
fn the_dashboard_shows_the_fleet_the_hit_rate_and_the_decisions_in_a_real_browser() {
    let (_mocker, lines) = start_mocker(2, "100");
    let (_serve, serve) = spawn_serve(&lines, &["--admin-token", TOKEN]);
    eventually("both workers connected", || {
        let r = stats(&serve);
        r.status == 200
            && r.json()["workers"].as_array().is_some_and(|w| {
                w.len() == 2 && w.iter().all(|w| w["ranks"][0]["connected"] == true)
            })
    });
    // Four prompts, three times each, half of them streamed: repeats hit the cache.
    for round in 0..3 {
        for p in 0..4u32 {
            let prompt: Vec<u32> = (0..96).map(|i| 1_000 * (p + 1) + i).collect();
            let body = json!({"model": "mock-model", "prompt": prompt, "max_tokens": 2, "stream": (round + p) % 2 == 0});
            let r = request(&serve, "POST", "/v1/completions", &body.to_string());
            assert_eq!(r.status, 200, "{}", r.body);
        }
    }
    eventually("the charts have samples", || {
        let doc: Value = stats(&serve).json();
        doc["series"].as_array().is_some_and(|s| s.len() >= 2) && doc["summary"]["compared"] == 12
    });
    assert_eq!(
        request(&serve, "GET", "/api/stats", "").status,
        401,
        "the data needs the token"
    );
    let page = request(&serve, "GET", "/dashboard", "");
    assert_eq!(page.status, 200);
    assert!(page
        .header("content-type")
        .is_some_and(|t| t.starts_with("text/html")));
    for outside in ["src=\"http", "href=\"http", "url(http", "@import"] {
        assert!(
            !page.body.contains(outside),
            "the page fetches from elsewhere: {outside}"
        );
    }

    let dom = rendered_dom(&format!("http://{serve}/dashboard#token={TOKEN}"), 4_000);
    let names: Vec<String> = lines
        .iter()
        .map(|l| {
            l.split(',')
                .next()
                .and_then(|n| n.strip_prefix("name="))
                .expect("name=")
                .to_owned()
        })
        .collect();
    for name in &names {
        assert!(
            dom.contains(&format!("<td data-testid=\"worker-name\">{name}</td>")),
            "worker {name} is not in the fleet table:\n{dom}"
        );
    }
    // Each worker's role (aggregated engines: both), in the data and the table.
    let doc = stats(&serve).json();
    assert_eq!(doc["workers"][0]["role"], "both", "{doc}");
    assert_eq!(testid_text(&dom, "worker-role"), Some("both"));
    // Each rank's speed: declared (1), none learned without --learn-speeds.
    let speed = testid_text(&dom, "rank-speed");
    assert_eq!(speed, Some("1.00"), "speed shown: {speed:?}");
    let hit = testid_text(&dom, "hit-rate").expect("the hit rate card");
    let value: f64 = hit.trim_end_matches('%').trim().parse().unwrap_or(0.0);
    assert!(value > 0.0, "hit rate shown: {hit:?}");
    let decision = dom
        .find("data-testid=\"decision-row\"")
        .map(|at| &dom[at..at + dom[at..].find("</tr>").unwrap_or(0)])
        .expect("a decision row");
    assert!(
        names
            .iter()
            .any(|n| decision.contains(&format!("data-worker=\"{n}\""))),
        "the decision row names no worker: {decision}"
    );
    assert!(decision.contains("lowest cost"), "{decision}");
    assert_eq!(testid_text(&dom, "load-only"), Some("0.0 %"));
}
