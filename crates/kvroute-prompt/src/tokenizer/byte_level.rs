//! A lean encoder for byte-level BPE pipelines (GPT-2, Qwen2, Llama 3):
//! the same steps as `tokenizers`, without its offset bookkeeping.
//!
//! For a piece between added tokens, `tokenizers` normalises (such a
//! pipeline has no normaliser or NFC), splits with the pre-tokenizer's regex
//! keeping matches and the gaps between them (`Isolated`), maps every byte
//! of each split to GPT-2's printable character for it, and runs the model
//! on each split. It does all of that on `NormalizedString`s that track the
//! alignment of every byte, then assembles an `Encoding` (token strings,
//! offsets, masks); that bookkeeping, not the BPE, is most of its time. Here
//! the same regex (`tokenizers`' own `SysRegex`, with its stop-at-first-error
//! iteration) and the same model (`Model::tokenize`) run on plain strings.
//!
//! Used only where it is the same computation: no normaliser, or NFC on an
//! ASCII piece (which NFC leaves unchanged); the pre-tokenizer `ByteLevel`
//! with its regex, or a `Split` regex (`Isolated`, not inverted) followed by
//! `ByteLevel` without one; never a prefix space. Anything else goes through
//! `tokenizers::Tokenizer::encode_fast`. The parity tests compare both.

use serde_json::Value;
use tokenizers::utils::SysRegex;
use tokenizers::Model;

/// GPT-2's byte-level regex, as `tokenizers`' `ByteLevel` compiles it.
const GPT2_REGEX: &str =
    r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+";

/// GPT-2's byte-to-character table (`bytes_to_unicode`): printable bytes
/// keep their code point, the 68 others take 256, 257, … in byte order.
fn byte_chars() -> [char; 256] {
    let printable = |b: u8| matches!(b, b'!'..=b'~' | 0xA1..=0xAC | 0xAE..=0xFF);
    let mut table = ['\0'; 256];
    let mut next = 256u32;
    for b in 0..=255u8 {
        table[usize::from(b)] = if printable(b) {
            char::from(b)
        } else {
            let c = char::from_u32(next).unwrap_or('\0');
            next += 1;
            c
        };
    }
    table
}

/// The lean encoder of one tokenizer.
pub(super) struct ByteLevelPath {
    regex: SysRegex,
    /// NFC is configured: only ASCII pieces may skip it.
    ascii_only: bool,
    byte_chars: [char; 256],
}

impl std::fmt::Debug for ByteLevelPath {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ByteLevelPath")
            .field("ascii_only", &self.ascii_only)
            .finish_non_exhaustive()
    }
}

fn byte_level(value: &Value, regex: bool) -> bool {
    value.get("type").and_then(Value::as_str) == Some("ByteLevel")
        && value.get("add_prefix_space").and_then(Value::as_bool) == Some(false)
        && value
            .get("use_regex")
            .and_then(Value::as_bool)
            .unwrap_or(true)
            == regex
}

/// The `Split` regex of `Sequence[Split(regex, Isolated), ByteLevel(no regex)]`.
fn split_regex(pre: &Value) -> Option<&str> {
    let [split, bytes] = pre.get("pretokenizers")?.as_array()?.as_slice() else {
        return None;
    };
    let isolated = pre.get("type").and_then(Value::as_str) == Some("Sequence")
        && split.get("type").and_then(Value::as_str) == Some("Split")
        && split.get("behavior").and_then(Value::as_str) == Some("Isolated")
        && split.get("invert").and_then(Value::as_bool) == Some(false)
        && byte_level(bytes, false);
    if !isolated {
        return None;
    }
    split.pointer("/pattern/Regex")?.as_str()
}

impl ByteLevelPath {
    /// Whether NFC is configured (which may shorten a text, at most by
    /// three times: a Hangul syllable written as its jamo).
    pub(super) fn normalizes(&self) -> bool {
        self.ascii_only
    }

    /// The lean encoder for the pipeline of `json`, when it is one of those
    /// above; `hidden_tokens`: added tokens may hide inside pieces (then the
    /// full pipeline must look for them).
    pub(super) fn analyse(json: &Value, hidden_tokens: bool) -> Option<Self> {
        if hidden_tokens {
            return None;
        }
        let ascii_only = match json.get("normalizer") {
            None | Some(Value::Null) => false,
            Some(n) if n.get("type").and_then(Value::as_str) == Some("NFC") => true,
            Some(_) => return None,
        };
        let pre = json.get("pre_tokenizer")?;
        let pattern = if byte_level(pre, true) {
            GPT2_REGEX
        } else {
            split_regex(pre)?
        };
        Some(ByteLevelPath {
            regex: SysRegex::new(pattern).ok()?,
            ascii_only,
            byte_chars: byte_chars(),
        })
    }

    /// Appends the ids of `piece` (text between added tokens) to `out`;
    /// `Ok(false)` (and nothing appended) when the piece needs the full pipeline.
    pub(super) fn encode(
        &self,
        model: &impl Model,
        piece: &str,
        out: &mut Vec<u32>,
    ) -> Result<bool, String> {
        if piece.is_empty() || (self.ascii_only && !piece.is_ascii()) {
            return Ok(false);
        }
        let mut word = String::new();
        let mut split = |text: &str| -> Result<(), String> {
            word.clear();
            word.extend(text.bytes().map(|b| self.byte_chars[usize::from(b)]));
            let tokens = model.tokenize(&word).map_err(|e| e.to_string())?;
            out.extend(tokens.iter().map(|t| t.id));
            Ok(())
        };
        let mut at = 0;
        for (start, end) in self.regex.find_iter(piece) {
            if at != start {
                split(&piece[at..start])?;
            }
            split(&piece[start..end])?;
            at = end;
        }
        if at != piece.len() {
            split(&piece[at..])?;
        }
        Ok(true)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn the_byte_table_is_gpt2s() {
        let t = byte_chars();
        assert_eq!(t[usize::from(b'a')], 'a');
        assert_eq!(t[usize::from(b' ')], 'Ġ');
        assert_eq!(t[usize::from(b'\n')], 'Ċ');
        assert_eq!(t[0], 'Ā');
        assert_eq!(t[0xAD], 'Ń');
        let distinct: std::collections::HashSet<char> = t.iter().copied().collect();
        assert_eq!(distinct.len(), 256);
    }

    #[test]
    fn only_byte_level_pipelines_without_other_normalisers_qualify() {
        let gpt2 = json!({"normalizer": null, "pre_tokenizer":
            {"type": "ByteLevel", "add_prefix_space": false, "trim_offsets": true, "use_regex": true}});
        assert!(ByteLevelPath::analyse(&gpt2, false).is_some_and(|p| !p.ascii_only));
        assert!(ByteLevelPath::analyse(&gpt2, true).is_none());
        let mut nfc = gpt2.clone();
        nfc["normalizer"] = json!({"type": "NFC"});
        assert!(ByteLevelPath::analyse(&nfc, false).is_some_and(|p| p.ascii_only));
        let mut lower = gpt2.clone();
        lower["normalizer"] = json!({"type": "Lowercase"});
        assert!(ByteLevelPath::analyse(&lower, false).is_none());
        let mut prefix = gpt2.clone();
        prefix["pre_tokenizer"]["add_prefix_space"] = true.into();
        assert!(ByteLevelPath::analyse(&prefix, false).is_none());
        let split = json!({"normalizer": null, "pre_tokenizer": {"type": "Sequence", "pretokenizers": [
            {"type": "Split", "pattern": {"Regex": "\\s+|\\S+"}, "behavior": "Isolated", "invert": false},
            {"type": "ByteLevel", "add_prefix_space": false, "trim_offsets": false, "use_regex": false}]}});
        assert!(ByteLevelPath::analyse(&split, false).is_some());
        let mut removed = split.clone();
        removed["pre_tokenizer"]["pretokenizers"][0]["behavior"] = "Removed".into();
        assert!(ByteLevelPath::analyse(&removed, false).is_none());
    }
}
