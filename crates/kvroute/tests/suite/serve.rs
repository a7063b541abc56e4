//! `kvroute serve` against real `kvroute mocker` engines, both as processes:
//! events flow from the engines into the index, `/workers` shows them, and the
//! admin endpoints register and unregister workers behind a bearer token.

use std::net::TcpStream;

use serde_json::Value;

use crate::support::http::{json_in as json_body, request_with};
use crate::support::*;

/// One request, with a bearer `token` if given: its status and body.
fn request(
    host_port: &str,
    method: &str,
    path: &str,
    body: Option<&str>,
    token: Option<&str>,
) -> (u16, String) {
    let auth = token.map(|t| format!("Bearer {t}"));
    let headers: Vec<(&str, &str)> = auth.iter().map(|a| ("Authorization", a.as_str())).collect();
    let r = request_with(host_port, method, path, &headers, body.unwrap_or(""));
    (r.status, r.body)
}

fn url_of(line: &str) -> String {
    line.split(',')
        .find_map(|kv| kv.strip_prefix("url=http://"))
        .expect("url")
        .to_owned()
}

fn device_blocks(serve: &str, worker: &str) -> u64 {
    let (status, body) = request(serve, "GET", "/workers", None, Some("secret"));
    if status != 200 {
        return 0;
    }
    let doc = json_body(&body);
    doc["workers"]
        .as_array()
        .and_then(|ws| ws.iter().find(|w| w["name"] == worker))
        .map_or(0, |w| {
            w["ranks"][0]["blocks"]["device"].as_u64().unwrap_or(0)
        })
}

#[test]
fn serve_ingests_mocker_events_and_manages_workers() {
    let (_mocker, lines) = start_mocker(2, "100");
    let (_serve, serve) = spawn_serve(&lines, &["--admin-token", "secret"]);
    eventually("serve answers /health", || {
        TcpStream::connect(&serve).is_ok() && request(&serve, "GET", "/health", None, None).0 == 200
    });
    eventually("both ranks connected", || {
        let (_, body) = request(&serve, "GET", "/workers", None, Some("secret"));
        let doc = json_body(&body);
        doc["workers"].as_array().is_some_and(|ws| {
            ws.len() == 2 && ws.iter().all(|w| w["ranks"][0]["connected"] == true)
        })
    });

    // 64 prompt tokens = 4 blocks of 16 on worker w0.
    let prompt: Vec<u32> = (1000..1064).collect();
    let body =
        serde_json::json!({"model": "mock-model", "prompt": prompt, "max_tokens": 1}).to_string();
    let (status, _) = request(
        &url_of(&lines[0]),
        "POST",
        "/v1/completions",
        Some(&body),
        None,
    );
    assert_eq!(status, 200);
    eventually("w0's blocks in the index", || {
        device_blocks(&serve, "w0") >= 4
    });
    assert_eq!(device_blocks(&serve, "w1"), 0);

    let (status, metrics) = request(&serve, "GET", "/metrics", None, None);
    assert_eq!(status, 200);
    let per_rank = "kvroute_ingest_events_total{worker=\"w0\",dp_rank=\"0\"}";
    assert!(metrics.contains(per_rank), "{metrics}");

    // Admin endpoints: token required, clear errors, blocks leave with the worker.
    let (status, _) = request(
        &serve,
        "POST",
        "/unregister",
        Some(r#"{"name":"w0"}"#),
        None,
    );
    assert_eq!(status, 401);
    let (status, body) = request(
        &serve,
        "POST",
        "/register",
        Some("{not json"),
        Some("secret"),
    );
    assert_eq!(status, 400, "{body}");
    let (status, _) = request(
        &serve,
        "POST",
        "/unregister",
        Some(r#"{"name":"w0"}"#),
        Some("secret"),
    );
    assert_eq!(status, 200);
    let (_, body) = request(&serve, "GET", "/workers", None, Some("secret"));
    let names: Vec<String> = json_body(&body)["workers"]
        .as_array()
        .expect("list")
        .iter()
        .map(|w| w["name"].as_str().unwrap_or("").to_owned())
        .collect();
    assert_eq!(names, ["w1"]);
    let (status, _) = request(
        &serve,
        "POST",
        "/unregister",
        Some(r#"{"name":"w0"}"#),
        Some("secret"),
    );
    assert_eq!(status, 404);

    // Registering w0 again over HTTP brings its ingestion back.
    let fields = registration_of(&lines[0]);
    let (status, body) = request(
        &serve,
        "POST",
        "/register",
        Some(&Value::Object(fields).to_string()),
        Some("secret"),
    );
    assert_eq!(status, 200, "{body}");
    let (status, _) = request(
        &url_of(&lines[0]),
        "POST",
        "/v1/completions",
        Some(&body_with_prompt(2000)),
        None,
    );
    assert_eq!(status, 200);
    eventually("w0's new blocks in the index", || {
        device_blocks(&serve, "w0") >= 4
    });
}

/// The registration body for the worker a mocker `line` describes: its
/// `key=value` fields (numbers as numbers) and its HTTP url.
fn registration_of(line: &str) -> serde_json::Map<String, Value> {
    let mut fields: serde_json::Map<String, Value> = line
        .split(',')
        .filter_map(|kv| kv.split_once('='))
        .map(|(k, v)| {
            (
                k.to_owned(),
                v.parse::<u64>()
                    .map_or(Value::String(v.to_owned()), Value::from),
            )
        })
        .collect();
    fields.insert(
        "url".into(),
        Value::String(format!("http://{}", url_of(line))),
    );
    fields
}

fn body_with_prompt(first: u32) -> String {
    let prompt: Vec<u32> = (first..first + 64).collect();
    serde_json::json!({"model": "mock-model", "prompt": prompt, "max_tokens": 1}).to_string()
}

#[test]
fn serve_discovers_an_sglang_worker_from_its_server_info() {
    let (_mocker, line) = start_two_rank_mocker("sglang");
    let engine = url_of(&line);
    let discover = format!("http://{engine}");
    let (_serve, serve) = spawn_serve(&[], &["--discover-sglang", &discover]);
    eventually("both discovered ranks connected", || {
        TcpStream::connect(&serve).is_ok() && {
            let (_, body) = request(&serve, "GET", "/workers", None, None);
            let doc = json_body(&body);
            doc["workers"][0]["ranks"]
                .as_array()
                .is_some_and(|r| r.len() == 2 && r.iter().all(|r| r["connected"] == true))
        }
    });
    let (status, _) = request(
        &engine,
        "POST",
        "/v1/completions",
        Some(&body_with_prompt(3000)),
        None,
    );
    assert_eq!(status, 200);
    eventually("the engine's blocks in the index", || {
        let (_, body) = request(&serve, "GET", "/workers", None, None);
        let doc = json_body(&body);
        let ranks = doc["workers"][0]["ranks"]
            .as_array()
            .cloned()
            .unwrap_or_default();
        ranks
            .iter()
            .map(|r| r["blocks"]["device"].as_u64().unwrap_or(0))
            .sum::<u64>()
            >= 4
    });
}

/// The role of each worker `/workers` lists, by name, with its bootstrap
/// port (`None` when `/workers` leaves it out).
fn roles(serve: &str) -> Vec<(String, String, Option<u64>)> {
    let (status, body) = request(serve, "GET", "/workers", None, Some("secret"));
    assert_eq!(status, 200, "{body}");
    let doc = json_body(&body);
    let list = doc["workers"].as_array().cloned().unwrap_or_default();
    list.iter()
        .map(|w| {
            let name = w["name"].as_str().unwrap_or("").to_owned();
            let role = w["role"].as_str().unwrap_or("").to_owned();
            (name, role, w.get("bootstrap_port").and_then(Value::as_u64))
        })
        .collect()
}

#[test]
fn registrations_give_the_role_in_kvroute_smg_and_dynamo_names() {
    let (_serve, serve) = spawn_serve(&[], &["--admin-token", "secret"]);
    eventually("serve answers /health", || {
        TcpStream::connect(&serve).is_ok() && request(&serve, "GET", "/health", None, None).0 == 200
    });
    // No engine publishes on these sockets: the workers only need to exist.
    let events = || format!("tcp://127.0.0.1:{}", free_port());
    let url = "http://127.0.0.1:9";
    let bodies = [
        // kvroute's own names.
        serde_json::json!({"name": "k", "url": url, "events": events(), "role": "decode"}),
        // SMG's: `worker_type` (regular|prefill|decode), `runtime_type`, `bootstrap_port`.
        serde_json::json!({"name": "s", "url": url, "events": events(), "worker_type": "prefill",
                           "runtime_type": "sglang", "bootstrap_port": 8998}),
        serde_json::json!({"name": "r", "url": url, "events": events(), "worker_type": "regular"}),
        // Dynamo's indexer fields with its `worker_type` (aggregated|prefill|decode).
        serde_json::json!({"instance_id": 7, "endpoint": events(), "url": url,
                           "model_name": "m", "worker_type": "decode"}),
        serde_json::json!({"instance_id": 8, "endpoint": events(), "url": url,
                           "worker_type": "aggregated"}),
    ];
    for body in &bodies {
        let text = body.to_string();
        let (status, reply) = request(&serve, "POST", "/register", Some(&text), Some("secret"));
        assert_eq!(status, 200, "{text}: {reply}");
        let expected = body
            .get("role")
            .or(body.get("worker_type"))
            .and_then(Value::as_str)
            .map(|r| match r {
                "regular" | "aggregated" => "both",
                r => r,
            });
        assert_eq!(json_body(&reply)["role"].as_str(), expected, "{reply}");
    }
    let mut listed = roles(&serve);
    listed.sort();
    let expected = [
        ("7", "decode", None),
        ("8", "both", None),
        ("k", "decode", None),
        ("r", "both", None),
        ("s", "prefill", Some(8998)),
    ]
    .map(|(n, r, p)| (n.to_owned(), r.to_owned(), p));
    assert_eq!(listed, expected);

    let (_, metrics) = request(&serve, "GET", "/metrics", None, None);
    for (name, role, _) in &expected {
        let sample = format!("kvroute_worker_info{{worker=\"{name}\",role=\"{role}\"}} 1");
        assert!(metrics.contains(&sample), "{sample}\n{metrics}");
    }

    // Refusals say why, and register nothing.
    let refused = [
        (
            serde_json::json!({"name": "e", "url": url, "events": events(), "worker_type": "encode"}),
            "not supported",
        ),
        (
            serde_json::json!({"name": "v", "url": url, "events": events(), "role": "prefill",
                               "bootstrap_port": 8998}),
            "only SGLang workers",
        ),
        (
            serde_json::json!({"name": "x", "url": url, "events": events(), "role": "prefill",
                               "worker_type": "decode"}),
            "disagree",
        ),
    ];
    for (body, why) in refused {
        let text = body.to_string();
        let (status, reply) = request(&serve, "POST", "/register", Some(&text), Some("secret"));
        assert_eq!(status, 400, "{text}: {reply}");
        assert!(reply.contains(why), "{text}: {reply}");
    }
    assert_eq!(roles(&serve).len(), expected.len());
}
