//! Test modules: golden payloads, hand-built cases, properties, robustness.

mod common;
mod golden;
mod hand_built;
mod properties;
mod robustness;
