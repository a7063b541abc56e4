//! `kvroute bench proxy` and `bench ingest` as a user runs them: the real
//! binary starts the router (and, for ingest, the publishers) as its own
//! child processes and measures them from outside.

use serde_json::Value;

use crate::support::kvroute;

#[test]
fn bench_proxy_measures_a_child_router_at_each_concurrency_with_text_prompts() {
    let out = kvroute()
        .args([
            "bench",
            "proxy",
            "--requests",
            "120",
            "--concurrency",
            "1,4",
        ])
        .args([
            "--text",
            "--tokenizer",
            "builtin",
            "--prompt-words",
            "64",
            "--json",
        ])
        .output()
        .expect("kvroute bench proxy runs");
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let runs: Vec<Value> = String::from_utf8_lossy(&out.stdout)
        .lines()
        .map(|l| serde_json::from_str(l).expect("one JSON object per line"))
        .collect();
    assert_eq!(runs.len(), 2);
    for (run, concurrency) in runs.iter().zip([1, 4]) {
        assert_eq!(run["concurrency"], concurrency);
        assert_eq!(run["proxy"]["requests"], 120, "{run}");
        assert_eq!(run["direct"]["requests"], 120, "{run}");
        assert!(run["router_cpu_us_per_request"]
            .as_f64()
            .is_some_and(|us| us > 0.0));
        // The router and the engines tokenized the text alike.
        assert_eq!(run["index_accuracy"], 1.0, "{run}");
        assert_eq!(run["tokenizer"], "builtin");
    }
}

#[test]
fn bench_ingest_brings_every_rank_of_a_small_fleet_live_and_measures_its_apply_rate() {
    let out = kvroute()
        .args(["bench", "ingest", "--workers", "8", "--dp", "4"])
        .args(["--idle-secs", "2", "--flood-secs", "2"])
        .args(["--live-timeout-secs", "60", "--json"])
        .output()
        .expect("kvroute bench ingest runs");
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let r: Value = serde_json::from_slice(&out.stdout).expect("one JSON object");
    assert_eq!(r["ranks"], 32, "{r}");
    assert_eq!(r["ranks_live"], 32, "{r}");
    assert_eq!(r["all_live"], true, "{r}");
    assert!(r["seconds_to_all_live"].as_f64().is_some(), "{r}");
    assert_eq!(r["threads_within_limit"], true, "{r}");
    let number = |k: &str| r[k].as_f64().unwrap_or(f64::NAN);
    assert!(number("idle_cpu_percent_of_one_core") >= 0.0, "{r}");
    assert!(number("kib_per_idle_rank").is_finite(), "{r}");
    assert!(number("block_ops_per_s") > 0.0, "{r}");
    assert!(number("applied_block_ops") > 0.0, "{r}");
    assert_eq!(r["decode_errors"], 0, "{r}");
    // A flood may leave ranks replaying or degraded, never in error.
    assert!(r["rank_states_after_flood"].get("error").is_none(), "{r}");
}
