//! One ingest thread serving many ranks: a readiness loop over their
//! sockets, feeding each rank's [`RankStream`].
//!
//! Per rank there is one SUB socket (live events). Replay requests of all
//! the thread's ranks go through **one** ROUTER connected to every replay
//! endpoint, each connection named after its rank (`ZMQ_CONNECT_ROUTING_ID`),
//! so a rank costs one socket and four descriptors instead of three sockets.
//! A monitor on that ROUTER says when an engine's replay socket connects
//! (prove continuity) or drops (hold live batches). Ranks without a replay
//! endpoint get a monitor on their SUB instead.
//!
//! ZeroMQ sockets signal readiness through a descriptor that fires on
//! change (edge-triggered), so each socket is drained until it would block,
//! and a sweep every few seconds covers any signal lost on the way. Waiting
//! is `epoll` through `mio`: an idle thread sleeps until something arrives
//! or a rank's timer is due, whatever the number of sockets.

use std::collections::{HashMap, VecDeque};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::mpsc;
use std::sync::Arc;
use std::time::Duration;

use kvroute_core::cursor::{EndLedger, ReplayEnd};
use kvroute_core::index::WorkerRank;
use mio::unix::SourceFd;
use mio::{Events, Interest, Poll, Token, Waker};
use tracing::{debug, warn};

use super::frames::{split_live, split_replay, Replayed};
use super::rank::{now_ms, RankStream};
use super::zmq_context::{Socket, ZmqContext, ZmqError};

const WAKER: Token = Token(0);
const ROUTER: Token = Token(1);
const ROUTER_MONITOR: Token = Token(2);
const FIRST_SLOT: usize = 3;

/// Messages read from one socket before others get a turn.
const DRAIN_BUDGET: usize = 256;
/// How often every rank's timers run.
const TICK_MS: u64 = 200;
/// How often every socket is drained whether it signalled or not (a safety
/// net: each drain of an idle socket is a system call).
const SWEEP_MS: u64 = 10_000;
/// First wait before re-opening a rank whose socket could not be made.
const RETRY_MS: u64 = 1_000;

/// What the registry asks of an ingest thread.
pub enum Command {
    /// Start following a rank.
    Add(Box<RankStream>),
    /// Stop following a rank; the sender is dropped once it stopped.
    Remove(WorkerRank, mpsc::Sender<()>),
    /// Stop the thread.
    Shutdown,
}

/// A monitor socket's events of interest.
fn monitored_events() -> i32 {
    (zmq::SocketEvent::HANDSHAKE_SUCCEEDED as i32) | (zmq::SocketEvent::DISCONNECTED as i32)
}

struct Slot {
    stream: RankStream,
    sub: Option<Socket>,
    /// Only for ranks without a replay endpoint.
    sub_monitor: Option<Socket>,
    /// The ROUTER's name for this rank's replay connection.
    alias: Vec<u8>,
    /// The ROUTER connection's endpoint as the monitor reports it.
    router_endpoint: Option<String>,
    /// Requests sent whose end marker has not arrived, and given-up ones
    /// whose end marker may still come late.
    ends: EndLedger,
    /// Requests waiting for the connection to accept them.
    unsent: VecDeque<u64>,
    retry_at_ms: u64,
    retry_ms: u64,
}

/// The loop's state.
pub struct Reactor {
    context: Arc<ZmqContext>,
    poll: Poll,
    commands: mpsc::Receiver<Command>,
    router: Socket,
    router_monitor: Socket,
    slots: Vec<Option<Slot>>,
    free: Vec<usize>,
    by_key: HashMap<WorkerRank, usize>,
    by_alias: HashMap<Vec<u8>, usize>,
    by_endpoint: HashMap<String, Vec<usize>>,
    ready: VecDeque<Token>,
    /// The ROUTER is queued in `ready`.
    router_queued: bool,
    load: Arc<AtomicUsize>,
    thread_no: usize,
    queue: i32,
    next_alias: u64,
}

/// Socket options that survive real networks (linger 0 is set where every
/// socket is made): bounded reconnect backoff, and TCP keepalive probing an idle connection after
/// 15 s (every 5 s, 3 times) so a vanished host shows as disconnected in
/// about 30 s. The kernel does that probing; ZMTP heartbeats would do it in
/// libzmq's I/O thread, whose timer list is scanned linearly on every
/// heartbeat: at 8 000 connections that alone took ~9 % of a core at idle.
fn harden(socket: &zmq::Socket) -> zmq::Result<()> {
    socket.set_reconnect_ivl(100)?;
    socket.set_reconnect_ivl_max(2_000)?;
    socket.set_tcp_keepalive(1)?;
    socket.set_tcp_keepalive_idle(15)?;
    socket.set_tcp_keepalive_intvl(5)?;
    socket.set_tcp_keepalive_cnt(3)?;
    Ok(())
}

fn register(poll: &Poll, socket: &zmq::Socket, token: Token) -> std::io::Result<()> {
    let fd = socket.get_fd().map_err(std::io::Error::other)?;
    poll.registry()
        .register(&mut SourceFd(&fd), token, Interest::READABLE)
}

fn deregister(poll: &Poll, socket: &zmq::Socket) {
    if let Ok(fd) = socket.get_fd() {
        let _ = poll.registry().deregister(&mut SourceFd(&fd));
    }
}

/// Makes a monitor for `socket` and the PAIR that reads it.
fn monitor(context: &Arc<ZmqContext>, socket: &Socket, name: &str) -> Result<Socket, ZmqError> {
    let address = format!("inproc://kvroute-monitor-{name}");
    socket.monitor(&address, monitored_events())?;
    let pair = context.socket(zmq::PAIR)?;
    // Every connection's events matter: never drop one for a full queue.
    pair.set_rcvhwm(0)?;
    pair.connect(&address)?;
    Ok(pair)
}

/// A monitor event: its code and the endpoint it concerns.
fn read_monitor_event(frames: &[Vec<u8>]) -> Option<(u16, String)> {
    let code = frames.first()?.get(..2)?;
    let endpoint = String::from_utf8(frames.get(1)?.clone()).ok()?;
    Some((u16::from_le_bytes([code[0], code[1]]), endpoint))
}

impl Reactor {
    /// A thread's loop state; `load` counts its ranks for the pool, and a
    /// rank's SUB queues at most `queue` live batches.
    pub fn new(
        context: Arc<ZmqContext>,
        commands: mpsc::Receiver<Command>,
        load: Arc<AtomicUsize>,
        thread_no: usize,
        queue: i32,
    ) -> Result<(Self, Arc<Waker>), std::io::Error> {
        let poll = Poll::new()?;
        let waker = Arc::new(Waker::new(poll.registry(), WAKER)?);
        let router = context.socket(zmq::ROUTER).map_err(std::io::Error::other)?;
        let setup = |router: &zmq::Socket| -> zmq::Result<()> {
            harden(router)?;
            router.set_router_mandatory(true)?;
            router.set_router_handover(true)?;
            router.set_rcvhwm(20_000)?;
            router.set_sndhwm(20_000)
        };
        setup(&router).map_err(std::io::Error::other)?;
        let name = format!("replay-{thread_no}-{}", now_ms());
        let router_monitor = monitor(&context, &router, &name).map_err(std::io::Error::other)?;
        register(&poll, &router, ROUTER)?;
        register(&poll, &router_monitor, ROUTER_MONITOR)?;
        let reactor = Reactor {
            context,
            poll,
            commands,
            router,
            router_monitor,
            slots: Vec::new(),
            free: Vec::new(),
            by_key: HashMap::new(),
            by_alias: HashMap::new(),
            by_endpoint: HashMap::new(),
            // A socket signals only after a read found it empty: read each
            // new one at once, or its first messages would wait for a sweep.
            ready: VecDeque::from([ROUTER, ROUTER_MONITOR]),
            router_queued: true,
            load,
            thread_no,
            queue,
            next_alias: 0,
        };
        Ok((reactor, waker))
    }

    /// Runs until [`Command::Shutdown`] (or every sender is gone).
    pub fn run(mut self) {
        let mut events = Events::with_capacity(1024);
        let mut next_tick = now_ms();
        let mut next_sweep = now_ms() + SWEEP_MS;
        loop {
            let now = now_ms();
            let wait = if self.ready.is_empty() {
                Duration::from_millis(next_tick.saturating_sub(now))
            } else {
                Duration::ZERO
            };
            if let Err(e) = self.poll.poll(&mut events, Some(wait)) {
                if e.kind() != std::io::ErrorKind::Interrupted {
                    warn!(thread = self.thread_no, error = %e, "ingest poll failed");
                    std::thread::sleep(Duration::from_millis(100));
                }
            }
            for event in events.iter() {
                self.ready.push_back(event.token());
            }
            if !self.take_commands() {
                return;
            }
            self.serve_ready();
            let now = now_ms();
            if now >= next_sweep {
                next_sweep = now + SWEEP_MS;
                self.sweep();
            }
            if now >= next_tick {
                next_tick = now + TICK_MS;
                self.tick(now);
            }
        }
    }

    /// Handles queued commands; false on shutdown.
    fn take_commands(&mut self) -> bool {
        loop {
            match self.commands.try_recv() {
                Ok(Command::Add(stream)) => self.add(*stream),
                Ok(Command::Remove(key, done)) => {
                    self.remove(key);
                    drop(done);
                }
                Ok(Command::Shutdown) | Err(mpsc::TryRecvError::Disconnected) => return false,
                Err(mpsc::TryRecvError::Empty) => return true,
            }
        }
    }

    fn serve_ready(&mut self) {
        // Each socket gets a budget per round; one that had more goes to the back.
        for _ in 0..self.ready.len() {
            let Some(token) = self.ready.pop_front() else {
                break;
            };
            let more = match token {
                WAKER => false,
                ROUTER => {
                    self.router_queued = false;
                    self.drain_router()
                }
                ROUTER_MONITOR => self.drain_router_monitor(),
                Token(n) if n >= FIRST_SLOT => {
                    let slot = (n - FIRST_SLOT) / 2;
                    if (n - FIRST_SLOT).is_multiple_of(2) {
                        self.drain_sub(slot)
                    } else {
                        self.drain_sub_monitor(slot)
                    }
                }
                Token(_) => false,
            };
            if more && token == ROUTER {
                self.queue_router();
            } else if more {
                self.ready.push_back(token);
            }
        }
    }

    /// Queues the ROUTER for draining. Every call into it (send, connect)
    /// lets libzmq process pending commands, which may consume the signal
    /// that a reply arrived: after each, its queue must be looked at.
    fn queue_router(&mut self) {
        if !self.router_queued {
            self.router_queued = true;
            self.ready.push_back(ROUTER);
        }
    }

    fn sweep(&mut self) {
        self.queue_router();
        self.ready.push_back(ROUTER_MONITOR);
        for (n, slot) in self.slots.iter().enumerate() {
            if slot.as_ref().is_some_and(|s| s.sub.is_some()) {
                self.ready.push_back(Token(FIRST_SLOT + 2 * n));
            }
            if slot.as_ref().is_some_and(|s| s.sub_monitor.is_some()) {
                self.ready.push_back(Token(FIRST_SLOT + 2 * n + 1));
            }
        }
    }

    fn tick(&mut self, now: u64) {
        for n in 0..self.slots.len() {
            let Some(slot) = self.slots[n].as_mut() else {
                continue;
            };
            if slot.sub.is_none() && now >= slot.retry_at_ms {
                self.open(n);
                continue;
            }
            let queued = slot.stream.tick(now);
            // Before the next request counts: a timed-out replay is over.
            for _ in 0..slot.stream.take_lost_ends() {
                slot.ends.given_up();
            }
            if queued || !slot.unsent.is_empty() {
                self.send_requests(n);
            }
        }
    }

    fn add(&mut self, stream: RankStream) {
        let key = stream.target().key;
        if self.by_key.contains_key(&key) {
            return;
        }
        self.next_alias += 1;
        let alias = format!("r{}-{}", self.thread_no, self.next_alias).into_bytes();
        let slot = Slot {
            stream,
            sub: None,
            sub_monitor: None,
            alias: alias.clone(),
            router_endpoint: None,
            ends: EndLedger::default(),
            unsent: VecDeque::new(),
            retry_at_ms: 0,
            retry_ms: RETRY_MS,
        };
        let n = match self.free.pop() {
            Some(n) => {
                self.slots[n] = Some(slot);
                n
            }
            None => {
                self.slots.push(Some(slot));
                self.slots.len() - 1
            }
        };
        self.by_key.insert(key, n);
        self.by_alias.insert(alias, n);
        self.load.fetch_add(1, Ordering::Relaxed);
        self.open(n);
    }

    /// Opens a rank's sockets; on failure the rank shows the reason and is
    /// retried with a growing delay.
    fn open(&mut self, n: usize) {
        let Some(mut slot) = self.slots[n].take() else {
            return;
        };
        match self.open_sockets(n, &mut slot) {
            Ok(()) => {
                slot.retry_ms = RETRY_MS;
                slot.stream.set_error(None);
            }
            Err(e) => {
                let target = slot.stream.target();
                warn!(worker = %target.worker, rank = %target.key.rank, error = %e, retry_ms = slot.retry_ms, "cannot open the rank's event stream; retrying");
                slot.stream
                    .set_error(Some(format!("cannot open the event stream: {e}")));
                self.close_sockets(&mut slot);
                slot.retry_at_ms = now_ms() + slot.retry_ms;
                slot.retry_ms = (slot.retry_ms * 2).min(30_000);
            }
        }
        self.slots[n] = Some(slot);
    }

    fn open_sockets(&mut self, n: usize, slot: &mut Slot) -> Result<(), ZmqError> {
        let target = slot.stream.target().clone();
        let sub = self.context.socket(zmq::SUB)?;
        harden(&sub)?;
        sub.set_rcvhwm(self.queue)?;
        sub.set_subscribe(target.topic.as_bytes())?;
        if target.endpoints.replay.is_none() {
            let name = format!("sub-{}-{n}-{}", self.thread_no, now_ms());
            let pair = monitor(&self.context, &sub, &name)?;
            register(&self.poll, &pair, Token(FIRST_SLOT + 2 * n + 1)).map_err(io_to_zmq)?;
            slot.sub_monitor = Some(pair);
            self.ready.push_back(Token(FIRST_SLOT + 2 * n + 1));
        }
        sub.connect(&target.endpoints.events)?;
        register(&self.poll, &sub, Token(FIRST_SLOT + 2 * n)).map_err(io_to_zmq)?;
        slot.sub = Some(sub);
        self.ready.push_back(Token(FIRST_SLOT + 2 * n));
        if let (Some(replay), None) = (&target.endpoints.replay, &slot.router_endpoint) {
            self.router.set_connect_routing_id(&slot.alias)?;
            self.router.connect(replay)?;
            let endpoint = match self.router.get_last_endpoint() {
                Ok(Ok(endpoint)) => endpoint,
                _ => replay.clone(),
            };
            self.by_endpoint
                .entry(endpoint.clone())
                .or_default()
                .push(n);
            slot.router_endpoint = Some(endpoint);
            self.queue_router();
        }
        debug!(worker = %target.worker, rank = %target.key.rank, endpoint = %target.endpoints.events, "subscribed");
        Ok(())
    }

    fn close_sockets(&mut self, slot: &mut Slot) {
        if let Some(sub) = slot.sub.take() {
            deregister(&self.poll, &sub);
        }
        if let Some(pair) = slot.sub_monitor.take() {
            deregister(&self.poll, &pair);
        }
    }

    fn remove(&mut self, key: WorkerRank) {
        let Some(n) = self.by_key.remove(&key) else {
            return;
        };
        let Some(mut slot) = self.slots[n].take() else {
            return;
        };
        self.close_sockets(&mut slot);
        self.by_alias.remove(&slot.alias);
        if let Some(endpoint) = &slot.router_endpoint {
            if let Some(ranks) = self.by_endpoint.get_mut(endpoint) {
                ranks.retain(|&r| r != n);
                if ranks.is_empty() {
                    self.by_endpoint.remove(endpoint);
                    let _ = self.router.disconnect(endpoint);
                    self.queue_router();
                }
            }
        }
        self.free.push(n);
        self.load.fetch_sub(1, Ordering::Relaxed);
    }

    /// Reads a SUB's queued batches and sends the replay requests they
    /// caused; true when its budget ran out first.
    fn drain_sub(&mut self, n: usize) -> bool {
        let more = self.read_sub(n);
        self.send_requests(n);
        more
    }

    fn read_sub(&mut self, n: usize) -> bool {
        let Some(Some(slot)) = self.slots.get_mut(n) else {
            return false;
        };
        let Some(sub) = &slot.sub else {
            return false;
        };
        for _ in 0..DRAIN_BUDGET {
            match sub.recv_multipart(zmq::DONTWAIT) {
                Ok(frames) => match split_live(frames) {
                    Some((seq, payload)) => slot.stream.live(seq, payload),
                    None => {
                        let stats = &slot.stream.target().stats;
                        stats.bad_frames.fetch_add(1, Ordering::Relaxed);
                    }
                },
                Err(zmq::Error::EAGAIN) => return false,
                Err(e) => {
                    warn!(thread = self.thread_no, error = %e, "event socket receive failed");
                    return false;
                }
            }
        }
        true
    }

    fn drain_sub_monitor(&mut self, n: usize) -> bool {
        let Some(Some(slot)) = self.slots.get_mut(n) else {
            return false;
        };
        let Some(pair) = &slot.sub_monitor else {
            return false;
        };
        while let Ok(frames) = pair.recv_multipart(zmq::DONTWAIT) {
            match read_monitor_event(&frames) {
                Some((code, _)) if code == zmq::SocketEvent::HANDSHAKE_SUCCEEDED as u16 => {
                    slot.stream.link_up()
                }
                Some((code, _)) if code == zmq::SocketEvent::DISCONNECTED as u16 => {
                    slot.stream.link_down()
                }
                _ => {}
            }
        }
        false
    }

    fn drain_router_monitor(&mut self) -> bool {
        for _ in 0..DRAIN_BUDGET {
            let Ok(frames) = self.router_monitor.recv_multipart(zmq::DONTWAIT) else {
                return false;
            };
            let Some((code, endpoint)) = read_monitor_event(&frames) else {
                continue;
            };
            let ranks = self.by_endpoint.get(&endpoint).cloned().unwrap_or_default();
            for n in ranks {
                let Some(Some(slot)) = self.slots.get_mut(n) else {
                    continue;
                };
                if code == zmq::SocketEvent::HANDSHAKE_SUCCEEDED as u16 {
                    slot.ends.reset();
                    slot.stream.link_up();
                    self.send_requests(n);
                } else if code == zmq::SocketEvent::DISCONNECTED as u16 {
                    slot.ends.reset();
                    slot.unsent.clear();
                    slot.stream.link_down();
                }
            }
        }
        true
    }

    /// Reads replay replies; true when the budget ran out first.
    fn drain_router(&mut self) -> bool {
        for _ in 0..DRAIN_BUDGET * 4 {
            let frames = match self.router.recv_multipart(zmq::DONTWAIT) {
                Ok(frames) => frames,
                Err(_) => return false,
            };
            let Some((alias, reply)) = split_replay(frames) else {
                // A malformed reply cannot be tied to a rank: count it on none.
                debug!(thread = self.thread_no, "malformed replay reply");
                continue;
            };
            let Some(&n) = self.by_alias.get(&alias) else {
                continue;
            };
            let Some(Some(slot)) = self.slots.get_mut(n) else {
                continue;
            };
            match reply {
                // Only while one request is out. A given-up request's late
                // replies would come first: the same engine's batches, from
                // no later a seq than the current request's, so the cursor
                // takes them as the current answer's or as stale.
                Replayed::Batch(seq, payload) if slot.ends.current() => {
                    slot.stream.replayed(seq, payload)
                }
                Replayed::Batch(..) => {}
                Replayed::End => {
                    let answered = slot.stream.replay_answered();
                    if slot.ends.end(answered) && slot.stream.is_replaying() {
                        slot.stream.replay_end(ReplayEnd::Complete);
                    }
                }
            }
            self.send_requests(n);
        }
        true
    }

    /// Sends a rank's replay requests through the shared ROUTER; those the
    /// connection cannot take yet wait for its handshake.
    fn send_requests(&mut self, n: usize) {
        let Some(Some(slot)) = self.slots.get_mut(n) else {
            return;
        };
        slot.unsent.extend(slot.stream.take_requests());
        if slot.stream.target().endpoints.replay.is_none() {
            slot.unsent.clear();
            return;
        }
        let tried = !slot.unsent.is_empty();
        while let Some(&from) = slot.unsent.front() {
            let request = [&slot.alias[..], b"", &from.to_be_bytes()[..]];
            match self.router.send_multipart(request, zmq::DONTWAIT) {
                Ok(()) => {
                    slot.unsent.pop_front();
                    slot.ends.sent();
                }
                // Not connected yet (EHOSTUNREACH) or its queue is full (EAGAIN).
                Err(_) => break,
            }
        }
        if tried {
            self.queue_router();
        }
    }
}

fn io_to_zmq(e: std::io::Error) -> ZmqError {
    // EIO for an error without an OS code.
    ZmqError(zmq::Error::from_raw(e.raw_os_error().unwrap_or(5)))
}
