//! kvroute-prompt: an OpenAI request's prompt to the token ids the engine
//! will cache, for the router and the mock engine alike.
//!
//! A KV-cache-aware router only finds the blocks an engine holds if it hashes
//! the same token ids the engine computed, so both sides of kvroute render
//! prompts here and nowhere else:
//!
//! * `kvroute serve --tokenizer` (the router's request side) tokenizes text
//!   prompts and chat messages to score workers by cached prefix;
//! * `kvroute-mocker` (the simulated vLLM / SGLang engine) builds the prompt
//!   it caches and publishes KV events for.
//!
//! **Contract.** Input is the already-extracted JSON value of each prompt
//! field of a request — `prompt` or `messages`, `mm_hashes`, `model` — so a
//! caller that scanned the body once never parses it again. [`Prompt`]
//! validates them (every error names the field: [`PromptError`]); a
//! [`Renderer`] (a [`Tokenizer`] and an [`ImageTokenRule`]) turns a prompt
//! into a [`NeutralPrompt`]: token ids with the image placeholder in every
//! image position, and each image's span and identity. Engine flavours fill
//! image positions from there (SGLang pads, vLLM placeholders, see
//! `kvroute_core::multimodal`).
//!
//! * **Chats**: when the tokenizer has the model's chat template
//!   (`tokenizer_config.json` beside `tokenizer.json`) and every part is
//!   text, the template renders the text, which is tokenized whole; otherwise
//!   the ChatML layout ([`fields::chat_segments`]).
//! * **Tokenizers**: the documented built-in tokenizer always; a Hugging Face
//!   `tokenizer.json` with the cargo feature `hf`, whose ids are exactly those
//!   of `tokenizers::Tokenizer::encode(text, false)` (`tests/parity.rs`
//!   checks that on real vocabularies). The text is cut where that provably
//!   changes nothing — at added tokens, and for byte-level BPE pipelines
//!   (GPT-2, Qwen2, Llama 3) also between words of long pieces — and the ids
//!   of each piece are kept in a bounded cache shared by all threads, so a
//!   repeated system prompt, an earlier chat turn or a shared document prefix
//!   costs a hash lookup. New byte-level pieces skip `tokenizers`' offset
//!   bookkeeping ([`Tokenizer::text_path`] tells which steps apply).
//! * **Other APIs' bodies**: OpenAI's Responses API ([`responses`]) and
//!   Anthropic's Messages API ([`messages`]) are converted into chat
//!   messages the way engines convert them, then rendered exactly as a chat
//!   is; the router and the mock engine share the conversion, as they share
//!   the rendering. SGLang's native `/generate` is read by [`generate`].
//! * **Pure and synchronous**: no runtime, sockets or I/O besides loading the
//!   tokenizer files. Tokenizing a long prompt is CPU work: async callers run
//!   it off their executor.
//!
//! ```
//! use kvroute_prompt::{ImageTokenRule, Prompt, PromptFields, PromptSource, Renderer, Tokenizer};
//!
//! let body: serde_json::Value = serde_json::json!({"prompt": "Hello, world", "model": "m"});
//! let prompt = Prompt::from_fields(&PromptFields {
//!     source: PromptSource::Completion(body.get("prompt")),
//!     mm_hashes: body.get("mm_hashes"),
//!     model: body.get("model").and_then(|m| m.as_str()),
//! })?;
//! let renderer = Renderer::new(Tokenizer::builtin(), ImageTokenRule::fixed(64));
//! assert_eq!(renderer.render(&prompt)?.tokens.len(), 3);
//! # Ok::<(), kvroute_prompt::PromptError>(())
//! ```

#![forbid(unsafe_code)]

pub mod body;
pub mod cache;
pub mod chat_template;
pub mod error;
pub mod fields;
pub mod generate;
pub mod keys;
pub mod messages;
pub mod prompt;
pub mod render;
pub mod responses;
pub mod sampling;
pub mod shape;
pub mod tokenizer;

pub use cache::CacheStats;
pub use chat_template::{ChatTemplate, ChatTemplateError};
pub use error::PromptError;
pub use kvroute_core::multimodal::{ImageSpan, ImageTokenRule, RoutingPrompt};
pub use prompt::{ChatEnding, Prompt, PromptFields, PromptSource, Segment, SpecialToken};
pub use render::{NeutralPrompt, Renderer};
pub use tokenizer::{Piece, Specials, TextPath, Tokenizer, TokenizerError};
