//! One module per subject; helpers are in `crate::support`.

mod bench;
mod block_size;
mod config;
mod dashboard;
mod demo;
mod deploy;
mod disagg;
mod discovery;
mod engine_load;
mod epp;
mod ingest;
mod inspect;
mod metrics;
mod mocker;
mod models;
mod multimodal;
mod priority;
mod proxy;
mod replicas;
mod restarts;
mod routing;
mod safety;
mod scale;
mod serve;
mod sessions;
mod warm_restart;
