//! Block hashes in the router's own hash space, compatible with Dynamo's.
//!
//! The index is navigated by a *local* hash per block, computed by kvroute from
//! the block's (folded) token ids, so that a request's prompt and an engine's
//! event hash to the same values whatever the engine's own hash algorithm is:
//!
//! * local hash = XXH3-64 over the block's `u32` token ids little-endian, with
//!   seed [`namespace_seed`]: 1337, plus a term for the LoRA adapter and a term
//!   for the cache salt, so tenants and adapters never share blocks;
//! * EAGLE (bigram) workers, and vLLM workers with lookahead hashing, hash
//!   windows of `block_size + L` tokens at stride `block_size` (L = 1 for
//!   EAGLE), because their cache entry also depends on the next tokens;
//! * a block with multimodal items (vLLM `extra_keys`) appends the items'
//!   64-bit hashes, sorted ascending, as little-endian `u64` (Dynamo's legacy form);
//! * the sequence hash chains local hashes: `seq[0] = local[0]`,
//!   `seq[i] = XXH3-64(seq[i-1] LE ‖ local[i] LE, 1337)`.
//!
//! Golden vectors D1–D10 of the reference test these rules.

use xxhash_rust::xxh3::xxh3_64_with_seed;

/// Base seed of every local block hash and of the sequence chain.
pub const HASH_SEED: u64 = 1337;

/// The router's hash of one block's tokens (and namespace); navigates the index.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct LocalBlockHash(pub u64);

/// The chained hash of a block and every block before it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct SequenceHash(pub u64);

/// The seed of a block's local hash: 1337, plus the LoRA term, plus the salt term.
///
/// Empty strings count as absent. The additions wrap, LoRA first, as Dynamo does.
pub fn namespace_seed(lora_name: Option<&str>, cache_salt: Option<&str>) -> u64 {
    let mut seed = HASH_SEED;
    if let Some(lora) = lora_name.filter(|s| !s.is_empty()) {
        seed = seed.wrapping_add(xxh3_64_with_seed(lora.as_bytes(), 0));
    }
    if let Some(salt) = cache_salt.filter(|s| !s.is_empty()) {
        seed = seed.wrapping_add(xxh3_64_with_seed(salt.as_bytes(), 1));
    }
    seed
}

/// Builds one block's hash input in a reusable buffer, so hashing allocates nothing
/// once the buffer has grown to the block size.
#[derive(Debug, Default, Clone)]
pub struct BlockHasher {
    bytes: Vec<u8>,
}

impl BlockHasher {
    /// An empty hasher.
    pub fn new() -> Self {
        Self::default()
    }

    /// Appends one (already folded) token id.
    #[inline]
    pub fn push_token(&mut self, token: u32) {
        self.bytes.extend_from_slice(&token.to_le_bytes());
    }

    /// Appends a multimodal item hash; callers push a block's items sorted ascending.
    #[inline]
    pub fn push_mm_hash(&mut self, mm_hash: u64) {
        self.bytes.extend_from_slice(&mm_hash.to_le_bytes());
    }

    /// Drops anything pushed since the last [`BlockHasher::finish`] (after a
    /// block was abandoned half-way, e.g. on a bad token id).
    pub fn reset(&mut self) {
        self.bytes.clear();
    }

    /// Hashes what was pushed with `seed` and empties the buffer for the next block.
    #[inline]
    pub fn finish(&mut self, seed: u64) -> LocalBlockHash {
        let hash = xxh3_64_with_seed(&self.bytes, seed);
        self.bytes.clear();
        LocalBlockHash(hash)
    }
}

/// The local hash of one block of tokens.
pub fn local_block_hash(tokens: &[u32], seed: u64) -> LocalBlockHash {
    local_block_hash_with_mm(tokens, &[], seed)
}

/// The local hash of one block of tokens carrying multimodal items (any order).
///
/// Blocks of up to 256 tokens (and 16 items) are hashed from a stack buffer,
/// without allocating: the request path hashes every prompt block this way.
pub fn local_block_hash_with_mm(tokens: &[u32], mm_hashes: &[u64], seed: u64) -> LocalBlockHash {
    const STACK_BYTES: usize = 1024;
    const STACK_ITEMS: usize = 16;
    let len = tokens.len() * 4 + mm_hashes.len() * 8;
    if len <= STACK_BYTES && mm_hashes.len() <= STACK_ITEMS {
        let mut buf = [0u8; STACK_BYTES];
        for (chunk, token) in buf.chunks_exact_mut(4).zip(tokens) {
            chunk.copy_from_slice(&token.to_le_bytes());
        }
        let mut sorted = [0u64; STACK_ITEMS];
        let sorted = &mut sorted[..mm_hashes.len()];
        sorted.copy_from_slice(mm_hashes);
        sorted.sort_unstable();
        let items = &mut buf[tokens.len() * 4..len];
        for (chunk, item) in items.chunks_exact_mut(8).zip(sorted.iter()) {
            chunk.copy_from_slice(&item.to_le_bytes());
        }
        return LocalBlockHash(xxh3_64_with_seed(&buf[..len], seed));
    }
    let mut hasher = BlockHasher::new();
    for &token in tokens {
        hasher.push_token(token);
    }
    let mut sorted = mm_hashes.to_vec();
    sorted.sort_unstable();
    for mm_hash in sorted {
        hasher.push_mm_hash(mm_hash);
    }
    hasher.finish(seed)
}

/// The local hashes of every complete block of `tokens`.
///
/// Block `i` hashes the `block_size + lookahead` tokens starting at
/// `i * block_size`: `lookahead` is 0 for plain workers, 1 for EAGLE (bigram)
/// workers and vLLM lookahead hashing with one token, so a block's hash also
/// covers the token after it. A block without all its tokens is not hashed.
pub fn local_block_hashes(
    tokens: &[u32],
    block_size: usize,
    seed: u64,
    lookahead: usize,
) -> Vec<LocalBlockHash> {
    if block_size == 0 {
        return Vec::new();
    }
    let blocks = tokens.len().saturating_sub(lookahead) / block_size;
    (0..blocks)
        .map(|i| {
            let start = i * block_size;
            local_block_hash(&tokens[start..start + block_size + lookahead], seed)
        })
        .collect()
}

/// The sequence hash of a block given its parent's sequence hash.
pub fn next_sequence_hash(parent: SequenceHash, local: LocalBlockHash) -> SequenceHash {
    let mut bytes = [0u8; 16];
    bytes[..8].copy_from_slice(&parent.0.to_le_bytes());
    bytes[8..].copy_from_slice(&local.0.to_le_bytes());
    SequenceHash(xxh3_64_with_seed(&bytes, HASH_SEED))
}

/// The chained sequence hashes of consecutive blocks starting at the first block.
pub fn sequence_hashes(locals: &[LocalBlockHash]) -> Vec<SequenceHash> {
    let mut out: Vec<SequenceHash> = Vec::with_capacity(locals.len());
    for &local in locals {
        let next = match out.last() {
            None => SequenceHash(local.0),
            Some(&parent) => next_sequence_hash(parent, local),
        };
        out.push(next);
    }
    out
}

/// The 64-bit hash of a multimodal item identifier as published by vLLM.
///
/// vLLM identifiers are hex digests (64 hex characters by default), optionally
/// prefixed with `"{lora_name}:"`. The hash is the first 16 hex digits read as a
/// `u64` (Dynamo's rule); an identifier that does not start with 16 hex digits is
/// hashed with XXH3-64 (seed 0) instead, so every identifier gets a stable value.
pub fn mm_hash_from_identifier(identifier: &str) -> u64 {
    let digest = identifier.rsplit(':').next().unwrap_or(identifier);
    digest
        .get(..16)
        .filter(|head| head.bytes().all(|b| b.is_ascii_hexdigit()))
        .and_then(|head| u64::from_str_radix(head, 16).ok())
        .unwrap_or_else(|| xxh3_64_with_seed(identifier.as_bytes(), 0))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::tokens::pad_value_for_mm_hash;

    fn hashes(values: &[LocalBlockHash]) -> Vec<u64> {
        values.iter().map(|h| h.0).collect()
    }

    #[test]
    fn d1_block_1_to_4() {
        assert_eq!(
            local_block_hash(&[1, 2, 3, 4], HASH_SEED).0,
            14643705804678351452
        );
    }

    #[test]
    fn d2_block_5_to_8() {
        assert_eq!(
            local_block_hash(&[5, 6, 7, 8], HASH_SEED).0,
            16777012769546811212
        );
    }

    #[test]
    fn d3_sequence_hash_chains_two_blocks() {
        let locals = local_block_hashes(&[1, 2, 3, 4, 5, 6, 7, 8], 4, HASH_SEED, 0);
        let seq = sequence_hashes(&locals);
        assert_eq!(seq[0].0, 14643705804678351452);
        assert_eq!(seq[1].0, 4945711292740353085);
    }

    #[test]
    fn d4_d5_lora_seed_and_hashes() {
        let seed = namespace_seed(Some("lora-a"), None);
        assert_eq!(seed, 16914862882262291013);
        let locals = local_block_hashes(&[1, 2, 3, 4, 5, 6, 7, 8], 4, seed, 0);
        assert_eq!(hashes(&locals), [16997879858665117404, 2010082078008787337]);
    }

    #[test]
    fn d6_d7_salt_seed_and_hashes() {
        let seed = namespace_seed(None, Some("tenant-a"));
        assert_eq!(seed, 1948188790972764086);
        let locals = local_block_hashes(&[1, 2, 3, 4, 5, 6, 7, 8], 4, seed, 0);
        assert_eq!(hashes(&locals), [5738685477468498325, 11202231085456067787]);
    }

    #[test]
    fn empty_namespace_strings_count_as_absent() {
        assert_eq!(namespace_seed(Some(""), Some("")), HASH_SEED);
        assert_eq!(namespace_seed(None, None), HASH_SEED);
    }

    #[test]
    fn d8_eagle_windows_overlap_by_one_token() {
        let tokens: Vec<u32> = (1..=9).collect();
        let locals = local_block_hashes(&tokens, 4, HASH_SEED, 1);
        assert_eq!(hashes(&locals), [1914873892905420881, 1929047464662796003]);
    }

    #[test]
    fn d9_legacy_multimodal_block_appends_sorted_item_hashes() {
        let h = local_block_hash_with_mm(&[10, 20, 30, 40], &[7, 3], HASH_SEED);
        assert_eq!(h.0, 13838298027603682952);
    }

    #[test]
    fn d10_pad_value() {
        assert_eq!(pad_value_for_mm_hash(9533257059414191570), 49115154);
    }

    #[test]
    fn stack_and_heap_paths_hash_alike() {
        let tokens: Vec<u32> = (0..300).collect();
        let mut hasher = BlockHasher::new();
        for &t in &tokens[..200] {
            hasher.push_token(t);
        }
        hasher.push_mm_hash(3);
        hasher.push_mm_hash(9);
        assert_eq!(
            local_block_hash_with_mm(&tokens[..200], &[9, 3], HASH_SEED),
            hasher.finish(HASH_SEED)
        );
        for &t in &tokens {
            hasher.push_token(t);
        }
        assert_eq!(
            local_block_hash(&tokens, HASH_SEED),
            hasher.finish(HASH_SEED)
        );
    }

    #[test]
    fn partial_blocks_are_not_hashed() {
        assert_eq!(
            local_block_hashes(&[1, 2, 3, 4, 5], 4, HASH_SEED, 0).len(),
            1
        );
        assert_eq!(local_block_hashes(&[1, 2, 3, 4], 4, HASH_SEED, 1).len(), 0);
        assert!(local_block_hashes(&[1, 2], 0, HASH_SEED, 0).is_empty());
    }

    #[test]
    fn mm_identifiers_use_their_first_16_hex_digits() {
        let id = "f4ee232804f98597174e7cc5a5c2bd7216c2ef44399c6580db2d79d7a86b7f45";
        assert_eq!(mm_hash_from_identifier(id), 0xf4ee232804f98597);
        assert_eq!(
            mm_hash_from_identifier(&format!("sql-adapter:{id}")),
            0xf4ee232804f98597
        );
        let odd = "not-a-digest";
        assert_eq!(
            mm_hash_from_identifier(odd),
            xxh3_64_with_seed(odd.as_bytes(), 0)
        );
    }
}
