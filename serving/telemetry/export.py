"""Where a server process' spans go: down a pipe to a child process that runs the OpenTelemetry SDK's batching span
processor and exporters (OTLP over gRPC or HTTP/protobuf, console), as the OTEL_* variables configure them.

Why a child: the SDK encodes each span to OTLP protobuf in Python, attribute by attribute, and in the server's
process that ran under the GIL the calls need (docs/BENCHMARKS.md, "Tracing").
Here a span costs the server a tuple and its share of one JSON write a batch; the child, at the lowest CPU
priority, turns the tuples back into the SDK's ReadableSpans and hands them to its processors: what the SDK would
have exported from the server itself.

    server process                                   child: python -m serving.telemetry.export STATUS_FD
    Tracing.record -> SpanPipe.put(tuple)            reads frames from stdin, ReadableSpan each span,
    a thread: JSON of the batch, write a frame --->  BatchSpanProcessor(exporter).on_end (OTEL_BSP_*: its queue)

- A frame: 4 bytes of length (big-endian), then a JSON array of `Record`s (not pickle: nothing of ours unpickles).
  The first frame is the setup: the resource, the instrumentation scope and the exporters' names. The child says
  `ready` (or `error: ...`, then exits 2) on STATUS_FD, so that a bad exporter variable stops the server before it
  serves.
- Bounded: at most OTEL_BSP_MAX_QUEUE_SIZE spans wait in the server; past that they are dropped, counted, and a
  warning says so (never waited for, as the SDK's own queue). A child that exited drops every span from then on,
  with one warning; the server goes on serving.
- Stopping: the pipe is closed; the child exports what it holds (its processors' shutdown) and exits. A server
  that dies closes the pipe too, so the child never outlives it.
"""

from __future__ import annotations

import collections
import json
import logging
import os
import select
import signal
import struct
import subprocess
import sys
import threading
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from serving.errors import ServerConfigError

log = logging.getLogger(__name__)

_LENGTH = struct.Struct(">I")
FLUSH_S = 0.1  # the server's spans go down the pipe this often, or at a batch (the child's OTEL_BSP_* batch again)
START_S = 30.0  # how long the child may take to import the SDK and build its exporters
WARN_EVERY_S = 10.0  # at most one warning of dropped spans in this time

# One finished span, as the server records it: plain values, cheap to build and to write as JSON (ids are ints of
# up to 128 bits, which JSON numbers hold in Python's reader and writer).
#   (name, trace_id, span_id, trace_flags, trace_state: ((key, value), ...) or None,
#    parent_span_id (0: a root), parent_is_remote, kind (SpanKind's value), start_ns, end_ns,
#    attributes: dict or None, links: ((trace_id, span_id, trace_flags, is_remote), ...),
#    status: (code, description) or None, events: ((name, attributes, timestamp_ns), ...))
Record = tuple


class SpanPipe:
    """The server's end: `put` a Record from any thread; a daemon thread writes them to the child."""

    def __init__(self, setup: Mapping[str, Any], max_queue: int, batch: int) -> None:
        status_read, status_write = os.pipe()
        try:
            # the child imports this very serving package, wherever the server found it
            here = str(Path(__file__).resolve().parents[2])
            path = os.pathsep.join(p for p in (here, os.environ.get("PYTHONPATH", "")) if p)
            self.child = subprocess.Popen([sys.executable, "-m", "serving.telemetry.export", str(status_write)],
                                          stdin=subprocess.PIPE, pass_fds=(status_write,), close_fds=True,
                                          env={**os.environ, "PYTHONPATH": path})
        finally:
            os.close(status_write)
        try:
            self._write(_encode(dict(setup)))
            answer = _read_line(status_read, START_S)
        except OSError as e:  # the child exited before reading its setup
            answer = f"error: the span export process exited at start ({e})"
        finally:
            os.close(status_read)
        if answer != "ready":
            self._stop_child(1.0)
            if answer.startswith("error: "):
                raise ServerConfigError(answer.removeprefix("error: "))
            raise ServerConfigError(f"the span export process exited at start (code {self.child.returncode}; its "
                                    "error is above)" if self.child.returncode is not None else
                                    f"the span export process did not start within {START_S:.0f} s")
        self.max_queue, self.batch = max_queue, batch
        self.pending: collections.deque[Record] = collections.deque()
        self.dropped = 0  # since the last warning
        self._warned = -WARN_EVERY_S
        self.broken = False
        self._wake = threading.Event()
        self._closing = False
        self._thread = threading.Thread(target=self._run, name="span-pipe", daemon=True)
        self._thread.start()

    def put(self, record: Record) -> None:
        pending = self.pending
        if self.broken:
            return  # said once, when the pipe broke
        if len(pending) >= self.max_queue:
            self.dropped += 1  # not under a lock: a warning's figure (two threads may count one), not a metric
            return
        pending.append(record)  # a deque: the writer takes from its other end, no record lost between the two
        if len(pending) >= self.batch:
            self._wake.set()

    def close(self, timeout_s: float) -> bool:
        """Send what waits, close the pipe and wait at most `timeout_s` for the child to export and exit; False if it
        had not (it is then killed: what it held is lost)."""
        self._closing = True
        self._wake.set()
        self._thread.join(timeout_s)  # its last write: what waits
        if self._thread.is_alive():  # stuck writing to a child that does not read (stopped?)
            self.child.kill()
            self.child.wait()
            return False
        return self._stop_child(timeout_s)

    def _run(self) -> None:
        while True:
            self._wake.wait(FLUSH_S)
            self._wake.clear()
            closing = self._closing
            self._flush()
            if closing:
                return

    def _flush(self) -> None:
        pending = self.pending
        batch = [pending.popleft() for _ in range(len(pending))]
        now = time.monotonic()
        if self.dropped and (now - self._warned >= WARN_EVERY_S or self._closing):
            dropped, self.dropped, self._warned = self.dropped, 0, now
            log.warning("%d spans dropped: more than %d waited to be exported (OTEL_BSP_MAX_QUEUE_SIZE)", dropped,
                        self.max_queue)
        if not batch or self.broken:
            return
        try:
            payload = _encode(batch)
        except (TypeError, ValueError) as e:  # an attribute value that is not a plain value: this batch only, said
            log.warning("%d spans dropped: %s", len(batch), e)
            return
        try:
            self._write(payload)
        except (BrokenPipeError, ValueError, OSError):
            self.broken = True
            log.warning("the span export process exited (code %s): spans are dropped from now on", self.child.poll())

    def _write(self, payload: bytes) -> None:
        stdin = self.child.stdin
        assert stdin is not None
        stdin.write(_LENGTH.pack(len(payload)) + payload)  # a blocking write: the GIL is released while it waits
        stdin.flush()

    def _stop_child(self, timeout_s: float) -> bool:
        try:
            if self.child.stdin is not None:
                self.child.stdin.close()
        except OSError:
            pass
        try:
            self.child.wait(timeout_s)
            return True
        except subprocess.TimeoutExpired:
            self.child.kill()
            self.child.wait()
            return False


def _encode(value: Any) -> bytes:
    return json.dumps(value, separators=(",", ":")).encode()


def _read_line(fd: int, timeout_s: float) -> str:
    """One line from `fd` within `timeout_s` ("" at end of file or timeout)."""
    end, got = time.monotonic() + timeout_s, b""
    while not got.endswith(b"\n"):
        left = end - time.monotonic()
        if left <= 0 or not select.select([fd], [], [], left)[0]:
            return ""
        chunk = os.read(fd, 4096)
        if not chunk:
            break
        got += chunk
    return got.decode(errors="replace").strip()


# --- the child ---------------------------------------------------------------------------------------------------


def _frames(stream: Any) -> Any:
    while header := stream.read(_LENGTH.size):
        if len(header) < _LENGTH.size:
            return
        (size,) = _LENGTH.unpack(header)
        payload = stream.read(size)
        if len(payload) < size:
            return
        yield json.loads(payload)


def _spans(records: Sequence[Record], resource: Any, scope: Any) -> Any:
    """The SDK's ReadableSpan of each record: what the SDK's Tracer would have handed its processors."""
    from opentelemetry import trace as t
    from opentelemetry.sdk.trace import Event, ReadableSpan

    kinds, codes = {k.value: k for k in t.SpanKind}, {c.value: c for c in t.StatusCode}
    unset = t.Status(t.StatusCode.UNSET)
    for (name, trace_id, span_id, flags, state, parent_id, parent_remote, kind, start_ns, end_ns, attributes, links,
         status, events) in records:
        trace_state = t.TraceState([(k, v) for k, v in state]) if state else None
        context = t.SpanContext(trace_id, span_id, False, t.TraceFlags(flags), trace_state)
        parent = t.SpanContext(trace_id, parent_id, parent_remote, t.TraceFlags(flags), trace_state) \
            if parent_id else None
        yield ReadableSpan(
            name, context, parent, resource, attributes or {},
            tuple(Event(n, a, ts) for n, a, ts in events),
            [t.Link(t.SpanContext(lt, ls, remote, t.TraceFlags(lf))) for lt, ls, lf, remote in links],
            kinds[kind], None, unset if status is None else t.Status(codes[status[0]], status[1]), start_ns, end_ns,
            instrumentation_scope=scope)


def child_main(status_fd: int) -> int:
    from opentelemetry.sdk.resources import Resource
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import BatchSpanProcessor, ConsoleSpanExporter
    from opentelemetry.sdk.util.instrumentation import InstrumentationScope

    from serving.telemetry import otlp

    # The server's signals are not this process' to act on (a Ctrl-C reaches the whole process group): it stops when
    # the server closes the pipe, having exported what it holds.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    # The lowest CPU priority: where the calls keep every core busy, the encoding takes what they leave; past that,
    # spans wait in the server's bounded queue (docs/BENCHMARKS.md, "Tracing").
    os.nice(19)
    status = os.fdopen(status_fd, "w")
    frames = _frames(sys.stdin.buffer)
    try:
        setup = next(frames)
        resource = otlp.hashed_once(Resource(setup["resource"], setup.get("schema_url")))
        scope = InstrumentationScope(*setup["scope"])
        provider = TracerProvider(resource=resource, shutdown_on_exit=False)
        processors = [BatchSpanProcessor(otlp.exporter(os.environ) if name == "otlp" else ConsoleSpanExporter())
                      for name in setup["exporters"]]
    except ServerConfigError as e:
        status.write(f"error: {e}\n")
        status.close()
        return 2
    except StopIteration:
        return 0
    for processor in processors:
        provider.add_span_processor(processor)
    status.write("ready\n")
    status.close()
    for records in frames:
        for span in _spans(records, resource, scope):
            for processor in processors:
                processor.on_end(span)
    # The server closed the pipe (or died): export what is held, within the exporters' own timeouts, then exit.
    provider.shutdown()
    return 0


if __name__ == "__main__":
    sys.exit(child_main(int(sys.argv[1])))
