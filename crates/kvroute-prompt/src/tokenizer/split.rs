//! Where a Hugging Face tokenizer's output provably does not depend on the
//! text around a cut: at its added tokens.
//!
//! `tokenizers` encodes a text in two passes over its added tokens before
//! anything else (`AddedVocabulary::extract_and_normalize`): it cuts the raw
//! text at every added token with `normalized: false` (leftmost-longest
//! matching), then normalises each piece between them and cuts it again at
//! the tokens with `normalized: true`. Every piece left between added tokens
//! is pre-tokenized and run through the model on its own. So the ids of a
//! text are the concatenation of the ids of its pieces, and a piece's ids can
//! be computed once and reused wherever the same piece appears, **provided**:
//!
//! * no added token has `lstrip`, `rstrip` or `single_word` (they move or
//!   veto cuts depending on the neighbours), and special tokens are not
//!   encoded as text (`encode_special_tokens`);
//! * no truncation or padding is configured (they act on the whole encoding);
//! * the pre-tokenizer is built only from the known per-piece components:
//!   every one except `Metaspace` with `prepend_scheme: "first"` ignores where
//!   its piece sat in the text. That one prepends `▁` only to a piece at
//!   offset 0 of the input, so a piece elsewhere must be encoded as if it were
//!   not first: with a copy of the pipeline whose scheme is `"never"`.
//!
//! The second pass (at `normalized: true` tokens) is repeated here only when
//! there is no normaliser, since it runs on normalised text; otherwise those
//! tokens stay inside their piece, where `tokenizers` finds them itself.
//! [`Plan::analyse`] checks all of this on the loaded tokenizer and its JSON,
//! and says why when a cut cannot be proved (then the whole text is one piece).
//!
//! **Between words, for byte-level BPE.** A long piece (a completion prompt
//! has no added tokens at all) is also cut into chunks of about
//! [`CHUNK_BYTES`], so that prompts sharing a prefix share its chunks, when
//! the pipeline is one whose pre-tokenizer is known to split there:
//! GPT-2's `ByteLevel` regex, or a `Split` with Qwen2's or Llama 3's
//! (cl100k) regex followed by a regex-less `ByteLevel`, neither adding a
//! prefix space; a normaliser of only NFC/NFD/NFKC/NFKD/Lowercase (or none);
//! no `normalized: true` added token left inside pieces. A chunk ends before
//! a space that has an ASCII letter on each side (`"word| word"`). Why that
//! is exact: those regexes have no look-behind, anchors or word boundaries, so
//! a match at a position depends only on the text after it; the match holding
//! the letter before the space is a letter run (or a contraction ending in
//! that letter) and ends at the space, since no alternative crosses from a
//! letter into a space; every look-ahead inside the first chunk (`\s+(?!\S)`
//! ends on whitespace, followed by a character of the chunk) sees the same
//! character alone as in context; and from the space on, `" word"` is
//! matched the same way in both. The normalisers listed map an ASCII letter
//! or space to itself (or a letter) and compose nothing across them, and the
//! model runs per pre-token. Other pipelines are cut at added tokens only.

use daachorse::{DoubleArrayAhoCorasick, DoubleArrayAhoCorasickBuilder, MatchKind};
use serde_json::Value;

/// Pre-tokenizers that treat each piece on its own, whatever its position.
const PER_PIECE_PRE_TOKENIZERS: &[&str] = &[
    "BertPreTokenizer",
    "ByteLevel",
    "CharDelimiterSplit",
    "Digits",
    "FixedLength",
    "Metaspace",
    "Punctuation",
    "Split",
    "UnicodeScripts",
    "Whitespace",
    "WhitespaceSplit",
];

/// Bytes a chunk of a long piece reaches before it may end (between words).
pub(super) const CHUNK_BYTES: usize = 256;

/// Pre-tokenizer regexes after which text splits before `" word"` (module docs).
const WORD_SPLITTING_REGEXES: &[&str] = &[
    // Qwen2 / Qwen2.5 / Qwen3.
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+",
    // Llama 3 and cl100k.
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+",
];

/// Normalisers that keep an ASCII letter or space what it is and compose
/// nothing across them.
const LOCAL_NORMALIZERS: &[&str] = &["NFC", "NFD", "NFKC", "NFKD", "Lowercase"];

/// One piece of a cut text.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum Cut<'t> {
    /// An added token, by id.
    Added(u32),
    /// Text between added tokens; `at_start`: it begins at byte 0 of the input.
    Text {
        /// The piece.
        text: &'t str,
        /// Whether the piece starts the input.
        at_start: bool,
    },
}

/// How to cut texts for one tokenizer.
pub(super) struct Plan {
    /// Added tokens matched on the raw text (`normalized: false`).
    raw: Option<DoubleArrayAhoCorasick<u32>>,
    /// Added tokens matched inside each raw piece (`normalized: true`; only
    /// without a normaliser).
    normalized: Option<DoubleArrayAhoCorasick<u32>>,
    /// A piece not at offset 0 needs the `prepend_scheme: "never"` pipeline.
    pub(super) first_only_prefix: bool,
    /// Long pieces may be cut between words (module docs).
    pub(super) between_words: bool,
    /// Added tokens may hide inside pieces (`normalized: true` with a
    /// normaliser): only the full pipeline finds them.
    pub(super) hidden_tokens: bool,
}

impl std::fmt::Debug for Plan {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Plan")
            .field("raw", &self.raw.is_some())
            .field("normalized", &self.normalized.is_some())
            .field("first_only_prefix", &self.first_only_prefix)
            .field("between_words", &self.between_words)
            .finish()
    }
}

fn trie(patterns: Vec<(String, u32)>) -> Result<Option<DoubleArrayAhoCorasick<u32>>, String> {
    if patterns.is_empty() {
        return Ok(None);
    }
    DoubleArrayAhoCorasickBuilder::new()
        .match_kind(MatchKind::LeftmostLongest)
        .build_with_values(patterns)
        .map(Some)
        .map_err(|e| format!("added tokens: {e}"))
}

/// Whether the pre-tokenizer (JSON) only has per-piece components, and
/// whether one of them is a `Metaspace` with `prepend_scheme: "first"`.
fn pre_tokenizer_is_per_piece(value: &Value, first_only: &mut bool) -> Result<(), String> {
    match value {
        Value::Null => Ok(()),
        Value::Object(o) => match o.get("type").and_then(Value::as_str) {
            Some("Sequence") => match o.get("pretokenizers") {
                Some(Value::Array(items)) => items
                    .iter()
                    .try_for_each(|p| pre_tokenizer_is_per_piece(p, first_only)),
                _ => Err("a pre-tokenizer Sequence without `pretokenizers`".into()),
            },
            Some("Metaspace") => {
                if o.get("prepend_scheme").and_then(Value::as_str) == Some("first") {
                    *first_only = true;
                }
                Ok(())
            }
            Some(t) if PER_PIECE_PRE_TOKENIZERS.contains(&t) => Ok(()),
            Some(t) => Err(format!("pre-tokenizer `{t}` is not known to be per-piece")),
            None => Err("a pre-tokenizer without `type`".into()),
        },
        _ => Err("the pre-tokenizer is not an object".into()),
    }
}

fn is_type(value: &Value, t: &str) -> bool {
    value.get("type").and_then(Value::as_str) == Some(t)
}

/// A `ByteLevel` pre-tokenizer without a prefix space, using its own regex
/// or not.
fn is_byte_level(value: &Value, regex: bool) -> bool {
    is_type(value, "ByteLevel")
        && value.get("add_prefix_space").and_then(Value::as_bool) == Some(false)
        && value
            .get("use_regex")
            .and_then(Value::as_bool)
            .unwrap_or(true)
            == regex
}

/// Whether the normaliser and pre-tokenizer (JSON) split text before `" word"`.
fn splits_between_words(json: &Value) -> bool {
    let normalizer_is_local = |n: &Value| match n.get("type").and_then(Value::as_str) {
        Some("Sequence") => n
            .get("normalizers")
            .and_then(Value::as_array)
            .is_some_and(|list| {
                list.iter().all(|n| {
                    n.get("type")
                        .and_then(Value::as_str)
                        .is_some_and(|t| LOCAL_NORMALIZERS.contains(&t))
                })
            }),
        Some(t) => LOCAL_NORMALIZERS.contains(&t),
        None => false,
    };
    let normalizer = json.get("normalizer").unwrap_or(&Value::Null);
    if !normalizer.is_null() && !normalizer_is_local(normalizer) {
        return false;
    }
    let pre = json.get("pre_tokenizer").unwrap_or(&Value::Null);
    if is_byte_level(pre, true) {
        return true;
    }
    let Some([split, byte_level]) = pre
        .get("pretokenizers")
        .and_then(Value::as_array)
        .map(Vec::as_slice)
    else {
        return false;
    };
    is_type(pre, "Sequence")
        && is_type(split, "Split")
        && split.get("behavior").and_then(Value::as_str) == Some("Isolated")
        && split.get("invert").and_then(Value::as_bool) == Some(false)
        && split
            .pointer("/pattern/Regex")
            .and_then(Value::as_str)
            .is_some_and(|r| WORD_SPLITTING_REGEXES.contains(&r))
        && is_byte_level(byte_level, false)
}

/// The end of the chunk of `piece` that starts at `start`: the first
/// `"word| word"` boundary at least [`CHUNK_BYTES`] on, else the piece's end.
fn chunk_end(piece: &str, start: usize) -> usize {
    let bytes = piece.as_bytes();
    let from = start.saturating_add(CHUNK_BYTES).max(1);
    (from..bytes.len().saturating_sub(1))
        .find(|&p| {
            bytes[p] == b' '
                && bytes[p - 1].is_ascii_alphabetic()
                && bytes[p + 1].is_ascii_alphabetic()
        })
        .unwrap_or(bytes.len())
}

/// `json` with every `Metaspace` pre-tokenizer's scheme set to `"never"`:
/// the pipeline of a piece that does not start the input.
pub(super) fn never_prepend(json: &Value) -> Value {
    fn walk(value: &mut Value) {
        match value {
            Value::Object(o) => {
                if o.get("type").and_then(Value::as_str) == Some("Metaspace") {
                    o.insert("prepend_scheme".into(), Value::from("never"));
                    o.remove("add_prefix_space");
                }
                o.values_mut().for_each(walk);
            }
            Value::Array(items) => items.iter_mut().for_each(walk),
            _ => {}
        }
    }
    let mut out = json.clone();
    if let Some(pre) = out.get_mut("pre_tokenizer") {
        walk(pre);
    }
    out
}

impl Plan {
    /// The plan for `tokenizer` (loaded from `json`), or why its output
    /// cannot be proved independent of the cuts.
    pub(super) fn analyse(tokenizer: &tokenizers::Tokenizer, json: &Value) -> Result<Plan, String> {
        if tokenizer.get_truncation().is_some() || tokenizer.get_padding().is_some() {
            return Err("truncation or padding acts on the whole text".into());
        }
        if tokenizer.get_encode_special_tokens() {
            return Err("special tokens are encoded as text".into());
        }
        let mut first_only_prefix = false;
        pre_tokenizer_is_per_piece(
            json.get("pre_tokenizer").unwrap_or(&Value::Null),
            &mut first_only_prefix,
        )?;
        let no_normalizer = tokenizer.get_normalizer().is_none();
        let (mut raw, mut normalized) = (Vec::new(), Vec::new());
        for (id, token) in tokenizer.get_added_tokens_decoder() {
            if token.lstrip || token.rstrip || token.single_word {
                return Err(format!(
                    "added token {:?} strips or needs word boundaries",
                    token.content
                ));
            }
            if token.content.is_empty() {
                return Err("an added token is empty".into());
            }
            if !token.normalized {
                raw.push((token.content, id));
            } else if no_normalizer {
                normalized.push((token.content, id));
            }
        }
        let hidden_normalized_tokens = !no_normalizer
            && tokenizer
                .get_added_tokens_decoder()
                .values()
                .any(|t| t.normalized);
        Ok(Plan {
            raw: trie(raw)?,
            normalized: trie(normalized)?,
            first_only_prefix,
            between_words: !hidden_normalized_tokens && splits_between_words(json),
            hidden_tokens: hidden_normalized_tokens,
        })
    }

    /// Calls `f` on each piece of `text`, in order: added tokens and the
    /// (non-empty) texts between them, exactly as `tokenizers` cuts it.
    pub(super) fn cut<'t, E>(
        &self,
        text: &'t str,
        mut f: impl FnMut(Cut<'t>) -> Result<(), E>,
    ) -> Result<(), E> {
        let Some(raw) = &self.raw else {
            return self.cut_normalized(text, 0, &mut f);
        };
        let mut at = 0;
        for m in raw.leftmost_find_iter(text) {
            if at < m.start() {
                self.cut_normalized(&text[at..m.start()], at, &mut f)?;
            }
            f(Cut::Added(m.value()))?;
            at = m.end();
        }
        if at < text.len() {
            self.cut_normalized(&text[at..], at, &mut f)?;
        }
        Ok(())
    }

    /// The second pass over one raw piece starting at byte `offset` of the input.
    fn cut_normalized<'t, E>(
        &self,
        piece: &'t str,
        offset: usize,
        f: &mut impl FnMut(Cut<'t>) -> Result<(), E>,
    ) -> Result<(), E> {
        let Some(normalized) = &self.normalized else {
            return self.chunks(piece, offset, f);
        };
        let mut at = 0;
        for m in normalized.leftmost_find_iter(piece) {
            if at < m.start() {
                self.chunks(&piece[at..m.start()], offset + at, f)?;
            }
            f(Cut::Added(m.value()))?;
            at = m.end();
        }
        if at < piece.len() {
            self.chunks(&piece[at..], offset + at, f)?;
        }
        Ok(())
    }

    /// A text piece between added tokens, in chunks when cutting between
    /// words is exact.
    fn chunks<'t, E>(
        &self,
        piece: &'t str,
        offset: usize,
        f: &mut impl FnMut(Cut<'t>) -> Result<(), E>,
    ) -> Result<(), E> {
        if !self.between_words {
            return f(Cut::Text {
                text: piece,
                at_start: offset == 0,
            });
        }
        let mut start = 0;
        while start < piece.len() {
            let end = chunk_end(piece, start);
            f(Cut::Text {
                text: &piece[start..end],
                at_start: offset + start == 0,
            })?;
            start = end;
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn tokenizer(added: Value, normalizer: Value, pre: Value) -> (tokenizers::Tokenizer, Value) {
        let json = json!({
            "version": "1.0", "truncation": null, "padding": null, "added_tokens": added,
            "normalizer": normalizer, "pre_tokenizer": pre, "post_processor": null,
            "decoder": null,
            "model": {"type": "WordLevel", "vocab": {"[UNK]": 0, "a": 1}, "unk_token": "[UNK]"},
        });
        let tok = json.to_string().parse().expect("tokenizer");
        (tok, json)
    }

    fn added(id: u32, content: &str, normalized: bool) -> Value {
        json!({"id": id, "content": content, "single_word": false, "lstrip": false,
               "rstrip": false, "normalized": normalized, "special": true})
    }

    /// The pieces of `text`, added tokens written as `#content`.
    fn pieces(tok: &tokenizers::Tokenizer, plan: &Plan, text: &str) -> Vec<String> {
        let mut out = Vec::new();
        plan.cut(text, |c| {
            out.push(match c {
                Cut::Added(id) => format!("#{}", tok.id_to_token(id).unwrap_or_default()),
                Cut::Text { text, at_start } => {
                    format!("{}{text}", if at_start { "^" } else { "" })
                }
            });
            Ok::<(), ()>(())
        })
        .expect("infallible");
        out
    }

    #[test]
    fn texts_are_cut_at_added_tokens_leftmost_longest() {
        let (tok, json) = tokenizer(
            json!([
                added(5, "<a>", false),
                added(6, "<a><b>", false),
                added(7, "<eot>", true)
            ]),
            Value::Null,
            json!({"type": "Whitespace"}),
        );
        let plan = Plan::analyse(&tok, &json).expect("provable");
        assert_eq!(pieces(&tok, &plan, "x<a>y"), ["^x", "#<a>", "y"]);
        assert_eq!(pieces(&tok, &plan, "<a><b>z<a>"), ["#<a><b>", "z", "#<a>"]);
        // Without a normaliser the `normalized: true` token is cut too.
        assert_eq!(pieces(&tok, &plan, "q<eot>r"), ["^q", "#<eot>", "r"]);
        assert_eq!(pieces(&tok, &plan, "plain"), ["^plain"]);
        assert!(pieces(&tok, &plan, "").is_empty());
        assert!(!plan.first_only_prefix);
    }

    #[test]
    fn normalized_tokens_stay_inside_their_piece_when_there_is_a_normalizer() {
        let (tok, json) = tokenizer(
            json!([added(5, "<a>", false), added(7, "<eot>", true)]),
            json!({"type": "Lowercase"}),
            Value::Null,
        );
        let plan = Plan::analyse(&tok, &json).expect("provable");
        assert_eq!(
            pieces(&tok, &plan, "q<eot>r<a>s"),
            ["^q<eot>r", "#<a>", "s"]
        );
    }

    #[test]
    fn unprovable_configurations_are_refused_with_a_reason() {
        let mut strip = added(5, "<a>", false);
        strip["lstrip"] = true.into();
        let (tok, json) = tokenizer(json!([strip]), Value::Null, Value::Null);
        assert!(Plan::analyse(&tok, &json)
            .expect_err("lstrip")
            .contains("strips"));
        let mut first_only = false;
        assert!(pre_tokenizer_is_per_piece(&json!({"type": "Mystery"}), &mut first_only).is_err());
        assert!(pre_tokenizer_is_per_piece(&json!({"type": "Sequence"}), &mut first_only).is_err());
        let (mut tok, json) = tokenizer(json!([]), Value::Null, Value::Null);
        tok.with_truncation(Some(tokenizers::TruncationParams::default()))
            .expect("truncation");
        assert!(Plan::analyse(&tok, &json)
            .expect_err("truncation")
            .contains("truncation"));
    }

    #[test]
    fn long_pieces_are_chunked_before_a_space_between_ascii_letters() {
        let pre = json!({"type": "ByteLevel", "add_prefix_space": false, "trim_offsets": true, "use_regex": true});
        let (tok, json) = tokenizer(json!([added(5, "<a>", false)]), Value::Null, pre);
        let plan = Plan::analyse(&tok, &json).expect("provable");
        assert!(plan.between_words);
        let text = format!("{}x{} tail", "ab ".repeat(100), "é".repeat(3));
        let got = pieces(&tok, &plan, &format!("{text}<a>{text}"));
        assert_eq!(got.concat().replace('^', ""), format!("{text}#<a>{text}"));
        // Two chunks per piece: the first ends at the first " ab" past
        // CHUNK_BYTES, the second starts with that space.
        assert_eq!(got.len(), 5, "{got:?}");
        assert_eq!(got[0].len() - 1, CHUNK_BYTES + 1);
        assert!(got[1].starts_with(" ab") && got[4].starts_with(" ab"));
        assert_eq!((got[2].as_str(), got[3].len()), ("#<a>", CHUNK_BYTES + 1));
        assert_eq!(chunk_end("short text", 0), 10);
        let long = "a".repeat(300);
        assert_eq!(chunk_end(&long, 0), 300, "no boundary: one chunk");
    }

    #[test]
    fn only_known_word_splitting_pipelines_are_chunked() {
        let byte_level = |prefix: bool, regex: bool| json!({"type": "ByteLevel", "add_prefix_space": prefix, "trim_offsets": false, "use_regex": regex});
        let split = |regex: &str| json!({"type": "Split", "pattern": {"Regex": regex}, "behavior": "Isolated", "invert": false});
        let with =
            |normalizer: Value, pre: Value| json!({"normalizer": normalizer, "pre_tokenizer": pre});
        assert!(splits_between_words(&with(
            Value::Null,
            byte_level(false, true)
        )));
        assert!(!splits_between_words(&with(
            Value::Null,
            byte_level(true, true)
        )));
        let seq = |regex: &str, bl: Value| json!({"type": "Sequence", "pretokenizers": [split(regex), bl]});
        let qwen = WORD_SPLITTING_REGEXES[0];
        assert!(splits_between_words(&with(
            json!({"type": "NFC"}),
            seq(qwen, byte_level(false, false))
        )));
        assert!(!splits_between_words(&with(
            json!({"type": "NFC"}),
            seq(r"\w+", byte_level(false, false))
        )));
        assert!(!splits_between_words(&with(
            json!({"type": "NFC"}),
            seq(qwen, byte_level(false, true))
        )));
        let prepend = json!({"type": "Prepend", "prepend": "▁"});
        assert!(!splits_between_words(&with(
            prepend,
            byte_level(false, true)
        )));
        let nested =
            json!({"type": "Sequence", "normalizers": [{"type": "NFKC"}, {"type": "Lowercase"}]});
        assert!(splits_between_words(&with(nested, byte_level(false, true))));
        let metaspace = json!({"type": "Metaspace", "replacement": "▁", "prepend_scheme": "always", "split": true});
        assert!(!splits_between_words(&with(Value::Null, metaspace)));
    }

    #[test]
    fn metaspace_first_is_detected_and_rewritten_to_never() {
        let pre = json!({"type": "Sequence", "pretokenizers": [
            {"type": "Metaspace", "replacement": "▁", "prepend_scheme": "first", "split": false}
        ]});
        let (tok, json) = tokenizer(json!([]), Value::Null, pre);
        let plan = Plan::analyse(&tok, &json).expect("provable");
        assert!(plan.first_only_prefix);
        let never = never_prepend(&json);
        assert_eq!(
            never["pre_tokenizer"]["pretokenizers"][0]["prepend_scheme"],
            "never"
        );
        assert!(never.to_string().parse::<tokenizers::Tokenizer>().is_ok());
    }
}
