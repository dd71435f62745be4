"""The server's log lines: one schema in two formats, and the rate limit of per-call lines.

Every line has a timestamp (UTC, ISO 8601, milliseconds), level, logger, message, request_id and trace_id (those two
from the call the line was written for; null outside a call or without tracing). `json`: one object per line
(python-json-logger), the access line's fields (serving/telemetry/call_log.py) as keys of their own; `text`:

    2026-01-02T03:04:05.678Z INFO serving.access: sentiment.v1.SentimentService/Classify OK ... request_id=R trace_id=T

Workers write the same, with their index and pid (`worker`, `pid` keys; `[worker N pid P]` after the logger).
"""

from __future__ import annotations

import logging
import os
import sys
import threading
import time
from collections.abc import Callable
from contextvars import ContextVar
from typing import Any, Literal

Format = Literal["text", "json"]
FORMATS: tuple[Format, ...] = ("text", "json")
# The call the running code serves (serving/telemetry/call_log.py sets it): its ids go in the lines written meanwhile.
current_call: ContextVar[Any] = ContextVar("sentiment_call", default=None)
_internal = logging.getLogger("serving.internal")


class LogThrottle:
    """At most `burst` lines per `period` s for one key (a kind of failure, a method and status); the rest are
    counted, and the count is given with the next line allowed."""

    def __init__(self, period: float = 60.0, burst: int = 3) -> None:
        self.period, self.burst = period, burst
        self._lock = threading.Lock()
        self._seen: dict[str, tuple[float, int, int]] = {}  # key -> (window start, logged, suppressed)

    def allow(self, key: str) -> tuple[bool, int]:
        """(log this one?, how many were suppressed since the last one logged)."""
        now = time.monotonic()
        with self._lock:
            start, logged, suppressed = self._seen.get(key, (now, 0, 0))
            if now - start >= self.period:
                start, logged = now, 0
            if logged < self.burst:
                self._seen[key] = (start, logged + 1, 0)
                return True, suppressed
            self._seen[key] = (start, logged, suppressed + 1)
            return False, 0


class InternalErrors:
    """The tracebacks of errors no code expected (a bug; its client gets INTERNAL and no detail), whatever the
    protocol: at most 3 a minute for each method and kind of error, the rest counted by `on_suppressed` and their
    number given with the next one logged. One per server, shared by its protocols."""

    def __init__(self, on_suppressed: Callable[[], None] = lambda: None) -> None:
        self.on_suppressed = on_suppressed
        self.throttle = LogThrottle()

    def report(self, method: str, error: BaseException) -> None:
        allowed, suppressed = self.throttle.allow(f"{method}:{type(error).__name__}")
        if allowed:
            more = f" ({suppressed} more like it not logged)" if suppressed else ""
            _internal.error("internal error in %s%s", method, more, exc_info=error)
        else:
            self.on_suppressed()


class ClientCausedLines(logging.Filter):
    """A library's log lines that a client causes, one per call or connection (OpenTelemetry's warnings about a
    malformed trace header, uvicorn's about an invalid HTTP request): at most 3 a minute for each line of the library's
    code that writes one (a LogThrottle keyed by logger and line number: a bounded set of keys), the rest counted and
    the count given with the next; the text cut to `max_chars`. So a client can neither flood the log nor write its
    own text into it at length. Attach it to the library's logger, once: `attach(name)`."""

    def __init__(self, prefix: str = "", max_chars: int = 200) -> None:
        super().__init__()
        self.prefix, self.max_chars = prefix, max_chars
        self.throttle = LogThrottle()

    def attach(self, *loggers: str) -> None:
        for name in loggers:
            if self not in logging.getLogger(name).filters:
                logging.getLogger(name).addFilter(self)

    def filter(self, record: logging.LogRecord) -> bool:
        allowed, suppressed = self.throttle.allow(f"{record.name}:{record.lineno}")
        if not allowed:
            return False
        text = record.getMessage()
        if len(text) > self.max_chars:
            text = f"{text[:self.max_chars]}... ({len(text):,} characters)"
        more = f" ({suppressed} more like it not logged)" if suppressed else ""
        record.msg, record.args = f"{self.prefix}{text}{more}", None
        return True


class _CallFields(logging.Filter):
    """Gives every record request_id and trace_id: its own (the access line's), else the current call's."""

    def filter(self, record: logging.LogRecord) -> bool:
        if not hasattr(record, "request_id"):
            call = current_call.get()
            record.request_id = call.request_id if call is not None else None
            record.trace_id = call.trace_id if call is not None else None
        return True


class _Utc:
    """ISO 8601 in UTC with milliseconds: 2026-01-02T03:04:05.678Z."""

    def formatTime(self, record: logging.LogRecord, datefmt: str | None = None) -> str:
        return time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(record.created)) + f".{int(record.msecs):03d}Z"


class TextFormatter(_Utc, logging.Formatter):
    def __init__(self, where: str = "") -> None:
        super().__init__(f"%(asctime)s %(levelname)s %(name)s{where}: %(message)s")

    def format(self, record: logging.LogRecord) -> str:
        line = super().format(record)
        ids = [f"{k}={v}" for k in ("request_id", "trace_id") if (v := getattr(record, k, None)) is not None]
        if not ids:
            return line
        first, newline, rest = line.partition("\n")  # after the message, before a traceback
        return f"{first} {' '.join(ids)}{newline}{rest}"


def json_formatter(static: dict[str, object] | None = None) -> logging.Formatter:
    """python-json-logger's formatter with the schema's names (imported here: only a JSON log needs it)."""
    from pythonjsonlogger.json import JsonFormatter

    class JsonLineFormatter(_Utc, JsonFormatter):
        pass

    return JsonLineFormatter("%(asctime)s %(levelname)s %(name)s %(message)s %(request_id)s %(trace_id)s",
                             rename_fields={"asctime": "timestamp", "levelname": "level", "name": "logger"},
                             static_fields=static or {})


def configure(level: str = "INFO", fmt: Format = "text", worker: int | None = None) -> None:
    """The process' one stderr handler (replacing any), in `fmt`; `worker`: the index of a --workers process."""
    if fmt not in FORMATS:
        raise ValueError(f"log format must be one of {FORMATS}, got {fmt!r}")
    handler = logging.StreamHandler(sys.stderr)
    if fmt == "json":
        static = {} if worker is None else {"worker": worker, "pid": os.getpid()}
        handler.setFormatter(json_formatter(static))
    else:
        handler.setFormatter(TextFormatter("" if worker is None else f"[worker {worker} pid {os.getpid()}]"))
    handler.addFilter(_CallFields())
    root = logging.getLogger()
    for old in list(root.handlers):
        root.removeHandler(old)
    root.addHandler(handler)
    root.setLevel(level)
