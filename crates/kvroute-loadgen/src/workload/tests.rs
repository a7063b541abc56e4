//! The workloads' unit tests.

use super::*;

fn spec(kind: WorkloadKind) -> WorkloadSpec {
    WorkloadSpec {
        kind,
        scale: 0.01,
        groups: 3,
        max_tokens: 4,
        ..WorkloadSpec::default()
    }
}

fn prompt_ids(r: &PlannedRequest) -> Vec<u64> {
    r.body["prompt"]
        .as_array()
        .expect("ids")
        .iter()
        .map(|v| v.as_u64().expect("id"))
        .collect()
}

#[test]
fn the_same_spec_gives_the_same_requests() {
    for kind in [
        WorkloadKind::SharedPrefix,
        WorkloadKind::LongDoc,
        WorkloadKind::Images,
        WorkloadKind::Random,
    ] {
        let (a, b) = (Workload::new(&spec(kind)), Workload::new(&spec(kind)));
        for _ in 0..20 {
            let (x, y) = (a.try_next().expect("x"), b.try_next().expect("y"));
            assert_eq!(x.body, y.body);
            assert_eq!(x.label, y.label);
        }
        let other = Workload::new(&WorkloadSpec {
            seed: 2,
            ..spec(kind)
        });
        assert_ne!(
            Workload::new(&spec(kind)).try_next().expect("r").body,
            other.try_next().expect("r").body
        );
    }
}

#[test]
fn shared_prefix_requests_share_one_of_the_group_prefixes() {
    let w = Workload::new(&WorkloadSpec {
        scale: 0.1,
        ..spec(WorkloadKind::SharedPrefix)
    });
    let mut prefixes = std::collections::HashSet::new();
    let mut questions = std::collections::HashSet::new();
    for _ in 0..50 {
        let r = w.try_next().expect("request");
        assert_eq!(r.path, "/v1/completions");
        assert_eq!(r.body["stream"], true);
        assert_eq!(r.body["stream_options"]["include_usage"], true);
        assert_eq!(r.body["max_tokens"], 4);
        let p = prompt_ids(&r);
        assert_eq!(p.len(), 600 + 120);
        assert!(p.iter().all(|&id| id < TEXT_VOCAB));
        prefixes.insert(p[..600].to_vec());
        questions.insert(p[600..].to_vec());
    }
    assert_eq!(prefixes.len(), 3);
    assert_eq!(questions.len(), 50);
}

#[test]
fn random_prompts_share_nothing() {
    let w = Workload::new(&spec(WorkloadKind::Random));
    let a = prompt_ids(&w.try_next().expect("a"));
    let b = prompt_ids(&w.try_next().expect("b"));
    assert_eq!(a.len(), 72);
    assert_ne!(a[..16], b[..16]);
}

#[test]
fn multi_turn_turns_extend_the_previous_prompt_and_wait_for_it() {
    let w = Workload::new(&WorkloadSpec {
        groups: 2,
        scale: 0.1,
        ..spec(WorkloadKind::MultiTurn)
    });
    let t0 = w.try_next().expect("conversation 0");
    let t1 = w.try_next().expect("conversation 1");
    assert_eq!((t0.conversation, t1.conversation), (Some(0), Some(1)));
    assert!(w.try_next().is_none(), "both conversations are in flight");
    let p0 = prompt_ids(&t0);
    assert_eq!(p0.len(), 100 + 20);
    w.finished(&t0);
    let t2 = w.try_next().expect("conversation 0 again");
    assert_eq!(t2.conversation, Some(0));
    let p2 = prompt_ids(&t2);
    // previous prompt + reply (max_tokens) + new user message
    assert_eq!(p2.len(), p0.len() + 4 + 20);
    assert_eq!(p2[..p0.len()], p0[..]);
    // After the last turn the conversation starts over.
    let mut last = t2;
    for _ in 2..sizes::MULTI_TURN_TURNS {
        w.finished(&last);
        last = w.try_next().expect("next turn");
        assert_eq!(last.conversation, Some(0));
    }
    w.finished(&last);
    let fresh = prompt_ids(&w.try_next().expect("restart"));
    assert_eq!(fresh.len(), 120);
    assert_ne!(fresh[..16], p0[..16]);
}

#[tokio::test]
async fn multi_turn_next_waits_for_a_finished_turn() {
    let w = std::sync::Arc::new(Workload::new(&WorkloadSpec {
        groups: 1,
        ..spec(WorkloadKind::MultiTurn)
    }));
    let first = w.next().await;
    let waiter = tokio::spawn({
        let w = w.clone();
        async move { w.next().await }
    });
    tokio::time::sleep(std::time::Duration::from_millis(20)).await;
    assert!(!waiter.is_finished());
    w.finished(&first);
    let second = tokio::time::timeout(std::time::Duration::from_secs(5), waiter)
        .await
        .expect("woken")
        .expect("task");
    assert_eq!(second.conversation, Some(0));
}

#[test]
fn images_label_first_uses_and_repeats() {
    let w = Workload::new(&spec(WorkloadKind::Images));
    let mut seen_text = std::collections::HashMap::new();
    let mut labels = std::collections::HashMap::new();
    for _ in 0..60 {
        let r = w.try_next().expect("request");
        assert_eq!(r.path, "/v1/chat/completions");
        *labels.entry(format!("{:?}", r.label)).or_insert(0) += 1;
        let content = &r.body["messages"][0]["content"];
        if let Some(text) = content.as_str() {
            let before = seen_text.insert(text.to_owned(), ());
            assert_eq!(before.is_some(), r.label == RepeatLabel::TextRepeat);
        } else {
            let url = content[0]["image_url"]["url"].as_str().expect("url");
            assert!(url.starts_with("data:image/png;base64,iVBORw0KGgo"));
            assert_ne!(r.label, RepeatLabel::TextRepeat);
        }
    }
    // 3 chats + 3 images → at most 6 first uses; the rest are repeats.
    assert!(labels.get("First").copied().unwrap_or(0) <= 6);
    assert!(labels.contains_key("TextRepeat") && labels.contains_key("ImageRepeat"));
}

#[test]
fn a_text_renderer_turns_every_completion_prompt_into_its_text() {
    let render = TextRenderer(std::sync::Arc::new(|ids: &[u32]| {
        ids.iter()
            .map(|i| format!("w{i}"))
            .collect::<Vec<_>>()
            .join(" ")
    }));
    let w = Workload::new(&WorkloadSpec {
        text: true,
        text_renderer: Some(render),
        ..spec(WorkloadKind::SharedPrefix)
    });
    let a = w.try_next().expect("a");
    let text = a.body["prompt"].as_str().expect("text prompt");
    assert_eq!(text.split(' ').count(), 60 + 12);
    assert!(text.split(' ').all(|w| w.starts_with('w')));
}

#[test]
fn text_mode_renders_one_word_per_id_with_stable_prefixes() {
    let w = Workload::new(&WorkloadSpec {
        text: true,
        model: Some("m".into()),
        ..spec(WorkloadKind::SharedPrefix)
    });
    let a = w.try_next().expect("a");
    let text = a.body["prompt"].as_str().expect("text prompt");
    assert_eq!(text.split(' ').filter(|w| !w.is_empty()).count(), 60 + 12);
    assert_eq!(a.body["model"], "m");
    assert_eq!(render_words(&[0, 1, 26]), " aaaa baaa abaa");
}

#[test]
fn workload_names_parse_back_and_unknown_ones_are_listed() {
    for kind in WorkloadKind::ALL {
        assert_eq!(kind.name().parse::<WorkloadKind>().ok(), Some(kind));
        assert_eq!(kind.to_string(), kind.name());
    }
    let err = "shared".parse::<WorkloadKind>().expect_err("unknown");
    assert!(
        err.to_string().contains("shared-prefix, multi-turn"),
        "{err}"
    );
}

#[test]
fn scale_never_gives_zero_and_describe_names_the_sizes() {
    let s = WorkloadSpec {
        scale: 0.0001,
        ..WorkloadSpec::default()
    };
    assert_eq!(s.scaled(6000), 1);
    let d = WorkloadSpec::default().describe();
    assert_eq!(d["name"], "shared-prefix");
    assert_eq!(d["sizes"]["prefix_tokens"], 6000);
    assert_eq!(d["sizes"]["question_tokens"], 1200);
}
