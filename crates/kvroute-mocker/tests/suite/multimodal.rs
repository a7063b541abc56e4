//! Images in chat requests: SGLang's wide pad ids and vLLM's mm extra keys on the wire.

use kvroute_core::event::KvEvent;
use kvroute_core::event::WorkerFlavor;
use kvroute_core::hash::{
    local_block_hash, local_block_hash_with_mm, mm_hash_from_identifier, HASH_SEED,
};
use kvroute_core::tokens::fold_token_id;
use kvroute_mocker::ReplayFrames;
use serde_json::json;
use sha2::{Digest, Sha256};

use super::common::*;
use super::msgpack::{self, V};

/// A tiny "image": bytes and their base64 data URL.
const IMAGE_BYTES: &[u8] = b"\x89PNG\r\n\x1a\nnot really an image";
const IMAGE_B64: &str = "iVBORw0KGgpub3QgcmVhbGx5IGFuIGltYWdl";

fn chat_with_image() -> serde_json::Value {
    json!({
        "messages": [{"role": "user", "content": [
            {"type": "text", "text": "What is in this picture? Describe it in detail please."},
            {"type": "image_url", "image_url": {"url": format!("data:image/png;base64,{IMAGE_B64}")}},
            {"type": "text", "text": "Answer in one sentence."},
        ]}],
        "max_tokens": 2,
    })
}

/// SGLang 0.5.23's four pad values, from the definition (vector S5's formula).
fn pad_values(item_hash: u64) -> [u64; 4] {
    let mut h = Sha256::new();
    h.update(b"sglang-mm-wide-pad-v1");
    h.update(item_hash.to_be_bytes());
    let d = h.finalize();
    std::array::from_fn(|k| {
        let word = u64::from_be_bytes(d[8 * k..8 * k + 8].try_into().expect("8 bytes"));
        1_000_000 + (word & ((1 << 62) - 1))
    })
}

fn image_hash() -> u64 {
    let d = Sha256::digest(IMAGE_BYTES);
    u64::from_be_bytes(d[..8].try_into().expect("8 bytes"))
}

/// Posts `body` as a chat to the fleet's first engine and returns its
/// answer once the engine published the request's batch: it answers before
/// it publishes, so a replay read right after the answer could be empty.
fn post_published(fleet: &TestFleet, body: &serde_json::Value) -> HttpResponse {
    let sub = subscribe(&fleet.events(0, 0));
    let answer = post(fleet.http(0), "/v1/chat/completions", body);
    assert!(
        !recv_n(&sub, 1).is_empty(),
        "the engine published no batch for the request"
    );
    answer
}

/// Raw `token_ids` of every BlockStored, as u64 (the decoder folds them; this does not).
fn raw_stored_tokens(payloads: &[(u64, Vec<u8>)]) -> Vec<Vec<u64>> {
    let mut out = Vec::new();
    for (_, p) in payloads {
        let batch = msgpack::decode(p);
        for e in batch.array()[1].array() {
            if e.get("type").map(V::str) == Some("BlockStored") {
                let tokens = e.get("token_ids").expect("token_ids").array();
                out.push(tokens.iter().map(V::bits).collect());
            }
        }
    }
    out
}

#[test]
fn sglang_image_pads_are_the_four_wide_values_cycled_and_decode_cleanly() {
    let mut c = config(WorkerFlavor::Sglang);
    c.mm_tokens_per_image = 24;
    let fleet = TestFleet::start(c);
    let r = post_published(&fleet, &chat_with_image());
    assert_eq!(r.status, 200, "{}", r.text());
    let payloads = replay(&fleet.replay(0, 0), 0, ReplayFrames::Four);
    let pads = pad_values(image_hash());
    assert!(pads.iter().all(|&p| p > u64::from(u32::MAX)));
    let tokens: Vec<u64> = raw_stored_tokens(&payloads).concat();
    let start = tokens
        .iter()
        .position(|&t| t == pads[0])
        .expect("pad ids in token_ids");
    let cycled: Vec<u64> = pads.iter().copied().cycle().take(24).collect();
    assert_eq!(tokens[start..start + 24], cycled[..]);
    assert_eq!(tokens[start - 1], 151_652, "vision start");
    assert_eq!(tokens[start + 24], 151_653, "vision end");

    // kvroute decodes it without a single skipped event; hashes are SGLang's wide-page
    // digests and the local hashes cover the folded pad ids.
    let events = all_events(&payloads, 16);
    let mut chain_tokens: Vec<u64> = Vec::new();
    let mut hashes = Vec::new();
    for e in &events {
        if let KvEvent::Stored(s) = e {
            hashes.extend(s.blocks.iter().map(|b| b.external.0));
            let folded = s.token_ids.as_ref().expect("kept");
            for (i, block) in s.blocks.iter().enumerate() {
                let expected = local_block_hash(&folded[i * 16..(i + 1) * 16], HASH_SEED);
                assert_eq!(block.local, expected);
            }
        }
    }
    chain_tokens.extend(&tokens);
    assert_eq!(
        hashes,
        engine_chain(WorkerFlavor::Sglang, &chain_tokens, 16)
    );
    assert!(tokens.iter().any(|&t| t > u64::from(u32::MAX)));
    let folded_pad = fold_token_id(pads[0]);
    assert!((1_000_000..1_000_000 + (1 << 30)).contains(&folded_pad));

    // The same image again is a prefix hit through the pads.
    let again = post(fleet.http(0), "/v1/chat/completions", &chat_with_image()).json();
    let prompt_tokens = again["usage"]["prompt_tokens"].as_u64().expect("count");
    assert_eq!(cached_tokens(&again), (prompt_tokens - 1) / 16 * 16);
}

#[test]
fn supplied_mm_hashes_choose_the_pads() {
    let fleet = TestFleet::start(config(WorkerFlavor::Sglang));
    let mut body = chat_with_image();
    body["mm_hashes"] = json!([15603577931234569631u64]);
    post_published(&fleet, &body);
    let payloads = replay(&fleet.replay(0, 0), 0, ReplayFrames::Four);
    let tokens = raw_stored_tokens(&payloads).concat();
    // Vector S5's values.
    assert!(tokens.contains(&4347295146520627095));
    assert!(tokens.contains(&1551477688476707388));
}

#[test]
fn vllm_images_are_placeholders_with_mm_extra_keys_per_block() {
    let mut c = config(WorkerFlavor::Vllm);
    c.mm_tokens_per_image = 30;
    // No tokenizer file: the engine's `root` is the model name, and it
    // names images as vLLM does, by their bytes and that root.
    assert!(c.tokenizer.is_none());
    let identifier = kvroute_core::multimodal::vllm_image_identifier(IMAGE_BYTES, &c.model);
    let fleet = TestFleet::start(c);
    let r = post_published(&fleet, &chat_with_image());
    assert_eq!(r.status, 200, "{}", r.text());
    let payloads = replay(&fleet.replay(0, 0), 0, ReplayFrames::Four);
    let batch = msgpack::decode(&payloads[0].1);
    let event = &batch.array()[1].array()[0];
    let tokens: Vec<u64> = event
        .get("token_ids")
        .expect("tokens")
        .array()
        .iter()
        .map(V::bits)
        .collect();
    let start = tokens
        .iter()
        .position(|&t| t == 151_655)
        .expect("placeholders");
    assert_eq!(tokens[start..start + 30], [151_655; 30]);
    let keys = event.get("extra_keys").expect("extra_keys").array();
    for (b, entry) in keys.iter().enumerate() {
        let (lo, hi) = (b * 16, b * 16 + 16);
        if start < hi && start + 30 > lo {
            let items = entry.array();
            assert_eq!(items.len(), 1);
            let pair = items[0].array();
            assert_eq!(pair[0].str(), identifier);
            assert_eq!(
                pair[1],
                if start >= lo {
                    V::U((start - lo) as u64)
                } else {
                    V::I(start as i64 - lo as i64)
                }
            );
        } else {
            assert_eq!(entry, &V::Nil);
        }
    }
    // The decoder folds the image into the local hash of every block it touches.
    let mm = mm_hash_from_identifier(&identifier);
    assert_eq!(
        Ok(mm),
        u64::from_str_radix(&identifier[..16], 16),
        "the item hash is the identifier's first 16 hex digits"
    );
    let decoded = decode_clean(&payloads[0].1, 16);
    let Some(KvEvent::Stored(s)) = decoded.decoded().next() else {
        panic!("a stored event first")
    };
    let folded = s.token_ids.as_ref().expect("kept");
    for (b, block) in s.blocks.iter().enumerate() {
        let touches = start < b * 16 + 16 && start + 30 > b * 16;
        let items: &[u64] = if touches { &[mm] } else { &[] };
        let expected = local_block_hash_with_mm(&folded[b * 16..b * 16 + 16], items, HASH_SEED);
        assert_eq!(block.local, expected, "block {b}");
    }
}
