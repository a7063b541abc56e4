//! The core's integration tests, in one binary.

mod suite;
