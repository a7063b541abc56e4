//! OTLP's protobuf for a batch of finished spans, written straight from
//! the SDK's `SpanData` into one buffer: an `ExportTraceServiceRequest`
//! (opentelemetry-proto's `collector/trace/v1`) holding one
//! `ResourceSpans`, a `ScopeSpans` per instrumentation scope and a `Span`
//! per span, field for field as the official conversion writes them.
//!
//! Why not the official conversion (opentelemetry-proto's types under
//! prost): it copies every span into owned message structs (a `String` per
//! attribute key and value, a `Vec` per id) and prost then measures each
//! nested message again at every level it is nested in. Measured with
//! callgrind on `kvroute bench proxy` at sampling 1.0, that export was more
//! than half of what tracing added to the router's instructions per
//! request; written here it is a few hundred instructions per span
//! (docs/tracing.md, "Cost"). The wire format is fixed by the protos; the
//! tests decode this module's bytes with the official types and compare
//! them with the official conversion's.
//!
//! Pure: no I/O. [`super::export`] sends the bytes.

use std::time::{SystemTime, UNIX_EPOCH};

use opentelemetry::trace::{SpanId, SpanKind, Status};
use opentelemetry::{Array, InstrumentationScope, Key, Value};
use opentelemetry_sdk::trace::SpanData;
use opentelemetry_sdk::Resource;
use prost::encoding::{encode_key, encode_varint, WireType};

/// `Span.flags`: the parent's remoteness is known.
const HAS_IS_REMOTE: u32 = 0x100;
/// `Span.flags`: the parent is remote.
const IS_REMOTE: u32 = 0x200;

/// The resource a batch is exported under, encoded once (its `Resource`
/// message's fields, and the schema URL of its `ResourceSpans`).
#[derive(Debug, Clone, Default)]
pub struct EncodedResource {
    fields: Vec<u8>,
    schema_url: String,
}

impl EncodedResource {
    /// `resource`'s attributes, encoded.
    pub fn new(resource: &Resource) -> Self {
        let mut fields = Vec::new();
        for (key, value) in resource.iter() {
            nested(&mut fields, 1, |b| key_value(b, key, value));
        }
        EncodedResource {
            fields,
            schema_url: resource.schema_url().unwrap_or_default().to_owned(),
        }
    }
}

/// The `ExportTraceServiceRequest` of `spans` under `resource`.
pub fn export_request(resource: &EncodedResource, spans: &[SpanData]) -> Vec<u8> {
    // Spans are mostly one scope's (the router has one tracer): a linear
    // grouping in first-seen order.
    let mut scopes: Vec<(&InstrumentationScope, Vec<&SpanData>)> = Vec::new();
    for span in spans {
        let scope = &span.instrumentation_scope;
        match scopes.iter_mut().find(|(s, _)| *s == scope) {
            Some((_, group)) => group.push(span),
            None => scopes.push((scope, vec![span])),
        }
    }
    let mut buf = Vec::with_capacity(512 * spans.len().max(1));
    nested(&mut buf, 1, |b| {
        nested(b, 1, |b| b.extend_from_slice(&resource.fields));
        for (scope, group) in &scopes {
            nested(b, 2, |b| scope_spans(b, scope, group));
        }
        string(b, 3, &resource.schema_url);
    });
    buf
}

fn scope_spans(buf: &mut Vec<u8>, scope: &InstrumentationScope, spans: &[&SpanData]) {
    nested(buf, 1, |b| {
        string(b, 1, scope.name());
        string(b, 2, scope.version().unwrap_or_default());
        for kv in scope.attributes() {
            nested(b, 3, |b| key_value(b, &kv.key, &kv.value));
        }
    });
    for span in spans {
        nested(buf, 2, |b| span_message(b, span));
    }
    string(buf, 3, scope.schema_url().unwrap_or_default());
}

fn span_message(buf: &mut Vec<u8>, span: &SpanData) {
    let context = &span.span_context;
    bytes(buf, 1, &context.trace_id().to_bytes());
    bytes(buf, 2, &context.span_id().to_bytes());
    string(buf, 3, &context.trace_state().header());
    if span.parent_span_id != SpanId::INVALID {
        bytes(buf, 4, &span.parent_span_id.to_bytes());
    }
    string(buf, 5, &span.name);
    varint(buf, 6, kind(&span.span_kind));
    fixed64(buf, 7, nanos(span.start_time));
    fixed64(buf, 8, nanos(span.end_time));
    for kv in &span.attributes {
        nested(buf, 9, |b| key_value(b, &kv.key, &kv.value));
    }
    varint(buf, 10, u64::from(span.dropped_attributes_count));
    for event in span.events.iter() {
        nested(buf, 11, |b| {
            fixed64(b, 1, nanos(event.timestamp));
            string(b, 2, &event.name);
            for kv in &event.attributes {
                nested(b, 3, |b| key_value(b, &kv.key, &kv.value));
            }
            varint(b, 4, u64::from(event.dropped_attributes_count));
        });
    }
    varint(buf, 12, u64::from(span.events.dropped_count));
    for link in span.links.iter() {
        nested(buf, 13, |b| {
            let context = &link.span_context;
            bytes(b, 1, &context.trace_id().to_bytes());
            bytes(b, 2, &context.span_id().to_bytes());
            string(b, 3, &context.trace_state().header());
            for kv in &link.attributes {
                nested(b, 4, |b| key_value(b, &kv.key, &kv.value));
            }
            varint(b, 5, u64::from(link.dropped_attributes_count));
            let trace_flags = u32::from(context.trace_flags().to_u8());
            fixed32(
                b,
                6,
                trace_flags | HAS_IS_REMOTE | remote(context.is_remote()),
            );
        });
    }
    varint(buf, 14, u64::from(span.links.dropped_count));
    nested(buf, 15, |b| {
        if let Status::Error { description } = &span.status {
            string(b, 2, description);
        }
        let code = match span.status {
            Status::Unset => 0,
            Status::Ok => 1,
            Status::Error { .. } => 2,
        };
        varint(b, 3, code);
    });
    let trace_flags = u32::from(context.trace_flags().to_u8());
    fixed32(
        buf,
        16,
        trace_flags | HAS_IS_REMOTE | remote(span.parent_span_is_remote),
    );
}

fn remote(is_remote: bool) -> u32 {
    if is_remote {
        IS_REMOTE
    } else {
        0
    }
}

/// `Span.SpanKind`'s number.
fn kind(kind: &SpanKind) -> u64 {
    match kind {
        SpanKind::Internal => 1,
        SpanKind::Server => 2,
        SpanKind::Client => 3,
        SpanKind::Producer => 4,
        SpanKind::Consumer => 5,
    }
}

/// Nanoseconds since the Unix epoch (0 before it).
fn nanos(time: SystemTime) -> u64 {
    time.duration_since(UNIX_EPOCH)
        .map_or(0, |d| u64::try_from(d.as_nanos()).unwrap_or(u64::MAX))
}

/// A `KeyValue` message's fields. Its value's length is known before it
/// is written (but an array's), so the common attribute is written in one
/// pass with nothing moved.
fn key_value(buf: &mut Vec<u8>, key: &Key, value: &Value) {
    string(buf, 1, key.as_str());
    match any_value_len(value) {
        Some(len) => {
            key_byte(buf, 2, WireType::LengthDelimited);
            varint_raw(buf, len as u64);
            any_value(buf, value);
        }
        None => nested(buf, 2, |b| any_value(b, value)),
    }
}

/// The length of `value`'s `AnyValue` message, when it is not an array.
fn any_value_len(value: &Value) -> Option<usize> {
    Some(match value {
        Value::String(s) => 1 + varint_len(s.as_str().len() as u64) + s.as_str().len(),
        Value::Bool(_) => 2,
        Value::I64(i) => 1 + varint_len(*i as u64),
        Value::F64(_) => 9,
        Value::Array(_) => return None,
        _ => 0,
    })
}

/// An `AnyValue` message's field: its one value, written even when it is
/// the type's zero (a oneof's member is always sent).
fn any_value(buf: &mut Vec<u8>, value: &Value) {
    match value {
        Value::String(s) => always_string(buf, 1, s.as_str()),
        Value::Bool(b) => always_varint(buf, 2, u64::from(*b)),
        // int64: two's complement as a 64-bit varint.
        Value::I64(i) => always_varint(buf, 3, *i as u64),
        Value::F64(f) => {
            key_byte(buf, 4, WireType::SixtyFourBit);
            buf.extend_from_slice(&f.to_le_bytes());
        }
        Value::Array(array) => nested(buf, 5, |b| array_values(b, array)),
        // A kind of value this module does not know: an empty AnyValue.
        _ => {}
    }
}

/// An `ArrayValue` message's fields: each element as an `AnyValue`.
fn array_values(buf: &mut Vec<u8>, array: &Array) {
    let mut element = |value: Value| nested(buf, 1, |b| any_value(b, &value));
    match array {
        Array::Bool(values) => values.iter().for_each(|v| element(Value::Bool(*v))),
        Array::I64(values) => values.iter().for_each(|v| element(Value::I64(*v))),
        Array::F64(values) => values.iter().for_each(|v| element(Value::F64(*v))),
        Array::String(values) => values
            .iter()
            .for_each(|v| element(Value::String(v.clone()))),
        _ => {}
    }
}

/// A length-delimited field whose body `write` appends: the body is
/// written in place, then its length put before it (one move of the body,
/// no buffer of its own).
fn nested(buf: &mut Vec<u8>, field: u32, write: impl FnOnce(&mut Vec<u8>)) {
    key_byte(buf, field, WireType::LengthDelimited);
    let start = buf.len();
    write(buf);
    let body = buf.len() - start;
    let mut head = [0u8; 10];
    let mut rest = &mut head[..];
    encode_varint(body as u64, &mut rest);
    let n = 10 - rest.len();
    buf.extend_from_slice(&head[..n]);
    buf[start..].rotate_right(n);
}

/// A field's key (the one byte of fields 1 to 15, else prost's varint).
#[inline]
fn key_byte(buf: &mut Vec<u8>, field: u32, wire_type: WireType) {
    if field < 16 {
        buf.push((field << 3) as u8 | wire_type as u8);
    } else {
        encode_key(field, wire_type, buf);
    }
}

/// A varint (one byte below 128, else prost's).
#[inline]
fn varint_raw(buf: &mut Vec<u8>, value: u64) {
    if value < 0x80 {
        buf.push(value as u8);
    } else {
        encode_varint(value, buf);
    }
}

/// How many bytes `value` takes as a varint.
#[inline]
fn varint_len(value: u64) -> usize {
    prost::encoding::encoded_len_varint(value)
}

fn string(buf: &mut Vec<u8>, field: u32, value: &str) {
    if !value.is_empty() {
        always_string(buf, field, value);
    }
}

fn always_string(buf: &mut Vec<u8>, field: u32, value: &str) {
    bytes_always(buf, field, value.as_bytes());
}

fn bytes(buf: &mut Vec<u8>, field: u32, value: &[u8]) {
    if !value.is_empty() {
        bytes_always(buf, field, value);
    }
}

fn bytes_always(buf: &mut Vec<u8>, field: u32, value: &[u8]) {
    key_byte(buf, field, WireType::LengthDelimited);
    varint_raw(buf, value.len() as u64);
    buf.extend_from_slice(value);
}

fn varint(buf: &mut Vec<u8>, field: u32, value: u64) {
    if value != 0 {
        always_varint(buf, field, value);
    }
}

fn always_varint(buf: &mut Vec<u8>, field: u32, value: u64) {
    key_byte(buf, field, WireType::Varint);
    varint_raw(buf, value);
}

fn fixed64(buf: &mut Vec<u8>, field: u32, value: u64) {
    if value != 0 {
        key_byte(buf, field, WireType::SixtyFourBit);
        buf.extend_from_slice(&value.to_le_bytes());
    }
}

fn fixed32(buf: &mut Vec<u8>, field: u32, value: u32) {
    if value != 0 {
        key_byte(buf, field, WireType::ThirtyTwoBit);
        buf.extend_from_slice(&value.to_le_bytes());
    }
}

#[cfg(test)]
#[path = "otlp_tests.rs"]
mod tests;
