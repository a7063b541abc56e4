#!/usr/bin/env python3
"""A small loopback data plane for kvroute's endpoint-picker tests: what
Envoy's ext_proc filter and an ORIGINAL_DST cluster do, in a few lines.

    dataplane.py --epp HOST:PORT [--fail-open ENDPOINT,...]

For each HTTP request it opens one ext_proc stream to the picker (the
messages of `client.py`: FULL_DUPLEX_STREAMED, the request headers with
the client's own, the body), forwards the echoed body and the client's
headers to the endpoint the picker named in
`x-gateway-destination-endpoint`, relays the answer to the client as it
comes, and feeds the response phase (headers, then each body chunk, then
the end) back to the picker, so its load, TTFT and accuracy work as in
`kvroute serve`. An ImmediateResponse (its status, headers and body) is
the client's answer. With
`--fail-open`, a picker that cannot be reached sends the request to the
next of these endpoints in turn (Envoy's FailOpen); without it the client
gets a 503 (FailClose). It prints `listening on PORT` once it serves.
"""

import argparse
import http.client
import http.server
import itertools
import os
import sys
import threading

import betterproto2
import grpc

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from client import FULL_DUPLEX, Stream, ep, header_map, served_metadata  # noqa: E402

CHUNK = 16 * 1024

# Hop-by-hop headers, and those the data plane sets itself: never passed on.
NOT_PASSED = {
    "connection", "keep-alive", "proxy-connection", "transfer-encoding", "te",
    "trailer", "upgrade", "host", "content-length",
}


def passed_on(headers):
    """The client's headers a proxy passes on (lower-cased names)."""
    return [(k.lower(), v) for k, v in headers.items() if k.lower() not in NOT_PASSED]


class Picker:
    """The picker's channel (one, shared) and the fallback endpoints."""

    def __init__(self, target, fallback):
        self.channel = grpc.insecure_channel(target)
        self.fallback = itertools.cycle(fallback) if fallback else None
        self.lock = threading.Lock()

    def next_fallback(self):
        if self.fallback is None:
            return None
        with self.lock:
            return next(self.fallback)


def pick(stream, path, body, headers):
    """The request phase (the client's `headers` with the pseudo-headers):
    the endpoint named, or (status, body) of an ImmediateResponse."""
    config = ep.ProtocolConfiguration(
        request_body_mode=FULL_DUPLEX,
        response_body_mode=FULL_DUPLEX,
        send_body_without_waiting_for_header_response=True,
    )
    pairs = [(":method", "POST"), (":path", path)] + headers
    if not any(k == "content-type" for k, _ in headers):
        pairs.append(("content-type", "application/json"))
    stream.send(
        ep.ProcessingRequest(
            request_headers=ep.HttpHeaders(headers=header_map(pairs), end_of_stream=False),
            protocol_config=config,
        )
    )
    stream.send(ep.ProcessingRequest(request_body=ep.HttpBody(body=body, end_of_stream=True)))
    kind, answer = betterproto2.which_one_of(stream.next(), "response")
    if kind == "immediate_response":
        headers = [
            (o.header.key, (o.header.raw_value or o.header.value.encode()).decode())
            for o in (answer.headers.set_headers if answer.headers else [])
        ]
        return None, (int(answer.status.code), answer.body, headers)
    endpoint = None
    for option in answer.response.header_mutation.set_headers:
        if option.header.key == "x-gateway-destination-endpoint":
            endpoint = (option.header.raw_value or option.header.value.encode()).decode()
    echoed = b""
    while True:
        _, answer = betterproto2.which_one_of(stream.next(), "response")
        piece = answer.response.body_mutation.streamed_response
        echoed += piece.body
        if piece.end_of_stream:
            break
    if echoed != body:
        raise RuntimeError("the picker did not echo the body")
    return endpoint, None


def finish(stream):
    """Ends a picker stream and its watchdog: a watchdog left running would
    close the channel every stream shares when its deadline came."""
    stream.close()
    stream.watchdog.cancel()


def tell(stream, step):
    """Runs `step` on the picker's stream; a picker gone meanwhile (it
    restarted) is dropped, and the answer keeps flowing without it."""
    if stream is None:
        return None
    try:
        step(stream)
        return stream
    except (grpc.RpcError, StopIteration, ValueError):
        finish(stream)
        return None


class Handler(http.server.BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"

    def log_message(self, *args):
        pass

    def do_POST(self):
        body = self.rfile.read(int(self.headers.get("content-length", "0")))
        picker = self.server.picker
        stream = None
        try:
            stream = Stream(picker.channel)
            endpoint, immediate = pick(stream, self.path, body, passed_on(self.headers))
        except (grpc.RpcError, RuntimeError, StopIteration) as e:
            if stream is not None:
                finish(stream)
            stream, immediate = None, None
            endpoint = picker.next_fallback()
            if endpoint is None:
                return self.answer(503, b'{"error": "the endpoint picker is unavailable: %s"}' % str(e).encode(), [])
        if immediate is not None:
            finish(stream)
            return self.answer(*immediate)
        try:
            self.forward(endpoint, body, stream)
        finally:
            if stream is not None:
                finish(stream)

    def answer(self, status, body, headers):
        """The picker's immediate answer: its status, headers and body."""
        self.send_response(status)
        names = {k.lower() for k, _ in headers}
        for k, v in headers:
            self.send_header(k, v)
        if "content-type" not in names:
            self.send_header("content-type", "application/json")
        self.send_header("content-length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def forward(self, endpoint, body, stream):
        """The request to `endpoint`, its answer relayed chunk by chunk (and
        shown to the picker's response phase)."""
        host, port = endpoint.rsplit(":", 1)
        upstream = http.client.HTTPConnection(host, int(port), timeout=120)
        headers = dict(passed_on(self.headers))
        headers.setdefault("content-type", "application/json")
        upstream.request("POST", self.path, body=body, headers=headers)
        resp = upstream.getresponse()
        pairs = [(":status", str(resp.status)), ("content-type", resp.getheader("content-type", ""))]
        stream = tell(stream, lambda s: s.send(
            ep.ProcessingRequest(
                response_headers=ep.HttpHeaders(headers=header_map(pairs), end_of_stream=False),
                metadata_context=served_metadata(endpoint),
            )
        ) or s.next())
        self.send_response(resp.status)
        self.send_header("content-type", resp.getheader("content-type", "application/json"))
        # Which endpoint served it, for tests (Envoy's upstream host).
        self.send_header("x-dataplane-endpoint", endpoint)
        self.send_header("transfer-encoding", "chunked")
        self.end_headers()
        while True:
            chunk = resp.read1(CHUNK)
            body = ep.HttpBody(body=chunk, end_of_stream=not chunk)
            if chunk:
                self.wfile.write(b"%x\r\n%s\r\n" % (len(chunk), chunk))
                self.wfile.flush()
                stream = tell(stream, lambda s: s.send(ep.ProcessingRequest(response_body=body)))
                continue
            # As Envoy does, the client's answer ends once the picker has
            # answered its end: what the picker learns from the answer (a
            # response id, the usage) is known before the client can act on it.
            stream = tell(stream, lambda s: s.send(ep.ProcessingRequest(response_body=body)) or through_end(s))
            self.wfile.write(b"0\r\n\r\n")
            self.wfile.flush()
            break
        upstream.close()


def through_end(stream):
    """Reads the picker's answers to the response body up to the one that
    ends it."""
    while True:
        kind, answer = betterproto2.which_one_of(stream.next(), "response")
        if kind != "response_body":
            continue
        if answer.response.body_mutation.streamed_response.end_of_stream:
            return


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--epp", required=True, help="the picker's ext_proc HOST:PORT (plaintext)")
    parser.add_argument("--fail-open", default="", help="endpoints to use when the picker is unavailable")
    args = parser.parse_args()
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    server.daemon_threads = True
    server.picker = Picker(args.epp, [e for e in args.fail_open.split(",") if e])
    print(f"listening on {server.server_address[1]}", flush=True)
    server.serve_forever()


if __name__ == "__main__":
    main()
