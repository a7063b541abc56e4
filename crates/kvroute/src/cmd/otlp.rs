//! `kvroute serve`'s tracing flags: OpenTelemetry traces over OTLP/gRPC
//! (`kvroute_server::otel`), off unless a collector is named.

use anyhow::{Context as _, Result};
use clap::Args;
use kvroute_server::otel::{self, TraceConfig, Traces};

/// The tracing flags of `kvroute serve`.
#[derive(Debug, Args)]
pub struct OtlpArgs {
    /// Export OpenTelemetry traces over OTLP/gRPC to this collector
    /// (e.g. http://otel-collector:4317): a span per request with its
    /// routing decision, attempts, P/D legs and migrations, and W3C
    /// `traceparent` sent to the engines. Off by default; also
    /// OTEL_EXPORTER_OTLP_TRACES_ENDPOINT, or OTEL_EXPORTER_OTLP_ENDPOINT
    /// (docs/tracing.md)
    #[arg(long, value_name = "URL", env = "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT")]
    otlp_traces_endpoint: Option<String>,
    /// The share of traces started here that are kept (parent-based: a
    /// request whose `traceparent` says sampled is always kept). Without
    /// it, OTEL_TRACES_SAMPLER / OTEL_TRACES_SAMPLER_ARG decide (by
    /// default all)
    #[arg(long, value_name = "RATIO", value_parser = parse_ratio, env = "KVROUTE_OTLP_SAMPLE_RATIO")]
    otlp_sample_ratio: Option<f64>,
}

impl OtlpArgs {
    /// What to export, if anything: the flag's endpoint, else
    /// `OTEL_EXPORTER_OTLP_ENDPOINT`'s; none when `OTEL_SDK_DISABLED=true`
    /// or `OTEL_TRACES_EXPORTER=none`.
    pub fn config(&self) -> Option<TraceConfig> {
        let var = |name: &str| std::env::var(name).ok().filter(|v| !v.trim().is_empty());
        let disabled = var("OTEL_SDK_DISABLED").is_some_and(|v| v.eq_ignore_ascii_case("true"))
            || var("OTEL_TRACES_EXPORTER").is_some_and(|v| v.eq_ignore_ascii_case("none"));
        let endpoint = self
            .otlp_traces_endpoint
            .clone()
            .filter(|e| !e.trim().is_empty())
            .or_else(|| var("OTEL_EXPORTER_OTLP_ENDPOINT"))?;
        (!disabled).then_some(TraceConfig {
            endpoint,
            sample_ratio: self.otlp_sample_ratio,
        })
    }

    /// Installs the tracer when a collector is named (inside the runtime).
    pub fn install(&self) -> Result<Option<Traces>> {
        let Some(config) = self.config() else {
            return Ok(None);
        };
        let traces = otel::install(&config).context("--otlp-traces-endpoint")?;
        tracing::info!(endpoint = %config.endpoint, "exporting traces over OTLP");
        Ok(Some(traces))
    }
}

/// `--otlp-sample-ratio`'s value: a share from 0 to 1.
fn parse_ratio(value: &str) -> Result<f64, String> {
    match value.parse::<f64>() {
        Ok(r) if (0.0..=1.0).contains(&r) => Ok(r),
        _ => Err(format!("`{value}` is not a ratio from 0 to 1")),
    }
}
