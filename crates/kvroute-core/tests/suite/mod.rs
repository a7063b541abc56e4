//! Test modules: golden payloads, hand-built cases, properties, robustness.

mod common;
mod golden;
