//! `kvroute bench proxy`, `bench ingest` and `bench replicas` as a user
//! runs them: the real binary starts the routers (and, for ingest, the
//! publishers; for replicas, nats-server) as its own child processes and
//! measures them from outside.

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
    // The router's CPU time over the quiet seconds, in % of one core: a
    // figure (0 when it stayed asleep between clock ticks), and far below
    // one busy core (100) for 32 quiet ranks. A thread spinning at idle, or
    // a figure that is not a share of one core, fails this.
    let idle_cpu = number("idle_cpu_percent_of_one_core");
    assert!(
        (0.0..25.0).contains(&idle_cpu),
        "idle CPU {idle_cpu} %: {r}"
    );
    assert!(number("kib_per_idle_rank").is_finite(), "{r}");
    assert!(number("block_ops_per_s") > 0.0, "{r}");
    assert!(number("applied_block_ops") > 0.0, "{r}");
    assert_eq!(r["decode_errors"], 0, "{r}");
    // A flood may leave ranks replaying or degraded, never in error.
    assert!(r["rank_states_after_flood"].get("error").is_none(), "{r}");
}

#[test]
fn bench_replicas_runs_every_phase_without_a_failure_and_only_synced_replicas_hear_peers() {
    let out = kvroute()
        .args([
            "bench",
            "replicas",
            "--requests",
            "200",
            "--concurrency",
            "8",
        ])
        .args(["--engines", "2", "--json"])
        // Early enough that the 200 requests are still running.
        .args(["--kill-after-ms", "150"])
        .output()
        .expect("kvroute bench replicas runs");
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let r: Value = serde_json::from_slice(&out.stdout).expect("one JSON object");
    let phases = r["phases"].as_array().expect("phases");
    let keys: Vec<&str> = phases.iter().filter_map(|p| p["phase"].as_str()).collect();
    assert_eq!(keys, ["one_router", "synced", "no_sync", "kill_one"], "{r}");
    for p in phases {
        assert_eq!(
            (&p["requests"], &p["failed"]),
            (&200.into(), &0.into()),
            "{p}"
        );
        let counted: u64 = p["requests_per_engine"]
            .as_object()
            .map_or(0, |m| m.values().filter_map(Value::as_u64).sum());
        assert!(counted > 0, "{p}");
    }
    let delays = |p: &Value| -> Vec<u64> {
        p["replicas"]
            .as_array()
            .into_iter()
            .flatten()
            .filter_map(|s| s["peer_delay"]["count"].as_u64())
            .collect()
    };
    let synced = &phases[1];
    assert_eq!(
        delays(synced).len(),
        2,
        "both replicas applied the other's requests: {synced}"
    );
    assert!(delays(synced).iter().all(|&n| n > 0), "{synced}");
    assert!(
        delays(&phases[2]).is_empty(),
        "no sync, no peer delay: {}",
        phases[2]
    );
    let killed = &phases[3];
    assert_eq!(killed["stream"], false, "{killed}");
    assert_eq!(killed["killed_during_load"], true, "{killed}");
    assert_eq!(
        killed["counted_from"],
        serde_json::json!(["r1"]),
        "{killed}"
    );
    assert!(
        killed["retried"].as_u64().is_some_and(|n| n > 0),
        "{killed}"
    );
}

#[test]
fn bench_index_replays_the_repositorys_mooncake_trace_beside_the_synthetic_fleet() {
    let trace = concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/../../bench/traces/synthetic-mooncake.jsonl"
    );
    let out = kvroute()
        .args(["bench", "index", "--workers", "8", "--blocks", "4000"])
        .args([
            "--trace",
            trace,
            "--trace-blocks-per-worker",
            "32",
            "--json",
        ])
        .output()
        .expect("kvroute bench index runs");
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let report: Value = serde_json::from_slice(&out.stdout).expect("one JSON object");
    assert!(
        report["apply_block_ops_per_s"].as_f64() > Some(0.0),
        "{report}"
    );
    let replay = &report["trace"];
    assert_eq!(replay["requests"], 600, "{replay}");
    assert_eq!(replay["workers"], 8);
    let residencies = replay["residencies"].as_u64().expect("residencies");
    assert!(residencies > 0 && residencies <= 8 * 32, "{replay}");
    assert!(
        replay["mean_matched_device_blocks"].as_f64() > Some(0.0),
        "{replay}"
    );
    let (p50, p99) = (
        replay["lookup_p50_us"].as_f64(),
        replay["lookup_p99_us"].as_f64(),
    );
    assert!(p50 > Some(0.0) && p50 <= p99, "{replay}");
}
