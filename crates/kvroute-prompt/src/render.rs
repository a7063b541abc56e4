//! A prompt to token ids, laid out the flavour-neutral way.

use kvroute_core::multimodal::{ImageIdentity, ImageSpan, ImageTokenRule, RoutingPrompt};
use kvroute_core::tokens::fold_token_id;

use crate::chat_template::ChatTemplate;
use crate::error::PromptError;
use crate::prompt::{ChatEnding, Prompt, Segment, SpecialToken};
use crate::tokenizer::Tokenizer;

/// A prompt laid out the flavour-neutral way: token ids with the image
/// placeholder id in every image position, and the images' spans.
///
/// The mock engine and the router's request side both start from this, so
/// their token ids agree; each engine flavour then fills image positions its
/// own way (SGLang pads, vLLM placeholders).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct NeutralPrompt {
    /// Token ids; image positions hold the tokenizer's image placeholder id.
    pub tokens: Vec<u64>,
    /// The images, in order, with the identity rule applied (client hash or URL).
    pub images: Vec<ImageSpan>,
}

impl NeutralPrompt {
    /// The router's form: ids folded to the 32 bits the engines hash.
    pub fn into_routing(self) -> RoutingPrompt {
        RoutingPrompt {
            tokens: self.tokens.into_iter().map(fold_token_id).collect(),
            images: self.images,
        }
    }
}

/// `messages` through `template`, ending as `ending` asks; to continue the
/// final message, the text is cut after that message's content (as vLLM
/// does), which must be in it.
fn render_template(
    template: &ChatTemplate,
    messages: &serde_json::Value,
    ending: ChatEnding,
) -> Result<String, PromptError> {
    let generation_prompt = ending == ChatEnding::GenerationPrompt;
    let mut text = template
        .render(messages, generation_prompt)
        .map_err(PromptError::Template)?;
    if ending == ChatEnding::ContinueFinal {
        let last = messages
            .as_array()
            .and_then(|m| m.last())
            .and_then(|m| m.get("content"))
            .and_then(serde_json::Value::as_str)
            .unwrap_or("");
        let end = text.rfind(last).map(|at| at + last.len()).ok_or_else(|| {
            PromptError::invalid("messages", "a chat whose final message the template shows")
        })?;
        text.truncate(end);
    }
    Ok(text)
}

/// Renders prompts to token ids: a tokenizer (with the model's chat template,
/// if any) and the positions each image takes.
#[derive(Debug)]
pub struct Renderer {
    tokenizer: Tokenizer,
    rule: ImageTokenRule,
}

impl Renderer {
    /// A renderer with `tokenizer` and `rule` positions per image.
    pub fn new(tokenizer: Tokenizer, rule: ImageTokenRule) -> Self {
        Renderer { tokenizer, rule }
    }

    /// The tokenizer.
    pub fn tokenizer(&self) -> &Tokenizer {
        &self.tokenizer
    }

    /// The image rule.
    pub fn rule(&self) -> ImageTokenRule {
        self.rule
    }

    /// Tokenizes a prompt: a chat whose parts are all text through the
    /// model's chat template when it has one, the whole text tokenized;
    /// otherwise the ChatML segments: text through the tokenizer, the
    /// specials, client token ids as given, and each image (video) as vision
    /// start, `rule` image (video) placeholder positions, vision end.
    pub fn render(&self, prompt: &Prompt) -> Result<NeutralPrompt, PromptError> {
        let images = prompt.image_count();
        if let Some(hashes) = &prompt.mm_hashes {
            if images > 0 && hashes.len() != images {
                return Err(PromptError::MmHashCount {
                    hashes: hashes.len(),
                    images,
                });
            }
        }
        if let (Some(template), Some(messages)) =
            (self.tokenizer.chat_template(), &prompt.template_messages)
        {
            let text = render_template(template, messages, prompt.ending)?;
            let tokens = self.tokenizer.encode(&text)?;
            if tokens.is_empty() {
                return Err(PromptError::NoTokens);
            }
            return Ok(NeutralPrompt {
                tokens,
                images: Vec::new(),
            });
        }
        self.layout_segments(prompt)
    }

    /// [`Renderer::render`] in the router's form ([`NeutralPrompt::into_routing`]).
    pub fn render_for_routing(&self, prompt: &Prompt) -> Result<RoutingPrompt, PromptError> {
        self.render(prompt).map(NeutralPrompt::into_routing)
    }

    fn layout_segments(&self, prompt: &Prompt) -> Result<NeutralPrompt, PromptError> {
        let specials = self.tokenizer.specials();
        let mut tokens: Vec<u64> = Vec::new();
        let mut spans = Vec::new();
        for segment in &prompt.segments {
            match segment {
                Segment::Text(text) => self.tokenizer.encode_into(text, &mut tokens)?,
                Segment::Tokens(ids) => tokens.extend_from_slice(ids),
                Segment::Special(SpecialToken::ImStart) => tokens.push(specials.im_start),
                Segment::Special(SpecialToken::ImEnd) => tokens.push(specials.im_end),
                Segment::Image(url) | Segment::Video(url) => {
                    let placeholder = match segment {
                        Segment::Video(_) => specials.video_pad,
                        _ => specials.image_pad,
                    };
                    let index = spans.len();
                    let client_hash = prompt
                        .mm_hashes
                        .as_ref()
                        .and_then(|h| h.get(index))
                        .copied();
                    let identity =
                        ImageIdentity::resolve(client_hash, url, prompt.model_id.as_deref())
                            .map_err(|source| PromptError::Image { index, source })?;
                    let len = self.rule.tokens_for(prompt.model.as_deref(), &identity);
                    tokens.push(specials.vision_start);
                    let start = tokens.len();
                    tokens.extend(std::iter::repeat_n(placeholder, len));
                    spans.push(ImageSpan {
                        start,
                        len,
                        identity,
                    });
                    tokens.push(specials.vision_end);
                }
            }
        }
        if tokens.is_empty() {
            return Err(PromptError::NoTokens);
        }
        Ok(NeutralPrompt {
            tokens,
            images: spans,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::chat_template::ChatTemplate;
    use crate::tokenizer::{IMAGE_PAD, IM_END, IM_START, VISION_END, VISION_START};
    use serde_json::json;

    fn renderer(n: usize) -> Renderer {
        Renderer::new(Tokenizer::builtin(), ImageTokenRule::fixed(n))
    }

    #[test]
    fn chatml_segments_with_an_image_lay_out_placeholders_and_spans() {
        let messages = json!([{"role": "user", "content": [
            {"type": "text", "text": "look"},
            {"type": "image_url", "image_url": "data:image/png;base64,aGVsbG8="}
        ]}]);
        let p = Prompt::chat(Some(&messages)).expect("ok");
        let r = renderer(3).render(&p).expect("renders");
        let tok = Tokenizer::builtin();
        let mut expected = vec![IM_START];
        expected.extend(tok.encode("user\n").expect("builtin"));
        expected.extend(tok.encode("look").expect("builtin"));
        expected.extend([
            VISION_START,
            IMAGE_PAD,
            IMAGE_PAD,
            IMAGE_PAD,
            VISION_END,
            IM_END,
        ]);
        expected.extend(tok.encode("\n").expect("builtin"));
        expected.push(IM_START);
        expected.extend(tok.encode("assistant\n").expect("builtin"));
        assert_eq!(r.tokens, expected);
        assert_eq!(r.images.len(), 1);
        let span = &r.images[0];
        assert_eq!((span.start, span.len), (expected.len() - 10, 3));
        assert_eq!(span.identity.hash, 0x2cf24dba5fb0a30e);
        let routing = renderer(3).render_for_routing(&p).expect("renders");
        assert_eq!(routing.tokens.len(), r.tokens.len());
        assert_eq!(routing.images, r.images);
    }

    #[test]
    fn a_video_is_laid_out_and_named_like_an_image_with_its_own_placeholder() {
        use crate::tokenizer::VIDEO_PAD;
        let url = "data:video/mp4;base64,aGVsbG8=";
        let messages = json!([{"role": "user", "content": [
            {"type": "video_url", "video_url": {"url": url}},
            {"type": "image_url", "image_url": url},
            {"type": "text", "text": "same bytes, two media"}
        ]}]);
        let p = Prompt::chat(Some(&messages)).expect("ok");
        assert_eq!(p.image_count(), 2);
        let r = renderer(2).render(&p).expect("renders");
        let (video, image) = (&r.images[0], &r.images[1]);
        assert_eq!(
            r.tokens[video.start..video.start + 2],
            [VIDEO_PAD, VIDEO_PAD]
        );
        assert_eq!(
            r.tokens[image.start..image.start + 2],
            [IMAGE_PAD, IMAGE_PAD]
        );
        assert_eq!(r.tokens[video.start - 1], VISION_START);
        assert_eq!(r.tokens[video.start + 2], VISION_END);
        // The identity rule is the image's: the bytes of the data URL.
        assert_eq!(video.identity, image.identity);
        // Client hashes count videos too, in prompt order.
        let mut p = p;
        p.mm_hashes = Some(vec![7, 8]);
        let r = renderer(2).render(&p).expect("renders");
        assert_eq!(
            (r.images[0].identity.hash, r.images[1].identity.hash),
            (7, 8)
        );
        let missing = json!([{"role": "user", "content": [{"type": "video_url"}]}]);
        let e = Prompt::chat(Some(&missing)).expect_err("no url");
        assert_eq!(
            e.to_string(),
            "`messages[0].content[0].video_url` is required"
        );
    }

    #[test]
    fn client_hashes_name_images_and_must_match_their_count() {
        let messages =
            json!([{"role": "user", "content": [{"type": "image_url", "image_url": "x"}]}]);
        let mut p = Prompt::chat(Some(&messages)).expect("ok");
        p.mm_hashes = Some(vec![255]);
        let r = renderer(2).render(&p).expect("renders");
        assert_eq!(r.images[0].identity.hash, 255);
        p.mm_hashes = Some(vec![1, 2]);
        let e = renderer(2).render(&p).expect_err("count");
        assert_eq!(e.to_string(), "`mm_hashes` has 2 entries for 1 image(s)");
        assert!(e.is_client_error());
        p.mm_hashes = None;
        p.segments = vec![Segment::Image("data:image/png;base64,%%%".into())];
        let e = renderer(2).render(&p).expect_err("bad data URL");
        assert!(e.to_string().starts_with("image 0: "), "{e}");
    }

    #[test]
    fn a_template_renders_text_chats_and_its_errors_blame_the_client() {
        let template = ChatTemplate::new(
            "{% if messages[0]['role'] != 'user' %}{{ raise_exception('user first') }}{% endif %}{{ messages[0]['content'] }}".into(),
            String::new(),
            String::new(),
        )
        .expect("compiles");
        assert!(template
            .render(&json!([{"role": "user", "content": "x"}]), true)
            .is_ok());
        let p = Prompt::chat(Some(&json!([{"role": "system", "content": "x"}]))).expect("ok");
        // The built-in tokenizer has no template: the ChatML layout applies.
        assert!(renderer(1).render(&p).is_ok());
        let e = PromptError::Template(
            template
                .render(p.template_messages.as_ref().expect("text"), true)
                .expect_err("raises"),
        );
        assert!(e.to_string().contains("user first"));
        assert!(e.is_client_error());
    }

    #[test]
    fn a_renderer_is_shared_across_threads() {
        fn shareable<T: Send + Sync>() {}
        shareable::<Renderer>();
        shareable::<Prompt>();
    }

    #[test]
    fn a_prompt_with_no_tokens_is_refused() {
        let p = Prompt {
            segments: vec![Segment::Tokens(Vec::new())],
            ..Prompt::default()
        };
        assert!(matches!(renderer(1).render(&p), Err(PromptError::NoTokens)));
    }
}
