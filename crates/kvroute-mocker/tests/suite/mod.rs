//! Test modules; `common` and `msgpack` are helpers.

mod cache;
mod cache_match;
mod common;
mod determinism;
mod faults;
mod golden;
mod http_api;
mod msgpack;
mod multimodal;
mod other_apis;
mod pd_sglang;
mod pd_vllm;
mod transport;
mod wire_exact;
