//! A stored event's token ids to local block hashes, read straight from the
//! payload.
//!
//! Two loops share the rules:
//!
//! * the plain loop, for text (and EAGLE bigram pairs, and vLLM lookahead
//!   tokens): each id folded and pushed, nothing else per token;
//! * the image loop, for events that name images per block or carry
//!   TensorRT-LLM's digest tokens. Per block it also notes whether any id is
//!   wider than 32 bits (SGLang 0.5.23's wide pads, which carry their images'
//!   identity in the tokens themselves: such a block's image keys are not
//!   added again), and it rewrites TensorRT-LLM's image positions to one
//!   canonical form (below). The plain loop hands an event over to it, from
//!   the start, when it meets a string token.
//!
//! **TensorRT-LLM's image positions.** Its radix key lays an item out
//! digest-first: item-local position 0 holds the item's 32-byte digest (on
//! the wire: 64 hex digits in `token_ids`), position k > 0 the id
//! `mm_token_id_offset + k` (the offset is the model's vocabulary size, so
//! these ids lie above every text id). The router does not know the offset,
//! so the decoder learns it from the stream (a digest token followed by two
//! consecutive ids `o + 1`, `o + 2`) and writes position k as
//! [`MM_PAD_BASE`]` + k` (k < 2^30); the request side lays a TensorRT-LLM
//! worker's images out the same way. Until the offset is known such ids are
//! hashed as they are. A digest token also names its item, as `mm_keys` does,
//! and so do the later positions of that item in the same event (TensorRT-LLM's
//! own `decodeEventBlock` attributes them so).

use super::items::is_hex_digest;
use super::msgpack::{Kind, Reader};
use super::normalize::{array, invalid, skip, Outcome};
use super::{SkipReason, StreamDecoder};
use crate::event::StoredBlock;
use crate::hash::mm_hash_from_identifier;
use crate::tokens::{fold_token_id, MM_PAD_BASE, MM_PAD_MASK};

/// What hashing a stored event's blocks gave: how many leading blocks had
/// all their tokens, the lookahead width, and the folded tokens when asked.
pub(super) type Hashed = (usize, u32, Option<Vec<u32>>);

/// Why the plain loop stopped: a string token, which the image loop reads.
enum Plain {
    Done(Hashed),
    StringToken,
}

/// One event's token reading inputs.
#[derive(Clone, Copy)]
pub(super) struct TokenFields<'a> {
    pub tokens: &'a [u8],
    pub lookahead: Option<&'a [u8]>,
    pub block_size: u32,
    pub seed: u64,
    /// The event carries TensorRT-LLM's `mm_keys`.
    pub trtllm_keys: bool,
}

impl StreamDecoder {
    /// Computes each block's local hash from the token ids in the payload.
    pub(super) fn hash_blocks(
        &mut self,
        blocks: &mut [StoredBlock],
        t: TokenFields<'_>,
    ) -> Outcome<Hashed> {
        self.scratch.token_items.clear();
        self.scratch.kept_items.clear();
        let (r, len) = array(t.tokens, "token_ids")?;
        let bigram = len > 0 && r.peek_kind() == Ok(Kind::Array);
        if !bigram && (t.trtllm_keys || !self.scratch.items.is_empty()) {
            return self.hash_blocks_images(blocks, t);
        }
        match self.hash_blocks_plain(blocks, t)? {
            Plain::Done(hashed) => Ok(hashed),
            Plain::StringToken => self.hash_blocks_images(blocks, t),
        }
    }

    fn hash_blocks_plain(
        &mut self,
        blocks: &mut [StoredBlock],
        t: TokenFields<'_>,
    ) -> Outcome<Plain> {
        // A previous event may have stopped half-way through a block.
        self.hasher.reset();
        let (mut r, len) = array(t.tokens, "token_ids")?;
        let bigram = len > 0 && r.peek_kind() == Ok(Kind::Array);
        let mut lookahead_reader = lookahead(t.lookahead)?;
        let bs = t.block_size as usize;
        let kept = blocks.len().min(len / bs);
        let mut kept_tokens = self
            .config
            .keep_tokens
            .then(|| Vec::with_capacity(kept * bs + 1));
        let mut lookahead = u32::from(bigram);
        let mut position = 0usize;
        let mut item_cursor = 0usize;
        // Checked once per event: a text event has neither, and the calls
        // per block would cost the plain path its speed.
        let has_items = !self.scratch.items.is_empty();
        for (b, block) in blocks.iter_mut().take(kept).enumerate() {
            for j in 0..bs {
                let field = || format!("token_ids[{position}]");
                if bigram {
                    let pair_len = r.read_array_len().map_err(|e| invalid(&field(), e))?;
                    if pair_len < 2 {
                        return Err(skip(
                            SkipReason::InvalidField,
                            format!("`{}`: a bigram pair needs 2 ids", field()),
                        ));
                    }
                    let first = fold_token_id(r.read_u64().map_err(|e| invalid(&field(), e))?);
                    let second = fold_token_id(r.read_u64().map_err(|e| invalid(&field(), e))?);
                    for _ in 2..pair_len {
                        r.skip_value().map_err(|e| invalid(&field(), e))?;
                    }
                    self.hasher.push_token(first);
                    if let Some(t) = kept_tokens.as_mut() {
                        t.push(first);
                    }
                    if j + 1 == bs {
                        // The window's last id is the pair's second: the next block's first id.
                        self.hasher.push_token(second);
                        if b + 1 == kept {
                            if let Some(t) = kept_tokens.as_mut() {
                                t.push(second);
                            }
                        }
                    }
                } else {
                    let token = match r.read_u64() {
                        Ok(id) => fold_token_id(id),
                        Err(e) => {
                            if r.peek_kind() == Ok(Kind::Str) {
                                return Ok(Plain::StringToken);
                            }
                            return Err(invalid(&field(), e));
                        }
                    };
                    self.hasher.push_token(token);
                    if let Some(t) = kept_tokens.as_mut() {
                        t.push(token);
                    }
                }
                position += 1;
            }
            if lookahead_reader.is_some() {
                if let Some(width) = self.push_lookahead(&mut lookahead_reader, b)? {
                    lookahead = width;
                }
            }
            if has_items {
                self.push_block_items(b, &mut item_cursor, false);
            }
            block.local = self.hasher.finish(t.seed);
        }
        Ok(Plain::Done((kept, lookahead, kept_tokens)))
    }

    /// The image loop (flat token ids): see the module docs.
    fn hash_blocks_images(
        &mut self,
        blocks: &mut [StoredBlock],
        t: TokenFields<'_>,
    ) -> Outcome<Hashed> {
        self.hasher.reset();
        self.scratch.kept_items.clear();
        let (mut r, len) = array(t.tokens, "token_ids")?;
        let mut lookahead_reader = lookahead(t.lookahead)?;
        let bs = t.block_size as usize;
        let kept = blocks.len().min(len / bs);
        let mut kept_tokens = self
            .config
            .keep_tokens
            .then(|| Vec::with_capacity(kept * bs));
        let mut lookahead = 0;
        let mut position = 0usize;
        let mut item_cursor = 0usize;
        let mut trtllm = t.trtllm_keys;
        // The item whose digest token came last: its later positions name it.
        let mut current_item = None;
        for (b, block) in blocks.iter_mut().take(kept).enumerate() {
            let mut wide = false;
            let mut continues_item = false;
            self.scratch.token_items.clear();
            for _ in 0..bs {
                let field = || format!("token_ids[{position}]");
                let token = if r.peek_kind() == Ok(Kind::Str) {
                    let digest = r.read_str().map_err(|e| invalid(&field(), e))?;
                    if !is_hex_digest(digest) {
                        return Err(skip(
                            SkipReason::InvalidField,
                            format!("`{}`: a string token must be a 64-hex digest", field()),
                        ));
                    }
                    let item = mm_hash_from_identifier(digest);
                    self.scratch.token_items.push(item);
                    current_item = Some(item);
                    self.learn_trtllm_offset(&r);
                    trtllm = true;
                    MM_PAD_BASE
                } else {
                    let id = r.read_u64().map_err(|e| invalid(&field(), e))?;
                    wide |= id > u64::from(u32::MAX);
                    match self.memory.trtllm_mm_offset {
                        Some(off) if trtllm && id > off && id - off <= MM_PAD_MASK => {
                            continues_item = true;
                            MM_PAD_BASE + (id - off) as u32
                        }
                        _ => fold_token_id(id),
                    }
                };
                self.hasher.push_token(token);
                if let Some(t) = kept_tokens.as_mut() {
                    t.push(token);
                }
                position += 1;
            }
            if let (true, Some(item)) = (continues_item, current_item) {
                self.scratch.token_items.push(item);
            }
            if let Some(width) = self.push_lookahead(&mut lookahead_reader, b)? {
                lookahead = width;
            }
            self.push_block_items(b, &mut item_cursor, wide);
            block.local = self.hasher.finish(t.seed);
        }
        Ok((kept, lookahead, kept_tokens))
    }

    /// After a digest token: when the next two ids are consecutive, `o + 1`
    /// and `o + 2`, the stream's TensorRT-LLM id offset is `o`.
    fn learn_trtllm_offset(&mut self, after_digest: &Reader<'_>) {
        let mut peek = after_digest.clone();
        if let (Ok(first), Ok(second)) = (peek.read_u64(), peek.read_u64()) {
            if first >= 1 && second == first + 1 {
                self.memory.trtllm_mm_offset = Some(first - 1);
            }
        }
    }

    /// Pushes block `b`'s lookahead tokens (vLLM) and returns their count.
    fn push_lookahead(
        &mut self,
        reader: &mut Option<(Reader<'_>, usize)>,
        b: usize,
    ) -> Outcome<Option<u32>> {
        let Some((lr, lookahead_len)) = reader.as_mut() else {
            return Ok(None);
        };
        if b >= *lookahead_len {
            return Err(skip(
                SkipReason::InvalidField,
                format!("`lookahead_token_ids` has no entry for block {b}"),
            ));
        }
        let field = || format!("lookahead_token_ids[{b}]");
        let n = lr.read_array_len().map_err(|e| invalid(&field(), e))?;
        for _ in 0..n {
            let token = fold_token_id(lr.read_u64().map_err(|e| invalid(&field(), e))?);
            self.hasher.push_token(token);
        }
        Ok(Some(u32::try_from(n).unwrap_or(u32::MAX)))
    }

    /// Appends block `b`'s item hashes (from its keys and its digest tokens),
    /// sorted, without repeats, to the hash input — unless the block's own
    /// ids are wide pads, which carry the identity already.
    fn push_block_items(&mut self, b: usize, cursor: &mut usize, wide: bool) {
        let block = u32::try_from(b).unwrap_or(u32::MAX);
        let items = &self.scratch.items;
        let start = *cursor;
        while *cursor < items.len() && items[*cursor].0 <= block {
            *cursor += 1;
        }
        let from_keys = items[start..*cursor].iter().filter(|(k, _)| *k == block);
        let token_items = &self.scratch.token_items;
        if wide || (start == *cursor && token_items.is_empty()) {
            return;
        }
        let merged = &mut self.scratch.mm_block;
        merged.clear();
        merged.extend(from_keys.map(|&(_, h)| h));
        merged.extend_from_slice(token_items);
        merged.sort_unstable();
        merged.dedup();
        for &h in merged.iter() {
            self.hasher.push_mm_hash(h);
        }
        if self.config.keep_tokens {
            let kept = merged.iter().map(|&h| (block, h));
            self.scratch.kept_items.extend(kept);
        }
    }
}

/// The `lookahead_token_ids` list, when present and not nil.
fn lookahead(bytes: Option<&[u8]>) -> Outcome<Option<(Reader<'_>, usize)>> {
    match bytes {
        Some(bytes) if bytes != [0xc0] => Ok(Some(array(bytes, "lookahead_token_ids")?)),
        _ => Ok(None),
    }
}
