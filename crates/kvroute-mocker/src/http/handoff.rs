//! The HTTP side of prefill/decode roles: what each leg of a disaggregated
//! request does around the engine, vLLM's side channel, and the counters.
//!
//! A request becomes one `Leg` (see `docs/mocker.md`, "Prefill and decode
//! roles"):
//! * vLLM, `kv_transfer_params.do_remote_decode` (a prefill leg): the
//!   blocks are held when it finishes and a non-streamed answer carries
//!   top-level `kv_transfer_params` telling the decode how to read them;
//! * vLLM, `do_remote_prefill` with every remote field (a decode leg): wait
//!   the modelled transfer of the blocks this engine lacks, tell the prefill
//!   they were read (`POST /internal/nixl/read` on its side channel, which
//!   releases them), and run with the prompt arrived computed; if the
//!   prefill cannot be read, compute it here (vLLM's `recompute` policy);
//! * SGLang prefill engine: open the room, compute the prompt (one output
//!   token, as SGLang's prefill returns), hold the blocks, fill the room;
//! * SGLang decode engine: wait for the room on the prefill's bootstrap
//!   server, the modelled transfer, tell the prefill it is done, and run
//!   with the prompt arrived computed.
//!
//! A vLLM `both` engine is both ends of its connector (vLLM's `kv_both`):
//! it answers a `do_remote_decode` leg holding its blocks and reads a
//! `do_remote_prefill` leg from another engine, which is how a router moves
//! a prefix between two aggregated engines; a request without the field is
//! an ordinary one. An SGLang `both` engine ignores its transfer fields,
//! unless it runs with `--kv-both`: then it serves bootstrap rooms too, a
//! leg whose bootstrap names its own server is a prefill leg (it is the
//! source), a leg naming another engine's is a decode leg (it reads the
//! blocks it lacks from there), and a request without a room is ordinary.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use axum::body::Bytes;
use axum::extract::rejection::BytesRejection;
use axum::extract::State;
use axum::http::StatusCode;
use axum::Json;
use serde_json::{json, Value};
use tokio::sync::mpsc;

use super::openai::ParsedRequest;
use super::{ApiError, EngineState, ErrorShape};
use crate::bootstrap::{self, page_hashes, RoomInfo, RoomTable, RoomWait};
use crate::config::Role;
use crate::driver::{RankError, RankHandle};
use crate::engine::{Handoff, NewRequest, RequestId, Update};
use crate::handoff::{transfer_delay, Bootstrap, FieldError, KvTransferParams};
use crate::peer;
use kvroute_core::event::WorkerFlavor;

/// How long a decode waits for a vLLM prefill's side channel to answer.
const READ_TIMEOUT: Duration = Duration::from_secs(5);

/// Disaggregation counters of one engine (on `/metrics` unless its role is
/// `both`, SGLang `--kv-both` engines excepted).
#[derive(Debug, Default)]
pub struct HandoffStats {
    /// Transfers handed to a decode: vLLM answers with `kv_transfer_params`, SGLang rooms filled.
    pub sent: AtomicU64,
    /// Decode legs whose prompt arrived from a prefill.
    pub received: AtomicU64,
    /// Blocks those transfers moved.
    pub blocks: AtomicU64,
    /// Nanoseconds waited for modelled transfers.
    pub wait_nanos: AtomicU64,
    /// vLLM decode legs with `do_remote_prefill` but not every remote field
    /// ("Got invalid KVTransferParams"), computed locally.
    pub invalid: AtomicU64,
    /// Transfers that failed: a vLLM prefill that could not be read (computed
    /// locally), an SGLang room that failed or never filled (an error).
    pub failures: AtomicU64,
}

fn bump(counter: &AtomicU64, by: u64) {
    counter.fetch_add(by, Ordering::Relaxed);
}

/// What one engine needs for its role.
#[derive(Debug)]
pub struct PdState {
    /// `--role`.
    pub role: Role,
    /// This engine's `remote_engine_id` (`w{k}@host:port`).
    pub engine_id: String,
    /// `remote_host` of its answers: where its side channel is reached.
    pub side_host: String,
    /// `remote_port`: its side channel (the HTTP port).
    pub side_port: u16,
    /// `--transfer-us-per-block`.
    pub transfer_us_per_block: u64,
    /// `--speedup`, which divides the transfer time too.
    pub speedup: f64,
    /// `--kv-lease-secs`: an SGLang decode's longest wait for its room.
    pub lease: Duration,
    /// The bootstrap rooms (SGLang prefill engines, `both` with `--kv-both`).
    pub rooms: Option<Arc<RoomTable>>,
    /// The port they are served on, which names this engine as a source.
    pub bootstrap_port: Option<u16>,
    /// Counters.
    pub stats: Arc<HandoffStats>,
}

/// What one request is in a disaggregated fleet.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(super) enum Leg {
    /// An ordinary request.
    Local,
    /// vLLM: read the prompt from a prefill (`receive`), hold the blocks for a decode (`send`).
    Vllm { receive: Option<Remote>, send: bool },
    /// SGLang prefill engine.
    SglangPrefill { room: u64 },
    /// SGLang decode engine.
    SglangDecode { host: String, port: u16, room: u64 },
}

/// Whether a leg's bootstrap names this engine's own bootstrap server:
/// an SGLang `both` engine is then the source of the hand-off.
fn names_this_engine(pd: &PdState, b: &Bootstrap) -> bool {
    b.port.is_some() && b.port == pd.bootstrap_port && b.host.as_deref() == Some(&*pd.side_host)
}

/// A vLLM prefill to read from.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(super) struct Remote {
    engine_id: String,
    request_id: String,
    host: String,
    port: u16,
}

/// A leg ready to submit: how its KV crosses engines, and the prefill's page hashes.
#[derive(Debug)]
pub(super) struct Prepared {
    pub handoff: Handoff,
    hashes: Vec<i64>,
}

fn sglang_error(e: FieldError) -> ApiError {
    ApiError::bad_request(e.message).with_shape(ErrorShape::Sglang)
}

impl Leg {
    /// The leg a request is on this engine; 400 for malformed or missing
    /// transfer fields. An SGLang prefill leg generates one token.
    pub(super) fn plan(state: &EngineState, parsed: &mut ParsedRequest) -> Result<Leg, ApiError> {
        let pd = &state.pd;
        if pd.role == Role::Both && state.flavor != WorkerFlavor::Vllm && pd.rooms.is_none() {
            return Ok(Leg::Local);
        }
        match state.flavor {
            // The mocker refuses prefill and decode roles for TensorRT-LLM.
            WorkerFlavor::Trtllm => Ok(Leg::Local),
            WorkerFlavor::Vllm => {
                let raw = parsed.transfer.kv_transfer_params.as_ref();
                let Some(params) =
                    KvTransferParams::parse(raw).map_err(|e| ApiError::bad_request(e.message))?
                else {
                    return Ok(Leg::Local);
                };
                let receive = params.remote().map(|r| Remote {
                    engine_id: r.engine_id.to_owned(),
                    request_id: r.request_id.to_owned(),
                    host: r.host.to_owned(),
                    port: r.port,
                });
                if params.do_remote_prefill && receive.is_none() {
                    bump(&pd.stats.invalid, 1);
                    tracing::warn!(
                        params = %raw.map(|v| v.to_string()).unwrap_or_default(),
                        "Got invalid KVTransferParams. This request will not utilize KVTransfer"
                    );
                }
                if receive.is_none() && !params.do_remote_decode {
                    return Ok(Leg::Local);
                }
                Ok(Leg::Vllm {
                    receive,
                    send: params.do_remote_decode,
                })
            }
            WorkerFlavor::Sglang => {
                let b = Bootstrap::parse(&parsed.transfer).map_err(sglang_error)?;
                if pd.role == Role::Both && b.room.is_none() {
                    return Ok(Leg::Local);
                }
                let source = pd.role == Role::Prefill
                    || (pd.role == Role::Both && names_this_engine(pd, &b));
                if source {
                    parsed.max_tokens = 1;
                    Ok(Leg::SglangPrefill {
                        room: b.prefill_room().map_err(sglang_error)?,
                    })
                } else {
                    let (host, port, room) = b.decode_target().map_err(sglang_error)?;
                    Ok(Leg::SglangDecode {
                        host: host.to_owned(),
                        port,
                        room,
                    })
                }
            }
        }
    }

    /// SGLang's `bootstrap_room`, which picks the DP rank (`room % dp`) as
    /// its `follow_bootstrap_room` balancing does.
    pub(super) fn room(&self) -> Option<u64> {
        match self {
            Leg::SglangPrefill { room } | Leg::SglangDecode { room, .. } => Some(*room),
            _ => None,
        }
    }

    /// Everything before the engine runs the leg: opening a room, or
    /// waiting for the prompt's KV to arrive.
    pub(super) async fn prepare(
        &self,
        state: &EngineState,
        rank: &RankHandle,
        request: &NewRequest,
    ) -> Result<Prepared, ApiError> {
        let local = |received_tokens, hold| Prepared {
            handoff: Handoff {
                received_tokens,
                hold,
            },
            hashes: Vec::new(),
        };
        match self {
            Leg::Local => Ok(local(0, false)),
            Leg::Vllm { receive, send } => {
                let received = match receive {
                    Some(remote) => receive_vllm(state, rank, request, remote).await?,
                    None => 0,
                };
                Ok(local(received, *send))
            }
            Leg::SglangPrefill { room } => {
                let rooms = state.pd.rooms.as_ref().ok_or_else(|| {
                    ApiError::internal("no bootstrap server").with_shape(ErrorShape::Sglang)
                })?;
                rooms.open(*room).map_err(|e| {
                    ApiError::bad_request(e.to_string()).with_shape(ErrorShape::Sglang)
                })?;
                Ok(Prepared {
                    handoff: Handoff {
                        received_tokens: 0,
                        hold: true,
                    },
                    hashes: page_hashes(&request.prompt, state.block_size),
                })
            }
            Leg::SglangDecode { host, port, room } => {
                let received = receive_sglang(state, rank, request, host, *port, *room).await?;
                Ok(local(received, false))
            }
        }
    }

    /// Submits the leg; a prefill leg's room is failed if the engine refuses it.
    pub(super) async fn submit(
        &self,
        state: &EngineState,
        rank: &RankHandle,
        request: NewRequest,
        prepared: Prepared,
    ) -> Result<(RequestId, mpsc::UnboundedReceiver<Update>), ApiError> {
        let prompt_tokens = request.prompt.len();
        let submitted = rank.submit_with(request, prepared.handoff).await;
        let (id, updates) = match submitted {
            Ok(s) => s,
            Err(e) => {
                if let (Leg::SglangPrefill { room }, Some(rooms)) = (self, &state.pd.rooms) {
                    rooms.fail(*room, e.to_string());
                }
                return Err(match e {
                    RankError::Invalid(e) => ApiError::bad_request(e.to_string()),
                    RankError::Stopped => ApiError::unavailable(e.to_string()),
                });
            }
        };
        let updates = match (self, &state.pd.rooms) {
            (Leg::SglangPrefill { room }, Some(rooms)) => {
                let filler = RoomFiller {
                    rooms: rooms.clone(),
                    stats: state.pd.stats.clone(),
                    rank: rank.clone(),
                    rank_index: state.ranks.iter().position(|r| r.rank() == rank.rank()),
                    id,
                    room: *room,
                    info: RoomInfo {
                        prompt_tokens,
                        block_hashes: prepared.hashes,
                        block_ids: Vec::new(),
                    },
                };
                filler.spawn(updates)
            }
            _ => updates,
        };
        Ok((id, updates))
    }

    /// A vLLM prefill leg's `kv_transfer_params`, once it finished holding its blocks.
    pub(super) async fn transfer_params(
        &self,
        state: &EngineState,
        rank: &RankHandle,
        id: RequestId,
    ) -> Option<Value> {
        if !matches!(self, Leg::Vllm { send: true, .. }) {
            return None;
        }
        let Ok(Some(blocks)) = rank.held_blocks(id).await else {
            tracing::warn!(
                request = id.0,
                "no held blocks to hand off (released early)"
            );
            return None;
        };
        bump(&state.pd.stats.sent, 1);
        let pd = &state.pd;
        Some(json!({
            "do_remote_prefill": true,
            "do_remote_decode": false,
            "remote_block_ids": [blocks],
            "remote_engine_id": pd.engine_id,
            "remote_request_id": format!("{}-{}-{}", state.name, rank.rank(), id.0),
            "remote_host": pd.side_host,
            "remote_port": pd.side_port,
            "tp_size": 1,
        }))
    }
}

/// Blocks of `request`'s prompt this engine lacks (the transfer moves
/// them), after asking the rank what it caches.
async fn blocks_to_move(
    state: &EngineState,
    rank: &RankHandle,
    request: &NewRequest,
) -> Result<usize, ApiError> {
    let cached = rank
        .cached_prefix_tokens(request.clone())
        .await
        .map_err(|e| ApiError::unavailable(e.to_string()))?;
    let bs = state.block_size.max(1);
    Ok(request
        .prompt
        .len()
        .div_ceil(bs)
        .saturating_sub(cached / bs))
}

/// Waits the modelled transfer of `blocks`; returns the wait.
async fn transfer(state: &EngineState, blocks: usize) -> Duration {
    let pd = &state.pd;
    let delay = transfer_delay(blocks, pd.transfer_us_per_block, pd.speedup);
    tokio::time::sleep(delay).await;
    bump(
        &pd.stats.wait_nanos,
        u64::try_from(delay.as_nanos()).unwrap_or(u64::MAX),
    );
    delay
}

/// vLLM decode leg: the transfer, then the read notification; the tokens
/// that arrived (0 when the prefill could not be read).
async fn receive_vllm(
    state: &EngineState,
    rank: &RankHandle,
    request: &NewRequest,
    remote: &Remote,
) -> Result<usize, ApiError> {
    let blocks = blocks_to_move(state, rank, request).await?;
    let delay = transfer(state, blocks).await;
    let body = json!({
        "remote_engine_id": remote.engine_id,
        "remote_request_id": remote.request_id,
    })
    .to_string();
    let read = peer::call(
        &remote.host,
        remote.port,
        "POST",
        "/internal/nixl/read",
        Some(body.as_bytes()),
        READ_TIMEOUT,
    )
    .await;
    let stats = &state.pd.stats;
    match read {
        Ok(r) if r.status == 200 => {
            bump(&stats.received, 1);
            bump(&stats.blocks, blocks as u64);
            tracing::debug!(blocks, ?delay, remote = %remote.engine_id, "KV received");
            Ok(request.prompt.len())
        }
        other => {
            bump(&stats.failures, 1);
            let why = match other {
                Ok(r) => format!("side channel answered {}", r.status),
                Err(e) => e.to_string(),
            };
            tracing::warn!(remote = %remote.engine_id, request = %remote.request_id, "KV read failed, recomputing locally: {why}");
            Ok(0)
        }
    }
}

fn kv_transfer_error(room: u64, message: impl std::fmt::Display) -> ApiError {
    ApiError::internal(format!("KVTransferError(bootstrap_room={room}): {message}"))
        .with_shape(ErrorShape::Sglang)
}

/// SGLang decode leg: the room, the transfer, the done notification; the
/// tokens that arrived.
async fn receive_sglang(
    state: &EngineState,
    rank: &RankHandle,
    request: &NewRequest,
    host: &str,
    port: u16,
    room: u64,
) -> Result<usize, ApiError> {
    let stats = &state.pd.stats;
    let deadline = Instant::now() + state.pd.lease;
    let info = match bootstrap::wait_for_room(host, port, room, deadline).await {
        RoomWait::Ready(info) => info,
        RoomWait::Failed(error) => {
            bump(&stats.failures, 1);
            return Err(kv_transfer_error(
                room,
                format!("the prefill failed: {error}"),
            ));
        }
        RoomWait::TimedOut(last) => {
            bump(&stats.failures, 1);
            let waited = state.pd.lease.as_secs_f64();
            return Err(kv_transfer_error(
                room,
                format!("the room was not filled within {waited} s ({last})"),
            ));
        }
    };
    let own = page_hashes(&request.prompt, state.block_size);
    if info.prompt_tokens != request.prompt.len() || info.block_hashes != own {
        bump(&stats.failures, 1);
        return Err(kv_transfer_error(
            room,
            format!(
                "the prefill computed another prompt ({} tokens; this request has {})",
                info.prompt_tokens,
                request.prompt.len()
            ),
        ));
    }
    let blocks = blocks_to_move(state, rank, request).await?;
    transfer(state, blocks).await;
    if let Err(e) = bootstrap::notify_done(host, port, room).await {
        tracing::warn!(room, "the prefill was not told the room was read: {e}");
    }
    bump(&stats.received, 1);
    bump(&stats.blocks, blocks as u64);
    Ok(request.prompt.len())
}

/// Relays a prefill leg's updates and fills (or fails) its room when it
/// ends, whether or not its client still listens.
struct RoomFiller {
    rooms: Arc<RoomTable>,
    stats: Arc<HandoffStats>,
    rank: RankHandle,
    rank_index: Option<usize>,
    id: RequestId,
    room: u64,
    info: RoomInfo,
}

impl RoomFiller {
    fn spawn(
        self,
        mut updates: mpsc::UnboundedReceiver<Update>,
    ) -> mpsc::UnboundedReceiver<Update> {
        let (tx, rx) = mpsc::unbounded_channel();
        tokio::spawn(async move {
            let mut filler = self;
            while let Some(update) = updates.recv().await {
                let last = !matches!(update, Update::Token(_));
                match &update {
                    Update::Finished(_) => filler.fill().await,
                    Update::Failed(message) => filler.rooms.fail(filler.room, message.clone()),
                    Update::Token(_) => {}
                }
                let _ = tx.send(update);
                if last {
                    return;
                }
            }
            filler
                .rooms
                .fail(filler.room, "the engine is shutting down");
        });
        rx
    }

    async fn fill(&mut self) {
        let held = self.rank.held_blocks(self.id).await.ok().flatten();
        let (Some(blocks), Some(rank_index)) = (held, self.rank_index) else {
            self.rooms
                .fail(self.room, "the prompt's blocks were released early");
            return;
        };
        let mut info = std::mem::replace(
            &mut self.info,
            RoomInfo {
                prompt_tokens: 0,
                block_hashes: Vec::new(),
                block_ids: Vec::new(),
            },
        );
        info.block_ids = blocks;
        self.rooms.ready(self.room, info, (rank_index, self.id));
        bump(&self.stats.sent, 1);
    }
}

/// `POST /internal/nixl/read` (vLLM prefill and decode engines): a decode
/// engine read the blocks a finished request holds; they are released.
/// The body is `{"remote_engine_id", "remote_request_id"}` as this engine
/// answered them; 404 when it holds nothing under them (read already,
/// lease ended, another engine).
pub(super) async fn nixl_read(
    State(state): State<Arc<EngineState>>,
    body: Result<Bytes, BytesRejection>,
) -> Result<Json<Value>, ApiError> {
    let (_, value) = super::json_body(body)?;
    let field = |key: &str| {
        value
            .get(key)
            .and_then(Value::as_str)
            .ok_or_else(|| ApiError::bad_request(format!("`{key}` must be a string")))
    };
    let (engine_id, request_id) = (field("remote_engine_id")?, field("remote_request_id")?);
    let not_held = || {
        ApiError::new(
            StatusCode::NOT_FOUND,
            "NotFoundError",
            format!("no transfer held for {request_id} on {engine_id}"),
        )
    };
    if engine_id != state.pd.engine_id {
        return Err(not_held());
    }
    // `{name}-{rank}-{id}`, as `Leg::transfer_params` wrote it.
    let mut parts = request_id.rsplitn(3, '-');
    let (Some(id), Some(rank), Some(name)) = (parts.next(), parts.next(), parts.next()) else {
        return Err(not_held());
    };
    let (Ok(id), Ok(rank)) = (id.parse::<u64>(), rank.parse::<u32>()) else {
        return Err(not_held());
    };
    let Some(handle) = state.ranks.iter().find(|r| r.rank() == rank) else {
        return Err(not_held());
    };
    if name != state.name {
        return Err(not_held());
    }
    match handle.release_held(RequestId(id)).await {
        Ok(Some(blocks)) => Ok(Json(json!({"released_blocks": blocks}))),
        Ok(None) => Err(not_held()),
        Err(e) => Err(ApiError::unavailable(e.to_string())),
    }
}
