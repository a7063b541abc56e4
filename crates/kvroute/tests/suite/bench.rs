//! `kvroute bench proxy` as a user runs it: the real binary starts the
//! router as its own child process and measures its CPU per request.

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
