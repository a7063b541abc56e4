//! One ext_proc stream as plain data: which message may come next, what
//! each one means, and the request body gathered up to its bound. No
//! sockets and no clock: the service feeds it the messages it reads and
//! acts on what it says ([`Input`]).
//!
//! The order is the protocol's: the request's headers, its body (chunks
//! until `end_of_stream`, or trailers), then the response's headers, body
//! and trailers. A request whose headers end the stream (a body-less GET)
//! is whole at once. Anything else is a broken stream, refused with
//! `FAILED_PRECONDITION`, as is a processing mode the picker cannot work in
//! ([`super::mode`]).

use envoy_types::pb::envoy::config::core::v3::{HeaderMap, Metadata};
use envoy_types::pb::envoy::service::ext_proc::v3::processing_request::Request;
use envoy_types::pb::envoy::service::ext_proc::v3::ProcessingRequest;

use axum::body::Bytes;

use super::mode::{self, ModeError};
use super::subset::{served_endpoint, Subset};
use crate::bodies::{BodyRefusal, BodyRules, Gathering};
use crate::budget::Share;

/// What routing reads of a request's headers and metadata.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct RequestHead {
    /// `:path` without its query.
    pub path: String,
    /// The client's headers (pseudo-headers aside; at most
    /// [`MAX_HEADERS`], each a valid name and value): what the router reads
    /// of a request's sender (`x-request-id`, the session, priority and
    /// tenant headers, the API key) at either door.
    pub headers: axum::http::HeaderMap,
    /// The gateway's subset hint (`None`: any endpoint).
    pub subset: Option<Subset>,
}

/// Client headers kept per request at most (Envoy's own default limit is
/// 100); the rest are ignored.
pub const MAX_HEADERS: usize = 256;

/// A request whose body has all arrived.
#[derive(Debug, Default, PartialEq, Eq)]
pub struct WholeRequest {
    /// Its head.
    pub head: RequestHead,
    /// Its body.
    pub body: Bytes,
    /// The request has a body (its headers did not end the stream), so
    /// the body goes back to Envoy after the headers' answer.
    pub has_body: bool,
    /// The body ended with trailers, which are answered after it.
    pub trailers: bool,
}

/// The head of the worker's answer.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct ResponseHead {
    /// `:status`, when Envoy sent one that parses.
    pub status: Option<u16>,
    /// `content-type: text/event-stream`.
    pub sse: bool,
    /// The endpoint the gateway says served the request.
    pub served: Option<String>,
    /// The answer has no body.
    pub end_of_stream: bool,
}

/// What a message means for the stream.
#[derive(Debug, PartialEq, Eq)]
pub enum Input {
    /// Part of the request was taken; nothing to answer yet.
    Buffered,
    /// The request is whole: pick its endpoint, then answer its headers
    /// and send its body back.
    Whole(WholeRequest),
    /// The body passed its size limit (413) or the memory budget (503):
    /// answer so and end the stream.
    Refused(BodyRefusal),
    /// The worker's answer begins.
    ResponseHead(ResponseHead),
    /// A piece of the worker's answer, to send on as it is.
    ResponseChunk {
        /// The bytes.
        body: Vec<u8>,
        /// The last piece.
        end_of_stream: bool,
    },
    /// The answer's trailers: it is over.
    ResponseTrailers,
}

/// Why a stream is refused.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum StreamError {
    /// Envoy's processing mode is not one the picker can work in.
    #[error(transparent)]
    Mode(#[from] ModeError),
    /// A message came out of the protocol's order.
    #[error("ext_proc message `{got}` out of order: expected {expected}")]
    OutOfOrder {
        /// The message that came.
        got: &'static str,
        /// What could have come.
        expected: &'static str,
    },
}

impl StreamError {
    /// The `reason` label of the metric counting refused streams.
    pub fn reason(&self) -> &'static str {
        match self {
            StreamError::Mode(_) => "processing_mode",
            StreamError::OutOfOrder { .. } => "out_of_order",
        }
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Phase {
    RequestHeaders,
    RequestBody,
    ResponseHeaders,
    ResponseBody,
    Done,
}

impl Phase {
    fn expected(self) -> &'static str {
        match self {
            Phase::RequestHeaders => "request_headers",
            Phase::RequestBody => "request_body or request_trailers",
            Phase::ResponseHeaders => "response_headers",
            Phase::ResponseBody => "response_body or response_trailers",
            Phase::Done => "nothing (the exchange is over)",
        }
    }
}

/// The state of one stream.
#[derive(Debug)]
pub struct Exchange {
    phase: Phase,
    head: RequestHead,
    body: Option<Gathering>,
    rules: BodyRules,
    started: std::time::Instant,
    /// The whole body's share of the memory budget, until taken.
    share: Share,
}

impl Exchange {
    /// A stream opened at `started` that has seen nothing yet, whose
    /// request body is gathered under `rules` (its size, its time from
    /// `started` and the memory budget).
    pub fn new(rules: BodyRules, started: std::time::Instant) -> Self {
        Exchange {
            phase: Phase::RequestHeaders,
            head: RequestHead::default(),
            body: None,
            rules,
            started,
            share: Share::unbounded(),
        }
    }

    /// While the request body is arriving: when it must be whole.
    pub fn body_deadline(&self) -> Option<std::time::Instant> {
        match (self.phase, &self.body) {
            (Phase::RequestBody, Some(body)) => Some(body.deadline()),
            _ => None,
        }
    }

    /// The refusal of a body that missed [`Exchange::body_deadline`]; the
    /// exchange is over.
    pub fn body_timed_out(&mut self) -> Option<BodyRefusal> {
        let refusal = self.body.as_ref().map(Gathering::timed_out);
        self.phase = Phase::Done;
        self.body = None;
        refusal
    }

    /// The share of the memory budget the whole body holds (keep it while
    /// the body is in use).
    pub fn take_share(&mut self) -> Share {
        std::mem::take(&mut self.share)
    }

    /// Takes the next message of the stream.
    pub fn accept(&mut self, message: ProcessingRequest) -> Result<Input, StreamError> {
        if let Some(config) = &message.protocol_config {
            mode::check(config)?;
        }
        let metadata = message.metadata_context.as_ref();
        let Some(request) = message.request else {
            return Ok(Input::Buffered);
        };
        match (self.phase, request) {
            (Phase::RequestHeaders, Request::RequestHeaders(h)) => {
                self.head = read_head(h.headers.as_ref(), metadata);
                if !h.end_of_stream {
                    self.phase = Phase::RequestBody;
                    self.body = Some(Gathering::new(&self.rules, self.started));
                    return Ok(Input::Buffered);
                }
                Ok(self.whole(false, false))
            }
            (Phase::RequestBody, Request::RequestBody(b)) => {
                if self.head.subset.is_none() {
                    self.head.subset = Subset::from_metadata(metadata);
                }
                let pushed = self.body.as_mut().map_or(Ok(()), |g| g.push(&b.body));
                if let Err(e) = pushed {
                    self.phase = Phase::Done;
                    self.body = None;
                    return Ok(Input::Refused(e));
                }
                if !b.end_of_stream {
                    return Ok(Input::Buffered);
                }
                Ok(self.whole(true, false))
            }
            (Phase::RequestBody, Request::RequestTrailers(_)) => Ok(self.whole(true, true)),
            (Phase::ResponseHeaders, Request::ResponseHeaders(h)) => {
                let head = read_response_head(h.headers.as_ref(), metadata, h.end_of_stream);
                self.phase = if h.end_of_stream {
                    Phase::Done
                } else {
                    Phase::ResponseBody
                };
                Ok(Input::ResponseHead(head))
            }
            (Phase::ResponseBody, Request::ResponseBody(b)) => {
                if b.end_of_stream {
                    self.phase = Phase::Done;
                }
                Ok(Input::ResponseChunk {
                    body: b.body,
                    end_of_stream: b.end_of_stream,
                })
            }
            (Phase::ResponseBody, Request::ResponseTrailers(_)) => {
                self.phase = Phase::Done;
                Ok(Input::ResponseTrailers)
            }
            (phase, other) => Err(StreamError::OutOfOrder {
                got: name_of(&other),
                expected: phase.expected(),
            }),
        }
    }

    /// The request is whole; from now on the response is expected.
    fn whole(&mut self, has_body: bool, trailers: bool) -> Input {
        self.phase = Phase::ResponseHeaders;
        let (body, share) = self
            .body
            .take()
            .map_or_else(|| (Bytes::new(), Share::unbounded()), Gathering::finish);
        self.share = share;
        Input::Whole(WholeRequest {
            head: std::mem::take(&mut self.head),
            body,
            has_body,
            trailers,
        })
    }

    /// Whether the exchange is over (the answer ended, or the request was
    /// refused).
    pub fn is_done(&self) -> bool {
        self.phase == Phase::Done
    }
}

/// The name of a message in the protocol.
fn name_of(request: &Request) -> &'static str {
    match request {
        Request::RequestHeaders(_) => "request_headers",
        Request::ResponseHeaders(_) => "response_headers",
        Request::RequestBody(_) => "request_body",
        Request::ResponseBody(_) => "response_body",
        Request::RequestTrailers(_) => "request_trailers",
        Request::ResponseTrailers(_) => "response_trailers",
    }
}

/// A header's value: `raw_value`, or `value` when that is empty (both are
/// in use); only values that are text.
fn header<'a>(headers: Option<&'a HeaderMap>, name: &str) -> Option<&'a str> {
    let h = headers?
        .headers
        .iter()
        .find(|h| h.key.eq_ignore_ascii_case(name))?;
    if h.raw_value.is_empty() {
        Some(h.value.as_str())
    } else {
        std::str::from_utf8(&h.raw_value).ok()
    }
}

fn read_head(headers: Option<&HeaderMap>, metadata: Option<&Metadata>) -> RequestHead {
    let path = header(headers, ":path").unwrap_or_default();
    let path = path.split_once('?').map_or(path, |(p, _)| p);
    RequestHead {
        path: path.to_owned(),
        headers: client_headers(headers),
        subset: Subset::from_metadata(metadata),
    }
}

/// The client's headers in `headers`, pseudo-headers (`:path`, …) aside,
/// at most [`MAX_HEADERS`]; a header whose name or value HTTP would not
/// carry is left out.
fn client_headers(headers: Option<&HeaderMap>) -> axum::http::HeaderMap {
    let mut out = axum::http::HeaderMap::new();
    let pairs = headers.map_or(&[][..], |h| h.headers.as_slice());
    for h in pairs
        .iter()
        .filter(|h| !h.key.starts_with(':'))
        .take(MAX_HEADERS)
    {
        let value = if h.raw_value.is_empty() {
            axum::http::HeaderValue::from_str(&h.value).ok()
        } else {
            axum::http::HeaderValue::from_bytes(&h.raw_value).ok()
        };
        if let (Ok(name), Some(value)) =
            (axum::http::HeaderName::from_bytes(h.key.as_bytes()), value)
        {
            out.append(name, value);
        }
    }
    out
}

fn read_response_head(
    headers: Option<&HeaderMap>,
    metadata: Option<&Metadata>,
    end_of_stream: bool,
) -> ResponseHead {
    ResponseHead {
        status: header(headers, ":status").and_then(|s| s.trim().parse().ok()),
        sse: header(headers, "content-type")
            .is_some_and(|ct| ct.trim_start().starts_with("text/event-stream")),
        served: served_endpoint(metadata),
        end_of_stream,
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::bodies::BodyLimits;
    use envoy_types::pb::envoy::config::core::v3::HeaderValue;
    use envoy_types::pb::envoy::extensions::filters::http::ext_proc::v3::processing_mode::BodySendMode;
    use envoy_types::pb::envoy::service::ext_proc::v3::{
        HttpBody, HttpHeaders, HttpTrailers, ProtocolConfiguration,
    };

    fn rules(max_bytes: usize) -> BodyRules {
        let limits = BodyLimits::default();
        BodyRules {
            max_bytes,
            limits,
            budget: limits.budget(),
        }
    }

    fn headers(pairs: &[(&str, &str)], end_of_stream: bool) -> HttpHeaders {
        HttpHeaders {
            headers: Some(HeaderMap {
                headers: pairs
                    .iter()
                    .enumerate()
                    .map(|(i, (k, v))| HeaderValue {
                        key: (*k).to_owned(),
                        // Both spellings Envoy uses.
                        value: if i % 2 == 0 {
                            (*v).to_owned()
                        } else {
                            String::new()
                        },
                        raw_value: if i % 2 == 0 {
                            Vec::new()
                        } else {
                            v.as_bytes().to_vec()
                        },
                    })
                    .collect(),
            }),
            end_of_stream,
            ..HttpHeaders::default()
        }
    }

    fn message(request: Request) -> ProcessingRequest {
        ProcessingRequest {
            request: Some(request),
            ..ProcessingRequest::default()
        }
    }

    fn chunk(bytes: &[u8], end_of_stream: bool) -> Request {
        Request::RequestBody(HttpBody {
            body: bytes.to_vec(),
            end_of_stream,
            ..HttpBody::default()
        })
    }

    #[test]
    fn a_body_in_chunks_is_whole_at_its_end_with_the_head_read() {
        let mut x = Exchange::new(rules(1 << 20), std::time::Instant::now());
        let head = headers(
            &[
                (":path", "/v1/completions?x=1"),
                ("x-request-id", "r-1"),
                (":method", "POST"),
            ],
            false,
        );
        assert_eq!(
            x.accept(message(Request::RequestHeaders(head))),
            Ok(Input::Buffered)
        );
        assert_eq!(
            x.accept(message(chunk(b"{\"prompt\":", false))),
            Ok(Input::Buffered)
        );
        let Ok(Input::Whole(whole)) = x.accept(message(chunk(b"[1,2]}", true))) else {
            panic!("whole");
        };
        assert_eq!(&whole.body[..], b"{\"prompt\":[1,2]}");
        assert_eq!(whole.head.path, "/v1/completions");
        assert_eq!(
            whole.head.headers.get("x-request-id").map(|v| v.as_bytes()),
            Some(&b"r-1"[..])
        );
        assert!(whole.has_body && !whole.trailers && whole.head.subset.is_none());
        let response = headers(
            &[(":status", "200"), ("content-type", "text/event-stream")],
            false,
        );
        let Ok(Input::ResponseHead(h)) = x.accept(message(Request::ResponseHeaders(response)))
        else {
            panic!("response head");
        };
        assert_eq!((h.status, h.sse, h.end_of_stream), (Some(200), true, false));
        let body = Request::ResponseBody(HttpBody {
            body: b"data: x\n\n".to_vec(),
            end_of_stream: true,
            ..HttpBody::default()
        });
        assert!(matches!(
            x.accept(message(body)),
            Ok(Input::ResponseChunk {
                end_of_stream: true,
                ..
            })
        ));
        assert!(x.is_done());
    }

    #[test]
    fn headers_that_end_the_stream_are_a_whole_request_without_a_body() {
        let mut x = Exchange::new(rules(16), std::time::Instant::now());
        let get = headers(&[(":path", "/v1/models")], true);
        let Ok(Input::Whole(whole)) = x.accept(message(Request::RequestHeaders(get))) else {
            panic!("whole");
        };
        assert!(!whole.has_body && whole.body.is_empty());
        let done = headers(&[(":status", "200")], true);
        assert!(matches!(
            x.accept(message(Request::ResponseHeaders(done))),
            Ok(Input::ResponseHead(ResponseHead {
                end_of_stream: true,
                ..
            }))
        ));
        assert!(x.is_done());
    }

    #[test]
    fn trailers_end_a_body_and_a_body_past_the_bound_is_too_large() {
        let mut x = Exchange::new(rules(4), std::time::Instant::now());
        let head = headers(&[(":path", "/v1/completions")], false);
        x.accept(message(Request::RequestHeaders(head.clone())))
            .expect("headers");
        x.accept(message(chunk(b"abcd", false))).expect("a chunk");
        let trailers = Request::RequestTrailers(HttpTrailers::default());
        let Ok(Input::Whole(whole)) = x.accept(message(trailers)) else {
            panic!("whole");
        };
        assert!(whole.trailers && &whole.body[..] == b"abcd");
        let mut x = Exchange::new(rules(4), std::time::Instant::now());
        x.accept(message(Request::RequestHeaders(head)))
            .expect("headers");
        assert_eq!(
            x.accept(message(chunk(b"abcde", false))),
            Ok(Input::Refused(BodyRefusal::TooLarge { limit: 4 }))
        );
        assert!(x.is_done());
    }

    #[test]
    fn messages_out_of_order_and_wrong_modes_are_refused() {
        let mut x = Exchange::new(rules(16), std::time::Instant::now());
        let e = x.accept(message(chunk(b"x", true))).expect_err("refused");
        assert_eq!(e.reason(), "out_of_order");
        assert!(e
            .to_string()
            .contains("`request_body` out of order: expected request_headers"));
        let mut x = Exchange::new(rules(16), std::time::Instant::now());
        let mut first = message(Request::RequestHeaders(headers(&[], false)));
        first.protocol_config = Some(ProtocolConfiguration {
            request_body_mode: BodySendMode::Buffered as i32,
            response_body_mode: BodySendMode::FullDuplexStreamed as i32,
            send_body_without_waiting_for_header_response: true,
        });
        let e = x.accept(first).expect_err("refused");
        assert_eq!(e.reason(), "processing_mode");
        assert!(e.to_string().contains("request_body_mode is BUFFERED"));
    }
}
