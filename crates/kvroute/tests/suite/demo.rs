//! `kvroute demo --quick` as CI runs it: the real binary, a real mock fleet,
//! and its report read back from disk.

use serde_json::Value;

use crate::support::kvroute;

fn run_demo(dir: &std::path::Path, extra: &[&str]) -> Value {
    let report = dir.join("demo-report.json");
    let plot = dir.join("demo-report.svg");
    let out = kvroute()
        .args(["demo", "--quick"])
        .args(extra)
        .arg("--report")
        .arg(&report)
        .arg("--plot")
        .arg(&plot)
        .output()
        .expect("kvroute demo runs");
    let (stdout, stderr) = (
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr),
    );
    assert!(out.status.success(), "demo failed: {stdout}\n{stderr}");
    // The demo chose its routers' settings: they give no advice about flags
    // (the admin API's line is `kvroute serve`'s alone).
    for text in [&stdout, &stderr] {
        assert!(!text.contains("admin API"), "{stdout}\n{stderr}");
    }
    let svg = std::fs::read_to_string(&plot).expect("plot written");
    assert!(svg.starts_with("<svg") && svg.trim_end().ends_with("</svg>"));
    serde_json::from_str(&std::fs::read_to_string(&report).expect("report written"))
        .expect("report is JSON")
}

fn temp_dir(name: &str) -> std::path::PathBuf {
    let dir = std::env::temp_dir().join(format!("kvroute-{name}-{}", std::process::id()));
    std::fs::create_dir_all(&dir).expect("temp dir");
    dir
}

#[test]
fn quick_demo_shows_kv_routing_beating_round_robin_on_shared_prefixes() {
    let dir = temp_dir("demo");
    // Smaller prompts than the interactive demo: this runs in a debug build.
    let doc = run_demo(&dir, &["--scale", "0.25", "--gpu-blocks", "640"]);
    assert_eq!(doc["workload"]["name"], "shared-prefix");
    let policies = doc["policies"].as_object().expect("policies");
    for name in ["kv", "approx", "round-robin", "random", "oracle"] {
        let p = &policies[name];
        for field in ["hit_rate", "output_tokens_per_s", "requests", "failed"] {
            assert!(p[field].is_number(), "{name}.{field} missing: {p}");
        }
        for q in ["p50", "p90", "p99"] {
            assert!(
                p["ttft_ms"][q].as_f64().is_some_and(|v| v > 0.0),
                "{name} ttft {q}"
            );
        }
        for q in ["p50", "p99"] {
            assert!(
                p["latency_ms"][q].as_f64().is_some_and(|v| v > 0.0),
                "{name} latency {q}"
            );
        }
        assert_eq!(p["failed"], 0, "{name} had failures");
        assert_eq!(p["requests"], 160, "{name}");
    }
    let hit = |name: &str| policies[name]["hit_rate"].as_f64().expect("hit rate");
    assert!(
        hit("kv") > hit("round-robin") + 0.1,
        "kv {} vs round-robin {}",
        hit("kv"),
        hit("round-robin")
    );
    assert!(hit("kv") > hit("random") + 0.1);
    assert_eq!(policies["kv"]["decode_errors"], 0);
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn image_demo_makes_repeated_images_hit_on_both_engine_flavours() {
    for flavor in ["sglang", "vllm"] {
        let dir = temp_dir(&format!("images-{flavor}"));
        let doc = run_demo(
            &dir,
            &[
                "--workload",
                "images",
                "--flavor",
                flavor,
                "--policies",
                "kv,round-robin",
                "--requests",
                "120",
                // One client: a repeat never races its own first use.
                "--concurrency",
                "1",
            ],
        );
        let kv = &doc["policies"]["kv"];
        let rate = |key: &str| kv[key].as_f64().unwrap_or(0.0);
        assert!(rate("text_repeat_hit_rate") >= 0.96, "{flavor}: {kv}");
        assert!(rate("image_repeat_hit_rate") >= 0.95, "{flavor}: {kv}");
        assert_eq!(kv["decode_errors"], 0, "{flavor}");
        assert!(kv["blocks_stored"].as_u64().is_some_and(|b| b > 0));
        let _ = std::fs::remove_dir_all(&dir);
    }
}

/// `--keep`: after its report, the demo prints the dashboard URL of the kv
/// router, which stays up with the engines it drove: its `/api/stats` shows
/// the run's traffic and decisions, the page itself is served, and Ctrl-C
/// (SIGINT) stops it all.
#[test]
fn demo_keep_leaves_the_kv_router_up_and_prints_its_dashboard() {
    use std::io::{BufRead, BufReader};
    use std::process::Stdio;

    let dir = temp_dir("keep");
    let mut child = kvroute()
        .args(["demo", "--quick", "--keep", "--policies", "kv,round-robin"])
        .args(["--requests", "40"])
        .arg("--report")
        .arg(dir.join("demo-report.json"))
        .arg("--plot")
        .arg(dir.join("demo-report.svg"))
        .stdout(Stdio::piped())
        .stderr(Stdio::null())
        .spawn()
        .expect("kvroute demo runs");
    // Read on to the end, so the demo can always write its lines.
    let mut lines = BufReader::new(child.stdout.take().expect("stdout")).lines();
    let mut url = None;
    for line in lines.by_ref() {
        let line = line.expect("a line");
        if let Some(u) = line.trim().strip_prefix("http://") {
            if u.ends_with("/dashboard") {
                url = Some(u.trim_end_matches("/dashboard").to_owned());
                break;
            }
        }
    }
    let host = url.expect("the demo printed a dashboard URL");
    let stats = crate::support::http::request(&host, "GET", "/api/stats", "").json();
    assert_eq!(stats["policy"], "kv");
    assert_eq!(stats["summary"]["routed"], 40, "{}", stats["summary"]);
    let decisions = stats["decisions"].as_array().expect("decisions");
    assert!(!decisions.is_empty());
    assert!(stats["workers"].as_array().is_some_and(|w| w.len() >= 2));
    let page = crate::support::http::request(&host, "GET", "/dashboard", "");
    assert_eq!(page.status, 200);
    let pid = child.id().to_string();
    let _ = std::process::Command::new("kill")
        .args(["-INT", &pid])
        .status();
    let rest: Vec<String> = lines.map_while(Result::ok).collect();
    let status = child.wait().expect("the demo ends");
    assert!(rest.iter().any(|l| l.contains("Ctrl-C")), "{rest:?}");
    assert!(status.success(), "after Ctrl-C: {status:?}");
    let _ = std::fs::remove_dir_all(&dir);
}
