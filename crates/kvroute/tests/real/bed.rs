//! The test bed: the real vLLM engines `scripts/real-engines start` wrote to
//! `engines.json` (named by `KVROUTE_REAL_ENGINES`), one test at a time, each
//! starting from empty engine caches; and what the tests ask of the engines
//! beside the router: their replay (an independent subscriber, `replay.py`
//! in the engines' own Python) and their answers' `cached_tokens`.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::{Mutex, MutexGuard};
use std::time::Duration;

use serde_json::{json, Value};

use crate::support::http::{self, count, Reply};
use crate::support::{eventually, polled_until, start_serve_with_env, Proc};

/// The variable naming the bed's `engines.json`.
pub const ENV: &str = "KVROUTE_REAL_ENGINES";

/// What to run when the bed is missing.
const HOW: &str = "run scripts/test (it installs vLLM and starts the engines), or by hand: \
     `scripts/real-engines install && scripts/real-engines start 2 --vlm 2 --dir /tmp/engines && \
     KVROUTE_REAL_ENGINES=/tmp/engines/engines.json cargo test -p kvroute --test real_engines; \
     scripts/real-engines stop --dir /tmp/engines`";

/// One engine of the bed.
#[derive(Debug, Clone)]
pub struct Engine {
    /// Its name (`e0`, `e1`, …), also its worker's name at the router.
    pub name: String,
    /// Its base URL, `http://127.0.0.1:PORT`.
    pub url: String,
    /// Its replay socket.
    pub replay: String,
    /// Its `--worker` spec (no `block_size`: learned from the stream).
    pub worker: String,
}

impl Engine {
    /// `host:port` of its HTTP server.
    pub fn addr(&self) -> &str {
        self.url.trim_start_matches("http://")
    }
}

/// The engines, the model and the bed's directory.
#[derive(Debug)]
pub struct Bed {
    /// `engines.json`.
    pub path: PathBuf,
    /// The bed's directory (the model, the logs).
    pub dir: PathBuf,
    /// The model's directory.
    pub model: PathBuf,
    /// The model's `tokenizer.json`.
    pub tokenizer: String,
    /// The engines' Python (pyzmq and msgspec for `replay.py`).
    pub python: PathBuf,
    /// The model name the engines serve.
    pub served: String,
    /// The engines.
    pub engines: Vec<Engine>,
}

/// One test at a time: the engines and their caches are shared.
static SERIAL: Mutex<()> = Mutex::new(());

/// Per replay endpoint, the sequence number of the engine's last cache
/// reset: what it holds is known from there on, and a replay from there is
/// short however long the engine's history (a replay from 0 of thousands
/// of batches takes seconds).
static SINCE: Mutex<BTreeMap<String, u64>> = Mutex::new(BTreeMap::new());

/// Where `engine`'s replays start (its last reset, else 0).
fn since(engine: &Engine) -> u64 {
    let since = SINCE.lock().unwrap_or_else(|p| p.into_inner());
    since.get(&engine.replay).copied().unwrap_or(0)
}

/// The bed, for one test: waits for the other tests to finish, checks that
/// every engine answers, and empties their caches. Fails, naming the
/// command, when `KVROUTE_REAL_ENGINES` is unset or its engines are down.
pub fn bed() -> (MutexGuard<'static, ()>, Bed) {
    bed_of(Section::Text)
}

/// [`bed`] for the vision-language engines (`engines.json`'s `vlm`: the
/// project's tiny Qwen2-VL, started by `scripts/real-engines start N --vlm M`).
pub fn vlm_bed() -> (MutexGuard<'static, ()>, Bed) {
    bed_of(Section::Vlm)
}

/// Which engines of `engines.json` a test runs on.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Section {
    /// The text engines (at least two).
    Text,
    /// The vision-language engines (at least two).
    Vlm,
}

fn bed_of(section: Section) -> (MutexGuard<'static, ()>, Bed) {
    let guard = SERIAL.lock().unwrap_or_else(|p| p.into_inner());
    let bed = Bed::read(section);
    for e in &bed.engines {
        let up = std::net::TcpStream::connect(e.addr()).is_ok()
            && http::request(e.addr(), "GET", "/health", "").status == 200;
        assert!(
            up,
            "engine {} at {} does not answer /health 200: the engines of {} are not up; {HOW}",
            e.name,
            e.url,
            bed.path.display()
        );
    }
    bed.reset();
    (guard, bed)
}

impl Bed {
    fn read(section: Section) -> Bed {
        let path = std::env::var_os(ENV).map(PathBuf::from).unwrap_or_else(|| {
            panic!("{ENV} is not set: this suite runs against real vLLM engines only; {HOW}")
        });
        let text = std::fs::read_to_string(&path)
            .unwrap_or_else(|e| panic!("{ENV}={}: {e}; {HOW}", path.display()));
        let doc: Value = serde_json::from_str(&text).expect("engines.json is JSON");
        let s = |v: &Value| v.as_str().expect("a string in engines.json").to_owned();
        let (list, least) = match section {
            Section::Text => (&doc["engines"], 2),
            Section::Vlm => (&doc["vlm"]["engines"], 2),
        };
        let engines: Vec<Engine> = list
            .as_array()
            .map(Vec::as_slice)
            .unwrap_or_default()
            .iter()
            .map(|e| Engine {
                name: s(&e["name"]),
                url: s(&e["url"]),
                replay: s(&e["replay"]),
                worker: s(&e["worker"]),
            })
            .collect();
        assert!(
            engines.len() >= least,
            "the suite needs {least} {section:?} engine(s), {} has {}; {HOW}",
            path.display(),
            engines.len()
        );
        let (model, served) = match section {
            Section::Text => (
                PathBuf::from(s(&doc["model"])),
                s(&doc["served_model_name"]),
            ),
            Section::Vlm => (
                PathBuf::from(s(&doc["vlm"]["model_dir"])),
                s(&doc["vlm"]["served_model"]),
            ),
        };
        let tokenizer = match section {
            Section::Text => s(&doc["tokenizer"]),
            Section::Vlm => model.join("tokenizer.json").display().to_string(),
        };
        Bed {
            dir: path.parent().expect("a directory").to_owned(),
            model,
            tokenizer,
            python: PathBuf::from(s(&doc["python"])),
            served,
            engines,
            path,
        }
    }

    /// Every engine's `--worker` spec.
    pub fn workers(&self) -> Vec<String> {
        self.engines.iter().map(|e| e.worker.clone()).collect()
    }

    /// The engine named `name`.
    pub fn engine(&self, name: &str) -> &Engine {
        self.engines
            .iter()
            .find(|e| e.name == name)
            .unwrap_or_else(|| panic!("no engine {name}"))
    }

    /// Empties every engine's prefix cache, and makes the engine say so on
    /// its stream: vLLM queues `AllBlocksCleared` and publishes it with its
    /// next scheduler step, so one request of a single token (no full
    /// block) follows the reset; then waits until the replay shows it.
    pub fn reset(&self) {
        for e in &self.engines {
            eventually(&format!("{} resets its prefix cache", e.name), || {
                let reply = http::request(e.addr(), "POST", "/reset_prefix_cache", "");
                assert_eq!(
                    reply.status, 200,
                    "POST {}/reset_prefix_cache: {} {} (the engines need VLLM_SERVER_DEV_MODE=1, \
                     as scripts/real-engines sets)",
                    e.url, reply.status, reply.body
                );
                reply.json()["success"] == true
            });
            let flush = json!({"model": self.served, "prompt": [16], "max_tokens": 1});
            let reply = http::request(e.addr(), "POST", "/v1/completions", &flush.to_string());
            assert_eq!(reply.status, 200, "{}: {}", e.name, reply.body);
            eventually(&format!("{}'s replay shows the reset", e.name), || {
                let r = self.replay(e);
                let reset = r.blocks.is_empty() && r.clears > 0;
                if let (true, Some(at)) = (reset, r.clear_seq) {
                    let mut since = SINCE.lock().unwrap_or_else(|p| p.into_inner());
                    since.insert(e.replay.clone(), at);
                }
                reset
            });
        }
    }

    /// What `engine` holds now, by its replay from its last reset (the
    /// reset's `AllBlocksCleared` included), or from 0.
    pub fn replay(&self, engine: &Engine) -> Replay {
        self.replay_from(engine, since(engine))
    }

    /// `engine` restarted: its sequence numbers start again from 0.
    pub fn restarted(&self, engine: &Engine) {
        let mut since = SINCE.lock().unwrap_or_else(|p| p.into_inner());
        since.remove(&engine.replay);
    }

    /// `engine`'s replay from sequence `from` (what those batches stored).
    pub fn replay_from(&self, engine: &Engine, from: u64) -> Replay {
        let script = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/real/replay.py");
        let out = Command::new(&self.python)
            .arg(&script)
            .arg(&engine.replay)
            .arg(from.to_string())
            .output()
            .expect("the engines' python runs");
        assert!(
            out.status.success(),
            "replay.py {}: {}",
            engine.replay,
            String::from_utf8_lossy(&out.stderr)
        );
        let doc: Value = serde_json::from_slice(&out.stdout).expect("replay.py prints JSON");
        let blocks = doc["blocks"]
            .as_array()
            .expect("blocks")
            .iter()
            .map(|b| Block {
                hash: b["hash"].as_u64().expect("a u64 hash"),
                parent: b["parent"].as_u64(),
                tokens: ids(&b["tokens"]),
            })
            .collect();
        Replay {
            last_seq: doc["last_seq"].as_i64(),
            batches: doc["batches"].as_u64().unwrap_or(0),
            clears: doc["clears"].as_u64().unwrap_or(0),
            clear_seq: doc["clear_seq"].as_u64(),
            block_sizes: doc["block_sizes"]
                .as_array()
                .expect("sizes")
                .iter()
                .filter_map(Value::as_u64)
                .collect(),
            blocks,
        }
    }

    /// `kvroute serve` over every engine with `extra` flags, once every
    /// rank's stream is connected and live (its replay caught up).
    pub fn router(&self, extra: &[&str]) -> (Proc, String) {
        self.router_with_env(extra, &[])
    }

    /// [`Bed::router`] with `env` set for the router.
    ///
    /// The router looks for tokenizers as a router does by default
    /// (`KVROUTE_TOKENIZER_SOURCES=root,cache,hub,engine`, the hub offline),
    /// unless `env` says otherwise; without `--tokenizer` or `--model`, it
    /// is returned once the model's tokenizer is no longer being looked for.
    pub fn router_with_env(&self, extra: &[&str], env: &[(&str, &str)]) -> (Proc, String) {
        let mut env_all = vec![("KVROUTE_TOKENIZER_SOURCES", "root,cache,hub,engine")];
        env_all.extend_from_slice(env);
        let (proc, serve) = start_serve_with_env(&self.workers(), extra, &env_all);
        eventually("every rank live", || {
            workers(&serve)
                .iter()
                .all(|w| w["ranks"][0]["state"] == "live")
        });
        if !extra.iter().any(|a| *a == "--tokenizer" || *a == "--model") {
            eventually("the model's tokenizer looked for", || {
                let shown = http::request(&serve, "GET", "/workers", "").json();
                shown["tokenizers"]
                    .as_array()
                    .is_some_and(|rows| rows.iter().any(|r| r["model"] == self.served.as_str()))
            });
        }
        (proc, serve)
    }

    /// The router with the model's tokenizer (`--tokenizer`).
    pub fn router_with_tokenizer(&self, extra: &[&str]) -> (Proc, String) {
        let mut args = vec!["--tokenizer", self.tokenizer.as_str()];
        args.extend_from_slice(extra);
        self.router(&args)
    }

    /// Waits until the router has applied every batch each engine
    /// published (the engine's replay from the router's last sequence
    /// number on has nothing newer); returns whether the router was behind
    /// at first. Events reach the router after the answer does (on a loaded
    /// machine, sometimes hundreds of milliseconds after): a test of what
    /// the index knows sends its next request after this.
    pub fn caught_up(&self, serve: &str) -> bool {
        let mut behind = false;
        for e in &self.engines {
            let (mut seq, mut newer) = (None, 0);
            let caught = polled_until(Duration::from_secs(30), || {
                let routed = workers(serve);
                seq = worker(&routed, &e.name)["ranks"][0]["last_seq"].as_u64();
                newer = self.replay_from(e, seq.map_or(0, |s| s + 1)).batches;
                behind |= newer > 0;
                newer == 0
            });
            assert!(
                caught,
                "{}: the router's last_seq stayed at {seq:?} for 30 s while the engine published {newer} batches after it",
                e.name
            );
        }
        behind
    }

    /// Waits until the router's index holds, for every engine, as many
    /// blocks as the engine's replay says it stores, up to the same last
    /// sequence number (at most 60 s); returns each engine's replay.
    pub fn settled(&self, serve: &str) -> Vec<Replay> {
        let (mut replays, mut seen) = (Vec::new(), Vec::new());
        let same = polled_until(Duration::from_secs(60), || {
            replays = self.engines.iter().map(|e| self.replay(e)).collect();
            let routed = workers(serve);
            let mut same = true;
            seen.clear();
            for (e, r) in self.engines.iter().zip(&replays) {
                let rank = &worker(&routed, &e.name)["ranks"][0];
                same &= rank["blocks"]["device"].as_u64() == Some(r.blocks.len() as u64)
                    && rank["last_seq"].as_i64() == r.last_seq;
                seen.push(format!(
                    "{}: the router holds {} blocks (seq {}), the engine {} (seq {:?})",
                    e.name,
                    rank["blocks"]["device"],
                    rank["last_seq"],
                    r.blocks.len(),
                    r.last_seq
                ));
            }
            same
        });
        assert!(
            same,
            "the router's index did not come to hold what the engines' replays hold in 60 s: {}",
            seen.join("; ")
        );
        replays
    }
}

/// `/workers`'s list.
pub fn workers(serve: &str) -> Vec<Value> {
    http::request(serve, "GET", "/workers", "").json()["workers"]
        .as_array()
        .cloned()
        .unwrap_or_default()
}

/// Each rank's stream as `/workers` shows it, in one line (for failures).
pub fn ranks(serve: &str) -> String {
    workers(serve)
        .iter()
        .map(|w| {
            let r = &w["ranks"][0];
            format!(
                "{} block_size {} state {} ({}) last_seq {} blocks {} events {} gaps {} replays {} restarts {} clears {}",
                w["name"], w["block_size"], r["state"], r["state_reason"], r["last_seq"],
                r["blocks"]["device"], r["events"], r["gaps"], r["replays_ok"],
                r["engine_restarts"], r["clears"]
            )
        })
        .collect::<Vec<_>>()
        .join("; ")
}

/// The entry of `name` in a `/workers` list.
pub fn worker<'a>(list: &'a [Value], name: &str) -> &'a Value {
    list.iter()
        .find(|w| w["name"] == name)
        .unwrap_or_else(|| panic!("no worker {name} in /workers"))
}

/// A JSON array of token ids.
pub fn ids(v: &Value) -> Vec<u32> {
    v.as_array()
        .expect("an array of ids")
        .iter()
        .map(|t| t.as_u64().expect("an id") as u32)
        .collect()
}

/// A stored block, by the engine's own events.
#[derive(Debug, Clone)]
pub struct Block {
    /// The engine's hash of it.
    pub hash: u64,
    /// Its parent's hash (none for a first block).
    pub parent: Option<u64>,
    /// Its tokens.
    pub tokens: Vec<u32>,
}

/// What an engine holds, by its replay.
#[derive(Debug, Clone)]
pub struct Replay {
    /// The last batch's sequence number (none before any).
    pub last_seq: Option<i64>,
    /// Batches replayed.
    pub batches: u64,
    /// `AllBlocksCleared` events seen.
    pub clears: u64,
    /// The last one's sequence number.
    pub clear_seq: Option<u64>,
    /// Block sizes the events carried.
    pub block_sizes: Vec<u64>,
    /// Every block stored and not removed since the last clear.
    pub blocks: Vec<Block>,
}

impl Replay {
    /// Tokens of `prompt`'s longest prefix of whole blocks the engine holds
    /// (followed from the first block through each block's parent).
    pub fn matched_tokens(&self, prompt: &[u32], block_size: usize) -> u64 {
        (self.chain(prompt, block_size).len() * block_size) as u64
    }

    /// The engine's hashes of `prompt`'s whole blocks it holds, in order
    /// (as far as [`Replay::matched_tokens`] matches).
    pub fn chain(&self, prompt: &[u32], block_size: usize) -> Vec<u64> {
        let mut parent = None;
        let mut out = Vec::new();
        for chunk in prompt.chunks_exact(block_size) {
            let Some(b) = self
                .blocks
                .iter()
                .find(|b| b.parent == parent && b.tokens == chunk)
            else {
                break;
            };
            parent = Some(b.hash);
            out.push(b.hash);
        }
        out
    }
}

/// `n` token ids from `start`: the words `w<start>` … (the tiny model's
/// tokenizer makes `w<i>` token i).
pub fn tokens(start: u32, n: usize) -> Vec<u32> {
    (start..).take(n).collect()
}

/// Token ids as the tiny model's words.
pub fn words(ids: &[u32]) -> String {
    ids.iter()
        .map(|i| format!("w{i}"))
        .collect::<Vec<_>>()
        .join(" ")
}

/// One answer through the router, and whether the router's prediction of
/// its cached tokens was the engine's own (`kvroute_accuracy_*`, read
/// before and after: the suite sends one request at a time).
#[derive(Debug, Clone)]
pub struct Answer {
    /// The worker the router chose.
    pub worker: String,
    /// The engine's prompt tokens.
    pub prompt_tokens: u64,
    /// The engine's `cached_tokens`.
    pub cached: u64,
    /// The prediction equalled `cached`.
    pub exact: bool,
    /// The router's prediction of `cached`.
    pub predicted: u64,
    /// The answer's body.
    pub body: Value,
}

/// Sends `body` to `path` through the router at `serve` and compares.
pub fn ask(serve: &str, path: &str, body: &Value) -> Answer {
    let compared = count(serve, "kvroute_accuracy_comparisons_total");
    let exact = count(serve, "kvroute_accuracy_exact_total");
    let predicted = count(serve, "kvroute_quality_predicted_cached_tokens_total");
    let reply: Reply = http::request(serve, "POST", path, &body.to_string());
    assert_eq!(reply.status, 200, "{path}: {}", reply.body);
    let doc = reply.json();
    let (prompt_tokens, cached) = usage(&doc);
    // The router compares as it relays the usage: by the answer's end.
    let compared_now = polled_until(Duration::from_secs(5), || {
        count(serve, "kvroute_accuracy_comparisons_total") != compared
    });
    assert!(
        compared_now,
        "{path}: the router made no prediction to compare with the engine's cached_tokens \
         ({} requests routed on load alone so far)",
        count(serve, "kvroute_proxy_load_only_total")
    );
    assert_eq!(
        count(serve, "kvroute_accuracy_comparisons_total"),
        compared + 1,
        "one comparison per answer"
    );
    Answer {
        worker: reply.header("x-kvroute-worker").expect("routed"),
        prompt_tokens,
        cached,
        exact: count(serve, "kvroute_accuracy_exact_total") == exact + 1,
        predicted: count(serve, "kvroute_quality_predicted_cached_tokens_total") - predicted,
        body: doc,
    }
}

/// An answer's (prompt tokens, cached tokens), in the shape of its API.
pub fn usage(doc: &Value) -> (u64, u64) {
    let u = &doc["usage"];
    let prompt = u["prompt_tokens"]
        .as_u64()
        .or_else(|| u["input_tokens"].as_u64())
        .unwrap_or_else(|| panic!("no prompt tokens in {doc}"));
    let cached = u["prompt_tokens_details"]["cached_tokens"]
        .as_u64()
        .or_else(|| u["input_tokens_details"]["cached_tokens"].as_u64())
        .unwrap_or_else(|| panic!("no cached_tokens in {doc}"));
    (prompt, cached)
}

/// The router's `kvroute_ingest_decode_errors_total`, summed.
pub fn decode_errors(serve: &str) -> u64 {
    count(serve, "kvroute_ingest_decode_errors_total")
}
