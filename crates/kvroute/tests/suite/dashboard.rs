//! `/dashboard` in a real headless Chromium: a mock fleet, a real router with
//! an admin token, real traffic, then the page rendered by the browser and
//! its DOM checked (every worker named, a non-zero hit rate, a decision row
//! naming a worker). `/api/stats` wants the token; the page gets it from its
//! URL fragment, which never reaches the server. The charts' axes are read
//! too: labelled as Grafana's "short" unit does (SI prefixes, three
//! significant digits, never `0.0`), checked exactly on fixed data.

use std::io::{Read, Write};
use std::net::{TcpListener, TcpStream};
use std::process::Command;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;

use serde_json::{json, Value};

use crate::support::http::*;
use crate::support::*;

const TOKEN: &str = "dashboard-secret";

/// The headless browser: `KVROUTE_CHROMIUM`, or the first of Debian's and
/// others' names on the `PATH` (`scripts/test` installs Debian's `chromium`).
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
        "no headless Chromium: run the tests with `scripts/test`, which installs it, or \
         `sudo apt-get install chromium`, or set KVROUTE_CHROMIUM to one"
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
    for chart in ["c-hit", "c-acc", "c-ttft", "c-rps"] {
        let labels = axis_labels(&dom, chart);
        assert_eq!(labels.len(), 3, "{chart}: {labels:?}");
        assert!(
            labels.iter().all(|l| grafana_short(l)),
            "{chart}'s axis: {labels:?}"
        );
    }
}

/// The texts of the axis labels of the chart `<svg id="{chart}">`.
fn axis_labels(dom: &str, chart: &str) -> Vec<String> {
    let start = dom
        .find(&format!("<svg id=\"{chart}\""))
        .unwrap_or_else(|| panic!("no chart {chart}"));
    let end = start + dom[start..].find("</svg>").expect("</svg>");
    dom[start..end]
        .split("<text")
        .skip(1)
        .map(|rest| {
            let text = &rest[rest.find('>').map_or(0, |i| i + 1)..];
            text[..text.find('<').unwrap_or(0)].to_owned()
        })
        .collect()
}

/// Whether `label` reads as Grafana's "short" unit writes numbers: at most
/// three significant digits before an SI prefix (`k`, `M`, `G`, `T`) and a
/// unit, no trailing zeros after a point (never `0.0`).
fn grafana_short(label: &str) -> bool {
    let number = [" %", " ms", " s"]
        .iter()
        .fold(label, |l, unit| l.strip_suffix(unit).unwrap_or(l));
    let number = number.trim_end_matches(['k', 'M', 'G', 'T']);
    let digits: String = number.chars().filter(char::is_ascii_digit).collect();
    let significant = digits.trim_start_matches('0').trim_end_matches('0');
    number.parse::<f64>().is_ok()
        && significant.len() <= 3
        && !(number.contains('.') && number.ends_with('0'))
}

/// A one-page server: `GET /dashboard` answers `page`, `GET /api/stats`
/// answers `stats`, anything else 404; stopped on drop.
struct FixedServer {
    addr: String,
    stop: Arc<AtomicBool>,
}

impl FixedServer {
    fn start(page: String, stats: String) -> FixedServer {
        let listener = TcpListener::bind("127.0.0.1:0").expect("bind");
        let addr = listener.local_addr().expect("addr").to_string();
        let stop = Arc::new(AtomicBool::new(false));
        let stopped = stop.clone();
        std::thread::spawn(move || {
            for stream in listener.incoming() {
                if stopped.load(Ordering::Relaxed) {
                    return;
                }
                if let Ok(stream) = stream {
                    answer(stream, &page, &stats);
                }
            }
        });
        FixedServer { addr, stop }
    }
}

impl Drop for FixedServer {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::Relaxed);
        // Wakes the accept loop so that it sees the flag.
        let _ = TcpStream::connect(&self.addr);
    }
}

/// Reads one request head and answers it, closing the connection.
fn answer(mut stream: TcpStream, page: &str, stats: &str) {
    let _ = stream.set_read_timeout(Some(std::time::Duration::from_secs(5)));
    let mut head = Vec::new();
    let mut buf = [0u8; 4096];
    while !head.windows(4).any(|w| w == b"\r\n\r\n") {
        match stream.read(&mut buf) {
            Ok(0) | Err(_) => return,
            Ok(n) => head.extend_from_slice(&buf[..n]),
        }
    }
    let head = String::from_utf8_lossy(&head);
    let path = head.split_whitespace().nth(1).unwrap_or("");
    let (status, kind, body) = match path.split('?').next() {
        Some("/dashboard") => ("200 OK", "text/html; charset=utf-8", page),
        Some("/api/stats") => ("200 OK", "application/json", stats),
        _ => ("404 Not Found", "text/plain", "not found"),
    };
    let _ = write!(
        stream,
        "HTTP/1.1 {status}\r\ncontent-type: {kind}\r\ncontent-length: {}\r\n\
         cache-control: no-store\r\nconnection: close\r\n\r\n{body}",
        body.len()
    );
}

/// `/api/stats` as the page reads it, with three seconds of samples: half a
/// million cached tokens a second, no requests routed, TTFTs of seconds.
fn fixed_stats() -> Value {
    let sample = |tokens: u64, ttft: Option<f64>| {
        json!({"hit_rate": 0.5, "reported_tokens": tokens, "predicted_tokens": tokens,
               "ttft_p50_ms": ttft, "ttft_p99_ms": ttft.map(|t| 2.0 * t), "by_worker": {"w0": 0}})
    };
    json!({
        "policy": "kv",
        "now_ms": 1_700_000_000_000u64,
        "summary": {"hit_rate": 0.5, "reported_tokens": 996_000, "accuracy": 1.0, "compared": 3,
                    "routed_per_s": 0.0, "routed": 3, "ttft_p50_ms": 850.0, "ttft_p99_ms": 2_400.0,
                    "load_only_fraction": 0.0, "routed_on_load": 0},
        "series": [sample(0, None), sample(480_000, Some(850.0)), sample(516_000, Some(1_200.0))],
        "workers": [{"name": "w0", "role": "both", "ranks": []}],
        "decisions": [],
    })
}

#[test]
fn the_dashboards_axes_use_si_units_and_show_no_fractions_of_counts() {
    // The page as the binary serves it, beside fixed data.
    let (_serve, serve) = spawn_serve(&[], &[]);
    eventually("serve up", || TcpStream::connect(&serve).is_ok());
    let page = request(&serve, "GET", "/dashboard", "");
    assert_eq!(page.status, 200);
    let server = FixedServer::start(page.body, fixed_stats().to_string());
    let dom = rendered_dom(&format!("http://{}/dashboard", server.addr), 2_000);
    let labels = |chart| axis_labels(&dom, chart);
    // 516 000 tokens/s with headroom: an axis to 600k, not `567600`.
    assert_eq!(labels("c-acc"), ["0", "300k", "600k"], "{dom}");
    // No request routed: a count axis of 0, 1, 2, not `0.0`.
    assert_eq!(labels("c-rps"), ["0", "1", "2"]);
    // A p99 of 2 400 ms: seconds past a thousand milliseconds.
    assert_eq!(labels("c-ttft"), ["0", "1.5 s", "3 s"]);
    assert_eq!(labels("c-hit"), ["0 %", "50 %", "100 %"]);
}
