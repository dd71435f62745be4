"""One call as the operator sees it, whatever its protocol: its request id, its span (when traced), its access log
line. Every protocol uses the same four steps:

    call = call_log.begin("grpc", "sentiment.v1.SentimentService/Classify", headers, span_attributes)
    start = time.time_ns() if call.traced else 0   # a step done before the handler (auth, admission)...
    if start: call.timed("auth", start)            # ...is a child span when the call is sampled
    with call: handler(...)                        # the handler's thread (or task) sees it: current(), the log lines
    call.finish("OK", failed=False)                # ends the span, writes the access line (rate-limited)

A step is timed by hand rather than in a `with` block: on every call that is not sampled (all of them, tracing off)
a `with` would run a context manager's Python for nothing. `headers` are the call's (name, value) pairs (gRPC
metadata, HTTP headers): `x-request-id` is taken from them when it is a sane token, else one is made; the caller
returns `call.request_id` (gRPC: trailing metadata; HTTP: a response header). The W3C `traceparent` among them makes
the span a child of the client's. The model's code reaches the call through `current()`: the core counts texts and
tokens and times its steps on it, the batcher takes `link()`.
"""

from __future__ import annotations

import logging
import os
import re
import time
from collections.abc import Callable, Iterable, Mapping
from typing import Any

from serving.telemetry import tracing
from serving.telemetry.logs import LogThrottle
from serving.telemetry.logs import current_call as _current

access = logging.getLogger("serving.access")

REQUEST_ID = "x-request-id"
_SANE_ID = re.compile(r"[A-Za-z0-9._:/+=@-]{1,128}")  # a client's id is kept only if it is this (it goes in logs)


def current() -> Call | None:
    """The call the running code serves (None outside a call)."""
    return _current.get()


class Call:
    """One call: see the module docstring. `texts` and `tokens` are filled in by the core; `peer` by the protocol:
    its client's address, or a function that says it (gRPC's `context.peer`), asked only when a line or a span needs
    it."""

    __slots__ = ("protocol", "method", "request_id", "_peer", "texts", "tokens", "model", "model_version", "span",
                 "traced", "_log", "_started", "_token")

    def __init__(self, log: CallLog, protocol: str, method: str, request_id: str,
                 span: tracing.ServerSpan | None) -> None:
        self.protocol, self.method, self.request_id = protocol, method, request_id
        self._peer: str | Callable[[], str] = ""
        self.texts = self.tokens = 0
        self.model = self.model_version = ""  # the model version that took the call (serving/model/core.py)
        self.span = span  # its server span when tracing is on, else None
        self.traced = span is not None and span.recording  # sampled: its steps are child spans
        self._log = log
        self._started = time.perf_counter()
        self._token: Any = None

    @property
    def peer(self) -> str:
        if callable(self._peer):
            self._peer = self._peer()
        return self._peer

    @peer.setter
    def peer(self, value: str | Callable[[], str]) -> None:
        self._peer = value

    @property
    def trace_id(self) -> str | None:
        """The trace's id as 32 hex digits (the logs' trace_id), None when not traced."""
        return None if self.span is None else format(self.span.context.trace_id, "032x")

    def link(self) -> Any:
        """The span context a batch links to (None when tracing is off or this call is not sampled): a small
        immutable value, so that a batch never holds the call itself."""
        return self.span.context if self.span is not None and self.span.recording else None

    def timed(self, name: str, start_ns: int) -> None:
        """A step of a sampled call (`traced`) that began at `start_ns` (time.time_ns()) and ends now: a child span."""
        t = tracing.active()
        if self.span is not None and t is not None:
            t.record(name, self.span.context, start_ns, time.time_ns())

    def __enter__(self) -> Call:
        """`with call:` the block runs as this call: `current()`, and the request id and trace id of its log lines."""
        self._token = _current.set(self)
        return self

    def __exit__(self, *exc: object) -> None:
        _current.reset(self._token)
        self._token = None

    def finish(self, status: str, *, failed: bool, attributes: Mapping[str, Any] | None = None,
               reason: str = "") -> None:
        """End the call: its span (status, attributes; an error when `failed`) and its access line. `status`: the
        protocol's own (a gRPC code's name, an HTTP status)."""
        ms = (time.perf_counter() - self._started) * 1000
        span, t = self.span, tracing.active()
        if span is not None and span.recording and t is not None:
            span.attributes.update(attributes or {})
            if self.texts:
                span.attributes.update({"sentiment.texts": self.texts, "sentiment.tokens": self.tokens})
            if self.model:
                span.attributes.update({"sentiment.model": self.model, "sentiment.model_version": self.model_version})
            t.end(span, (reason or status) if failed else None)
        self._log.write(self, status, ms)


def _new_id() -> str:
    """A random (version 4) UUID as uuid.uuid4() writes it, in one call rather than three on every call's path."""
    h = os.urandom(16).hex()
    return f"{h[:8]}-{h[8:12]}-4{h[13:16]}-{'89ab'[int(h[16], 16) & 3]}{h[17:20]}-{h[20:]}"


class CallLog:
    """Begins calls and writes their access lines: at most `rate` lines per second for each method and status (a
    flood of refusals cannot hide the answered calls, nor grow the log without bound); the lines not written are
    counted by `on_suppressed` and their number given in the next line written."""

    def __init__(self, rate: int, on_suppressed: Callable[[], None] = lambda: None) -> None:
        self.rate = rate
        self.on_suppressed = on_suppressed
        self.throttle = LogThrottle(period=1.0, burst=rate)

    def begin(self, protocol: str, method: str, headers: Iterable[tuple[str, str | bytes]] | None,
              span_attributes: Mapping[str, Any] | None = None) -> Call:
        """A call of `method` (the span's name too) with the client's `headers`."""
        t = tracing.active()
        wanted = t.fields if t is not None else frozenset()
        request_id, carrier = None, {}
        for key, value in headers or ():  # gRPC's are str (binary values bytes), ASGI's bytes
            key = (key.decode("latin-1") if isinstance(key, bytes) else key).lower()
            if key == REQUEST_ID or key in wanted:
                value = value if isinstance(value, str) else value.decode("latin-1")
                if key == REQUEST_ID:
                    request_id = value
                else:
                    carrier[key] = value
        if request_id is None or not _SANE_ID.fullmatch(request_id):
            request_id = _new_id()
        span = None if t is None else t.start(method, carrier, span_attributes or {})
        return Call(self, protocol, method, request_id, span)

    def write(self, call: Call, status: str, ms: float) -> None:
        if self.rate <= 0 or not access.isEnabledFor(logging.INFO):
            return
        allowed, suppressed = self.throttle.allow(f"{call.method} {status}")
        if not allowed:
            self.on_suppressed()
            return
        more = f" ({suppressed} more like it not logged)" if suppressed else ""
        access.info("%s %s texts=%d tokens=%d %.1f ms peer=%s%s", call.method, status, call.texts, call.tokens, ms,
                    call.peer or "-", more,
                    extra={"request_id": call.request_id, "trace_id": call.trace_id, "method": call.method,
                           "protocol": call.protocol, "peer": call.peer, "status": status, "texts": call.texts,
                           "tokens": call.tokens, "ms": round(ms, 3), "suppressed": suppressed,
                           "model": call.model, "model_version": call.model_version})
