//! Per-block image keys, in every form the engines write them, read into one
//! list of (block, item hash) pairs.
//!
//! No engine writes a version field, so each form is known by its key and
//! its shape:
//!
//! * `extra_keys` (vLLM, and SGLang's aligned list): one entry per block, nil
//!   or a list of items. An item `[identifier, offset]` or a bare string of 64
//!   hex digits names a multimodal item; a string equal to the event's
//!   `lora_name` is the adapter; another string on the first block is vLLM's
//!   cache salt, but only in an event shaped as vLLM writes it (no
//!   `cache_salt` key, and the adapter first when there is one): SGLang's
//!   entries hold its namespace string instead (the cache salt and/or the
//!   adapter), which its `cache_salt` and `lora_name` fields carry. Digests of prompt
//!   embeddings (`bin`) and numbers are not item identities.
//! * `block_mm_infos` (Dynamo's producers): per block nil or
//!   `{mm_objects: [{mm_hash, offsets}]}`; `mm_hash` an integer (its 64 bits)
//!   or a hex string.
//! * `mm_keys` (TensorRT-LLM): per block a list of `{type: "mm_key", hash,
//!   start_offset, uuid?}` (or the same as an array); `hash` the item's
//!   digest in hex.
//!
//! Every identifier becomes its 64-bit item hash by
//! [`mm_hash_from_identifier`] (the first 16 hex digits, or XXH3 of any other
//! string), the rule the request side applies to the same image, so a block
//! names the same item whichever form carried it. A key of the wrong type
//! spoils its own event only (`invalid_field`).

use super::msgpack::{Kind, ReadError, Reader};
use super::normalize::{invalid, Outcome};
use super::StreamDecoder;
use crate::hash::mm_hash_from_identifier;

/// The raw bytes of the per-block key fields of one stored event.
#[derive(Debug, Clone, Copy, Default)]
pub(super) struct ItemFields<'a> {
    pub extra_keys: Option<&'a [u8]>,
    pub block_mm_infos: Option<&'a [u8]>,
    pub mm_keys: Option<&'a [u8]>,
    /// Whether the event wrote a `cache_salt` key (vLLM never does).
    pub has_salt_key: bool,
}

/// A read failure inside one per-block list, named by its field and block.
fn at(field: &'static str, block: usize) -> impl Fn(ReadError) -> super::Skipped {
    move |e| invalid(&format!("{field}[{block}]"), e)
}

/// Reads a list field's header: `None` when absent or nil.
fn list<'a>(bytes: Option<&'a [u8]>, field: &str) -> Outcome<Option<(Reader<'a>, usize)>> {
    let Some(bytes) = bytes else { return Ok(None) };
    let mut r = Reader::new(bytes);
    if r.eat_nil() {
        return Ok(None);
    }
    let len = r.read_array_len().map_err(|e| invalid(field, e))?;
    Ok(Some((r, len)))
}

/// Whether `s` is a bare digest: exactly 64 hex digits.
pub(super) fn is_hex_digest(s: &str) -> bool {
    s.len() == 64 && s.bytes().all(|c| c.is_ascii_hexdigit())
}

impl StreamDecoder {
    /// Reads every per-block key form of a stored event of `blocks` blocks
    /// into the scratch item list (sorted by block, then hash, no repeats)
    /// and returns vLLM's cache salt from the first block, if any.
    pub(super) fn read_block_items<'a>(
        &mut self,
        f: ItemFields<'a>,
        lora_name: Option<&str>,
        blocks: usize,
    ) -> Outcome<Option<&'a str>> {
        self.scratch.items.clear();
        let salt = self.read_extra_keys(f, lora_name, blocks)?;
        self.read_block_mm_infos(f.block_mm_infos, blocks)?;
        self.read_mm_keys(f.mm_keys, blocks)?;
        let items = &mut self.scratch.items;
        if items.len() > 1 {
            items.sort_unstable();
            items.dedup();
        }
        Ok(salt)
    }

    fn push_item(&mut self, block: usize, hash: u64) {
        let block = u32::try_from(block).unwrap_or(u32::MAX);
        self.scratch.items.push((block, hash));
    }

    /// `extra_keys`: items, the adapter, and (vLLM-shaped events) the salt.
    fn read_extra_keys<'a>(
        &mut self,
        f: ItemFields<'a>,
        lora_name: Option<&str>,
        blocks: usize,
    ) -> Outcome<Option<&'a str>> {
        let Some((mut r, entries)) = list(f.extra_keys, "extra_keys")? else {
            return Ok(None);
        };
        let mut salt_allowed = !f.has_salt_key;
        let mut salt = None;
        for b in 0..entries {
            let err = at("extra_keys", b);
            if b >= blocks {
                r.skip_value().map_err(&err)?;
                continue;
            }
            if r.eat_nil() {
                continue;
            }
            let items = r.read_array_len().map_err(&err)?;
            let mut lora_seen = false;
            for i in 0..items {
                match r.peek_kind().map_err(&err)? {
                    Kind::Str => {
                        let s = r.read_str().map_err(&err)?;
                        if !lora_seen && Some(s) == lora_name {
                            lora_seen = true;
                        } else if is_hex_digest(s) {
                            self.push_item(b, mm_hash_from_identifier(s));
                        } else if b == 0 && salt.is_none() {
                            salt = Some(s).filter(|s| !s.is_empty());
                        }
                    }
                    Kind::Array => {
                        let n = r.read_array_len().map_err(&err)?;
                        let mut rest = n;
                        if n > 0 && r.peek_kind() == Ok(Kind::Str) {
                            let id = r.read_str().map_err(&err)?;
                            self.push_item(b, mm_hash_from_identifier(id));
                            rest -= 1;
                        }
                        for _ in 0..rest {
                            r.skip_value().map_err(&err)?;
                        }
                    }
                    _ => r.skip_value().map_err(&err)?,
                }
                // vLLM writes the adapter first; an entry that does not start
                // with it is not vLLM's, and its strings are not salts.
                if b == 0 && i == 0 && lora_name.is_some() && !lora_seen {
                    salt_allowed = false;
                }
            }
        }
        Ok(salt.filter(|_| salt_allowed))
    }

    /// Dynamo's `block_mm_infos`: `{mm_objects: [{mm_hash, offsets}]}` per block.
    fn read_block_mm_infos(&mut self, bytes: Option<&[u8]>, blocks: usize) -> Outcome<()> {
        let Some((mut r, entries)) = list(bytes, "block_mm_infos")? else {
            return Ok(());
        };
        for b in 0..entries {
            let err = at("block_mm_infos", b);
            if b >= blocks {
                r.skip_value().map_err(&err)?;
                continue;
            }
            if r.eat_nil() {
                continue;
            }
            let keys = r.read_map_len().map_err(&err)?;
            for _ in 0..keys {
                if r.read_key().map_err(&err)? != Some("mm_objects") {
                    r.skip_value().map_err(&err)?;
                    continue;
                }
                if r.eat_nil() {
                    continue;
                }
                let objects = r.read_array_len().map_err(&err)?;
                for _ in 0..objects {
                    let hash = read_mm_object(&mut r).map_err(&err)?;
                    if let Some(hash) = hash {
                        self.push_item(b, hash);
                    }
                }
            }
        }
        Ok(())
    }

    /// TensorRT-LLM's `mm_keys`: a list of `{hash, start_offset, uuid?}` per block.
    fn read_mm_keys(&mut self, bytes: Option<&[u8]>, blocks: usize) -> Outcome<()> {
        let Some((mut r, entries)) = list(bytes, "mm_keys")? else {
            return Ok(());
        };
        for b in 0..entries {
            let err = at("mm_keys", b);
            if b >= blocks {
                r.skip_value().map_err(&err)?;
                continue;
            }
            if r.eat_nil() {
                continue;
            }
            let keys = r.read_array_len().map_err(&err)?;
            for _ in 0..keys {
                let hash = read_mm_key(&mut r).map_err(&err)?;
                self.push_item(b, hash);
            }
        }
        Ok(())
    }
}

/// One identifier: a string (hex digest or other), or a digest as `bin`
/// (its first 8 bytes, big-endian, as the first 16 hex digits would read).
fn read_identifier(r: &mut Reader<'_>) -> Result<u64, ReadError> {
    if r.peek_kind()? == Kind::Bin {
        let offset = r.position();
        let digest = r.read_bin()?;
        return match digest.get(..8).and_then(|d| <[u8; 8]>::try_from(d).ok()) {
            Some(head) => Ok(u64::from_be_bytes(head)),
            None => Err(ReadError::Range {
                offset,
                value: super::msgpack::Int::Unsigned(digest.len() as u64),
                expected: "a digest of at least 8 bytes",
            }),
        };
    }
    r.read_str().map(mm_hash_from_identifier)
}

/// One Dynamo `mm_object`: its `mm_hash` (an integer's 64 bits, or a string),
/// `None` when it names none.
fn read_mm_object(r: &mut Reader<'_>) -> Result<Option<u64>, ReadError> {
    let keys = r.read_map_len()?;
    let mut hash = None;
    for _ in 0..keys {
        if r.read_key()? != Some("mm_hash") {
            r.skip_value()?;
            continue;
        }
        hash = Some(match r.peek_kind()? {
            Kind::Int => match r.read_int()? {
                super::msgpack::Int::Unsigned(v) => v,
                super::msgpack::Int::Negative(v) => v as u64,
            },
            _ => read_identifier(r)?,
        });
    }
    Ok(hash)
}

/// One TensorRT-LLM `mm_key`: a map with `hash`, or `[hash, start_offset, uuid?]`.
fn read_mm_key(r: &mut Reader<'_>) -> Result<u64, ReadError> {
    let offset = r.position();
    if r.peek_kind()? == Kind::Array {
        let n = r.read_array_len()?;
        if n == 0 {
            return Err(ReadError::Range {
                offset,
                value: super::msgpack::Int::Unsigned(0),
                expected: "an mm_key with a hash",
            });
        }
        let hash = read_identifier(r)?;
        for _ in 1..n {
            r.skip_value()?;
        }
        return Ok(hash);
    }
    let keys = r.read_map_len()?;
    let mut hash = None;
    for _ in 0..keys {
        if r.read_key()? == Some("hash") {
            hash = Some(read_identifier(r)?);
        } else {
            r.skip_value()?;
        }
    }
    hash.ok_or(ReadError::Range {
        offset,
        value: super::msgpack::Int::Unsigned(0),
        expected: "an mm_key with a hash",
    })
}
