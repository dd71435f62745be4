"""One HTTP call's life in one function, `HttpCalls.serve`: auth -> admission -> body -> work (the core) -> answer ->
metrics, admitted by the server's one admission (serving/limits/admission.py), which gRPC's gate asks too:

- a call without a valid `Authorization: Bearer` token (401), and a model call that admission refuses (429: every
  model slot taken, the answers' budget spent, no room in the batching queue for a request of max_texts), are
  answered before a byte of their body is read (no `100 Continue` either), with `Connection: close`;
- the body: at most max_message_bytes (a larger Content-Length is refused before reading, a chunked body once it
  passes), all of it within body_timeout_s of the call's start (else 408 and the connection closed);
- a deadline from the `Request-Timeout-Ms` header (or Triton's `timeout` parameter of a KServe infer request, in
  microseconds): texts still queued then are dropped, the client gets 504; texts of a client that disconnects are
  dropped too;
- the model slot is released once the answer is built; the answer counts against the answers' budget until it is
  handed to the connection.
Every call is counted in sentiment_requests_total{protocol="http"} with the code (the gRPC status name) its client got.
Every call but health's is a telemetry call (serving/telemetry/call_log.py) as on gRPC: its `x-request-id` (taken or
made) is a response header, its span follows the semantic conventions for HTTP servers, its access line gives the
HTTP status (499: the client left before its answer).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable, Iterable
from concurrent.futures import Future
from contextlib import nullcontext
from dataclasses import dataclass, field
from functools import partial
from typing import Any

import orjson

from serving.config import ServerConfig
from serving.errors import Cancelled, DeadlineExpired, InvalidInput, ServingError, Unauthenticated
from serving.limits.admission import Admission, Permit
from serving.model.core import ServingCore
from serving.model.models import Models
from serving.model.predictor import Prediction
from serving.protocols.http.errors import HttpError, error_body, status_of
from serving.telemetry.call_log import CallLog
from serving.telemetry.logs import InternalErrors
from serving.telemetry.prometheus import Metrics

log = logging.getLogger(__name__)

Scope = dict[str, Any]
Receive = Callable[[], Awaitable[dict[str, Any]]]
Send = Callable[[dict[str, Any]], Awaitable[None]]
JSON_TYPES = (b"application/json",)
TIMEOUT_HEADER = b"request-timeout-ms"
MAX_TIMEOUT_MS = 3_600_000.0
# Characters of a call's texts past which they are tokenized off the event loop: about 0.2 ms of sentencepiece here,
# twice a hand-off to a thread (to_thread on uvloop: 85 us on the 2-core VM of docs/BENCHMARKS.md).
OFFLOAD_CHARS = 2048


@dataclass
class Answer:
    """What a route's work returns: the body (JSON unless `content_type` says otherwise) and its status."""

    body: bytes
    status: int = 200
    content_type: bytes = b"application/json"
    headers: list[tuple[bytes, bytes]] = field(default_factory=list)


@dataclass(eq=False)
class HttpCall:
    """One call as its route's work sees it: headers, path parameters, the body (read once, by `body()` or
    `json()`), the deadline, and whether its client has left."""

    scope: Scope
    receive: Receive
    limits: ServerConfig
    admission: Admission
    start: float  # time.monotonic()
    deadline: float | None = None  # time.monotonic() seconds
    body_read: bool = False
    body_late: bool = False  # its body did not come within body_timeout_s: its task was cancelled for it
    gone: bool = False  # the client disconnected while its texts waited

    @property
    def params(self) -> dict[str, str]:
        return self.scope.get("path_params", {})

    def header(self, name: bytes) -> bytes | None:
        for key, value in self.scope["headers"]:
            if key == name:
                return value
        return None

    def set_timeout(self, seconds: float) -> None:
        """A deadline `seconds` after the call's start (the earlier one wins)."""
        deadline = self.start + seconds
        self.deadline = deadline if self.deadline is None else min(self.deadline, deadline)

    async def body(self, types: Iterable[bytes] = JSON_TYPES) -> bytes:
        """The whole body, bounded in size and time; HttpError 415 for a content type not in `types` (a call without
        one is read as the first), 413 past max_message_bytes, BodyTimeout past body_timeout_s."""
        kind = (self.header(b"content-type") or b"").split(b";")[0].strip().lower()
        if kind and kind not in types:
            raise HttpError(415, "INVALID_ARGUMENT", f"content type {kind.decode('latin-1')!r} is not read here; send "
                            f"{' or '.join(t.decode() for t in types)} (Content-Type header)")
        encoding = (self.header(b"content-encoding") or b"identity").strip().lower()
        if encoding != b"identity":
            raise HttpError(415, "INVALID_ARGUMENT", f"content encoding {encoding.decode('latin-1')!r} is not read "
                            "here; send the body uncompressed")
        limit = self.limits.max_message_bytes
        declared = self.header(b"content-length")
        if declared is not None and declared.isdigit() and int(declared) > limit:
            raise HttpError(413, "RESOURCE_EXHAUSTED", f"body of {int(declared)} bytes > max_message_bytes {limit}; "
                            "send fewer or shorter texts per request")
        loop = asyncio.get_running_loop()
        task = asyncio.current_task()
        assert task is not None
        # The event loop's own timer, not admission's watchdog thread: a cancel from another thread could land
        # after the body was read. The limit and the count are admission's.
        timer = loop.call_later(max(0.0, self.start + self.admission.body_timeout_s - time.monotonic()),
                                self._late, task)
        try:
            data = await self._read(limit)
        except asyncio.CancelledError:
            if self.body_late:
                if hasattr(task, "uncancel"):  # Python >= 3.11: the cancel was ours, and is consumed here
                    task.uncancel()
                raise self.admission.late_body() from None
            raise
        finally:
            timer.cancel()
        self.body_read = True
        return data

    def _late(self, task: asyncio.Task) -> None:
        self.body_late = True
        task.cancel()

    async def _read(self, limit: int) -> bytes:
        chunks, size = [], 0
        while True:
            message = await self.receive()
            if message["type"] == "http.disconnect":
                raise Cancelled("the client closed the connection before sending its whole body")
            chunk = message.get("body", b"")
            size += len(chunk)
            if size > limit:
                raise HttpError(413, "RESOURCE_EXHAUSTED", f"body over max_message_bytes {limit}; send fewer or "
                                "shorter texts per request")
            chunks.append(chunk)
            if not message.get("more_body", False):
                return chunks[0] if len(chunks) == 1 else b"".join(chunks)

    async def json(self, types: Iterable[bytes] = JSON_TYPES) -> Any:
        return parse_json(await self.body(types))

    async def predictions(self, models: Models, name: str, version: str,
                          texts: list[str]) -> tuple[ServingCore, list[Prediction]]:
        """The core that answered and its predictions of `texts` (Models.submit, without blocking the loop), awaited as
        `result` does. Texts of more than OFFLOAD_CHARS characters in all are checked, tokenized and queued in a
        thread of the loop's pool (sentencepiece lets go of the interpreter lock): on the loop they held up every
        other call's reading and answering, the answers of a batch just computed included (docs/BENCHMARKS.md, "HTTP
        beside gRPC"). Shorter ones stay on the loop, where they cost less than the hand-off to a thread."""
        submit = partial(models.submit, name, version, texts, self.deadline, lambda: self.gone)
        long = sum(map(len, texts)) > OFFLOAD_CHARS
        # while several models are busy a call may wait for its model's turn (serving/model/turns.py): in a thread
        core, future = await asyncio.to_thread(submit) if long or models.contended else submit()
        return core, await self.result(future)

    async def result(self, future: Future) -> Any:
        """The core's answer (its ServingError raised), awaited without a thread; DeadlineExpired once the deadline
        passes, Cancelled when the client disconnects first (its queued texts are then dropped: `gone`)."""
        loop = asyncio.get_running_loop()
        waiter = loop.create_future()

        def wake(*_: object) -> None:
            if not waiter.done():
                waiter.set_result(None)

        def from_thread(_: Future) -> None:
            try:
                loop.call_soon_threadsafe(wake)
            except RuntimeError:  # the loop has closed: the server stopped
                pass

        future.add_done_callback(from_thread)
        watch = loop.create_task(self.receive())  # http.disconnect once the client leaves (its body was read)
        watch.add_done_callback(wake)
        timer = None if self.deadline is None else loop.call_later(max(0.0, self.deadline - time.monotonic()), wake)
        try:
            await waiter
        finally:
            watch.cancel()
            if timer is not None:
                timer.cancel()
        if future.done():
            return future.result()
        if watch.done() and not watch.cancelled():
            self.gone = True
            raise Cancelled("the client closed the connection before its answer")
        raise DeadlineExpired("deadline passed while the texts waited for a batch")


def parse_json(data: bytes) -> Any:
    """JSON as RFC 8259 has it (UTF-8, no NaN, no lone surrogate) -> Python; InvalidInput naming where it breaks.
    orjson rather than the standard library: the profile of a call of 64 texts (docs/BENCHMARKS.md, "HTTP beside
    gRPC")."""
    try:
        return orjson.loads(data)
    except orjson.JSONDecodeError as e:
        try:
            data.decode("utf-8")
        except UnicodeDecodeError as bad:
            raise InvalidInput(f"body: not UTF-8 (byte {bad.start})") from None
        if e.msg.startswith("depth limit exceeded"):  # orjson reads 1,024 levels
            raise InvalidInput("body: JSON nested too deeply") from None
        raise InvalidInput(f"body: not JSON: {e}") from None


Work = Callable[[HttpCall], Awaitable[Answer]]
HEALTH_PATHS = "/v2/health/"  # probes: neither traced nor in the access log (they would flood both)


def _span_attributes(scope: Scope, label: str) -> dict[str, Any]:
    """OpenTelemetry's semantic conventions for an HTTP server span; `label`: "METHOD /route/{param}"."""
    client = scope.get("client") or ("", 0)
    return {"http.request.method": scope["method"], "http.route": label.partition(" ")[2],
            "url.path": scope["path"], "url.scheme": scope.get("scheme", "http"),
            "network.protocol.version": scope.get("http_version", "1.1"), "client.address": client[0],
            "client.port": client[1]}


class HttpCalls:
    """Serves calls under admission's bounds; `serve` is the one place a call goes through."""

    def __init__(self, admission: Admission, metrics: Metrics, calls: CallLog, errors: InternalErrors,
                 cfg: ServerConfig) -> None:
        """calls: where every call but health's gets its request id, span and access line. errors: where a bug's
        traceback goes (rate-limited)."""
        self.admission, self.metrics, self.calls, self.errors, self.cfg = admission, metrics, calls, errors, cfg

    async def serve(self, scope: Scope, receive: Receive, send: Send, method: str, work: Work, *, model: bool,
                    open: bool = False) -> None:
        """One call: auth -> admission -> body -> work -> answer -> metrics. method: its label ("POST
        /v1/classify"); model: takes a model permit (admission first); open: served without a token (health)."""
        admission = self.admission
        call = HttpCall(scope, receive, self.cfg, admission, time.monotonic())
        tele = None if scope["path"].startswith(HEALTH_PATHS) else \
            self.calls.begin("http", method, scope["headers"], _span_attributes(scope, method))
        code, answer = "OK", None
        permit: Permit | None = None
        try:
            start = time.time_ns() if tele is not None and tele.traced else 0  # steps: child spans when sampled
            if not open:
                authorized = admission.authorized(call.header(b"authorization"))
                if start and admission.guarded:
                    tele.timed("auth", start)
                    start = time.time_ns()
                if not authorized:
                    raise Unauthenticated("missing or wrong bearer token (header 'Authorization: Bearer <token>')")
            timeout = call.header(TIMEOUT_HEADER)
            if timeout is not None:
                call.set_timeout(timeout_seconds(timeout))
            if model:
                try:
                    permit = admission.admit()
                finally:
                    if start:
                        tele.timed("admission", start)
            with tele if tele is not None else nullcontext():  # the core sees it: texts, tokens, spans
                answer = await work(call)
        except ServingError as e:
            code = e.code
            answer = self._refusal(e, call)
        except Exception as e:  # a bug: logged (rate-limited), its client learns nothing of it
            code = "INTERNAL"
            self.errors.report(method, e)
            answer = self._refusal(ServingError("internal server error (details in the server log)"), call)
        finally:
            if permit is not None:
                permit.release()
        if tele is not None:
            answer.headers.append((b"x-request-id", tele.request_id.encode()))
        if call.gone:
            code = "CANCELLED"  # no one to answer
        else:
            size = len(answer.body)
            try:
                admission.hold_answer(size)
            except ServingError as e:  # over the answers' budget: refused (a refusal itself is not counted)
                code, answer, size = e.code, self._refusal(e, call), 0
            try:
                await self._send(send, answer)
            finally:
                if size:
                    admission.answer_gone(size)
        self.metrics.answered("http", method, code, time.monotonic() - call.start)
        if tele is not None:
            status = 499 if call.gone else answer.status
            client = scope.get("client") or ("", 0)
            tele.peer = f"{client[0]}:{client[1]}"
            attributes = {"http.response.status_code": status} if tele.traced else None
            tele.finish(str(status), failed=status >= 500, attributes=attributes, reason=code)

    def _refusal(self, error: ServingError, call: HttpCall) -> Answer:
        headers = list(error.headers) if isinstance(error, HttpError) else []
        if not call.body_read:  # its body (maybe large, maybe never coming) is not worth reading: close instead
            headers.append((b"connection", b"close"))
        if error.code == "UNAUTHENTICATED":
            headers.append((b"www-authenticate", b'Bearer realm="sentiment"'))
        if status_of(error) in (429, 503):
            headers.append((b"retry-after", b"1"))
        return Answer(error_body(error.code, str(error)), status_of(error), headers=headers)

    async def _send(self, send: Send, answer: Answer) -> None:
        await send({"type": "http.response.start", "status": answer.status, "headers": [
            (b"content-type", answer.content_type), (b"content-length", str(len(answer.body)).encode()),
            *answer.headers]})
        await send({"type": "http.response.body", "body": answer.body})


def timeout_seconds(value: bytes) -> float:
    """A Request-Timeout-Ms header -> seconds; InvalidInput unless a number of ms in (0, 1 h]."""
    try:
        ms = float(value)
    except ValueError:
        ms = float("nan")
    if not 0 < ms <= MAX_TIMEOUT_MS:  # NaN fails too
        raise InvalidInput(f"header Request-Timeout-Ms: {value[:32].decode('latin-1')!r} is not a number of "
                           f"milliseconds in (0, {MAX_TIMEOUT_MS:.0f}]")
    return ms / 1000
