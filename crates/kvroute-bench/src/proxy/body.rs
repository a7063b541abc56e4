//! The request bodies of `kvroute bench proxy`: completions whose prompt is
//! a prefix shared by one request in 8, then a suffix unique to the request
//! and to its path (direct or routed), as token ids or as text.

use std::sync::Arc;

use kvroute_core::rng::SplitMix64;
use serde_json::{json, Value};

use crate::workload::{render_words, TextRenderer, TEXT_VOCAB};

/// Prefix groups: request `n` shares its prefix with every request `n ± 8k`.
const GROUPS: u64 = 8;

/// Makes request `n`'s body for one path.
#[derive(Debug, Clone)]
pub(crate) enum Bodies {
    /// `"prompt": [ids…]` of `tokens` ids.
    TokenIds {
        /// Prompt length.
        tokens: u32,
    },
    /// `"prompt": "text"` of `words` words; the prefixes rendered once.
    Text {
        /// Prompt length in words (ids rendered, see [`Bodies::text`]).
        words: u32,
        /// Each group's prefix, rendered.
        prefixes: Arc<Vec<String>>,
        /// How ids become text; `None`: one four-letter word per id, one
        /// token each for the mocker's built-in tokenizer.
        render: Option<TextRenderer>,
        /// Every request of a path sends the same prompt.
        repeat: bool,
    },
}

impl Bodies {
    /// Text prompts of `words` words, rendered by `render` (a tokenizer's
    /// decoding) or as built-in words.
    pub(crate) fn text(words: u32, render: Option<TextRenderer>, repeat: bool) -> Self {
        let prefixes = (0..GROUPS)
            .map(|g| render_ids(&render, &seeded_ids(g, words / 2)))
            .collect();
        Bodies::Text {
            words,
            prefixes: Arc::new(prefixes),
            render,
            repeat,
        }
    }

    /// Request `n`'s body on `path` (0: direct, 1: routed, so that the two
    /// paths of an interleaved run do not warm each other's caches).
    pub(crate) fn body(&self, n: u64, path: u32) -> Value {
        match self {
            Bodies::TokenIds { tokens } => token_id_body(n, *tokens, path),
            Bodies::Text {
                words,
                prefixes,
                render,
                repeat,
            } => {
                let n = if *repeat { 0 } else { n };
                let suffix = words - words / 2;
                let unique = seeded_ids((1 << 40) | (u64::from(path) << 39) | n, suffix);
                let mut prompt = prefixes[(n % GROUPS) as usize].clone();
                prompt.push_str(&render_ids(render, &unique));
                json!({"model": "mock-model", "prompt": prompt, "max_tokens": 1})
            }
        }
    }
}

/// The token-id body: the prefix `g·100,000 + 0..half` of group `g = n mod
/// 8`, then ids unique to `n` and `path`.
fn token_id_body(n: u64, prompt_tokens: u32, path: u32) -> Value {
    let half = prompt_tokens / 2;
    let prefix = (n % GROUPS) as u32 * 100_000;
    let mut prompt: Vec<u32> = (prefix..prefix + half).collect();
    let unique = 1_000_000 + n as u32 * prompt_tokens + path * 500_000_000;
    prompt.extend(unique..unique + (prompt_tokens - half));
    json!({"model": "mock-model", "prompt": prompt, "max_tokens": 1})
}

/// `count` text ids drawn from a generator seeded with `seed`.
fn seeded_ids(seed: u64, count: u32) -> Vec<u32> {
    let mut rng = SplitMix64::new(seed ^ 0x7e57_b0d1);
    (0..count)
        .map(|_| (rng.next_u64() % TEXT_VOCAB) as u32)
        .collect()
}

fn render_ids(render: &Option<TextRenderer>, ids: &[u32]) -> String {
    match render {
        Some(render) => (render.0)(ids),
        None => render_words(ids),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn prompt_text(v: &Value) -> String {
        v["prompt"].as_str().expect("text").to_owned()
    }

    #[test]
    fn token_id_prompts_share_the_group_prefix_and_nothing_else() {
        let bodies = Bodies::TokenIds { tokens: 16 };
        let ids = |n, path| -> Vec<u64> {
            bodies.body(n, path)["prompt"]
                .as_array()
                .expect("ids")
                .iter()
                .map(|v| v.as_u64().expect("id"))
                .collect()
        };
        let (a, b) = (ids(3, 0), ids(11, 0));
        assert_eq!(a.len(), 16);
        assert_eq!(a[..8], b[..8]);
        assert_ne!(a[8..], b[8..]);
        assert_eq!(a[0], 300_000);
        assert_ne!(ids(3, 1)[8..], a[8..], "the paths never share a suffix");
        assert_ne!(ids(4, 0)[..8], a[..8]);
    }

    #[test]
    fn text_prompts_have_the_words_asked_for_and_share_the_group_prefix() {
        let bodies = Bodies::text(64, None, false);
        let (a, b) = (
            prompt_text(&bodies.body(2, 0)),
            prompt_text(&bodies.body(10, 0)),
        );
        assert_eq!(a.split_whitespace().count(), 64);
        let words = |s: &str| s.split_whitespace().map(str::to_owned).collect::<Vec<_>>();
        assert_eq!(words(&a)[..32], words(&b)[..32]);
        assert_ne!(words(&a)[32..], words(&b)[32..]);
        assert_ne!(prompt_text(&bodies.body(2, 1)), a);
        assert_eq!(bodies.body(2, 0)["max_tokens"], 1);
        let render = TextRenderer(Arc::new(|ids: &[u32]| format!("<{}>", ids.len())));
        let rendered = Bodies::text(10, Some(render), false);
        assert_eq!(prompt_text(&rendered.body(0, 0)), "<5><5>");
    }
}
