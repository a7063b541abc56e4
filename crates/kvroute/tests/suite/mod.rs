//! One module per subject; helpers are in `crate::support`.

mod bench;
mod demo;
mod ingest;
mod inspect;
mod mocker;
mod multimodal;
mod proxy;
mod serve;
