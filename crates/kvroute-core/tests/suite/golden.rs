//! Every golden payload (real vLLM 0.33.0, vLLM 0.34.0, SGLang 0.5.23 and
//! TensorRT-LLM encoder output, plus one hand-built legacy layout) decodes exactly: engine
//! hashes, parents, tiers, ranks, folded token ids and local hashes; hybrid
//! models' window and state groups decode as group residency; the events
//! kvroute skips on purpose are skipped for the expected reason.

use super::common::{fixture_json, fixture_names, fixture_payload};
use kvroute_core::event::{KvEvent, Tier};
use kvroute_core::tokens::fold_token_id;
use kvroute_core::wire::{decode_batch, DecodedBatch, DecoderConfig};
use serde_json::Value;

/// Local hashes computed independently by `fixtures/expected_local_hashes.py`,
/// one list per stored event, in order.
const EXPECTED_LOCAL_HASHES: &[(&str, &[&[u64]])] = &[
    (
        "legacy_mirror_vllm_array_like",
        &[&[15310707395893867146, 15292316782987903195]],
    ),
    (
        "sglang_0.5.23_bigram_eagle",
        &[&[8334579873550901439, 11601446131838666152]],
    ),
    (
        "sglang_0.5.23_dynamo_format_lora_salt",
        &[&[9571468485520773554, 3825235224563861652]],
    ),
    (
        "sglang_0.5.23_lora_salt_cpu_removed_cleared",
        &[
            &[9571468485520773554, 3825235224563861652],
            &[11812180143836272434],
        ],
    ),
    (
        "sglang_0.5.23_text_chain",
        &[
            &[
                16589044740506546021,
                14354859250219920266,
                10593748692691194823,
            ],
            &[10428940892038784389, 9084101749306525243],
        ],
    ),
    (
        "sglang_0.5.23_wide_mm_pad",
        &[&[
            4365136014639328574,
            470738540398786090,
            7312985844804104185,
            3407184178956116715,
        ]],
    ),
    (
        "trtllm_multimodal_mm_keys",
        &[
            &[7337249070645057399, 897701560265631416, 5408140822639131940],
            &[4794251433642539899, 4817144209703348756],
        ],
    ),
    (
        "trtllm_text_chain",
        &[
            &[
                9512771973321669882,
                4747984322424188473,
                16312857304576808105,
            ],
            &[6682388363008858211, 6979197425233858025],
        ],
    ),
    ("vllm_0.33.0_dp_rank_nil", &[]),
    (
        "vllm_0.33.0_lookahead_cpu_removed_cleared",
        &[
            &[14355121167881186305, 10207206427186985925],
            &[996988181455801259],
        ],
    ),
    (
        "vllm_0.33.0_multimodal_lora_salt",
        &[
            &[
                13692193324830867749,
                3450744953057182751,
                954751336919509923,
            ],
            &[1833609482950383648, 3356614177344672700],
        ],
    ),
    (
        "vllm_0.34.0_hybrid_sliding_window",
        &[&[
            16118063208670566578,
            4584425714164444364,
            4994771818556395109,
        ]],
    ),
    (
        "vllm_0.34.0_multimodal_text_chain",
        &[
            &[
                5763260993811111971,
                7023124676231967400,
                12195761467454896547,
            ],
            &[596225445606306974],
        ],
    ),
    (
        "vllm_0.34.0_offload_storage_remote",
        &[
            &[16118063208670566578, 4584425714164444364],
            &[4994771818556395109, 596225445606306974],
        ],
    ),
    (
        "vllm_0.33.0_text_chain",
        &[
            &[
                17398317676424800983,
                10330492761939927175,
                16782401743060503540,
            ],
            &[71164928307586583, 2358154837447633959],
        ],
    ),
];

/// Events of engine samples that kvroute skips on purpose, by index, with
/// the reason: vLLM 0.34's offloading connector's placeholder.
const EXPECTED_SKIPS: &[(&str, &[(u32, &str)])] =
    &[("vllm_0.34.0_offload_storage_remote", &[(3, "placeholder")])];

/// The reason event `index` of fixture `name` is expected to be skipped for.
fn expected_skip(name: &str, index: u32) -> Option<&'static str> {
    EXPECTED_SKIPS
        .iter()
        .find(|(n, _)| *n == name)
        .and_then(|(_, skips)| skips.iter().find(|(i, _)| *i == index))
        .map(|&(_, reason)| reason)
}

fn decode_fixture(name: &str) -> DecodedBatch {
    let config = DecoderConfig {
        block_size: Some(16),
        registered_rank: 7,
        keep_tokens: true,
        ..Default::default()
    };
    decode_batch(&fixture_payload(name), &config).unwrap_or_else(|e| panic!("{name}: {e}"))
}

/// A JSON integer as the 64-bit pattern kvroute keeps (negative → two's complement).
fn bits(v: &Value) -> u64 {
    v.as_u64()
        .or_else(|| v.as_i64().map(|i| i as u64))
        .expect("integer")
}

fn field<'a>(event: &'a Value, name: &str, slot: usize) -> Option<&'a Value> {
    match event {
        Value::Object(map) => map.get(name),
        Value::Array(items) => items.get(slot),
        _ => None,
    }
    .filter(|v| !v.is_null())
}

fn expected_tier(event: &Value, removed: bool) -> Tier {
    if field(event, "locality", 12).and_then(Value::as_str) == Some("REMOTE") {
        return Tier::External;
    }
    match field(event, "medium", if removed { 2 } else { 6 }).and_then(Value::as_str) {
        None | Some("GPU") => Tier::Device,
        Some("CPU" | "CPU_PINNED") => Tier::Host,
        Some("STORAGE") => Tier::Disk,
        Some(other) => panic!("unexpected medium {other}"),
    }
}

/// The folded token ids a stored event's JSON view describes (bigram pairs
/// normalized; TensorRT-LLM's digest tokens and the ids after them written
/// as item-local positions above 1 000 000, with the offset `offset` learned
/// from a digest followed by two consecutive ids).
fn expected_tokens(event: &Value, offset: &mut Option<u64>) -> Vec<u32> {
    let tokens = field(event, "token_ids", 3)
        .and_then(Value::as_array)
        .expect("token_ids");
    let mut out: Vec<u32> = Vec::new();
    let trtllm = tokens.iter().any(Value::is_string);
    for (i, t) in tokens.iter().enumerate() {
        match t {
            Value::String(_) => {
                if let (Some(a), Some(b)) = (
                    tokens.get(i + 1).and_then(Value::as_u64),
                    tokens.get(i + 2).and_then(Value::as_u64),
                ) {
                    if b == a + 1 {
                        *offset = Some(a - 1);
                    }
                }
                out.push(1_000_000);
            }
            Value::Number(n) if trtllm && offset.is_some_and(|o| n.as_u64() > Some(o)) => {
                let o = offset.expect("offset");
                out.push(1_000_000 + (bits(t) - o) as u32);
            }
            Value::Array(pair) => {
                out.push(fold_token_id(bits(&pair[0])));
                if i + 1 == tokens.len() {
                    out.push(fold_token_id(bits(&pair[1])));
                }
            }
            other => out.push(fold_token_id(bits(other))),
        }
    }
    out
}

#[test]
fn every_fixture_has_expected_local_hashes() {
    let names = fixture_names();
    assert_eq!(names.len(), EXPECTED_LOCAL_HASHES.len());
    for name in names {
        assert!(
            EXPECTED_LOCAL_HASHES.iter().any(|(n, _)| *n == name),
            "{name} has no expectation"
        );
    }
}

#[test]
fn golden_payloads_decode_exactly() {
    for (name, expected_locals) in EXPECTED_LOCAL_HASHES {
        let batch = decode_fixture(name);
        let json = fixture_json(name);
        let json_events = json[1].as_array().expect("events");

        let expected_rank = json.get(2).and_then(Value::as_u64).map_or(7, |r| r as u32);
        assert_eq!(batch.dp_rank, expected_rank, "{name}: rank");
        assert_eq!(batch.ts, Some(1767225600.25), "{name}: ts");
        assert_eq!(batch.lost_events, 0, "{name}");
        assert_eq!(batch.events.len(), json_events.len(), "{name}: event count");

        let mut stored_seen = 0;
        let mut offset = None;
        for (decoded, source) in batch.events.iter().zip(json_events) {
            if let Some(reason) = expected_skip(name, decoded.index) {
                let skipped = decoded.outcome.as_ref().err();
                assert_eq!(
                    skipped.map(|s| s.reason.as_str()),
                    Some(reason),
                    "{name} event {}",
                    decoded.index
                );
                continue;
            }
            let event = decoded
                .outcome
                .as_ref()
                .unwrap_or_else(|s| panic!("{name} event {}: {s}", decoded.index));
            let ty = field(source, "type", 0)
                .and_then(Value::as_str)
                .expect("type");
            match (ty, event) {
                ("BlockStored", KvEvent::Stored(stored)) => {
                    let hashes: Vec<u64> = field(source, "block_hashes", 1)
                        .and_then(Value::as_array)
                        .expect("hashes")
                        .iter()
                        .map(bits)
                        .collect();
                    let externals: Vec<u64> = stored.blocks.iter().map(|b| b.external.0).collect();
                    assert_eq!(externals, hashes, "{name}: engine hashes");
                    assert_eq!(
                        stored.parent.map(|p| p.0),
                        field(source, "parent_block_hash", 2).map(bits),
                        "{name}"
                    );
                    assert_eq!(stored.tier, expected_tier(source, false), "{name}: tier");
                    assert_eq!(stored.dropped_blocks, 0, "{name}");
                    let locals: Vec<u64> = stored.blocks.iter().map(|b| b.local.0).collect();
                    assert_eq!(locals, expected_locals[stored_seen], "{name}: local hashes");
                    assert_eq!(
                        stored.token_ids.as_deref(),
                        Some(&expected_tokens(source, &mut offset)[..]),
                        "{name}: tokens"
                    );
                    assert_eq!(
                        stored.lora_name.as_deref(),
                        field(source, "lora_name", 7).and_then(Value::as_str),
                        "{name}: lora"
                    );
                    stored_seen += 1;
                }
                ("BlockRemoved", KvEvent::Removed(removed)) => {
                    let hashes: Vec<u64> = field(source, "block_hashes", 1)
                        .and_then(Value::as_array)
                        .expect("hashes")
                        .iter()
                        .map(bits)
                        .collect();
                    let got: Vec<u64> = removed.blocks.iter().map(|b| b.0).collect();
                    assert_eq!(got, hashes, "{name}: removed hashes");
                    assert_eq!(removed.tier, expected_tier(source, true), "{name}: tier");
                }
                ("AllBlocksCleared", KvEvent::Cleared) => {}
                (ty @ ("BlockStored" | "BlockRemoved"), KvEvent::Group(group)) => {
                    // A hybrid model's window or state group: kept by engine hash.
                    let hashes: Vec<u64> = field(source, "block_hashes", 1)
                        .and_then(Value::as_array)
                        .expect("hashes")
                        .iter()
                        .map(bits)
                        .collect();
                    let got: Vec<u64> = group.blocks.iter().map(|b| b.0).collect();
                    assert_eq!(got, hashes, "{name}: group hashes");
                    assert_eq!(group.stored, ty == "BlockStored", "{name}");
                    assert_ne!(
                        field(source, "group_idx", 9).and_then(Value::as_u64),
                        Some(0)
                    );
                }
                (ty, event) => panic!("{name}: {ty} decoded as {event:?}"),
            }
        }
        assert_eq!(stored_seen, expected_locals.len(), "{name}: stored events");
    }
}

#[test]
fn wide_pad_sample_keeps_every_text_block_and_folds_the_pads() {
    let batch = decode_fixture("sglang_0.5.23_wide_mm_pad");
    let Some(KvEvent::Stored(stored)) = batch.decoded().next() else {
        panic!("stored event")
    };
    assert_eq!(stored.blocks.len(), 4);
    let tokens = stored.token_ids.as_ref().expect("kept tokens");
    // Position 15 is the vision start id; 16.. are the four pads cycled, folded.
    assert_eq!(tokens[15], 151652);
    let folded: Vec<u32> = [
        4347295146520627095u64,
        3437777575314344313,
        653167716596367843,
        1551477688476707388,
    ]
    .iter()
    .map(|&p| 1_000_000 + (p & ((1 << 30) - 1)) as u32)
    .collect();
    assert_eq!(&tokens[16..20], &folded[..]);
    assert_eq!(&tokens[20..24], &folded[..]);
    assert_eq!(tokens[46], 151653);
}

#[test]
fn salted_and_lora_events_carry_their_namespace() {
    let batch = decode_fixture("sglang_0.5.23_lora_salt_cpu_removed_cleared");
    let Some(KvEvent::Stored(stored)) = batch.decoded().next() else {
        panic!("stored event")
    };
    assert_eq!(stored.lora_name.as_deref(), Some("sql-adapter"));
    assert_eq!(stored.cache_salt.as_deref(), Some("tenant-0"));

    // vLLM carries the salt inside extra_keys of the first block.
    let batch = decode_fixture("vllm_0.33.0_multimodal_lora_salt");
    let stored: Vec<_> = batch.decoded().collect();
    let KvEvent::Stored(second) = stored[1] else {
        panic!("stored event")
    };
    assert_eq!(second.lora_name.as_deref(), Some("sql-adapter"));
    assert_eq!(second.cache_salt.as_deref(), Some("tenant-0"));
    let KvEvent::Stored(first) = stored[0] else {
        panic!("stored event")
    };
    assert_eq!(first.cache_salt, None);
}

#[test]
fn bigram_and_lookahead_events_report_their_window() {
    let batch = decode_fixture("sglang_0.5.23_bigram_eagle");
    let Some(KvEvent::Stored(stored)) = batch.decoded().next() else {
        panic!("stored event")
    };
    assert_eq!(stored.lookahead, 1);
    assert_eq!(stored.token_ids.as_ref().map(Vec::len), Some(33));

    let batch = decode_fixture("vllm_0.33.0_lookahead_cpu_removed_cleared");
    let Some(KvEvent::Stored(stored)) = batch.decoded().next() else {
        panic!("stored event")
    };
    assert_eq!(stored.lookahead, 1);
}

#[test]
fn rank_nil_falls_back_to_the_registered_rank() {
    let batch = decode_fixture("vllm_0.33.0_dp_rank_nil");
    assert_eq!(batch.dp_rank, 7);
    assert_eq!(batch.events.len(), 1);
    assert_eq!(batch.events[0].outcome, Ok(KvEvent::Cleared));
}

#[test]
fn hybrid_groups_carry_their_rules() {
    use kvroute_core::event::GroupRule;
    let batch = decode_fixture("vllm_0.34.0_hybrid_sliding_window");
    let KvEvent::Group(window) = batch.events[1].outcome.as_ref().expect("group") else {
        panic!("{:?}", batch.events[1]);
    };
    // Window 32 at 16-token blocks: the 2 blocks before a prefix's end.
    assert_eq!(
        window.rule,
        GroupRule::Window {
            blocks: 2,
            stride: 1
        }
    );
    assert_eq!(
        (window.group, window.blocks.len(), window.stored),
        (1, 3, true)
    );
    let KvEvent::Group(evicted) = batch.events[2].outcome.as_ref().expect("group") else {
        panic!("{:?}", batch.events[2]);
    };
    // The removal names only its group: the rule learned from the store.
    assert_eq!((evicted.rule, evicted.stored), (window.rule, false));
    let batch = decode_fixture("vllm_0.34.0_offload_storage_remote");
    let KvEvent::Group(state) = batch.events[4].outcome.as_ref().expect("group") else {
        panic!("{:?}", batch.events[4]);
    };
    assert_eq!(
        (state.rule, state.group, state.tier),
        (GroupRule::State, 2, Tier::Host)
    );
}
