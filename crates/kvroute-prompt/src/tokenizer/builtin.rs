//! The built-in tokenizer's pieces and ids (the rules are in the parent
//! module's documentation).

use xxhash_rust::xxh3::xxh3_64_with_seed;

use super::TEXT_VOCAB;

/// Longest word chunk of the built-in tokenizer, in characters.
const MAX_WORD_CHARS: usize = 8;

/// The built-in id of one piece.
pub(super) fn id(piece: &str) -> u64 {
    xxh3_64_with_seed(piece.as_bytes(), 0) % TEXT_VOCAB
}

/// The built-in tokenizer's pieces of `text`.
pub(super) fn pieces(text: &str) -> impl Iterator<Item = &str> {
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

    fn split(text: &str) -> Vec<&str> {
        pieces(text).collect()
    }

    #[test]
    fn pieces_follow_the_documented_rules() {
        assert_eq!(split("Hello, world"), ["Hello", ",", " world"]);
        assert_eq!(split("a  b\n"), ["a", " ", " b", "\n"]);
        assert_eq!(
            split("internationalization"),
            ["internat", "ionaliza", "tion"]
        );
        assert_eq!(split(" ünïcode!"), [" ünïcode", "!"]);
        assert_eq!(split(" "), [" "]);
        assert_eq!(split(""), Vec::<&str>::new());
        assert_eq!(split("x ."), ["x", " ."]);
    }

    #[test]
    fn pieces_cover_the_text_exactly() {
        let text = "  Tabs\tand  spaces, ünïcode 😀 and numbers 1234567890123!\n";
        assert_eq!(split(text).concat(), text);
    }
}
