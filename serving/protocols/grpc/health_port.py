"""grpc.health.v1 on a port of its own, for probes (Kubernetes' gRPC probes, load balancers): plain text (those
probes speak no TLS; health carries no data), no token, nothing else served (every other method is UNIMPLEMENTED).

Served by gRPC's asyncio server on an event loop in a thread of its own, not by threads: a threaded server gives each
call a thread that first waits for the request message, so calls that never send it could hold every thread and
fail the probes queued behind them (tests/test_reliability_attacks.py). Here such a call is a coroutine, costing
memory (about 24 KB while it lasts, docs/RELIABILITY.md) and ending after body_timeout_s; the connection options of
the gRPC port apply. Statuses come from the server's one `Health` (serving/protocols/grpc/health.py); every call is
counted in `sentiment_requests_total` with the code its client got.
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Awaitable, Callable, Coroutine
from typing import Any

import grpc
from google.protobuf.message import DecodeError
from grpc_health.v1 import health_pb2

from serving.errors import ServerConfigError
from serving.limits.bounds import Busy
from serving.protocols.grpc.health import SERVICE_NAME, Health
from serving.telemetry.prometheus import Metrics

_Response = health_pb2.HealthCheckResponse


class _Refused(Exception):
    def __init__(self, code: grpc.StatusCode, details: str) -> None:
        super().__init__(details)
        self.code, self.details = code, details


class HealthPort:
    """Binds in the constructor (ServerConfigError when the port is taken); serves from `start()` to `stop()`."""

    def __init__(self, health: Health, metrics: Metrics, host: str, port: int, options: list[tuple[str, Any]],
                 body_timeout_s: float, reclaimer: Busy | None = None) -> None:
        """`reclaimer` counts every call in progress as work (serving/process/memory.py): the memory of many calls comes
        back once they are over."""
        self.health, self.metrics, self.body_timeout_s = health, metrics, body_timeout_s
        self.reclaimer = reclaimer
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name="health-port", daemon=True)
        self._thread.start()
        try:
            self.port: int = self._run(self._bind(host, port, options))
        except BaseException:
            self._close_loop()
            raise
        health.listen(lambda: self._loop.call_soon_threadsafe(self._changed))

    def start(self) -> None:
        self._run(self._server.start())

    def stop(self) -> None:
        if self._loop.is_closed():
            return
        self._run(self._server.stop(0))
        self._close_loop()

    def _run(self, coroutine: Coroutine[Any, Any, Any]) -> Any:
        return asyncio.run_coroutine_threadsafe(coroutine, self._loop).result(30)

    def _close_loop(self) -> None:
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(10)
        self._loop.close()

    async def _bind(self, host: str, port: int, options: list[tuple[str, Any]]) -> int:
        self._change = asyncio.Event()  # set (and replaced) at every status change
        self._server = grpc.aio.server(options=options)
        self._server.add_generic_rpc_handlers([grpc.method_handlers_generic_handler(SERVICE_NAME, {
            "Check": grpc.stream_unary_rpc_method_handler(
                self._call("Check", self._check), response_serializer=_Response.SerializeToString),
            "List": grpc.stream_unary_rpc_method_handler(
                self._call("List", self._list), response_serializer=health_pb2.HealthListResponse.SerializeToString),
            "Watch": grpc.stream_stream_rpc_method_handler(
                self._call("Watch", self._watch), response_serializer=_Response.SerializeToString),
        })])
        try:
            return self._server.add_insecure_port(f"{host}:{port}")
        except RuntimeError as e:
            raise ServerConfigError(f"cannot listen on {host}:{port} (health): {e}") from None

    def _changed(self) -> None:
        """In the loop: wake every Watch."""
        self._change.set()
        self._change = asyncio.Event()

    def _call(self, method: str, serve: Callable[[Any, grpc.aio.ServicerContext], Awaitable[Any]],
              ) -> Callable[[Any, grpc.aio.ServicerContext], Awaitable[Any]]:
        """A behaviour that reads the one request message within body_timeout_s, calls `serve(request, context)`,
        maps refusals to status codes and counts the call."""
        name = f"{SERVICE_NAME}/{method}"
        request_type = health_pb2.HealthListRequest if method == "List" else health_pb2.HealthCheckRequest

        async def behavior(requests: Any, context: grpc.aio.ServicerContext) -> Any:
            code = "OK"
            if self.reclaimer is not None:
                self.reclaimer.enter()
            try:
                return await serve(await self._first(request_type, context), context)
            except _Refused as e:
                code = e.code.name
                await context.abort(e.code, e.details)
            except asyncio.CancelledError:  # the client went away, or the server stops
                code = "CANCELLED"
                raise
            finally:
                self.metrics.answered("grpc", name, code)
                if self.reclaimer is not None:
                    self.reclaimer.leave()

        return behavior

    async def _first(self, request_type: type, context: grpc.aio.ServicerContext) -> Any:
        try:
            raw = await asyncio.wait_for(context.read(), self.body_timeout_s)
        except TimeoutError:
            raise _Refused(grpc.StatusCode.CANCELLED,
                           f"request message not received within body_timeout_s={self.body_timeout_s}") from None
        if raw is grpc.aio.EOF:
            raise _Refused(grpc.StatusCode.INVALID_ARGUMENT, "the call ended without its request message")
        try:
            return request_type.FromString(raw)
        except DecodeError as e:
            raise _Refused(grpc.StatusCode.INVALID_ARGUMENT, f"request does not parse: {e}") from None

    async def _check(self, request: health_pb2.HealthCheckRequest, context: grpc.aio.ServicerContext) -> _Response:
        status = self.health.statuses().get(request.service)
        if status is None:
            raise _Refused(grpc.StatusCode.NOT_FOUND, f"unknown service {request.service!r}")
        return _Response(status=status)

    async def _list(self, request: health_pb2.HealthListRequest,
                    context: grpc.aio.ServicerContext) -> health_pb2.HealthListResponse:
        return health_pb2.HealthListResponse(
            statuses={name: _Response(status=s) for name, s in self.health.statuses().items()})

    async def _watch(self, request: health_pb2.HealthCheckRequest, context: grpc.aio.ServicerContext) -> None:
        """The service's status now (SERVICE_UNKNOWN when it has none), then each change, until the client leaves."""
        last = None
        while True:
            change = self._change  # taken before reading: a change in between wakes the wait below at once
            status = self.health.statuses().get(request.service, _Response.SERVICE_UNKNOWN)
            if status != last:
                await context.write(_Response(status=status))
                last = status
            await change.wait()
