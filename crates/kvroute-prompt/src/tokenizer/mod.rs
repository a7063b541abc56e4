//! Text to token ids: the documented built-in tokenizer, or a Hugging Face
//! `tokenizer.json`.
//!
//! **Built-in tokenizer** (no file needed; stable across releases because tests
//! and captured traces depend on it):
//! 1. The text is cut into pieces, left to right: a run of alphanumeric
//!    characters (Unicode `is_alphanumeric`) is a word, cut into chunks of at
//!    most 8 characters; one space directly before a word or another
//!    non-space character joins that piece as a prefix (`" word"`); every other
//!    character (punctuation, newline, tab, a second space) is a piece alone.
//! 2. A piece's id is `XXH3-64(piece as UTF-8, seed 0) mod 151643`, so text ids
//!    never collide with the special ids below (Qwen2's numbering).
//!
//! So `"Hello, world"` is the pieces `"Hello"`, `","`, `" world"`: 3 tokens.
//!
//! **A Hugging Face `tokenizer.json`** (cargo feature `hf`): text is encoded
//! as `tokenizers::Tokenizer::encode(text, false)` would encode it (no
//! special tokens added), through a cache of its pieces: `split.rs` says
//! where a text may be cut and why that is exact, `byte_level.rs` how new
//! pieces of byte-level BPE pipelines are encoded, `hf.rs` puts them
//! together. The special ids are looked up by their strings and fall back
//! to the constants below. A `tokenizer_config.json` beside the file supplies
//! the model's chat template ([`crate::chat_template`]).

mod builtin;
#[cfg(feature = "hf")]
mod byte_level;
#[cfg(feature = "hf")]
mod hf;
#[cfg(feature = "hf")]
mod split;

use std::path::Path;

use crate::cache::CacheStats;
use crate::chat_template::ChatTemplate;

/// Built-in text ids lie in `0..TEXT_VOCAB`.
pub const TEXT_VOCAB: u64 = 151_643;
/// `<|im_start|>`.
pub const IM_START: u64 = 151_644;
/// `<|im_end|>`.
pub const IM_END: u64 = 151_645;
/// `<|vision_start|>`.
pub const VISION_START: u64 = 151_652;
/// `<|vision_end|>`.
pub const VISION_END: u64 = 151_653;
/// `<|image_pad|>`: vLLM's placeholder id for image positions.
pub const IMAGE_PAD: u64 = 151_655;
/// `<|video_pad|>`: vLLM's placeholder id for video positions.
pub const VIDEO_PAD: u64 = 151_656;

/// Bytes the segment cache of a Hugging Face tokenizer may hold by default.
pub const DEFAULT_CACHE_BYTES: usize = 64 << 20;

/// The special ids of the ChatML layout and of image spans.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Specials {
    /// `<|im_start|>`.
    pub im_start: u64,
    /// `<|im_end|>`.
    pub im_end: u64,
    /// `<|vision_start|>`.
    pub vision_start: u64,
    /// `<|vision_end|>`.
    pub vision_end: u64,
    /// `<|image_pad|>`.
    pub image_pad: u64,
    /// `<|video_pad|>`.
    pub video_pad: u64,
}

impl Default for Specials {
    fn default() -> Self {
        Specials {
            im_start: IM_START,
            im_end: IM_END,
            vision_start: VISION_START,
            vision_end: VISION_END,
            image_pad: IMAGE_PAD,
            video_pad: VIDEO_PAD,
        }
    }
}

/// A tokenizer failure.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum TokenizerError {
    /// The file could not be loaded.
    #[error("cannot load tokenizer {path}: {message}")]
    Load {
        /// The file.
        path: String,
        /// Why.
        message: String,
    },
    /// `--tokenizer` was given to a build without the `hf` feature.
    #[error("--tokenizer needs kvroute built with `--features hf-tokenizer`")]
    NotBuilt,
    /// Encoding failed.
    #[error("tokenizer failed: {0}")]
    Encode(String),
}

/// One token of a text with the text it decodes to.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Piece {
    /// The id.
    pub id: u64,
    /// Its text (special tokens included as written).
    pub text: String,
}

/// How a Hugging Face tokenizer encodes text (see `split.rs` and
/// `byte_level.rs` for when each step is exact).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TextPath {
    /// Why texts are tokenized whole instead of cut at added tokens (a
    /// configuration under which the cut cannot be proved exact); `None`
    /// when they are cut.
    pub whole_text_reason: Option<String>,
    /// Long pieces are also cut between words, so that prompts sharing a
    /// prefix share its cached chunks.
    pub between_words: bool,
    /// Pieces are encoded by the lean byte-level encoder rather than
    /// `tokenizers`' full pipeline.
    pub lean_byte_level: bool,
    /// Pieces' ids are cached.
    pub cached: bool,
}

#[derive(Debug)]
enum Kind {
    Builtin,
    #[cfg(feature = "hf")]
    Hf(Box<hf::HfTokenizer>),
}

/// A tokenizer with its chat specials and, for a Hugging Face file, the
/// model's chat template.
#[derive(Debug)]
pub struct Tokenizer {
    kind: Kind,
    specials: Specials,
    /// The model's own chat template (`tokenizer_config.json` beside the
    /// `tokenizer.json`), if it has one.
    chat_template: Option<ChatTemplate>,
}

impl Tokenizer {
    /// The documented built-in tokenizer.
    pub fn builtin() -> Self {
        Tokenizer {
            kind: Kind::Builtin,
            specials: Specials::default(),
            chat_template: None,
        }
    }

    /// Loads a Hugging Face `tokenizer.json` and the chat template of the
    /// `tokenizer_config.json` beside it (feature `hf`), with a segment cache
    /// of [`DEFAULT_CACHE_BYTES`].
    pub fn from_file(path: &Path) -> Result<Self, TokenizerError> {
        Self::from_file_with_cache(path, DEFAULT_CACHE_BYTES)
    }

    /// [`Tokenizer::from_file`] with a segment cache of `cache_bytes` (0: none).
    pub fn from_file_with_cache(path: &Path, cache_bytes: usize) -> Result<Self, TokenizerError> {
        let load = |message: String| TokenizerError::Load {
            path: path.display().to_string(),
            message,
        };
        #[cfg(feature = "hf")]
        {
            let json = std::fs::read_to_string(path).map_err(|e| load(e.to_string()))?;
            let template = ChatTemplate::beside(path).map_err(|e| load(e.to_string()))?;
            Self::from_json(&json, template, cache_bytes).map_err(|e| match e {
                TokenizerError::Load { message, .. } => load(message),
                other => other,
            })
        }
        #[cfg(not(feature = "hf"))]
        {
            let _ = (load, cache_bytes);
            Err(TokenizerError::NotBuilt)
        }
    }

    /// A Hugging Face tokenizer from the text of its `tokenizer.json`, with
    /// `chat_template` as the model's template and a segment cache of
    /// `cache_bytes` (0: none).
    #[cfg(feature = "hf")]
    pub fn from_json(
        json: &str,
        chat_template: Option<ChatTemplate>,
        cache_bytes: usize,
    ) -> Result<Self, TokenizerError> {
        let tok = hf::HfTokenizer::from_json(json, cache_bytes).map_err(|message| {
            TokenizerError::Load {
                path: "(json)".into(),
                message,
            }
        })?;
        let lookup = |s: &str, default: u64| tok.token_to_id(s).map_or(default, u64::from);
        let specials = Specials {
            im_start: lookup("<|im_start|>", IM_START),
            im_end: lookup("<|im_end|>", IM_END),
            vision_start: lookup("<|vision_start|>", VISION_START),
            vision_end: lookup("<|vision_end|>", VISION_END),
            image_pad: lookup("<|image_pad|>", IMAGE_PAD),
            video_pad: lookup("<|video_pad|>", VIDEO_PAD),
        };
        Ok(Tokenizer {
            kind: Kind::Hf(Box::new(tok)),
            specials,
            chat_template,
        })
    }

    /// The special ids.
    pub fn specials(&self) -> Specials {
        self.specials
    }

    /// The model's chat template from `tokenizer_config.json`, when one was
    /// found beside the `tokenizer.json`; `None`: the built-in ChatML layout.
    pub fn chat_template(&self) -> Option<&ChatTemplate> {
        self.chat_template.as_ref()
    }

    /// Token ids of a text segment (no special tokens added).
    pub fn encode(&self, text: &str) -> Result<Vec<u64>, TokenizerError> {
        let mut out = Vec::new();
        self.encode_into(text, &mut out)?;
        Ok(out)
    }

    /// [`Tokenizer::encode`], appending to `out` (no intermediate vector).
    pub fn encode_into(&self, text: &str, out: &mut Vec<u64>) -> Result<(), TokenizerError> {
        match &self.kind {
            Kind::Builtin => {
                out.extend(builtin::pieces(text).map(builtin::id));
                Ok(())
            }
            #[cfg(feature = "hf")]
            Kind::Hf(tok) => tok.encode_into(text, out).map_err(TokenizerError::Encode),
        }
    }

    /// The tokens of `text`, each with the text it decodes to on its own
    /// (what the mock engine "generates" from a word list).
    pub fn pieces(&self, text: &str) -> Result<Vec<Piece>, TokenizerError> {
        match &self.kind {
            Kind::Builtin => Ok(builtin::pieces(text)
                .map(|piece| Piece {
                    id: builtin::id(piece),
                    text: piece.to_owned(),
                })
                .collect()),
            #[cfg(feature = "hf")]
            Kind::Hf(tok) => tok.pieces(text).map_err(TokenizerError::Encode),
        }
    }

    /// Text for token ids (special tokens left out), for clients that want
    /// real text: `None` for the built-in tokenizer, whose ids are hashes.
    /// Ids at or above the vocabulary size are taken modulo it.
    pub fn decode(&self, ids: &[u32]) -> Option<String> {
        match &self.kind {
            Kind::Builtin => {
                // Only a Hugging Face tokenizer can decode (and read `ids`).
                let _ = ids;
                None
            }
            #[cfg(feature = "hf")]
            Kind::Hf(tok) => tok.decode(ids),
        }
    }

    /// How a Hugging Face tokenizer's text path runs (for start-up logs and
    /// tests); `None` for the built-in tokenizer.
    pub fn text_path(&self) -> Option<TextPath> {
        match &self.kind {
            Kind::Builtin => None,
            #[cfg(feature = "hf")]
            Kind::Hf(tok) => Some(tok.text_path()),
        }
    }

    /// The most bytes of text (not counting whitespace, which a pipeline
    /// may drop) one token can stand for, when the tokenizer bounds it: so
    /// that a text of more than `context` times that many bytes is known to
    /// be longer than `context` tokens without tokenizing it. The built-in
    /// tokenizer's pieces are at most a space and eight characters.
    pub fn max_token_bytes(&self) -> Option<usize> {
        match &self.kind {
            Kind::Builtin => Some(1 + 8 * 4),
            #[cfg(feature = "hf")]
            Kind::Hf(tok) => tok.max_token_bytes(),
        }
    }

    /// Hits, misses and size of the segment cache; `None` without one.
    pub fn cache_stats(&self) -> Option<CacheStats> {
        match &self.kind {
            Kind::Builtin => None,
            #[cfg(feature = "hf")]
            Kind::Hf(tok) => tok.cache_stats(),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn builtin_ids_are_stable_and_below_the_specials() {
        let t = Tokenizer::builtin();
        let ids = t.encode("Hello, world").expect("builtin never fails");
        assert_eq!(ids.len(), 3);
        assert!(ids.iter().all(|&id| id < TEXT_VOCAB));
        assert_eq!(ids, t.encode("Hello, world").expect("same"));
        // Pinned so that a change of the documented algorithm is noticed.
        assert_eq!(
            ids[0],
            xxhash_rust::xxh3::xxh3_64_with_seed(b"Hello", 0) % TEXT_VOCAB
        );
    }

    #[test]
    fn builtin_pieces_carry_their_text_and_ids() {
        let t = Tokenizer::builtin();
        let pieces = t.pieces(" lorem ipsum").expect("builtin");
        let texts: Vec<&str> = pieces.iter().map(|p| p.text.as_str()).collect();
        assert_eq!(texts, [" lorem", " ipsum"]);
        let ids: Vec<u64> = pieces.iter().map(|p| p.id).collect();
        assert_eq!(ids, t.encode(" lorem ipsum").expect("builtin"));
        assert!(t.cache_stats().is_none());
    }

    #[cfg(feature = "hf")]
    #[test]
    fn a_hugging_face_word_level_tokenizer_loads_and_encodes() {
        let mut vocab = serde_json::Map::new();
        vocab.insert("[UNK]".into(), 0.into());
        for (i, w) in ["hello", "world", "<|im_start|>"].iter().enumerate() {
            vocab.insert((*w).into(), (i + 1).into());
        }
        let json = serde_json::json!({
            "version": "1.0", "truncation": null, "padding": null, "added_tokens": [],
            "normalizer": null, "pre_tokenizer": {"type": "Whitespace"},
            "post_processor": null, "decoder": null,
            "model": {"type": "WordLevel", "vocab": vocab, "unk_token": "[UNK]"},
        });
        let path = std::env::temp_dir().join(format!("kvroute-prompt-{}.json", std::process::id()));
        std::fs::write(&path, json.to_string()).expect("write");
        let t = Tokenizer::from_file(&path).expect("loads");
        let _ = std::fs::remove_file(&path);
        assert_eq!(t.encode("hello world").expect("encodes"), [1, 2]);
        assert_eq!(t.decode(&[1, 2]).as_deref(), Some("hello world"));
        // Ids past the vocabulary wrap around instead of failing.
        assert!(t.decode(&[1, 2, 150_000]).is_some());
        assert!(Tokenizer::builtin().decode(&[1]).is_none());
        assert_eq!(t.specials().im_start, 3);
        assert_eq!(t.specials().im_end, IM_END);
        let pieces = t.pieces("hello world").expect("encodes");
        assert_eq!(
            pieces,
            [
                Piece {
                    id: 1,
                    text: "hello".into()
                },
                Piece {
                    id: 2,
                    text: "world".into()
                }
            ]
        );
    }

    #[test]
    fn a_missing_feature_or_file_is_an_error() {
        let err = Tokenizer::from_file(Path::new("/nonexistent/tokenizer.json"))
            .expect_err("no such file");
        assert!(matches!(
            err,
            TokenizerError::NotBuilt | TokenizerError::Load { .. }
        ));
    }
}
