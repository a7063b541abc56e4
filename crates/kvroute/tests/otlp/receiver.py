#!/usr/bin/env python3
"""An OTLP/gRPC trace receiver for kvroute's tracing tests, built from the
official OpenTelemetry protos (PyPI's `opentelemetry-proto`) over `grpcio`,
sharing no code with kvroute.

    receiver.py --out FILE [--port PORT]

Listens on PORT of 127.0.0.1 (default: a free one), prints `listening PORT`
once ready, and appends every span it is sent to FILE as one JSON line: its
service, its resource's attributes, name, kind, ids (lower-case hex;
`parent_span_id` empty for a root), attributes and status. Runs until
killed. The tracing tests start one per test; `scripts/real-engines start`
starts one for the real engines' spans (it runs in the engines' Python,
whose OpenTelemetry exporter brings `grpcio` and `opentelemetry-proto`).
"""

import argparse
import json
import sys
import threading
from concurrent import futures

import grpc
from opentelemetry.proto.collector.trace.v1 import trace_service_pb2, trace_service_pb2_grpc


def value_of(any_value):
    kind = any_value.WhichOneof("value")
    return getattr(any_value, kind) if kind else None


def attributes_of(pairs):
    return {kv.key: value_of(kv.value) for kv in pairs}


class Receiver(trace_service_pb2_grpc.TraceServiceServicer):
    def __init__(self, out):
        self.out = out
        self.lock = threading.Lock()

    def Export(self, request, context):
        lines = []
        for resource_spans in request.resource_spans:
            resource = attributes_of(resource_spans.resource.attributes)
            for scope_spans in resource_spans.scope_spans:
                for span in scope_spans.spans:
                    lines.append(json.dumps({
                        "service": resource.get("service.name"),
                        "resource": resource,
                        "name": span.name,
                        "kind": span.kind,
                        "trace_id": span.trace_id.hex(),
                        "span_id": span.span_id.hex(),
                        "parent_span_id": span.parent_span_id.hex(),
                        "attributes": attributes_of(span.attributes),
                        "status_code": span.status.code,
                    }))
        with self.lock, open(self.out, "a", encoding="utf-8") as f:
            for line in lines:
                f.write(line + "\n")
        return trace_service_pb2.ExportTraceServiceResponse()


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--out", required=True)
    p.add_argument("--port", type=int, default=0)
    args = p.parse_args()
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=4))
    trace_service_pb2_grpc.add_TraceServiceServicer_to_server(Receiver(args.out), server)
    port = server.add_insecure_port(f"127.0.0.1:{args.port}")
    if port == 0:
        sys.exit(f"receiver.py: cannot listen on 127.0.0.1:{args.port}")
    server.start()
    print(f"listening {port}", flush=True)
    server.wait_for_termination()


if __name__ == "__main__":
    sys.exit(main())
