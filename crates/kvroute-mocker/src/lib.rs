//! kvroute-mocker: a simulated inference engine that a router cannot tell from
//! a real vLLM 0.33 or SGLang 0.5.23 on the wire.
//!
//! Each engine serves an OpenAI-compatible HTTP API, keeps a real prefix cache
//! (chained engine block hashes, LRU eviction of unreferenced blocks, pinned
//! running requests), schedules like vLLM v1 (continuous batching, chunked
//! prefill, preemption), takes time by Dynamo's step-time polynomial, and
//! publishes KV events over ZeroMQ exactly as the imitated engine does,
//! replay socket included. See `docs/mocker.md` for flags, ports and formulas.
//!
//! Pure core, thin shell:
//! * [`engine`] (pure, synchronous, no clock): cache, scheduler, timing, events;
//! * [`hashing`], [`encode`], [`multimodal`], [`filler`] (pure): the engines'
//!   hashes, their msgpack bytes, image pads and generated text; prompts are
//!   rendered by `kvroute_prompt`, which the router shares;
//! * [`handoff`], [`lease`] (pure): prefill/decode transfer fields as the
//!   engines read them, the modelled transfer time, tables whose entries expire;
//! * [`publisher`] (one OS thread per rank: ZeroMQ PUB + replay ROUTER),
//!   [`driver`] (one tokio task per rank: gives the engine real time),
//!   [`http`] (axum; [`http::handoff`]: the prefill and decode legs),
//!   [`bootstrap`] (SGLang prefill engines' rooms), [`peer`] (what one engine
//!   asks another), [`fleet`] (start, print `--worker` lines, stop).
//!
//! ```no_run
//! # async fn demo() -> Result<(), kvroute_mocker::MockerError> {
//! // One vLLM-flavoured engine on the default ports, for a minute.
//! let config = kvroute_mocker::MockerConfig::default();
//! let stop = tokio::time::sleep(std::time::Duration::from_secs(60));
//! kvroute_mocker::run(config, stop).await
//! # }
//! ```

#![forbid(unsafe_code)]

pub mod bootstrap;
pub mod config;
pub mod driver;
pub mod encode;
pub mod engine;
pub mod event;
pub mod faults;
pub mod filler;
pub mod fleet;
pub mod handoff;
pub mod hashing;
pub mod http;
pub mod lease;
pub mod multimodal;
pub mod peer;
pub mod publisher;

pub use config::{EventFormat, MockerConfig, ReplayFrames, Role, TsSource};
pub use fleet::{run, Fleet, MockerError, WorkerInfo};
