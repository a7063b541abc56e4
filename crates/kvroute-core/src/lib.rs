//! kvroute's pure core: everything that decides, nothing that waits.
//!
//! No sockets, no threads, no clocks, no async runtime: the shell (the
//! `kvroute` binary) receives bytes and requests and hands them in as plain
//! data. The event path runs
//! engine payload → [`wire`] (decode, fold token ids with [`tokens`], hash
//! blocks with [`hash`]) → [`event::KvEvent`] → the index.
//! The request path folds and hashes prompt tokens with the same [`tokens`]
//! and [`hash`] functions, so both sides meet on equal local block hashes;
//! prompts with images are laid out per engine flavour by [`multimodal`].

#![forbid(unsafe_code)]

pub mod cursor;
pub mod event;
pub mod hash;
pub mod index;
pub mod multimodal;
pub mod rng;
pub mod scheduler;
pub mod tokens;
pub mod wire;
