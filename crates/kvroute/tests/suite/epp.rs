//! `kvroute serve --epp-port`: the Gateway API Inference Extension endpoint
//! picker, driven over real gRPC by a client kvroute does not share code
//! with: `tests/epp/client.py`, Envoy's ext_proc v3 messages from PyPI's
//! `envoy-data-plane` over `grpcio`, and `grpcio-health-checking`.
//! Its Python and the picker's start are in `crate::support::picker`.

use std::path::PathBuf;
use std::process::{Command, Stdio};
use std::sync::atomic::{AtomicU32, Ordering};
use std::time::{Duration, Instant};

use serde_json::{json, Value};

use crate::support::http::{count, metric, metric_where, request};
use crate::support::picker::{
    python, script, start_dataplane, start_picker, start_picker_with_env, Picker,
};
use crate::support::{eventually, free_port, start_mocker_with, Proc};

/// A file holding `body`, removed when dropped.
struct BodyFile(PathBuf);

impl BodyFile {
    fn new(body: &[u8]) -> Self {
        static NEXT: AtomicU32 = AtomicU32::new(0);
        let name = format!(
            "kvroute-epp-{}-{}.json",
            std::process::id(),
            NEXT.fetch_add(1, Ordering::Relaxed)
        );
        let path = std::env::temp_dir().join(name);
        std::fs::write(&path, body).expect("write the body file");
        BodyFile(path)
    }

    fn arg(&self) -> &str {
        self.0.to_str().expect("a UTF-8 temp path")
    }
}

impl Drop for BodyFile {
    fn drop(&mut self) {
        let _ = std::fs::remove_file(&self.0);
    }
}

/// Runs the client with `args` (at most 60 s) and returns the JSON it printed.
fn client(args: &[&str]) -> Value {
    let mut child = Command::new(python())
        .arg(script())
        .args(args)
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("python runs");
    let deadline = Instant::now() + Duration::from_secs(60);
    while child.try_wait().expect("wait").is_none() {
        if Instant::now() >= deadline {
            let _ = child.kill();
            panic!("the ext_proc client ran over 60 s: {args:?}");
        }
        std::thread::sleep(Duration::from_millis(20));
    }
    let out = child.wait_with_output().expect("output");
    let stdout = String::from_utf8_lossy(&out.stdout);
    let line = stdout.lines().last().unwrap_or_default();
    serde_json::from_str(line).unwrap_or_else(|_| {
        panic!(
            "the client printed no JSON ({args:?}): {stdout}\n{}",
            String::from_utf8_lossy(&out.stderr)
        )
    })
}

/// Starts the client in the background (killed when dropped).
fn client_in_background(args: &[&str]) -> Proc {
    let child = Command::new(python())
        .arg(script())
        .args(args)
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .expect("python runs");
    Proc(child)
}

/// `ip:port` of a mocker's `--worker` line (its `url=`).
fn endpoint_of(line: &str) -> String {
    line.split(',')
        .find_map(|kv| kv.strip_prefix("url=http://"))
        .expect("a url")
        .trim_end_matches('/')
        .to_owned()
}

/// Runs the client's `process` against the picker with `extra` arguments.
fn process(picker: &Picker, body: &BodyFile, extra: &[&str]) -> Value {
    let mut args = vec![
        "process",
        "--target",
        &picker.ext_proc,
        "--body",
        body.arg(),
    ];
    args.extend_from_slice(extra);
    client(&args)
}

/// The endpoint a routed answer names, after checking that the header and
/// the metadata agree, that the route cache is cleared and that a client
/// cannot append a destination of its own.
fn routed_to(answer: &Value) -> String {
    assert_eq!(answer["kind"], "routed", "{answer}");
    let header = answer["headers"]["x-gateway-destination-endpoint"]
        .as_str()
        .expect("the destination header");
    assert_eq!(answer["metadata_endpoint"], header, "{answer}");
    assert_eq!(answer["clear_route_cache"], true, "{answer}");
    // OVERWRITE_IF_EXISTS_OR_ADD.
    assert_eq!(
        answer["headers"]["x-gateway-destination-endpoint:append_action"],
        2
    );
    header.to_owned()
}

#[test]
fn the_picker_routes_a_chunked_body_on_the_index_and_echoes_it_byte_for_byte() {
    let (_mocker, workers) = start_mocker_with(2, &["--speedup", "100"]);
    let endpoints: Vec<String> = workers.iter().map(|w| endpoint_of(w)).collect();
    let picker = start_picker(&workers, &["--epp-plaintext", "--tokenizer", "builtin"]);
    // A text prompt of about 130 kB, sent in three uneven chunks, comes
    // back whole in pieces of 62 000 bytes, the last one ending the body,
    // and the response phase passes through unchanged.
    let words: Vec<String> = (0..28_000).map(|i| format!("w{}", i % 997)).collect();
    let big =
        json!({"model": "mock-model", "prompt": words.join(" "), "max_tokens": 4, "stream": true});
    let big = BodyFile::new(big.to_string().as_bytes());
    let size = std::fs::metadata(&big.0).expect("the body").len() as usize;
    assert!(size > 124_000, "{size}");
    let answer = process(&picker, &big, &["--chunks", "7,65536", "--response", "sse"]);
    assert!(endpoints.contains(&routed_to(&answer)), "{answer}");
    let sizes: Vec<u64> = answer["echo_sizes"]
        .as_array()
        .expect("sizes")
        .iter()
        .filter_map(Value::as_u64)
        .collect();
    assert_eq!(sizes, [62_000, 62_000, size as u64 - 124_000], "{answer}");
    assert_eq!(answer["echo_ends"], json!([false, false, true]));
    assert_eq!(answer["echo_equal"], true, "byte for byte: {answer}");
    assert_eq!(answer["response_echo_equal"], true, "{answer}");
    assert_eq!(answer["stream_ended"], true, "{answer}");

    // The index decides: once an engine has cached a prompt (the test plays
    // the data plane and sends the request where the picker said), the
    // picker sends the same prompt there again, unless the subset hint
    // leaves only the other endpoint.
    let prompt: Vec<u32> = (1..=160).collect();
    let body = json!({"model": "mock-model", "prompt": prompt, "max_tokens": 1});
    let ids = BodyFile::new(body.to_string().as_bytes());
    let first = routed_to(&process(&picker, &ids, &["--chunks", "20"]));
    let sent = request(&first, "POST", "/v1/completions", &body.to_string());
    assert_eq!(sent.status, 200, "{}", sent.body);
    let query = json!({"token_ids": prompt}).to_string();
    eventually(
        "the index holds the prompt on the engine that served it",
        || {
            let doc = request(&picker.http, "POST", "/query", &query).json();
            doc["scores"].as_object().is_some_and(|s| !s.is_empty())
        },
    );
    let again = process(
        &picker,
        &ids,
        &["--response", "sse", "--cached-tokens", "144"],
    );
    assert_eq!(routed_to(&again), first, "the prefix's engine: {again}");
    let other = endpoints
        .iter()
        .find(|e| **e != first)
        .expect("two engines")
        .clone();
    let hinted = process(&picker, &ids, &["--subset", &other]);
    assert_eq!(routed_to(&hinted), other, "the hint's only endpoint");
    let both = format!("{other},{first}");
    let listed = process(&picker, &ids, &["--subset", &both, "--subset-list"]);
    assert_eq!(routed_to(&listed), first, "the cache within the hint");
    let listed_one = process(&picker, &ids, &["--subset", &other, "--subset-list"]);
    assert_eq!(routed_to(&listed_one), other);
    // The whole address, any port: a bare IP admits both, and the cache decides.
    let bare = process(&picker, &ids, &["--subset", "127.0.0.1"]);
    assert_eq!(routed_to(&bare), first);

    refusals_and_health(&picker, &ids);

    // The same metrics as serve's, and the picker's own.
    let http = &picker.http;
    assert_eq!(count(http, "kvroute_epp_picks_total"), 7);
    assert_eq!(count(http, "kvroute_epp_streams_total"), 10);
    assert_eq!(metric(http, "kvroute_epp_streams_open"), Some(0.0));
    let refused = |label| metric_where(http, "kvroute_epp_immediate_responses_total", label);
    assert_eq!(refused("status=\"503\""), Some(2.0));
    let mode = metric_where(http, "kvroute_epp_refused_streams_total", "processing_mode");
    assert_eq!(mode, Some(1.0));
    assert_eq!(count(http, "kvroute_proxy_routed_total"), 7);
    assert_eq!(count(http, "kvroute_accuracy_comparisons_total"), 2);
    assert_eq!(count(http, "kvroute_epp_decision_seconds_count"), 7);
    eventually("no request left in flight", || {
        metric(http, "kvroute_active_requests") == Some(0.0)
    });
}

/// What the picker answers itself: 503 when no endpoint is eligible (an
/// address no worker has, or an empty hint), a refusal for a body mode that
/// would deadlock, and health as GIE's pickers answer it on both ports.
fn refusals_and_health(picker: &Picker, ids: &BodyFile) {
    // No eligible endpoint (an address no worker has, or an empty hint):
    // the picker answers 503 itself.
    for hint in ["10.255.0.1:8000", ""] {
        let refused = process(picker, ids, &["--subset", hint]);
        assert_eq!(refused["kind"], "immediate", "{refused}");
        assert_eq!(refused["status"], 503, "{refused}");
        let error: Value = serde_json::from_str(refused["body"].as_str().unwrap_or_default())
            .expect("an OpenAI error body");
        assert_eq!(error["error"]["code"], 503);
        assert!(
            error["error"]["message"]
                .as_str()
                .is_some_and(|m| m.contains("subset hint")),
            "{error}"
        );
    }

    // Envoy in another body mode would deadlock: refused at once.
    let buffered = process(picker, ids, &["--mode", "buffered"]);
    assert_eq!(buffered["kind"], "grpc_error", "{buffered}");
    assert_eq!(buffered["code"], "FAILED_PRECONDITION", "{buffered}");
    assert!(
        buffered["details"]
            .as_str()
            .is_some_and(|d| d.contains("FULL_DUPLEX_STREAMED")),
        "{buffered}"
    );

    // Health, as GIE's pickers answer it, on both ports.
    let names = [
        "",
        "liveness",
        "readiness",
        "envoy.service.ext_proc.v3.ExternalProcessor",
        "other",
    ];
    let mut args = vec!["health", "--target", picker.health.as_str()];
    for name in names {
        args.extend(["--service", name]);
    }
    let statuses = client(&args);
    for name in &names[..4] {
        assert_eq!(statuses[*name], "SERVING", "{name}: {statuses}");
    }
    assert_eq!(statuses["other"], "NOT_FOUND", "{statuses}");
    args[2] = picker.ext_proc.as_str();
    assert_eq!(client(&args)[names[3]], "SERVING");
}

#[test]
fn a_busy_fleet_sheds_with_429_and_a_closed_stream_frees_its_load_over_tls() {
    let (_mocker, workers) = start_mocker_with(1, &["--speedup", "100"]);
    // TLS is the default: a self-signed certificate made at start.
    let picker = start_picker(&workers, &["--busy-requests", "1"]);
    let body =
        json!({"model": "mock-model", "prompt": (1..=64).collect::<Vec<u32>>(), "max_tokens": 1});
    let body = BodyFile::new(body.to_string().as_bytes());
    let (target, file) = (picker.ext_proc.as_str(), body.arg());
    // A request whose answer has not ended holds its place in the load...
    let holder = client_in_background(&[
        "process",
        "--target",
        target,
        "--tls",
        "--body",
        file,
        "--hold-secs",
        "30",
    ]);
    let http = &picker.http;
    eventually("the held request is in flight", || {
        metric(http, "kvroute_active_requests") == Some(1.0)
    });
    // ...so the only rank is busy, and the next request is shed.
    let shed = client(&["process", "--target", target, "--tls", "--body", file]);
    assert_eq!(shed["kind"], "immediate", "{shed}");
    assert_eq!(shed["status"], 429, "{shed}");
    assert_eq!(shed["headers"]["retry-after"], "1", "{shed}");
    let error: Value =
        serde_json::from_str(shed["body"].as_str().unwrap_or_default()).expect("an error body");
    assert_eq!(error["error"]["type"], "overloaded", "{error}");
    // The stream closing ends the request, whatever stage it was at.
    drop(holder);
    eventually("the closed stream's load is freed", || {
        metric(http, "kvroute_active_requests") == Some(0.0)
    });
    let routed = client(&["process", "--target", target, "--tls", "--body", file]);
    assert_eq!(routed_to(&routed), endpoint_of(&workers[0]));
    let statuses = client(&[
        "health",
        "--target",
        target,
        "--tls",
        "--service",
        "envoy.service.ext_proc.v3.ExternalProcessor",
    ]);
    assert_eq!(
        statuses["envoy.service.ext_proc.v3.ExternalProcessor"],
        "SERVING"
    );
    let shed_count = metric_where(http, "kvroute_epp_immediate_responses_total", "429");
    assert_eq!(shed_count, Some(1.0));
    assert_eq!(count(http, "kvroute_proxy_overloaded_total"), 1);
}

/// `kvroute bench` at `host:port` on a shared-prefix workload whose groups
/// do not fit every engine: its report of the run, checked complete.
fn bench_at(host_port: &str, requests: u32) -> Value {
    let requests = requests.to_string();
    let doc = crate::support::bench_report(
        host_port,
        &[
            "--workload",
            "shared-prefix",
            "--groups",
            "8",
            "--scale",
            "0.1",
            "--requests",
            &requests,
            "--concurrency",
            "4",
            "--max-tokens",
            "4",
            "--seed",
            "3",
        ],
    );
    let run = doc["policies"]["target"].clone();
    assert_eq!(run["failed"], 0, "{run}");
    run
}

/// Routing through the picker is as good as `serve`'s own: the same seeded
/// workload through a data plane that asks the picker reaches the hit rate
/// it reaches through `serve` on the same fleet, each on emptied caches.
#[test]
fn routing_through_the_picker_hits_the_cache_as_serve_does() {
    let (_mocker, lines) = start_mocker_with(3, &["--num-gpu-blocks", "256", "--speedup", "20"]);
    let picker = start_picker(&lines, &["--epp-plaintext"]);
    let reset = || {
        for line in &lines {
            let reply = request(&endpoint_of(line), "POST", "/reset_prefix_cache", "");
            assert_eq!(reply.status, 200, "{}", reply.body);
        }
    };
    reset();
    let direct = bench_at(&picker.http, 240);
    reset();
    let (_plane, plane) = start_dataplane(&picker.ext_proc, &[]);
    let through = bench_at(&plane, 240);
    let hit = |run: &Value| run["hit_rate"].as_f64().unwrap_or(0.0);
    assert!(hit(&direct) > 0.5, "serve's hit rate {}", hit(&direct));
    assert!(
        hit(&through) >= hit(&direct) - 0.03,
        "through the picker {} against serve's {}",
        hit(&through),
        hit(&direct)
    );
    let picks = metric(&picker.http, "kvroute_epp_picks_total").unwrap_or(0.0);
    assert_eq!(
        picks as u64, 240,
        "every request through the data plane was picked"
    );
}

/// Envoy's FailOpen through a restart of the picker: while it is down the
/// data plane sends requests on by itself, then asks the new picker again,
/// and not one request of the run is lost.
#[test]
fn no_request_is_lost_while_the_picker_restarts_under_fail_open() {
    let (_mocker, lines) = start_mocker_with(2, &["--speedup", "20"]);
    let port = free_port().to_string();
    let flags = ["--epp-plaintext", "--epp-port", port.as_str()];
    let first = start_picker(&lines, &flags);
    let endpoints: Vec<String> = lines.iter().map(|l| endpoint_of(l)).collect();
    let (_plane, plane) = start_dataplane(&first.ext_proc, &endpoints);
    let run = {
        let plane = plane.clone();
        std::thread::spawn(move || bench_at(&plane, 600))
    };
    eventually("the first picker routes", || {
        metric(&first.http, "kvroute_epp_picks_total").unwrap_or(0.0) >= 20.0
    });
    drop(first);
    std::thread::sleep(Duration::from_millis(300));
    let second = start_picker(&lines, &flags);
    let run = run.join().expect("the bench's thread");
    assert_eq!(run["requests"], 600, "{run}");
    assert_eq!(run["failed"], 0, "{run}");
    let picked = metric(&second.http, "kvroute_epp_picks_total").unwrap_or(0.0);
    assert!(picked > 0.0, "the data plane came back to the new picker");
}

/// Twenty streams each send 10 MB of a request body and never end it: the
/// picker holds none of them past the memory budget every body shares
/// (429 at once for those over it) nor past the body-read allowance (408),
/// so the router's memory stays bounded (50 such streams used to take it
/// to 735 MB), and the picker keeps routing a whole request meanwhile.
#[test]
fn unfinished_request_bodies_cannot_hold_the_pickers_memory() {
    let (_mocker, workers) = start_mocker_with(1, &["--speedup", "100"]);
    let env = [
        ("KVROUTE_BODY_TIMEOUT_SECS", "2"),
        ("KVROUTE_BODY_MIN_RATE_KIB", "1000000"),
    ];
    let picker = start_picker_with_env(&workers, &["--epp-plaintext"], &env);
    let big = BodyFile::new(&vec![b' '; 10 << 20]);
    let target = picker.ext_proc.clone();
    let stalled: Vec<_> = (0..20)
        .map(|_| {
            let (target, file) = (target.clone(), big.arg().to_owned());
            std::thread::spawn(move || {
                client(&[
                    "process",
                    "--target",
                    &target,
                    "--body",
                    &file,
                    "--chunks",
                    "1000000,1000000,1000000,1000000,1000000,1000000,1000000,1000000,1000000",
                    "--no-end",
                ])
            })
        })
        .collect();
    let small = json!({"model": "mock-model", "prompt": [1, 2, 3], "max_tokens": 1});
    let small = BodyFile::new(small.to_string().as_bytes());
    let routed = client(&["process", "--target", &target, "--body", small.arg()]);
    assert_eq!(routed_to(&routed), endpoint_of(&workers[0]));
    for answer in stalled {
        let answer = answer.join().expect("a stalled client");
        assert_eq!(answer["kind"], "immediate", "{answer}");
        // 429: the picker's word for "shed, retry" (Envoy retries it).
        assert!(
            [408, 429].contains(&answer["status"].as_u64().unwrap_or(0)),
            "{answer}"
        );
    }
    crate::support::assert_peak_rss_under(
        picker.proc.0.id(),
        256 << 20,
        "under twenty unfinished 10 MB picker streams",
    );
}
