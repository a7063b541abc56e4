//! The engine's own tokenizer as the last source: vLLM and SGLang serve
//! `POST /tokenize`, which renders a chat with the engine's own template and
//! tokenizes it exactly as the engine will, so a model whose tokenizer the
//! router cannot find is still routed on its prefix. It costs a round trip
//! to an engine per request (measured in `docs/real-engines.md`); answers
//! are cached by the exact text asked, so a repeated prompt costs nothing.
//!
//! The body asked is built from the request as the router read it (the chat
//! messages the Responses and Messages APIs convert to, or a completion's
//! text) and the fields of the client's body that change how a chat renders.

use std::collections::{HashMap, VecDeque};
use std::sync::{Arc, Mutex, PoisonError};
use std::time::Duration;

use kvroute_core::tokens::fold_token_id;
use kvroute_prompt::body::{RoutingRequest, TextPrompt};
use serde_json::{Map, Value};

use crate::proxy::answer;

/// The client's chat fields that change how the engine renders the prompt,
/// passed on to `/tokenize` as they came.
const CHAT_FIELDS: [&str; 6] = [
    "add_generation_prompt",
    "continue_final_message",
    "add_special_tokens",
    "chat_template",
    "chat_template_kwargs",
    "tools",
];

/// Time allowed for one `/tokenize` answer.
pub const TOKENIZE_TIMEOUT: Duration = Duration::from_secs(2);

/// The most of a `/tokenize` answer read (a 1 M-token prompt's ids).
const MAX_ANSWER_BYTES: usize = 16 << 20;

/// The `/tokenize` body for `req` (read from `client_body`), if the
/// engine's tokens would be this request's: a chat, or a completion of one
/// text. Batches, prompts given as ids and client-hashed images have none;
/// a chat with images has one only `with_images` (the caller pairs the
/// answer's image spans with the chat's images: `/tokenize` does not say
/// which image is which).
pub fn tokenize_body(
    req: &RoutingRequest,
    client_body: &[u8],
    chat: bool,
    with_images: bool,
) -> Option<Value> {
    if !req.images.is_empty() || req.mm_hashes.is_some() {
        return None;
    }
    let mut out = Map::new();
    if let Some(model) = &req.model {
        out.insert("model".into(), Value::String(model.clone()));
    }
    let client: Option<Map<String, Value>> = serde_json::from_slice(client_body).ok();
    match req.text.as_ref()? {
        TextPrompt::Chat(messages) => {
            if !with_images && has_images(messages) {
                return None;
            }
            out.insert("messages".into(), messages.clone());
            if chat {
                for key in CHAT_FIELDS {
                    if let Some(v) = client.as_ref().and_then(|c| c.get(key)) {
                        out.insert(key.into(), v.clone());
                    }
                }
            }
        }
        TextPrompt::Completion(Value::String(text)) => {
            out.insert("prompt".into(), Value::String(text.clone()));
            if let Some(v) = client.as_ref().and_then(|c| c.get("add_special_tokens")) {
                out.insert("add_special_tokens".into(), v.clone());
            }
        }
        TextPrompt::Completion(_) => return None,
    }
    Some(Value::Object(out))
}

/// Whether chat `messages` hold any part that is not text.
fn has_images(messages: &Value) -> bool {
    messages.as_array().into_iter().flatten().any(|m| {
        m.get("content")
            .and_then(Value::as_array)
            .is_some_and(|parts| {
                parts.iter().any(|p| {
                    p.get("type")
                        .and_then(Value::as_str)
                        .is_some_and(|t| t != "text")
                })
            })
    })
}

/// The token ids of a `/tokenize` answer, folded as the engine's events
/// fold them.
pub fn tokens_of(answer: &[u8]) -> Option<Vec<u32>> {
    #[derive(serde::Deserialize)]
    struct Answer {
        tokens: Vec<u64>,
    }
    let answer: Answer = serde_json::from_slice(answer).ok()?;
    Some(answer.tokens.into_iter().map(fold_token_id).collect())
}

/// Asks the engine at `url` for the tokens of `body`.
pub async fn ask(client: &reqwest::Client, url: &str, body: &Value) -> Result<Vec<u32>, String> {
    let resp = client
        .post(format!("{url}/tokenize"))
        .json(body)
        .timeout(TOKENIZE_TIMEOUT)
        .send()
        .await
        .map_err(|e| crate::api::error_chain(&e))?;
    if !resp.status().is_success() {
        return Err(format!("/tokenize answered {}", resp.status()));
    }
    let bytes = answer::read_capped(resp, MAX_ANSWER_BYTES)
        .await
        .map_err(|e| e.to_string())?;
    tokens_of(&bytes).ok_or_else(|| "/tokenize answered no `tokens` list".to_owned())
}

/// Recent `/tokenize` answers by the exact body asked, at most
/// `max_tokens` ids in all (the oldest go first).
#[derive(Debug)]
pub struct AnswerCache {
    max_tokens: usize,
    inner: Mutex<CacheInner>,
}

#[derive(Debug, Default)]
struct CacheInner {
    by_body: HashMap<u64, Arc<[u32]>>,
    order: VecDeque<u64>,
    tokens: usize,
}

impl AnswerCache {
    /// A cache of at most `max_tokens` ids.
    pub fn new(max_tokens: usize) -> Self {
        AnswerCache {
            max_tokens,
            inner: Mutex::default(),
        }
    }

    /// The key of `body`.
    pub fn key(body: &Value) -> u64 {
        xxhash_rust::xxh3::xxh3_64(body.to_string().as_bytes())
    }

    /// The tokens cached for `key`.
    pub fn get(&self, key: u64) -> Option<Arc<[u32]>> {
        self.lock().by_body.get(&key).cloned()
    }

    /// Caches `tokens` for `key`, dropping the oldest answers to make room.
    pub fn put(&self, key: u64, tokens: Arc<[u32]>) {
        if tokens.len() > self.max_tokens {
            return;
        }
        let mut inner = self.lock();
        if inner.by_body.contains_key(&key) {
            return;
        }
        while inner.tokens + tokens.len() > self.max_tokens {
            let Some(oldest) = inner.order.pop_front() else {
                break;
            };
            if let Some(gone) = inner.by_body.remove(&oldest) {
                inner.tokens -= gone.len();
            }
        }
        inner.tokens += tokens.len();
        inner.order.push_back(key);
        inner.by_body.insert(key, tokens);
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, CacheInner> {
        self.inner.lock().unwrap_or_else(PoisonError::into_inner)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn request(text: TextPrompt) -> RoutingRequest {
        RoutingRequest {
            model: Some("m".into()),
            text: Some(text),
            ..RoutingRequest::default()
        }
    }

    #[test]
    fn a_chat_is_asked_with_the_fields_that_change_its_rendering() {
        let messages = json!([{"role": "user", "content": "hi"}]);
        let client = json!({"messages": messages, "add_generation_prompt": false,
            "chat_template_kwargs": {"thinking": true}, "temperature": 0.5});
        let req = request(TextPrompt::Chat(messages.clone()));
        let body = tokenize_body(&req, client.to_string().as_bytes(), true, false).expect("a chat");
        assert_eq!(
            body,
            json!({"model": "m", "messages": messages, "add_generation_prompt": false,
                "chat_template_kwargs": {"thinking": true}})
        );
        let text = request(TextPrompt::Completion(json!("once upon")));
        let body = tokenize_body(&text, b"{}", false, false).expect("a text");
        assert_eq!(body, json!({"model": "m", "prompt": "once upon"}));
        let batch = request(TextPrompt::Completion(json!(["a", "b"])));
        assert_eq!(tokenize_body(&batch, b"{}", false, false), None);
        let image = json!([{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]);
        let image = request(TextPrompt::Chat(image));
        assert_eq!(tokenize_body(&image, b"{}", true, false), None);
        let asked = tokenize_body(&image, b"{}", true, true).expect("asked with images");
        assert_eq!(asked["messages"][0]["content"][0]["image_url"]["url"], "x");
    }

    #[test]
    fn answers_are_read_folded_and_cached_within_their_bound() {
        assert_eq!(
            tokens_of(br#"{"count": 3, "tokens": [1, 2, 5000000000]}"#),
            Some(vec![1, 2, fold_token_id(5_000_000_000)])
        );
        assert_eq!(tokens_of(br#"{"count": 3}"#), None);
        let cache = AnswerCache::new(5);
        cache.put(1, Arc::from(vec![1, 2, 3]));
        cache.put(2, Arc::from(vec![4, 5]));
        assert!(cache.get(1).is_some() && cache.get(2).is_some());
        cache.put(3, Arc::from(vec![6]));
        assert!(cache.get(1).is_none(), "the oldest made room");
        assert_eq!(cache.get(3).as_deref(), Some(&[6][..]));
        cache.put(4, Arc::from(vec![0; 6]));
        assert!(cache.get(4).is_none(), "longer than the whole cache");
    }
}
