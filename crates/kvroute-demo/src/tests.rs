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

/// `--rounds`: every round runs every policy, the second in the reverse
/// order, and the summary gives each figure's median and spread and each
/// policy's comparison with `dynamo` and `sglang-cache-aware` round by
/// round.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn rounds_alternate_the_order_and_sum_up_by_medians() {
    use crate::contender::{DYNAMO, SGLANG};
    use kvroute_prompt::{ImageTokenRule, Renderer, Tokenizer};
    let names = ["kv", DYNAMO, SGLANG];
    let contenders = names
        .iter()
        .map(|n| (n.to_string(), n.parse::<Contender>().expect("known")))
        .collect();
    let config = small_run(WorkerFlavor::Vllm, contenders, 1);
    let tokenizer = std::sync::Arc::new(Renderer::new(
        Tokenizer::builtin(),
        ImageTokenRule::fixed(MM_TOKENS_PER_IMAGE),
    ));
    let rounds = rounds::run_rounds(&config, tokenizer, 2, std::future::pending())
        .await
        .expect("the rounds run")
        .expect("not interrupted");
    let order = |i: usize| -> Vec<String> {
        rounds.reports()[i]
            .report
            .policies
            .iter()
            .map(|(n, _)| n.clone())
            .collect()
    };
    assert_eq!(order(0), names);
    assert_eq!(order(1), [SGLANG, DYNAMO, "kv"]);
    let summary = rounds.summary();
    assert_eq!(summary["rounds"], 2);
    let kv = &summary["policies"]["kv"];
    let hits: Vec<f64> = (0..2)
        .map(|i| rounds.reports()[i].report.get("kv").expect("ran").hit_rate)
        .collect();
    assert_eq!(
        kv["hit rate"]["median"],
        (hits[0] + hits[1]) / 2.0,
        "{summary}"
    );
    assert_eq!(kv["hit rate"]["min"], hits[0].min(hits[1]), "{summary}");
    let ratio = |i: usize| {
        let r = &rounds.reports()[i].report;
        r.get("kv").expect("ran").latency_ms.p99 / r.get(DYNAMO).expect("ran").latency_ms.p99
    };
    let ratios = [ratio(0), ratio(1)];
    assert_eq!(
        kv["latency p99 / dynamo's"]["max"],
        ratios[0].max(ratios[1]),
        "{summary}"
    );
    assert!(
        kv.get("hit rate − sglang-cache-aware's").is_some(),
        "{summary}"
    );
    assert!(summary["policies"][DYNAMO]
        .get("latency p99 / dynamo's")
        .is_none());
    let text = rounds.to_string();
    assert!(text.contains("medians of 2 rounds"), "{text}");
    assert!(text.contains("kv: latency p99 / dynamo's "), "{text}");
    let file = std::env::temp_dir().join(format!("kvroute-rounds-{}.json", std::process::id()));
    rounds.write_json(&file).expect("written");
    let written = std::fs::read_to_string(&file).expect("read");
    let _ = std::fs::remove_file(&file);
    let doc: Value = serde_json::from_str(&written).expect("JSON");
    assert_eq!(doc["rounds"].as_array().map(Vec::len), Some(2));
    // (Floats read back from text may differ in their last digit.)
    assert_eq!(doc["summary"]["rounds"], 2);
    assert!(doc["summary"]["policies"]["kv"]["latency p99 / dynamo's"]["median"].is_f64());
    let too_many = rounds::run_rounds(
        &config,
        std::sync::Arc::new(Renderer::new(
            Tokenizer::builtin(),
            ImageTokenRule::fixed(MM_TOKENS_PER_IMAGE),
        )),
        rounds::MAX_ROUNDS + 1,
        std::future::pending(),
    );
    assert!(too_many.await.is_err());
}

/// `kv-replicate` runs in the demo, its copies counted beside its fetches.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_replicating_policy_runs_and_reports_its_copies() {
    let name = crate::contender::KV_REPLICATE;
    let contenders = vec![(name.to_owned(), Contender::Router(Routing::replicate()))];
    let done = report_of(&small_run(WorkerFlavor::Vllm, contenders, 1)).await;
    let p = done.report.get(name).expect("the policy ran");
    assert_eq!((p.requests, p.failed), (24, 0));
    assert!(p.fetches.is_some(), "its counters were read");
    let text = done.to_string();
    assert!(
        text.contains("hot prefixes copied ahead of demand"),
        "{text}"
    );
}
