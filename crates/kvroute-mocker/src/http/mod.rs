//! The OpenAI-compatible HTTP server of one engine.
//!
//! | route | what |
//! | --- | --- |
//! | `POST /v1/completions` | text or token-id prompt; JSON or SSE (`stream`, `stream_options.include_usage`) |
//! | `POST /v1/chat/completions` | messages with text and `image_url` parts; JSON or SSE |
//! | `POST /v1/responses` | OpenAI's Responses API, rendered as a chat; stored conversations continued by `previous_response_id` ([`responses`]) |
//! | `POST /v1/messages` | Anthropic's Messages API, rendered as a chat, answered and failed in Anthropic's shapes ([`anthropic`]) |
//! | `GET /v1/models` | the served model |
//! | `GET /health` | 200 with an empty body |
//! | `GET /metrics` | the engine's gauges and counters per rank: Prometheus text, or OpenMetrics when `Accept` asks for it |
//! | `POST /reset_prefix_cache` (also SGLang's `/flush_cache`) | clear every rank's cache → `AllBlocksCleared` |
//! | `GET /server_info` (SGLang flavour) | SGLang's `kv_events` descriptor |
//! | `POST /internal/cache_match` | internal: cached prefix tokens of a request body on every rank (the bench's oracle) |
//! | `POST /internal/nixl/read` (vLLM engines) | a decode engine read the blocks a finished prefill leg holds ([`handoff`]) |
//!
//! A request goes to the rank named by the `X-data-parallel-rank` header or
//! the body's `data_parallel_rank`, else (SGLang prefill and decode roles)
//! to rank `bootstrap_room % dp`, else to the rank with the fewest requests
//! in flight. Every error is an OpenAI-style JSON body `{"error": {"message",
//! "type", "param", "code"}}`, except the disaggregation errors of SGLang
//! roles ([`ErrorShape::Sglang`]) and every error of `/v1/messages`
//! ([`ErrorShape::Anthropic`]); bodies up to [`BODY_LIMIT`] are accepted.

pub mod anthropic;
mod events;
pub mod handoff;
mod metrics;
pub mod native;
pub mod openai;
pub mod response_store;
pub mod responses;
mod tokenize;
pub mod traces;

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use axum::body::{Body, Bytes};
use axum::extract::rejection::BytesRejection;
use axum::extract::{DefaultBodyLimit, Request, State};
use axum::http::{header, HeaderMap, HeaderValue, StatusCode};
use axum::middleware::{self, Next};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use axum::{Json, Router};
use serde_json::{json, Value};
use tokio::sync::mpsc;

use crate::driver::RankHandle;
use crate::engine::{RequestId, Update, Usage};
use crate::faults::FailureDice;
use crate::filler::{Filler, FillerToken};
use kvroute_core::event::WorkerFlavor;
use kvroute_prompt::Renderer;
use openai::{ChunkPiece, Endpoint, ParsedRequest, PromptSettings, ResponseMeta};
pub use response_store::ResponseStore;

/// Largest request body accepted (images arrive inline as data URLs).
pub const BODY_LIMIT: usize = 64 * 1024 * 1024;

/// The JSON layout of an error body.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub enum ErrorShape {
    /// `{"error": {"message", "type", "param", "code"}}` (OpenAI, vLLM): the default.
    #[default]
    OpenAi,
    /// `{"object": "error", "message", "type", "param", "code"}`: SGLang's
    /// `ErrorResponse`, used for the errors of its disaggregation roles.
    Sglang,
    /// `{"type": "error", "error": {"type", "message"}}`: Anthropic's, for
    /// every error of `/v1/messages`; the type follows from the status
    /// (`invalid_request_error`, `not_found_error`, `overloaded_error`, …).
    Anthropic,
}

/// An HTTP error with an OpenAI-style JSON body.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ApiError {
    status: StatusCode,
    kind: &'static str,
    message: String,
    shape: ErrorShape,
    param: Option<&'static str>,
}

impl ApiError {
    /// 400: the request is invalid.
    pub fn bad_request(message: impl Into<String>) -> Self {
        Self::new(StatusCode::BAD_REQUEST, "BadRequestError", message)
    }

    /// 500: the mocker itself failed (or `--fail-rate` says so).
    pub fn internal(message: impl Into<String>) -> Self {
        Self::new(
            StatusCode::INTERNAL_SERVER_ERROR,
            "InternalServerError",
            message,
        )
    }

    /// 503: the engine restarted or is shutting down.
    pub fn unavailable(message: impl Into<String>) -> Self {
        Self::new(
            StatusCode::SERVICE_UNAVAILABLE,
            "ServiceUnavailableError",
            message,
        )
    }

    /// Any status.
    pub fn new(status: StatusCode, kind: &'static str, message: impl Into<String>) -> Self {
        ApiError {
            status,
            kind,
            message: message.into(),
            shape: ErrorShape::OpenAi,
            param: None,
        }
    }

    /// The same error naming the request field at fault (`param`).
    pub fn with_param(mut self, param: &'static str) -> Self {
        self.param = Some(param);
        self
    }

    /// The same error with its body laid out as `shape` says.
    pub fn with_shape(mut self, shape: ErrorShape) -> Self {
        self.shape = shape;
        self
    }

    /// The message.
    pub fn message(&self) -> &str {
        &self.message
    }

    /// The status code.
    pub fn status(&self) -> StatusCode {
        self.status
    }

    fn body(&self) -> Value {
        match self.shape {
            ErrorShape::OpenAi => json!({"error": {
                "message": self.message,
                "type": self.kind,
                "param": self.param,
                "code": self.status.as_u16(),
            }}),
            ErrorShape::Sglang => json!({
                "object": "error",
                "message": self.message,
                "type": self.kind,
                "param": self.param,
                "code": self.status.as_u16(),
            }),
            ErrorShape::Anthropic => json!({
                "type": "error",
                "error": {"type": anthropic::error_type(self.status), "message": self.message},
            }),
        }
    }
}

impl IntoResponse for ApiError {
    fn into_response(self) -> Response {
        (self.status, Json(self.body())).into_response()
    }
}

/// Where one engine's KV events can be read (for `/server_info`).
#[derive(Debug, Clone)]
pub struct EventEndpoints {
    /// Host of the sockets as clients should use it.
    pub host: String,
    /// PUB port of rank 0.
    pub events_port_base: u16,
    /// ROUTER port of rank 0.
    pub replay_port_base: u16,
}

/// Everything one engine's handlers share.
#[derive(Debug)]
pub struct EngineState {
    /// The engine's name (`w{k}`).
    pub name: String,
    /// The served model name.
    pub model: String,
    /// Where the model was loaded from, as `/v1/models` says (`root`): the
    /// folder of `--tokenizer`, else the model name.
    pub root: String,
    /// The LoRA adapters it serves besides.
    pub lora_adapters: Vec<String>,
    /// Which engine is imitated.
    pub flavor: WorkerFlavor,
    /// The data-parallel ranks.
    pub ranks: Vec<RankHandle>,
    /// Prompts to token ids (shared with the router's request side).
    pub renderer: Arc<Renderer>,
    /// The text generated tokens are drawn from.
    pub filler: Arc<Filler>,
    /// Prompt building settings.
    pub prompt: PromptSettings,
    /// Tokens per block.
    pub block_size: usize,
    /// `--delay-ms`.
    pub delay: Duration,
    /// `--fail-rate`.
    pub dice: Mutex<FailureDice>,
    /// `--cut-streams`.
    pub cut_dice: Mutex<FailureDice>,
    /// Unix seconds at start.
    pub created: u64,
    /// For `/server_info`.
    pub endpoints: EventEndpoints,
    /// Response ids.
    pub counter: AtomicU64,
    /// The prefill/decode role and what it needs.
    pub pd: handoff::PdState,
    /// The Responses API's stored conversations, by response id.
    pub responses: ResponseStore,
}

/// The router of one engine.
pub fn app(state: Arc<EngineState>) -> Router {
    let log = Arc::new(traces::TraceLog::default());
    let seen = log.clone();
    let mut router = Router::new();
    if state.flavor == WorkerFlavor::Vllm {
        router = router.route("/internal/nixl/read", post(handoff::nixl_read));
    }
    if state.flavor == WorkerFlavor::Sglang {
        router = router.route("/generate", post(native_generate));
    }
    router
        .route("/v1/completions", post(completions))
        .route("/v1/chat/completions", post(chat_completions))
        .route("/v1/responses", post(responses::create))
        .route("/v1/messages", post(anthropic::create))
        .route("/v1/models", get(models))
        .route("/tokenize", post(tokenize::tokenize))
        .route("/health", get(health))
        .route("/metrics", get(metrics))
        .route("/reset_prefix_cache", post(reset_prefix_cache))
        .route(
            "/flush_cache",
            post(reset_prefix_cache).get(reset_prefix_cache),
        )
        .route("/server_info", get(server_info))
        .route("/get_server_info", get(server_info))
        .route("/internal/cache_match", post(cache_match))
        .route(
            "/internal/traceparents",
            get(move || async move { traces::answer(&seen) }),
        )
        .fallback(not_found)
        .method_not_allowed_fallback(method_not_allowed)
        .layer(middleware::from_fn_with_state(state.clone(), delay))
        .layer(middleware::from_fn_with_state(log, traces::record))
        .layer(DefaultBodyLimit::max(BODY_LIMIT))
        .with_state(state)
}

async fn delay(State(state): State<Arc<EngineState>>, request: Request, next: Next) -> Response {
    if !state.delay.is_zero() {
        tokio::time::sleep(state.delay).await;
    }
    next.run(request).await
}

async fn not_found() -> ApiError {
    ApiError::new(StatusCode::NOT_FOUND, "NotFoundError", "no such route")
}

async fn method_not_allowed() -> ApiError {
    ApiError::new(
        StatusCode::METHOD_NOT_ALLOWED,
        "MethodNotAllowedError",
        "method not allowed on this route",
    )
}

async fn health() -> StatusCode {
    StatusCode::OK
}

impl EngineState {
    /// Prompt plus output tokens a request may have: what one rank's KV
    /// cache holds (every rank has the same).
    pub fn capacity_tokens(&self) -> usize {
        self.ranks.first().map_or(0, RankHandle::capacity_tokens)
    }
}

async fn models(State(state): State<Arc<EngineState>>) -> Json<Value> {
    let max_model_len = state.capacity_tokens();
    let entry = |id: &str, parent: Option<&str>| {
        json!({
            "id": id,
            "object": "model",
            "created": state.created,
            "owned_by": state.flavor.as_str(),
            "root": if parent.is_some() { parent.unwrap_or(id) } else { state.root.as_str() },
            "parent": parent,
            "max_model_len": max_model_len,
        })
    };
    let mut data = vec![entry(&state.model, None)];
    for adapter in &state.lora_adapters {
        data.push(entry(adapter, Some(&state.model)));
    }
    Json(json!({"object": "list", "data": data}))
}

async fn server_info(State(state): State<Arc<EngineState>>) -> Result<Json<Value>, ApiError> {
    if state.flavor != WorkerFlavor::Sglang {
        return Err(not_found().await);
    }
    Ok(Json(json!({
        "model_path": state.model,
        "served_model_name": state.model,
        "page_size": state.block_size,
        "dp_size": state.ranks.len(),
        "kv_events": {
            "publisher": "zmq",
            "endpoint_host": state.endpoints.host,
            "endpoint_port_base": state.endpoints.events_port_base,
            "topic": "",
            "block_size": state.block_size,
            "dp_size": state.ranks.len(),
            "replay_endpoint_port_base": state.endpoints.replay_port_base,
        },
    })))
}

async fn reset_prefix_cache(State(state): State<Arc<EngineState>>) -> Result<StatusCode, ApiError> {
    for rank in &state.ranks {
        rank.reset_prefix_cache()
            .await
            .map_err(|e| ApiError::unavailable(e.to_string()))?;
    }
    Ok(StatusCode::OK)
}

async fn completions(
    State(state): State<Arc<EngineState>>,
    headers: HeaderMap,
    body: Result<Bytes, BytesRejection>,
) -> Response {
    generate(state, headers, body, Endpoint::Completions)
        .await
        .unwrap_or_else(IntoResponse::into_response)
}

/// SGLang's native `/generate` (SGLang-flavoured engines).
async fn native_generate(
    State(state): State<Arc<EngineState>>,
    headers: HeaderMap,
    body: Result<Bytes, BytesRejection>,
) -> Response {
    generate(state, headers, body, Endpoint::Generate)
        .await
        .unwrap_or_else(IntoResponse::into_response)
}

async fn chat_completions(
    State(state): State<Arc<EngineState>>,
    headers: HeaderMap,
    body: Result<Bytes, BytesRejection>,
) -> Response {
    generate(state, headers, body, Endpoint::Chat)
        .await
        .unwrap_or_else(IntoResponse::into_response)
}

/// The shared path of the OpenAI and SGLang inference endpoints.
async fn generate(
    state: Arc<EngineState>,
    headers: HeaderMap,
    body: Result<Bytes, BytesRejection>,
    endpoint: Endpoint,
) -> Result<Response, ApiError> {
    let body = body.map_err(|e| ApiError::new(e.status(), "BadRequestError", e.body_text()))?;
    let parsed = openai::parse(endpoint, &body)?;
    let run = admit(&state, &headers, parsed).await?;
    let meta = ResponseMeta {
        id: match endpoint {
            Endpoint::Completions => format!("cmpl-{}-{}", state.name, run.n),
            Endpoint::Chat => format!("chatcmpl-{}-{}", state.name, run.n),
            Endpoint::Generate => format!("gen-{}-{}", state.name, run.n),
        },
        created: unix_now(),
        model: state.model.clone(),
        endpoint,
        input_logprobs: run.input_logprobs,
    };
    if run.parsed.stream {
        let cut = match state.cut_dice.lock() {
            Ok(mut dice) => dice.roll(),
            Err(poisoned) => poisoned.into_inner().roll(),
        };
        let state = StreamState {
            include_usage: run.parsed.include_usage,
            filler: run.filler,
            updates: run.updates,
            pending: std::collections::VecDeque::new(),
            text: String::new(),
            done: false,
            sent: 0,
            cut_after: cut.then(|| (run.parsed.max_tokens / 2).max(1)),
            meta,
        };
        return Ok(stream_response(state));
    }
    let mut answer = full_body(meta, run.filler, run.updates).await?;
    if let Some(params) = run.leg.transfer_params(&state, run.rank, run.id).await {
        answer["kv_transfer_params"] = params;
    }
    Ok(Json(answer).into_response())
}

/// A request running on one rank, with what its answer needs.
struct Admitted<'a> {
    /// The request as parsed (`max_tokens` as the leg set it).
    parsed: ParsedRequest,
    /// Its leg of a disaggregated request.
    leg: handoff::Leg,
    /// The rank running it.
    rank: &'a RankHandle,
    /// The engine's id of it.
    id: RequestId,
    /// Its tokens and its end, as the engine produces them.
    updates: mpsc::UnboundedReceiver<Update>,
    /// The text of each token it will generate.
    filler: Vec<FillerToken>,
    /// `/generate`'s `input_token_logprobs`, when asked.
    input_logprobs: Option<Value>,
    /// Its prompt's length in tokens.
    prompt_tokens: usize,
    /// Its number among the engine's answers (for response ids).
    n: u64,
}

/// Runs a parsed request the way every inference endpoint does: the model
/// (or LoRA adapter) checked, its leg planned, a rank picked, the prompt
/// rendered off the async workers, and the request submitted.
async fn admit<'a>(
    state: &'a EngineState,
    headers: &HeaderMap,
    mut parsed: ParsedRequest,
) -> Result<Admitted<'a>, ApiError> {
    if let Some(model) = &parsed.prompt.model {
        if state.lora_adapters.contains(model) {
            parsed.lora = Some(model.clone());
        } else if model != &state.model {
            return Err(ApiError::new(
                StatusCode::NOT_FOUND,
                "NotFoundError",
                format!("The model `{model}` does not exist."),
            ));
        }
    }
    let leg = handoff::Leg::plan(state, &mut parsed)?;
    let rank = pick_rank(state, headers, &parsed, leg.room())?;
    let failed = match state.dice.lock() {
        Ok(mut dice) => dice.roll(),
        Err(poisoned) => poisoned.into_inner().roll(),
    };
    if failed {
        return Err(ApiError::internal("injected failure (--fail-rate)"));
    }
    let (request, filler, parsed) = build_off_runtime(state, parsed).await?;
    // A decode leg received the prompt's KV and computed none of it.
    let input_logprobs = parsed.input_logprobs.then(|| match &leg {
        handoff::Leg::SglangDecode { .. } => Value::Array(Vec::new()),
        _ => native::input_token_logprobs(&request.prompt),
    });
    let prompt_tokens = request.prompt.len();
    let prepared = leg.prepare(state, rank, &request).await?;
    let (id, updates) = leg.submit(state, rank, request, prepared).await?;
    Ok(Admitted {
        parsed,
        leg,
        rank,
        id,
        updates,
        filler,
        input_logprobs,
        prompt_tokens,
        n: state.counter.fetch_add(1, Ordering::Relaxed),
    })
}

/// `parsed`'s engine request, built (rendered, tokenized, images hashed)
/// on the blocking pool: CPU work kept off the async workers. The parsed
/// request comes back with it. Images are named as vLLM names them, by
/// their bytes and the folder the engine says it loaded the model from
/// (its `root`).
pub(super) async fn build_off_runtime(
    state: &EngineState,
    mut parsed: ParsedRequest,
) -> Result<(crate::engine::NewRequest, Vec<FillerToken>, ParsedRequest), ApiError> {
    if parsed.prompt.image_count() > 0 {
        parsed.prompt.model_id = Some(state.root.clone());
    }
    let (renderer, filler) = (state.renderer.clone(), state.filler.clone());
    let (settings, capacity) = (state.prompt, state.capacity_tokens());
    tokio::task::spawn_blocking(move || {
        openai::build(&parsed, &renderer, &filler, settings, capacity).map(|(r, f)| (r, f, parsed))
    })
    .await
    .map_err(|e| ApiError::internal(format!("tokenizer task failed: {e}")))?
}

/// A request body and its JSON: the extractor's refusal (too large, …) or
/// a 400 naming the JSON error.
pub(super) fn json_body(body: Result<Bytes, BytesRejection>) -> Result<(Bytes, Value), ApiError> {
    let body = body.map_err(|e| ApiError::new(e.status(), "BadRequestError", e.body_text()))?;
    let value = serde_json::from_slice(&body)
        .map_err(|e| ApiError::bad_request(format!("the body is not valid JSON: {e}")))?;
    Ok((body, value))
}

/// `POST /internal/cache_match`: how many prompt tokens of a request each
/// rank's prefix cache holds right now, without running or changing anything.
///
/// The body is a `/v1/completions`, `/v1/chat/completions`, `/v1/responses`
/// or `/v1/messages` body, optionally with `"endpoint": "completions" |
/// "chat" | "responses" | "messages"` (without it, a body with `messages` is
/// a chat request, else a completion). The prompt is built exactly as the
/// real request would build it (chat template, images, a stored
/// conversation), and the answer is `{"ranks": [{"rank", "matched_tokens"}],
/// "prompt_tokens"}`, where `matched_tokens` is the `cached_tokens` the
/// request would report if that rank admitted it now. Internal: it exists so
/// a benchmark can compute the best achievable routing (an oracle); no real
/// engine has it.
async fn cache_match(
    State(state): State<Arc<EngineState>>,
    body: Result<Bytes, BytesRejection>,
) -> Result<Json<Value>, ApiError> {
    let (body, value) = json_body(body)?;
    let endpoint = match value.get("endpoint") {
        None | Some(Value::Null) if value.get("messages").is_some() => "chat".to_owned(),
        None | Some(Value::Null) => "completions".to_owned(),
        Some(Value::String(s)) => s.clone(),
        Some(_) => String::new(),
    };
    let parsed = match (endpoint.as_str(), value) {
        ("completions", _) => openai::parse(Endpoint::Completions, &body)?,
        ("chat", _) => openai::parse(Endpoint::Chat, &body)?,
        ("responses", Value::Object(obj)) => responses::parse(&state, body.len(), obj)?.0,
        ("messages", Value::Object(obj)) => anthropic::parse(obj)?,
        _ => {
            return Err(ApiError::bad_request(
                "`endpoint` must be \"completions\", \"chat\", \"responses\" or \"messages\"",
            ))
        }
    };
    let (request, _, _) = build_off_runtime(&state, parsed).await?;
    let mut ranks = Vec::with_capacity(state.ranks.len());
    for rank in &state.ranks {
        let matched = rank
            .cached_prefix_tokens(request.clone())
            .await
            .map_err(|e| ApiError::unavailable(e.to_string()))?;
        ranks.push(json!({"rank": rank.rank(), "matched_tokens": matched}));
    }
    Ok(Json(json!({
        "ranks": ranks,
        "prompt_tokens": request.prompt.len(),
    })))
}

fn pick_rank<'a>(
    state: &'a EngineState,
    headers: &HeaderMap,
    parsed: &ParsedRequest,
    room: Option<u64>,
) -> Result<&'a RankHandle, ApiError> {
    let from_header = match headers.get("x-data-parallel-rank") {
        None => None,
        Some(v) => Some(
            v.to_str()
                .ok()
                .and_then(|s| s.trim().parse::<u32>().ok())
                .ok_or_else(|| {
                    ApiError::bad_request("X-data-parallel-rank must be a non-negative integer")
                })?,
        ),
    };
    match from_header.or(parsed.dp_rank) {
        Some(r) => state.ranks.get(r as usize).ok_or_else(|| {
            ApiError::bad_request(format!(
                "data parallel rank {r} does not exist (dp size {})",
                state.ranks.len()
            ))
        }),
        None => match room {
            Some(room) if !state.ranks.is_empty() => {
                let index = room % state.ranks.len() as u64;
                state
                    .ranks
                    .get(usize::try_from(index).unwrap_or(0))
                    .ok_or_else(|| ApiError::internal("the engine has no ranks"))
            }
            _ => state
                .ranks
                .iter()
                .min_by_key(|r| (r.in_flight(), r.rank()))
                .ok_or_else(|| ApiError::internal("the engine has no ranks")),
        },
    }
}

/// The non-streamed answer, once the request finished.
async fn full_body(
    meta: ResponseMeta,
    filler: Vec<FillerToken>,
    mut updates: mpsc::UnboundedReceiver<Update>,
) -> Result<Value, ApiError> {
    let mut text = String::new();
    while let Some(update) = updates.recv().await {
        match update {
            Update::Token(i) => {
                if let Some(t) = filler.get(i) {
                    text.push_str(&t.text);
                }
            }
            Update::Finished(usage) => return Ok(meta.full(&text, &usage)),
            Update::Failed(message) => return Err(ApiError::unavailable(message)),
        }
    }
    Err(ApiError::unavailable("the engine is shutting down"))
}

fn sse(value: &Value) -> Bytes {
    Bytes::from(format!("data: {value}\n\n"))
}

struct StreamState {
    meta: ResponseMeta,
    include_usage: bool,
    filler: Vec<FillerToken>,
    updates: mpsc::UnboundedReceiver<Update>,
    /// Chunks ready to send, in order.
    pending: std::collections::VecDeque<Bytes>,
    /// The text so far (`/generate` streams it whole each time).
    text: String,
    done: bool,
    /// Tokens sent so far.
    sent: usize,
    /// `--cut-streams`: the connection closes after this many tokens.
    cut_after: Option<usize>,
}

impl StreamState {
    /// The chunk of one generated piece, or of the end with `usage`.
    fn chunk(&mut self, piece: ChunkPiece<'_>, usage: Option<&Usage>) -> Value {
        if self.meta.endpoint != Endpoint::Generate {
            return self.meta.chunk(piece, self.include_usage);
        }
        if let ChunkPiece::Text(t) = piece {
            self.text.push_str(t);
        }
        let logprobs = self.meta.input_logprobs.as_ref();
        native::chunk(&self.meta.id, &self.text, usage, logprobs)
    }
}

/// A streamed answer; a stream chosen by `--cut-streams` ends with an error
/// after its tokens, so the connection closes in the middle of the body.
fn stream_response(mut state: StreamState) -> Response {
    if state.meta.endpoint == Endpoint::Chat {
        let role = sse(&state.meta.chunk(ChunkPiece::Role, state.include_usage));
        state.pending.push_back(role);
    }
    let stream = futures_util::stream::unfold(state, |mut s| async move {
        loop {
            if let Some(bytes) = s.pending.pop_front() {
                return Some((Ok::<Bytes, std::io::Error>(bytes), s));
            }
            if s.done {
                return None;
            }
            if s.cut_after.is_some_and(|n| s.sent >= n) {
                s.done = true;
                let cut = std::io::Error::other("injected cut (--cut-streams)");
                return Some((Err(cut), s));
            }
            match s.updates.recv().await {
                Some(Update::Token(i)) => {
                    let text = s.filler.get(i).map(|t| t.text.clone()).unwrap_or_default();
                    let chunk = s.chunk(ChunkPiece::Text(&text), None);
                    s.pending.push_back(sse(&chunk));
                    s.sent += 1;
                }
                Some(Update::Finished(usage)) => {
                    let chunk = s.chunk(ChunkPiece::Finish, Some(&usage));
                    s.pending.push_back(sse(&chunk));
                    if s.include_usage {
                        s.pending.push_back(sse(&s.meta.usage_chunk(&usage)));
                    }
                    s.pending.push_back(Bytes::from_static(b"data: [DONE]\n\n"));
                    s.done = true;
                }
                Some(Update::Failed(message)) => {
                    s.pending
                        .push_back(sse(&ApiError::unavailable(message).body()));
                    s.pending.push_back(Bytes::from_static(b"data: [DONE]\n\n"));
                    s.done = true;
                }
                None => {
                    let e = ApiError::unavailable("the engine is shutting down");
                    s.pending.push_back(sse(&e.body()));
                    s.pending.push_back(Bytes::from_static(b"data: [DONE]\n\n"));
                    s.done = true;
                }
            }
        }
    });
    events::sse_response(Body::from_stream(stream))
}

fn unix_now() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| d.as_secs())
}

async fn metrics(State(state): State<Arc<EngineState>>, headers: HeaderMap) -> Response {
    let format = metrics::Format::negotiate(headers.get(header::ACCEPT));
    match metrics::render(&state, format) {
        Ok(text) => (
            [(
                header::CONTENT_TYPE,
                HeaderValue::from_static(format.content_type()),
            )],
            text,
        )
            .into_response(),
        Err(_) => ApiError::internal("the metrics could not be encoded").into_response(),
    }
}
