//! OpenTelemetry traces (`serve --otlp-traces-endpoint`): a span per
//! request at either door, its decision as attributes, a child span per
//! attempt, per prefill/decode leg and per migration, exported over OTLP
//! by a batch exporter on its own thread (the request path never waits on
//! the collector), and W3C `traceparent` sent to the engine on every leg so
//! the engine's own spans join the trace.
//!
//! Off unless installed: the tracer is one process-wide slot, as the log
//! subscriber is, read once per hook; while it is empty every hook returns
//! at that read and nothing else is done per request — except that a
//! client's `traceparent` and `tracestate` go on to the engine unchanged
//! (an operator's gateway may trace when kvroute does not; see
//! [`headers::TRACE_HEADERS`]).
//!
//! [`spans`] holds the hooks the doors call; [`headers`] the W3C
//! propagation over HTTP header maps. The span and attribute catalogue is
//! docs/tracing.md's.

mod export;
pub mod headers;
mod otlp;
pub(crate) mod spans;

use std::future::Future;
use std::sync::OnceLock;

use opentelemetry::context::FutureExt as _;
use opentelemetry::trace::TracerProvider as _;
use opentelemetry::Context;
use opentelemetry_sdk::trace::{Sampler, SdkTracer, SdkTracerProvider};

/// The tracer requests' spans start from; empty while tracing is off.
static TRACER: OnceLock<SdkTracer> = OnceLock::new();

/// The tracer, when tracing is on.
#[inline]
pub(crate) fn tracer() -> Option<&'static SdkTracer> {
    TRACER.get()
}

/// Tracing is on: a tracer is installed.
#[inline]
pub fn enabled() -> bool {
    TRACER.get().is_some()
}

/// Where and how traces are exported.
#[derive(Debug, Clone, PartialEq)]
pub struct TraceConfig {
    /// The OTLP/gRPC collector, e.g. `http://otel-collector:4317`.
    pub endpoint: String,
    /// Keep this share of the traces that start here (a parent-based ratio:
    /// a request whose `traceparent` says sampled is always kept); `None`:
    /// as `OTEL_TRACES_SAMPLER` / `OTEL_TRACES_SAMPLER_ARG` say (by default
    /// parent-based, always on).
    pub sample_ratio: Option<f64>,
}

/// Why tracing could not be installed.
#[derive(Debug, thiserror::Error)]
pub enum TraceError {
    /// The exporter could not be built (a malformed endpoint, say).
    #[error("the OTLP trace exporter: {0}")]
    Exporter(String),
    /// A tracer was installed already in this process.
    #[error("tracing is installed already")]
    Installed,
}

/// The installed exporter; [`Traces::shutdown`] flushes what it holds.
#[derive(Debug)]
pub struct Traces {
    provider: SdkTracerProvider,
}

impl Traces {
    /// Exports the spans still batched and stops the exporter. Blocks
    /// (up to the exporter's timeout) until the collector took them: call
    /// it off the runtime's workers (`spawn_blocking`).
    pub fn shutdown(self) {
        if let Err(e) = self.provider.shutdown() {
            tracing::warn!(error = %e, "flushing the last traces");
        }
    }
}

/// Installs the process's tracer exporting to `config.endpoint`. Must be
/// called inside a Tokio runtime (the gRPC channel's I/O runs on it). The
/// service is named `kvroute` unless `OTEL_SERVICE_NAME` says otherwise;
/// `OTEL_RESOURCE_ATTRIBUTES`, `OTEL_EXPORTER_OTLP_TRACES_HEADERS` /
/// `_TIMEOUT` and the batch processor's `OTEL_BSP_*` are honoured
/// ([`export`] says why the exporter is kvroute's own).
pub fn install(config: &TraceConfig) -> Result<Traces, TraceError> {
    let exporter = export::OtlpExporter::new(&config.endpoint)?;
    let mut resource = opentelemetry_sdk::Resource::builder();
    if std::env::var_os("OTEL_SERVICE_NAME").is_none() {
        resource = resource.with_service_name("kvroute");
    }
    let mut builder = SdkTracerProvider::builder()
        .with_batch_exporter(exporter)
        .with_resource(resource.build());
    if let Some(ratio) = config.sample_ratio {
        let ratio = Sampler::TraceIdRatioBased(ratio.clamp(0.0, 1.0));
        builder = builder.with_sampler(Sampler::ParentBased(Box::new(ratio)));
    }
    let provider = builder.build();
    let tracer = provider.tracer("kvroute");
    TRACER.set(tracer).map_err(|_| TraceError::Installed)?;
    Ok(Traces { provider })
}

/// Runs `work` within `cx` (its spans' parent, and the attempts' outgoing
/// `traceparent`), or as it is when there is none (tracing off). Give a
/// large future pinned where it is made (`std::pin::pin!(...)`): the
/// context then wraps a pointer to it, not a copy moved in (measured: one
/// 9 KB copy per request for the proxy's routing future).
pub async fn within<F: Future>(cx: Option<Context>, work: F) -> F::Output {
    match cx {
        Some(cx) => work.with_context(cx).await,
        None => work.await,
    }
}
