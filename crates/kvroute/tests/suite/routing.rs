//! Routing quality as `kvroute bench sim` and `kvroute demo` measure it:
//! the real binary runs the mocker's engines and kvroute's scheduler on a
//! virtual clock (deterministic), or a real mock fleet and router in real
//! time, on the published comparison's presets and on Mooncake traces.

use std::collections::HashMap;
use std::net::TcpStream;
use std::time::Duration;

use serde_json::{json, Value};

use crate::support::http::{connect, count, metric_where, read_reply, request, write_request};
use crate::support::{kvroute, start_mocker_with, start_serve};

/// Runs `kvroute bench sim ARGS --json` and returns its rows.
fn sim(args: &[&str]) -> Vec<Value> {
    let out = kvroute()
        .args(["bench", "sim", "--json"])
        .args(args)
        .output()
        .expect("kvroute bench sim runs");
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8_lossy(&out.stdout)
        .lines()
        .map(|l| serde_json::from_str(l).expect("one JSON object per line"))
        .collect()
}

/// Each policy's mean of `field` (a path in its report) over its rows.
fn means(rows: &[Value], path: &[&str]) -> HashMap<String, f64> {
    let mut sums: HashMap<String, (f64, f64)> = HashMap::new();
    for r in rows {
        let v = path
            .iter()
            .fold(&r["report"], |v, k| &v[*k])
            .as_f64()
            .expect("a number");
        let e = sums
            .entry(r["policy"].as_str().expect("named").to_owned())
            .or_default();
        *e = (e.0 + v, e.1 + 1.0);
    }
    sums.into_iter().map(|(k, (s, n))| (k, s / n)).collect()
}

#[test]
fn on_the_long_preset_every_prefix_stays_where_it_is_cached_and_the_cold_burst_is_no_slower() {
    // The published comparison: kvroute's hit rate 0.92 against 0.94 for a
    // router that keeps each prefix on one engine, because prefixes went to
    // a second engine while the first was busy. The earlier weights
    // (prefill 4, no decode-load term, no placement rules) reproduce the
    // gap; the defaults keep
    // every prefix where it is cached or being computed, within a request
    // of the ceiling (each group's first request misses: 0.9387), above the
    // oracle, which sees only what the engines have cached.
    let rows = sim(&[
        "--preset",
        "long",
        "--seeds",
        "1,2,3",
        "--policies",
        "kv,dynamo,least-loaded,oracle",
    ]);
    let earlier = sim(&[
        "--preset",
        "long",
        "--seeds",
        "1,2,3",
        "--policies",
        "kv",
        "--prefill-load-scale",
        "4",
        "--request-kv-weight",
        "0",
        "--deal-new-prefixes",
        "0",
        "--holder-stickiness",
        "0",
    ]);
    assert_eq!(rows.len(), 12);
    for r in rows.iter().chain(&earlier) {
        assert_eq!(r["report"]["requests"], 1_000, "{r}");
        assert_eq!(r["report"]["failed"], 0, "{r}");
        assert_eq!(r["skipped_events"], 0, "{r}");
    }
    let hit = means(&rows, &["hit_rate"]);
    let earlier_hit = means(&earlier, &["hit_rate"])["kv[pls=4,kvw=0,deal=0,stick=0]"];
    assert!(earlier_hit < hit["kv"] - 0.01, "{earlier_hit} {hit:?}");
    assert!(hit["kv"] >= 0.938, "{hit:?}");
    assert!(hit["kv"] > hit["oracle"], "{hit:?}");
    assert!(hit["kv"] > hit["dynamo"] + 0.2, "{hit:?}");
    // The cold burst at the start sets TTFT p99: a request of a group that is
    // being prefilled follows it and shares its blocks, which is no slower
    // than what the load-only routers do.
    let ttft_p99 = means(&rows, &["ttft_ms", "p99"]);
    assert!(
        ttft_p99["kv"] <= ttft_p99["dynamo"].min(ttft_p99["least-loaded"]),
        "{ttft_p99:?}"
    );
}

#[test]
fn the_default_dominates_sglang_and_kv_tail_dominates_dynamo_on_every_case() {
    // Tried as a new user would on `long`: kvroute had the ceiling hit rate
    // but the longest latency p99 of the three (534 ms on seed 1 against
    // 485 for sglang's `cache_aware` and 456 for Dynamo's KV router).
    let trace = concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/../../bench/traces/synthetic-mooncake.jsonl"
    );
    let cases: [&[&str]; 3] = [
        &["--preset", "long"],
        &["--preset", "short"],
        &["--trace", trace, "--gpu-blocks", "2048"],
    ];
    for case in cases {
        let mut args = case.to_vec();
        args.extend(["--seeds", "1,2,3", "--policies"]);
        args.push("kv,kv-tail,sglang-cache-aware,dynamo");
        let rows = sim(&args);
        for seed in 1..=3 {
            let point = |policy: &str| {
                let r = rows
                    .iter()
                    .find(|r| r["policy"] == policy && r["seed"] == seed)
                    .unwrap_or_else(|| panic!("{policy} seed {seed} in {rows:?}"));
                let f = |path: &[&str]| {
                    path.iter()
                        .fold(&r["report"], |v, k| &v[*k])
                        .as_f64()
                        .expect("a number")
                };
                (
                    f(&["hit_rate"]),
                    f(&["ttft_ms", "p99"]),
                    f(&["latency_ms", "p99"]),
                )
            };
            let (kv, tail) = (point("kv"), point("kv-tail"));
            let (sglang, dynamo) = (point("sglang-cache-aware"), point("dynamo"));
            let at = format!("{case:?} seed {seed}: kv {kv:?} kv-tail {tail:?} sglang {sglang:?} dynamo {dynamo:?}");
            assert!(kv.0 >= sglang.0 - 0.002, "{at}");
            assert!(kv.1 <= sglang.1 && kv.2 <= sglang.2, "{at}");
            assert!(tail.0 >= dynamo.0, "{at}");
            assert!(
                tail.1 <= dynamo.1 * 1.02 && tail.2 <= dynamo.2 * 1.02,
                "{at}"
            );
        }
    }
}

#[test]
fn a_real_router_on_the_long_workload_keeps_each_prefix_where_it_is_cached() {
    // The published comparison's `long` workload at four times real speed,
    // with flags every build has: four engines of 2 048 blocks, 32 groups of
    // a 2 048-token prefix (6 000 × 0.341333) and a 64-token question, 16 in
    // flight, 16 output tokens. The earlier weights placed prefixes on a
    // second engine while the first was busy (0.923 here, 0.916–0.920 in the
    // comparison), and the engines computed a prefix twice when two requests
    // of a group started together (0.935); the ceiling, each group's first
    // request missing, is 0.9387.
    let (_mocker, lines) = start_mocker_with(4, &["--num-gpu-blocks", "2048", "--speedup", "4"]);
    let (_serve, serve) = start_serve(&lines, &[]);
    let run = bench_long(&serve, 1_000);
    let hit = run["hit_rate"].as_f64().expect("a hit rate");
    assert!(hit >= 0.935, "hit rate {hit}");
}

/// Runs `kvroute bench` through the router at `serve` on the `long`
/// workload (flags every build has): 32 groups of a 2 048-token prefix
/// (6 000 × 0.341333) and a 64-token question, 16 in flight, 16 output
/// tokens, seed 1; the run's report, checked complete.
pub(crate) fn bench_long(serve: &str, requests: u32) -> Value {
    let n = requests.to_string();
    let doc = crate::support::bench_report(
        serve,
        &[
            "--workload",
            "shared-prefix",
            "--groups",
            "32",
            "--scale",
            "0.341333",
            "--question-tokens",
            "64",
            "--requests",
            &n,
            "--concurrency",
            "16",
            "--max-tokens",
            "16",
            "--seed",
            "1",
        ],
    );
    assert_eq!(doc["workload"]["sizes"]["prefix_tokens"], 2_048);
    let run = doc["policies"]["target"].clone();
    assert_eq!(
        (run["requests"].as_u64(), run["failed"].as_u64()),
        (Some(u64::from(requests)), Some(0)),
        "{run}"
    );
    run
}

/// A fleet with one engine at a quarter of the others' speed, declared to
/// the router (`speed=0.25`): a request there costs four times its work,
/// so the slow engine takes few groups and so few requests (0 of 400 in
/// three runs of the release build, 9–14 without the request-size term,
/// against 45–65 undeclared: groups stay where they are cached). In
/// `kvroute bench sim --engine-speeds 1,1,1,0.5` the same at half speed
/// cuts kv's latency p99 from 977 to 539 ms.
#[test]
fn a_worker_declared_a_quarter_as_fast_takes_few_requests() {
    let (_fast, mut lines) = start_mocker_with(3, &["--num-gpu-blocks", "2048", "--speedup", "4"]);
    let (_slow, slow) = start_mocker_with(1, &["--num-gpu-blocks", "2048", "--speedup", "1"]);
    let slow = slow[0].replacen("name=w0", "name=slow", 1);
    lines.push(format!("{slow},speed=0.25"));
    let (_serve, serve) = start_serve(&lines, &[]);
    let speed_of = |name: &str| worker_entry(&serve, name).map(|w| w["speed"].clone());
    assert_eq!(speed_of("slow"), Some(json!(0.25)));
    assert_eq!(speed_of("w0"), Some(json!(1.0)));
    bench_long(&serve, 400);
    let (slow, fast) = routed_slow_and_fast(&serve, 400);
    let mean_fast = fast.iter().sum::<f64>() / 3.0;
    assert!(slow < mean_fast / 4.0, "slow {slow}, fast {fast:?}");
}

/// A prompt cached only on an engine declared a quarter as fast as the
/// other goes to the faster engine: there its blocks cost a prefill, but it
/// decodes four times as fast, and the request-size term weighs that. With
/// `--request-size-weight 0` (no such term) the cached copy wins.
#[test]
fn a_prompt_cached_only_on_a_much_slower_engine_goes_to_a_faster_one() {
    let prompt: Vec<u32> = (3000..3128).collect();
    let query = json!({"token_ids": prompt}).to_string();
    for (flags, expected) in [
        (&[][..], "w0"),
        (&["--request-size-weight", "0"][..], "slow"),
    ] {
        let (_fast, mut lines) = start_mocker_with(1, &["--speedup", "100"]);
        let (_slow, slow) = start_mocker_with(1, &["--speedup", "100"]);
        let engine = slow[0]
            .split(',')
            .find_map(|kv| kv.strip_prefix("url=http://"))
            .expect("the engine's url")
            .to_string();
        lines.push(format!(
            "{},speed=0.25",
            slow[0].replacen("name=w0", "name=slow", 1)
        ));
        let (_serve, serve) = start_serve(&lines, flags);
        let body = json!({"model": "mock-model", "prompt": prompt, "max_tokens": 1}).to_string();
        let r = request(&engine, "POST", "/v1/completions", &body);
        assert_eq!(r.status, 200, "{}", r.body);
        let cached_on_slow = || {
            let q = request(&serve, "POST", "/query", &query).json();
            q["workers"].as_array().is_some_and(|ws| {
                ws.iter()
                    .any(|w| w["name"] == "slow" && w["device_blocks"] == 8)
            })
        };
        crate::support::eventually("the slow engine's blocks in the index", cached_on_slow);
        let q = request(&serve, "POST", "/query", &query).json();
        assert_eq!(q["chosen"]["name"], expected, "{flags:?}: {q}");
    }
}

/// A fleet with one engine at an eighth of the others' speed, nothing
/// declared, and `--learn-speeds`: the router learns the slow engine's
/// speed from its streamed responses (time per token after the first,
/// against the blocks it decoded under), reports it in `/workers` and
/// `kvroute_rank_speed`, and prices the engine by it (`/query`), so the
/// engine takes few groups (quiet machine: learned at 0.11–0.12 and 11–21
/// requests of 400 in seven runs, against 27–48 without learning in
/// three). The fast engines are within the dead band of each other and so
/// are learned as equal.
#[test]
fn a_worker_an_eighth_as_fast_is_learned_from_its_responses() {
    let (learned, slow, fast, priced) = eighth_speed_fleet(true);
    let learned = learned.expect("a learned speed");
    // What the router sees also holds fixed costs (HTTP, the engine's
    // wake-up after a step), more so on a busy machine, which bring the
    // ratio towards 1.
    assert!((0.03..0.5).contains(&learned), "slow learned at {learned}");
    assert_eq!(priced, Some(learned));
    let mean_fast = fast.iter().sum::<f64>() / 3.0;
    assert!(slow < mean_fast / 2.0, "slow {slow}, fast {fast:?}");
    // Without learning, the same engine is priced as the others.
    let (none, _, _, priced) = eighth_speed_fleet(false);
    assert_eq!((none, priced), (None, Some(1.0)));
}

/// Three engines of `kvroute mocker --speedup 4` and one at 0.5, nothing
/// declared, 400 requests of the `long` shape: the slow engine's learned
/// speed (with `learn`), the requests routed to it and to the others, and
/// the speed `/query` then prices it at.
fn eighth_speed_fleet(learn: bool) -> (Option<f64>, f64, [f64; 3], Option<f64>) {
    let (_fast, mut lines) = start_mocker_with(3, &["--num-gpu-blocks", "2048", "--speedup", "4"]);
    let (_slow, slow) = start_mocker_with(1, &["--num-gpu-blocks", "2048", "--speedup", "0.5"]);
    lines.push(slow[0].replacen("name=w0", "name=slow", 1));
    let flags: &[&str] = if learn { &["--learn-speeds"] } else { &[] };
    let (_serve, serve) = start_serve(&lines, flags);
    let learned_of = |name: &str| {
        worker_entry(&serve, name)
            .map(|w| (w["speed"].clone(), w["ranks"][0]["learned_speed"].clone()))
    };
    // Nothing is learned before a response has been seen.
    assert_eq!(learned_of("slow"), Some((json!(1.0), Value::Null)));
    bench_long(&serve, 400);
    let (declared, learned) = learned_of("slow").expect("the slow worker");
    assert_eq!(declared, json!(1.0));
    let priced_at = metric_where(&serve, "kvroute_rank_speed", "worker=\"slow\"");
    if learn {
        for name in ["w0", "w1", "w2"] {
            assert_eq!(learned_of(name).map(|l| l.1), Some(json!(1.0)), "{name}");
        }
        // The exposition prints a float to within a unit of its last place.
        let (at, learned) = (priced_at.unwrap_or(0.0), learned.as_f64().unwrap_or(1.0));
        assert!((at - learned).abs() < 1e-12, "{at} vs {learned}");
        // The dashboard's fleet table shows it, marked as learned.
        let stats = request(&serve, "GET", "/api/stats", "").json();
        let shown = stats["workers"]
            .as_array()
            .and_then(|ws| ws.iter().find(|w| w["name"] == "slow"))
            .map(|w| {
                (
                    w["ranks"][0]["speed"].as_f64(),
                    w["ranks"][0]["speed_learned"].clone(),
                )
            });
        assert_eq!(shown, Some((Some(learned), json!(true))));
    } else {
        assert_eq!(priced_at, Some(1.0));
    }
    let (slow, fast) = routed_slow_and_fast(&serve, 400);
    let prompt: Vec<u32> = (0..64).collect();
    let body = json!({"model": "mock-model", "prompt": prompt});
    let query = request(&serve, "POST", "/query", &body.to_string()).json();
    let priced = query["workers"]
        .as_array()
        .and_then(|ws| ws.iter().find(|w| w["name"] == "slow"))
        .and_then(|w| w["speed"].as_f64());
    (learned.as_f64(), slow, fast, priced)
}

/// Worker `name`'s entry in the router's `/workers`.
fn worker_entry(serve: &str, name: &str) -> Option<Value> {
    let workers = request(serve, "GET", "/workers", "").json();
    workers["workers"]
        .as_array()?
        .iter()
        .find(|w| w["name"] == name)
        .cloned()
}

/// The requests routed to the worker `slow` and to `w0`–`w2`, which were
/// all of the `requests` sent.
fn routed_slow_and_fast(serve: &str, requests: u32) -> (f64, [f64; 3]) {
    let routed = |name: &str| {
        let label = format!("worker=\"{name}\"");
        metric_where(serve, "kvroute_proxy_routed_total", &label).unwrap_or(0.0)
    };
    let fast = ["w0", "w1", "w2"].map(routed);
    let slow = routed("slow");
    assert_eq!(fast.iter().sum::<f64>() + slow, f64::from(requests));
    (slow, fast)
}

/// Two requests of a new group sent at once: the router places them one
/// after the other, so the second sees the first's prefix in flight and
/// follows it, and the engine computes the prefix once (vLLM shares a block
/// it is computing). 32 rounds, a new group each: without the ordering,
/// two requests scored at the same moment both see idle engines and part; a
/// router that spreads a burst (in-flight prefix credit 1, the earlier
/// weights) parts them every time.
#[test]
fn a_request_that_starts_beside_another_of_its_group_follows_it_and_shares_its_prefix() {
    let (_mocker, lines) = start_mocker_with(4, &["--num-gpu-blocks", "2048", "--speedup", "1"]);
    let (_serve, serve) = start_serve(&lines, &[]);
    for round in 0..32u32 {
        let (workers, cached) = send_pair(&serve, round, Duration::ZERO);
        assert_eq!(workers[0], workers[1], "round {round}");
        assert_eq!(cached.iter().sum::<u64>(), 2_048, "round {round}");
    }
}

/// Sends two requests of a new group (a 2 048-token prefix, `round`'s own),
/// the second `gap` after the first; the workers that answered and each
/// one's cached tokens.
fn send_pair(serve: &str, round: u32, gap: Duration) -> (Vec<String>, Vec<u64>) {
    let prefix: Vec<u32> = (0..2_048).map(|i| 100_000 * (round + 1) + i).collect();
    let bodies: Vec<String> = (0..2u32)
        .map(|k| {
            let mut prompt = prefix.clone();
            prompt.extend((0..64).map(|i| 20_000 + 100 * k + i));
            json!({"model": "mock-model", "prompt": prompt, "max_tokens": 4}).to_string()
        })
        .collect();
    // Both connected, then both written, before either answer is read:
    // without a gap the router has both within microseconds.
    let mut sent: Vec<TcpStream> = bodies.iter().map(|_| connect(serve)).collect();
    for (i, (s, body)) in sent.iter_mut().zip(&bodies).enumerate() {
        if i > 0 {
            std::thread::sleep(gap);
        }
        write_request(s, serve, "POST", "/v1/completions", &[], body);
    }
    let mut workers = Vec::new();
    let mut cached = Vec::new();
    for s in sent {
        let reply = read_reply(s);
        assert_eq!(reply.status, 200, "{}", reply.body);
        workers.push(reply.header("x-kvroute-worker").expect("the worker"));
        cached.push(
            reply.json()["usage"]["prompt_tokens_details"]["cached_tokens"]
                .as_u64()
                .expect("cached_tokens"),
        );
    }
    (workers, cached)
}

/// A request that follows another of its group onto a vLLM engine while
/// that one's prefill runs hits the prefix it is computing, before the
/// engine announces it (vLLM caches a block as it schedules it, and
/// publishes the step's events when the step ends), and the router
/// predicts that hit: predictions that counted only the index missed every
/// follower's. The follower is sent 20 ms after the first request, well
/// inside its ~50 ms prefill step, so the engine sees them in order.
///
/// On a starved machine the router's two forwards can still reach the
/// engine the other way round: the follower computes the prefix and the
/// first request hits it, so both predictions miss by design. Such a round
/// shows in the engine's answers (the first request is the one cached) and
/// is allowed to miss. Measured with eight busy loops beside the test on two
/// cores: 12 to 16 of 16 rounds in order, and exactly the in-order rounds'
/// predictions exact.
#[test]
fn a_request_that_follows_a_prefix_in_flight_is_predicted_to_hit_it() {
    let (_mocker, lines) = start_mocker_with(4, &["--num-gpu-blocks", "2048", "--speedup", "1"]);
    let (_serve, serve) = start_serve(&lines, &[]);
    let rounds = 16;
    let mut in_order = 0u64;
    for round in 0..rounds {
        let (workers, cached) = send_pair(&serve, round, Duration::from_millis(20));
        assert_eq!(workers[0], workers[1], "round {round}");
        assert_eq!(
            cached.iter().sum::<u64>(),
            2_048,
            "round {round}: {cached:?}"
        );
        in_order += u64::from(cached[1] == 2_048);
    }
    // More than half, so that predictions blind to the prefix in flight
    // (exact for the first request of each round only: 16) cannot pass.
    assert!(
        2 * in_order > u64::from(rounds),
        "{in_order} of {rounds} rounds reached the engine in order"
    );
    let compared = count(&serve, "kvroute_accuracy_comparisons_total");
    let exact = count(&serve, "kvroute_accuracy_exact_total");
    assert_eq!(compared, u64::from(2 * rounds));
    assert!(
        exact >= 2 * in_order,
        "{exact} exact of {compared}; {in_order} rounds reached the engine in order"
    );
}

#[test]
fn a_weight_sweep_runs_every_combination_and_a_bad_trace_names_its_line() {
    let rows = sim(&[
        "--preset",
        "short",
        "--requests",
        "200",
        "--policies",
        "kv,round-robin",
        "--prefill-load-scale",
        "1,8",
        "--request-kv-weight",
        "0,0.5",
    ]);
    let names: Vec<&str> = rows.iter().filter_map(|r| r["policy"].as_str()).collect();
    assert_eq!(
        names,
        [
            "kv[pls=1,kvw=0]",
            "kv[pls=1,kvw=0.5]",
            "kv[pls=8,kvw=0]",
            "kv[pls=8,kvw=0.5]",
            "round-robin"
        ]
    );
    let dir = std::env::temp_dir().join(format!("kvroute-trace-{}", std::process::id()));
    std::fs::create_dir_all(&dir).expect("temp dir");
    let bad = dir.join("bad.jsonl");
    std::fs::write(
        &bad,
        "{\"timestamp\": 0, \"input_length\": 10, \"output_length\": 2, \"hash_ids\": [1]}\n{\"timestamp\": 5}\n",
    )
    .expect("written");
    let out = kvroute()
        .args(["bench", "sim", "--trace"])
        .arg(&bad)
        .output()
        .expect("runs");
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success());
    assert!(stderr.contains("bad.jsonl line 2"), "{stderr}");
}

#[test]
fn a_synthesized_trace_replays_in_the_simulator_and_through_a_real_router() {
    let dir = std::env::temp_dir().join(format!("kvroute-synth-{}", std::process::id()));
    std::fs::create_dir_all(&dir).expect("temp dir");
    let trace = dir.join("trace.jsonl");
    let out = kvroute()
        .args(["bench", "synth-trace", "--requests", "60", "--rate", "40"])
        .output()
        .expect("runs");
    assert!(out.status.success());
    std::fs::write(&trace, &out.stdout).expect("written");
    let path = trace.to_str().expect("utf-8 path");
    let rows = sim(&["--trace", path, "--policies", "kv,oracle"]);
    for r in &rows {
        assert_eq!(r["report"]["requests"], 60, "{r}");
        assert_eq!(r["report"]["failed"], 0, "{r}");
        assert!(
            r["report"]["hit_rate"].as_f64().is_some_and(|h| h > 0.3),
            "{r}"
        );
    }
    let report = dir.join("report.json");
    let out = kvroute()
        .args(["demo", "--trace", path, "--speedup", "10"])
        .args(["--policies", "kv,round-robin", "--report"])
        .arg(&report)
        .arg("--plot")
        .arg(dir.join("report.svg"))
        .output()
        .expect("kvroute demo runs");
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let doc: Value =
        serde_json::from_str(&std::fs::read_to_string(&report).expect("written")).expect("JSON");
    assert_eq!(doc["workload"]["name"], "trace");
    let kv = &doc["policies"]["kv"];
    let rr = &doc["policies"]["round-robin"];
    for p in [kv, rr] {
        assert_eq!(
            (p["requests"].as_u64(), p["failed"].as_u64()),
            (Some(60), Some(0)),
            "{p}"
        );
    }
    assert!(
        kv["hit_rate"].as_f64() > rr["hit_rate"].as_f64(),
        "{kv} {rr}"
    );
}

#[test]
fn the_placement_search_prints_a_placement_at_the_ceiling_that_runs_again_alike() {
    let run = ["--preset", "short", "--requests", "300", "--seeds", "2"];
    let rows = sim(&[&run[..], &["--pin-search", "6"]].concat());
    let names: Vec<&str> = rows.iter().filter_map(|r| r["policy"].as_str()).collect();
    assert_eq!(names, ["least-loaded", "dynamo", "kv", "pinned-best"]);
    let best = &rows[3];
    assert_eq!(best["evaluations"], 6);
    let ratio = best["ratio"].as_f64().expect("a ratio");
    assert!(ratio <= best["start_ratio"].as_f64().expect("a start"));
    // Each group's prefix computed once: no router's hit rate is higher.
    let hit = |r: &Value| r["report"]["hit_rate"].as_f64().expect("a hit rate");
    assert!(rows[..3].iter().all(|r| hit(r) <= hit(best)), "{rows:?}");
    // The printed placement, run alone, is the same run.
    let pins: Vec<String> = best["pins"]
        .as_array()
        .expect("a placement")
        .iter()
        .map(|p| p.to_string())
        .collect();
    assert_eq!(pins.len(), 32);
    let pins = pins.join(",");
    let again = sim(&[&run[..], &["--pins", &pins]].concat());
    assert_eq!(again.len(), 1);
    assert_eq!(again[0]["policy"], "pinned");
    assert_eq!(again[0]["report"], best["report"]);
    assert_eq!(again[0]["per_engine"], best["per_engine"]);
}
