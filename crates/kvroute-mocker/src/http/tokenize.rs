//! `POST /tokenize`, as vLLM serves it: a chat (`messages`) rendered with
//! the engine's template, or a completion's `prompt`, tokenized exactly as a
//! request of that body would be; `{"count", "max_model_len", "tokens"}`.
//! Routers that cannot read the model's tokenizer ask this instead.

use std::sync::Arc;

use axum::body::Bytes;
use axum::extract::rejection::BytesRejection;
use axum::extract::State;
use axum::Json;
use serde_json::{json, Value};

use super::{build_off_runtime, json_body, openai, ApiError, Endpoint, EngineState};

/// `POST /tokenize`.
pub(super) async fn tokenize(
    State(state): State<Arc<EngineState>>,
    body: Result<Bytes, BytesRejection>,
) -> Result<Json<Value>, ApiError> {
    let (body, value) = json_body(body)?;
    let endpoint = if value.get("messages").is_some() {
        Endpoint::Chat
    } else {
        Endpoint::Completions
    };
    let parsed = openai::parse(endpoint, &body)?;
    let capacity = state.capacity_tokens();
    let (request, _, _) = build_off_runtime(&state, parsed).await?;
    Ok(Json(json!({
        "count": request.prompt.len(),
        "max_model_len": capacity,
        "tokens": request.prompt,
    })))
}
