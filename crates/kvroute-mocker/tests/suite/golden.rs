//! Mocker payloads decode through kvroute's own decoder with the engines' hashes
//! (recomputed here from their definitions) and kvroute's local hashes.

use kvroute_core::event::KvEvent;
use kvroute_core::event::WorkerFlavor;
use kvroute_core::hash::{local_block_hashes, HASH_SEED};
use kvroute_core::tokens::fold_token_id;
use kvroute_mocker::encode::EncodeOptions;
use kvroute_mocker::engine::timing::TimingModel;
use kvroute_mocker::engine::{Engine, EngineConfig, NewRequest, RequestId};
use kvroute_mocker::faults::FaultConfig;
use kvroute_mocker::publisher::Sequencer;
use kvroute_mocker::{EventFormat, ReplayFrames};

use super::common::*;

const BS: usize = 16;

/// Runs requests through a pure engine and publishes every step as a batch.
fn run_engine(flavor: WorkerFlavor, format: EventFormat, requests: &[NewRequest]) -> Vec<Vec<u8>> {
    let mut engine = Engine::new(EngineConfig {
        flavor,
        block_size: BS,
        num_gpu_blocks: 64,
        max_num_seqs: 4,
        max_num_batched_tokens: 48,
        timing: TimingModel::default(),
    });
    let mut seq = Sequencer::new(
        EncodeOptions { flavor, format },
        0,
        FaultConfig::default(),
        100,
    );
    for (i, r) in requests.iter().enumerate() {
        engine
            .submit(RequestId(i as u64), r.clone())
            .expect("valid");
    }
    let mut payloads = Vec::new();
    while let Some(step) = engine.step() {
        if !step.events.is_empty() {
            payloads.push(seq.publish(TS0, &step.events).payload.to_vec());
        }
    }
    payloads
}

fn requests() -> Vec<NewRequest> {
    // Two prompts sharing 32 tokens, outputs long enough to fill generated blocks.
    let shared: Vec<u64> = (1000..1032).collect();
    let a: Vec<u64> = shared.iter().copied().chain(5000..5020).collect();
    let b: Vec<u64> = shared.iter().copied().chain(7000..7030).collect();
    vec![
        NewRequest {
            prompt: a,
            output: (90_000..90_021).collect(),
            mm_items: Vec::new(),
            lora_name: None,
        },
        NewRequest {
            prompt: b,
            output: (91_000..91_003).collect(),
            mm_items: Vec::new(),
            lora_name: None,
        },
    ]
}

/// Checks every stored event: engine hashes chain from the definitions, local hashes match.
fn check_golden(flavor: WorkerFlavor, format: EventFormat) {
    let reqs = requests();
    let payloads = run_engine(flavor, format, &reqs);
    assert!(!payloads.is_empty());
    let full: Vec<Vec<u64>> = reqs
        .iter()
        .map(|r| r.prompt.iter().chain(&r.output).copied().collect())
        .collect();
    let chains: Vec<Vec<u64>> = full.iter().map(|t| engine_chain(flavor, t, BS)).collect();
    let mut stored_blocks = 0;
    for payload in &payloads {
        let batch = decode_clean(payload, BS as u32);
        for event in batch.decoded() {
            let KvEvent::Stored(s) = event else { continue };
            let tokens = s.token_ids.as_ref().expect("tokens kept");
            // Which request's chain is this? The one containing the first hash.
            let first = s.blocks[0].external.0;
            let (r, start) = chains
                .iter()
                .enumerate()
                .find_map(|(r, c)| c.iter().position(|&h| h == first).map(|p| (r, p)))
                .unwrap_or_else(|| panic!("hash {first} is no block of any request"));
            let expected_parent = start.checked_sub(1).map(|p| chains[r][p]);
            assert_eq!(s.parent.map(|p| p.0), expected_parent);
            for (i, block) in s.blocks.iter().enumerate() {
                assert_eq!(block.external.0, chains[r][start + i], "engine hash");
            }
            let expected_tokens: Vec<u32> = full[r][start * BS..(start + s.blocks.len()) * BS]
                .iter()
                .map(|&t| fold_token_id(t))
                .collect();
            assert_eq!(tokens, &expected_tokens);
            let locals = local_block_hashes(tokens, BS, HASH_SEED, 0);
            let got: Vec<u64> = s.blocks.iter().map(|b| b.local.0).collect();
            assert_eq!(
                got,
                locals.iter().map(|h| h.0).collect::<Vec<_>>(),
                "local hash"
            );
            stored_blocks += s.blocks.len();
        }
    }
    // Request a: 52 prompt + 20 computed outputs = 72 → 4 blocks; request b: 62 + 2 = 64 → 4
    // blocks, the first 2 shared with a (stored once).
    assert_eq!(stored_blocks, 4 + 2);
}

#[test]
fn vllm_payloads_decode_with_sha256_cbor_hashes_and_local_hashes() {
    check_golden(WorkerFlavor::Vllm, EventFormat::Map);
}

#[test]
fn sglang_payloads_decode_with_page_digest_hashes_and_local_hashes() {
    check_golden(WorkerFlavor::Sglang, EventFormat::Map);
}

#[test]
fn legacy_array_payloads_decode_the_same_for_both_flavours() {
    check_golden(WorkerFlavor::Vllm, EventFormat::LegacyArray);
    check_golden(WorkerFlavor::Sglang, EventFormat::LegacyArray);
}

#[test]
fn vllm_event_fields_appear_as_vllm_writes_them() {
    let payloads = run_engine(WorkerFlavor::Vllm, EventFormat::Map, &requests()[..1]);
    let batch = super::msgpack::decode(&payloads[0]);
    let batch = batch.array();
    assert_eq!(batch.len(), 3, "[ts, events, dp_rank]");
    let event = &batch[1].array()[0];
    assert_eq!(
        event.keys(),
        [
            "type",
            "block_hashes",
            "parent_block_hash",
            "token_ids",
            "block_size",
            "lora_id",
            "medium",
            "lora_name",
            "extra_keys",
            "group_idx",
            "kv_cache_spec_kind"
        ]
    );
    assert_eq!(
        payloads[0][11..14],
        [0xde, 0x00, 0x0b],
        "map16 header, as msgspec writes it"
    );
    assert_eq!(event.get("medium").map(|m| m.str()), Some("GPU"));
    assert_eq!(
        event.get("kv_cache_spec_kind").map(|m| m.str()),
        Some("full_attention")
    );
}

#[test]
fn sglang_event_fields_appear_as_sglang_writes_them() {
    let payloads = run_engine(WorkerFlavor::Sglang, EventFormat::Map, &requests()[..1]);
    let batch = super::msgpack::decode(&payloads[0]);
    let event = &batch.array()[1].array()[0];
    assert_eq!(
        event.keys(),
        [
            "type",
            "block_hashes",
            "parent_block_hash",
            "token_ids",
            "block_size",
            "lora_id",
            "medium"
        ]
    );
}

#[test]
fn events_over_http_and_zmq_carry_engine_and_local_hashes() {
    let fleet = TestFleet::start(config(WorkerFlavor::Vllm));
    let addr = fleet.http(0);
    let prompt: Vec<u64> = (300..340).collect();
    let r = post(addr, "/v1/completions", &ids_prompt(&prompt, 30));
    assert_eq!(r.status, 200, "{}", r.text());
    let payloads = replay(&fleet.replay(0, 0), 0, ReplayFrames::Four);
    let events = all_events(&payloads, BS as u32);
    let mut chain: Vec<u64> = Vec::new();
    let mut tokens: Vec<u32> = Vec::new();
    for e in &events {
        let KvEvent::Stored(s) = e else {
            panic!("only stores expected, got {e:?}")
        };
        assert_eq!(s.parent.map(|p| p.0), chain.last().copied());
        chain.extend(s.blocks.iter().map(|b| b.external.0));
        tokens.extend(s.token_ids.as_ref().expect("kept"));
    }
    // 40 prompt + 29 computed generated tokens = 69 → 4 full blocks.
    assert_eq!(chain.len(), 4);
    assert_eq!(
        tokens[..40],
        prompt.iter().map(|&t| t as u32).collect::<Vec<_>>()[..]
    );
    let wide: Vec<u64> = tokens.iter().map(|&t| u64::from(t)).collect();
    assert_eq!(chain, engine_chain(WorkerFlavor::Vllm, &wide, BS));
}
