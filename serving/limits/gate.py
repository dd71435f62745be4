"""The gate every gRPC call passes: authentication, admission, time to send the body, bytes of answers held, codes.

`Gate` is the server's one gRPC interceptor. gRPC's threaded server runs interceptors in its polling thread, before a
handler thread is taken; a unary handler's thread would then wait for the request body without bound. So every
handler is re-made here as request-streaming, which lets the gate refuse from the call's metadata alone, before its
body is read and without a thread: a call without a valid token, and a model call when every model slot is taken,
the answers in flight fill their budget or the batching queue has no room for a request of max_texts. A unary model
call takes its slot here too, so that no admitted call waits in the pool's queue. A call then reads its message
under a watchdog that cancels it when the body has not arrived within `body_timeout_s`.

Per-address limits (connections, call rates, failed logins) are the front proxy's (deploy/proxy/): only the edge
sees a client's real address. The bounds themselves are serving/limits/bounds.py. Health runs on a pool of its own
threads, so no model traffic can starve it. Errors become status codes here (ServingError subclasses; anything else
is a bug: INTERNAL, its traceback logged with a rate limit). Every call is counted with the code its client got.
"""

from __future__ import annotations

import hmac
import logging
import time
from collections.abc import Callable, Iterator
from concurrent import futures
from contextlib import contextmanager
from typing import Any

import grpc
from google.protobuf.message import DecodeError

from serving.errors import BodyTimeout, InvalidInput, Overloaded, ServingError, Unauthenticated
from serving.limits.bounds import LogThrottle, ResponseBudget, Slots, Watchdog
from serving.limits.memory import Reclaimer
from serving.metrics import Metrics

log = logging.getLogger(__name__)

HEALTH_PREFIX = "/grpc.health.v1.Health/"  # open without a token (load balancers, probes)


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

    def __init__(self, metrics: Metrics, *, auth_token: str | None, max_calls: int, health_workers: int,
                 body_timeout_s: float, max_message_bytes: int, max_response_bytes: int,
                 reclaimer: Reclaimer | None = None, queue_full: Callable[[], str | None] = lambda: None) -> None:
        """queue_full: why the batcher might have no room for the call's texts (their number is known only once its
        body is read), or None (model calls are then refused at admission with that reason)."""
        self.metrics = metrics
        self.queue_full = queue_full
        self.expected = f"Bearer {auth_token}".encode() if auth_token else None
        self.body_timeout_s = body_timeout_s
        self.model_slots = Slots(max_calls, "model", reclaimer)
        self.health_slots = Slots(health_workers, "health")
        self.health_pool = futures.ThreadPoolExecutor(health_workers, thread_name_prefix="health")
        self.refusal_pool = _Inline()  # refusals only abort: done in gRPC's polling thread, where they arrive
        self.watchdog = Watchdog(body_timeout_s, on_fire=metrics.body_timeouts.inc)
        self.budget = ResponseBudget(max_response_bytes, metrics, reclaimer)
        self.max_message_bytes = max_message_bytes
        self.throttle = LogThrottle()

    def close(self) -> None:
        self.watchdog.close()
        self.health_pool.shutdown(wait=False, cancel_futures=True)

    def _authorized(self, details: grpc.HandlerCallDetails) -> bool:
        if self.expected is None or details.method.startswith(HEALTH_PREFIX):
            return True
        for key, value in details.invocation_metadata or ():
            if key == "authorization":
                given = value.encode() if isinstance(value, str) else value
                return hmac.compare_digest(given, self.expected)
        return False

    def intercept_service(self, continuation, details):
        handler = continuation(details)
        if handler is None:
            return None  # unknown method: grpc answers UNIMPLEMENTED at once, without a thread
        method = details.method.lstrip("/")
        if not self._authorized(details):
            return self._refusal(handler, method, Unauthenticated("missing or wrong bearer token (metadata "
                                                                  "'authorization: Bearer <token>')"), auth=True)
        health = details.method.startswith(HEALTH_PREFIX)
        if not health:  # admission: refused here, in gRPC's polling thread, rather than after a wait for a thread
            refusal = self.admission()
            if refusal is not None:
                return self._refusal(handler, method, refusal)
        # A unary model call takes its slot here, before gRPC queues it for a thread of its pool: a call that got
        # past admission is one the pool has a thread for, never one that waits in the pool's queue to be refused
        # there. (Streams, reflection's, take theirs when they start: a generator's code runs only once iterated.)
        prepaid = not health and handler.unary_unary is not None
        call = _Call(self, method, self.health_slots if health else self.model_slots, model=not health,
                     prepaid=prepaid)
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
        if prepaid:
            refusal = self.model_slots.acquire()  # released when the behaviour ends (gRPC always runs it)
            if refusal is not None:
                return self._refusal(handler, method, refusal)
        return made

    def admission(self) -> Overloaded | None:
        """Why a model call would be refused now (every model slot taken, the answers in flight over their budget,
        or the batching queue full), or None. Read without a lock: the slot itself is taken later, and refuses on its
        own."""
        slots, budget = self.model_slots, self.budget
        if slots.used >= slots.limit:
            return Overloaded(f"server busy: {slots.used} model calls in progress (limit {slots.limit}); retry later")
        if budget.spent:
            return Overloaded(f"{budget.used} bytes of answers wait for their clients (max_response_bytes_in_flight "
                              f"{budget.limit}); retry later")
        full = self.queue_full()
        if full:
            return Overloaded(full)
        return None

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
        with self.watchdog.watching(context.cancel) as watch:
            request = next(requests, None)
        if watch.fired:
            raise BodyTimeout(f"request message not received within body_timeout_s={self.body_timeout_s}")
        return request

    def account(self, response: Any, context: grpc.ServicerContext) -> Any:
        """Count an answer against the budget until its call ends; refuse one that gRPC could not send."""
        size = response.ByteSize()
        if size > self.max_message_bytes:
            raise Overloaded(f"the answer would be {size} bytes > max_message_bytes {self.max_message_bytes}; "
                             "send fewer texts per request")
        self.budget.reserve(size)
        if not context.add_callback(lambda: self.budget.release(size)):
            self.budget.release(size)  # the call has already ended
        return response

    def log_internal(self, method: str, error: Exception) -> None:
        allowed, suppressed = self.throttle.allow(f"{method}:{type(error).__name__}")
        if allowed:
            more = f" ({suppressed} more like it not logged)" if suppressed else ""
            log.error("internal error in %s%s", method, more, exc_info=error)
        else:
            self.metrics.suppressed_logs.inc()

    def _refusal(self, handler: grpc.RpcMethodHandler, method: str, error: ServingError,
                 auth: bool = False) -> grpc.RpcMethodHandler:
        """A request-streaming handler that only aborts: it never reads the body, so a client that never sends it
        holds nothing; it runs in gRPC's polling thread (`_Inline`). auth: a failed authentication, counted."""

        def abort(requests: Iterator[Any], context: grpc.ServicerContext, *callback: Any) -> Any:
            if auth:
                self.metrics.auth_failures.inc()
            self.metrics.requests.labels(method, error.code).inc()
            context.abort(grpc.StatusCode[error.code], str(error))

        abort.experimental_thread_pool = self.refusal_pool
        make = grpc.stream_stream_rpc_method_handler if handler.response_streaming else \
            grpc.stream_unary_rpc_method_handler
        return make(abort, response_serializer=handler.response_serializer)


class _Call:
    """The behaviours of one call of `method`: each takes a slot (or holds the one taken at admission), reads under
    the watchdog, maps errors to codes, counts the call with the code its client got."""

    def __init__(self, gate: Gate, method: str, slots: Slots, model: bool, prepaid: bool = False) -> None:
        """prepaid: its slot was taken at admission; it is released when the behaviour ends."""
        self.gate, self.method, self.slots, self.model, self.prepaid = gate, method, slots, model, prepaid

    @contextmanager
    def _served(self, context: grpc.ServicerContext) -> Iterator[None]:
        start, code = time.perf_counter(), None
        prepaid = self.prepaid  # a slot this call holds, released at the end whatever happens
        try:
            if not prepaid:
                refusal = self.slots.acquire()
                if refusal is not None:
                    raise refusal
                prepaid = True
            if self.model and self.gate.budget.spent:  # refused before computing anything
                b = self.gate.budget
                raise Overloaded(f"{b.used} bytes of answers wait for their clients "
                                 f"(max_response_bytes_in_flight {b.limit}); retry later")
            yield
        except grpc.RpcError:
            code = "CANCELLED"  # the client went away: gRPC raised this itself and ends the call quietly
            raise
        except ServingError as e:
            code = e.code
            context.abort(grpc.StatusCode[e.code], str(e))
        except Exception as e:
            chosen = context.code()
            if chosen not in (None, grpc.StatusCode.OK):  # the handler chose its code (set_code, abort), then raised
                code = chosen.name
                context.abort(chosen, (context.details() or b"").decode("utf-8", "replace"))
            code = "INTERNAL"
            self.gate.log_internal(self.method, e)
            context.abort(grpc.StatusCode.INTERNAL, "internal server error (details in the server log)")
        finally:
            if prepaid:
                self.slots.release()
            if code is None:  # also a code set without raising (health Check's NOT_FOUND)
                code = context.code().name if context.code() is not None else "OK"
            self.gate.metrics.requests.labels(self.method, code).inc()
            self.gate.metrics.request_seconds.labels(self.method).observe(time.perf_counter() - start)

    def unary(self, inner: Callable[[Any, grpc.ServicerContext], Any]) -> Callable[..., Any]:
        def behavior(requests: Iterator[Any], context: grpc.ServicerContext) -> Any:
            with self._served(context):
                request = self.gate.first(requests, context, self.method)
                return self.gate.account(inner(request, context), context) if self.model else \
                    inner(request, context)

        return behavior

    def watch(self, inner: Callable[..., Any]) -> Callable[..., Any]:
        def behavior(requests: Iterator[Any], context: grpc.ServicerContext, send: Any = None) -> Any:
            with self._served(context):
                return inner(self.gate.first(requests, context, self.method), context, send)

        behavior.experimental_non_blocking = getattr(inner, "experimental_non_blocking", False)
        return behavior

    def stream(self, inner: Callable[[Iterator[Any], grpc.ServicerContext], Iterator[Any]]) -> Callable[..., Any]:
        def messages(requests: Iterator[Any], context: grpc.ServicerContext) -> Iterator[Any]:
            while (request := self.gate.next_message(requests, context)) is not None:
                yield request

        def behavior(requests: Iterator[Any], context: grpc.ServicerContext) -> Iterator[Any]:
            with self._served(context):  # held while the stream lives
                yield from inner(messages(requests, context), context)

        return behavior
