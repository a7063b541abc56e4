//! Event batches in msgpack, byte for byte as each engine's msgspec encoder writes them.
//!
//! Rules reproduced (checked against the engines' golden payloads in the tests):
//!
//! * batch: `[ts (float64), events, dp_rank]`, always three elements;
//! * events are tagged maps: `"type"` first, then the declared fields in
//!   declaration order; fields without a default are always written (nil when
//!   `None`), defaulted fields only when set;
//! * msgspec sizes a struct's map header by its *declared* field count: a
//!   struct with 16 or more possible entries (vLLM `BlockStored`) always gets a
//!   `map16` header, smaller ones a `fixmap`;
//! * integers in their shortest form; vLLM hashes unsigned (`uint64` when ≥ 2^63),
//!   SGLang hashes signed (`int64` when negative);
//! * `--event-format legacy-array`: the tagged arrays of vLLM ≤ 0.23 and
//!   SGLang ≤ 0.5.19, trailing defaults omitted as `array_like` does.
//!
//! vLLM `BlockStored` field order (0.33): `block_hashes`, `parent_block_hash`,
//! `token_ids`, `block_size`, `lora_id`, `medium`, `lora_name` (always), then
//! `extra_keys`, `group_idx`, `kv_cache_spec_kind`, … `session_id`, … when set.
//! SGLang (0.5.23): `block_hashes`, `parent_block_hash`, `token_ids`,
//! `block_size`, `lora_id` (always), then `medium`, `cache_salt`, `session_id`,
//! `lora_name` when set. TensorRT-LLM (`kv_cache_events.py`, commit 13599e9):
//! `block_hashes`, `parent_block_hash`, `token_ids` (an image's first position
//! as its hex digest), `block_size`, `lora_id`, `medium`, `lora_name`
//! (always), then `mm_keys` when set (maps tagged `"type": "mm_key"`);
//! hashes signed; `BlockRemoved` has `block_hashes` and `medium`. The legacy
//! array format has no TensorRT-LLM form: it writes vLLM's.

use kvroute_core::wire::write as mp;

use crate::config::EventFormat;
use crate::event::{BlockRemoved, BlockStored, ExtraKey, KvCacheEvent};
use kvroute_core::event::WorkerFlavor;

/// `s`, or `nil` when absent.
fn opt_str(w: &mut Vec<u8>, s: Option<&str>) {
    match s {
        Some(s) => mp::str(w, s),
        None => mp::nil(w),
    }
}

/// How batches are written: which engine and which event shape.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct EncodeOptions {
    /// The engine whose format to write.
    pub flavor: WorkerFlavor,
    /// Tagged maps (current) or tagged arrays (legacy).
    pub format: EventFormat,
}

/// Encodes one batch `[ts, events, dp_rank]`.
///
/// `bad_event_at` inserts one deliberately malformed `BlockStored` at that
/// index (fault injection, `--bad-event-every`): well-formed msgpack whose
/// `block_hashes` is a string and whose `token_ids` holds a negative id, so a
/// tolerant decoder skips it and keeps the events around it.
pub fn encode_batch(
    options: EncodeOptions,
    ts: f64,
    events: &[KvCacheEvent],
    dp_rank: Option<u32>,
    bad_event_at: Option<usize>,
) -> Vec<u8> {
    let mut out = Vec::new();
    let w = &mut out;
    mp::array(w, 3);
    mp::f64(w, ts);
    let bad_at = bad_event_at.map(|i| i.min(events.len()));
    mp::array(w, events.len() + usize::from(bad_at.is_some()));
    for (i, event) in events.iter().enumerate() {
        if bad_at == Some(i) {
            write_bad_event(w, options);
        }
        write_event(w, options, event);
    }
    if bad_at == Some(events.len()) {
        write_bad_event(w, options);
    }
    match dp_rank {
        Some(rank) => mp::uint(w, u64::from(rank)),
        None => mp::nil(w),
    }
    out
}

/// Encodes one event on its own (tests and debugging).
pub fn encode_event(options: EncodeOptions, event: &KvCacheEvent) -> Vec<u8> {
    let mut out = Vec::new();
    let w = &mut out;
    write_event(w, options, event);
    out
}

fn write_event(w: &mut Vec<u8>, o: EncodeOptions, event: &KvCacheEvent) {
    match (o.flavor, o.format, event) {
        (_, _, KvCacheEvent::AllBlocksCleared) => {
            if o.format == EventFormat::Map {
                mp::map(w, 1);
                mp::str(w, "type");
            } else {
                mp::array(w, 1);
            }
            mp::str(w, "AllBlocksCleared");
        }
        (WorkerFlavor::Vllm, EventFormat::Map, KvCacheEvent::BlockStored(e)) => vllm_stored(w, e),
        (WorkerFlavor::Vllm, EventFormat::Map, KvCacheEvent::BlockRemoved(e)) => vllm_removed(w, e),
        (WorkerFlavor::Sglang, EventFormat::Map, KvCacheEvent::BlockStored(e)) => {
            sglang_stored(w, e)
        }
        (WorkerFlavor::Sglang, EventFormat::Map, KvCacheEvent::BlockRemoved(e)) => {
            sglang_removed(w, e)
        }
        (WorkerFlavor::Trtllm, EventFormat::Map, KvCacheEvent::BlockStored(e)) => {
            trtllm_stored(w, e)
        }
        (WorkerFlavor::Trtllm, EventFormat::Map, KvCacheEvent::BlockRemoved(e)) => {
            trtllm_removed(w, e)
        }
        (flavor, EventFormat::LegacyArray, KvCacheEvent::BlockStored(e)) => {
            legacy_stored(w, flavor, e)
        }
        (flavor, EventFormat::LegacyArray, KvCacheEvent::BlockRemoved(e)) => {
            legacy_removed(w, flavor, e)
        }
    }
}

fn hashes(w: &mut Vec<u8>, flavor: WorkerFlavor, hashes: &[u64]) {
    mp::array(w, hashes.len());
    for &h in hashes {
        hash(w, flavor, h);
    }
}

fn hash(w: &mut Vec<u8>, flavor: WorkerFlavor, h: u64) {
    match flavor {
        WorkerFlavor::Vllm => mp::uint(w, h),
        // SGLang's and TensorRT-LLM's hashes are Python ints from a signed
        // 64-bit conversion.
        WorkerFlavor::Sglang | WorkerFlavor::Trtllm => mp::int(w, h as i64),
    }
}

fn parent(w: &mut Vec<u8>, flavor: WorkerFlavor, parent: Option<u64>) {
    match parent {
        Some(h) => hash(w, flavor, h),
        None => mp::nil(w),
    }
}

fn tokens(w: &mut Vec<u8>, ids: &[u64]) {
    mp::array(w, ids.len());
    for &t in ids {
        mp::uint(w, t);
    }
}

fn opt_int(w: &mut Vec<u8>, v: Option<i64>) {
    match v {
        Some(v) => mp::int(w, v),
        None => mp::nil(w),
    }
}

fn extra_keys(w: &mut Vec<u8>, keys: &[Option<Vec<ExtraKey>>]) {
    mp::array(w, keys.len());
    for entry in keys {
        match entry {
            None => mp::nil(w),
            Some(items) => {
                mp::array(w, items.len());
                for item in items {
                    match item {
                        ExtraKey::Str(s) => mp::str(w, s),
                        ExtraKey::Mm { identifier, offset } => {
                            mp::array(w, 2);
                            mp::str(w, identifier);
                            mp::int(w, *offset);
                        }
                    }
                }
            }
        }
    }
}

/// The KV-cache group the mocker's blocks belong to (vLLM): one full-attention group.
const VLLM_GROUP_IDX: u64 = 0;
/// `kv_cache_spec_kind` of that group.
const VLLM_SPEC_KIND: &str = "full_attention";

/// The fields both engines write first in a `BlockStored` map, in their order.
fn stored_head(w: &mut Vec<u8>, f: WorkerFlavor, e: &BlockStored) {
    mp::str(w, "type");
    mp::str(w, "BlockStored");
    mp::str(w, "block_hashes");
    hashes(w, f, &e.block_hashes);
    mp::str(w, "parent_block_hash");
    parent(w, f, e.parent_block_hash);
    mp::str(w, "token_ids");
    tokens(w, &e.token_ids);
    mp::str(w, "block_size");
    mp::uint(w, u64::from(e.block_size));
    mp::str(w, "lora_id");
    opt_int(w, e.lora_id);
}

fn vllm_stored(w: &mut Vec<u8>, e: &BlockStored) {
    let f = WorkerFlavor::Vllm;
    // type + 7 required + extra_keys, group_idx, kv_cache_spec_kind + session_id.
    let entries = 8 + usize::from(e.extra_keys.is_some()) + 2 + usize::from(e.session_id.is_some());
    mp::map16(w, entries as u16);
    stored_head(w, f, e);
    mp::str(w, "medium");
    opt_str(w, e.medium.as_deref());
    mp::str(w, "lora_name");
    opt_str(w, e.lora_name.as_deref());
    if let Some(keys) = &e.extra_keys {
        mp::str(w, "extra_keys");
        extra_keys(w, keys);
    }
    mp::str(w, "group_idx");
    mp::uint(w, VLLM_GROUP_IDX);
    mp::str(w, "kv_cache_spec_kind");
    mp::str(w, VLLM_SPEC_KIND);
    if let Some(session) = &e.session_id {
        mp::str(w, "session_id");
        mp::str(w, session);
    }
}

fn vllm_removed(w: &mut Vec<u8>, e: &BlockRemoved) {
    mp::map(w, 4);
    mp::str(w, "type");
    mp::str(w, "BlockRemoved");
    mp::str(w, "block_hashes");
    hashes(w, WorkerFlavor::Vllm, &e.block_hashes);
    mp::str(w, "medium");
    opt_str(w, e.medium.as_deref());
    mp::str(w, "group_idx");
    mp::uint(w, VLLM_GROUP_IDX);
}

fn sglang_stored(w: &mut Vec<u8>, e: &BlockStored) {
    let f = WorkerFlavor::Sglang;
    let optional = [
        e.medium.is_some(),
        e.cache_salt.is_some(),
        e.session_id.is_some(),
        e.lora_name.is_some(),
    ];
    mp::map(w, 6 + optional.iter().filter(|&&set| set).count());
    stored_head(w, f, e);
    for (key, value) in [
        ("medium", &e.medium),
        ("cache_salt", &e.cache_salt),
        ("session_id", &e.session_id),
        ("lora_name", &e.lora_name),
    ] {
        if let Some(value) = value {
            mp::str(w, key);
            mp::str(w, value);
        }
    }
}

fn sglang_removed(w: &mut Vec<u8>, e: &BlockRemoved) {
    mp::map(w, 2 + usize::from(e.medium.is_some()));
    mp::str(w, "type");
    mp::str(w, "BlockRemoved");
    mp::str(w, "block_hashes");
    hashes(w, WorkerFlavor::Sglang, &e.block_hashes);
    if let Some(medium) = &e.medium {
        mp::str(w, "medium");
        mp::str(w, medium);
    }
}

fn trtllm_stored(w: &mut Vec<u8>, e: &BlockStored) {
    let f = WorkerFlavor::Trtllm;
    let images = e.trtllm_images.as_deref();
    mp::map(w, 8 + usize::from(images.is_some()));
    mp::str(w, "type");
    mp::str(w, "BlockStored");
    mp::str(w, "block_hashes");
    hashes(w, f, &e.block_hashes);
    mp::str(w, "parent_block_hash");
    parent(w, f, e.parent_block_hash);
    mp::str(w, "token_ids");
    mp::array(w, e.token_ids.len());
    for (i, &t) in e.token_ids.iter().enumerate() {
        let digest = images.and_then(|im| im.digest_tokens.iter().find(|(at, _)| *at == i));
        match digest {
            Some((_, digest)) => mp::str(w, digest),
            None => mp::uint(w, t),
        }
    }
    mp::str(w, "block_size");
    mp::uint(w, u64::from(e.block_size));
    mp::str(w, "lora_id");
    opt_int(w, e.lora_id);
    mp::str(w, "medium");
    opt_str(w, e.medium.as_deref());
    mp::str(w, "lora_name");
    opt_str(w, e.lora_name.as_deref());
    if let Some(images) = images {
        mp::str(w, "mm_keys");
        mp::array(w, images.mm_keys.len());
        for block in &images.mm_keys {
            mp::array(w, block.len());
            for key in block {
                mp::map(w, 3 + usize::from(key.uuid.is_some()));
                mp::str(w, "type");
                mp::str(w, "mm_key");
                mp::str(w, "hash");
                mp::str(w, &key.hash);
                mp::str(w, "start_offset");
                mp::uint(w, key.start_offset);
                if let Some(uuid) = &key.uuid {
                    mp::str(w, "uuid");
                    mp::str(w, uuid);
                }
            }
        }
    }
}

fn trtllm_removed(w: &mut Vec<u8>, e: &BlockRemoved) {
    mp::map(w, 3);
    mp::str(w, "type");
    mp::str(w, "BlockRemoved");
    mp::str(w, "block_hashes");
    hashes(w, WorkerFlavor::Trtllm, &e.block_hashes);
    mp::str(w, "medium");
    opt_str(w, e.medium.as_deref());
}

/// vLLM ≤ 0.23: `["BlockStored", hashes, parent, tokens, block_size, lora_id,
/// medium, lora_name, extra_keys, group_idx, kv_cache_spec_kind]` (trailing
/// `None` fields omitted). SGLang 0.5.18–0.5.19: `["BlockStored", hashes,
/// parent, tokens, block_size, lora_id, medium]`.
fn legacy_stored(w: &mut Vec<u8>, flavor: WorkerFlavor, e: &BlockStored) {
    let flavor = legacy_flavor(flavor);
    match flavor {
        WorkerFlavor::Sglang => mp::array(w, 7),
        _ => mp::array(w, 11),
    }
    mp::str(w, "BlockStored");
    hashes(w, flavor, &e.block_hashes);
    parent(w, flavor, e.parent_block_hash);
    tokens(w, &e.token_ids);
    mp::uint(w, u64::from(e.block_size));
    opt_int(w, e.lora_id);
    opt_str(w, e.medium.as_deref());
    if flavor == WorkerFlavor::Vllm {
        opt_str(w, e.lora_name.as_deref());
        match &e.extra_keys {
            Some(keys) => extra_keys(w, keys),
            None => mp::nil(w),
        }
        mp::uint(w, VLLM_GROUP_IDX);
        mp::str(w, VLLM_SPEC_KIND);
    }
}

/// vLLM ≤ 0.23: `["BlockRemoved", hashes, medium, group_idx]`;
/// SGLang ≤ 0.5.19: `["BlockRemoved", hashes, medium]`.
fn legacy_removed(w: &mut Vec<u8>, flavor: WorkerFlavor, e: &BlockRemoved) {
    let flavor = legacy_flavor(flavor);
    match flavor {
        WorkerFlavor::Sglang => mp::array(w, 3),
        _ => mp::array(w, 4),
    }
    mp::str(w, "BlockRemoved");
    hashes(w, flavor, &e.block_hashes);
    opt_str(w, e.medium.as_deref());
    if flavor == WorkerFlavor::Vllm {
        mp::uint(w, VLLM_GROUP_IDX);
    }
}

/// The engine whose legacy arrays a flavour writes: TensorRT-LLM never wrote
/// arrays, so its legacy form is vLLM's.
fn legacy_flavor(flavor: WorkerFlavor) -> WorkerFlavor {
    match flavor {
        WorkerFlavor::Trtllm => WorkerFlavor::Vllm,
        other => other,
    }
}

/// The injected malformed event: valid msgpack, invalid as an event.
fn write_bad_event(w: &mut Vec<u8>, o: EncodeOptions) {
    if o.format == EventFormat::Map {
        mp::map(w, 5);
        mp::str(w, "type");
        mp::str(w, "BlockStored");
        mp::str(w, "block_hashes");
        mp::str(w, "corrupt");
        mp::str(w, "parent_block_hash");
        mp::nil(w);
        mp::str(w, "token_ids");
        mp::array(w, 1);
        mp::int(w, -1);
        mp::str(w, "block_size");
        mp::str(w, "sixteen");
    } else {
        mp::array(w, 5);
        mp::str(w, "BlockStored");
        mp::str(w, "corrupt");
        mp::nil(w);
        mp::array(w, 1);
        mp::int(w, -1);
        mp::str(w, "sixteen");
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::event::MEDIUM_GPU;

    fn hex(bytes: &[u8]) -> String {
        crate::hashing::hex(bytes)
    }

    const VLLM_MAP: EncodeOptions = EncodeOptions {
        flavor: WorkerFlavor::Vllm,
        format: EventFormat::Map,
    };

    #[test]
    fn vllm_byte_examples_from_the_reference() {
        let cleared = encode_event(VLLM_MAP, &KvCacheEvent::AllBlocksCleared);
        assert_eq!(
            hex(&cleared),
            "81a474797065b0416c6c426c6f636b73436c6561726564"
        );
        let removed = encode_event(
            VLLM_MAP,
            &KvCacheEvent::BlockRemoved(BlockRemoved {
                block_hashes: vec![u64::MAX],
                medium: Some(MEDIUM_GPU.into()),
            }),
        );
        assert_eq!(
            hex(&removed),
            "84a474797065ac426c6f636b52656d6f766564ac626c6f636b5f68617368657391\
             cfffffffffffffffffa66d656469756da3475055a967726f75705f69647800"
        );
        let batch = encode_batch(VLLM_MAP, 1.5, &[], Some(3), None);
        assert_eq!(hex(&batch), "93cb3ff80000000000009003");
    }

    #[test]
    fn bad_event_sits_between_good_ones() {
        let events = vec![
            KvCacheEvent::AllBlocksCleared,
            KvCacheEvent::AllBlocksCleared,
        ];
        let batch = encode_batch(VLLM_MAP, 0.0, &events, Some(0), Some(1));
        // [ts, [cleared, bad, cleared], 0]
        assert_eq!(batch[10], 0x93);
    }
}
