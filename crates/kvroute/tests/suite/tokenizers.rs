//! The router finds each model's tokenizer itself (no `--tokenizer`): from
//! the folder the engine's `/v1/models` names as `root`, the Hugging Face
//! cache, a download from a hub (here one served by the test, in the hub's
//! own URL layout), or the engine's `/tokenize`; a found tokenizer that
//! renders differently from the engine's is not trusted; and a model found
//! nowhere is said to be routed on load alone. Mock engines load the same
//! word-level tokenizer and chat template the router must find, so every
//! prediction is checked against what the engine itself counted.

use std::io::{Read, Write};
use std::net::TcpListener;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;

use serde_json::{json, Value};

use crate::support::http::request;
use crate::support::{eventually, spawn_serve_with_env, start_mocker_with, Proc};

/// A word-level tokenizer (`w<i>` is token i, `<|user|>`-style role
/// tokens) and its chat template, written to a fresh folder; `shift` moves
/// every word's id, giving a tokenizer that disagrees with the unshifted one.
fn tokenizer_folder(name: &str, shift: u32) -> PathBuf {
    let dir = std::env::temp_dir().join(format!("kvroute-tok-{}-{name}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).expect("dir");
    let specials = [
        "<s>",
        "</s>",
        "<unk>",
        "<|system|>",
        "<|user|>",
        "<|assistant|>",
        "<|end|>",
    ];
    let mut vocab = serde_json::Map::new();
    for (i, t) in specials.iter().enumerate() {
        vocab.insert((*t).to_owned(), json!(i));
    }
    for i in 16..4_000u32 {
        vocab.insert(format!("w{i}"), json!(16 + (i - 16 + shift) % 3_984));
    }
    let added: Vec<Value> = specials
        .iter()
        .enumerate()
        .map(|(i, t)| {
            json!({"id": i, "content": t, "single_word": false, "lstrip": false,
            "rstrip": false, "normalized": false, "special": true})
        })
        .collect();
    let tokenizer = json!({"version": "1.0", "truncation": null, "padding": null,
        "added_tokens": added, "normalizer": null, "pre_tokenizer": {"type": "WhitespaceSplit"},
        "post_processor": null, "decoder": null,
        "model": {"type": "WordLevel", "vocab": vocab, "unk_token": "<unk>"}});
    let template =
        "{% for message in messages %}<|{{ message['role'] }}|> {{ message['content'] }} \
                    <|end|> {% endfor %}{% if add_generation_prompt %}<|assistant|> {% endif %}";
    let config = json!({"bos_token": "<s>", "eos_token": "</s>", "unk_token": "<unk>",
        "chat_template": template});
    std::fs::write(dir.join("tokenizer.json"), tokenizer.to_string()).expect("write");
    std::fs::write(dir.join("tokenizer_config.json"), config.to_string()).expect("write");
    dir
}

/// A Hugging Face cache holding `folder`'s files as repository `repo`.
fn cache_with(repo: &str, folder: &Path) -> PathBuf {
    let cache = std::env::temp_dir().join(format!(
        "kvroute-hfcache-{}-{}",
        std::process::id(),
        repo.replace('/', "-")
    ));
    let _ = std::fs::remove_dir_all(&cache);
    let repo_dir = cache.join(format!("models--{}", repo.replace('/', "--")));
    let snapshot = repo_dir.join("snapshots/0123abcd");
    std::fs::create_dir_all(&snapshot).expect("dir");
    for file in ["tokenizer.json", "tokenizer_config.json"] {
        std::fs::copy(folder.join(file), snapshot.join(file)).expect("copy");
    }
    std::fs::create_dir_all(repo_dir.join("refs")).expect("dir");
    std::fs::write(repo_dir.join("refs/main"), "0123abcd").expect("write");
    cache
}

/// One mock engine serving `model` with the tokenizer in `folder`.
fn engine(model: &str, folder: &Path) -> (Proc, String) {
    let tokenizer = folder.join("tokenizer.json");
    let (proc, mut lines) = start_mocker_with(
        1,
        &[
            "--speedup",
            "100",
            "--model",
            model,
            "--tokenizer",
            tokenizer.to_str().expect("utf-8"),
        ],
    );
    (proc, lines.remove(0))
}

/// The router in front of `line`, looking for tokenizers as `env` says
/// (`KVROUTE_TOKENIZER_SOURCES`, the hub's variables), once the worker's
/// tokenizer is no longer being looked for: its source then.
fn router(line: &str, env: &[(&str, &str)]) -> (Proc, String, Value) {
    let (proc, serve) = spawn_serve_with_env(&[line.to_owned()], &[], env);
    let mut found = Value::Null;
    eventually("the model's tokenizer was looked for", || {
        let doc = request(&serve, "GET", "/workers", "");
        if doc.status != 200 {
            return false;
        }
        found = doc.json()["tokenizers"][0].clone();
        !found.is_null()
    });
    (proc, serve, found)
}

/// The most of `body`'s prompt one rank of the engine at `addr` holds
/// (its `/internal/cache_match`).
fn engine_best(addr: &str, body: &Value) -> u64 {
    let doc = request(addr, "POST", "/internal/cache_match", &body.to_string());
    assert_eq!(doc.status, 200, "{}", doc.body);
    doc.json()["ranks"]
        .as_array()
        .into_iter()
        .flatten()
        .filter_map(|r| r["matched_tokens"].as_u64())
        .max()
        .unwrap_or(0)
}

/// Two chat turns sharing a long system prompt; both predictions must
/// equal the engine's `cached_tokens` and none may be routed on load.
fn predictions_are_exact(serve: &str, model: &str) {
    let system: Vec<String> = (100..260).map(|i| format!("w{i}")).collect();
    let url = request(serve, "GET", "/workers", "").json()["workers"][0]["url"]
        .as_str()
        .map(|u| u.trim_start_matches("http://").to_owned())
        .expect("the worker's url");
    for turn in 0..2 {
        let messages = json!([
            {"role": "system", "content": system.join(" ")},
            {"role": "user", "content": format!("w{} w{}", 300 + turn, 400 + turn)}]);
        // The earlier turn's events are in the index before this turn is
        // routed: the router's best match is the engine's own.
        let held = engine_best(&url, &json!({"model": model, "messages": messages}));
        // Asked by the engine's token ids: the router's own tokens for the
        // chat are what the test checks, not what it waits with.
        let tokenized = request(
            &url,
            "POST",
            "/tokenize",
            &json!({"model": model, "messages": messages}).to_string(),
        );
        assert_eq!(tokenized.status, 200, "{}", tokenized.body);
        let ids = tokenized.json()["tokens"].clone();
        eventually("the earlier turn's blocks in the router's index", || {
            crate::support::indexed(serve, &json!({"model": model, "prompt": ids})) >= held
        });
        let body = json!({"model": model, "max_tokens": 2, "messages": messages});
        let reply = request(serve, "POST", "/v1/chat/completions", &body.to_string());
        assert_eq!(reply.status, 200, "{}", reply.body);
    }
    let count = |name: &str| crate::support::http::count(serve, name);
    eventually("both answers compared", || {
        count("kvroute_accuracy_comparisons_total") == 2
    });
    assert_eq!(
        count("kvroute_accuracy_exact_total"),
        2,
        "exact predictions"
    );
    assert_eq!(
        count("kvroute_proxy_load_only_total"),
        0,
        "routed on its prefix"
    );
}

#[test]
fn a_tokenizer_is_found_in_the_folder_the_engine_names_as_root() {
    let folder = tokenizer_folder("root", 0);
    let (_engine, line) = engine("tiny", &folder);
    let (_serve, serve, found) = router(&line, &[("KVROUTE_TOKENIZER_SOURCES", "root")]);
    assert_eq!(found["source"], "root", "{found}");
    let from = found["from"].as_str().unwrap_or_default();
    assert!(from.ends_with("tokenizer.json"), "{found}");
    predictions_are_exact(&serve, "tiny");
}

#[test]
fn a_tokenizer_is_found_in_the_hugging_face_cache_by_model_id() {
    let folder = tokenizer_folder("cache", 0);
    let cache = cache_with("org/tiny", &folder);
    let (_engine, line) = engine("org/tiny", &folder);
    let env = [
        ("KVROUTE_TOKENIZER_SOURCES", "cache"),
        ("HF_HUB_CACHE", cache.to_str().expect("utf-8")),
    ];
    let (_serve, serve, found) = router(&line, &env);
    assert_eq!(found["source"], "cache", "{found}");
    assert!(found["from"]
        .as_str()
        .unwrap_or_default()
        .contains("snapshots/0123abcd"));
    predictions_are_exact(&serve, "org/tiny");
}

/// A hub in the Hugging Face hub's URL layout, serving `folder`'s files as
/// repository `repo` at `main`: its address and how many files it served.
fn fake_hub(repo: &'static str, folder: PathBuf) -> (String, Arc<AtomicUsize>) {
    let listener = TcpListener::bind("127.0.0.1:0").expect("bind");
    let addr = listener.local_addr().expect("addr").to_string();
    let served = Arc::new(AtomicUsize::new(0));
    let count = served.clone();
    std::thread::spawn(move || {
        for mut stream in listener.incoming().flatten() {
            let mut head = [0u8; 8192];
            let n = stream.read(&mut head).unwrap_or(0);
            let line = String::from_utf8_lossy(&head[..n])
                .lines()
                .next()
                .unwrap_or_default()
                .to_owned();
            let path = line
                .split_whitespace()
                .nth(1)
                .unwrap_or_default()
                .to_owned();
            let file = path
                .strip_prefix(&format!("/{repo}/resolve/main/"))
                .map(str::to_owned);
            let body = file.and_then(|f| std::fs::read(folder.join(f)).ok());
            let _ = match body {
                Some(body) => {
                    count.fetch_add(1, Ordering::SeqCst);
                    write!(stream, "HTTP/1.1 200 OK\r\nx-repo-commit: feedbeef01\r\ncontent-length: {}\r\nconnection: close\r\n\r\n", body.len())
                        .and_then(|()| stream.write_all(&body))
                }
                None => stream.write_all(
                    b"HTTP/1.1 404 Not Found\r\ncontent-length: 0\r\nconnection: close\r\n\r\n",
                ),
            };
        }
    });
    (format!("http://{addr}"), served)
}

#[test]
fn a_tokenizer_is_downloaded_from_the_hub_into_the_cache() {
    let folder = tokenizer_folder("hub", 0);
    let (hub, served) = fake_hub("org/tiny", folder.clone());
    let cache = std::env::temp_dir().join(format!("kvroute-hubcache-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&cache);
    let (_engine, line) = engine("org/tiny", &folder);
    let env = [
        ("KVROUTE_TOKENIZER_SOURCES", "cache,hub"),
        ("HF_HUB_CACHE", cache.to_str().expect("utf-8")),
        ("HF_ENDPOINT", hub.as_str()),
        ("HF_HUB_OFFLINE", "0"),
    ];
    let (_serve, serve, found) = router(&line, &env);
    assert_eq!(found["source"], "hub", "{found}");
    assert_eq!(
        served.load(Ordering::SeqCst),
        2,
        "tokenizer.json and tokenizer_config.json"
    );
    let snapshot = cache.join("models--org--tiny/snapshots/feedbeef01/tokenizer.json");
    assert!(snapshot.is_file(), "kept in the cache's own layout");
    let main = std::fs::read_to_string(cache.join("models--org--tiny/refs/main")).expect("ref");
    assert_eq!(main, "feedbeef01");
    predictions_are_exact(&serve, "org/tiny");
}

#[test]
fn without_a_tokenizer_file_the_engines_tokenize_is_asked() {
    let folder = tokenizer_folder("engine", 0);
    let (_engine, line) = engine("tiny", &folder);
    let (_serve, serve, found) = router(&line, &[("KVROUTE_TOKENIZER_SOURCES", "engine")]);
    assert_eq!(found["source"], "engine", "{found}");
    predictions_are_exact(&serve, "tiny");
}

/// A tokenizer in the cache whose ids differ from the engine's is caught by
/// the probe chat and the engine's `/tokenize` used in its place.
#[test]
fn a_found_tokenizer_that_disagrees_with_the_engine_is_not_trusted() {
    let engines = tokenizer_folder("truth", 0);
    let wrong = tokenizer_folder("wrong", 7);
    let cache = cache_with("org/other", &wrong);
    let (_engine, line) = engine("org/other", &engines);
    let env = [
        ("KVROUTE_TOKENIZER_SOURCES", "cache,engine"),
        ("HF_HUB_CACHE", cache.to_str().expect("utf-8")),
    ];
    let (_serve, serve, found) = router(&line, &env);
    assert_eq!(found["source"], "engine", "{found}");
    predictions_are_exact(&serve, "org/other");
}

/// A model found nowhere is routed on load alone and says so: `/workers`,
/// the metric and one warning naming the model and the fix.
#[test]
fn a_model_found_nowhere_is_said_to_be_routed_on_load() {
    let (_engine, mut lines) = start_mocker_with(1, &["--speedup", "100", "--model", "blind"]);
    let line = lines.remove(0);
    let mut command = crate::support::kvroute();
    command
        .args(["serve", "--port", "0", "--worker", &line])
        .env("KVROUTE_TOKENIZER_SOURCES", "root,cache")
        .stdout(std::process::Stdio::null())
        .stderr(std::process::Stdio::piped());
    let mut child = command.spawn().expect("serve runs");
    let lines_rx = crate::support::lines_of(child.stderr.take().expect("stderr"));
    let _serve_proc = Proc(child);
    let mut warning = None;
    let mut serve = None;
    eventually("the warning that names the model", || {
        while let Ok(l) = lines_rx.try_recv() {
            if let Some((_, rest)) = l.split_once("listening on http://") {
                serve = rest.split_whitespace().next().map(str::to_owned);
            }
            if l.contains("NO TOKENIZER") {
                warning = Some(l);
            }
        }
        warning.is_some()
    });
    let warning = warning.unwrap_or_default();
    assert!(
        warning.contains("`blind`") && warning.contains("--model blind="),
        "{warning}"
    );
    let serve = serve.expect("the listening line");
    let found = request(&serve, "GET", "/workers", "").json()["tokenizers"][0].clone();
    assert_eq!(
        found,
        json!({"model": "blind", "source": "none", "from": null})
    );
    let metrics = request(&serve, "GET", "/metrics", "").body;
    assert!(
        metrics.contains("kvroute_model_tokenizer{model=\"blind\",source=\"none\"} 1"),
        "{metrics}"
    );
}
