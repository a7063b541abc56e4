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
//! `lora_name` when set.

use crate::config::{EngineFlavor, EventFormat};
use crate::event::{BlockRemoved, BlockStored, ExtraKey, KvCacheEvent};

/// A msgpack writer that always picks the shortest encoding, as msgspec does.
#[derive(Debug, Default)]
pub struct MsgpackWriter {
    buf: Vec<u8>,
}

impl MsgpackWriter {
    /// An empty writer.
    pub fn new() -> Self {
        Self::default()
    }

    /// The bytes written so far.
    pub fn into_bytes(self) -> Vec<u8> {
        self.buf
    }

    /// `nil`.
    pub fn nil(&mut self) {
        self.buf.push(0xc0);
    }

    /// A non-negative integer.
    pub fn uint(&mut self, v: u64) {
        match v {
            0..=0x7f => self.buf.push(v as u8),
            0x80..=0xff => self.buf.extend_from_slice(&[0xcc, v as u8]),
            0x100..=0xffff => {
                self.buf.push(0xcd);
                self.buf.extend_from_slice(&(v as u16).to_be_bytes());
            }
            0x1_0000..=0xffff_ffff => {
                self.buf.push(0xce);
                self.buf.extend_from_slice(&(v as u32).to_be_bytes());
            }
            _ => {
                self.buf.push(0xcf);
                self.buf.extend_from_slice(&v.to_be_bytes());
            }
        }
    }

    /// A signed integer: non-negative values as unsigned, negative ones in the shortest signed form.
    pub fn int(&mut self, v: i64) {
        if v >= 0 {
            self.uint(v as u64);
        } else if v >= -32 {
            self.buf.push(v as i8 as u8);
        } else if v >= i64::from(i8::MIN) {
            self.buf.extend_from_slice(&[0xd0, v as i8 as u8]);
        } else if v >= i64::from(i16::MIN) {
            self.buf.push(0xd1);
            self.buf.extend_from_slice(&(v as i16).to_be_bytes());
        } else if v >= i64::from(i32::MIN) {
            self.buf.push(0xd2);
            self.buf.extend_from_slice(&(v as i32).to_be_bytes());
        } else {
            self.buf.push(0xd3);
            self.buf.extend_from_slice(&v.to_be_bytes());
        }
    }

    /// A `float64` (msgspec always writes Python floats as 64-bit).
    pub fn f64(&mut self, v: f64) {
        self.buf.push(0xcb);
        self.buf.extend_from_slice(&v.to_be_bytes());
    }

    /// A UTF-8 string.
    pub fn str(&mut self, s: &str) {
        let n = s.len();
        match n {
            0..=31 => self.buf.push(0xa0 | n as u8),
            32..=0xff => self.buf.extend_from_slice(&[0xd9, n as u8]),
            0x100..=0xffff => {
                self.buf.push(0xda);
                self.buf.extend_from_slice(&(n as u16).to_be_bytes());
            }
            _ => {
                self.buf.push(0xdb);
                self.buf.extend_from_slice(&(n as u32).to_be_bytes());
            }
        }
        self.buf.extend_from_slice(s.as_bytes());
    }

    /// An array header for `n` elements.
    pub fn array(&mut self, n: usize) {
        match n {
            0..=15 => self.buf.push(0x90 | n as u8),
            16..=0xffff => {
                self.buf.push(0xdc);
                self.buf.extend_from_slice(&(n as u16).to_be_bytes());
            }
            _ => {
                self.buf.push(0xdd);
                self.buf.extend_from_slice(&(n as u32).to_be_bytes());
            }
        }
    }

    /// A map header for `n` entries, shortest form.
    pub fn map(&mut self, n: usize) {
        if n <= 15 {
            self.buf.push(0x80 | n as u8);
        } else {
            self.map16(n);
        }
    }

    /// A `map16` header even for few entries (msgspec's header for large structs).
    pub fn map16(&mut self, n: usize) {
        self.buf.push(0xde);
        self.buf.extend_from_slice(&(n as u16).to_be_bytes());
    }

    fn opt_str(&mut self, s: Option<&str>) {
        match s {
            Some(s) => self.str(s),
            None => self.nil(),
        }
    }
}

/// How batches are written: which engine and which event shape.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct EncodeOptions {
    /// The engine whose format to write.
    pub flavor: EngineFlavor,
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
    let mut w = MsgpackWriter::new();
    w.array(3);
    w.f64(ts);
    let bad_at = bad_event_at.map(|i| i.min(events.len()));
    w.array(events.len() + usize::from(bad_at.is_some()));
    for (i, event) in events.iter().enumerate() {
        if bad_at == Some(i) {
            write_bad_event(&mut w, options);
        }
        write_event(&mut w, options, event);
    }
    if bad_at == Some(events.len()) {
        write_bad_event(&mut w, options);
    }
    match dp_rank {
        Some(rank) => w.uint(u64::from(rank)),
        None => w.nil(),
    }
    w.into_bytes()
}

/// Encodes one event on its own (tests and debugging).
pub fn encode_event(options: EncodeOptions, event: &KvCacheEvent) -> Vec<u8> {
    let mut w = MsgpackWriter::new();
    write_event(&mut w, options, event);
    w.into_bytes()
}

fn write_event(w: &mut MsgpackWriter, o: EncodeOptions, event: &KvCacheEvent) {
    match (o.flavor, o.format, event) {
        (_, _, KvCacheEvent::AllBlocksCleared) => {
            if o.format == EventFormat::Map {
                w.map(1);
                w.str("type");
            } else {
                w.array(1);
            }
            w.str("AllBlocksCleared");
        }
        (EngineFlavor::Vllm, EventFormat::Map, KvCacheEvent::BlockStored(e)) => vllm_stored(w, e),
        (EngineFlavor::Vllm, EventFormat::Map, KvCacheEvent::BlockRemoved(e)) => vllm_removed(w, e),
        (EngineFlavor::Sglang, EventFormat::Map, KvCacheEvent::BlockStored(e)) => {
            sglang_stored(w, e)
        }
        (EngineFlavor::Sglang, EventFormat::Map, KvCacheEvent::BlockRemoved(e)) => {
            sglang_removed(w, e)
        }
        (flavor, EventFormat::LegacyArray, KvCacheEvent::BlockStored(e)) => {
            legacy_stored(w, flavor, e)
        }
        (flavor, EventFormat::LegacyArray, KvCacheEvent::BlockRemoved(e)) => {
            legacy_removed(w, flavor, e)
        }
    }
}

fn hashes(w: &mut MsgpackWriter, flavor: EngineFlavor, hashes: &[u64]) {
    w.array(hashes.len());
    for &h in hashes {
        hash(w, flavor, h);
    }
}

fn hash(w: &mut MsgpackWriter, flavor: EngineFlavor, h: u64) {
    match flavor {
        EngineFlavor::Vllm => w.uint(h),
        // SGLang's hashes are Python ints from a signed 64-bit conversion.
        EngineFlavor::Sglang => w.int(h as i64),
    }
}

fn parent(w: &mut MsgpackWriter, flavor: EngineFlavor, parent: Option<u64>) {
    match parent {
        Some(h) => hash(w, flavor, h),
        None => w.nil(),
    }
}

fn tokens(w: &mut MsgpackWriter, ids: &[u64]) {
    w.array(ids.len());
    for &t in ids {
        w.uint(t);
    }
}

fn opt_int(w: &mut MsgpackWriter, v: Option<i64>) {
    match v {
        Some(v) => w.int(v),
        None => w.nil(),
    }
}

fn extra_keys(w: &mut MsgpackWriter, keys: &[Option<Vec<ExtraKey>>]) {
    w.array(keys.len());
    for entry in keys {
        match entry {
            None => w.nil(),
            Some(items) => {
                w.array(items.len());
                for item in items {
                    match item {
                        ExtraKey::Str(s) => w.str(s),
                        ExtraKey::Mm { identifier, offset } => {
                            w.array(2);
                            w.str(identifier);
                            w.int(*offset);
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
fn stored_head(w: &mut MsgpackWriter, f: EngineFlavor, e: &BlockStored) {
    w.str("type");
    w.str("BlockStored");
    w.str("block_hashes");
    hashes(w, f, &e.block_hashes);
    w.str("parent_block_hash");
    parent(w, f, e.parent_block_hash);
    w.str("token_ids");
    tokens(w, &e.token_ids);
    w.str("block_size");
    w.uint(u64::from(e.block_size));
    w.str("lora_id");
    opt_int(w, e.lora_id);
}

fn vllm_stored(w: &mut MsgpackWriter, e: &BlockStored) {
    let f = EngineFlavor::Vllm;
    // type + 7 required + extra_keys, group_idx, kv_cache_spec_kind + session_id.
    let entries = 8 + usize::from(e.extra_keys.is_some()) + 2 + usize::from(e.session_id.is_some());
    w.map16(entries);
    stored_head(w, f, e);
    w.str("medium");
    w.opt_str(e.medium.as_deref());
    w.str("lora_name");
    w.opt_str(e.lora_name.as_deref());
    if let Some(keys) = &e.extra_keys {
        w.str("extra_keys");
        extra_keys(w, keys);
    }
    w.str("group_idx");
    w.uint(VLLM_GROUP_IDX);
    w.str("kv_cache_spec_kind");
    w.str(VLLM_SPEC_KIND);
    if let Some(session) = &e.session_id {
        w.str("session_id");
        w.str(session);
    }
}

fn vllm_removed(w: &mut MsgpackWriter, e: &BlockRemoved) {
    w.map(4);
    w.str("type");
    w.str("BlockRemoved");
    w.str("block_hashes");
    hashes(w, EngineFlavor::Vllm, &e.block_hashes);
    w.str("medium");
    w.opt_str(e.medium.as_deref());
    w.str("group_idx");
    w.uint(VLLM_GROUP_IDX);
}

fn sglang_stored(w: &mut MsgpackWriter, e: &BlockStored) {
    let f = EngineFlavor::Sglang;
    let optional = [
        e.medium.is_some(),
        e.cache_salt.is_some(),
        e.session_id.is_some(),
        e.lora_name.is_some(),
    ];
    w.map(6 + optional.iter().filter(|&&set| set).count());
    stored_head(w, f, e);
    for (key, value) in [
        ("medium", &e.medium),
        ("cache_salt", &e.cache_salt),
        ("session_id", &e.session_id),
        ("lora_name", &e.lora_name),
    ] {
        if let Some(value) = value {
            w.str(key);
            w.str(value);
        }
    }
}

fn sglang_removed(w: &mut MsgpackWriter, e: &BlockRemoved) {
    w.map(2 + usize::from(e.medium.is_some()));
    w.str("type");
    w.str("BlockRemoved");
    w.str("block_hashes");
    hashes(w, EngineFlavor::Sglang, &e.block_hashes);
    if let Some(medium) = &e.medium {
        w.str("medium");
        w.str(medium);
    }
}

/// vLLM ≤ 0.23: `["BlockStored", hashes, parent, tokens, block_size, lora_id,
/// medium, lora_name, extra_keys, group_idx, kv_cache_spec_kind]` (trailing
/// `None` fields omitted). SGLang 0.5.18–0.5.19: `["BlockStored", hashes,
/// parent, tokens, block_size, lora_id, medium]`.
fn legacy_stored(w: &mut MsgpackWriter, flavor: EngineFlavor, e: &BlockStored) {
    match flavor {
        EngineFlavor::Vllm => w.array(11),
        EngineFlavor::Sglang => w.array(7),
    }
    w.str("BlockStored");
    hashes(w, flavor, &e.block_hashes);
    parent(w, flavor, e.parent_block_hash);
    tokens(w, &e.token_ids);
    w.uint(u64::from(e.block_size));
    opt_int(w, e.lora_id);
    w.opt_str(e.medium.as_deref());
    if flavor == EngineFlavor::Vllm {
        w.opt_str(e.lora_name.as_deref());
        match &e.extra_keys {
            Some(keys) => extra_keys(w, keys),
            None => w.nil(),
        }
        w.uint(VLLM_GROUP_IDX);
        w.str(VLLM_SPEC_KIND);
    }
}

/// vLLM ≤ 0.23: `["BlockRemoved", hashes, medium, group_idx]`;
/// SGLang ≤ 0.5.19: `["BlockRemoved", hashes, medium]`.
fn legacy_removed(w: &mut MsgpackWriter, flavor: EngineFlavor, e: &BlockRemoved) {
    match flavor {
        EngineFlavor::Vllm => w.array(4),
        EngineFlavor::Sglang => w.array(3),
    }
    w.str("BlockRemoved");
    hashes(w, flavor, &e.block_hashes);
    w.opt_str(e.medium.as_deref());
    if flavor == EngineFlavor::Vllm {
        w.uint(VLLM_GROUP_IDX);
    }
}

/// The injected malformed event: valid msgpack, invalid as an event.
fn write_bad_event(w: &mut MsgpackWriter, o: EncodeOptions) {
    if o.format == EventFormat::Map {
        w.map(5);
        w.str("type");
        w.str("BlockStored");
        w.str("block_hashes");
        w.str("corrupt");
        w.str("parent_block_hash");
        w.nil();
        w.str("token_ids");
        w.array(1);
        w.int(-1);
        w.str("block_size");
        w.str("sixteen");
    } else {
        w.array(5);
        w.str("BlockStored");
        w.str("corrupt");
        w.nil();
        w.array(1);
        w.int(-1);
        w.str("sixteen");
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
        flavor: EngineFlavor::Vllm,
        format: EventFormat::Map,
    };

    #[test]
    fn integers_take_the_shortest_form() {
        let mut w = MsgpackWriter::new();
        for v in [
            0u64,
            127,
            128,
            255,
            256,
            65535,
            65536,
            u64::from(u32::MAX),
            1 << 63,
        ] {
            w.uint(v);
        }
        for v in [
            -1i64,
            -32,
            -33,
            -128,
            -129,
            -32768,
            -32769,
            i64::from(i32::MIN) - 1,
        ] {
            w.int(v);
        }
        assert_eq!(
            hex(&w.into_bytes()),
            "007fcc80ccffcd0100cdffffce00010000ceffffffffcf8000000000000000\
             ffe0d0dfd080d1ff7fd18000d2ffff7fffd3ffffffff7fffffff"
        );
    }

    #[test]
    fn strings_arrays_and_maps_switch_headers_at_msgpack_limits() {
        let mut w = MsgpackWriter::new();
        w.str(&"a".repeat(31));
        w.str(&"b".repeat(32));
        w.array(15);
        w.array(16);
        w.map(15);
        w.map(16);
        let b = w.into_bytes();
        assert_eq!(b[0], 0xbf);
        assert_eq!(&b[32..34], &[0xd9, 32]);
        assert_eq!(&b[66..], &[0x9f, 0xdc, 0, 16, 0x8f, 0xde, 0, 16]);
    }

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
