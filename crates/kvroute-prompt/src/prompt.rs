//! A request's prompt before tokenizing: segments, the messages a chat
//! template takes, client image hashes and the model.

use serde_json::Value;

use crate::error::PromptError;
use crate::fields;

/// A piece of a prompt in the ChatML layout.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Segment {
    /// Text for the tokenizer.
    Text(String),
    /// Token ids given by the client.
    Tokens(Vec<u64>),
    /// A ChatML special token.
    Special(SpecialToken),
    /// An image by URL.
    Image(String),
    /// A video by URL (`video_url` parts): laid out and hashed like an
    /// image, with the video placeholder id in its positions.
    Video(String),
}

/// The ChatML layout's special tokens.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum SpecialToken {
    /// `<|im_start|>`.
    ImStart,
    /// `<|im_end|>`.
    ImEnd,
}

/// Which request field holds the prompt, with its value (`None`: absent).
#[derive(Debug, Clone, Copy)]
pub enum PromptSource<'a> {
    /// `/v1/completions`: `prompt`.
    Completion(Option<&'a Value>),
    /// `/v1/chat/completions`: `messages`.
    Chat(Option<&'a Value>),
}

/// The prompt fields of a request, as values the caller already extracted
/// from the body (so the body is never parsed twice).
#[derive(Debug, Clone, Copy)]
pub struct PromptFields<'a> {
    /// `prompt` or `messages`.
    pub source: PromptSource<'a>,
    /// `mm_hashes` (`None`: absent).
    pub mm_hashes: Option<&'a Value>,
    /// `model` (`None`: absent).
    pub model: Option<&'a str>,
}

/// A validated prompt, ready for [`crate::Renderer::render`].
#[derive(Debug, Clone, PartialEq, Default)]
pub struct Prompt {
    /// The prompt in the ChatML layout (used when the model has no chat
    /// template, and for chats with images).
    pub segments: Vec<Segment>,
    /// Chat messages as a model's chat template takes them (`role` and
    /// string `content`), when every part is text; `None` for completions
    /// and chats with images.
    pub template_messages: Option<Value>,
    /// Client-supplied item hashes, one per image or video in prompt order.
    pub mm_hashes: Option<Vec<u64>>,
    /// The `model` field, for per-model image rules.
    pub model: Option<String>,
    /// Where the serving engine loaded the model from (its `/v1/models`
    /// `root`, vLLM's `--model`), when known: vLLM names a `data:` URL image
    /// by its bytes and this (see [`kvroute_core::multimodal::vllm_image_identifier`]).
    pub model_id: Option<String>,
    /// How a chat ends: with the assistant's header (the default), or
    /// without it, or inside the final message, which the model continues.
    pub ending: ChatEnding,
}

/// How a chat prompt ends (vLLM's `add_generation_prompt` and
/// `continue_final_message`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum ChatEnding {
    /// The assistant's header follows the messages (`add_generation_prompt`).
    #[default]
    GenerationPrompt,
    /// The messages alone (`add_generation_prompt: false`).
    Messages,
    /// Inside the final message: its end-of-turn left off, so the model
    /// continues it (`continue_final_message: true`).
    ContinueFinal,
}

impl Prompt {
    /// A `/v1/completions` prompt from its `prompt` field.
    pub fn completion(prompt: Option<&Value>) -> Result<Self, PromptError> {
        Ok(Prompt {
            segments: fields::completion_segments(prompt)?,
            ..Prompt::default()
        })
    }

    /// A `/v1/chat/completions` prompt from its `messages` field.
    pub fn chat(messages: Option<&Value>) -> Result<Self, PromptError> {
        let segments = fields::chat_segments(messages)?;
        Ok(Prompt {
            segments,
            template_messages: messages.and_then(fields::template_messages),
            ..Prompt::default()
        })
    }

    /// The chat ended as `ending` asks: the ChatML layout loses the
    /// assistant's header (and, to continue the final message, that
    /// message's end of turn); a chat template renders so too.
    pub fn end_chat(&mut self, ending: ChatEnding) {
        self.ending = ending;
        if ending == ChatEnding::GenerationPrompt {
            return;
        }
        let header = [
            Segment::Special(SpecialToken::ImStart),
            Segment::Text("assistant\n".into()),
        ];
        if self.segments.ends_with(&header) {
            self.segments.truncate(self.segments.len() - header.len());
        }
        let end_of_turn = [
            Segment::Special(SpecialToken::ImEnd),
            Segment::Text("\n".into()),
        ];
        if ending == ChatEnding::ContinueFinal && self.segments.ends_with(&end_of_turn) {
            self.segments
                .truncate(self.segments.len() - end_of_turn.len());
        }
    }

    /// The prompt of a request's fields: the prompt source first, then
    /// `mm_hashes` (errors in that order).
    pub fn from_fields(fields: &PromptFields<'_>) -> Result<Self, PromptError> {
        let mut prompt = match fields.source {
            PromptSource::Completion(p) => Prompt::completion(p)?,
            PromptSource::Chat(m) => Prompt::chat(m)?,
        };
        prompt.mm_hashes = fields::mm_hashes(fields.mm_hashes)?;
        prompt.model = fields.model.map(str::to_owned);
        Ok(prompt)
    }

    /// How many multimodal items (images and videos) the prompt holds.
    pub fn image_count(&self) -> usize {
        self.segments
            .iter()
            .filter(|s| matches!(s, Segment::Image(_) | Segment::Video(_)))
            .count()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn chat_messages_become_chatml_segments_and_template_messages() {
        let messages = json!([{"role": "user", "content": [
            {"type": "text", "text": "look"},
            {"type": "image_url", "image_url": {"url": "data:image/png;base64,aGVsbG8="}}
        ]}]);
        let p = Prompt::chat(Some(&messages)).expect("ok");
        assert_eq!(
            p.segments,
            [
                Segment::Special(SpecialToken::ImStart),
                Segment::Text("user\n".into()),
                Segment::Text("look".into()),
                Segment::Image("data:image/png;base64,aGVsbG8=".into()),
                Segment::Special(SpecialToken::ImEnd),
                Segment::Text("\n".into()),
                Segment::Special(SpecialToken::ImStart),
                Segment::Text("assistant\n".into()),
            ]
        );
        assert_eq!(p.template_messages, None, "an image: no template");
        assert_eq!(p.image_count(), 1);
        let text = json!([{"role": "user", "content": "hi"}]);
        let p = Prompt::chat(Some(&text)).expect("ok");
        assert_eq!(p.template_messages, Some(text));
    }

    #[test]
    fn fields_are_read_in_order_with_hashes_and_model() {
        let messages = json!([{"role": "user", "content": "x"}]);
        let hashes = json!(["00000000000000ff"]);
        let p = Prompt::from_fields(&PromptFields {
            source: PromptSource::Chat(Some(&messages)),
            mm_hashes: Some(&hashes),
            model: Some("m"),
        })
        .expect("ok");
        assert_eq!(p.mm_hashes, Some(vec![255]));
        assert_eq!(p.model.as_deref(), Some("m"));
        // The prompt's own error comes before the hashes'.
        let bad = json!("not hashes");
        let e = Prompt::from_fields(&PromptFields {
            source: PromptSource::Completion(None),
            mm_hashes: Some(&bad),
            model: None,
        })
        .expect_err("no prompt");
        assert_eq!(e.to_string(), "`prompt` is required");
    }
}
