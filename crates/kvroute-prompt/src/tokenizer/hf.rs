//! A Hugging Face tokenizer with the fast path: texts cut at added tokens
//! ([`super::split`]) and each piece's ids taken from a bounded cache, so
//! repeated system prompts and earlier chat turns are tokenized once.
//!
//! The ids are always those of `tokenizers::Tokenizer::encode(text, false)`;
//! the parity tests (`tests/parity.rs`) check that on real tokenizer files.
//! When cutting cannot be proved exact the whole text is one piece (still
//! cached: the same text always gives the same ids); when the model is not
//! deterministic (BPE dropout) nothing is cached.

use std::str::FromStr;

use serde_json::Value;

use super::byte_level::ByteLevelPath;
use super::split::{never_prepend, Cut, Plan};
use super::{Piece, TextPath};
use crate::cache::{CacheStats, SegmentCache};

/// A loaded `tokenizer.json` with its cutting plan and cache.
pub(super) struct HfTokenizer {
    /// The tokenizer as configured.
    full: tokenizers::Tokenizer,
    /// The same pipeline with `Metaspace` never prepending, for pieces that
    /// do not start the input (only when the file prepends at offset 0 only).
    not_first: Option<tokenizers::Tokenizer>,
    /// Where texts may be cut; `None`: never (see `unprovable`).
    plan: Option<Plan>,
    /// Why cutting is off, for diagnostics.
    unprovable: Option<String>,
    /// The lean encoder for pieces of a byte-level pipeline (only with a plan:
    /// it must never see an added token).
    byte_level: Option<ByteLevelPath>,
    /// Ids of pieces seen before; `None`: the model is not deterministic.
    cache: Option<SegmentCache>,
    /// See [`HfTokenizer::max_token_bytes`], worked out once.
    max_token_bytes: Option<usize>,
}

impl std::fmt::Debug for HfTokenizer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("HfTokenizer")
            .field("plan", &self.plan)
            .field("unprovable", &self.unprovable)
            .field("cache", &self.cache)
            .finish_non_exhaustive()
    }
}

/// Whether the model samples (BPE dropout), so that equal texts may differ.
fn samples(json: &Value) -> bool {
    json.pointer("/model/dropout")
        .and_then(Value::as_f64)
        .is_some_and(|p| p > 0.0)
}

impl HfTokenizer {
    /// Loads the text of a `tokenizer.json`; `cache_bytes` bounds the cache (0: none).
    pub(super) fn from_json(json: &str, cache_bytes: usize) -> Result<Self, String> {
        let full = tokenizers::Tokenizer::from_str(json).map_err(|e| e.to_string())?;
        let value: Value = serde_json::from_str(json).map_err(|e| e.to_string())?;
        let (plan, unprovable) = match Plan::analyse(&full, &value) {
            Ok(plan) => (Some(plan), None),
            Err(why) => (None, Some(why)),
        };
        let not_first = match &plan {
            Some(p) if p.first_only_prefix => Some(
                tokenizers::Tokenizer::from_str(&never_prepend(&value).to_string())
                    .map_err(|e| e.to_string())?,
            ),
            _ => None,
        };
        let cache = (cache_bytes > 0 && !samples(&value)).then(|| SegmentCache::new(cache_bytes));
        let byte_level = plan
            .as_ref()
            .and_then(|p| ByteLevelPath::analyse(&value, p.hidden_tokens));
        let max_token_bytes = byte_level.as_ref().and_then(|b| {
            let longest = full.get_vocab(true).keys().map(String::len).max()?;
            Some(if b.normalizes() { 3 * longest } else { longest })
        });
        Ok(HfTokenizer {
            full,
            not_first,
            plan,
            unprovable,
            byte_level,
            cache,
            max_token_bytes,
        })
    }

    /// The most bytes of text one token can stand for, when the pipeline
    /// bounds it: a byte-level one (every input byte is a vocabulary
    /// character, so no token covers more text than its string; NFC can
    /// shorten a text at most three times). `None` for other pipelines,
    /// where an unknown word, dropped whitespace or a normalizer can make
    /// one token of any length.
    pub(super) fn max_token_bytes(&self) -> Option<usize> {
        self.max_token_bytes
    }

    /// The id of a token string (vocabulary or added token).
    pub(super) fn token_to_id(&self, token: &str) -> Option<u32> {
        self.full.token_to_id(token)
    }

    /// Appends the ids of `text` (no special tokens added) to `out`.
    pub(super) fn encode_into(&self, text: &str, out: &mut Vec<u64>) -> Result<(), String> {
        match &self.plan {
            // The empty text: whatever the pipeline makes of it, uncached.
            _ if text.is_empty() => self.encode_with(&self.full, text, out),
            None => self.encode_piece(text, true, out),
            Some(plan) => plan.cut(text, |cut| match cut {
                Cut::Added(id) => {
                    out.push(u64::from(id));
                    Ok(())
                }
                Cut::Text { text, at_start } => self.encode_piece(text, at_start, out),
            }),
        }
    }

    /// One piece, from the cache or the tokenizer.
    fn encode_piece(&self, piece: &str, at_start: bool, out: &mut Vec<u64>) -> Result<(), String> {
        // Only a `Metaspace` that prepends at offset 0 alone tells first pieces apart.
        let variant = !at_start && self.not_first.is_some();
        if let Some(ids) = self.cache.as_ref().and_then(|c| c.get(piece, variant)) {
            out.extend(ids.iter().map(|&id| u64::from(id)));
            return Ok(());
        }
        let ids = self.encode_uncached(piece, variant)?;
        out.extend(ids.iter().map(|&id| u64::from(id)));
        if let Some(cache) = &self.cache {
            cache.insert(piece, variant, &ids);
        }
        Ok(())
    }

    /// A piece's ids by the lean byte-level encoder when it applies, else by
    /// `tokenizers` (the pipeline for pieces not at offset 0 if `variant`).
    fn encode_uncached(&self, piece: &str, variant: bool) -> Result<Vec<u32>, String> {
        let mut ids = Vec::new();
        if let (Some(lean), Some(_)) = (&self.byte_level, &self.plan) {
            if lean.encode(self.full.get_model(), piece, &mut ids)? {
                return Ok(ids);
            }
        }
        let tokenizer = match &self.not_first {
            Some(not_first) if variant => not_first,
            _ => &self.full,
        };
        let encoding = tokenizer
            .encode_fast(piece, false)
            .map_err(|e| e.to_string())?;
        Ok(encoding.get_ids().to_vec())
    }

    fn encode_with(
        &self,
        tokenizer: &tokenizers::Tokenizer,
        text: &str,
        out: &mut Vec<u64>,
    ) -> Result<(), String> {
        let encoding = tokenizer
            .encode_fast(text, false)
            .map_err(|e| e.to_string())?;
        out.extend(encoding.get_ids().iter().map(|&id| u64::from(id)));
        Ok(())
    }

    /// The tokens of `text`, each with its own decoded text.
    pub(super) fn pieces(&self, text: &str) -> Result<Vec<Piece>, String> {
        let mut ids = Vec::new();
        self.encode_into(text, &mut ids)?;
        Ok(ids
            .into_iter()
            .map(|id| Piece {
                id,
                text: u32::try_from(id)
                    .ok()
                    .and_then(|id| self.full.decode(&[id], false).ok())
                    .unwrap_or_default(),
            })
            .collect())
    }

    /// Text of `ids` (special tokens skipped), ids taken modulo the vocabulary.
    pub(super) fn decode(&self, ids: &[u32]) -> Option<String> {
        let vocab = u32::try_from(self.full.get_vocab_size(true)).ok()?.max(1);
        let ids: Vec<u32> = ids.iter().map(|&i| i % vocab).collect();
        self.full.decode(&ids, true).ok()
    }

    /// The cache's counters.
    pub(super) fn cache_stats(&self) -> Option<CacheStats> {
        self.cache.as_ref().map(SegmentCache::stats)
    }

    /// How texts are encoded.
    pub(super) fn text_path(&self) -> TextPath {
        TextPath {
            whole_text_reason: self.unprovable.clone(),
            between_words: self.plan.as_ref().is_some_and(|p| p.between_words),
            lean_byte_level: self.byte_level.is_some(),
            cached: self.cache.is_some(),
        }
    }
}
