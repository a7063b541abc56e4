//! Ingestion: every worker's KV-event streams into the index, and the
//! registry of workers that routing, `/workers` and `/metrics` read.
//!
//! * [`spec`]: what a worker is, and the `--worker`, TOML and registration forms;
//! * [`address`]: the forms a worker's URL and sockets must take, and where
//!   the operator allows them to point;
//! * [`discover`]: SGLang workers described by their own `/server_info`;
//! * [`frames`]: the ZeroMQ message layouts of live events and replay replies;
//! * [`rank`]: one rank's stream as plain data, deciding through
//!   `kvroute_core::cursor` and applying to the index;
//! * [`stats`]: a rank's counters and state, shared with `/workers` and routing;
//! * [`reactor`]: one ingest thread's readiness loop over many ranks' sockets;
//! * [`pool`]: the fixed set of ingest threads;
//! * [`zmq_context`]: a ZeroMQ context sized for thousands of sockets;
//! * [`registry`]: the workers, their ranks, limits, and typed views of both.

pub mod address;
pub mod discover;
pub mod frames;
pub mod pool;
pub mod rank;
pub mod reactor;
pub mod registry;
pub mod spec;
pub mod stats;
pub mod zmq_context;
