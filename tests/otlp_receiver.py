"""A real OTLP trace receiver on 127.0.0.1, built on opentelemetry-proto's service definitions (the OpenTelemetry
Collector is not installable from the package registries): the gRPC TraceService/Export and the HTTP endpoint
`POST /v1/traces` (protobuf, gzip or not), each answering as a collector does. What arrives is kept as `Span`s;
`tree()` draws a trace as text (docs/OBSERVABILITY.md's figure: bench/trace_example.py).

Used by tests/test_telemetry_traces.py and bench/ (trace_example.py, telemetry_bench.py). As a process of its own
(`python tests/otlp_receiver.py`, as a collector would be: not sharing a load generator's GIL), it counts spans:
`ReceiverProcess`.
"""

from __future__ import annotations

import gzip
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from concurrent import futures
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

import grpc
from opentelemetry.proto.collector.trace.v1 import trace_service_pb2 as pb
from opentelemetry.proto.collector.trace.v1 import trace_service_pb2_grpc as pb_grpc
from opentelemetry.proto.common.v1.common_pb2 import AnyValue
from opentelemetry.sdk.trace import TracerProvider

from serving.client import SentimentClient

# The batcher waits up to max_queue_delay for as many texts as its previous batch held: a call of two texts first,
# then two calls of one text each share a run. One batch thread: no second one takes the first text alone.
BATCH_PAIRS = ("--max-queue-delay-ms", "1000", "--batch-workers", "1")
KINDS = {0: "UNSPECIFIED", 1: "INTERNAL", 2: "SERVER", 3: "CLIENT", 4: "PRODUCER", 5: "CONSUMER"}


def _value(v: AnyValue) -> Any:
    kind = v.WhichOneof("value")
    if kind == "array_value":
        return [_value(x) for x in v.array_value.values]
    return getattr(v, kind) if kind else None


def _attributes(pairs: Any) -> dict[str, Any]:
    return {kv.key: _value(kv.value) for kv in pairs}


@dataclass
class Span:
    """One received span; ids as lowercase hex, as W3C traceparent writes them."""

    name: str
    trace_id: str
    span_id: str
    parent_id: str  # "" for a root span
    kind: str
    start_ns: int
    end_ns: int
    status: int  # 0 unset, 1 ok, 2 error
    attributes: dict[str, Any]
    links: list[tuple[str, str]]  # (trace id, span id) of each link
    resource: dict[str, Any]
    transport: str  # "grpc" or "http": how it arrived
    events: list[str] = field(default_factory=list)

    @property
    def ms(self) -> float:
        return (self.end_ns - self.start_ns) / 1e6


def _env(grpc_endpoint: str, http_endpoint: str, protocol: str, more: dict[str, str]) -> dict[str, str]:
    """The standard variables that send a server's spans to a receiver, exported every 50 ms."""
    endpoint = grpc_endpoint if protocol == "grpc" else http_endpoint
    return {"OTEL_TRACES_EXPORTER": "otlp", "OTEL_EXPORTER_OTLP_PROTOCOL": protocol,
            "OTEL_EXPORTER_OTLP_ENDPOINT": endpoint, "OTEL_BSP_SCHEDULE_DELAY": "50", **more}


class OtlpReceiver:
    """Both OTLP transports on free ports of 127.0.0.1; `spans` fills as exports arrive. Use as a context manager."""

    def __init__(self, keep: bool = True) -> None:
        """keep=False: only count the spans (`received`), as a benchmark's receiver, which should cost little."""
        self.keep = keep
        self.spans: list[Span] = []
        self.received = 0
        self.requests = {"grpc": 0, "http": 0}
        self._lock = threading.Condition()
        self._grpc = grpc.server(futures.ThreadPoolExecutor(4))
        pb_grpc.add_TraceServiceServicer_to_server(_TraceService(self), self._grpc)
        self.grpc_port = self._grpc.add_insecure_port("127.0.0.1:0")
        self._http = ThreadingHTTPServer(("127.0.0.1", 0), type("H", (_Handler,), {"receiver": self}))
        self.http_port = self._http.server_port
        self._thread = threading.Thread(target=self._http.serve_forever, daemon=True)

    @property
    def grpc_endpoint(self) -> str:
        return f"http://127.0.0.1:{self.grpc_port}"

    @property
    def http_endpoint(self) -> str:
        return f"http://127.0.0.1:{self.http_port}"

    def env(self, protocol: str = "grpc", **more: str) -> dict[str, str]:
        return _env(self.grpc_endpoint, self.http_endpoint, protocol, more)

    def __enter__(self) -> OtlpReceiver:
        self._grpc.start()
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._grpc.stop(None)
        self._http.shutdown()
        self._http.server_close()

    def take(self, request: pb.ExportTraceServiceRequest, transport: str) -> None:
        if not self.keep:
            with self._lock:
                self.requests[transport] += 1
                self.received += sum(len(ss.spans) for rs in request.resource_spans for ss in rs.scope_spans)
            return
        received = []
        for rs in request.resource_spans:
            resource = _attributes(rs.resource.attributes)
            for ss in rs.scope_spans:
                for s in ss.spans:
                    received.append(Span(
                        s.name, s.trace_id.hex(), s.span_id.hex(), s.parent_span_id.hex(), KINDS[s.kind],
                        s.start_time_unix_nano, s.end_time_unix_nano, s.status.code, _attributes(s.attributes),
                        [(link.trace_id.hex(), link.span_id.hex()) for link in s.links], resource, transport,
                        [e.name for e in s.events]))
        with self._lock:
            self.requests[transport] += 1
            self.received += len(received)
            self.spans.extend(received)
            self._lock.notify_all()

    def wait_for(self, condition: Callable[[list[Span]], Any], timeout: float = 30.0, what: str = "spans") -> Any:
        """Waits until `condition(spans)` is truthy and returns it; fails after `timeout` s."""
        end = time.monotonic() + timeout
        with self._lock:
            while not (found := condition(list(self.spans))):
                left = end - time.monotonic()
                assert left > 0, f"{what} not received in {timeout} s; got {[s.name for s in self.spans]}"
                self._lock.wait(left)
        return found


class ReceiverProcess:
    """A counting receiver (keep=False) in a process of its own: `env` as OtlpReceiver's, `received` asks it for
    its count. Use as a context manager."""

    def __init__(self) -> None:
        self.proc = subprocess.Popen([sys.executable, __file__], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                     text=True)
        assert self.proc.stdout is not None and self.proc.stdin is not None
        self.grpc_endpoint, self.http_endpoint = self.proc.stdout.readline().split()

    def env(self, protocol: str = "grpc", **more: str) -> dict[str, str]:
        return _env(self.grpc_endpoint, self.http_endpoint, protocol, more)

    @property
    def received(self) -> int:
        assert self.proc.stdin is not None and self.proc.stdout is not None
        self.proc.stdin.write("count\n")
        self.proc.stdin.flush()
        return int(self.proc.stdout.readline())

    def __enter__(self) -> ReceiverProcess:
        return self

    def __exit__(self, *exc: object) -> None:
        if self.proc.stdin is not None:
            self.proc.stdin.close()
        self.proc.wait(30)


class _TraceService(pb_grpc.TraceServiceServicer):
    def __init__(self, receiver: OtlpReceiver) -> None:
        self.receiver = receiver

    def Export(self, request: pb.ExportTraceServiceRequest, context: grpc.ServicerContext
               ) -> pb.ExportTraceServiceResponse:
        self.receiver.take(request, "grpc")
        return pb.ExportTraceServiceResponse()


class _Handler(BaseHTTPRequestHandler):
    receiver: OtlpReceiver

    def do_POST(self) -> None:
        if self.path != "/v1/traces":
            self.send_error(404)
            return
        body = self.rfile.read(int(self.headers.get("Content-Length", 0)))
        if self.headers.get("Content-Encoding") == "gzip":
            body = gzip.decompress(body)
        if self.headers.get("Content-Type") != "application/x-protobuf":
            self.send_error(415, "OTLP/HTTP protobuf only")
            return
        self.receiver.take(pb.ExportTraceServiceRequest.FromString(body), "http")
        answer = pb.ExportTraceServiceResponse().SerializeToString()
        self.send_response(200)
        self.send_header("Content-Type", "application/x-protobuf")
        self.send_header("Content-Length", str(len(answer)))
        self.end_headers()
        self.wfile.write(answer)

    def log_message(self, format: str, *args: object) -> None:
        pass


def tree(spans: list[Span], trace_id: str, attributes: tuple[str, ...] = ()) -> str:
    """A trace as indented text: each span's name, start (ms after the trace's first) and length, the `attributes`
    named, and its links (to spans of this trace or, with its id, of another)."""
    mine = [s for s in spans if s.trace_id == trace_id]
    ids = {s.span_id for s in mine}
    t0 = min(s.start_ns for s in mine)
    children: dict[str, list[Span]] = {}
    for s in mine:
        children.setdefault(s.parent_id if s.parent_id in ids else "", []).append(s)
    lines: list[str] = []

    def draw(s: Span, depth: int) -> None:
        shown = [f"{k}={s.attributes[k]}" for k in attributes if k in s.attributes]
        links = [f"link->{span[:8]}" + ("" if trace == trace_id else f" (trace {trace[:8]})")
                 for trace, span in s.links]
        lines.append(f"{'  ' * depth}{s.name} [{s.span_id[:8]}] +{(s.start_ns - t0) / 1e6:.2f} ms, "
                     f"{s.ms:.2f} ms" + "".join(f"  {x}" for x in shown + links))
        for c in sorted(children.get(s.span_id, []), key=lambda c: c.start_ns):
            draw(c, depth + 1)

    for root in sorted(children.get("", []), key=lambda s: s.start_ns):
        draw(root, 0)
    return "\n".join(lines)


def paired_calls(target: str, text: str, token: str | None = None) -> list[Any]:
    """Two concurrent calls of `text` through SentimentClient, each inside a client span of its own (a tracer of this
    process, not the global provider), after a call of two texts: on a server started with BATCH_PAIRS they share one
    run, unless the machine is so loaded that they arrive more than a second apart. The client spans' contexts."""
    tracer = TracerProvider().get_tracer("client")
    with SentimentClient(target, token=token, timeout=30) as client:
        client.classify([text, text])  # the previous batch: two texts

        def one(i: int) -> Any:
            with tracer.start_as_current_span(f"client call {i}") as span:
                client.classify([text])
                return span.get_span_context()

        with futures.ThreadPoolExecutor(2) as pool:
            return list(pool.map(one, range(2)))


if __name__ == "__main__":  # ReceiverProcess: the endpoints, then the count for each line read, until end of input
    with OtlpReceiver(keep=False) as counting:
        print(counting.grpc_endpoint, counting.http_endpoint, flush=True)
        for _ in sys.stdin:
            print(counting.received, flush=True)
