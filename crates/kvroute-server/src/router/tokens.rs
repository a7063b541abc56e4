//! The router's side of tokenizer discovery: which models are due a look
//! (the workers' learned lists, less what `--tokenizer` and `--model`
//! cover), and a request's tokens asked of its engine's `/tokenize` when
//! that is where its model's come from. What is found, and how, is
//! [`crate::tokenizers`]'.

use std::sync::Arc;
use std::time::Instant;

use crate::model_list::Model;
use kvroute_prompt::body::{RoutingRequest, TextPrompt};

use crate::tokenizers::{engine, media, Asker};

use super::Router;

/// Starts looking for the tokenizer of every model the workers list that
/// is due a look (unless `--tokenizer` covers every model), each on a task
/// of its own: a download may take a while.
pub fn discover_due(router: &Arc<Router>) {
    if router.config().renderer.is_some() {
        return;
    }
    let learned = router.learned_models();
    let explicit = &router.config().model_renderers;
    let learned: Vec<Model> = learned
        .into_iter()
        .filter(|m| !explicit.contains_key(&m.id))
        .collect();
    for model in router.tokenizers().due(&learned, Instant::now()) {
        let router = router.clone();
        tokio::spawn(async move {
            let asker = Asker {
                client: router.client(),
                urls: router.urls_serving(&model.id),
            };
            router.tokenizers().discover(&model, asker).await;
        });
    }
}

/// Fills in `req.tokens` from the engine's `/tokenize` when its model's
/// tokens come from there (and it has text, and no tokens yet), or when it
/// is a chat with images for a vision-language model found by discovery
/// (then `req.images` too: [`media`]); a failed ask leaves it routed on
/// load alone. `client_body` is the body as the client sent it, `chat`
/// whether it came to the chat endpoint.
pub async fn complete_from_engine(
    router: &Router,
    req: &mut RoutingRequest,
    client_body: &[u8],
    chat: bool,
) {
    if req.tokens.is_some() || req.text.is_none() {
        return;
    }
    let Some(model) = req.model.clone().or_else(|| router.only_model()) else {
        return;
    };
    let with_media = chat_with_media(req);
    let media = router
        .tokenizers()
        .media(&model)
        .filter(|_| with_media && !router.has_explicit_renderer(&model));
    if !router.tokenizers().uses_engine(&model) && media.is_none() {
        return;
    }
    let Some(body) = engine::tokenize_body(req, client_body, chat, media.is_some()) else {
        return;
    };
    let Some(tokens) = ask_engines(router, &model, &body).await else {
        return;
    };
    let text = req.text.take();
    let (Some(media), Some(TextPrompt::Chat(messages))) = (media, &text) else {
        req.tokens = Some(tokens.to_vec());
        return;
    };
    let parts = media::media_parts(messages);
    let root = router.model_root(&model);
    match media::locate(&tokens, media, &parts, root.as_deref()) {
        media::Located::Spans(spans) => {
            req.tokens = Some(tokens.to_vec());
            req.images = spans;
        }
        media::Located::Prefix(keep) => {
            tracing::debug!(model = %model, keep, "images not paired with the engine's tokens; text prefix only");
            req.tokens = Some(tokens.get(..keep).unwrap_or(&tokens).to_vec());
        }
    }
}

/// The engine's tokens for `body`: from the answers cache, else asked of
/// the model's workers in turn (and cached).
async fn ask_engines(router: &Router, model: &str, body: &serde_json::Value) -> Option<Arc<[u32]>> {
    let key = engine::AnswerCache::key(body);
    let answers = &router.tokenizers().answers;
    if let Some(tokens) = answers.get(key) {
        return Some(tokens);
    }
    for url in router.urls_serving(model) {
        match engine::ask(router.client(), &url, body).await {
            Ok(tokens) => {
                let tokens: Arc<[u32]> = Arc::from(tokens);
                answers.put(key, tokens.clone());
                return Some(tokens);
            }
            Err(e) => tracing::debug!(model = %model, url = %url, error = %e, "/tokenize failed"),
        }
    }
    None
}

/// Whether `req` is a chat with image or video parts.
fn chat_with_media(req: &RoutingRequest) -> bool {
    matches!(&req.text, Some(TextPrompt::Chat(m)) if !media::media_parts(m).is_empty())
}
