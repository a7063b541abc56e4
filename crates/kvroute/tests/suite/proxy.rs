//! `kvroute serve` as a routing proxy in front of real `kvroute mocker`
//! engines, all as processes on 127.0.0.1: prefix affinity, load spreading,
//! streaming pass-through, retries past a dead worker, overload, bad input,
//! `/query` and the index-accuracy metric.

use std::io::{BufRead, BufReader};
use std::net::TcpStream;

use serde_json::json;

use crate::support::http::*;
use crate::support::*;

/// Sends a streaming request and reads until the first `data:` chunk; the
/// stream stays open while the returned socket lives.
fn open_stream(host_port: &str, body: &str) -> (TcpStream, String) {
    let s = send(host_port, "POST", "/v1/completions", body);
    let mut reader = BufReader::new(s.try_clone().expect("clone"));
    let mut head = String::new();
    loop {
        let mut line = String::new();
        let n = reader.read_line(&mut line).expect("read");
        assert!(n > 0, "stream closed early: {head}");
        head.push_str(&line.to_ascii_lowercase());
        if line.starts_with("data: ") {
            return (s, head);
        }
    }
}

fn header_in(head: &str, name: &str) -> Option<String> {
    let prefix = format!("{name}:");
    head.lines()
        .find_map(|l| l.strip_prefix(&prefix).map(|v| v.trim().to_owned()))
}

fn device_blocks(serve: &str, worker: &str) -> u64 {
    let doc = request(serve, "GET", "/workers", "").json();
    doc["workers"]
        .as_array()
        .into_iter()
        .flatten()
        .filter(|w| w["name"] == worker)
        .flat_map(|w| w["ranks"].as_array().cloned().unwrap_or_default())
        .map(|r| r["blocks"]["device"].as_u64().unwrap_or(0))
        .sum()
}

/// Sends a completion that must be answered by `holder`; its cached tokens.
fn cached_at_holder(serve: &str, body: &str, holder: &str) -> u64 {
    let r = request(serve, "POST", "/v1/completions", body);
    assert_eq!(r.status, 200, "{}", r.body);
    assert_eq!(r.header("x-kvroute-worker").as_deref(), Some(holder));
    r.json()["usage"]["prompt_tokens_details"]["cached_tokens"]
        .as_u64()
        .expect("cached_tokens")
}

fn completion(prompt: &[u32], max_tokens: u32, stream: bool) -> String {
    json!({"model": "mock-model", "prompt": prompt, "max_tokens": max_tokens, "stream": stream})
        .to_string()
}

#[test]
fn a_repeated_prefix_goes_to_the_worker_holding_it() {
    let (_mocker, lines) = start_mocker(2, "100");
    let (_serve, serve) = start_serve(&lines, &[]);
    let prompt: Vec<u32> = (1000..1128).collect();
    let first = request(
        &serve,
        "POST",
        "/v1/completions",
        &completion(&prompt, 1, false),
    );
    assert_eq!(first.status, 200, "{}", first.body);
    let holder = first.header("x-kvroute-worker").expect("worker header");
    assert_eq!(
        first.json()["usage"]["prompt_tokens_details"]["cached_tokens"],
        0
    );
    eventually("the first prompt's blocks in the index", || {
        device_blocks(&serve, &holder) >= 8
    });
    // /query names the holder, with the Dynamo-compatible `scores` shape.
    let q = request(
        &serve,
        "POST",
        "/query",
        &json!({"token_ids": prompt}).to_string(),
    );
    assert_eq!(q.status, 200, "{}", q.body);
    let q = q.json();
    assert_eq!(q["scores"][&holder]["0"], 128);
    assert_eq!(q["chosen"]["name"], holder.as_str());
    let workers = q["workers"].as_array().expect("workers");
    assert_eq!(workers.len(), 2);
    for w in workers {
        for key in [
            "prefill_blocks",
            "overlap_credit",
            "prefill",
            "decode_blocks",
            "decode_load",
            "size",
            "total",
        ] {
            assert!(w["cost"][key].is_number(), "{w}");
        }
        assert!(w["host_blocks"].is_number() && w["disk_blocks"].is_number());
    }
    // A prompt sharing the first 112 tokens goes to the holder and hits its cache.
    let mut second: Vec<u32> = prompt[..112].to_vec();
    second.extend(5000..5032);
    for _ in 0..3 {
        let cached = cached_at_holder(&serve, &completion(&second, 1, false), &holder);
        assert!(cached >= 112, "cached {cached}");
        // Let the blocks of this request land before the next prediction.
        eventually("the second prompt's blocks in the index", || {
            let q = request(
                &serve,
                "POST",
                "/query",
                &json!({"token_ids": second}).to_string(),
            );
            q.json()["scores"][&holder]["0"] == 144
        });
    }
    // The index predicted every cached_tokens exactly.
    let comparisons = count(&serve, "kvroute_accuracy_comparisons_total");
    assert_eq!(comparisons, 4);
    assert_eq!(count(&serve, "kvroute_accuracy_exact_total"), comparisons);
    let by_hash = request(
        &serve,
        "POST",
        "/query_by_hash",
        r#"{"local_hashes":[1,2,3]}"#,
    );
    assert_eq!(by_hash.status, 200);
    assert!(by_hash.json()["workers"]
        .as_array()
        .is_some_and(|w| w.len() == 2));
}

#[test]
fn new_prefixes_spread_and_streams_pass_through() {
    // Real time (speedup 1): a 1000-token decode lasts seconds, so streams overlap.
    let (_mocker, lines) = start_mocker(2, "1");
    let (_serve, serve) = start_serve(&lines, &[]);
    let mut open = Vec::new();
    let mut used = std::collections::BTreeSet::new();
    for i in 0..4u32 {
        let prompt: Vec<u32> = (i * 1000..i * 1000 + 64).collect();
        let (socket, head) = open_stream(&serve, &completion(&prompt, 1000, true));
        assert!(head.starts_with("http/1.1 200"), "{head}");
        assert!(head.contains("text/event-stream"), "{head}");
        used.insert(header_in(&head, "x-kvroute-worker").expect("worker header"));
        open.push(socket);
    }
    assert_eq!(
        used.len(),
        2,
        "both workers take the new prefixes: {used:?}"
    );
    // Closing the client sockets cancels the upstream requests and frees their load.
    drop(open);
    eventually("active requests freed after the clients left", || {
        let text = request(&serve, "GET", "/metrics", "").body;
        let active: Vec<&str> = text
            .lines()
            .filter(|l| l.starts_with("kvroute_active_requests{"))
            .collect();
        // Both workers' ranks took streams, so both are listed.
        active.len() == 2 && active.iter().all(|l| l.ends_with(" 0"))
    });
    // A complete stream: many chunks, the usage chunk, then [DONE].
    let body = json!({"model": "mock-model", "prompt": (7000..7064).collect::<Vec<u32>>(),
        "max_tokens": 8, "stream": true, "stream_options": {"include_usage": true}})
    .to_string();
    let r = request(&serve, "POST", "/v1/completions", &body);
    assert_eq!(r.status, 200);
    let chunks = r.body.matches("data: {").count();
    assert!(chunks >= 9, "{chunks} chunks: {}", r.body);
    assert!(r.body.contains("cached_tokens"));
    let (events, ended) = dechunk(r.body.as_bytes());
    let events = String::from_utf8_lossy(&events).into_owned();
    assert!(ended, "the chunked body has no last chunk: {}", r.body);
    assert!(events.ends_with("}\n\ndata: [DONE]\n\n"), "{events}");
    assert!(count(&serve, "kvroute_accuracy_comparisons_total") >= 1);
}

#[test]
fn a_killed_worker_fails_no_client_request() {
    let (mocker_a, lines_a) = start_mocker(1, "100");
    let (_mocker_b, lines_b) = start_mocker(1, "100");
    // Both mockers call their engine w0: rename the second.
    let line_b = lines_b[0].replacen("name=w0", "name=w1", 1);
    let lines = vec![lines_a[0].clone(), line_b];
    let (_serve, serve) = start_serve(&lines, &["--breaker-failures", "2"]);
    // Find a prompt w0 (process A) holds, so that w0 is the first choice after the kill.
    let prompt: Vec<u32> = (20_000..20_064).collect();
    let mut holder = String::new();
    let mut attempt = 0u32;
    while holder != "w0" {
        let p: Vec<u32> = prompt.iter().map(|t| t + attempt * 100).collect();
        let r = request(&serve, "POST", "/v1/completions", &completion(&p, 1, false));
        assert_eq!(r.status, 200);
        holder = r.header("x-kvroute-worker").expect("worker header");
        if holder == "w0" {
            eventually("w0's blocks in the index", || {
                device_blocks(&serve, "w0") >= 4
            });
            drop(mocker_a);
            for i in 0..10u32 {
                let body = if i == 0 {
                    completion(&p, 1, false)
                } else {
                    completion(&(i * 300..i * 300 + 64).collect::<Vec<u32>>(), 1, false)
                };
                let r = request(&serve, "POST", "/v1/completions", &body);
                assert_eq!(r.status, 200, "request {i}: {}", r.body);
                assert_eq!(r.header("x-kvroute-worker").as_deref(), Some("w1"));
            }
            assert!(count(&serve, "kvroute_proxy_retries_total") >= 1);
            return;
        }
        attempt += 1;
        assert!(attempt < 64, "w0 never chosen");
    }
}

#[test]
fn a_bounded_queue_holds_requests_until_a_rank_has_room() {
    let (_mocker, lines) = start_mocker(1, "1");
    let (_serve, serve) = start_serve(
        &lines,
        &[
            "--busy-decode-blocks",
            "1",
            "--queue-capacity",
            "1",
            "--queue-timeout-ms",
            "20000",
        ],
    );
    // A long stream holds the only worker over its threshold.
    let (socket, head) = open_stream(
        &serve,
        &completion(&(0..64).collect::<Vec<u32>>(), 1000, true),
    );
    assert!(head.starts_with("http/1.1 200"), "{head}");
    let waiting = {
        let serve = serve.clone();
        std::thread::spawn(move || {
            request(
                &serve,
                "POST",
                "/v1/completions",
                &completion(&[1, 2, 3], 1, false),
            )
        })
    };
    eventually("the request waits in the queue", || {
        count(&serve, "kvroute_proxy_queued_total") == 1
    });
    // The queue's one place is taken: the next request (of the same,
    // anonymous tenant) is refused at once, with a 429 and `retry-after`.
    let full = request(
        &serve,
        "POST",
        "/v1/completions",
        &completion(&[4, 5, 6], 1, false),
    );
    assert_eq!(full.status, 429, "{}", full.body);
    assert!(
        full.body.contains("the full overload queue"),
        "{}",
        full.body
    );
    assert_eq!(full.header("retry-after").as_deref(), Some("1"));
    // The stream ends: the queued request goes through.
    drop(socket);
    let answer = waiting.join().expect("the waiting client");
    assert_eq!(answer.status, 200, "{}", answer.body);
    assert_eq!(count(&serve, "kvroute_proxy_queue_timeouts_total"), 0);
}

#[test]
fn overload_and_bad_input_are_refused_clearly() {
    let (_mocker, lines) = start_mocker(1, "1");
    let (_serve, serve) = start_serve(
        &lines,
        &["--busy-decode-blocks", "1", "--max-body-mib", "1"],
    );
    let bad = request(&serve, "POST", "/v1/completions", "{not json");
    assert_eq!(bad.status, 400);
    assert!(bad.json()["error"]["message"]
        .as_str()
        .is_some_and(|m| m.contains("invalid JSON")));
    let missing = request(&serve, "POST", "/v1/chat/completions", r#"{"model":"m"}"#);
    assert_eq!(missing.status, 400);
    assert!(missing.body.contains("`messages` is required"));
    let big = format!(r#"{{"prompt":"{}"}}"#, "x".repeat(2 << 20));
    assert_eq!(request(&serve, "POST", "/v1/completions", &big).status, 413);
    let q = request(&serve, "POST", "/query", r#"{"token_ids":"x"}"#);
    assert_eq!(q.status, 400);
    // One long stream holds the only worker's blocks: the next request is refused.
    let message = refused_while_a_stream_holds_the_worker(&serve);
    assert!(message.contains("busy thresholds"), "{message}");
    // Text prompts without a tokenizer are routed on load and counted.
    let text = request(
        &serve,
        "POST",
        "/v1/completions",
        r#"{"model":"mock-model","prompt":"hello there","max_tokens":1}"#,
    );
    assert_eq!(text.status, 200, "{}", text.body);
    assert!(count(&serve, "kvroute_proxy_load_only_total") >= 1);
    let models = request(&serve, "GET", "/v1/models", "");
    assert_eq!(models.status, 200);
    assert_eq!(models.json()["data"][0]["id"], "mock-model");
}

#[test]
fn chat_requests_are_tokenized_and_routed_to_their_prefix() {
    let (_mocker, lines) = start_mocker(2, "100");
    let (_serve, serve) = start_serve(&lines, &["--tokenizer", "builtin"]);
    let system = "You are a careful assistant. ".repeat(40);
    let chat = |user: &str| {
        json!({"model": "mock-model", "max_tokens": 1, "messages": [
            {"role": "system", "content": system},
            {"role": "user", "content": user},
        ]})
        .to_string()
    };
    let first = request(
        &serve,
        "POST",
        "/v1/chat/completions",
        &chat("first question"),
    );
    assert_eq!(first.status, 200, "{}", first.body);
    let holder = first.header("x-kvroute-worker").expect("worker header");
    eventually("the system prompt's blocks in the index", || {
        device_blocks(&serve, &holder) >= 8
    });
    let q = request(
        &serve,
        "POST",
        "/query",
        &json!({"messages": [{"role": "system", "content": system}, {"role": "user", "content": "x"}]})
            .to_string(),
    );
    assert_eq!(q.status, 200, "{}", q.body);
    assert!(q.json()["scores"][&holder]["0"]
        .as_u64()
        .is_some_and(|t| t >= 128));
    let second = request(&serve, "POST", "/v1/chat/completions", &chat("another one"));
    assert_eq!(second.status, 200, "{}", second.body);
    assert_eq!(
        second.header("x-kvroute-worker").as_deref(),
        Some(holder.as_str())
    );
    let cached = second.json()["usage"]["prompt_tokens_details"]["cached_tokens"]
        .as_u64()
        .expect("cached_tokens");
    assert!(cached >= 128, "cached {cached}");
    assert_eq!(count(&serve, "kvroute_proxy_load_only_total"), 0);
    assert_eq!(
        count(&serve, "kvroute_accuracy_exact_total"),
        count(&serve, "kvroute_accuracy_comparisons_total")
    );
}

#[test]
fn approx_routing_learns_from_its_own_decisions_without_events() {
    let (_mocker, lines) = start_mocker(2, "100");
    // Point every worker's events at a port nobody publishes on: no events reach the index.
    let lines: Vec<String> = lines
        .iter()
        .map(|l| {
            l.split(',')
                .filter(|kv| !kv.starts_with("replay="))
                .map(|kv| {
                    if kv.starts_with("events=") {
                        format!("events=tcp://127.0.0.1:{}", free_port())
                    } else {
                        kv.to_owned()
                    }
                })
                .collect::<Vec<_>>()
                .join(",")
        })
        .collect();
    let (_serve, serve) = spawn_serve(&lines, &["--policy", "approx"]);
    eventually("serve up with both workers", || {
        TcpStream::connect(&serve).is_ok()
            && request(&serve, "GET", "/workers", "").json()["workers"]
                .as_array()
                .is_some_and(|w| w.len() == 2)
    });
    let prompt: Vec<u32> = (40_000..40_128).collect();
    let first = request(
        &serve,
        "POST",
        "/v1/completions",
        &completion(&prompt, 1, false),
    );
    assert_eq!(first.status, 200, "{}", first.body);
    let holder = first.header("x-kvroute-worker").expect("worker header");
    // The decision itself is the index entry: no waiting for events.
    let q = request(
        &serve,
        "POST",
        "/query",
        &json!({"token_ids": prompt}).to_string(),
    )
    .json();
    assert_eq!(q["scores"][&holder]["0"], 128);
    for _ in 0..3 {
        let cached = cached_at_holder(&serve, &completion(&prompt, 1, false), &holder);
        assert_eq!(cached, 112);
    }
}

/// A model folder with a word-level tokenizer (`t0` … `t299` are ids 1 …
/// 300) and a chat template with role markers `t290`/`t291` and a generation
/// prompt `t292`: the folder and its `tokenizer.json`.
#[cfg(feature = "hf-tokenizer")]
fn word_level_model_folder() -> (std::path::PathBuf, std::path::PathBuf) {
    let mut vocab = serde_json::Map::new();
    vocab.insert("[UNK]".into(), 0.into());
    for i in 0..300u32 {
        vocab.insert(format!("t{i}"), (i + 1).into());
    }
    let file = json!({
        "version": "1.0", "truncation": null, "padding": null, "added_tokens": [],
        "normalizer": null, "pre_tokenizer": {"type": "Whitespace"},
        "post_processor": null, "decoder": null,
        "model": {"type": "WordLevel", "vocab": vocab, "unk_token": "[UNK]"},
    });
    // The model's own chat template sits beside it, as in a model folder.
    let dir = std::env::temp_dir().join(format!("kvroute-proxy-tok-{}", std::process::id()));
    std::fs::create_dir_all(&dir).expect("temp dir");
    let path = dir.join("tokenizer.json");
    std::fs::write(&path, file.to_string()).expect("write the tokenizer");
    let template = "{% for m in messages %}t290 {{ m['content'] }} t291 {% endfor %}{% if add_generation_prompt %}t292{% endif %}";
    std::fs::write(
        dir.join("tokenizer_config.json"),
        json!({"chat_template": template}).to_string(),
    )
    .expect("write the config");
    (dir, path)
}

#[cfg(feature = "hf-tokenizer")]
#[test]
fn text_prompts_are_tokenized_with_a_hugging_face_tokenizer() {
    let (dir, path) = word_level_model_folder();
    let path_arg = path.to_str().expect("utf-8 path").to_owned();
    let (_mocker, lines) = start_mocker_with(2, &["--tokenizer", &path_arg, "--speedup", "100"]);
    let (_serve, serve) = start_serve(&lines, &["--tokenizer", &path_arg]);
    let words =
        |range: std::ops::Range<u32>| range.map(|i| format!("t{i}")).collect::<Vec<_>>().join(" ");
    let body =
        |text: String| json!({"model": "mock-model", "prompt": text, "max_tokens": 1}).to_string();
    let first = request(&serve, "POST", "/v1/completions", &body(words(0..160)));
    assert_eq!(first.status, 200, "{}", first.body);
    let holder = first.header("x-kvroute-worker").expect("worker header");
    eventually("the prompt's blocks in the index", || {
        device_blocks(&serve, &holder) >= 10
    });
    let second = request(
        &serve,
        "POST",
        "/v1/completions",
        &body(format!("{} {}", words(0..128), words(200..240))),
    );
    assert_eq!(second.status, 200, "{}", second.body);
    assert_eq!(
        second.header("x-kvroute-worker").as_deref(),
        Some(holder.as_str())
    );
    assert_eq!(
        second.json()["usage"]["prompt_tokens_details"]["cached_tokens"],
        128
    );
    assert_eq!(count(&serve, "kvroute_proxy_load_only_total"), 0);

    // Chats render through the model's template on both sides: a chat whose
    // first message repeats goes to its holder, and the router predicted
    // exactly what the engine reports as cached.
    let chat = |second: String| {
        json!({"model": "mock-model", "max_tokens": 1, "messages": [
            {"role": "system", "content": words(0..100)},
            {"role": "user", "content": second},
        ]})
        .to_string()
    };
    let first = request(
        &serve,
        "POST",
        "/v1/chat/completions",
        &chat(words(100..130)),
    );
    assert_eq!(first.status, 200, "{}", first.body);
    // t290, 100 words, t291, t290, 30 words, t291, t292.
    assert_eq!(first.json()["usage"]["prompt_tokens"], 135);
    let chat_holder = first.header("x-kvroute-worker").expect("worker header");
    let probe = json!({"messages": [
        {"role": "system", "content": words(0..100)},
        {"role": "user", "content": words(100..130)},
    ]})
    .to_string();
    eventually("the chat's blocks in the index", || {
        let answer = request(&serve, "POST", "/query", &probe).json();
        answer["workers"].as_array().is_some_and(|ws| {
            ws.iter().any(|w| {
                w["name"] == chat_holder.as_str() && w["device_blocks"].as_u64() >= Some(8)
            })
        })
    });
    let exact_before = count(&serve, "kvroute_accuracy_exact_total");
    let second = request(
        &serve,
        "POST",
        "/v1/chat/completions",
        &chat(words(200..230)),
    );
    assert_eq!(second.status, 200, "{}", second.body);
    assert_eq!(
        second.header("x-kvroute-worker").as_deref(),
        Some(chat_holder.as_str())
    );
    // The system message and its markers: 102 tokens, 6 whole blocks.
    assert_eq!(
        second.json()["usage"]["prompt_tokens_details"]["cached_tokens"],
        96
    );
    assert_eq!(
        count(&serve, "kvroute_accuracy_exact_total"),
        exact_before + 1
    );
    let _ = std::fs::remove_dir_all(&dir);
}

/// Device blocks of one rank of a worker, from `/workers`.
fn rank_blocks(serve: &str, worker: &str, rank: u64) -> u64 {
    let doc = request(serve, "GET", "/workers", "").json();
    doc["workers"]
        .as_array()
        .into_iter()
        .flatten()
        .filter(|w| w["name"] == worker)
        .flat_map(|w| w["ranks"].as_array().cloned().unwrap_or_default())
        .filter(|r| r["dp_rank"] == rank)
        .map(|r| r["blocks"]["device"].as_u64().unwrap_or(0))
        .sum()
}

fn dp_rank_reaches_the_engine(flavor: &str, extra: &[&str]) {
    let (_mocker, line) = start_two_rank_mocker(flavor);
    let (_serve, serve) = start_serve(&[line], extra);
    // Prompts of increasing first token until the router picks rank 1: the
    // mocker alone would pick rank 0 for an idle engine, so blocks on rank 1
    // prove the rank reached it.
    for i in 0..64u32 {
        let prompt: Vec<u32> = (50_000 + i * 100..50_000 + i * 100 + 64).collect();
        let r = request(
            &serve,
            "POST",
            "/v1/completions",
            &completion(&prompt, 1, false),
        );
        assert_eq!(r.status, 200, "{}", r.body);
        if r.header("x-kvroute-dp-rank").as_deref() == Some("1") {
            eventually("the prompt's blocks on rank 1", || {
                rank_blocks(&serve, "w0", 1) >= 4
            });
            return;
        }
    }
    panic!("rank 1 never chosen");
}

#[test]
fn the_chosen_dp_rank_reaches_a_vllm_engine_by_header() {
    dp_rank_reaches_the_engine("vllm", &[]);
}

#[test]
fn the_chosen_dp_rank_reaches_an_sglang_engine_in_the_body() {
    // The worker line says flavor=sglang: the rank goes in the body.
    dp_rank_reaches_the_engine("sglang", &[]);
}

#[test]
fn every_worker_gets_the_rank_in_the_body_when_asked() {
    dp_rank_reaches_the_engine("vllm", &["--dp-rank-in-body"]);
}

/// A streaming client that did not ask for usage gets no usage chunk, yet the
/// router (which added `include_usage` upstream) still compares the engine's
/// `cached_tokens` with its prediction.
#[test]
fn streams_without_include_usage_get_no_usage_chunk_but_are_measured() {
    let (_mocker, lines) = start_mocker(2, "100");
    let (_serve, serve) = start_serve(&lines, &[]);
    let prompt: Vec<u32> = (7000..7100).collect();
    let plain = request(
        &serve,
        "POST",
        "/v1/completions",
        &completion(&prompt, 8, true),
    );
    assert_eq!(plain.status, 200, "{}", plain.body);
    assert!(plain.body.contains("data: [DONE]"), "{}", plain.body);
    assert!(plain.body.contains("\"text\""), "{}", plain.body);
    assert!(!plain.body.contains("\"choices\":[]"), "{}", plain.body);
    assert!(!plain.body.contains("cached_tokens"), "{}", plain.body);
    assert_eq!(count(&serve, "kvroute_accuracy_comparisons_total"), 1);
    // A client that asks for usage still gets its usage chunk.
    let body = json!({"model": "mock-model", "prompt": prompt, "max_tokens": 8,
                      "stream": true, "stream_options": {"include_usage": true}});
    let asked = request(&serve, "POST", "/v1/completions", &body.to_string());
    assert_eq!(asked.status, 200, "{}", asked.body);
    assert!(asked.body.contains("\"choices\":[]"), "{}", asked.body);
    assert!(asked.body.contains("cached_tokens"), "{}", asked.body);
    assert_eq!(count(&serve, "kvroute_accuracy_comparisons_total"), 2);
}

/// Opens a long stream to the only worker, sends one more request, which
/// must be refused with a 503, and waits until the worker takes requests
/// again once the stream is closed; returns the refusal's message.
fn refused_while_a_stream_holds_the_worker(serve: &str) -> String {
    let (socket, head) = open_stream(
        serve,
        &completion(&(0..64).collect::<Vec<u32>>(), 1000, true),
    );
    assert!(head.starts_with("http/1.1 200"), "{head}");
    let small = completion(&[1, 2, 3], 1, false);
    let r = request(serve, "POST", "/v1/completions", &small);
    assert_eq!(r.status, 503, "{}", r.body);
    let message = r.json()["error"]["message"]
        .as_str()
        .unwrap_or_default()
        .to_owned();
    drop(socket);
    eventually("the worker takes requests again", || {
        request(serve, "POST", "/v1/completions", &small).status == 200
    });
    message
}

#[test]
fn a_rank_with_as_many_requests_in_flight_as_busy_requests_is_skipped() {
    let (_mocker, lines) = start_mocker(1, "1");
    let (_serve, serve) = start_serve(&lines, &["--busy-requests", "1"]);
    let message = refused_while_a_stream_holds_the_worker(&serve);
    assert!(message.contains("requests Some(1)"), "{message}");
}
