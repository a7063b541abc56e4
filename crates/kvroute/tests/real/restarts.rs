//! A real vLLM engine killed (SIGKILL to every process of it: the API
//! server, its EngineCore and worker) and restarted on the same ports under
//! a running router. Its block hashes are the same after the restart (the
//! test shows it), so only the stream can tell the router that the cache
//! it knew is gone: after each restart the router holds no block for that
//! engine that the engine did not store since, and predicts every answer.

use std::path::Path;
use std::process::Command;

use serde_json::{json, Value};

use super::bed::{ask, bed, tokens, worker, workers, Bed, Engine};
use crate::support::{eventually, http};

/// Restarts in the test (the goal: at least 5).
const TRIALS: usize = 5;

/// The pid `engines.json` records for `engine` now (it changes on restart).
fn pid(bed: &Bed, engine: &Engine) -> i32 {
    let doc: Value =
        serde_json::from_str(&std::fs::read_to_string(&bed.path).expect("engines.json"))
            .expect("JSON");
    doc["engines"]
        .as_array()
        .expect("engines")
        .iter()
        .find(|e| e["name"] == engine.name.as_str())
        .and_then(|e| e["pid"].as_i64())
        .expect("a pid") as i32
}

/// The live processes of session `sid` (each engine runs in its own).
fn session(sid: i32) -> Vec<i32> {
    let mut out = Vec::new();
    for entry in std::fs::read_dir("/proc").expect("/proc").flatten() {
        let Ok(pid) = entry.file_name().to_string_lossy().parse::<i32>() else {
            continue;
        };
        let Ok(stat) = std::fs::read_to_string(entry.path().join("stat")) else {
            continue;
        };
        let Some((_, rest)) = stat.rsplit_once(')') else {
            continue;
        };
        let fields: Vec<&str> = rest.split_whitespace().collect();
        if fields.first() != Some(&"Z") && fields.get(3) == Some(&sid.to_string().as_str()) {
            out.push(pid);
        }
    }
    out
}

/// SIGKILL to every process of `engine`, as a crash or an OOM kill of its
/// container would; returns when none is left.
pub(super) fn kill(bed: &Bed, engine: &Engine) {
    let sid = pid(bed, engine);
    let procs = session(sid);
    assert!(
        !procs.is_empty(),
        "{} (session {sid}) is not running",
        engine.name
    );
    let status = Command::new("kill")
        .arg("-KILL")
        .args(procs.iter().map(i32::to_string))
        .status()
        .expect("kill runs");
    assert!(status.success(), "kill -KILL {procs:?}");
    eventually(&format!("{}'s processes exit", engine.name), || {
        session(sid).is_empty()
    });
}

/// `scripts/real-engines restart NAME --dir DIR`: the same command on the
/// same ports; returns once the engine answers /health.
pub(super) fn restart(bed: &Bed, engine: &Engine) {
    let script = Path::new(env!("CARGO_MANIFEST_DIR")).join("../../scripts/real-engines");
    let out = Command::new(script)
        .args(["restart", &engine.name, "--dir"])
        .arg(&bed.dir)
        .output()
        .expect("scripts/real-engines runs");
    assert!(
        out.status.success(),
        "restarting {}: {}",
        engine.name,
        String::from_utf8_lossy(&out.stderr)
    );
}

/// `name`'s rank as the router's `/workers` shows it.
fn rank_of(serve: &str, name: &str) -> Value {
    worker(&workers(serve), name)["ranks"][0].clone()
}

/// The router's stream counter `key` of `name`'s rank.
fn rank_counter(serve: &str, name: &str, key: &str) -> u64 {
    rank_of(serve, name)[key].as_u64().unwrap_or(0)
}

/// The router's `/query` match of `prompt` on `name`.
fn routed_match(serve: &str, name: &str, prompt: &[u32]) -> u64 {
    let query = json!({ "token_ids": prompt });
    http::request(serve, "POST", "/query", &query.to_string()).json()["workers"]
        .as_array()
        .expect("workers")
        .iter()
        .find(|w| w["name"] == name)
        .and_then(|w| w["matched_tokens"].as_u64())
        .expect("matched_tokens")
}

#[test]
fn a_killed_and_restarted_engine_leaves_no_ghost_blocks_and_no_misprediction() {
    let (_serial, bed) = bed();
    let (_router, serve) = bed.router_with_tokenizer(&[]);
    let mut prompts: Vec<Vec<u32>> = Vec::new();
    let mut after_restart = (0, 0);
    // Restarts whose first request came before the router had proven anything.
    let mut in_doubt = 0;
    for trial in 0..TRIALS {
        // A prompt of its own, cached and predicted somewhere.
        let prompt = tokens(1_000 + trial as u32 * 2_000, 1_000);
        prompts.push(prompt.clone());
        let body = json!({"model": bed.served, "prompt": prompt, "max_tokens": 1});
        bed.caught_up(&serve);
        let first = ask(&serve, "/v1/completions", &body);
        bed.caught_up(&serve);
        let again = ask(&serve, "/v1/completions", &body);
        assert!(
            first.exact && again.exact,
            "trial {trial}: before the restart"
        );
        let victim = bed.engine(&first.worker).clone();
        let before = bed.settled(&serve);
        let held = bed
            .engines
            .iter()
            .position(|e| e.name == victim.name)
            .map(|i| before[i].chain(&prompt, 32))
            .expect("the victim");
        assert_eq!(
            held.len(),
            31,
            "trial {trial}: {} holds the prompt",
            victim.name
        );
        let restarts = rank_counter(&serve, &victim.name, "engine_restarts");

        kill(&bed, &victim);
        // The kernel closes the dead engine's sockets: the router hears its
        // link drop, and from then on holds the victim's blocks in doubt.
        eventually(
            &format!("trial {trial}: the router sees {}'s link drop", victim.name),
            || rank_of(&serve, &victim.name)["connected"] == false,
        );
        restart(&bed, &victim);
        bed.restarted(&victim);
        // At once, the first request after the engine is back: whatever
        // the router knows by now (its replay may not have proven anything
        // yet), its prediction must hold.
        let doubted = rank_of(&serve, &victim.name)["in_doubt"] == true;
        in_doubt += usize::from(doubted);
        let first_back = ask(&serve, "/v1/completions", &body);
        // Then the router hears the restart from the stream …
        eventually(
            &format!("trial {trial}: the router sees {} restarted", victim.name),
            || rank_counter(&serve, &victim.name, "engine_restarts") > restarts,
        );
        let replays = bed.settled(&serve);
        // … and holds nothing for the victim the new engine did not store.
        let k = bed
            .engines
            .iter()
            .position(|e| e.name == victim.name)
            .expect("victim");
        for (i, p) in prompts.iter().enumerate() {
            assert_eq!(
                routed_match(&serve, &victim.name, p),
                replays[k].matched_tokens(p, 32),
                "trial {trial}: ghost blocks of prompt {i} on {}",
                victim.name
            );
        }
        // The new engine names the same prompt's blocks with the same hashes.
        let direct = http::request(victim.addr(), "POST", "/v1/completions", &body.to_string());
        assert_eq!(direct.status, 200, "{}", direct.body);
        let replays = bed.settled(&serve);
        assert_eq!(
            replays[k].chain(&prompt, 32),
            held,
            "trial {trial}: {}'s block hashes across the restart",
            victim.name
        );
        bed.caught_up(&serve);
        let last = ask(&serve, "/v1/completions", &body);
        for (what, a) in [("first after the restart", &first_back), ("last", &last)] {
            after_restart.0 += 1;
            after_restart.1 += usize::from(a.exact);
            assert!(
                a.exact,
                "trial {trial}: the {what} request to {} (cached {} of {}) was mispredicted",
                a.worker, a.cached, a.prompt_tokens
            );
        }
        eprintln!(
            "trial {trial}: {} killed and restarted; first request after it (the victim {}) on {} cached {}, predicted exactly; 0 ghost blocks; same hashes",
            victim.name,
            if doubted { "in doubt" } else { "proven" },
            first_back.worker,
            first_back.cached
        );
    }
    eprintln!(
        "{TRIALS} restarts ({in_doubt} with the first request while the victim was in doubt): 0 ghost blocks, predictions exact on {} of {} requests after the restarts",
        after_restart.1, after_restart.0
    );
}
