"""The gate every gRPC call passes: admission said in gRPC's terms, the time to send the body, codes, spans.

`Gate` is the server's one gRPC interceptor. What is admitted is the server's one admission
(serving/limits/admission.py, which the HTTP layer asks too); this module is how gRPC asks it. gRPC's threaded
server runs interceptors in its polling thread, before a handler thread is taken; a unary handler's thread would then
wait for the request body without bound. So every handler is re-made here as request-streaming, which lets the gate
refuse from the call's metadata alone, before its body is read and without a thread: a call without a valid token
(UNAUTHENTICATED), and a model call that admission refuses (RESOURCE_EXHAUSTED). A unary model call takes its permit
here too, so that no admitted call waits in the pool's queue. A call then reads its message under admission's
watchdog, which cancels it when the body has not arrived within `body_timeout_s`.

Per-address limits (connections, call rates, failed logins) are the front proxy's (deploy/proxy/): only the edge
sees a client's real address. Health is open, and runs on a pool of its own threads, so no model traffic can starve
it. Errors become status codes here (ServingError subclasses; anything else is a bug: INTERNAL, its traceback logged
with a rate limit). Every call is counted with the code its client got.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from concurrent import futures
from functools import partial
from typing import Any

import grpc
from google.protobuf.message import DecodeError

from serving.errors import BodyTimeout, InvalidInput, Overloaded, ServingError, Unauthenticated
from serving.limits.admission import Admission, Permit
from serving.limits.bounds import Slots
from serving.telemetry.call_log import REQUEST_ID, Call, CallLog
from serving.telemetry.logs import InternalErrors
from serving.telemetry.prometheus import Metrics

HEALTH_PREFIX = "/grpc.health.v1.Health/"  # open without a token (load balancers, probes)
# The codes that make a server span an error (OpenTelemetry's semantic conventions for gRPC): the others are the
# client's doing (a bad argument, a missing token, a refusal it may retry).
SERVER_ERRORS = frozenset({"UNKNOWN", "DEADLINE_EXCEEDED", "UNIMPLEMENTED", "INTERNAL", "UNAVAILABLE", "DATA_LOSS"})


class _Malformed:
    """Stands in for a request message that failed to parse (e.g. invalid UTF-8 in a string field)."""

    def __init__(self, error: Exception, size: int) -> None:
        self.error, self.size = error, size


def _safe(deserializer: Callable[[bytes], Any] | None) -> Callable[[bytes], Any] | None:
    """grpc answers a parse failure with INTERNAL; we want INVALID_ARGUMENT, so parse failures become values."""
    if deserializer is None:
        return None

    def parse(data: bytes) -> Any:
        try:
            return deserializer(data)
        except DecodeError as e:
            return _Malformed(e, len(data))

    return parse


class _Inline(futures.Executor):
    """Runs what gRPC hands it at once, in the thread that hands it (gRPC's polling thread): for the behaviours that
    only refuse, which never wait (no body read, no lock held long), so that a refusal costs no hand-over to
    another thread, and no queue forms in front of it."""

    def submit(self, fn: Callable[..., Any], /, *args: Any, **kwargs: Any) -> futures.Future:
        future: futures.Future = futures.Future()
        try:
            future.set_result(fn(*args, **kwargs))
        except Exception as e:  # gRPC's wrapper catches the behaviour's own errors; this is only a safety net
            future.set_exception(e)
        return future


class Gate(grpc.ServerInterceptor):
    """See the module docstring."""

    def __init__(self, admission: Admission, metrics: Metrics, calls: CallLog, errors: InternalErrors, *,
                 health_workers: int, max_message_bytes: int) -> None:
        """calls: where every call but health's gets its request id, span and access line
        (serving/telemetry/call_log.py). errors: where a bug's traceback goes (rate-limited)."""
        self.admission = admission
        self.metrics = metrics
        self.calls = calls
        self.errors = errors
        self.health_slots = Slots(health_workers, "health")
        self.health_pool = futures.ThreadPoolExecutor(health_workers, thread_name_prefix="health")
        self.refusal_pool = _Inline()  # refusals only abort: done in gRPC's polling thread, where they arrive
        self.max_message_bytes = max_message_bytes

    def close(self) -> None:
        self.health_pool.shutdown(wait=False, cancel_futures=True)

    def _authorized(self, details: grpc.HandlerCallDetails) -> bool:
        for key, value in details.invocation_metadata or ():
            if key == "authorization":
                return self.admission.authorized(value)
        return self.admission.authorized(None)

    def intercept_service(self, continuation, details):
        handler = continuation(details)
        if handler is None:
            return None  # unknown method: grpc answers UNIMPLEMENTED at once, without a thread
        method = details.method.lstrip("/")
        health = details.method.startswith(HEALTH_PREFIX)
        # Every call but health's (probes would flood the access log and the traces) is a telemetry Call from here.
        tele = None if health else self.calls.begin("grpc", method, details.invocation_metadata,
                                                     {"rpc.system.name": "grpc", "rpc.method": method})
        permit = None
        if tele is not None:  # health is open; every other call is admitted here, in gRPC's polling thread
            start = time.time_ns() if tele.traced else 0  # its steps are child spans when it is sampled
            if self.admission.guarded:
                authorized = self._authorized(details)
                if start:
                    tele.timed("auth", start)
                    start = time.time_ns()
                if not authorized:
                    return self._refusal(handler, method, Unauthenticated(
                        "missing or wrong bearer token (metadata 'authorization: Bearer <token>')"), tele)
            # A unary model call takes its permit here, before gRPC queues it for a thread of its pool: a call that
            # got past admission is one the pool has a thread for, never one that waits in the pool's queue to be
            # refused there. (Streams, reflection's, take theirs when they start: a generator's code runs only once
            # iterated.) The permit is released when the behaviour ends (gRPC always runs it).
            try:
                if handler.unary_unary is not None:
                    permit = self.admission.admit()
                else:
                    self.admission.check()
            except Overloaded as refusal:
                return self._refusal(handler, method, refusal, tele)
            finally:
                if start:
                    tele.timed("admission", start)
        call = _Call(self, method, model=not health, permit=permit, tele=tele)
        parse = _safe(handler.request_deserializer)
        if handler.unary_unary is not None:
            made = grpc.stream_unary_rpc_method_handler(call.unary(handler.unary_unary), request_deserializer=parse,
                                                        response_serializer=handler.response_serializer)
        elif handler.unary_stream is not None:  # health Watch: non-blocking, answers through a callback
            made = grpc.stream_stream_rpc_method_handler(call.watch(handler.unary_stream), request_deserializer=parse,
                                                         response_serializer=handler.response_serializer)
        elif handler.stream_stream is not None:  # reflection
            made = grpc.stream_stream_rpc_method_handler(call.stream(handler.stream_stream),
                                                         request_deserializer=parse,
                                                         response_serializer=handler.response_serializer)
        else:
            return handler  # no stream-unary method is served
        if health:
            for behavior in (made.stream_unary, made.stream_stream):
                if behavior is not None:
                    behavior.experimental_thread_pool = self.health_pool
        return made

    def first(self, requests: Iterator[Any], context: grpc.ServicerContext, method: str) -> Any:
        """The one message of a unary call, read under the watchdog."""
        request = self.next_message(requests, context)
        if request is None:
            raise InvalidInput(f"{method}: the call ended without its request message")
        if isinstance(request, _Malformed):
            raise InvalidInput(f"request does not parse as {method}'s message: {request.error}")
        return request

    def next_message(self, requests: Iterator[Any], context: grpc.ServicerContext) -> Any:
        """The next message of a call (None at its end); BodyTimeout when it took longer than body_timeout_s."""
        watch = self.admission.watch(context.cancel)
        try:
            request = next(requests, None)
        finally:
            fired = self.admission.unwatch(watch)
        if fired:
            raise BodyTimeout(f"request message not received within body_timeout_s={self.admission.body_timeout_s}")
        return request

    def account(self, response: Any, context: grpc.ServicerContext) -> Any:
        """Count an answer against the budget until its call ends; refuse one that gRPC could not send."""
        size = response.ByteSize()
        if size > self.max_message_bytes:
            raise Overloaded(f"the answer would be {size} bytes > max_message_bytes {self.max_message_bytes}; "
                             "send fewer texts per request")
        self.admission.hold_answer(size)
        if not context.add_callback(partial(self.admission.answer_gone, size)):
            self.admission.answer_gone(size)  # the call has already ended
        return response

    def finish(self, tele: Call, context: grpc.ServicerContext, code: str, reason: str = "") -> None:
        """The call's span and access line ended, with the code its client gets."""
        tele.peer = context.peer  # asked only when the access line or the span needs it
        attributes = {"rpc.response.status_code": code, **_peer(tele.peer)} if tele.traced else None
        tele.finish(code, failed=code in SERVER_ERRORS, attributes=attributes, reason=reason)

    def _refusal(self, handler: grpc.RpcMethodHandler, method: str, error: ServingError,
                 tele: Call | None) -> grpc.RpcMethodHandler:
        """A request-streaming handler that only aborts: it never reads the body, so a client that never sends it
        holds nothing; it runs in gRPC's polling thread (`_Inline`)."""

        def abort(requests: Iterator[Any], context: grpc.ServicerContext, *callback: Any) -> Any:
            self.metrics.answered("grpc", method, error.code)
            if tele is not None:
                context.set_trailing_metadata(((REQUEST_ID, tele.request_id),))
                self.finish(tele, context, error.code, str(error))
            context.abort(grpc.StatusCode[error.code], str(error))

        abort.experimental_thread_pool = self.refusal_pool
        make = grpc.stream_stream_rpc_method_handler if handler.response_streaming else \
            grpc.stream_unary_rpc_method_handler
        return make(abort, response_serializer=handler.response_serializer)


class _Call:
    """The behaviours of one call of `method`: each holds a permit (a model call's, taken at admission or when it
    starts; a health thread's), reads under the watchdog, maps errors to codes, counts the call with the code its
    client got. A behaviour runs `with` the call (once: the call is its own context manager, so that a unary call's
    path runs no generator of contextlib's)."""

    __slots__ = ("gate", "method", "model", "permit", "tele", "context", "_start")

    def __init__(self, gate: Gate, method: str, model: bool, permit: Permit | None = None,
                 tele: Call | None = None) -> None:
        """permit: taken at admission (a unary model call); released when the behaviour ends. tele: its telemetry
        record (None for health)."""
        self.gate, self.method, self.model, self.permit = gate, method, model, permit
        self.tele = tele
        self.context: grpc.ServicerContext | None = None
        self._start = 0.0

    def __enter__(self) -> None:
        self._start = time.perf_counter()
        gate, tele, context = self.gate, self.tele, self.context
        if tele is not None:  # the request id is in the trailing metadata whatever the outcome
            context.set_trailing_metadata(((REQUEST_ID, tele.request_id),))
            tele.__enter__()
        try:
            if not self.model:
                refusal = gate.health_slots.acquire()
                if refusal is not None:
                    raise refusal
                self.permit = Permit(gate.health_slots)
            else:
                if self.permit is None:
                    self.permit = gate.admission.take()
                gate.admission.check_answers()  # refused before computing anything
        except BaseException as e:  # refused: said and counted as any other failure of the call
            self.__exit__(type(e), e, e.__traceback__)
            raise

    def __exit__(self, kind: type[BaseException] | None, error: BaseException | None, tb: Any) -> bool:
        """The call's code (the error's, or what the handler set), its permit given back, the call counted; a
        ServingError or a bug is said to the client in its code (context.abort raises here)."""
        gate, tele, context = self.gate, self.tele, self.context
        code, reason, abort = None, "", None
        if tele is not None:
            tele.__exit__(None, None, None)
        if isinstance(error, grpc.RpcError):
            code = "CANCELLED"  # the client went away: gRPC raised this itself and ends the call quietly
        elif isinstance(error, ServingError):
            code, reason = error.code, str(error)
            abort = (grpc.StatusCode[code], reason)
        elif isinstance(error, Exception):
            chosen = context.code()
            if chosen not in (None, grpc.StatusCode.OK):  # the handler chose its code (set_code, abort), then raised
                code, abort = chosen.name, (chosen, (context.details() or b"").decode("utf-8", "replace"))
            else:
                code = "INTERNAL"
                gate.errors.report(self.method, error)
                abort = (grpc.StatusCode.INTERNAL, "internal server error (details in the server log)")
        permit, self.permit = self.permit, None
        if permit is not None:
            permit.release()
        if code is None:  # also a code set without raising (health Check's NOT_FOUND)
            code = context.code().name if context.code() is not None else "OK"
        gate.metrics.answered("grpc", self.method, code, time.perf_counter() - self._start)
        if tele is not None:
            gate.finish(tele, context, code, reason)
        if abort is not None:
            context.abort(*abort)
        return False

    def unary(self, inner: Callable[[Any, grpc.ServicerContext], Any]) -> Callable[..., Any]:
        def behavior(requests: Iterator[Any], context: grpc.ServicerContext) -> Any:
            self.context = context
            with self:
                request = self.gate.first(requests, context, self.method)
                return self.gate.account(inner(request, context), context) if self.model else \
                    inner(request, context)

        return behavior

    def watch(self, inner: Callable[..., Any]) -> Callable[..., Any]:
        def behavior(requests: Iterator[Any], context: grpc.ServicerContext, send: Any = None) -> Any:
            self.context = context
            with self:
                return inner(self.gate.first(requests, context, self.method), context, send)

        behavior.experimental_non_blocking = getattr(inner, "experimental_non_blocking", False)
        return behavior

    def stream(self, inner: Callable[[Iterator[Any], grpc.ServicerContext], Iterator[Any]]) -> Callable[..., Any]:
        def messages(requests: Iterator[Any], context: grpc.ServicerContext) -> Iterator[Any]:
            while (request := self.gate.next_message(requests, context)) is not None:
                yield request

        def behavior(requests: Iterator[Any], context: grpc.ServicerContext) -> Iterator[Any]:
            self.context = context
            with self:  # held while the stream lives
                yield from inner(messages(requests, context), context)

        return behavior


def _peer(peer: str) -> dict[str, Any]:
    """network.peer.* of a gRPC peer string ("ipv4:127.0.0.1:5000", "ipv6:[::1]:5000", "unix:/path")."""
    kind, _, address = peer.partition(":")
    if kind in ("ipv4", "ipv6"):
        host, _, port = address.rpartition(":")
        if port.isdigit():
            return {"network.peer.address": host.strip("[]"), "network.peer.port": int(port)}
    return {"network.peer.address": address} if address else {}
