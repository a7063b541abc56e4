//! kvroute as a Gateway API Inference Extension endpoint picker (EPP):
//! Envoy's `ext_proc` over gRPC (`serve --epp-port`), sharing the index,
//! the workers, the scheduler, the load and the metrics of `kvroute serve`.
//!
//! For each request through the gateway, Envoy opens one `Process` stream
//! in `FULL_DUPLEX_STREAMED` mode and sends the request's headers and body
//! chunks; the picker reads the whole body, routes it as `serve` would
//! (without sending it), answers the headers with
//! `x-gateway-destination-endpoint: ip:port` (and the same value in the
//! `envoy.lb` dynamic metadata, with `clear_route_cache`), and sends the
//! body back in pieces of at most 62 000 bytes; Envoy then sends the request
//! to that endpoint and passes the answer through the picker, which follows
//! it to keep the rank's load, TTFT and accuracy as `serve` does.
//!
//! One job per file:
//! * [`mode`]: the processing mode a stream must be in;
//! * [`exchange`]: a stream's messages as plain data: their order, the
//!   request's head and body (bounded), what each message means;
//! * [`subset`]: endpoints as `ip:port`, the subset hint, the served endpoint;
//! * [`body`]: bodies gathered up to a bound, and cut into 62 000-byte pieces;
//! * [`reply`]: the messages the picker sends, built from plain values;
//! * [`usage`]: the engine's `cached_tokens` read from the passing answer;
//! * [`pick`]: routing a whole request through the router, and the answer's
//!   accounting;
//! * [`service`]: the gRPC service, one task per stream;
//! * [`health`]: `grpc.health.v1` statuses; [`tls`]: the port's certificate.
//!
//! The service is built with the crate's feature `epp` (its protocol's
//! generated code is the largest dependency of a first build); without it
//! the settings below still parse and [`spawn`] answers
//! [`EppError::NotBuilt`].

#[cfg(feature = "epp")]
pub mod body;
#[cfg(feature = "epp")]
pub mod exchange;
pub mod health;
#[cfg(feature = "epp")]
pub mod mode;
#[cfg(feature = "epp")]
pub mod pick;
#[cfg(feature = "epp")]
pub mod reply;
#[cfg(feature = "epp")]
pub mod service;
#[cfg(feature = "epp")]
pub mod subset;
pub mod tls;
#[cfg(feature = "epp")]
pub mod usage;

use std::sync::Arc;

#[cfg(feature = "epp")]
use envoy_types::pb::envoy::service::ext_proc::v3::external_processor_server::ExternalProcessorServer;
use tokio::net::TcpListener;
use tokio::sync::watch;
use tokio::task::JoinHandle;
#[cfg(feature = "epp")]
use tonic::transport::server::TcpIncoming;
#[cfg(feature = "epp")]
use tonic::transport::{Server, ServerTlsConfig};
#[cfg(feature = "epp")]
use tracing::warn;

use crate::metrics::epp::EppMetrics;
use crate::router::Router;
pub use tls::EppTls;

/// Whether this build has the endpoint picker (the crate's feature `epp`).
pub const BUILT: bool = cfg!(feature = "epp");

/// GIE's port of the ext_proc service.
pub const DEFAULT_PORT: u16 = 9002;
/// GIE's port of the gRPC health service.
pub const DEFAULT_HEALTH_PORT: u16 = 9003;

/// How the endpoint picker serves (its listeners are bound by the caller,
/// so that it can print their ports first).
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct EppConfig {
    /// TLS on the ext_proc port.
    pub tls: EppTls,
    /// The host the ports listen on, named by a self-signed certificate.
    pub host: String,
}

/// The picker's bound listeners.
#[derive(Debug)]
pub struct EppListeners {
    /// The ext_proc service (and health, for Envoy's cluster health check).
    pub ext_proc: TcpListener,
    /// The gRPC health service, in plaintext.
    pub health: TcpListener,
}

/// Why the picker could not start.
#[derive(Debug, thiserror::Error)]
pub enum EppError {
    /// TLS could not be set up.
    #[error("endpoint picker TLS: {0}")]
    Tls(#[from] tls::TlsError),
    /// tonic refused the TLS configuration.
    #[cfg(feature = "epp")]
    #[error("endpoint picker TLS: {0}")]
    Transport(#[from] tonic::transport::Error),
    /// This build has no endpoint picker.
    #[error("this kvroute was built without the endpoint picker: build it with `--features epp` (or `full`)")]
    NotBuilt,
}

/// What the picker shares with the rest of the router.
#[derive(Debug, Clone)]
pub struct EppShared {
    /// Routing state.
    pub router: Arc<Router>,
    /// The picker's counters.
    pub metrics: Arc<EppMetrics>,
    /// Largest request body, in bytes (`--max-body-mib`).
    pub max_body_bytes: usize,
}

/// Resolves once `stop` turns true (or its sender is gone).
#[cfg(feature = "epp")]
async fn stopped(mut stop: watch::Receiver<bool>) {
    let _ = stop.wait_for(|s| *s).await;
}

/// Starts the ext_proc server, the health server and the readiness
/// reports on `listeners`, until `stop` turns true.
#[cfg(feature = "epp")]
pub fn spawn(
    shared: EppShared,
    config: &EppConfig,
    listeners: EppListeners,
    stop: watch::Receiver<bool>,
) -> Result<Vec<JoinHandle<()>>, EppError> {
    let EppShared {
        router,
        metrics,
        max_body_bytes,
    } = shared;
    let (reporter, health) = tonic_health::server::health_reporter();
    let mut builder = Server::builder();
    if let Some(identity) = config.tls.identity(&config.host)? {
        builder = builder.tls_config(ServerTlsConfig::new().identity(identity))?;
    }
    let picker = service::Picker::new(router.clone(), metrics, max_body_bytes);
    let ext_proc = builder
        .add_service(ExternalProcessorServer::new(picker))
        .add_service(health.clone())
        .serve_with_incoming_shutdown(
            TcpIncoming::from(listeners.ext_proc).with_nodelay(Some(true)),
            stopped(stop.clone()),
        );
    let health = Server::builder()
        .add_service(health)
        .serve_with_incoming_shutdown(TcpIncoming::from(listeners.health), stopped(stop.clone()));
    Ok(vec![
        tokio::spawn(async move {
            if let Err(e) = ext_proc.await {
                warn!(error = %e, "the endpoint picker's ext_proc server stopped");
            }
        }),
        tokio::spawn(async move {
            if let Err(e) = health.await {
                warn!(error = %e, "the endpoint picker's health server stopped");
            }
        }),
        tokio::spawn(health::keep_reporting(reporter, router, stop)),
    ])
}

/// Without the feature `epp`: the picker cannot start.
#[cfg(not(feature = "epp"))]
pub fn spawn(
    _shared: EppShared,
    _config: &EppConfig,
    _listeners: EppListeners,
    _stop: watch::Receiver<bool>,
) -> Result<Vec<JoinHandle<()>>, EppError> {
    Err(EppError::NotBuilt)
}
