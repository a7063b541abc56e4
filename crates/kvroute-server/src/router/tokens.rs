//! The router's side of tokenizer discovery: which models are due a look
//! (the workers' learned lists, less what `--tokenizer` and `--model`
//! cover), and a request's tokens asked of its engine's `/tokenize` when
//! that is where its model's come from. What is found, and how, is
//! [`crate::tokenizers`]'.

use std::sync::Arc;
use std::time::Instant;

use crate::model_list::Model;
use crate::tokenizers::{engine, Asker};

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
/// tokens come from there (and it has text, and no tokens yet); a failed
/// ask leaves it routed on load alone. `client_body` is the body as the
/// client sent it, `chat` whether it came to the chat endpoint.
pub async fn complete_from_engine(
    router: &Router,
    req: &mut kvroute_prompt::body::RoutingRequest,
    client_body: &[u8],
    chat: bool,
) {
    if req.tokens.is_some() || req.text.is_none() {
        return;
    }
    let Some(model) = req.model.clone().or_else(|| router.only_model()) else {
        return;
    };
    if !router.tokenizers().uses_engine(&model) {
        return;
    }
    let Some(body) = engine::tokenize_body(req, client_body, chat) else {
        return;
    };
    let key = engine::AnswerCache::key(&body);
    let answers = &router.tokenizers().answers;
    if let Some(tokens) = answers.get(key) {
        req.tokens = Some(tokens.to_vec());
        req.text = None;
        return;
    }
    for url in router.urls_serving(&model) {
        match engine::ask(router.client(), &url, &body).await {
            Ok(tokens) => {
                answers.put(key, Arc::from(tokens.as_slice()));
                req.tokens = Some(tokens);
                req.text = None;
                return;
            }
            Err(e) => tracing::debug!(model = %model, url = %url, error = %e, "/tokenize failed"),
        }
    }
}
