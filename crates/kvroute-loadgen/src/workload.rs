//! The benchmark's workloads: seeded, deterministic request generators.
//!
//! Every size below is the size at `scale` 1.0; a run at scale `s` uses
//! `max(1, round(size · s))` tokens (or words, or images) instead. Token ids
//! are drawn uniformly below 151,643, so they are plain text ids for Qwen-style
//! vocabularies and the mocker. The n-th request of a run is the same on
//! every run with the same spec (for `multi-turn`, each conversation's n-th
//! turn is; which conversation goes next depends on which one finished).
//!
//! | workload | requests | reuse |
//! | --- | --- | --- |
//! | `shared-prefix` | one of `groups` system prompts (6,000 tokens, picked uniformly) + a unique question (1,200 tokens) | the system prompt (llm-d's published benchmark shape) |
//! | `multi-turn` | `groups` conversations of 8 turns: a 1,000-token system prompt, then per turn a 200-token user message; each turn's prompt is the previous prompt + a synthetic assistant reply of `max_tokens` ids + the new user message | the whole previous prompt |
//! | `long-doc` | one of `groups` documents (10,000 tokens, picked uniformly) + a unique question (100 tokens) | the document |
//! | `images` | chat requests: half a text-only chat from a pool of `groups` (500 words, resent verbatim), half one of `groups` image chats (an image, then that image's own 200-word question; resent verbatim) | repeated chats, repeated images (the published multimodal validation: a repeated image must hit on its image blocks and everything after them) |
//! | `random` | 7,200 unique tokens (the size of a shared-prefix request) | none: the overhead case |
//!
//! Requests go to `POST /v1/completions` with a token-id prompt (or, with
//! `text`, the same ids rendered as words, one word per id) except `images`,
//! which posts `/v1/chat/completions`. All stream with usage and set
//! `ignore_eos`, so every request generates exactly `max_tokens`.

use std::sync::Mutex;

use kvroute_core::rng::SplitMix64;
use serde::Serialize;
use serde_json::{json, Value};
use tokio::sync::Notify;

/// Token ids are drawn below this (Qwen2's first special id): plain text ids.
pub const TEXT_VOCAB: u64 = 151_643;

/// Sizes at scale 1.0 (tokens unless named otherwise).
pub mod sizes {
    /// `shared-prefix`: tokens of each group's system prompt (llm-d's benchmark).
    pub const SHARED_PREFIX: usize = 6_000;
    /// `shared-prefix`: tokens of each request's unique question (llm-d's benchmark).
    pub const SHARED_QUESTION: usize = 1_200;
    /// `multi-turn`: tokens of each conversation's system prompt.
    pub const MULTI_TURN_SYSTEM: usize = 1_000;
    /// `multi-turn`: tokens of each user message.
    pub const MULTI_TURN_USER: usize = 200;
    /// `multi-turn`: turns before a conversation starts over with new content (not scaled).
    pub const MULTI_TURN_TURNS: usize = 8;
    /// `long-doc`: tokens of each document.
    pub const LONG_DOC: usize = 10_000;
    /// `long-doc`: tokens of each question.
    pub const LONG_DOC_QUESTION: usize = 100;
    /// `images`: words of each text-only chat.
    pub const IMAGES_TEXT_WORDS: usize = 500;
    /// `images`: words of the question that follows each image.
    pub const IMAGES_QUESTION_WORDS: usize = 200;
    /// `images`: side of each generated RGB image in pixels (not scaled).
    pub const IMAGE_SIDE: usize = 32;
    /// `random`: tokens of each prompt.
    pub const RANDOM: usize = 7_200;
}

/// Which traffic to generate (see the module documentation for sizes).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "kebab-case")]
pub enum WorkloadKind {
    /// `groups` long system prompts shared by many requests, each with a unique question.
    SharedPrefix,
    /// Conversations that grow turn by turn; each turn resends the whole history.
    MultiTurn,
    /// Many short questions over a few long documents.
    LongDoc,
    /// Chat requests with repeated images and repeated text-only chats.
    Images,
    /// All-unique prompts: no reuse, the router's overhead case.
    Random,
    /// A Mooncake-format trace's requests, in order ([`WorkloadSpec::trace`]).
    Trace,
}

impl WorkloadKind {
    /// Every workload, in the order `--help` lists them.
    pub const ALL: [WorkloadKind; 5] = [
        WorkloadKind::SharedPrefix,
        WorkloadKind::MultiTurn,
        WorkloadKind::LongDoc,
        WorkloadKind::Images,
        WorkloadKind::Random,
    ];

    /// The command-line name (`shared-prefix`, …).
    pub fn name(self) -> &'static str {
        match self {
            WorkloadKind::SharedPrefix => "shared-prefix",
            WorkloadKind::MultiTurn => "multi-turn",
            WorkloadKind::LongDoc => "long-doc",
            WorkloadKind::Images => "images",
            WorkloadKind::Random => "random",
            WorkloadKind::Trace => "trace",
        }
    }
}

impl std::fmt::Display for WorkloadKind {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.name())
    }
}

impl std::str::FromStr for WorkloadKind {
    type Err = crate::Error;

    /// Parses a command-line name ([`WorkloadKind::name`]).
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        WorkloadKind::ALL
            .into_iter()
            .find(|k| k.name() == s)
            .ok_or_else(|| {
                let names: Vec<&str> = WorkloadKind::ALL.iter().map(|k| k.name()).collect();
                crate::Error::Invalid(format!(
                    "unknown workload `{s}` (expected one of {})",
                    names.join(", ")
                ))
            })
    }
}

/// A workload and its knobs; the same spec always yields the same requests.
#[derive(Debug, Clone, PartialEq)]
pub struct WorkloadSpec {
    /// Which traffic.
    pub kind: WorkloadKind,
    /// Seed of every random choice and token.
    pub seed: u64,
    /// Multiplies every size (1.0 = llm-d's full sizes; a laptop demo uses ~0.05–0.1).
    pub scale: f64,
    /// Groups (`shared-prefix`), conversations (`multi-turn`), documents
    /// (`long-doc`), or the size of both pools (`images`); `random` ignores it.
    pub groups: usize,
    /// Prompt positions the target engine gives one image (recorded in the
    /// report so `images` hit rates can be read against it; the engine decides).
    pub mm_tokens_per_image: usize,
    /// Tokens generated per request.
    pub max_tokens: u32,
    /// Send completion prompts as text (one word per token id) instead of ids;
    /// the router then needs a tokenizer to see the prefixes.
    pub text: bool,
    /// The `model` field of every request; none when `None`.
    pub model: Option<String>,
    /// `shared-prefix`: tokens of each question, instead of the scaled
    /// 1,200 (a shorter question raises the hit rate's ceiling).
    pub question_tokens: Option<usize>,
    /// `shared-prefix`: tokens of each group's prefix, instead of the
    /// scaled 6,000 (the presets' sizes).
    pub prefix_tokens: Option<usize>,
    /// Renders completion prompts as real text (a tokenizer's decoding of
    /// the ids) instead of ids or `text`'s made-up words.
    pub text_renderer: Option<TextRenderer>,
    /// Ask for streamed answers (SSE, the default) or whole ones.
    pub stream: bool,
    /// `trace`: the requests to replay (prompts drawn from their hash ids,
    /// `max_tokens` from their output lengths).
    pub trace: Option<crate::mooncake::Trace>,
    /// Token ids are drawn from `[low, high)` instead of below
    /// [`TEXT_VOCAB`]: a real model's vocabulary, its special ids left out
    /// (the project's tiny model: `(16, 32000)`).
    pub token_ids: Option<(u32, u32)>,
}

/// The function inside a [`TextRenderer`].
pub type RenderFn = dyn Fn(&[u32]) -> String + Send + Sync;

/// Token ids to prompt text, e.g. a Hugging Face tokenizer's decoding.
#[derive(Clone)]
pub struct TextRenderer(pub std::sync::Arc<RenderFn>);

impl TextRenderer {
    /// Prompts as the text the tokenizer in `path` (a Hugging Face
    /// `tokenizer.json`) decodes the workload's ids to.
    pub fn from_tokenizer_file(path: &std::path::Path) -> crate::Result<TextRenderer> {
        let tokenizer = kvroute_prompt::Tokenizer::from_file(path).map_err(|source| {
            crate::Error::Tokenizer {
                path: path.to_owned(),
                source,
            }
        })?;
        if tokenizer.decode(&[0]).is_none() {
            return Err(crate::Error::Invalid(format!(
                "the tokenizer {} cannot decode token ids",
                path.display()
            )));
        }
        Ok(TextRenderer(std::sync::Arc::new(move |ids: &[u32]| {
            tokenizer.decode(ids).unwrap_or_default()
        })))
    }
}

impl std::fmt::Debug for TextRenderer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("TextRenderer")
    }
}

impl PartialEq for TextRenderer {
    fn eq(&self, other: &Self) -> bool {
        std::sync::Arc::ptr_eq(&self.0, &other.0)
    }
}

impl Default for WorkloadSpec {
    fn default() -> Self {
        WorkloadSpec {
            kind: WorkloadKind::SharedPrefix,
            seed: 1,
            scale: 1.0,
            groups: 8,
            mm_tokens_per_image: 64,
            max_tokens: 32,
            text: false,
            model: None,
            question_tokens: None,
            prefix_tokens: None,
            text_renderer: None,
            stream: true,
            trace: None,
            token_ids: None,
        }
    }
}

impl WorkloadSpec {
    /// `size` at this spec's scale: `max(1, round(size · scale))`.
    pub fn scaled(&self, size: usize) -> usize {
        let scale = if self.scale.is_finite() && self.scale > 0.0 {
            self.scale
        } else {
            1.0
        };
        ((size as f64 * scale).round() as usize).max(1)
    }

    /// Tokens of each `shared-prefix` question.
    pub fn shared_question_tokens(&self) -> usize {
        self.question_tokens
            .map_or_else(|| self.scaled(sizes::SHARED_QUESTION), |q| q.max(1))
    }

    /// Tokens of each `shared-prefix` group's prefix.
    pub fn shared_prefix_tokens(&self) -> usize {
        self.prefix_tokens
            .map_or_else(|| self.scaled(sizes::SHARED_PREFIX), |p| p.max(1))
    }

    /// The spec as the report's `workload` object, with the resulting sizes.
    pub fn describe(&self) -> Value {
        let s = |n| self.scaled(n);
        let sizes = match self.kind {
            WorkloadKind::SharedPrefix => json!({
                "prefix_tokens": self.shared_prefix_tokens(),
                "question_tokens": self.shared_question_tokens(),
            }),
            WorkloadKind::MultiTurn => json!({
                "system_tokens": s(sizes::MULTI_TURN_SYSTEM),
                "user_tokens": s(sizes::MULTI_TURN_USER),
                "reply_tokens": self.max_tokens,
                "turns": sizes::MULTI_TURN_TURNS,
            }),
            WorkloadKind::LongDoc => json!({
                "document_tokens": s(sizes::LONG_DOC),
                "question_tokens": s(sizes::LONG_DOC_QUESTION),
            }),
            WorkloadKind::Images => json!({
                "text_words": s(sizes::IMAGES_TEXT_WORDS),
                "question_words": s(sizes::IMAGES_QUESTION_WORDS),
                "image_side_px": sizes::IMAGE_SIDE,
                "mm_tokens_per_image": self.mm_tokens_per_image,
            }),
            WorkloadKind::Random => json!({"prompt_tokens": s(sizes::RANDOM)}),
            WorkloadKind::Trace => json!({
                "trace": self.trace.as_ref().map(|t| t.name.as_str()),
                "requests": self.trace.as_ref().map_or(0, |t| t.requests.len()),
            }),
        };
        json!({
            "name": self.kind.name(),
            "seed": self.seed,
            "scale": self.scale,
            "groups": self.groups,
            "max_tokens": self.max_tokens,
            "prompt": match (self.kind, self.text) {
                (WorkloadKind::Images, _) => "chat",
                (_, true) => "text",
                (_, false) => "token_ids",
            },
            "sizes": sizes,
        })
    }
}

/// What a request repeats, for the `images` workload's per-kind hit rates.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum RepeatLabel {
    /// A text workload's request (no per-kind accounting).
    Plain,
    /// The first use of a text-only chat or an image.
    First,
    /// A text-only chat sent before, resent verbatim.
    TextRepeat,
    /// An image chat sent before, resent verbatim.
    ImageRepeat,
}

/// One request to send.
#[derive(Debug, Clone)]
pub struct PlannedRequest {
    /// `/v1/completions` or `/v1/chat/completions`.
    pub path: &'static str,
    /// The JSON body.
    pub body: Value,
    /// What it repeats.
    pub label: RepeatLabel,
    /// The `multi-turn` conversation it belongs to (release it with [`Workload::finished`]).
    pub conversation: Option<usize>,
}

/// A mixing step, so seeds of neighbouring items are unrelated.
fn mix(a: u64, b: u64) -> u64 {
    SplitMix64::new(a ^ b.wrapping_mul(SplitMix64::GAMMA)).next_u64()
}

/// `n` token ids from `rng`, in `spec`'s range ([`WorkloadSpec::token_ids`]).
fn ids(spec: &WorkloadSpec, rng: &mut SplitMix64, n: usize) -> Vec<u32> {
    let (low, high) = spec.token_ids.unwrap_or((0, TEXT_VOCAB as u32));
    let span = u64::from(high.saturating_sub(low).max(1));
    (0..n)
        .map(|_| low + (rng.next_u64() % span) as u32)
        .collect()
}

/// A token id as a word: a space and four lowercase letters (base 26), one
/// piece (one token) for the mocker's built-in tokenizer; distinct ids give
/// distinct words, so equal id prefixes render to equal text prefixes.
fn word(id: u32, out: &mut String) {
    out.push(' ');
    let mut v = id;
    for _ in 0..4 {
        out.push(char::from(b'a' + (v % 26) as u8));
        v /= 26;
    }
}

/// Ids rendered as words, each a space and four lowercase letters (one
/// token for the mocker's built-in tokenizer); ids below 26⁴ give distinct
/// words, so equal id prefixes render to equal text prefixes.
pub fn render_words(ids: &[u32]) -> String {
    let mut s = String::with_capacity(ids.len() * 5);
    for &id in ids {
        word(id, &mut s);
    }
    s
}

struct Conversation {
    /// Everything sent and "replied" so far.
    history: Vec<u32>,
    turns: usize,
    /// Times this conversation started over (seeds its next content).
    epoch: u64,
    busy: bool,
}

struct State {
    rng: SplitMix64,
    issued: u64,
    /// `shared-prefix` prompts or `long-doc` documents.
    prefixes: Vec<Vec<u32>>,
    conversations: Vec<Conversation>,
    next_conversation: usize,
    images: Vec<String>,
    image_used: Vec<bool>,
    chat_used: Vec<bool>,
}

/// A running workload: hands out requests in order, and for `multi-turn`
/// holds a conversation's next turn until its previous turn finished.
pub struct Workload {
    spec: WorkloadSpec,
    state: Mutex<State>,
    idle: Notify,
}

impl std::fmt::Debug for Workload {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Workload")
            .field("spec", &self.spec)
            .finish_non_exhaustive()
    }
}

impl Workload {
    /// Builds the shared content (prefixes, documents, images) from the seed.
    pub fn new(spec: &WorkloadSpec) -> Self {
        let groups = spec.groups.max(1);
        let seed = spec.seed;
        let mut prefixes = Vec::new();
        let mut images = Vec::new();
        let mut conversations = Vec::new();
        match spec.kind {
            WorkloadKind::SharedPrefix | WorkloadKind::LongDoc => {
                let n = if spec.kind == WorkloadKind::SharedPrefix {
                    spec.shared_prefix_tokens()
                } else {
                    spec.scaled(sizes::LONG_DOC)
                };
                for g in 0..groups {
                    let mut rng = SplitMix64::new(mix(seed, 1_000 + g as u64));
                    prefixes.push(ids(spec, &mut rng, n));
                }
            }
            WorkloadKind::MultiTurn => {
                conversations = (0..groups)
                    .map(|_| Conversation {
                        history: Vec::new(),
                        turns: 0,
                        epoch: 0,
                        busy: false,
                    })
                    .collect();
            }
            WorkloadKind::Images => {
                for i in 0..groups {
                    let mut rng = SplitMix64::new(mix(seed, 2_000 + i as u64));
                    images.push(crate::image::png_data_url(&mut rng, sizes::IMAGE_SIDE));
                }
            }
            WorkloadKind::Random | WorkloadKind::Trace => {}
        }
        Workload {
            spec: spec.clone(),
            state: Mutex::new(State {
                rng: SplitMix64::new(mix(seed, 1)),
                issued: 0,
                prefixes,
                conversations,
                next_conversation: 0,
                image_used: vec![false; images.len()],
                images,
                chat_used: vec![false; groups],
            }),
            idle: Notify::new(),
        }
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, State> {
        match self.state.lock() {
            Ok(g) => g,
            Err(poisoned) => poisoned.into_inner(),
        }
    }

    /// The next request; for `multi-turn` it waits until some conversation
    /// has no turn in flight.
    pub async fn next(&self) -> PlannedRequest {
        loop {
            let idle = self.idle.notified();
            if let Some(r) = self.try_next() {
                return r;
            }
            idle.await;
        }
    }

    /// The next request, or `None` when every `multi-turn` conversation has a
    /// turn in flight, or a `trace` has no request left.
    pub fn try_next(&self) -> Option<PlannedRequest> {
        let spec = &self.spec;
        let mut guard = self.lock();
        let st = &mut *guard;
        let n = st.issued;
        let request = match spec.kind {
            WorkloadKind::SharedPrefix | WorkloadKind::LongDoc => {
                let g = st.rng.below(st.prefixes.len());
                let q = if spec.kind == WorkloadKind::SharedPrefix {
                    spec.shared_question_tokens()
                } else {
                    spec.scaled(sizes::LONG_DOC_QUESTION)
                };
                let mut rng = SplitMix64::new(mix(spec.seed, (1 << 40) | n));
                let mut prompt = st.prefixes[g].clone();
                prompt.extend(ids(spec, &mut rng, q));
                self.completion(&prompt, None)
            }
            WorkloadKind::Random => {
                let mut rng = SplitMix64::new(mix(spec.seed, (1 << 40) | n));
                let prompt = ids(spec, &mut rng, spec.scaled(sizes::RANDOM));
                self.completion(&prompt, None)
            }
            WorkloadKind::Trace => {
                let r = spec.trace.as_ref()?.requests.get(n as usize)?;
                let mut request = self.completion(&crate::mooncake::prompt_tokens(r), None);
                request.body["max_tokens"] = json!(r.output_length);
                request
            }
            WorkloadKind::MultiTurn => {
                let count = st.conversations.len();
                let c = (0..count)
                    .map(|k| (st.next_conversation + k) % count)
                    .find(|&c| !st.conversations[c].busy)?;
                st.next_conversation = (c + 1) % count.max(1);
                let conv = &mut st.conversations[c];
                if conv.turns == sizes::MULTI_TURN_TURNS {
                    conv.turns = 0;
                    conv.epoch += 1;
                    conv.history.clear();
                }
                let mut rng = SplitMix64::new(mix(
                    spec.seed,
                    (3 << 40) | ((c as u64) << 20) | (conv.epoch << 8) | conv.turns as u64,
                ));
                if conv.turns == 0 {
                    conv.history = ids(spec, &mut rng, spec.scaled(sizes::MULTI_TURN_SYSTEM));
                }
                conv.history
                    .extend(ids(spec, &mut rng, spec.scaled(sizes::MULTI_TURN_USER)));
                let prompt = conv.history.clone();
                // The assistant's reply, client-side: the next turn resends it.
                conv.history
                    .extend(ids(spec, &mut rng, spec.max_tokens.max(1) as usize));
                conv.turns += 1;
                conv.busy = true;
                self.completion(&prompt, Some(c))
            }
            WorkloadKind::Images => {
                let pool = st.images.len().max(1);
                let item = st.rng.below(pool);
                if st.rng.next_u64() & 1 == 0 {
                    let label = if std::mem::replace(&mut st.chat_used[item], true) {
                        RepeatLabel::TextRepeat
                    } else {
                        RepeatLabel::First
                    };
                    let mut rng = SplitMix64::new(mix(spec.seed, (4 << 40) | item as u64));
                    let words = ids(spec, &mut rng, spec.scaled(sizes::IMAGES_TEXT_WORDS));
                    let messages = json!([{"role": "user", "content": render_words(&words)}]);
                    self.chat(messages, label)
                } else {
                    let label = if std::mem::replace(&mut st.image_used[item], true) {
                        RepeatLabel::ImageRepeat
                    } else {
                        RepeatLabel::First
                    };
                    let mut rng = SplitMix64::new(mix(spec.seed, (5 << 40) | item as u64));
                    let words = ids(spec, &mut rng, spec.scaled(sizes::IMAGES_QUESTION_WORDS));
                    let messages = json!([{"role": "user", "content": [
                        {"type": "image_url", "image_url": {"url": st.images[item]}},
                        {"type": "text", "text": render_words(&words)},
                    ]}]);
                    self.chat(messages, label)
                }
            }
        };
        st.issued += 1;
        Some(request)
    }

    /// Marks a request done; a `multi-turn` conversation may send its next turn.
    pub fn finished(&self, request: &PlannedRequest) {
        if let Some(c) = request.conversation {
            if let Some(conv) = self.lock().conversations.get_mut(c) {
                conv.busy = false;
            }
            self.idle.notify_waiters();
        }
    }

    fn common(&self, body: &mut Value) {
        body["max_tokens"] = json!(self.spec.max_tokens.max(1));
        body["stream"] = json!(self.spec.stream);
        if self.spec.stream {
            body["stream_options"] = json!({"include_usage": true});
        }
        body["ignore_eos"] = json!(true);
        if let Some(model) = &self.spec.model {
            body["model"] = json!(model);
        }
    }

    fn completion(&self, prompt: &[u32], conversation: Option<usize>) -> PlannedRequest {
        let mut body = if let Some(render) = &self.spec.text_renderer {
            json!({"prompt": (render.0)(prompt)})
        } else if self.spec.text {
            json!({"prompt": render_words(prompt)})
        } else {
            json!({ "prompt": prompt })
        };
        self.common(&mut body);
        PlannedRequest {
            path: "/v1/completions",
            body,
            label: RepeatLabel::Plain,
            conversation,
        }
    }

    fn chat(&self, messages: Value, label: RepeatLabel) -> PlannedRequest {
        let mut body = json!({ "messages": messages });
        self.common(&mut body);
        PlannedRequest {
            path: "/v1/chat/completions",
            body,
            label,
            conversation: None,
        }
    }
}

#[cfg(test)]
mod tests;
