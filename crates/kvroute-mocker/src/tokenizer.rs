//! Text to token ids, and the deterministic filler the mocker "generates".
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
//! **`--tokenizer tokenizer.json`** (cargo feature `hf-tokenizer`): a Hugging
//! Face tokenizer encodes text segments (no special tokens added); the special
//! ids are looked up by their strings and fall back to the constants below.
//!
//! **Chat template**: with `--tokenizer tokenizer.json` and a
//! `tokenizer_config.json` beside it that has a `chat_template`, text-only
//! chats are rendered with that template (see [`crate::chat_template`]) and the
//! text is tokenized; otherwise (and for chats with images) every message becomes
//! `<|im_start|>` + text(`"{role}\n"`) + content + `<|im_end|>` + text(`"\n"`),
//! then `<|im_start|>` + text(`"assistant\n"`); an image in the content becomes
//! `<|vision_start|>`, its placeholder span (see [`crate::multimodal`]), `<|vision_end|>`.
//!
//! **Filler**: generated tokens are words drawn from a fixed list of 32 lorem
//! ipsum words, by a generator seeded with `--seed` and a hash of the prompt
//! tokens, so the same prompt and seed always give the same text (like greedy
//! decoding) and different prompts give different text.

use std::path::Path;

use xxhash_rust::xxh3::xxh3_64_with_seed;

use kvroute_core::rng::SplitMix64;

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

/// Longest word chunk of the built-in tokenizer, in characters.
const MAX_WORD_CHARS: usize = 8;

const FILLER_WORDS: [&str; 32] = [
    " lorem",
    " ipsum",
    " dolor",
    " sit",
    " amet",
    " consectetur",
    " adipiscing",
    " elit",
    " sed",
    " do",
    " eiusmod",
    " tempor",
    " incididunt",
    " ut",
    " labore",
    " et",
    " dolore",
    " magna",
    " aliqua",
    " enim",
    " ad",
    " minim",
    " veniam",
    " quis",
    " nostrud",
    " exercitation",
    " ullamco",
    " laboris",
    " nisi",
    " aliquip",
    " ex",
    " ea",
];

/// The special ids of a tokenizer's chat template.
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
}

impl Default for Specials {
    fn default() -> Self {
        Specials {
            im_start: IM_START,
            im_end: IM_END,
            vision_start: VISION_START,
            vision_end: VISION_END,
            image_pad: IMAGE_PAD,
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
    /// `--tokenizer` was given to a build without the `hf-tokenizer` feature.
    #[error("--tokenizer needs kvroute built with `--features hf-tokenizer`")]
    NotBuilt,
    /// Encoding failed.
    #[error("tokenizer failed: {0}")]
    Encode(String),
}

/// One generated token and its text.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct FillerToken {
    /// The id.
    pub id: u64,
    /// The text it decodes to.
    pub text: String,
}

#[derive(Debug)]
enum Kind {
    Builtin,
    #[cfg(feature = "hf-tokenizer")]
    Hf(Box<tokenizers::Tokenizer>),
}

/// A tokenizer with its chat specials and filler vocabulary.
#[derive(Debug)]
pub struct Tokenizer {
    kind: Kind,
    specials: Specials,
    /// The model's own chat template (`tokenizer_config.json` beside the
    /// `tokenizer.json`), if it has one.
    chat_template: Option<crate::chat_template::ChatTemplate>,
    /// Each filler word as its tokens.
    filler_words: Vec<Vec<FillerToken>>,
}

impl Tokenizer {
    /// The documented built-in tokenizer.
    pub fn builtin() -> Self {
        let filler_words = FILLER_WORDS
            .iter()
            .map(|w| {
                builtin_pieces(w)
                    .map(|piece| FillerToken {
                        id: builtin_id(piece),
                        text: piece.to_owned(),
                    })
                    .collect()
            })
            .collect();
        Tokenizer {
            kind: Kind::Builtin,
            specials: Specials::default(),
            chat_template: None,
            filler_words,
        }
    }

    /// Loads a Hugging Face `tokenizer.json` (feature `hf-tokenizer`).
    pub fn from_file(path: &Path) -> Result<Self, TokenizerError> {
        #[cfg(feature = "hf-tokenizer")]
        {
            let tok = tokenizers::Tokenizer::from_file(path).map_err(|e| TokenizerError::Load {
                path: path.display().to_string(),
                message: e.to_string(),
            })?;
            let lookup = |s: &str, default: u64| tok.token_to_id(s).map_or(default, u64::from);
            let specials = Specials {
                im_start: lookup("<|im_start|>", IM_START),
                im_end: lookup("<|im_end|>", IM_END),
                vision_start: lookup("<|vision_start|>", VISION_START),
                vision_end: lookup("<|vision_end|>", VISION_END),
                image_pad: lookup("<|image_pad|>", IMAGE_PAD),
            };
            let mut filler_words = Vec::with_capacity(FILLER_WORDS.len());
            for word in FILLER_WORDS {
                let enc = tok
                    .encode(word, false)
                    .map_err(|e| TokenizerError::Encode(e.to_string()))?;
                let tokens: Vec<FillerToken> = enc
                    .get_ids()
                    .iter()
                    .map(|&id| FillerToken {
                        id: u64::from(id),
                        text: tok.decode(&[id], false).unwrap_or_default(),
                    })
                    .collect();
                if !tokens.is_empty() {
                    filler_words.push(tokens);
                }
            }
            if filler_words.is_empty() {
                return Err(TokenizerError::Load {
                    path: path.display().to_string(),
                    message: "the tokenizer encodes the filler words to nothing".into(),
                });
            }
            let chat_template = crate::chat_template::ChatTemplate::beside(path).map_err(|e| {
                TokenizerError::Load {
                    path: path.display().to_string(),
                    message: e.to_string(),
                }
            })?;
            Ok(Tokenizer {
                kind: Kind::Hf(Box::new(tok)),
                specials,
                chat_template,
                filler_words,
            })
        }
        #[cfg(not(feature = "hf-tokenizer"))]
        {
            let _ = path;
            Err(TokenizerError::NotBuilt)
        }
    }

    /// The chat template's special ids.
    pub fn specials(&self) -> Specials {
        self.specials
    }

    /// The model's chat template from `tokenizer_config.json`, when one was
    /// found beside the `tokenizer.json`; `None`: the built-in ChatML layout.
    pub fn chat_template(&self) -> Option<&crate::chat_template::ChatTemplate> {
        self.chat_template.as_ref()
    }

    /// Token ids of a text segment (no special tokens added).
    pub fn encode(&self, text: &str) -> Result<Vec<u64>, TokenizerError> {
        match &self.kind {
            Kind::Builtin => Ok(builtin_pieces(text).map(builtin_id).collect()),
            #[cfg(feature = "hf-tokenizer")]
            Kind::Hf(tok) => tok
                .encode(text, false)
                .map(|enc| enc.get_ids().iter().map(|&id| u64::from(id)).collect())
                .map_err(|e| TokenizerError::Encode(e.to_string())),
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
            #[cfg(feature = "hf-tokenizer")]
            Kind::Hf(tok) => {
                let vocab = u32::try_from(tok.get_vocab_size(true)).ok()?.max(1);
                let ids: Vec<u32> = ids.iter().map(|&i| i % vocab).collect();
                tok.decode(&ids, true).ok()
            }
        }
    }

    /// `n` filler tokens for a prompt: the same `seed` and prompt always give the same tokens.
    pub fn filler(&self, seed: u64, prompt: &[u64], n: usize) -> Vec<FillerToken> {
        let mut bytes = Vec::with_capacity(prompt.len() * 8);
        for &t in prompt {
            bytes.extend_from_slice(&t.to_le_bytes());
        }
        let mut rng = SplitMix64::new(seed ^ xxh3_64_with_seed(&bytes, 0));
        let mut out = Vec::with_capacity(n);
        while out.len() < n {
            let word = &self.filler_words[rng.below(self.filler_words.len())];
            for t in word {
                if out.len() < n {
                    out.push(t.clone());
                }
            }
        }
        out
    }
}

/// The built-in id of one piece.
fn builtin_id(piece: &str) -> u64 {
    xxh3_64_with_seed(piece.as_bytes(), 0) % TEXT_VOCAB
}

/// The built-in tokenizer's pieces of `text`.
fn builtin_pieces(text: &str) -> impl Iterator<Item = &str> {
    let mut rest = text;
    std::iter::from_fn(move || {
        let mut chars = rest.char_indices();
        let (_, first) = chars.next()?;
        // A single space joins the piece that follows it, unless that is whitespace too.
        let lead = match (first, chars.next()) {
            (' ', Some((i, c))) if !c.is_whitespace() => {
                debug_assert_eq!(i, 1);
                1
            }
            _ => 0,
        };
        let body = &rest[lead..];
        let first_is_word = body.chars().next().is_some_and(char::is_alphanumeric);
        let mut end = lead;
        for (n, (i, c)) in body.char_indices().enumerate() {
            // A word takes up to MAX_WORD_CHARS alphanumerics; anything else is one character.
            let continues = if first_is_word {
                n < MAX_WORD_CHARS && c.is_alphanumeric()
            } else {
                n == 0
            };
            if !continues {
                break;
            }
            end = lead + i + c.len_utf8();
        }
        let (piece, tail) = rest.split_at(end);
        rest = tail;
        Some(piece)
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn pieces(text: &str) -> Vec<&str> {
        builtin_pieces(text).collect()
    }

    #[test]
    fn pieces_follow_the_documented_rules() {
        assert_eq!(pieces("Hello, world"), ["Hello", ",", " world"]);
        assert_eq!(pieces("a  b\n"), ["a", " ", " b", "\n"]);
        assert_eq!(
            pieces("internationalization"),
            ["internat", "ionaliza", "tion"]
        );
        assert_eq!(pieces(" ünïcode!"), [" ünïcode", "!"]);
        assert_eq!(pieces(" "), [" "]);
        assert_eq!(pieces(""), Vec::<&str>::new());
        assert_eq!(pieces("x ."), ["x", " ."]);
    }

    #[test]
    fn pieces_cover_the_text_exactly() {
        let text = "  Tabs\tand  spaces, ünïcode 😀 and numbers 1234567890123!\n";
        assert_eq!(pieces(text).concat(), text);
    }

    #[test]
    fn builtin_ids_are_stable_and_below_the_specials() {
        let t = Tokenizer::builtin();
        let ids = t.encode("Hello, world").expect("builtin never fails");
        assert_eq!(ids.len(), 3);
        assert!(ids.iter().all(|&id| id < TEXT_VOCAB));
        assert_eq!(ids, t.encode("Hello, world").expect("same"));
        // Pinned so that a change of the documented algorithm is noticed.
        assert_eq!(ids[0], xxh3_64_with_seed(b"Hello", 0) % TEXT_VOCAB);
    }

    #[test]
    fn filler_is_deterministic_per_seed_and_prompt() {
        let t = Tokenizer::builtin();
        let a = t.filler(1, &[1, 2, 3], 20);
        assert_eq!(a.len(), 20);
        assert_eq!(a, t.filler(1, &[1, 2, 3], 20));
        assert_ne!(a, t.filler(2, &[1, 2, 3], 20));
        assert_ne!(a, t.filler(1, &[1, 2, 4], 20));
        // Filler text tokenizes back to the filler ids.
        let text: String = a.iter().map(|f| f.text.as_str()).collect();
        let ids: Vec<u64> = a.iter().map(|f| f.id).collect();
        assert_eq!(t.encode(&text).expect("builtin"), ids);
    }

    #[cfg(feature = "hf-tokenizer")]
    #[test]
    fn a_hugging_face_word_level_tokenizer_loads_and_encodes() {
        let mut vocab = serde_json::Map::new();
        vocab.insert("[UNK]".into(), 0.into());
        for (i, w) in ["hello", "world", "<|im_start|>"].iter().enumerate() {
            vocab.insert((*w).into(), (i + 1).into());
        }
        for (i, w) in FILLER_WORDS.iter().enumerate() {
            vocab.insert(w.trim().into(), (i + 10).into());
        }
        let json = serde_json::json!({
            "version": "1.0", "truncation": null, "padding": null, "added_tokens": [],
            "normalizer": null, "pre_tokenizer": {"type": "Whitespace"},
            "post_processor": null, "decoder": null,
            "model": {"type": "WordLevel", "vocab": vocab, "unk_token": "[UNK]"},
        });
        let path = std::env::temp_dir().join(format!("kvroute-mocker-{}.json", std::process::id()));
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
        let filler = t.filler(0, &[1, 2], 5);
        assert!(filler.iter().all(|f| (10..42).contains(&f.id)));
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
