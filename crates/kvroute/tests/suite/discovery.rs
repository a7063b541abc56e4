//! Workers from an endpoints file (`serve --endpoints-file`, llm-d's
//! `endpoints.yaml` shape): registered at start, followed as the file
//! changes, and kept when it turns unreadable, empty, half-written, huge or
//! hostile (an alias bomb).

use std::io::Write as _;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;

use serde_json::{json, Value};

use crate::support::http::{count, request};
use crate::support::{eventually, spawn_serve, start_mocker_with, Proc};

/// `key=value` of a mocker's `--worker` line.
fn field<'a>(line: &'a str, key: &str) -> &'a str {
    line.split(',')
        .find_map(|kv| kv.strip_prefix(key)?.strip_prefix('='))
        .unwrap_or_default()
}

/// The port at the end of `url`.
fn port_of(url: &str) -> &str {
    url.rsplit(':').next().unwrap_or_default()
}

/// One endpoints-file entry for the engine of `line`, named `name`.
fn entry(name: &str, line: &str) -> String {
    format!(
        "  - name: {name}\n    namespace: pool\n    address: 127.0.0.1\n    port: \"{}\"\n    labels:\n      kvroute.io/events-port: \"{}\"\n      kvroute.io/replay-port: \"{}\"\n      app: vllm\n",
        port_of(field(line, "url")),
        port_of(field(line, "events")),
        port_of(field(line, "replay")),
    )
}

/// The names of the workers `/workers` lists, each with whether all its
/// ranks are connected.
fn workers(serve: &str) -> Vec<(String, bool)> {
    let doc: Value = request(serve, "GET", "/workers", "").json();
    doc["workers"]
        .as_array()
        .into_iter()
        .flatten()
        .map(|w| {
            let connected = w["ranks"]
                .as_array()
                .is_some_and(|r| !r.is_empty() && r.iter().all(|r| r["connected"] == true));
            (w["name"].as_str().unwrap_or_default().to_owned(), connected)
        })
        .collect()
}

#[test]
fn workers_follow_the_endpoints_file_and_survive_a_broken_one() {
    let (_mocker, lines) = start_mocker_with(2, &[]);
    let dir = std::env::temp_dir().join(format!("kvroute-endpoints-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).expect("a temp dir");
    let file = dir.join("endpoints.yaml");
    let write = |text: &str| {
        // Written beside, then renamed over: what a ConfigMap update does.
        let next = dir.join("endpoints.yaml.next");
        std::fs::write(&next, text).expect("written");
        std::fs::rename(&next, &file).expect("renamed");
    };
    write(&format!("endpoints:\n{}", entry("a", &lines[0])));
    let file_arg = file.to_string_lossy().into_owned();
    let (_serve, serve) = spawn_serve(
        &[],
        &[
            "--endpoints-file",
            &file_arg,
            "--endpoints-poll-ms",
            "100",
            "--public-introspection",
        ],
    );
    eventually("pool/a registered and connected", || {
        workers(&serve) == [("pool/a".to_owned(), true)]
    });
    let body = json!({"model": "mock-model", "prompt": [1, 2, 3, 4], "max_tokens": 2});
    let answer = request(&serve, "POST", "/v1/completions", &body.to_string());
    assert_eq!(answer.status, 200, "{}", answer.body);
    assert_eq!(answer.header("x-kvroute-worker").as_deref(), Some("pool/a"));

    // b added, a removed.
    write(&format!("endpoints:\n{}", entry("b", &lines[1])));
    eventually("pool/b alone", || {
        workers(&serve) == [("pool/b".to_owned(), true)]
    });
    assert_eq!(count(&serve, "kvroute_discovery_endpoints"), 1);
    assert!(count(&serve, "kvroute_discovery_reloads_total") >= 2);

    // A broken file changes nothing, and is counted.
    write("endpoints: [\n");
    eventually("the broken file counted", || {
        count(&serve, "kvroute_discovery_errors_total") == 1
    });
    assert_eq!(workers(&serve), [("pool/b".to_owned(), true)]);
    let answer = request(&serve, "POST", "/v1/completions", &body.to_string());
    assert_eq!(answer.header("x-kvroute-worker").as_deref(), Some("pool/b"));
    let _ = std::fs::remove_dir_all(&dir);
}

/// A router following an endpoints file that lists two mock engines
/// (`pool/a`, `pool/b`), both registered and connected.
struct Watched {
    _mocker: Proc,
    router: Proc,
    serve: String,
    dir: PathBuf,
    file: PathBuf,
    /// The file's good text.
    text: String,
}

impl Drop for Watched {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}

/// The two workers of a [`Watched`] router, as `/workers` lists them.
fn both() -> Vec<(String, bool)> {
    vec![("pool/a".to_owned(), true), ("pool/b".to_owned(), true)]
}

/// A router polling its endpoints file every 50 ms (the least allowed), the
/// file naming two engines; returns once both serve.
fn watched(tag: &str) -> Watched {
    let (mocker, lines) = start_mocker_with(2, &[]);
    let dir = std::env::temp_dir().join(format!("kvroute-{tag}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).expect("a temp dir");
    let file = dir.join("endpoints.yaml");
    let text = format!(
        "endpoints:\n{}{}",
        entry("a", &lines[0]),
        entry("b", &lines[1])
    );
    std::fs::write(&file, &text).expect("written");
    let file_arg = file.to_string_lossy().into_owned();
    let (router, serve) = spawn_serve(
        &[],
        &[
            "--endpoints-file",
            &file_arg,
            "--endpoints-poll-ms",
            "50",
            "--public-introspection",
        ],
    );
    eventually("pool/a and pool/b registered and connected", || {
        workers(&serve) == both()
    });
    Watched {
        _mocker: mocker,
        router,
        serve,
        dir,
        file,
        text,
    }
}

impl Watched {
    /// `text` written beside the file, then renamed over it.
    fn replace(&self, text: &str) {
        let next = self.dir.join("endpoints.yaml.next");
        std::fs::write(&next, text).expect("written");
        std::fs::rename(&next, &self.file).expect("renamed");
    }

    /// Looks the router has finished on the file: reloads (applied) plus
    /// errors (refused). A change of either says the router read it.
    fn looks(&self) -> u64 {
        count(&self.serve, "kvroute_discovery_reloads_total")
            + count(&self.serve, "kvroute_discovery_errors_total")
    }

    /// Waits until the router has read the file since `looks` was `before`.
    fn await_look(&self, what: &str, before: u64) {
        eventually(what, || self.looks() > before);
    }

    /// Asserts both workers are still registered and a request is served.
    fn assert_serving(&self, after: &str) {
        assert_eq!(
            count(&self.serve, "kvroute_discovery_endpoints"),
            2,
            "workers after {after}"
        );
        assert_eq!(workers(&self.serve), both(), "after {after}");
        let answer = complete(&self.serve);
        assert_eq!(answer.status, 200, "after {after}: {}", answer.body);
    }

    /// The router's resident memory, in bytes (`VmRSS` of /proc/PID/status).
    fn rss(&self) -> u64 {
        crate::support::rss(self.router.0.id())
    }
}

/// A short completion through the router.
fn complete(serve: &str) -> crate::support::http::Reply {
    let body = json!({"model": "mock-model", "prompt": [1, 2, 3, 4], "max_tokens": 2});
    request(serve, "POST", "/v1/completions", &body.to_string())
}

/// The file at `path` opened for writing in place and truncated to 0 bytes
/// (as `open(O_TRUNC)` by an editor or `cat > F` does), not yet written.
fn truncate_in_place(path: &Path) -> std::fs::File {
    std::fs::OpenOptions::new()
        .write(true)
        .truncate(true)
        .open(path)
        .expect("opened in place")
}

/// An alias bomb: anchor `a0`, a list of nine strings, then `levels`
/// anchors each listing nine aliases of the one before: 9^(levels + 1)
/// strings once expanded, in a few hundred bytes (the probe's critical file
/// is `bomb(11)`; its smaller one, once accepted at 200 MB, `bomb(5)`).
fn bomb(levels: usize) -> String {
    let mut lines =
        vec![r#"a0: &a0 ["lol","lol","lol","lol","lol","lol","lol","lol","lol"]"#.to_owned()];
    for i in 1..=levels {
        let refs = vec![format!("*a{}", i - 1); 9].join(",");
        lines.push(format!("a{i}: &a{i} [{refs}]"));
    }
    lines.join("\n")
        + &format!(
            "\nendpoints:\n  - name: e0\n    address: 127.0.0.1\n    port: \"47700\"\n    labels: {{x: *a{levels}}}\n"
        )
}

/// The most memory the router may use while a bomb sits in its file.
const RSS_BOUND: u64 = 256 << 20;

/// Probe 7g: a 736-byte YAML alias bomb took the router to 100 % CPU and
/// 5.4 GB; a 446-byte one was accepted at 200 MB. Both are refused while
/// they are parsed: the router stays under 256 MB, counts the error, and
/// the workers of the last good file keep serving.
#[test]
fn an_alias_bomb_in_the_endpoints_file_is_refused_within_bounded_memory() {
    let w = watched("bomb");
    let start = w.rss();
    let mut peak = start;
    for levels in [11, 5] {
        let text = bomb(levels);
        assert!(text.len() < 800, "{} bytes", text.len());
        let errors = count(&w.serve, "kvroute_discovery_errors_total");
        w.replace(&text);
        eventually(
            &format!("the {}-byte bomb refused and counted", text.len()),
            || {
                peak = peak.max(w.rss());
                assert!(
                    peak < RSS_BOUND,
                    "the router's RSS reached {} MB with a {}-byte bomb in its file (from {} MB)",
                    peak >> 20,
                    text.len(),
                    start >> 20
                );
                count(&w.serve, "kvroute_discovery_errors_total") > errors
            },
        );
        w.assert_serving(&format!("a {}-byte bomb", text.len()));
        // The good file back, so that the next bomb's error is a new one.
        let looks = w.looks();
        w.replace(&format!("{}\n", w.text));
        w.await_look("the good file read again", looks);
    }
    peak = peak.max(w.rss());
    assert!(peak < RSS_BOUND, "peak RSS {} MB", peak >> 20);
    eprintln!(
        "router RSS: {} MB at start, {} MB at most",
        start >> 20,
        peak >> 20
    );
}

/// Probe 7b: a 0-byte endpoints file removed every worker. A file that
/// lists nothing (empty, blank, `endpoints:` with nothing after it) is
/// refused and counted; only `endpoints: []` removes the workers.
#[test]
fn an_empty_endpoints_file_keeps_the_workers() {
    let w = watched("empty");
    for (what, text) in [
        ("a 0-byte file", ""),
        ("a blank file", "\n  \n"),
        ("a file cut after its first line", "endpoints:\n"),
    ] {
        let looks = w.looks();
        let errors = count(&w.serve, "kvroute_discovery_errors_total");
        std::fs::write(&w.file, text).expect("written in place");
        w.await_look(&format!("{what} read"), looks);
        w.assert_serving(what);
        assert!(
            count(&w.serve, "kvroute_discovery_errors_total") > errors,
            "{what} counted as an error"
        );
        // The good file back (a new error is counted only after a good file).
        let looks = w.looks();
        w.replace(&w.text);
        w.await_look("the good file read", looks);
    }
    w.replace("endpoints: []\n");
    eventually("an explicit empty list removes every worker", || {
        workers(&w.serve).is_empty()
    });
    assert_eq!(count(&w.serve, "kvroute_discovery_endpoints"), 0);
}

/// Probe 7e: 400 in-place rewrites (truncate, write half, write the rest)
/// under traffic cost 10/300 requests a 503 `no_workers`. Each round here
/// truncates the file in place and holds it until the router has read the
/// empty file (so the old code deterministically removes every worker),
/// then writes it back in two halves; a client sends requests throughout,
/// and none may fail.
#[test]
fn in_place_rewrites_under_traffic_lose_no_request() {
    let w = watched("rewrites");
    let stop = Arc::new(AtomicBool::new(false));
    let traffic = {
        let (serve, stop) = (w.serve.clone(), Arc::clone(&stop));
        std::thread::spawn(move || {
            let mut failed = Vec::new();
            let mut sent = 0;
            while !stop.load(Ordering::Relaxed) {
                let answer = complete(&serve);
                sent += 1;
                if answer.status != 200 {
                    failed.push(format!("{} {}", answer.status, answer.body));
                }
            }
            (sent, failed)
        })
    };
    let rounds = 20;
    let bytes = w.text.as_bytes();
    for round in 0..rounds {
        let looks = w.looks();
        let mut file = truncate_in_place(&w.file);
        w.await_look(&format!("round {round}: the truncated file read"), looks);
        let endpoints = count(&w.serve, "kvroute_discovery_endpoints");
        if endpoints != 2 {
            stop.store(true, Ordering::Relaxed);
            let (sent, failed) = traffic.join().expect("traffic");
            panic!(
                "round {round}: {endpoints} workers left by a truncated file; {}/{sent} requests failed: {:?}",
                failed.len(),
                failed.first()
            );
        }
        // Two writes, cut at a different place each round.
        let cut = bytes.len() * (round + 1) / (rounds + 1);
        let reloads = count(&w.serve, "kvroute_discovery_reloads_total");
        file.write_all(&bytes[..cut]).expect("first half");
        file.write_all(&bytes[cut..]).expect("the rest");
        drop(file);
        eventually(&format!("round {round}: the whole file applied"), || {
            count(&w.serve, "kvroute_discovery_reloads_total") > reloads
                && count(&w.serve, "kvroute_discovery_endpoints") == 2
        });
    }
    stop.store(true, Ordering::Relaxed);
    let (sent, failed) = traffic.join().expect("traffic");
    assert!(sent > 0, "no request was sent");
    assert!(
        failed.is_empty(),
        "{}/{sent} requests failed over {rounds} in-place rewrites: {:?}",
        failed.len(),
        failed.first()
    );
    assert_eq!(workers(&w.serve), both());
    eprintln!("{sent} requests over {rounds} in-place rewrites, none failed");
}

/// Probe 7c: a file rewritten in place as 200 MB was read truncated (every
/// worker removed), then refused as too big: 0 workers were left. Both
/// states are refused now, and the workers stay.
#[test]
fn a_file_truncated_then_rewritten_huge_keeps_the_workers() {
    let w = watched("huge");
    let looks = w.looks();
    let mut file = truncate_in_place(&w.file);
    w.await_look("the truncated file read", looks);
    w.assert_serving("the file was truncated");
    let errors = count(&w.serve, "kvroute_discovery_errors_total");
    // 200 MB: the good text, then a sparse tail (the router reads at most 1 MiB of it).
    file.write_all(w.text.as_bytes()).expect("written");
    file.set_len(200 << 20).expect("grown");
    drop(file);
    eventually("the 200 MB file refused and counted", || {
        count(&w.serve, "kvroute_discovery_errors_total") > errors
    });
    w.assert_serving("the file grew to 200 MB");
    assert!(w.rss() < RSS_BOUND, "RSS {} MB", w.rss() >> 20);
    // Written back whole, it is applied again.
    let reloads = count(&w.serve, "kvroute_discovery_reloads_total");
    w.replace(&w.text);
    eventually("the good file applied", || {
        count(&w.serve, "kvroute_discovery_reloads_total") > reloads
    });
    w.assert_serving("the good file came back");
}
