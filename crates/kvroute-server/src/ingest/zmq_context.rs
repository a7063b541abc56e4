//! A ZeroMQ context sized for thousands of streams, and the two settings the
//! `zmq` crate does not expose.
//!
//! libzmq refuses a context's 1 024th socket unless `ZMQ_MAX_SOCKETS` is
//! raised, and the shared replay socket names each engine connection with
//! `ZMQ_CONNECT_ROUTING_ID`; both exist only in the C API. This module is the
//! only place that calls it: every other module sees plain [`zmq::Socket`]s.
#![allow(unsafe_code)]

use std::ffi::c_void;
use std::ops::Deref;
use std::sync::Arc;

/// Why a context or socket could not be made.
#[derive(Debug, thiserror::Error)]
#[error("zeromq: {0}")]
pub struct ZmqError(#[from] pub zmq::Error);

fn last_error() -> ZmqError {
    // SAFETY: reads the calling thread's errno as libzmq set it.
    ZmqError(zmq::Error::from_raw(unsafe { zmq_sys::zmq_errno() }))
}

/// An owned libzmq context; terminated when the last [`Socket`] and handle drop.
#[derive(Debug)]
pub struct ZmqContext {
    raw: *mut c_void,
}

// SAFETY: a libzmq context is thread safe (sockets are not, and are never
// shared through this type).
unsafe impl Send for ZmqContext {}
// SAFETY: as above.
unsafe impl Sync for ZmqContext {}

impl ZmqContext {
    /// A context that allows `max_sockets` sockets and runs one I/O thread.
    pub fn new(max_sockets: usize) -> Result<Arc<Self>, ZmqError> {
        // SAFETY: zmq_ctx_new has no preconditions; null means failure.
        let raw = unsafe { zmq_sys::zmq_ctx_new() };
        if raw.is_null() {
            return Err(last_error());
        }
        let context = ZmqContext { raw };
        let max = i32::try_from(max_sockets.max(16)).unwrap_or(i32::MAX);
        context.set(zmq_sys::ZMQ_MAX_SOCKETS, max)?;
        context.set(zmq_sys::ZMQ_IO_THREADS, 1)?;
        Ok(Arc::new(context))
    }

    fn set(&self, option: u32, value: i32) -> Result<(), ZmqError> {
        // SAFETY: `raw` is a live context; the option is an int option.
        let rc = unsafe { zmq_sys::zmq_ctx_set(self.raw, option as i32, value) };
        if rc == 0 {
            Ok(())
        } else {
            Err(last_error())
        }
    }

    /// The socket limit in effect.
    pub fn max_sockets(&self) -> usize {
        // SAFETY: `raw` is a live context.
        let n = unsafe { zmq_sys::zmq_ctx_get(self.raw, zmq_sys::ZMQ_MAX_SOCKETS as i32) };
        usize::try_from(n).unwrap_or(0)
    }

    /// A new socket of `kind`, with linger 0 (closing it drops what it has
    /// not sent, so neither it nor the context's end waits on a vanished
    /// engine); it keeps this context alive.
    pub fn socket(self: &Arc<Self>, kind: zmq::SocketType) -> Result<Socket, ZmqError> {
        // SAFETY: `raw` is a live context; null means failure.
        let raw = unsafe { zmq_sys::zmq_socket(self.raw, kind as i32) };
        if raw.is_null() {
            return Err(last_error());
        }
        // SAFETY: `raw` is a fresh socket that nothing else owns.
        let socket = unsafe { zmq::Socket::from_raw(raw) };
        socket.set_linger(0)?;
        Ok(Socket {
            socket,
            _context: self.clone(),
        })
    }
}

impl Drop for ZmqContext {
    fn drop(&mut self) {
        // SAFETY: every socket of this context holds an Arc to it, so none
        // is left; [`ZmqContext::socket`] sets linger 0 on each, so this does not block.
        unsafe { zmq_sys::zmq_ctx_term(self.raw) };
    }
}

/// A socket and the context it belongs to (which must outlive it).
pub struct Socket {
    // Dropped first: fields drop in declaration order.
    socket: zmq::Socket,
    _context: Arc<ZmqContext>,
}

impl std::fmt::Debug for Socket {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Socket").finish_non_exhaustive()
    }
}

impl Deref for Socket {
    type Target = zmq::Socket;
    fn deref(&self) -> &zmq::Socket {
        &self.socket
    }
}

impl Socket {
    /// Names the peer of the next `connect` on this ROUTER socket, so its
    /// replies arrive under `id` and requests to it can be addressed by it.
    pub fn set_connect_routing_id(&mut self, id: &[u8]) -> Result<(), ZmqError> {
        // SAFETY: the socket is live and owned; libzmq copies `id`.
        let rc = unsafe {
            zmq_sys::zmq_setsockopt(
                self.socket.as_mut_ptr(),
                zmq_sys::ZMQ_CONNECT_ROUTING_ID as i32,
                id.as_ptr().cast(),
                id.len(),
            )
        };
        if rc == 0 {
            Ok(())
        } else {
            Err(last_error())
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_context_holds_more_than_the_default_1023_sockets() {
        let context = ZmqContext::new(1_500).expect("context");
        assert_eq!(context.max_sockets(), 1_500);
        let sockets: Vec<Socket> = (0..1_100)
            .map(|_| context.socket(zmq::SUB).expect("socket"))
            .collect();
        assert_eq!(sockets.len(), 1_100);
    }

    #[test]
    fn every_socket_is_made_with_linger_0() {
        let context = ZmqContext::new(64).expect("context");
        for kind in [zmq::SUB, zmq::ROUTER, zmq::PAIR, zmq::PUSH] {
            let socket = context.socket(kind).expect("socket");
            assert_eq!(socket.get_linger().expect("linger"), 0, "{kind:?}");
        }
    }

    #[test]
    fn replies_arrive_under_the_connect_routing_id() {
        let context = ZmqContext::new(64).expect("context");
        let engine = context.socket(zmq::ROUTER).expect("engine");
        engine.bind("tcp://127.0.0.1:*").expect("bind");
        let endpoint = engine
            .get_last_endpoint()
            .expect("endpoint")
            .expect("utf-8");
        let mut router = context.socket(zmq::ROUTER).expect("router");
        router.set_connect_routing_id(b"rank-7").expect("id");
        router.connect(&endpoint).expect("connect");
        // The engine speaks first here, so no handshake race: it learns our
        // id from its own first message's reply path.
        std::thread::sleep(std::time::Duration::from_millis(100));
        router
            .send_multipart([&b"rank-7"[..], b"", b"hello"], 0)
            .expect("send");
        let request = engine.recv_multipart(0).expect("recv");
        engine
            .send_multipart([&request[0][..], b"", b"reply"], 0)
            .expect("reply");
        let reply = router.recv_multipart(0).expect("reply");
        assert_eq!(reply, vec![b"rank-7".to_vec(), vec![], b"reply".to_vec()]);
    }
}
