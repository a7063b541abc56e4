//! Ingestion: every worker's KV-event streams into the index, and the
//! registry of workers that routing, `/workers` and `/metrics` read.
//!
//! * [`spec`]: what a worker is, and the `--worker`, TOML and registration forms;
//! * [`address`]: the forms a worker's URL and sockets must take, and where
//!   the operator allows them to point;
//! * [`discover`]: SGLang workers described by their own `/server_info`;
//! * [`stream`]: one thread per (worker, rank) that subscribes, replays what
//!   it missed, decodes and applies, deciding through `kvroute_core::cursor`;
//! * [`registry`]: the workers, their streams, and typed views of both.

pub mod address;
pub mod discover;
pub mod registry;
pub mod spec;
pub mod stream;
