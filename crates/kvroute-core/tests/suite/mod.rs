//! Test modules: golden payloads, hand-built cases, per-block image keys,
//! properties, robustness.

mod common;
mod golden;
mod hand_built;
mod hybrid;
mod image_keys;
mod properties;
mod robustness;
