//! From an event's raw fields to a [`KvEvent`]: types checked, tier and
//! placement filters applied, local block hashes computed.
//!
//! Token ids are hashed by `blocks` (read from the payload one at a time,
//! folded, written into the block hasher's reused buffer, so the common path
//! builds no token list); per-block image keys are read by `items`.

use std::sync::Arc;

use super::blocks::TokenFields;
use super::event::Fields;
use super::groups::Placement;
use super::items::ItemFields;
use super::msgpack::{Int, Kind, ReadError, Reader};
use super::{SkipReason, Skipped, StreamDecoder};
use crate::event::{
    ExternalHash, GroupBlocks, GroupRule, KvEvent, Removed, Stored, StoredBlock, Tier,
};
use crate::hash::{namespace_seed, LocalBlockHash};

pub(super) type Outcome<T> = Result<T, Skipped>;

pub(super) fn skip(reason: SkipReason, detail: impl Into<String>) -> Skipped {
    Skipped {
        reason,
        detail: detail.into(),
    }
}

fn missing(field: &str) -> Skipped {
    skip(SkipReason::MissingField, format!("`{field}` is required"))
}

pub(super) fn invalid(field: &str, e: ReadError) -> Skipped {
    skip(SkipReason::InvalidField, format!("`{field}`: {e}"))
}

/// Reads an optional string field: absent, nil and "" are all `None`.
pub(super) fn opt_str<'a>(bytes: Option<&'a [u8]>, field: &str) -> Outcome<Option<&'a str>> {
    let Some(bytes) = bytes else { return Ok(None) };
    let mut r = Reader::new(bytes);
    if r.eat_nil() {
        return Ok(None);
    }
    let s = r.read_str().map_err(|e| invalid(field, e))?;
    Ok(Some(s).filter(|s| !s.is_empty()))
}

/// Reads an optional non-negative integer below 2^32.
pub(super) fn opt_u32(bytes: Option<&[u8]>, field: &str) -> Outcome<Option<u32>> {
    let Some(bytes) = bytes else { return Ok(None) };
    let mut r = Reader::new(bytes);
    if r.eat_nil() {
        return Ok(None);
    }
    r.read_u32().map(Some).map_err(|e| invalid(field, e))
}

/// Reads one engine hash: unsigned, negative (two's complement) or a digest.
fn read_hash(r: &mut Reader<'_>) -> Result<ExternalHash, ReadError> {
    if r.peek_kind()? == Kind::Bin {
        let offset = r.position();
        let digest = r.read_bin()?;
        // vLLM's int form of a digest is its last 8 bytes read big-endian.
        let tail = digest.len().checked_sub(8).map(|start| &digest[start..]);
        return match tail.and_then(|t| <[u8; 8]>::try_from(t).ok()) {
            Some(tail) => Ok(ExternalHash(u64::from_be_bytes(tail))),
            None => Err(ReadError::Range {
                offset,
                value: Int::Unsigned(digest.len() as u64),
                expected: "a digest of at least 8 bytes",
            }),
        };
    }
    Ok(match r.read_int()? {
        Int::Unsigned(v) => ExternalHash(v),
        Int::Negative(v) => ExternalHash(v as u64),
    })
}

/// An array field: its reader positioned after the header, and its length.
pub(super) fn array<'a>(bytes: &'a [u8], field: &str) -> Outcome<(Reader<'a>, usize)> {
    let mut r = Reader::new(bytes);
    let len = r.read_array_len().map_err(|e| invalid(field, e))?;
    Ok((r, len))
}

impl StreamDecoder {
    /// Interprets one gathered event.
    pub(super) fn normalize(&mut self, fields: &Fields<'_>) -> Outcome<KvEvent> {
        if let Some(kind) = fields.not_an_event {
            return Err(skip(
                SkipReason::NotAnEvent,
                format!("event is a msgpack {}, not a map or array", kind.name()),
            ));
        }
        let tag = fields.tag.ok_or_else(|| missing("type"))?;
        let tag = Reader::new(tag)
            .read_str()
            .map_err(|e| invalid("type", e))?;
        match tag {
            "BlockStored" => self.stored(fields),
            "BlockRemoved" => self.removed(fields),
            "AllBlocksCleared" => {
                check_ownership(fields)?;
                self.memory.salts.clear();
                Ok(KvEvent::Cleared)
            }
            other => Err(skip(
                SkipReason::UnknownType,
                format!("event type {other:?}"),
            )),
        }
    }

    fn removed(&mut self, f: &Fields<'_>) -> Outcome<KvEvent> {
        let hashes = f.block_hashes.ok_or_else(|| missing("block_hashes"))?;
        let tier = tier(f.medium, f.locality)?;
        check_ownership(f)?;
        let placement = self.placement(f, None)?;
        let blocks = read_hashes(hashes)?;
        if let Placement::Group { group, rule } = placement {
            return Ok(group_event(group, rule, blocks, tier, false));
        }
        if !self.memory.salts.is_empty() {
            for hash in &blocks {
                self.memory.salts.remove(&hash.0);
            }
        }
        Ok(KvEvent::Removed(Removed { blocks, tier }))
    }

    fn stored(&mut self, f: &Fields<'_>) -> Outcome<KvEvent> {
        let hashes = f.block_hashes.ok_or_else(|| missing("block_hashes"))?;
        let tokens = f.token_ids.ok_or_else(|| missing("token_ids"))?;
        let block_size = f.block_size.ok_or_else(|| missing("block_size"))?;
        let block_size = Reader::new(block_size)
            .read_u32()
            .map_err(|e| invalid("block_size", e))?;
        if block_size == 0 {
            return Err(placeholder_or_invalid(tokens));
        }
        let tier = tier(f.medium, f.locality)?;
        check_ownership(f)?;
        if let Placement::Group { group, rule } = self.placement(f, Some(block_size))? {
            return Ok(group_event(group, rule, read_hashes(hashes)?, tier, true));
        }
        let lora_name = opt_str(f.lora_name, "lora_name")?;
        let explicit_salt = opt_str(f.cache_salt, "cache_salt")?;
        let parent = read_parent(f.parent_block_hash)?;

        let (mut r, count) = array(hashes, "block_hashes")?;
        let mut blocks = Vec::with_capacity(count.min(r.remaining()));
        for i in 0..count {
            let external =
                read_hash(&mut r).map_err(|e| invalid(&format!("block_hashes[{i}]"), e))?;
            blocks.push(StoredBlock {
                external,
                local: LocalBlockHash(0),
            });
        }
        self.check_no_repeats(&blocks, parent)?;

        if let Some(expected) = self.config.block_size {
            if expected != block_size {
                return Err(skip(
                    SkipReason::BlockSizeMismatch,
                    format!("event block_size {block_size}, worker block size {expected}"),
                ));
            }
        }

        let item_fields = ItemFields {
            extra_keys: f.extra_keys,
            block_mm_infos: f.block_mm_infos,
            mm_keys: f.mm_keys,
            has_salt_key: f.cache_salt.is_some(),
        };
        let extra_salt = self.read_block_items(item_fields, lora_name, count)?;
        let inherited_salt = match (explicit_salt.or(extra_salt), parent) {
            (None, Some(parent)) => self.memory.salts.get(&parent.0).cloned(),
            _ => None,
        };
        let cache_salt = explicit_salt.or(extra_salt).or(inherited_salt.as_deref());
        let seed = namespace_seed(lora_name, cache_salt);

        let token_fields = TokenFields {
            tokens,
            lookahead: f.lookahead_token_ids,
            block_size,
            seed,
            trtllm_keys: f.mm_keys.is_some_and(|k| k != [0xc0]),
        };
        let (kept, lookahead, token_ids) = self.hash_blocks(&mut blocks, token_fields)?;
        let dropped_blocks = u32::try_from(blocks.len() - kept).unwrap_or(u32::MAX);
        if kept == 0 && !blocks.is_empty() {
            return Err(skip(
                SkipReason::TooFewTokens,
                format!(
                    "{} block(s) of {block_size} need more token ids than the event carries",
                    blocks.len()
                ),
            ));
        }
        blocks.truncate(kept);

        let cache_salt = cache_salt.map(str::to_owned);
        if let Some(salt) = &cache_salt {
            self.remember_salt(&blocks, salt);
        }
        Ok(KvEvent::Stored(Stored {
            parent,
            blocks,
            tier,
            block_size,
            lora_name: lora_name.map(str::to_owned),
            cache_salt,
            lookahead,
            dropped_blocks,
            image_items: token_ids
                .is_some()
                .then(|| std::mem::take(&mut self.scratch.kept_items)),
            token_ids,
        }))
    }

    /// Rejects a store that names a block twice or names its own parent: applying
    /// it would create a cycle in the worker's chain.
    fn check_no_repeats(
        &mut self,
        blocks: &[StoredBlock],
        parent: Option<ExternalHash>,
    ) -> Outcome<()> {
        let sorted = &mut self.scratch.sorted_hashes;
        sorted.clear();
        sorted.extend(blocks.iter().map(|b| b.external.0));
        sorted.extend(parent.map(|p| p.0));
        sorted.sort_unstable();
        match sorted.windows(2).find(|w| w[0] == w[1]) {
            Some(w) => Err(skip(
                SkipReason::RepeatedHash,
                format!("hash {} appears twice (or as its own parent)", w[0]),
            )),
            None => Ok(()),
        }
    }

    /// Remembers the salt of salted blocks so that child stores inherit it.
    fn remember_salt(&mut self, blocks: &[StoredBlock], salt: &str) {
        let salts = &mut self.memory.salts;
        if salts.len() + blocks.len() > self.config.max_salted_blocks {
            return;
        }
        let salt: Arc<str> = match blocks.first().and_then(|b| salts.get(&b.external.0)) {
            Some(existing) if &**existing == salt => existing.clone(),
            _ => Arc::from(salt),
        };
        for block in blocks {
            salts.insert(block.external.0, salt.clone());
        }
    }
}

/// Every hash of a `block_hashes` list.
fn read_hashes(bytes: &[u8]) -> Outcome<Vec<ExternalHash>> {
    let (mut r, len) = array(bytes, "block_hashes")?;
    let mut blocks = Vec::with_capacity(len.min(r.remaining()));
    for i in 0..len {
        blocks.push(read_hash(&mut r).map_err(|e| invalid(&format!("block_hashes[{i}]"), e))?);
    }
    Ok(blocks)
}

/// `parent_block_hash`: absent or nil is `None`.
fn read_parent(bytes: Option<&[u8]>) -> Outcome<Option<ExternalHash>> {
    let Some(bytes) = bytes else { return Ok(None) };
    let mut r = Reader::new(bytes);
    if r.eat_nil() {
        return Ok(None);
    }
    read_hash(&mut r)
        .map(Some)
        .map_err(|e| invalid("parent_block_hash", e))
}

/// A constraining group's blocks stored or evicted.
fn group_event(
    group: u32,
    rule: GroupRule,
    blocks: Vec<ExternalHash>,
    tier: Tier,
    stored: bool,
) -> KvEvent {
    KvEvent::Group(GroupBlocks {
        group,
        rule,
        blocks,
        tier,
        stored,
    })
}

fn check_ownership(f: &Fields<'_>) -> Outcome<()> {
    match opt_str(f.ownership, "ownership")? {
        Some(owner) => Err(skip(
            SkipReason::ForeignOwnership,
            format!("ownership {owner:?}"),
        )),
        None => Ok(()),
    }
}

/// Maps `medium` and `locality` to a tier.
///
/// `medium` absent, nil or empty means the device. `locality` absent or
/// `LOCAL` keeps the medium's tier; `REMOTE` (vLLM's offloading tiers on
/// storage that is remote to the engine, e.g. a network file system or an
/// object store, which the engine still loads its blocks from) is the
/// external tier whatever the medium; any other locality is skipped.
fn tier(medium: Option<&[u8]>, locality: Option<&[u8]>) -> Outcome<Tier> {
    let tier = match opt_str(medium, "medium")? {
        None => Tier::Device,
        Some(m) => Tier::from_medium(m)
            .ok_or_else(|| skip(SkipReason::UnknownMedium, format!("medium {m:?}")))?,
    };
    match opt_str(locality, "locality")? {
        None => Ok(tier),
        Some(l) if l.eq_ignore_ascii_case("LOCAL") => Ok(tier),
        Some(l) if l.eq_ignore_ascii_case("REMOTE") => Ok(Tier::External),
        Some(l) => Err(skip(SkipReason::NonLocal, format!("locality {l:?}"))),
    }
}

/// A store with `block_size` 0: a placeholder when it also has no token ids
/// (vLLM's offloading connector names a chunk it cannot describe so), else
/// an impossible value.
fn placeholder_or_invalid(tokens: &[u8]) -> Skipped {
    let mut r = Reader::new(tokens);
    match r.read_array_len() {
        Ok(0) => skip(
            SkipReason::Placeholder,
            "`block_size` 0 and no token ids: the store names its block only",
        ),
        _ => skip(SkipReason::InvalidField, "`block_size` is 0"),
    }
}
