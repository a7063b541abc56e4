//! Why a prompt could not be rendered: the client's request or the tokenizer.

use crate::chat_template::ChatTemplateError;
use crate::tokenizer::TokenizerError;
use kvroute_core::multimodal::ImageError;

/// A prompt that cannot be rendered. Every variant but
/// [`PromptError::Tokenizer`] is the client's fault (an HTTP 400); the
/// messages name the offending field as the request spells it.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum PromptError {
    /// A required field is absent.
    #[error("`{field}` is required")]
    Missing {
        /// The field, e.g. `messages` or `messages[0].content[1].image_url`.
        field: String,
    },
    /// A field that must hold something is empty.
    #[error("`{field}` is empty")]
    Empty {
        /// The field.
        field: String,
    },
    /// A field has the wrong type or value.
    #[error("`{field}` must be {expected}")]
    Invalid {
        /// The field, e.g. `prompt[3]`.
        field: String,
        /// What it must be, e.g. `a string or an array of token ids`.
        expected: &'static str,
    },
    /// A content part of a type other than `text`, `image_url` and `video_url`.
    #[error("`{field}` {kind:?} is not supported (text, image_url and video_url are)")]
    UnsupportedPart {
        /// The part's `type` field.
        field: String,
        /// The type given.
        kind: String,
    },
    /// A completion request with several prompts.
    #[error("batched prompts are not supported: send one prompt per request")]
    Batched,
    /// `mm_hashes` does not have one entry per image.
    #[error("`mm_hashes` has {hashes} entries for {images} image(s)")]
    MmHashCount {
        /// Entries given.
        hashes: usize,
        /// Images in the prompt.
        images: usize,
    },
    /// An image whose identity cannot be computed (a malformed `data:` URL).
    #[error("image {index}: {source}")]
    Image {
        /// The image's position among the prompt's images.
        index: usize,
        /// Why.
        source: ImageError,
    },
    /// The model's chat template refused the messages (including its own
    /// `raise_exception`).
    #[error(transparent)]
    Template(ChatTemplateError),
    /// The prompt renders to no tokens at all.
    #[error("the prompt has no tokens")]
    NoTokens,
    /// The tokenizer itself failed: not the client's fault (an HTTP 500).
    #[error(transparent)]
    Tokenizer(#[from] TokenizerError),
}

impl PromptError {
    /// Whether the request is at fault (400) rather than the tokenizer (500).
    pub fn is_client_error(&self) -> bool {
        !matches!(self, PromptError::Tokenizer(_))
    }

    pub(crate) fn invalid(field: impl Into<String>, expected: &'static str) -> Self {
        PromptError::Invalid {
            field: field.into(),
            expected,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn messages_name_the_field_and_the_blame_is_told_apart() {
        let e = PromptError::invalid("prompt[1]", "a token id (an integer from 0 to 2^63-1)");
        assert_eq!(
            e.to_string(),
            "`prompt[1]` must be a token id (an integer from 0 to 2^63-1)"
        );
        assert!(e.is_client_error());
        let e = PromptError::UnsupportedPart {
            field: "messages[0].content[0].type".into(),
            kind: "input_audio".into(),
        };
        assert_eq!(
            e.to_string(),
            "`messages[0].content[0].type` \"input_audio\" is not supported (text, image_url and video_url are)"
        );
        let e = PromptError::from(TokenizerError::Encode("boom".into()));
        assert_eq!(e.to_string(), "tokenizer failed: boom");
        assert!(!e.is_client_error());
    }
}
