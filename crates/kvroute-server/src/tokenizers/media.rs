//! Images in prompts the engine tokenizes: where its `/tokenize` answer
//! puts each image, and which image it is.
//!
//! A vision-language model's engine expands each image to as many
//! placeholder positions as its processor makes of that image (Qwen2-VL:
//! one per 28×28 patch after its resize), which the router cannot know
//! without the model's processor. vLLM's `/tokenize` runs that processor,
//! so its answer for a chat with images holds every image's span as a run
//! of the model's image (or video) placeholder id. The router reads the
//! placeholder ids from the model's `config.json` (`image_token_id` or
//! `image_token_index`, `video_token_id`), finds the runs, and pairs the
//! k-th run with the k-th image or video part of the chat, named by
//! [`ImageIdentity::from_url_for`] with the model's `root`, or by the
//! part's `uuid` when the client gave one (vLLM then keys the image by it).
//!
//! When the runs cannot be paired with the parts one to one, the prompt
//! keeps only its tokens before the first run: its text prefix still
//! routes, and no two different images are ever taken for one.

use std::io::Read;
use std::path::Path;

use kvroute_core::multimodal::{ImageError, ImageIdentity, ImageSpan};
use serde_json::Value;

/// The most of a model's `config.json` read.
const MAX_CONFIG_BYTES: u64 = 1 << 20;

/// A vision-language model's placeholder ids: what its engine's tokens
/// hold in an image's (video's) positions.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct MediaTokens {
    /// The image placeholder id.
    pub image: u32,
    /// The video placeholder id, when the model has one.
    pub video: Option<u32>,
}

impl MediaTokens {
    /// The placeholder ids of the model whose `config.json` is in `dir`;
    /// `None` for a model without images, or a file that is missing,
    /// larger than 1 MiB or not JSON.
    pub fn read(dir: &Path) -> Option<MediaTokens> {
        let file = std::fs::File::open(dir.join("config.json")).ok()?;
        let mut text = Vec::new();
        file.take(MAX_CONFIG_BYTES + 1)
            .read_to_end(&mut text)
            .ok()?;
        if text.len() as u64 > MAX_CONFIG_BYTES {
            return None;
        }
        MediaTokens::of_config(&serde_json::from_slice(&text).ok()?)
    }

    /// The placeholder ids a model's configuration names.
    pub fn of_config(config: &Value) -> Option<MediaTokens> {
        let id = |key: &str| {
            config
                .get(key)
                .and_then(Value::as_u64)
                .and_then(|v| u32::try_from(v).ok())
        };
        let image = id("image_token_id").or_else(|| id("image_token_index"))?;
        let video = id("video_token_id").filter(|&v| v != image);
        Some(MediaTokens { image, video })
    }

    fn holds(&self, token: u32) -> bool {
        token == self.image || Some(token) == self.video
    }
}

/// One image or video part of a chat: its URL and the client's `uuid`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct MediaPart<'a> {
    /// The part's URL.
    pub url: &'a str,
    /// The part's `uuid`, when given.
    pub uuid: Option<&'a str>,
}

impl MediaPart<'_> {
    /// The image's identity as an engine that loaded its model from
    /// `model_id` names it.
    fn identity(&self, model_id: Option<&str>) -> Result<ImageIdentity, ImageError> {
        match self.uuid {
            Some(uuid) => Ok(ImageIdentity::from_uuid(uuid)),
            None => ImageIdentity::from_url_for(self.url, model_id),
        }
    }
}

/// Every image and video part of chat `messages`, in order.
pub fn media_parts(messages: &Value) -> Vec<MediaPart<'_>> {
    let parts = messages
        .as_array()
        .into_iter()
        .flatten()
        .filter_map(|m| m.get("content").and_then(Value::as_array))
        .flatten();
    parts
        .filter_map(|p| {
            let kind = p.get("type").and_then(Value::as_str)?;
            if kind != "image_url" && kind != "video_url" {
                return None;
            }
            let field = p.get(kind)?;
            let url = field
                .as_str()
                .or_else(|| field.get("url").and_then(Value::as_str))?;
            let uuid = p.get("uuid").and_then(Value::as_str);
            Some(MediaPart { url, uuid })
        })
        .collect()
}

/// What the engine's tokens of a chat with `parts` (its image and video
/// parts, in order) say of them: the spans, paired one to one with the
/// parts, or the length of the text prefix to keep when they cannot be.
#[derive(Debug, PartialEq, Eq)]
pub enum Located {
    /// Every part's span, in order.
    Spans(Vec<ImageSpan>),
    /// Keep the tokens before this position only.
    Prefix(usize),
}

/// Pairs the placeholder runs of `tokens` with `urls` (see the module docs).
pub fn locate(
    tokens: &[u32],
    media: MediaTokens,
    parts: &[MediaPart<'_>],
    model_id: Option<&str>,
) -> Located {
    let runs = runs(tokens, media);
    let prefix = runs.first().map_or(tokens.len(), |r| r.0);
    if runs.len() != parts.len() {
        return Located::Prefix(prefix);
    }
    let identities: Result<Vec<ImageIdentity>, ImageError> =
        parts.iter().map(|p| p.identity(model_id)).collect();
    match identities {
        Ok(identities) => Located::Spans(
            runs.into_iter()
                .zip(identities)
                .map(|((start, len), identity)| ImageSpan {
                    start,
                    len,
                    identity,
                })
                .collect(),
        ),
        Err(_) => Located::Prefix(prefix),
    }
}

/// The maximal runs of placeholder ids in `tokens`, as (start, length); an
/// image run and a video run side by side are two runs.
fn runs(tokens: &[u32], media: MediaTokens) -> Vec<(usize, usize)> {
    let mut out: Vec<(usize, usize)> = Vec::new();
    let mut i = 0;
    while i < tokens.len() {
        let token = tokens[i];
        if !media.holds(token) {
            i += 1;
            continue;
        }
        let len = tokens[i..].iter().take_while(|&&t| t == token).count();
        out.push((i, len));
        i += len;
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    const QWEN2_VL: MediaTokens = MediaTokens {
        image: 6,
        video: Some(7),
    };

    #[test]
    fn placeholder_ids_come_from_the_models_configuration() {
        let qwen = json!({"image_token_id": 6, "video_token_id": 7, "vision_start_token_id": 3});
        assert_eq!(MediaTokens::of_config(&qwen), Some(QWEN2_VL));
        let llava = json!({"image_token_index": 32000});
        assert_eq!(
            MediaTokens::of_config(&llava),
            Some(MediaTokens {
                image: 32000,
                video: None
            })
        );
        assert_eq!(MediaTokens::of_config(&json!({"vocab_size": 9})), None);
        assert_eq!(MediaTokens::of_config(&json!({"image_token_id": -1})), None);
        let dir = std::env::temp_dir().join(format!("kvroute-media-{}", std::process::id()));
        std::fs::create_dir_all(&dir).expect("dir");
        std::fs::write(dir.join("config.json"), qwen.to_string()).expect("write");
        assert_eq!(MediaTokens::read(&dir), Some(QWEN2_VL));
        std::fs::write(dir.join("config.json"), "{").expect("write");
        assert_eq!(MediaTokens::read(&dir), None);
        std::fs::remove_dir_all(&dir).ok();
        assert_eq!(MediaTokens::read(Path::new("/nonexistent")), None);
    }

    #[test]
    fn runs_pair_with_the_parts_in_order() {
        // text, image A (4), text, video (2), image B (3) right after it
        let tokens = [1, 16, 3, 6, 6, 6, 6, 4, 100, 3, 7, 7, 6, 6, 6, 4, 2];
        let (a, b) = ("data:image/png;base64,aGVsbG8=", "data:,other");
        let messages = json!([{"role": "user", "content": [
            {"type": "text", "text": "x"},
            {"type": "image_url", "image_url": {"url": a}},
            {"type": "video_url", "video_url": a},
            {"type": "image_url", "image_url": {"url": b}, "uuid": "mine"},
        ]}]);
        let parts = media_parts(&messages);
        assert_eq!(parts.len(), 3);
        let located = locate(&tokens, QWEN2_VL, &parts, Some("/m"));
        let Located::Spans(spans) = located else {
            panic!("paired: {located:?}");
        };
        let got: Vec<(usize, usize)> = spans.iter().map(|s| (s.start, s.len)).collect();
        assert_eq!(got, [(3, 4), (10, 2), (12, 3)]);
        assert_eq!(
            spans[0].identity,
            ImageIdentity::from_url_for(a, Some("/m")).expect("valid")
        );
        assert_eq!(spans[0].identity, spans[1].identity);
        assert_eq!(spans[2].identity, ImageIdentity::from_uuid("mine"));
    }

    #[test]
    fn unpaired_runs_keep_only_the_text_before_them() {
        let tokens = [1, 16, 3, 6, 6, 4, 100];
        let part = MediaPart {
            url: "data:,x",
            uuid: None,
        };
        assert_eq!(
            locate(&tokens, QWEN2_VL, &[part, part], None),
            Located::Prefix(3)
        );
        assert_eq!(locate(&tokens, QWEN2_VL, &[], None), Located::Prefix(3));
        assert_eq!(locate(&[1, 2], QWEN2_VL, &[part], None), Located::Prefix(2));
        let bad = MediaPart {
            url: "data:image/png;base64,%",
            uuid: None,
        };
        assert_eq!(locate(&tokens, QWEN2_VL, &[bad], None), Located::Prefix(3));
        assert_eq!(
            locate(&[1, 2], QWEN2_VL, &[], None),
            Located::Spans(Vec::new())
        );
    }
}
