//! The encoder reproduces real engine payloads byte for byte.
//!
//! Each golden sample (encoded by vLLM 0.33.0's, SGLang 0.5.23's or
//! TensorRT-LLM's own msgspec classes) is read back from its JSON view into the mocker's event model and
//! re-encoded; the bytes must equal the engine's. Samples with fields the
//! mocker never produces (lookahead tokens, locality, bigram pairs) are skipped.

use std::path::PathBuf;

use kvroute_core::event::WorkerFlavor;
use kvroute_mocker::encode::{encode_batch, EncodeOptions};
use kvroute_mocker::event::{
    BlockRemoved, BlockStored, ExtraKey, KvCacheEvent, MmKey, TrtllmImages,
};
use kvroute_mocker::EventFormat;
use serde_json::Value;

fn fixture(name: &str) -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("../kvroute-core/tests/fixtures")
        .join(name)
}

fn read_hex(name: &str) -> Vec<u8> {
    let text = std::fs::read_to_string(fixture(&format!("{name}.hex"))).expect("fixture");
    let line = text.lines().nth(1).expect("payload line");
    (0..line.len())
        .step_by(2)
        .map(|i| u8::from_str_radix(&line[i..i + 2], 16).expect("hex"))
        .collect()
}

fn read_json(name: &str) -> Value {
    let text = std::fs::read_to_string(fixture(&format!("{name}.json"))).expect("fixture");
    serde_json::from_str(&text).expect("json")
}

fn bits(v: &Value) -> u64 {
    v.as_u64()
        .or_else(|| v.as_i64().map(|i| i as u64))
        .unwrap_or_else(|| panic!("not an integer: {v}"))
}

fn opt_string(e: &Value, key: &str) -> Option<String> {
    e.get(key).and_then(Value::as_str).map(str::to_owned)
}

/// TensorRT-LLM's image keys of a stored event `e`: its `mm_keys` per block
/// and the digest tokens standing where its image's token ids are.
fn trtllm_images(e: &Value, keys: &Value) -> Box<TrtllmImages> {
    let digest_tokens = e["token_ids"]
        .as_array()
        .expect("tokens")
        .iter()
        .enumerate()
        .filter_map(|(i, t)| t.as_str().map(|d| (i, d.to_owned())))
        .collect();
    let mm_keys = keys
        .as_array()
        .expect("mm_keys")
        .iter()
        .map(|block| {
            block
                .as_array()
                .expect("block keys")
                .iter()
                .map(|k| MmKey {
                    hash: k["hash"].as_str().expect("hash").to_owned(),
                    start_offset: k["start_offset"].as_u64().expect("offset"),
                    uuid: k.get("uuid").and_then(Value::as_str).map(str::to_owned),
                })
                .collect()
        })
        .collect();
    Box::new(TrtllmImages {
        mm_keys,
        digest_tokens,
    })
}

/// vLLM's `extra_keys` of a stored event: per block, nothing or a list of
/// salts and `[identifier, offset]` image keys.
fn extra_keys(keys: &Value) -> Vec<Option<Vec<ExtraKey>>> {
    keys.as_array()
        .expect("extra_keys")
        .iter()
        .map(|entry| {
            entry.as_array().map(|items| {
                items
                    .iter()
                    .map(|item| match item {
                        Value::String(s) => ExtraKey::Str(s.clone()),
                        Value::Array(pair) => ExtraKey::Mm {
                            identifier: pair[0].as_str().expect("id").to_owned(),
                            offset: pair[1].as_i64().expect("offset"),
                        },
                        other => panic!("unsupported extra key {other}"),
                    })
                    .collect()
            })
        })
        .collect()
}

fn event_from_json(e: &Value) -> KvCacheEvent {
    let known = [
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
        "kv_cache_spec_kind",
        "cache_salt",
        "session_id",
        "mm_keys",
    ];
    for key in e.as_object().expect("event object").keys() {
        assert!(known.contains(&key.as_str()), "unsupported field {key}");
    }
    let hashes = |e: &Value| -> Vec<u64> {
        e["block_hashes"]
            .as_array()
            .expect("hashes")
            .iter()
            .map(bits)
            .collect()
    };
    match e["type"].as_str().expect("type") {
        "BlockStored" => KvCacheEvent::BlockStored(BlockStored {
            block_hashes: hashes(e),
            parent_block_hash: e
                .get("parent_block_hash")
                .filter(|v| !v.is_null())
                .map(bits),
            token_ids: e["token_ids"]
                .as_array()
                .expect("tokens")
                .iter()
                .map(|t| if t.is_string() { 0 } else { bits(t) })
                .collect(),
            trtllm_images: e
                .get("mm_keys")
                .filter(|v| !v.is_null())
                .map(|keys| trtllm_images(e, keys)),
            block_size: e["block_size"].as_u64().expect("block size") as u32,
            lora_id: e.get("lora_id").and_then(Value::as_i64),
            medium: opt_string(e, "medium"),
            lora_name: opt_string(e, "lora_name"),
            extra_keys: e.get("extra_keys").filter(|v| !v.is_null()).map(extra_keys),
            cache_salt: opt_string(e, "cache_salt"),
            session_id: opt_string(e, "session_id"),
        }),
        "BlockRemoved" => KvCacheEvent::BlockRemoved(BlockRemoved {
            block_hashes: hashes(e),
            medium: opt_string(e, "medium"),
        }),
        "AllBlocksCleared" => KvCacheEvent::AllBlocksCleared,
        other => panic!("unknown type {other}"),
    }
}

fn reencode(name: &str, flavor: WorkerFlavor) {
    let json = read_json(name);
    let events: Vec<KvCacheEvent> = json[1]
        .as_array()
        .expect("events")
        .iter()
        .map(event_from_json)
        .collect();
    let rank = json[2].as_u64().map(|r| r as u32);
    let ts = json[0].as_f64().expect("ts");
    let options = EncodeOptions {
        flavor,
        format: EventFormat::Map,
    };
    let ours = encode_batch(options, ts, &events, rank, None);
    let theirs = read_hex(name);
    assert_eq!(
        kvroute_mocker::hashing::hex(&ours),
        kvroute_mocker::hashing::hex(&theirs),
        "{name}: bytes differ"
    );
}

#[test]
fn vllm_text_chain_is_reproduced_byte_for_byte() {
    reencode("vllm_0.33.0_text_chain", WorkerFlavor::Vllm);
}

#[test]
fn vllm_multimodal_lora_salt_is_reproduced_byte_for_byte() {
    reencode("vllm_0.33.0_multimodal_lora_salt", WorkerFlavor::Vllm);
}

#[test]
fn vllm_rank_nil_batch_is_reproduced_byte_for_byte() {
    reencode("vllm_0.33.0_dp_rank_nil", WorkerFlavor::Vllm);
}

#[test]
fn sglang_text_chain_is_reproduced_byte_for_byte() {
    reencode("sglang_0.5.23_text_chain", WorkerFlavor::Sglang);
}

#[test]
fn sglang_wide_pads_are_reproduced_byte_for_byte() {
    reencode("sglang_0.5.23_wide_mm_pad", WorkerFlavor::Sglang);
}

#[test]
fn sglang_salt_cpu_removal_and_clear_are_reproduced_byte_for_byte() {
    reencode(
        "sglang_0.5.23_lora_salt_cpu_removed_cleared",
        WorkerFlavor::Sglang,
    );
    reencode(
        "sglang_0.5.23_dynamo_format_lora_salt",
        WorkerFlavor::Sglang,
    );
}

#[test]
fn trtllm_text_and_images_are_reproduced_byte_for_byte() {
    reencode("trtllm_text_chain", WorkerFlavor::Trtllm);
    reencode("trtllm_multimodal_mm_keys", WorkerFlavor::Trtllm);
}
