#!/usr/bin/env python3
"""An ext_proc client for kvroute's endpoint-picker tests, written against
Envoy's own protocol with code kvroute does not share: the ext_proc v3
messages of PyPI's `envoy-data-plane` (betterproto2), sent over `grpcio`,
and `grpcio-health-checking` for health.

    client.py process --target HOST:PORT --body FILE [--chunks 7,100] ...
    client.py health --target HOST:PORT --service NAME [--service NAME]...

`process` plays Envoy in FULL_DUPLEX_STREAMED mode: the request headers,
then the body in chunks (cut at the given sizes, the rest last), then, once
the picker has answered and echoed the body, the response phase (headers
and an SSE body in three chunks) when `--response sse`. It checks the
protocol's order itself and prints one JSON object: what the picker
answered (`routed`, `immediate` or `grpc_error`), with the destination
header, the `envoy.lb` metadata, the echoed body's pieces and whether it
came back byte for byte. `health` prints each service's status. Every call
has a deadline, so a broken picker fails the test instead of hanging it.
"""

import argparse
import json
import queue
import ssl
import sys
import threading

import betterproto2
import grpc
from envoy_data_plane.envoy.config.core import v3 as core
from envoy_data_plane.envoy.extensions.filters.http.ext_proc import v3 as filter_v3
from envoy_data_plane.envoy.service.ext_proc import v3 as ep
from envoy_data_plane.google import protobuf as pb

DEADLINE_SECS = 30
FULL_DUPLEX = filter_v3.ProcessingModeBodySendMode.FULL_DUPLEX_STREAMED
BUFFERED = filter_v3.ProcessingModeBodySendMode.BUFFERED
SSE_USAGE = (
    b'data: {"choices":[{"index":0,"text":"hi"}]}\n\n'
    b'data: {"choices":[],"usage":{"prompt_tokens":40,"completion_tokens":1,'
    b'"prompt_tokens_details":{"cached_tokens":%d}}}\n\n'
    b"data: [DONE]\n\n"
)


def open_channel(target, tls):
    if not tls:
        return grpc.insecure_channel(target)
    host, port = target.rsplit(":", 1)
    # The picker's self-signed certificate, trusted as its own root: what
    # the test checks is that the port speaks TLS with it, and names
    # localhost.
    pem = ssl.get_server_certificate((host, int(port))).encode()
    credentials = grpc.ssl_channel_credentials(root_certificates=pem)
    options = [("grpc.ssl_target_name_override", "localhost")]
    return grpc.secure_channel(target, credentials, options=options)


def header_map(pairs):
    return core.HeaderMap(
        headers=[core.HeaderValue(key=k, raw_value=v.encode()) for k, v in pairs]
    )


def subset_metadata(subset, as_list):
    if subset is None:
        return None
    if as_list:
        items = [s for s in subset.split(",") if s]
        value = pb.Value(list_value=pb.ListValue(values=[pb.Value(string_value=s) for s in items]))
    else:
        value = pb.Value(string_value=subset)
    hint = pb.Struct(fields={"x-gateway-destination-endpoint-subset": value})
    return core.Metadata(filter_metadata={"envoy.lb.subset_hint": hint})


def served_metadata(endpoint):
    lb = pb.Struct(fields={"x-gateway-destination-endpoint-served": pb.Value(string_value=endpoint)})
    return core.Metadata(filter_metadata={"envoy.lb": lb})


def cut(body, sizes):
    pieces, at = [], 0
    for size in sizes:
        pieces.append(body[at : at + size])
        at += size
    pieces.append(body[at:])
    return pieces


def header_values(mutation):
    out = {}
    for option in (mutation.set_headers if mutation else []):
        h = option.header
        out[h.key] = (h.raw_value or h.value.encode()).decode()
        out[h.key + ":append_action"] = int(option.append_action)
    return out


class Stream:
    """One Process stream: messages out through a queue, answers in."""

    def __init__(self, channel):
        self.outgoing = queue.Queue()
        stub = ep.ExternalProcessorSyncStub(channel)
        # The stub takes no deadline: closing the channel cancels the call.
        self.watchdog = threading.Timer(DEADLINE_SECS, channel.close)
        self.watchdog.daemon = True
        self.watchdog.start()
        self.answers = stub.process(self._messages())

    def _messages(self):
        while True:
            message = self.outgoing.get()
            if message is None:
                return
            yield message

    def send(self, message):
        self.outgoing.put(message)

    def close(self):
        self.outgoing.put(None)

    def next(self):
        return next(self.answers)


def request_phase(stream, args, body):
    mode = BUFFERED if args.mode == "buffered" else FULL_DUPLEX
    config = ep.ProtocolConfiguration(
        request_body_mode=mode,
        response_body_mode=FULL_DUPLEX,
        send_body_without_waiting_for_header_response=True,
    )
    pairs = [(":method", "POST"), (":path", args.path), ("content-type", "application/json")]
    if args.request_id:
        pairs.append(("x-request-id", args.request_id))
    for header in args.header:
        name, _, value = header.partition(":")
        pairs.append((name.strip().lower(), value.strip()))
    stream.send(
        ep.ProcessingRequest(
            request_headers=ep.HttpHeaders(headers=header_map(pairs), end_of_stream=False),
            metadata_context=subset_metadata(args.subset, args.subset_list),
            protocol_config=config,
        )
    )
    pieces = cut(body, [int(c) for c in args.chunks.split(",") if c])
    for i, piece in enumerate(pieces):
        last = i == len(pieces) - 1 and not args.no_end
        stream.send(ep.ProcessingRequest(request_body=ep.HttpBody(body=piece, end_of_stream=last)))


def read_request_answers(stream, result, body):
    """The headers' answer, then the body's pieces until end_of_stream."""
    first = stream.next()
    kind, answer = betterproto2.which_one_of(first, "response")
    if kind == "immediate_response":
        result["kind"] = "immediate"
        result["status"] = int(answer.status.code)
        result["headers"] = header_values(answer.headers)
        result["body"] = answer.body.decode()
        return False
    if kind != "request_headers":
        raise AssertionError(f"the first answer must be request_headers, got {kind}")
    common = answer.response
    result["kind"] = "routed"
    result["clear_route_cache"] = bool(common.clear_route_cache)
    result["headers"] = header_values(common.header_mutation)
    lb = first.dynamic_metadata.fields["envoy.lb"].struct_value
    result["metadata_endpoint"] = lb.fields["x-gateway-destination-endpoint"].string_value
    echoed, sizes, ends = b"", [], []
    while True:
        kind, answer = betterproto2.which_one_of(stream.next(), "response")
        if kind != "request_body":
            raise AssertionError(f"the body's answers must be request_body, got {kind}")
        piece = answer.response.body_mutation.streamed_response
        echoed += piece.body
        sizes.append(len(piece.body))
        ends.append(bool(piece.end_of_stream))
        if piece.end_of_stream:
            break
    result["echo_sizes"] = sizes
    result["echo_ends"] = ends
    result["echo_equal"] = echoed == body
    return True


def response_phase(stream, args, result):
    """Response headers and an SSE body in three chunks; each echoed as is."""
    endpoint = args.served or result["metadata_endpoint"]
    pairs = [(":status", "200"), ("content-type", "text/event-stream")]
    stream.send(
        ep.ProcessingRequest(
            response_headers=ep.HttpHeaders(headers=header_map(pairs), end_of_stream=False),
            metadata_context=served_metadata(endpoint),
        )
    )
    kind, _ = betterproto2.which_one_of(stream.next(), "response")
    if kind != "response_headers":
        raise AssertionError(f"expected response_headers, got {kind}")
    sse = SSE_USAGE % args.cached_tokens
    thirds = [sse[: len(sse) // 3], sse[len(sse) // 3 : 2 * len(sse) // 3], sse[2 * len(sse) // 3 :]]
    echoed = b""
    for i, piece in enumerate(thirds):
        last = i == len(thirds) - 1
        stream.send(ep.ProcessingRequest(response_body=ep.HttpBody(body=piece, end_of_stream=last)))
        while True:
            kind, answer = betterproto2.which_one_of(stream.next(), "response")
            if kind != "response_body":
                raise AssertionError(f"expected response_body, got {kind}")
            streamed = answer.response.body_mutation.streamed_response
            echoed += streamed.body
            if streamed.end_of_stream or len(echoed) == sum(len(t) for t in thirds[: i + 1]):
                break
    result["response_echo_equal"] = echoed == sse


def process(args):
    with open(args.body, "rb") as f:
        body = f.read()
    result = {}
    channel = open_channel(args.target, args.tls)
    stream = Stream(channel)
    try:
        request_phase(stream, args, body)
        if read_request_answers(stream, result, body) and args.response == "sse":
            response_phase(stream, args, result)
        if args.hold_secs:
            # The request stays in flight (as if the worker were still
            # answering) until the stream closes.
            print(json.dumps(result), flush=True)
            threading.Event().wait(args.hold_secs)
        stream.close()
        result["stream_ended"] = next(stream.answers, None) is None
    except grpc.RpcError as e:
        result = {"kind": "grpc_error", "code": e.code().name, "details": e.details()}
    finally:
        stream.close()
        stream.watchdog.cancel()
        channel.close()
    print(json.dumps(result))


def health(args):
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    channel = open_channel(args.target, args.tls)
    stub = health_pb2_grpc.HealthStub(channel)
    statuses = {}
    for service in args.service:
        try:
            reply = stub.Check(health_pb2.HealthCheckRequest(service=service), timeout=DEADLINE_SECS)
            statuses[service] = health_pb2.HealthCheckResponse.ServingStatus.Name(reply.status)
        except grpc.RpcError as e:
            statuses[service] = e.code().name
    channel.close()
    print(json.dumps(statuses))


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    commands = parser.add_subparsers(dest="command", required=True)
    p = commands.add_parser("process")
    p.add_argument("--target", required=True)
    p.add_argument("--tls", action="store_true")
    p.add_argument("--body", required=True, help="a file holding the request body")
    p.add_argument("--path", default="/v1/completions")
    p.add_argument("--chunks", default="", help="sizes of the first chunks; the rest is the last")
    p.add_argument("--subset", help="the subset hint, comma-separated")
    p.add_argument("--subset-list", action="store_true", help="send the hint as a list of strings")
    p.add_argument("--mode", choices=["full-duplex", "buffered"], default="full-duplex")
    p.add_argument("--response", choices=["none", "sse"], default="none")
    p.add_argument("--served", help="the served endpoint to report (default: the one picked)")
    p.add_argument("--cached-tokens", type=int, default=0)
    p.add_argument("--request-id")
    p.add_argument("--header", action="append", default=[], help="NAME: VALUE, another request header")
    p.add_argument("--hold-secs", type=float, default=0, help="keep the stream open this long")
    p.add_argument("--no-end", action="store_true", help="never end the request body (a stalled upload)")
    h = commands.add_parser("health")
    h.add_argument("--target", required=True)
    h.add_argument("--tls", action="store_true")
    h.add_argument("--service", action="append", default=[])
    args = parser.parse_args()
    {"process": process, "health": health}[args.command](args)


if __name__ == "__main__":
    try:
        main()
    except AssertionError as e:
        print(json.dumps({"kind": "protocol_violation", "error": str(e)}))
        sys.exit(0)
