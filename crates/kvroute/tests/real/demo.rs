//! `kvroute demo --engines`: the demo's table and plot with the bed's real
//! vLLM engines instead of its mock ones, the oracle following each
//! engine's own KV events.

use serde_json::Value;

use super::bed::bed;
use crate::support::kvroute;

/// The quick demo on the real engines: every request answered, kv at
/// least 95 % of the oracle's hit rate and above round-robin's, the table
/// and its comparison lines printed, the report and the plot written.
/// (Its TTFTs are reported, not asserted: they are wall-clock figures of a
/// shared machine; docs/real-engines.md has measured ones.)
#[test]
fn the_demo_runs_on_real_engines_and_kv_nears_the_oracle() {
    let (_serial, bed) = bed();
    let dir = std::env::temp_dir().join(format!("kvroute-real-demo-{}", std::process::id()));
    std::fs::create_dir_all(&dir).expect("a directory");
    let (report, plot) = (dir.join("report.json"), dir.join("report.svg"));
    let out = kvroute()
        .args([
            "demo",
            "--quick",
            "--policies",
            "kv,round-robin,oracle",
            "--engines",
        ])
        .arg(&bed.path)
        .arg("--report")
        .arg(&report)
        .arg("--plot")
        .arg(&plot)
        .output()
        .expect("kvroute demo runs");
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success(),
        "{stdout}\n{}",
        String::from_utf8_lossy(&out.stderr)
    );
    eprintln!("{stdout}");
    assert!(stdout.contains("kv reaches"), "{stdout}");
    assert!(stdout.contains("kv vs round-robin"), "{stdout}");
    let doc: Value =
        serde_json::from_str(&std::fs::read_to_string(&report).expect("the report")).expect("JSON");
    let hit = |name: &str| {
        let p = &doc["policies"][name];
        assert_eq!(p["failed"], 0, "{name}: {p}");
        assert!(p["requests"].as_u64() > Some(0), "{name}: {p}");
        p["hit_rate"].as_f64().expect("hit_rate")
    };
    let (kv, rr, oracle) = (hit("kv"), hit("round-robin"), hit("oracle"));
    assert!(
        kv >= 0.95 * oracle,
        "kv {kv:.3} against the oracle's {oracle:.3}"
    );
    assert!(kv > rr, "kv {kv:.3} against round-robin's {rr:.3}");
    assert_eq!(doc["policies"]["kv"]["decode_errors"], 0);
    assert!(
        std::fs::metadata(&plot).is_ok_and(|m| m.len() > 0),
        "the plot"
    );
    let _ = std::fs::remove_dir_all(&dir);
}
