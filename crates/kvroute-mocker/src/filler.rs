//! The deterministic text the mock engine "generates".
//!
//! Generated tokens are words drawn from a fixed list of 32 lorem ipsum
//! words, by a generator seeded with `--seed` and a hash of the prompt
//! tokens, so the same prompt and seed always give the same text (like greedy
//! decoding) and different prompts give different text. Each word is
//! tokenized once, by the engine's tokenizer, into tokens that carry their
//! own text.

use kvroute_core::rng::SplitMix64;
use kvroute_prompt::{Tokenizer, TokenizerError};
use xxhash_rust::xxh3::xxh3_64_with_seed;

/// The words generated text is made of.
pub const FILLER_WORDS: [&str; 32] = [
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

/// One generated token and its text.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct FillerToken {
    /// The id.
    pub id: u64,
    /// The text it decodes to.
    pub text: String,
}

/// Why a tokenizer cannot generate filler.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum FillerError {
    /// Every filler word encodes to no tokens.
    #[error("the tokenizer encodes the filler words to nothing")]
    Empty,
    /// The tokenizer failed on a filler word.
    #[error(transparent)]
    Tokenizer(#[from] TokenizerError),
}

/// The filler words as one tokenizer's tokens.
#[derive(Debug, Clone)]
pub struct Filler {
    /// Each word that has tokens, as its tokens.
    words: Vec<Vec<FillerToken>>,
}

impl Filler {
    /// The filler words tokenized by `tokenizer` (words without tokens left out).
    pub fn new(tokenizer: &Tokenizer) -> Result<Self, FillerError> {
        let mut words = Vec::with_capacity(FILLER_WORDS.len());
        for word in FILLER_WORDS {
            let tokens: Vec<FillerToken> = tokenizer
                .pieces(word)?
                .into_iter()
                .map(|p| FillerToken {
                    id: p.id,
                    text: p.text,
                })
                .collect();
            if !tokens.is_empty() {
                words.push(tokens);
            }
        }
        if words.is_empty() {
            return Err(FillerError::Empty);
        }
        Ok(Filler { words })
    }

    /// `n` filler tokens for a prompt: the same `seed` and prompt always give the same tokens.
    pub fn tokens(&self, seed: u64, prompt: &[u64], n: usize) -> Vec<FillerToken> {
        let mut bytes = Vec::with_capacity(prompt.len() * 8);
        for &t in prompt {
            bytes.extend_from_slice(&t.to_le_bytes());
        }
        let mut rng = SplitMix64::new(seed ^ xxh3_64_with_seed(&bytes, 0));
        let mut out = Vec::new();
        while out.len() < n {
            let word = &self.words[rng.below(self.words.len())];
            for t in word {
                if out.len() < n {
                    out.push(t.clone());
                }
            }
        }
        out
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn filler_is_deterministic_per_seed_and_prompt() {
        let t = Tokenizer::builtin();
        let filler = Filler::new(&t).expect("builtin");
        let a = filler.tokens(1, &[1, 2, 3], 20);
        assert_eq!(a.len(), 20);
        assert_eq!(a, filler.tokens(1, &[1, 2, 3], 20));
        assert_ne!(a, filler.tokens(2, &[1, 2, 3], 20));
        assert_ne!(a, filler.tokens(1, &[1, 2, 4], 20));
        // Filler text tokenizes back to the filler ids.
        let text: String = a.iter().map(|f| f.text.as_str()).collect();
        let ids: Vec<u64> = a.iter().map(|f| f.id).collect();
        assert_eq!(t.encode(&text).expect("builtin"), ids);
    }

    #[cfg(feature = "hf-tokenizer")]
    #[test]
    fn a_hugging_face_tokenizer_generates_its_own_filler_ids() {
        let mut vocab = serde_json::Map::new();
        vocab.insert("[UNK]".into(), 0.into());
        for (i, w) in FILLER_WORDS.iter().enumerate() {
            vocab.insert(w.trim().into(), (i + 10).into());
        }
        let json = serde_json::json!({
            "version": "1.0", "truncation": null, "padding": null, "added_tokens": [],
            "normalizer": null, "pre_tokenizer": {"type": "Whitespace"},
            "post_processor": null, "decoder": null,
            "model": {"type": "WordLevel", "vocab": vocab, "unk_token": "[UNK]"},
        });
        let t = Tokenizer::from_json(&json.to_string(), None, 0).expect("loads");
        let filler = Filler::new(&t).expect("filler");
        let tokens = filler.tokens(0, &[1, 2], 5);
        assert!(tokens.iter().all(|f| (10..42).contains(&f.id)));
        assert!(tokens
            .iter()
            .all(|f| FILLER_WORDS.contains(&format!(" {}", f.text).as_str())));
    }
}
