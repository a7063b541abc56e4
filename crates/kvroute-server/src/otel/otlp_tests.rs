//! The encoder's bytes, decoded with the official OTLP messages, are the
//! official conversion's messages.

use std::borrow::Cow;
use std::time::{Duration, UNIX_EPOCH};

use opentelemetry::trace::{
    Event, Link, SpanContext, SpanId, SpanKind, Status, TraceFlags, TraceId, TraceState,
};
use opentelemetry::{Array, InstrumentationScope, KeyValue, StringValue, Value};
use opentelemetry_proto::tonic::collector::trace::v1::ExportTraceServiceRequest;
use opentelemetry_proto::transform::common::tonic::ResourceAttributesWithSchema;
use opentelemetry_proto::transform::trace::tonic::group_spans_by_resource_and_scope;
use opentelemetry_sdk::trace::{SpanData, SpanEvents, SpanLinks};
use opentelemetry_sdk::Resource;
use prost::Message as _;

use super::{export_request, EncodedResource};

fn context(n: u64, remote: bool, state: TraceState) -> SpanContext {
    SpanContext::new(
        TraceId::from(u128::from(n) << 64 | 0xabcd),
        SpanId::from(n.wrapping_mul(0x9e37_79b9_7f4a_7c15) | 1),
        if n.is_multiple_of(2) {
            TraceFlags::SAMPLED
        } else {
            TraceFlags::default()
        },
        remote,
        state,
    )
}

fn every_value() -> Vec<KeyValue> {
    vec![
        KeyValue::new("s", "text"),
        KeyValue::new("empty", ""),
        KeyValue::new("t", true),
        KeyValue::new("f", false),
        KeyValue::new("i", -7_i64),
        KeyValue::new("zero", 0_i64),
        KeyValue::new("big", i64::MAX),
        KeyValue::new("d", 0.25_f64),
        KeyValue::new("d0", 0.0_f64),
        KeyValue::new("bools", Value::Array(Array::Bool(vec![true, false]))),
        KeyValue::new("ints", Value::Array(Array::I64(vec![1, -1, 0]))),
        KeyValue::new("floats", Value::Array(Array::F64(vec![1.5]))),
        KeyValue::new(
            "strings",
            Value::Array(Array::String(vec![StringValue::from("a"), "".into()])),
        ),
        KeyValue::new("none", Value::Array(Array::I64(vec![]))),
        KeyValue::new("ü-key", "vålue ✓"),
    ]
}

fn span(n: u64, scope: &InstrumentationScope) -> SpanData {
    let state = if n == 2 {
        TraceState::from_key_value([("vendor", "x")]).expect("a trace state")
    } else {
        TraceState::NONE
    };
    let mut events = SpanEvents::default();
    let mut links = SpanLinks::default();
    if n == 1 {
        let at = UNIX_EPOCH + Duration::from_nanos(1_700_000_000_123_456_789);
        events
            .events
            .push(Event::new("retry", at, every_value(), 2));
        events.events.push(Event::with_name("bare"));
        events.dropped_count = 3;
        links.links.push(Link::new(
            context(9, true, TraceState::NONE),
            vec![KeyValue::new("why", "follows")],
            1,
        ));
        links.dropped_count = 4;
    }
    SpanData {
        span_context: context(n, false, state),
        parent_span_id: if n == 0 {
            SpanId::INVALID
        } else {
            SpanId::from(n)
        },
        parent_span_is_remote: n == 2,
        span_kind: [
            SpanKind::Server,
            SpanKind::Client,
            SpanKind::Internal,
            SpanKind::Producer,
            SpanKind::Consumer,
        ][(n % 5) as usize]
            .clone(),
        name: Cow::Owned(format!("kvroute.span{n}")),
        start_time: UNIX_EPOCH + Duration::from_nanos(1_700_000_000_000_000_000 + n),
        end_time: UNIX_EPOCH + Duration::from_nanos(1_700_000_000_500_000_000 + n),
        attributes: if n == 3 { vec![] } else { every_value() },
        dropped_attributes_count: u32::try_from(n).unwrap_or(0),
        events,
        links,
        status: match n % 3 {
            0 => Status::Unset,
            1 => Status::Ok,
            _ => Status::error("answered 503"),
        },
        instrumentation_scope: scope.clone(),
    }
}

/// The official request for `spans`, its scopes in name order.
fn official(resource: &Resource, spans: Vec<SpanData>) -> ExportTraceServiceRequest {
    let mut resource_spans =
        group_spans_by_resource_and_scope(spans, &ResourceAttributesWithSchema::from(resource));
    for r in &mut resource_spans {
        r.scope_spans.sort_by(|a, b| {
            a.scope
                .as_ref()
                .map(|s| &s.name)
                .cmp(&b.scope.as_ref().map(|s| &s.name))
        });
    }
    ExportTraceServiceRequest { resource_spans }
}

fn ours(resource: &Resource, spans: &[SpanData]) -> ExportTraceServiceRequest {
    let bytes = export_request(&EncodedResource::new(resource), spans);
    let mut decoded = ExportTraceServiceRequest::decode(bytes.as_slice()).expect("valid OTLP");
    for r in &mut decoded.resource_spans {
        r.scope_spans.sort_by(|a, b| {
            a.scope
                .as_ref()
                .map(|s| &s.name)
                .cmp(&b.scope.as_ref().map(|s| &s.name))
        });
    }
    decoded
}

#[test]
fn a_batch_decodes_to_the_official_conversion() {
    let resource = Resource::builder_empty()
        .with_service_name("kvroute")
        .with_attributes([
            KeyValue::new("deployment", "test"),
            KeyValue::new("n", 3_i64),
        ])
        .with_schema_url([], "https://opentelemetry.io/schemas/1.30.0")
        .build();
    let router = InstrumentationScope::builder("kvroute").build();
    let other = InstrumentationScope::builder("other")
        .with_version("1.2")
        .with_schema_url("https://example.com/s")
        .with_attributes([KeyValue::new("scope.attr", 1_i64)])
        .build();
    let spans: Vec<SpanData> = (0..6)
        .map(|n| span(n, if n == 4 { &other } else { &router }))
        .collect();
    assert_eq!(ours(&resource, &spans), official(&resource, spans));
}

#[test]
fn an_empty_resource_and_batch_decode_too() {
    let resource = Resource::builder_empty().build();
    assert_eq!(ours(&resource, &[]), official(&resource, vec![]));
    let scope = InstrumentationScope::builder("kvroute").build();
    let one = vec![span(0, &scope)];
    assert_eq!(ours(&resource, &one), official(&resource, one));
}

/// A body of more than 127 bytes takes a two-byte length, of more than
/// 16 383 a three-byte one: the length moved in before it must not cut it.
#[test]
fn long_values_keep_their_lengths() {
    let resource = Resource::builder_empty().build();
    let scope = InstrumentationScope::builder("kvroute").build();
    let mut spans = Vec::new();
    for len in [127, 128, 16_383, 16_384, 70_000] {
        let mut s = span(3, &scope);
        s.attributes = vec![KeyValue::new("long", "x".repeat(len))];
        spans.push(s);
    }
    assert_eq!(ours(&resource, &spans), official(&resource, spans));
}
