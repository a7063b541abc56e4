//! The messages the picker sends Envoy, built from plain values: the
//! headers answer naming the endpoint, the body pieces, the pass-through
//! answers of the response phase, and the immediate answers (errors the
//! picker answers the client itself).

use envoy_types::pb::envoy::config::core::v3::header_value_option::HeaderAppendAction;
use envoy_types::pb::envoy::config::core::v3::{HeaderValue, HeaderValueOption};
use envoy_types::pb::envoy::r#type::v3::HttpStatus;
use envoy_types::pb::envoy::service::ext_proc::v3::body_mutation::Mutation;
use envoy_types::pb::envoy::service::ext_proc::v3::processing_response::Response;
use envoy_types::pb::envoy::service::ext_proc::v3::{
    BodyMutation, BodyResponse, CommonResponse, HeaderMutation, HeadersResponse, ImmediateResponse,
    ProcessingResponse, TrailersResponse,
};
use envoy_types::pb::google::protobuf::value::Kind;
use envoy_types::pb::google::protobuf::{Struct, Value};
use serde_json::json;

use super::body::pieces;
use super::subset::LB_NAMESPACE;
use crate::api::{ErrorKind, ProxyError};
use crate::dialect::Dialect;

/// The request header, and the `envoy.lb` metadata key, naming the
/// endpoint the request goes to.
pub const DESTINATION: &str = "x-gateway-destination-endpoint";

/// Seconds a shed request is told to wait before it retries (`retry-after`).
pub const RETRY_AFTER_SECS: u32 = 1;

/// A header Envoy sets on the request, replacing any value the client sent
/// (so a client cannot add a destination of its own).
fn overwrite(key: &str, value: &str) -> HeaderValueOption {
    HeaderValueOption {
        header: Some(HeaderValue {
            key: key.to_owned(),
            raw_value: value.as_bytes().to_vec(),
            ..HeaderValue::default()
        }),
        append_action: HeaderAppendAction::OverwriteIfExistsOrAdd as i32,
        ..HeaderValueOption::default()
    }
}

fn string_value(s: &str) -> Value {
    Value {
        kind: Some(Kind::StringValue(s.to_owned())),
    }
}

/// The answer to a request's headers once its endpoint is picked: the
/// destination header (and `extra` headers, such as the rank of a
/// multi-rank worker), the same endpoint in the `envoy.lb` dynamic
/// metadata, and `clear_route_cache` so Envoy routes on the new header.
pub fn routed(endpoint: &str, extra: &[(&str, String)]) -> ProcessingResponse {
    let mut set_headers = vec![overwrite(DESTINATION, endpoint)];
    set_headers.extend(extra.iter().map(|(k, v)| overwrite(k, v)));
    let mut lb = Struct::default();
    lb.fields
        .insert(DESTINATION.to_owned(), string_value(endpoint));
    let mut metadata = Struct::default();
    metadata.fields.insert(
        LB_NAMESPACE.to_owned(),
        Value {
            kind: Some(Kind::StructValue(lb)),
        },
    );
    ProcessingResponse {
        response: Some(Response::RequestHeaders(HeadersResponse {
            response: Some(CommonResponse {
                header_mutation: Some(HeaderMutation {
                    set_headers,
                    remove_headers: Vec::new(),
                }),
                clear_route_cache: true,
                ..CommonResponse::default()
            }),
        })),
        dynamic_metadata: Some(metadata),
        ..ProcessingResponse::default()
    }
}

/// Which body a piece belongs to.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Side {
    /// The request's, on its way to the worker.
    Request,
    /// The worker's answer, on its way to the client.
    Response,
}

/// `body` sent back as `streamed_response` pieces (see [`pieces`]).
pub fn body(side: Side, body: &[u8], end_of_stream: bool) -> Vec<ProcessingResponse> {
    pieces(body, end_of_stream)
        .into_iter()
        .map(|piece| {
            let answer = BodyResponse {
                response: Some(CommonResponse {
                    body_mutation: Some(BodyMutation {
                        mutation: Some(Mutation::StreamedResponse(piece)),
                    }),
                    ..CommonResponse::default()
                }),
            };
            let response = match side {
                Side::Request => Response::RequestBody(answer),
                Side::Response => Response::ResponseBody(answer),
            };
            ProcessingResponse {
                response: Some(response),
                ..ProcessingResponse::default()
            }
        })
        .collect()
}

/// The answer to the response's headers: nothing changed.
pub fn response_headers() -> ProcessingResponse {
    ProcessingResponse {
        response: Some(Response::ResponseHeaders(HeadersResponse {
            response: Some(CommonResponse::default()),
        })),
        ..ProcessingResponse::default()
    }
}

/// The answer to trailers: nothing changed.
pub fn trailers(side: Side) -> ProcessingResponse {
    let answer = TrailersResponse::default();
    let response = match side {
        Side::Request => Response::RequestTrailers(answer),
        Side::Response => Response::ResponseTrailers(answer),
    };
    ProcessingResponse {
        response: Some(response),
        ..ProcessingResponse::default()
    }
}

/// An answer the picker gives the client itself, instead of a worker's.
pub fn immediate(status: u16, body: Vec<u8>, headers: &[(&str, &str)]) -> ProcessingResponse {
    ProcessingResponse {
        response: Some(Response::ImmediateResponse(ImmediateResponse {
            status: Some(HttpStatus {
                code: i32::from(status),
            }),
            headers: Some(HeaderMutation {
                set_headers: headers.iter().map(|(k, v)| overwrite(k, v)).collect(),
                remove_headers: Vec::new(),
            }),
            body,
            details: format!("kvroute_epp_{status}"),
            ..ImmediateResponse::default()
        })),
        ..ProcessingResponse::default()
    }
}

/// The HTTP status the picker answers an error with: as `kvroute serve`
/// answers it, except that shedding (every eligible rank over its busy
/// thresholds, no room or no more time in the queue) is 429, as the
/// endpoint picker protocol asks for a request that should be dropped.
pub fn status_of(kind: ErrorKind) -> u16 {
    match kind {
        ErrorKind::Overloaded | ErrorKind::QueueTimeout => 429,
        other => other.status().as_u16(),
    }
}

/// The immediate answer to an error: OpenAI's error body with the
/// picker's status, and `retry-after` on a shed request.
pub fn for_error(error: &ProxyError, dialect: Dialect) -> ProcessingResponse {
    let status = status_of(error.kind());
    // The body `kvroute serve` answers the same error with, in the API's
    // shape, its code the picker's status where the two differ.
    let mut body = error.body_in(dialect);
    if status != error.status().as_u16() {
        if let Some(code) = body.pointer_mut("/error/code") {
            *code = json!(status);
        }
    }
    immediate_error(status, &body)
}

/// [`for_error`] for an error of `kind` that says `message`.
pub fn for_kind(kind: ErrorKind, message: &str) -> ProcessingResponse {
    let status = status_of(kind);
    let body = json!({"error": {
        "message": message,
        "type": kind.openai_type(),
        "param": null,
        "code": status,
    }});
    immediate_error(status, &body)
}

/// The immediate answer of an error `body` with `status`, and
/// `retry-after` on a shed request.
fn immediate_error(status: u16, body: &serde_json::Value) -> ProcessingResponse {
    let retry = RETRY_AFTER_SECS.to_string();
    let mut headers = vec![("content-type", "application/json")];
    if status == 429 {
        headers.push(("retry-after", retry.as_str()));
    }
    immediate(status, body.to_string().into_bytes(), &headers)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn header(option: &HeaderValueOption) -> (&str, &[u8], i32) {
        let h = option.header.as_ref().expect("a header");
        (h.key.as_str(), h.raw_value.as_slice(), option.append_action)
    }

    #[test]
    fn the_routed_answer_names_the_endpoint_in_the_header_and_the_metadata() {
        let answer = routed("10.0.0.1:8100", &[("x-data-parallel-rank", "1".into())]);
        let Some(Response::RequestHeaders(h)) = &answer.response else {
            panic!("a headers answer: {answer:?}");
        };
        let common = h.response.as_ref().expect("common");
        assert!(common.clear_route_cache);
        let set = &common
            .header_mutation
            .as_ref()
            .expect("mutation")
            .set_headers;
        let overwrite = HeaderAppendAction::OverwriteIfExistsOrAdd as i32;
        assert_eq!(
            header(&set[0]),
            (DESTINATION, &b"10.0.0.1:8100"[..], overwrite)
        );
        assert_eq!(
            header(&set[1]),
            ("x-data-parallel-rank", &b"1"[..], overwrite)
        );
        let md = answer.dynamic_metadata.as_ref().expect("metadata");
        let Some(Kind::StructValue(lb)) = &md.fields[LB_NAMESPACE].kind else {
            panic!("envoy.lb is a struct");
        };
        assert_eq!(lb.fields[DESTINATION], string_value("10.0.0.1:8100"));
    }

    #[test]
    fn shedding_is_a_429_with_retry_after_and_no_worker_a_503() {
        let shed = for_error(&ProxyError::Overloaded("busy".into()), Dialect::OpenAi);
        let Some(Response::ImmediateResponse(r)) = &shed.response else {
            panic!("immediate");
        };
        assert_eq!(r.status.as_ref().map(|s| s.code), Some(429));
        let set = &r.headers.as_ref().expect("headers").set_headers;
        assert!(set
            .iter()
            .any(|o| header(o).0 == "retry-after" && header(o).1 == b"1"));
        let doc: serde_json::Value = serde_json::from_slice(&r.body).expect("json");
        assert_eq!(doc["error"]["code"], 429);
        assert_eq!(doc["error"]["type"], "overloaded");
        let none = for_error(&ProxyError::NoWorkers, Dialect::OpenAi);
        let Some(Response::ImmediateResponse(r)) = &none.response else {
            panic!("immediate");
        };
        assert_eq!(r.status.as_ref().map(|s| s.code), Some(503));
        let set = &r.headers.as_ref().expect("headers").set_headers;
        assert!(!set.iter().any(|o| header(o).0 == "retry-after"));
        assert_eq!(status_of(ErrorKind::QueueTimeout), 429);
        assert_eq!(status_of(ErrorKind::BadRequest), 400);
        assert_eq!(status_of(ErrorKind::TooLarge), 413);
    }

    #[test]
    fn body_pieces_go_to_their_side() {
        let request = body(Side::Request, &[1; 70_000], true);
        assert_eq!(request.len(), 2);
        assert!(matches!(
            request[0].response,
            Some(Response::RequestBody(_))
        ));
        let response = body(Side::Response, b"data: x\n\n", false);
        assert!(matches!(
            response[0].response,
            Some(Response::ResponseBody(_))
        ));
    }
}
