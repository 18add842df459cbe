"""A local OTLP/HTTP trace receiver for tests: decodes each export (protobuf
``ExportTraceServiceRequest``, what OpenTelemetry's OTLP/HTTP exporter sends) into plain spans."""

from __future__ import annotations

import gzip
import http.server
import threading
import time
from dataclasses import dataclass, field
from typing import Any


@dataclass
class Span:
    """One received span, ids as hex."""

    trace_id: str
    span_id: str
    parent_id: str
    name: str
    start_ns: int
    end_ns: int
    attributes: dict[str, Any]
    events: list[tuple[str, int, dict[str, Any]]]
    error: str | None  # the status message of an error status, None if not an error
    resource: dict[str, Any] = field(default_factory=dict)


def _value(v: Any) -> Any:
    kind = v.WhichOneof("value")
    return getattr(v, kind) if kind else None


def _attrs(kvs: Any) -> dict[str, Any]:
    return {kv.key: _value(kv.value) for kv in kvs}


class Receiver:
    """``POST /v1/traces`` on a loopback port; ``spans`` is everything received."""

    def __init__(self) -> None:
        from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import (
            ExportTraceServiceRequest,
            ExportTraceServiceResponse,
        )

        self.spans: list[Span] = []
        self.lock = threading.Lock()
        receiver = self

        class Handler(http.server.BaseHTTPRequestHandler):
            def do_POST(self) -> None:  # noqa: N802 - http.server's name
                data = self.rfile.read(int(self.headers.get("Content-Length", 0)))
                if self.headers.get("Content-Encoding") == "gzip":
                    data = gzip.decompress(data)
                req = ExportTraceServiceRequest()
                req.ParseFromString(data)
                receiver._take(req)
                body = ExportTraceServiceResponse().SerializeToString()
                self.send_response(200)
                self.send_header("Content-Type", "application/x-protobuf")
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, *args: object) -> None:
                pass

        self.server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_port}/v1/traces"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def _take(self, req: Any) -> None:
        out = []
        for rs in req.resource_spans:
            resource = _attrs(rs.resource.attributes)
            for ss in rs.scope_spans:
                for s in ss.spans:
                    error = s.status.message if s.status.code == 2 else None  # STATUS_CODE_ERROR
                    out.append(Span(s.trace_id.hex(), s.span_id.hex(), s.parent_span_id.hex(),
                                    s.name, s.start_time_unix_nano, s.end_time_unix_nano,
                                    _attrs(s.attributes),
                                    [(e.name, e.time_unix_nano, _attrs(e.attributes))
                                     for e in s.events], error, resource))
        with self.lock:
            self.spans.extend(out)

    def of_trace(self, trace_id: str) -> list[Span]:
        with self.lock:
            return [s for s in self.spans if s.trace_id == trace_id]

    def wait(self, trace_id: str, pred: Any, timeout: float = 30.0) -> list[Span]:
        """The spans of ``trace_id`` once ``pred(spans)`` holds (or when ``timeout`` passes)."""
        end = time.monotonic() + timeout
        while True:
            spans = self.of_trace(trace_id)
            if pred(spans) or time.monotonic() > end:
                return spans
            time.sleep(0.1)

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()
