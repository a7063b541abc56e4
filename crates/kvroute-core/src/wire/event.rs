//! Locating one event and its fields, in either wire shape.
//!
//! An event is a tagged map (`{"type": "BlockStored", …}`, vLLM ≥ 0.24 and
//! SGLang ≥ 0.5.20) or a tagged array (`["BlockStored", hashes, parent, …]`,
//! older releases). [`gather`] walks the event once, by markers only, and
//! records the bytes of each field it knows; interpretation happens later in
//! `normalize`, so a field of the wrong type spoils only its own event.

use super::msgpack::{Kind, ReadError, Reader};

/// The raw bytes of each known field of one event; `None` when absent.
#[derive(Debug, Default, Clone)]
pub(super) struct Fields<'a> {
    /// The event's own msgpack family, when it is neither a map nor an array.
    pub not_an_event: Option<Kind>,
    pub tag: Option<&'a [u8]>,
    pub block_hashes: Option<&'a [u8]>,
    pub parent_block_hash: Option<&'a [u8]>,
    pub token_ids: Option<&'a [u8]>,
    pub block_size: Option<&'a [u8]>,
    pub medium: Option<&'a [u8]>,
    pub lora_name: Option<&'a [u8]>,
    pub cache_salt: Option<&'a [u8]>,
    pub extra_keys: Option<&'a [u8]>,
    pub group_idx: Option<&'a [u8]>,
    pub kv_cache_spec_kind: Option<&'a [u8]>,
    pub kv_cache_spec_sliding_window: Option<&'a [u8]>,
    pub locality: Option<&'a [u8]>,
    pub ownership: Option<&'a [u8]>,
    pub lookahead_token_ids: Option<&'a [u8]>,
    pub block_mm_infos: Option<&'a [u8]>,
    pub mm_keys: Option<&'a [u8]>,
}

/// A field of the positional (array) layout.
#[derive(Debug, Clone, Copy)]
enum Slot {
    BlockHashes,
    Parent,
    TokenIds,
    BlockSize,
    Medium,
    LoraName,
    ExtraKeys,
    GroupIdx,
    SpecKind,
    SlidingWindow,
    Locality,
    Ownership,
    Ignored,
}

/// Slots 1.. of a positional `BlockStored`: vLLM ≤ 0.23 order
/// (`lora_id` is read and ignored);
/// SGLang ≤ 0.5.19 stops after `medium`.
const STORED_SLOTS: &[Slot] = &[
    Slot::BlockHashes,
    Slot::Parent,
    Slot::TokenIds,
    Slot::BlockSize,
    Slot::Ignored, // lora_id
    Slot::Medium,
    Slot::LoraName,
    Slot::ExtraKeys,
    Slot::GroupIdx,
    Slot::SpecKind,
    Slot::SlidingWindow,
    Slot::Locality,
    Slot::Ownership,
];

/// Slots 1.. of a positional `BlockRemoved`.
const REMOVED_SLOTS: &[Slot] = &[
    Slot::BlockHashes,
    Slot::Medium,
    Slot::GroupIdx,
    Slot::SpecKind,
    Slot::SlidingWindow,
    Slot::Locality,
    Slot::Ownership,
];

/// Slots 1.. of a positional `AllBlocksCleared`.
const CLEARED_SLOTS: &[Slot] = &[Slot::Ownership];

/// Walks one event at the reader into `fields` (overwritten whole) and leaves
/// the reader after it.
///
/// Fails only when the event's bytes are cut or corrupt, so its end cannot be
/// found; every other problem is left for `normalize` to report. `fields` is
/// the caller's, reused from event to event: [`Fields`] is a few hundred
/// bytes, and returning it by value costs two copies of it per event.
pub(super) fn gather<'a>(r: &mut Reader<'a>, fields: &mut Fields<'a>) -> Result<(), ReadError> {
    *fields = Fields::default();
    match r.peek_kind()? {
        Kind::Map => gather_map(r, fields),
        Kind::Array => gather_array(r, fields),
        other => {
            r.skip_value()?;
            fields.not_an_event = Some(other);
            Ok(())
        }
    }
}

fn gather_map<'a>(r: &mut Reader<'a>, fields: &mut Fields<'a>) -> Result<(), ReadError> {
    let entries = r.read_map_len()?;
    for _ in 0..entries {
        // msgspec never writes non-string keys; skip any such entry whole.
        let key = r.read_key()?;
        let value = r.value_bytes()?;
        let target = match key {
            Some("type") => &mut fields.tag,
            Some("block_hashes") => &mut fields.block_hashes,
            Some("parent_block_hash") => &mut fields.parent_block_hash,
            Some("token_ids") => &mut fields.token_ids,
            Some("block_size") => &mut fields.block_size,
            Some("medium") => &mut fields.medium,
            Some("lora_name") => &mut fields.lora_name,
            Some("cache_salt") => &mut fields.cache_salt,
            Some("extra_keys") => &mut fields.extra_keys,
            Some("group_idx") => &mut fields.group_idx,
            Some("kv_cache_spec_kind") => &mut fields.kv_cache_spec_kind,
            Some("kv_cache_spec_sliding_window") => &mut fields.kv_cache_spec_sliding_window,
            Some("locality") => &mut fields.locality,
            Some("ownership") => &mut fields.ownership,
            Some("lookahead_token_ids") => &mut fields.lookahead_token_ids,
            Some("block_mm_infos") => &mut fields.block_mm_infos,
            Some("mm_keys") => &mut fields.mm_keys,
            _ => continue,
        };
        *target = Some(value);
    }
    Ok(())
}

fn gather_array<'a>(r: &mut Reader<'a>, fields: &mut Fields<'a>) -> Result<(), ReadError> {
    let len = r.read_array_len()?;
    if len == 0 {
        return Ok(());
    }
    let tag = r.value_bytes()?;
    fields.tag = Some(tag);
    let slots = match Reader::new(tag).read_str() {
        Ok("BlockStored") => STORED_SLOTS,
        Ok("BlockRemoved") => REMOVED_SLOTS,
        Ok("AllBlocksCleared") => CLEARED_SLOTS,
        _ => &[],
    };
    for position in 1..len {
        let value = r.value_bytes()?;
        let target = match slots.get(position - 1) {
            Some(Slot::BlockHashes) => &mut fields.block_hashes,
            Some(Slot::Parent) => &mut fields.parent_block_hash,
            Some(Slot::TokenIds) => &mut fields.token_ids,
            Some(Slot::BlockSize) => &mut fields.block_size,
            Some(Slot::Medium) => &mut fields.medium,
            Some(Slot::LoraName) => &mut fields.lora_name,
            Some(Slot::ExtraKeys) => &mut fields.extra_keys,
            Some(Slot::GroupIdx) => &mut fields.group_idx,
            Some(Slot::SpecKind) => &mut fields.kv_cache_spec_kind,
            Some(Slot::SlidingWindow) => &mut fields.kv_cache_spec_sliding_window,
            Some(Slot::Locality) => &mut fields.locality,
            Some(Slot::Ownership) => &mut fields.ownership,
            Some(Slot::Ignored) | None => continue,
        };
        *target = Some(value);
    }
    Ok(())
}
