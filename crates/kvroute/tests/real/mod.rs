//! One module per subject; the bed and the helpers are in `bed`.

pub mod bed;
mod conversations;
mod demo;
mod discovery;
mod images;
mod ingest;
mod migration;
mod predictions;
mod restarts;
mod routing;
mod tracing;
