//! Serving the app on a listener with bounded connections: at most
//! `max_connections` at once (beyond that a new connection is closed at
//! once, and counted), a request's head must arrive within
//! `header_timeout` of its first byte, and a kept-alive connection with no
//! request in progress is closed after `idle_timeout`.
//!
//! hyper's own header-read timer starts as soon as a connection waits for
//! a request head, idle or not, so it cannot tell a slow client from an idle
//! kept-alive one; each connection here has a watchdog instead, fed by its
//! I/O (the first byte of a request) and by the app (a request's head was
//! read; its response was sent).

use std::future::Future;
use std::pin::Pin;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::Arc;
use std::task::{Context, Poll};
use std::time::{Duration, Instant};

use axum::body::Body;
use axum::extract::Request;
use axum::response::Response;
use hyper::body::{Body as HttpBody, Frame, SizeHint};
use hyper_util::rt::{TokioIo, TokioTimer};
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::gauge::Gauge;
use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::{watch, Semaphore};
use tower::ServiceExt as _;
use tracing::{debug, info, warn};

/// The limits of the HTTP server.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct HttpLimits {
    /// Connections served at once; more are closed as they arrive.
    pub max_connections: usize,
    /// Time from a request's first byte to the end of its head.
    pub header_timeout: Duration,
    /// Time a kept-alive connection may wait for its next request.
    pub idle_timeout: Duration,
    /// Time in-flight requests get to finish at shutdown.
    pub drain_timeout: Duration,
}

impl Default for HttpLimits {
    fn default() -> Self {
        HttpLimits {
            max_connections: 4096,
            header_timeout: Duration::from_secs(10),
            idle_timeout: Duration::from_secs(60),
            drain_timeout: Duration::from_secs(30),
        }
    }
}

/// Raises the soft limit on open files to the hard limit, and returns the
/// soft limit now in force (connections, sockets to the engines and files
/// all count against it).
pub fn raise_fd_limit() -> u64 {
    match rlimit::increase_nofile_limit(u64::MAX) {
        Ok(limit) => limit,
        Err(e) => {
            warn!(error = %e, "cannot raise the open-file limit");
            rlimit::getrlimit(rlimit::Resource::NOFILE).map_or(1024, |(soft, _)| soft)
        }
    }
}

/// The default `--max-connections` for an open-file limit: a tenth of what
/// is left after a reserve (each proxied request may hold a connection to a
/// worker too), so that most descriptors remain for the engines' streams.
pub fn default_max_connections(fd_limit: u64) -> usize {
    let usable = fd_limit.saturating_sub(256) / 10;
    usize::try_from(usable.clamp(64, 100_000)).unwrap_or(usize::MAX)
}

/// The connection counters of `/metrics`.
#[derive(Debug, Clone, Default)]
pub struct ConnectionMetrics {
    /// Connections open now.
    pub open: Gauge,
    /// Connections closed on arrival because `max_connections` were open.
    pub refused: Counter,
    /// Connections closed because a request head took too long.
    pub header_timeouts: Counter,
    /// Kept-alive connections closed because they stayed idle.
    pub idle_timeouts: Counter,
}

/// What a connection's watchdog knows, fed by its I/O and its requests.
#[derive(Debug)]
struct Activity {
    started: Instant,
    /// Requests whose head was read and whose response is not finished.
    in_flight: AtomicUsize,
    /// When the connection last had no request in progress (ms since `started`).
    idle_since_ms: AtomicU64,
    /// When the first byte of the next request arrived (ms + 1; 0: none yet).
    head_started_ms: AtomicU64,
}

impl Activity {
    fn new() -> Self {
        Activity {
            started: Instant::now(),
            in_flight: AtomicUsize::new(0),
            idle_since_ms: AtomicU64::new(0),
            head_started_ms: AtomicU64::new(0),
        }
    }

    fn now_ms(&self) -> u64 {
        self.started.elapsed().as_millis() as u64
    }

    /// Bytes arrived: with no request in progress they start the next head.
    fn bytes_read(&self) {
        if self.in_flight.load(Ordering::Acquire) == 0 {
            let now = self.now_ms() + 1;
            let _ =
                self.head_started_ms
                    .compare_exchange(0, now, Ordering::AcqRel, Ordering::Relaxed);
        }
    }

    fn request_started(&self) {
        self.in_flight.fetch_add(1, Ordering::AcqRel);
        self.head_started_ms.store(0, Ordering::Release);
    }

    fn request_finished(&self) {
        self.idle_since_ms.store(self.now_ms(), Ordering::Release);
        self.in_flight.fetch_sub(1, Ordering::AcqRel);
    }

    /// Why the connection should be closed now, if it should.
    fn expired(&self, limits: &HttpLimits) -> Option<Expiry> {
        if self.in_flight.load(Ordering::Acquire) > 0 {
            return None;
        }
        let now = self.now_ms();
        match self.head_started_ms.load(Ordering::Acquire) {
            0 => (now.saturating_sub(self.idle_since_ms.load(Ordering::Acquire))
                >= limits.idle_timeout.as_millis() as u64)
                .then_some(Expiry::Idle),
            started => (now.saturating_sub(started - 1)
                >= limits.header_timeout.as_millis() as u64)
                .then_some(Expiry::Header),
        }
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Expiry {
    Header,
    Idle,
}

/// A TCP stream that tells its connection's [`Activity`] when bytes arrive.
struct WatchedIo {
    inner: TcpStream,
    activity: Arc<Activity>,
}

impl AsyncRead for WatchedIo {
    fn poll_read(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<std::io::Result<()>> {
        let before = buf.filled().len();
        let poll = Pin::new(&mut self.inner).poll_read(cx, buf);
        if buf.filled().len() > before {
            self.activity.bytes_read();
        }
        poll
    }
}

impl AsyncWrite for WatchedIo {
    fn poll_write(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        data: &[u8],
    ) -> Poll<std::io::Result<usize>> {
        Pin::new(&mut self.inner).poll_write(cx, data)
    }

    fn poll_flush(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<std::io::Result<()>> {
        Pin::new(&mut self.inner).poll_flush(cx)
    }

    fn poll_shutdown(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<std::io::Result<()>> {
        Pin::new(&mut self.inner).poll_shutdown(cx)
    }

    fn poll_write_vectored(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        bufs: &[std::io::IoSlice<'_>],
    ) -> Poll<std::io::Result<usize>> {
        Pin::new(&mut self.inner).poll_write_vectored(cx, bufs)
    }

    fn is_write_vectored(&self) -> bool {
        self.inner.is_write_vectored()
    }
}

/// A response body that tells its connection's [`Activity`] when it is done
/// (sent, or dropped with the connection).
struct TrackedBody {
    inner: Body,
    activity: Option<Arc<Activity>>,
}

impl TrackedBody {
    fn finish(&mut self) {
        if let Some(a) = self.activity.take() {
            a.request_finished();
        }
    }
}

impl Drop for TrackedBody {
    fn drop(&mut self) {
        self.finish();
    }
}

impl HttpBody for TrackedBody {
    type Data = axum::body::Bytes;
    type Error = axum::Error;

    fn poll_frame(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Self::Data>, Self::Error>>> {
        let poll = Pin::new(&mut self.inner).poll_frame(cx);
        if let Poll::Ready(None) = poll {
            self.finish();
        }
        poll
    }

    fn is_end_stream(&self) -> bool {
        self.inner.is_end_stream()
    }

    fn size_hint(&self) -> SizeHint {
        self.inner.size_hint()
    }
}

/// Serves `app` on `listener` within `limits` until `shutdown` completes,
/// then lets in-flight requests finish for at most `drain_timeout`.
pub async fn serve_bounded(
    listener: TcpListener,
    app: axum::Router,
    limits: HttpLimits,
    metrics: ConnectionMetrics,
    shutdown: impl Future<Output = ()> + Send + 'static,
) -> std::io::Result<()> {
    let slots = Arc::new(Semaphore::new(limits.max_connections.max(1)));
    let (stop_tx, stop_rx) = watch::channel(false);
    tokio::pin!(shutdown);
    loop {
        let (stream, peer) = tokio::select! {
            () = &mut shutdown => break,
            accepted = listener.accept() => match accepted {
                Ok(a) => a,
                Err(e) => {
                    // Out of descriptors or a reset before accept: keep serving.
                    warn!(error = %e, "accept failed");
                    tokio::time::sleep(Duration::from_millis(10)).await;
                    continue;
                }
            },
        };
        let Ok(permit) = slots.clone().try_acquire_owned() else {
            metrics.refused.inc();
            debug!(%peer, "connection refused: at --max-connections");
            drop(stream);
            continue;
        };
        if let Err(e) = stream.set_nodelay(true) {
            debug!(error = %e, "cannot set TCP_NODELAY");
        }
        let connection = serve_connection(
            stream,
            app.clone(),
            limits,
            metrics.clone(),
            stop_rx.clone(),
        );
        tokio::spawn(async move {
            let _permit = permit;
            connection.await;
        });
    }
    info!("shutting down: no new connections; draining in-flight requests");
    let _ = stop_tx.send(true);
    let all = limits.max_connections.max(1) as u32;
    let drained = tokio::time::timeout(limits.drain_timeout, slots.acquire_many(all)).await;
    if drained.is_err() {
        warn!(
            timeout_s = limits.drain_timeout.as_secs(),
            "requests still in flight at the end of the drain time were dropped"
        );
    }
    Ok(())
}

/// One connection: HTTP/1 with keep-alive, its watchdog, and a graceful
/// close when `stop` turns true.
async fn serve_connection(
    stream: TcpStream,
    app: axum::Router,
    limits: HttpLimits,
    metrics: ConnectionMetrics,
    mut stop: watch::Receiver<bool>,
) {
    metrics.open.inc();
    let activity = Arc::new(Activity::new());
    let io = WatchedIo {
        inner: stream,
        activity: activity.clone(),
    };
    let service_activity = activity.clone();
    let service = hyper::service::service_fn(move |request: Request<hyper::body::Incoming>| {
        let app = app.clone();
        let activity = service_activity.clone();
        activity.request_started();
        async move {
            let response: Response = match app.oneshot(request.map(Body::new)).await {
                Ok(r) => r,
                Err(never) => match never {},
            };
            let (parts, body) = response.into_parts();
            let body = TrackedBody {
                inner: body,
                activity: Some(activity),
            };
            Ok::<_, std::convert::Infallible>(Response::from_parts(parts, body))
        }
    });
    let mut builder = hyper::server::conn::http1::Builder::new();
    builder
        .timer(TokioTimer::new())
        .header_read_timeout(None)
        .keep_alive(true);
    let conn = builder.serve_connection(TokioIo::new(io), service);
    tokio::pin!(conn);
    let mut tick = tokio::time::interval(Duration::from_millis(250));
    loop {
        tokio::select! {
            result = conn.as_mut() => {
                if let Err(e) = result {
                    debug!(error = %e, "connection ended with an error");
                }
                break;
            }
            _ = tick.tick() => match activity.expired(&limits) {
                Some(Expiry::Header) => { metrics.header_timeouts.inc(); break; }
                Some(Expiry::Idle) => { metrics.idle_timeouts.inc(); break; }
                None => {}
            },
            changed = stop.changed() => {
                if changed.is_err() || *stop.borrow() {
                    conn.as_mut().graceful_shutdown();
                    let _ = conn.as_mut().await;
                    break;
                }
            }
        }
    }
    metrics.open.dec();
}

#[cfg(test)]
mod tests {
    use super::*;

    fn limits(header_ms: u64, idle_ms: u64) -> HttpLimits {
        HttpLimits {
            header_timeout: Duration::from_millis(header_ms),
            idle_timeout: Duration::from_millis(idle_ms),
            ..HttpLimits::default()
        }
    }

    #[test]
    fn an_idle_connection_expires_after_the_idle_time_and_a_slow_head_after_the_header_time() {
        let a = Activity::new();
        assert_eq!(
            a.expired(&limits(50, 10_000)),
            None,
            "idle, within the idle time"
        );
        assert_eq!(a.expired(&limits(50, 0)), Some(Expiry::Idle));
        a.bytes_read();
        assert_eq!(a.expired(&limits(0, 10_000)), Some(Expiry::Header));
        assert_eq!(
            a.expired(&limits(10_000, 0)),
            None,
            "a head in progress is not idle"
        );
        a.request_started();
        assert_eq!(
            a.expired(&limits(0, 0)),
            None,
            "a request in progress never expires"
        );
        a.bytes_read();
        a.request_finished();
        assert_eq!(
            a.expired(&limits(0, 10_000)),
            None,
            "body bytes start no head"
        );
        assert_eq!(a.expired(&limits(10_000, 0)), Some(Expiry::Idle));
    }
}
