//! SGLang's bootstrap rendezvous as the mocker plays it: a prefill engine's
//! bootstrap server, its table of rooms, and the decode side's wait.
//!
//! Both legs of a request carry the same `bootstrap_room` and arrive at
//! once, so the decode may come first. The prefill opens the room when its
//! leg arrives and fills it when the prompt is computed, with what the
//! decode needs: the token count, the published hashes of the prompt's full
//! pages (so the decode can check it got the same prompt) and the block ids
//! it holds. The decode long-polls the room on the prefill's bootstrap
//! server until it is filled, failed, or its own wait ends, then tells the
//! prefill it is done, which releases the held blocks.
//!
//! Real SGLang does this handshake over ZeroMQ between the two engines'
//! KV managers, its bootstrap server only telling the decode where the
//! prefill ranks are; the routes below are the mocker's own:
//!
//! | route | answer |
//! | --- | --- |
//! | `GET /health` | 200 |
//! | `GET /kvroute/room/{room}?wait_ms=N` | waits up to `min(N, 5000)` ms for the room to fill; `{"room", "status": "ready", "prompt_tokens", "block_hashes", "block_ids"}`, or `"status": "pending"` / `"unknown"`, or `"status": "failed", "error"` |
//! | `POST /kvroute/room/{room}/done` | the decode read the room: its blocks are released and the room closed; `{"released_blocks"}`, 404 when no such filled room |
//!
//! Rooms live [`crate::MockerConfig::kv_lease`] after their last change, at
//! most [`MAX_ROOMS`] at once (the oldest goes first).

use std::sync::{Arc, Mutex, MutexGuard};
use std::time::{Duration, Instant};

use axum::extract::{Path, RawQuery, State};
use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use axum::{Json, Router};
use serde_json::{json, Value};
use tokio::sync::watch;

use crate::driver::RankHandle;
use crate::engine::RequestId;
use crate::hashing::{sglang_page_digest, sglang_published, Digest32};
use crate::lease::LeaseTable;
use crate::peer;

/// Most rooms a prefill engine keeps at once.
pub const MAX_ROOMS: usize = 16_384;

/// Longest single wait of a room request; a decode asks again until its own wait ends.
pub const MAX_POLL: Duration = Duration::from_secs(5);

/// Pause between a decode's attempts when the bootstrap server cannot be reached.
const RETRY: Duration = Duration::from_millis(50);

/// What a decode engine needs from a filled room.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RoomInfo {
    /// Prompt tokens the prefill computed.
    pub prompt_tokens: usize,
    /// SGLang's published hashes of the prompt's full pages, in order.
    pub block_hashes: Vec<i64>,
    /// The prefill's block ids holding the prompt.
    pub block_ids: Vec<u32>,
}

/// A room as a decode sees it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum RoomView {
    /// No such room (not opened yet, expired, or closed).
    Unknown,
    /// The prefill leg arrived; its prompt is being computed.
    Pending,
    /// The prompt is computed and held.
    Ready(RoomInfo),
    /// The prefill leg failed.
    Failed(String),
}

#[derive(Debug, Clone)]
enum RoomState {
    Pending,
    Ready {
        info: RoomInfo,
        /// The rank and request holding the blocks.
        holder: (usize, RequestId),
    },
    Failed(String),
}

/// A bootstrap room that is already taken.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("bootstrap_room {0} is already in use by another request")]
pub struct RoomInUse(pub u64);

/// One prefill engine's rooms.
#[derive(Debug)]
pub struct RoomTable {
    rooms: Mutex<LeaseTable<u64, RoomState>>,
    /// Bumped on every change; waiters watch it.
    changed: watch::Sender<u64>,
}

impl RoomTable {
    /// An empty table whose rooms live `lease` after their last change.
    pub fn new(lease: Duration) -> Self {
        RoomTable {
            rooms: Mutex::new(LeaseTable::new(MAX_ROOMS, lease)),
            changed: watch::channel(0).0,
        }
    }

    fn lock(&self) -> MutexGuard<'_, LeaseTable<u64, RoomState>> {
        let mut rooms = self.rooms.lock().unwrap_or_else(|p| p.into_inner());
        rooms.purge(Instant::now());
        rooms
    }

    fn set(&self, room: u64, state: RoomState) {
        if let Some((old, _)) = self.lock().insert(room, state, Instant::now()) {
            tracing::warn!(
                room = old,
                "bootstrap room dropped early: more than {MAX_ROOMS} rooms"
            );
        }
        self.changed.send_modify(|n| *n = n.wrapping_add(1));
    }

    /// Opens `room` for a prefill leg that just arrived.
    pub fn open(&self, room: u64) -> Result<(), RoomInUse> {
        if self.lock().get(&room).is_some() {
            return Err(RoomInUse(room));
        }
        self.set(room, RoomState::Pending);
        Ok(())
    }

    /// Fills `room`: the prompt is computed, its blocks held by `holder` (rank, request).
    pub fn ready(&self, room: u64, info: RoomInfo, holder: (usize, RequestId)) {
        self.set(room, RoomState::Ready { info, holder });
    }

    /// Marks `room` failed (the prefill leg failed).
    pub fn fail(&self, room: u64, message: impl Into<String>) {
        self.set(room, RoomState::Failed(message.into()));
    }

    /// Rooms held.
    pub fn len(&self) -> usize {
        self.lock().len()
    }

    /// True when no room is held.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// The room as it is now.
    pub fn view(&self, room: u64) -> RoomView {
        match self.lock().get(&room) {
            None => RoomView::Unknown,
            Some(RoomState::Pending) => RoomView::Pending,
            Some(RoomState::Ready { info, .. }) => RoomView::Ready(info.clone()),
            Some(RoomState::Failed(m)) => RoomView::Failed(m.clone()),
        }
    }

    /// The room once it is filled or failed, or as it is after `wait`.
    pub async fn wait(&self, room: u64, wait: Duration) -> RoomView {
        let deadline = tokio::time::Instant::now() + wait;
        // Subscribed before looking: a change after the look is not missed.
        let mut changes = self.changed.subscribe();
        loop {
            let view = self.view(room);
            if matches!(view, RoomView::Ready(_) | RoomView::Failed(_)) {
                return view;
            }
            match tokio::time::timeout_at(deadline, changes.changed()).await {
                Ok(Ok(())) => {}
                Ok(Err(_)) | Err(_) => return self.view(room),
            }
        }
    }

    /// Closes a filled room; the holder of its blocks, to release them.
    pub fn close(&self, room: u64) -> Option<(usize, RequestId)> {
        let mut rooms = self.lock();
        match rooms.get(&room) {
            Some(RoomState::Ready { holder, .. }) => {
                let holder = *holder;
                rooms.remove(&room);
                Some(holder)
            }
            _ => None,
        }
    }
}

/// SGLang's published hashes of the full pages of `prompt` (page size `bs`).
pub fn page_hashes(prompt: &[u64], bs: usize) -> Vec<i64> {
    let mut parent: Option<Digest32> = None;
    prompt
        .chunks_exact(bs.max(1))
        .map(|page| {
            let digest = sglang_page_digest(parent.as_ref(), page);
            parent = Some(digest);
            sglang_published(&digest)
        })
        .collect()
}

/// What a bootstrap server serves.
#[derive(Debug, Clone)]
pub struct BootstrapState {
    /// The engine's rooms.
    pub rooms: Arc<RoomTable>,
    /// The engine's ranks (to release held blocks).
    pub ranks: Vec<RankHandle>,
}

/// The bootstrap server of one SGLang prefill engine.
pub fn app(state: BootstrapState) -> Router {
    Router::new()
        .route("/health", get(|| async { StatusCode::OK }))
        .route("/kvroute/room/{room}", get(room_get))
        .route("/kvroute/room/{room}/done", post(room_done))
        .fallback(|| async {
            (
                StatusCode::NOT_FOUND,
                Json(json!({"error": "no such route"})),
            )
        })
        .with_state(state)
}

fn bad_room(text: &str) -> Response {
    let message = format!("`{text}` is not a bootstrap room (a non-negative integer)");
    (StatusCode::BAD_REQUEST, Json(json!({"error": message}))).into_response()
}

/// `wait_ms` of a query string, capped at [`MAX_POLL`]; 0 when absent or malformed.
fn wait_of(query: Option<&str>) -> Duration {
    let ms = query
        .unwrap_or_default()
        .split('&')
        .find_map(|kv| kv.strip_prefix("wait_ms="))
        .and_then(|v| v.parse::<u64>().ok())
        .unwrap_or(0);
    Duration::from_millis(ms).min(MAX_POLL)
}

async fn room_get(
    State(state): State<BootstrapState>,
    Path(room): Path<String>,
    RawQuery(query): RawQuery,
) -> Response {
    let Ok(id) = room.parse::<u64>() else {
        return bad_room(&room);
    };
    let view = state.rooms.wait(id, wait_of(query.as_deref())).await;
    let body = match view {
        RoomView::Unknown => json!({"room": id, "status": "unknown"}),
        RoomView::Pending => json!({"room": id, "status": "pending"}),
        RoomView::Failed(error) => json!({"room": id, "status": "failed", "error": error}),
        RoomView::Ready(info) => json!({
            "room": id,
            "status": "ready",
            "prompt_tokens": info.prompt_tokens,
            "block_hashes": info.block_hashes,
            "block_ids": info.block_ids,
        }),
    };
    Json(body).into_response()
}

async fn room_done(State(state): State<BootstrapState>, Path(room): Path<String>) -> Response {
    let Ok(id) = room.parse::<u64>() else {
        return bad_room(&room);
    };
    let Some((rank, request)) = state.rooms.close(id) else {
        let error = format!("no filled bootstrap room {id}");
        return (StatusCode::NOT_FOUND, Json(json!({"error": error}))).into_response();
    };
    let released = match state.ranks.get(rank) {
        Some(r) => r.release_held(request).await.ok().flatten().unwrap_or(0),
        None => 0,
    };
    Json(json!({"room": id, "released_blocks": released})).into_response()
}

/// How a decode's wait for its room ended.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum RoomWait {
    /// Filled.
    Ready(RoomInfo),
    /// The prefill leg failed.
    Failed(String),
    /// Not filled before the deadline (the last thing seen, for the error).
    TimedOut(String),
}

/// A room request's answer, as JSON.
fn parse_view(body: &[u8]) -> Option<RoomView> {
    let v: Value = serde_json::from_slice(body).ok()?;
    let list = |key: &str| v.get(key).and_then(Value::as_array);
    match v.get("status")?.as_str()? {
        "unknown" => Some(RoomView::Unknown),
        "pending" => Some(RoomView::Pending),
        "failed" => Some(RoomView::Failed(
            v.get("error")
                .and_then(Value::as_str)
                .unwrap_or("failed")
                .to_owned(),
        )),
        "ready" => Some(RoomView::Ready(RoomInfo {
            prompt_tokens: usize::try_from(v.get("prompt_tokens")?.as_u64()?).ok()?,
            block_hashes: list("block_hashes")?
                .iter()
                .map(Value::as_i64)
                .collect::<Option<_>>()?,
            block_ids: list("block_ids")?
                .iter()
                .map(|b| b.as_u64().and_then(|b| u32::try_from(b).ok()))
                .collect::<Option<_>>()?,
        })),
        _ => None,
    }
}

/// Waits until `room` on the bootstrap server at `host:port` is filled or
/// failed, or `deadline` passes. An unreachable server is retried until
/// then; a poll that comes back early is followed by a short pause.
pub async fn wait_for_room(host: &str, port: u16, room: u64, deadline: Instant) -> RoomWait {
    let mut last = String::from("the bootstrap server was not reached");
    loop {
        let left = deadline.saturating_duration_since(Instant::now());
        if left.is_zero() {
            return RoomWait::TimedOut(last);
        }
        let wait = left.min(MAX_POLL);
        let path = format!("/kvroute/room/{room}?wait_ms={}", wait.as_millis());
        let asked = Instant::now();
        let answer = peer::call(
            host,
            port,
            "GET",
            &path,
            None,
            wait + Duration::from_secs(2),
        )
        .await;
        match answer {
            Ok(r) if r.status == 200 => match parse_view(&r.body) {
                Some(RoomView::Ready(info)) => return RoomWait::Ready(info),
                Some(RoomView::Failed(error)) => return RoomWait::Failed(error),
                Some(RoomView::Pending) => last = "the prefill leg is still running".into(),
                Some(RoomView::Unknown) => last = "the prefill leg never arrived".into(),
                None => last = "the bootstrap server answered nonsense".into(),
            },
            Ok(r) => last = format!("the bootstrap server answered {}", r.status),
            Err(e) => {
                tracing::debug!(room, "bootstrap server not reached: {e}");
                last = format!("the bootstrap server was not reached ({e})");
            }
        }
        if asked.elapsed() < wait {
            let pause = RETRY.min(deadline.saturating_duration_since(Instant::now()));
            tokio::time::sleep(pause).await;
        }
    }
}

/// Tells the prefill the decode read `room`; the blocks released there.
pub async fn notify_done(host: &str, port: u16, room: u64) -> Result<u64, String> {
    let path = format!("/kvroute/room/{room}/done");
    let r = peer::call(
        host,
        port,
        "POST",
        &path,
        Some(b"{}"),
        Duration::from_secs(5),
    )
    .await
    .map_err(|e| e.to_string())?;
    if r.status != 200 {
        return Err(format!("the bootstrap server answered {}", r.status));
    }
    let v: Value = serde_json::from_slice(&r.body).map_err(|e| e.to_string())?;
    Ok(v.get("released_blocks")
        .and_then(Value::as_u64)
        .unwrap_or(0))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn info(n: usize) -> RoomInfo {
        RoomInfo {
            prompt_tokens: n,
            block_hashes: vec![-1, 2],
            block_ids: vec![3, 4],
        }
    }

    #[test]
    fn a_room_opens_once_fills_and_closes() {
        let rooms = RoomTable::new(Duration::from_secs(30));
        assert_eq!(rooms.view(7), RoomView::Unknown);
        rooms.open(7).expect("new room");
        assert_eq!(rooms.open(7), Err(RoomInUse(7)));
        assert_eq!(rooms.view(7), RoomView::Pending);
        assert_eq!(rooms.close(7), None, "not filled yet");
        rooms.ready(7, info(40), (1, RequestId(9)));
        assert_eq!(rooms.view(7), RoomView::Ready(info(40)));
        assert_eq!(rooms.close(7), Some((1, RequestId(9))));
        assert_eq!(rooms.view(7), RoomView::Unknown);
        rooms.open(8).expect("new room");
        rooms.fail(8, "engine restarted");
        assert_eq!(rooms.view(8), RoomView::Failed("engine restarted".into()));
        assert_eq!(rooms.len(), 1);
    }

    #[test]
    fn rooms_expire_after_their_lease() {
        let rooms = RoomTable::new(Duration::from_millis(20));
        rooms.open(1).expect("new");
        std::thread::sleep(Duration::from_millis(40));
        assert_eq!(rooms.view(1), RoomView::Unknown);
        assert!(rooms.is_empty());
        rooms.open(1).expect("the expired room can be opened again");
    }

    #[test]
    fn a_waiter_wakes_when_its_room_fills_and_times_out_otherwise() {
        let rt = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .expect("runtime");
        rt.block_on(async {
            let rooms = Arc::new(RoomTable::new(Duration::from_secs(30)));
            let filler = rooms.clone();
            tokio::spawn(async move {
                tokio::time::sleep(Duration::from_millis(20)).await;
                filler.open(5).expect("new");
                filler.open(6).expect("new");
                tokio::time::sleep(Duration::from_millis(20)).await;
                filler.ready(5, info(1), (0, RequestId(1)));
            });
            let started = Instant::now();
            assert_eq!(
                rooms.wait(5, Duration::from_secs(10)).await,
                RoomView::Ready(info(1))
            );
            assert!(started.elapsed() < Duration::from_secs(5));
            assert_eq!(
                rooms.wait(6, Duration::from_millis(30)).await,
                RoomView::Pending
            );
            assert_eq!(rooms.wait(9, Duration::ZERO).await, RoomView::Unknown);
        });
    }

    #[test]
    fn page_hashes_chain_full_pages_only() {
        let prompt: Vec<u64> = (1..=10).collect();
        let hashes = page_hashes(&prompt, 4);
        assert_eq!(hashes.len(), 2);
        let first = sglang_page_digest(None, &prompt[..4]);
        let second = sglang_page_digest(Some(&first), &prompt[4..8]);
        assert_eq!(
            hashes,
            [sglang_published(&first), sglang_published(&second)]
        );
        assert_eq!(
            page_hashes(&prompt[..10], 4)[..1],
            page_hashes(&prompt[..4], 4)[..]
        );
    }

    #[test]
    fn room_answers_parse_and_nonsense_does_not() {
        let ready = br#"{"room":1,"status":"ready","prompt_tokens":40,"block_hashes":[-1,2],"block_ids":[3,4]}"#;
        assert_eq!(parse_view(ready), Some(RoomView::Ready(info(40))));
        assert_eq!(
            parse_view(br#"{"status":"pending"}"#),
            Some(RoomView::Pending)
        );
        assert_eq!(
            parse_view(br#"{"status":"failed","error":"x"}"#),
            Some(RoomView::Failed("x".into()))
        );
        for bad in [
            &b"{}"[..],
            b"[]",
            b"{\"status\":\"ready\"}",
            b"{\"status\":\"odd\"}",
        ] {
            assert_eq!(parse_view(bad), None);
        }
        assert_eq!(wait_of(Some("a=1&wait_ms=250")), Duration::from_millis(250));
        assert_eq!(wait_of(Some("wait_ms=999999")), MAX_POLL);
        assert_eq!(wait_of(Some("wait_ms=x")), Duration::ZERO);
        assert_eq!(wait_of(None), Duration::ZERO);
    }
}
