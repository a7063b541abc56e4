//! Workers from an endpoints file (`serve --endpoints-file`, llm-d's
//! `endpoints.yaml` shape): registered at start, followed as the file
//! changes, and kept when it turns unreadable.

use serde_json::{json, Value};

use crate::support::http::{count, request};
use crate::support::{eventually, spawn_serve, start_mocker_with};

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
