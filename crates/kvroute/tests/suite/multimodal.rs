//! Requests with images, end to end: `kvroute serve --tokenizer builtin` in
//! front of two `kvroute mocker` engines of one flavour. A client sends text
//! prompts and chat requests with data-URL images, each several times; the
//! repeats must hit the cache of the engine that holds them (SGLang: the
//! router folds the same wide pad ids the events carry; vLLM: the same item
//! hashes the events' extra keys give; TensorRT-LLM: the same item-local
//! positions and `mm_keys` items), every event must decode, and the router's
//! predictions must equal the engines' `cached_tokens`.

use serde_json::{json, Value};

use crate::support::http::*;
use crate::support::*;

/// Positions per image on both sides (mocker and router): long spans make the
/// one block every repeat recomputes (the last prompt token) a small share.
const MM_TOKENS: &str = "512";
const BLOCK_SIZE: u64 = 16;

fn start_fleet(flavor: &str) -> (Proc, Proc, String) {
    let (mocker, lines) = start_mocker_with(
        2,
        &[
            "--engine-flavor",
            flavor,
            "--speedup",
            "1000",
            "--mm-tokens-per-image",
            MM_TOKENS,
        ],
    );
    for line in &lines {
        assert!(line.contains(&format!("flavor={flavor}")), "{line}");
    }
    let (serve, addr) = start_serve(
        &lines,
        &["--tokenizer", "builtin", "--mm-tokens-per-image", MM_TOKENS],
    );
    (mocker, serve, addr)
}

/// A small deterministic "image": its bytes as a base64 data URL.
fn image_url(k: u32) -> String {
    const DIGITS: &[u8; 64] = b"ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789+/";
    let mut rng = kvroute_core::rng::SplitMix64::new(u64::from(k));
    let b64: String = (0..400)
        .map(|_| DIGITS[(rng.next_u64() >> 58) as usize] as char)
        .collect();
    format!("data:image/png;base64,{b64}")
}

fn image_chat(k: u32) -> Value {
    json!({
        "model": "mock-model",
        "messages": [{"role": "user", "content": [
            {"type": "image_url", "image_url": {"url": image_url(k)}},
            {"type": "text", "text": "What is shown here?"},
        ]}],
        "max_tokens": 1,
    })
}

fn video_chat(k: u32) -> Value {
    let url = image_url(1000 + k).replace("image/png", "video/mp4");
    json!({
        "model": "mock-model",
        "messages": [{"role": "user", "content": [
            {"type": "text", "text": "Describe this clip."},
            {"type": "video_url", "video_url": {"url": url}},
        ]}],
        "max_tokens": 1,
    })
}

fn text_completion(k: u32) -> Value {
    let words = [
        "alpha", "bravo", "charlie", "delta", "echo", "foxtrot", "golf", "hotel",
    ];
    let mut text = format!("Document {k}: ");
    for i in 0..400u32 {
        text.push_str(words[((i * 7 + k * 3) % 8) as usize]);
        text.push(' ');
    }
    json!({"model": "mock-model", "prompt": text, "max_tokens": 1})
}

/// One request's outcome.
struct Served {
    worker: String,
    prompt_tokens: u64,
    cached_tokens: u64,
}

fn send(serve: &str, path: &str, body: &Value) -> Served {
    let r = request(serve, "POST", path, &body.to_string());
    assert_eq!(r.status, 200, "{}", r.body);
    let doc = r.json();
    Served {
        worker: r.header("x-kvroute-worker").expect("worker header"),
        prompt_tokens: doc["usage"]["prompt_tokens"]
            .as_u64()
            .expect("prompt_tokens"),
        cached_tokens: doc["usage"]["prompt_tokens_details"]["cached_tokens"]
            .as_u64()
            .expect("cached_tokens"),
    }
}

/// Waits until `/query` for `body` sees every full block of the prompt on `worker`.
fn wait_indexed(serve: &str, body: &Value, worker: &str, prompt_tokens: u64, flavor: &str) {
    let full = prompt_tokens / BLOCK_SIZE * BLOCK_SIZE;
    eventually("the prompt's blocks in the index", || {
        let q = request(serve, "POST", "/query", &body.to_string()).json();
        q["scores"][worker]["0"].as_u64().unwrap_or(0) >= full
            && q["chosen"]["name"] == worker
            && q["workers"]
                .as_array()
                .is_some_and(|w| !w.is_empty() && w.iter().all(|w| w["flavor"] == flavor))
    });
}

/// Sends each request once, then `repeats` more times; returns the repeats'
/// cached / prompt tokens and checks each repeat went to the first's worker.
fn repeat_hit_rate(serve: &str, flavor: &str, path: &str, bodies: &[Value], repeats: usize) -> f64 {
    let (mut cached, mut prompt) = (0u64, 0u64);
    for body in bodies {
        let first = send(serve, path, body);
        assert_eq!(first.cached_tokens, 0, "a new prompt is a miss");
        wait_indexed(serve, body, &first.worker, first.prompt_tokens, flavor);
        for _ in 0..repeats {
            let again = send(serve, path, body);
            assert_eq!(
                again.worker, first.worker,
                "routed to the worker holding it"
            );
            assert_eq!(again.prompt_tokens, first.prompt_tokens);
            cached += again.cached_tokens;
            prompt += again.prompt_tokens;
        }
    }
    cached as f64 / prompt as f64
}

fn repeats_hit(flavor: &str) {
    let (_mocker, _serve_proc, serve) = start_fleet(flavor);
    let texts: Vec<Value> = (0..4).map(text_completion).collect();
    let images: Vec<Value> = (0..6).map(image_chat).collect();
    let text_rate = repeat_hit_rate(&serve, flavor, "/v1/completions", &texts, 2);
    let image_rate = repeat_hit_rate(&serve, flavor, "/v1/chat/completions", &images, 2);
    eprintln!(
        "{flavor}: text-repeat hit rate {text_rate:.4}, image-repeat hit rate {image_rate:.4}"
    );
    assert!(
        text_rate >= 0.96,
        "{flavor}: text-repeat hit rate {text_rate}"
    );
    assert!(
        image_rate >= 0.95,
        "{flavor}: image-repeat hit rate {image_rate}"
    );
    // Every event decoded and applied; every prediction was exact.
    assert_eq!(count(&serve, "kvroute_ingest_decode_errors_total"), 0);
    assert_eq!(count(&serve, "kvroute_ingest_envelope_errors_total"), 0);
    assert!(count(&serve, "kvroute_ingest_events_total") > 0);
    let comparisons = count(&serve, "kvroute_accuracy_comparisons_total");
    assert_eq!(comparisons, 30, "every response compared");
    assert_eq!(
        count(&serve, "kvroute_accuracy_exact_total"),
        comparisons,
        "{flavor}: the index predicted every cached_tokens"
    );
}

#[test]
fn sglang_repeated_images_hit_the_worker_holding_them() {
    repeats_hit("sglang");
}

#[test]
fn vllm_repeated_images_hit_the_worker_holding_them() {
    repeats_hit("vllm");
}

/// TensorRT-LLM's streaming events (signed radix-key hashes, coalesced
/// stores, images digest-first with `mm_keys`): text and image repeats hit
/// and every prediction is exact.
#[test]
fn trtllm_repeated_images_hit_the_worker_holding_them() {
    repeats_hit("trtllm");
}

/// Two different images with the same text around them are different prompts:
/// the second is not predicted to hit the first's blocks, on any flavour.
#[test]
fn different_images_do_not_look_alike_to_the_router() {
    for flavor in ["sglang", "vllm", "trtllm"] {
        let (_mocker, _serve_proc, serve) = start_fleet(flavor);
        let a = image_chat(100);
        let first = send(&serve, "/v1/chat/completions", &a);
        wait_indexed(&serve, &a, &first.worker, first.prompt_tokens, flavor);
        let q = request(&serve, "POST", "/query", &image_chat(101).to_string()).json();
        let matched: u64 = q["workers"]
            .as_array()
            .expect("workers")
            .iter()
            .map(|w| w["matched_tokens"].as_u64().unwrap_or(0))
            .max()
            .unwrap_or(0);
        // At most the text before the image (less than one block) could match.
        assert_eq!(matched, 0, "{flavor}: {q}");
    }
}

/// One endpoint per rank: a TensorRT-LLM engine with two DP ranks publishes
/// on two sockets (base port + rank); the router follows each rank's events,
/// a repeat goes back to the rank holding its prompt, and every prediction
/// equals the engine's `cached_tokens`.
#[test]
fn a_trtllm_engine_with_two_ranks_is_routed_on_each_ranks_events() {
    let events = free_port_pair(&[]);
    let replay = free_port_pair(&[events]);
    let (events, replay) = (events.to_string(), replay.to_string());
    let args = [
        "--engine-flavor",
        "trtllm",
        "--dp-size",
        "2",
        "--speedup",
        "1000",
        "--port",
        "0",
        "--kv-events-port",
        &events,
        "--replay-port",
        &replay,
    ];
    let (_mocker, lines) = spawn_mocker(&args, 1);
    assert!(lines
        .iter()
        .all(|l| l.contains("flavor=trtllm") && l.contains("dp=2")));
    let (_serve_proc, serve) = start_serve(&lines, &["--tokenizer", "builtin"]);
    let mut placed = std::collections::HashSet::new();
    for k in 0..8 {
        let body = text_completion(100 + k);
        let r = request(&serve, "POST", "/v1/completions", &body.to_string());
        assert_eq!(r.status, 200, "{}", r.body);
        let worker = r.header("x-kvroute-worker").expect("worker");
        let rank = r.header("x-kvroute-dp-rank").unwrap_or_else(|| "0".into());
        placed.insert((worker.clone(), rank.clone()));
        let prompt = r.json()["usage"]["prompt_tokens"].as_u64().expect("prompt");
        let full = prompt / BLOCK_SIZE * BLOCK_SIZE;
        eventually("the prompt's blocks on its rank", || {
            let q = request(&serve, "POST", "/query", &body.to_string()).json();
            q["scores"][&worker][&rank].as_u64().unwrap_or(0) >= full
        });
        let again = send(&serve, "/v1/completions", &body);
        assert_eq!(again.worker, worker, "the repeat goes back to its worker");
        assert!(
            again.cached_tokens >= full - BLOCK_SIZE,
            "{}",
            again.cached_tokens
        );
    }
    assert!(placed.len() >= 2, "prompts spread over ranks: {placed:?}");
    assert_eq!(count(&serve, "kvroute_ingest_decode_errors_total"), 0);
    let comparisons = count(&serve, "kvroute_accuracy_comparisons_total");
    assert_eq!(comparisons, 16, "every response compared");
    assert_eq!(count(&serve, "kvroute_accuracy_exact_total"), comparisons);
}

/// `video_url` parts are laid out and named like images (the video
/// placeholder id, SGLang's pads, TensorRT-LLM's digest-first positions):
/// a repeated video hits the engine holding it with an exact prediction on
/// every flavour, and another video with the same text does not match.
#[test]
fn repeated_videos_hit_and_other_videos_do_not_on_every_flavour() {
    for flavor in ["vllm", "sglang", "trtllm"] {
        let (_mocker, _serve_proc, serve) = start_fleet(flavor);
        let videos: Vec<Value> = (0..3).map(video_chat).collect();
        let rate = repeat_hit_rate(&serve, flavor, "/v1/chat/completions", &videos, 1);
        assert!(rate >= 0.95, "{flavor}: video-repeat hit rate {rate}");
        let q = request(&serve, "POST", "/query", &video_chat(50).to_string()).json();
        let matched = q["workers"]
            .as_array()
            .expect("workers")
            .iter()
            .filter_map(|w| w["matched_tokens"].as_u64())
            .max()
            .unwrap_or(0);
        assert!(
            matched < BLOCK_SIZE * 2,
            "{flavor}: a new video matched {matched}: {q}"
        );
        assert_eq!(count(&serve, "kvroute_ingest_decode_errors_total"), 0);
        let comparisons = count(&serve, "kvroute_accuracy_comparisons_total");
        assert_eq!(comparisons, 6, "{flavor}");
        assert_eq!(
            count(&serve, "kvroute_accuracy_exact_total"),
            comparisons,
            "{flavor}"
        );
    }
}
