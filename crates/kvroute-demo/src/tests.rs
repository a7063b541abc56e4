//! The demo run in process: router policies through replicas, and what
//! the fetch lever did.

use super::*;
use kvroute_core::scheduler::Policy;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn router_policies_run_through_two_replicas_sharing_a_nats_server() {
    assert!(NatsServer::available(), "{}", Error::NatsNotFound);
    let contenders = vec![
        ("kv".into(), Contender::Router(Routing::new(Policy::Kv))),
        (
            "round-robin".into(),
            Contender::Router(Routing::new(Policy::RoundRobin)),
        ),
    ];
    let done = report_of(&small_run(WorkerFlavor::Vllm, contenders, 2)).await;
    let doc = done.document().expect("a document");
    for name in ["kv", "round-robin"] {
        let p = done.report.get(name).expect("the policy ran");
        assert_eq!((p.requests, p.failed, p.retried), (24, 0, 0), "{name}");
        assert_eq!(doc["policies"][name]["replicas"], 2, "{name}");
        assert!(
            p.index_accuracy.is_some(),
            "{name}: summed over both replicas"
        );
        let received = doc["policies"][name]["replica_messages_received"].as_u64();
        assert!(received.is_some_and(|n| n > 0), "{name}: shared over NATS");
    }
    let text = done.to_string();
    assert!(
        text.contains("kv, round-robin ran through 2 router replicas each, sharing state over NATS at nats://127.0.0.1:"),
        "{text}"
    );
}

/// A small demo run on `flavor` engines with the given policies and routers per policy.
fn small_run(
    flavor: WorkerFlavor,
    contenders: Vec<(String, Contender)>,
    replicas: usize,
) -> DemoConfig {
    use crate::driver::Arrival;
    use crate::workload::WorkloadSpec;
    DemoConfig {
        flavor,
        workers: 2,
        layout: None,
        gpu_blocks: 2048,
        speedup: 200.0,
        seed: 1,
        contenders,
        load: LoadOptions {
            workload: WorkloadSpec {
                kind: WorkloadKind::SharedPrefix,
                scale: 0.05,
                groups: 3,
                max_tokens: 4,
                mm_tokens_per_image: MM_TOKENS_PER_IMAGE,
                ..WorkloadSpec::default()
            },
            arrival: Arrival::Closed { concurrency: 4 },
            requests: 24,
            max_duration: Some(Duration::from_secs(60)),
            progress: false,
            label: String::new(),
        },
        replicas,
        keep: false,
        real_engines: None,
    }
}

/// Runs the demo to its report.
async fn report_of(config: &DemoConfig) -> DemoReport {
    use kvroute_prompt::{ImageTokenRule, Renderer, Tokenizer};
    let tokenizer = std::sync::Arc::new(Renderer::new(
        Tokenizer::builtin(),
        ImageTokenRule::fixed(MM_TOKENS_PER_IMAGE),
    ));
    run(config, tokenizer, std::future::pending())
        .await
        .expect("the demo runs")
        .map(|(report, _)| report)
        .expect("not interrupted")
}

/// The `kv-fetch` policy's report has the router's fetch counts (in the
/// JSON, the table and a line beside `kv`); on SGLang engines, which the
/// demo then starts as both ends of a hand-off, no fetch falls back.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_fetch_policy_reports_what_it_moved() {
    let fetch = crate::contender::KV_FETCH;
    let contenders = vec![
        ("kv".into(), Contender::Router(Routing::new(Policy::Kv))),
        (fetch.into(), Contender::Router(Routing::fetch())),
    ];
    let config = small_run(WorkerFlavor::Sglang, contenders, 1);
    assert!(mocker_config(&config).kv_both);
    let done = report_of(&config).await;
    let doc = done.document().expect("a document");
    for name in ["kv", fetch] {
        let p = done.report.get(name).expect("the policy ran");
        assert_eq!((p.requests, p.failed), (24, 0), "{name}");
    }
    assert!(doc["policies"]["kv"].get("fetches").is_none(), "{doc}");
    let counts = &doc["policies"][fetch]["fetches"];
    assert_eq!(counts["fell_back"], 0, "{doc}");
    assert!(
        counts["handed_off"].is_u64() && counts["blocks"].is_u64(),
        "{doc}"
    );
    let text = done.to_string();
    assert!(text.contains("fetch blk"), "{text}");
    let line = format!("{fetch}: {} requests fetched", counts["handed_off"]);
    assert!(text.contains(&line), "{text}");
}
