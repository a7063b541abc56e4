//! The span exporter: OTLP over gRPC to the collector, each batch the
//! SDK's batch processor hands over encoded by [`super::otlp`] and sent as
//! one `TraceService/Export` call on a tonic channel (HTTP/2, one
//! connection kept, made again when it drops).
//!
//! The OTLP exporter's standard variables are honoured:
//! `OTEL_EXPORTER_OTLP_TRACES_HEADERS` (else `OTEL_EXPORTER_OTLP_HEADERS`:
//! `key=value,...`, values percent-decoded) and
//! `OTEL_EXPORTER_OTLP_TRACES_TIMEOUT` (else `OTEL_EXPORTER_OTLP_TIMEOUT`,
//! milliseconds, 10 s by default) bounding each export. Plain `http://`
//! collectors only: a `https://` one is refused when tracing is installed.

use std::time::Duration;

use bytes::{Buf as _, BufMut as _, Bytes};
use opentelemetry_sdk::error::{OTelSdkError, OTelSdkResult};
use opentelemetry_sdk::trace::{SpanData, SpanExporter};
use opentelemetry_sdk::Resource;
use tonic::codec::{Codec, DecodeBuf, Decoder, EncodeBuf, Encoder};
use tonic::metadata::{AsciiMetadataKey, AsciiMetadataValue, MetadataMap};
use tonic::transport::{Channel, Endpoint};

use super::otlp::{export_request, EncodedResource};
use super::TraceError;

/// The gRPC method spans are exported to.
const EXPORT: &str = "/opentelemetry.proto.collector.trace.v1.TraceService/Export";
/// How long an export may take unless the variables say otherwise.
const DEFAULT_TIMEOUT: Duration = Duration::from_secs(10);
/// How long connecting to the collector may take.
const CONNECT_TIMEOUT: Duration = Duration::from_secs(5);

/// Spans to a collector over OTLP/gRPC.
#[derive(Debug)]
pub struct OtlpExporter {
    channel: Channel,
    resource: EncodedResource,
    metadata: MetadataMap,
}

impl OtlpExporter {
    /// An exporter to the collector at `endpoint` (`http://host:port`);
    /// connects when the first batch is sent. Must be called inside a
    /// Tokio runtime: the channel's connection runs on it.
    pub fn new(endpoint: &str) -> Result<Self, TraceError> {
        let env = |name: &str| std::env::var(name).ok().filter(|v| !v.trim().is_empty());
        if endpoint
            .trim_start()
            .to_ascii_lowercase()
            .starts_with("https:")
        {
            return Err(TraceError::Exporter(format!(
                "{endpoint}: this exporter speaks plain gRPC (http://); \
                 reach a TLS collector through a local one or a sidecar"
            )));
        }
        let timeout = env("OTEL_EXPORTER_OTLP_TRACES_TIMEOUT")
            .or_else(|| env("OTEL_EXPORTER_OTLP_TIMEOUT"))
            .and_then(|ms| ms.trim().parse::<u64>().ok())
            .map_or(DEFAULT_TIMEOUT, Duration::from_millis);
        let headers = env("OTEL_EXPORTER_OTLP_TRACES_HEADERS")
            .or_else(|| env("OTEL_EXPORTER_OTLP_HEADERS"))
            .unwrap_or_default();
        let channel = Endpoint::from_shared(endpoint.trim().to_owned())
            .map_err(|e| TraceError::Exporter(format!("{endpoint}: {e}")))?
            .connect_timeout(CONNECT_TIMEOUT)
            .timeout(timeout)
            .connect_lazy();
        Ok(OtlpExporter {
            channel,
            resource: EncodedResource::default(),
            metadata: metadata(&headers),
        })
    }
}

impl SpanExporter for OtlpExporter {
    async fn export(&self, batch: Vec<SpanData>) -> OTelSdkResult {
        let body = Bytes::from(export_request(&self.resource, &batch));
        drop(batch);
        let mut request = tonic::Request::new(body);
        *request.metadata_mut() = self.metadata.clone();
        let mut grpc = tonic::client::Grpc::new(self.channel.clone());
        grpc.ready()
            .await
            .map_err(|e| OTelSdkError::InternalFailure(format!("the collector: {e}")))?;
        let path = axum::http::uri::PathAndQuery::from_static(EXPORT);
        match grpc.unary(request, path, Encoded).await {
            Ok(_) => Ok(()),
            Err(status) => Err(OTelSdkError::InternalFailure(format!(
                "the collector refused the spans: {status}"
            ))),
        }
    }

    fn set_resource(&mut self, resource: &Resource) {
        self.resource = EncodedResource::new(resource);
    }
}

/// The gRPC metadata `key=value,...` names (keys lower-cased, values
/// percent-decoded); a pair that is not valid metadata is skipped.
fn metadata(headers: &str) -> MetadataMap {
    let mut map = MetadataMap::new();
    for pair in headers.split(',') {
        let Some((key, value)) = pair.split_once('=') else {
            continue;
        };
        let value = percent_encoding::percent_decode_str(value.trim()).decode_utf8_lossy();
        let key = key.trim().to_ascii_lowercase();
        if let (Ok(key), Ok(value)) = (
            key.parse::<AsciiMetadataKey>(),
            value.parse::<AsciiMetadataValue>(),
        ) {
            map.insert(key, value);
        }
    }
    map
}

/// The codec of an export: the request is sent as the bytes it was encoded
/// to, and the answer (an `ExportTraceServiceResponse`) is read and
/// dropped.
#[derive(Debug, Clone, Copy, Default)]
struct Encoded;

impl Codec for Encoded {
    type Encode = Bytes;
    type Decode = ();
    type Encoder = Encoded;
    type Decoder = Encoded;

    fn encoder(&mut self) -> Encoded {
        Encoded
    }

    fn decoder(&mut self) -> Encoded {
        Encoded
    }
}

impl Encoder for Encoded {
    type Item = Bytes;
    type Error = tonic::Status;

    fn encode(&mut self, item: Bytes, dst: &mut EncodeBuf<'_>) -> Result<(), tonic::Status> {
        dst.put_slice(&item);
        Ok(())
    }
}

impl Decoder for Encoded {
    type Item = ();
    type Error = tonic::Status;

    fn decode(&mut self, src: &mut DecodeBuf<'_>) -> Result<Option<()>, tonic::Status> {
        src.advance(src.remaining());
        Ok(Some(()))
    }
}

#[cfg(test)]
mod tests {
    use super::metadata;

    #[test]
    fn headers_become_metadata_percent_decoded() {
        let map = metadata("api-key=abc%20def, X-Team = routing ,broken,=x,ok=1");
        assert_eq!(
            map.get("api-key").and_then(|v| v.to_str().ok()),
            Some("abc def")
        );
        assert_eq!(
            map.get("x-team").and_then(|v| v.to_str().ok()),
            Some("routing")
        );
        assert_eq!(map.get("ok").and_then(|v| v.to_str().ok()), Some("1"));
        assert_eq!(map.len(), 3);
    }
}
