"""grpc.health.v1 for the server: Check and Watch from grpcio-health-checking, plus List (which its servicer leaves
unimplemented). One instance holds the statuses: the gRPC port serves it, the health port
(serving/protocols/grpc/health_port.py) reads it."""

from __future__ import annotations

import threading
from collections.abc import Callable

import grpc
from grpc_health.v1 import health, health_pb2

SERVICE_NAME = health.SERVICE_NAME


class Health(health.HealthServicer):
    """Statuses by service name ("" = the whole server)."""

    def __init__(self) -> None:
        super().__init__(experimental_non_blocking=True)  # Watch holds no thread between its answers
        self._statuses: dict[str, int] = {"": health_pb2.HealthCheckResponse.SERVING}
        self._statuses_lock = threading.Lock()
        self._listeners: list[Callable[[], None]] = []

    def set(self, service: str, status: int) -> None:
        super().set(service, status)
        with self._statuses_lock:  # enter_graceful_shutdown() goes through set() too
            self._statuses[service] = status
            listeners = list(self._listeners)
        for listener in listeners:
            listener()

    def listen(self, listener: Callable[[], None]) -> None:
        """`listener()` is called (in the thread that changed it) after every status change."""
        with self._statuses_lock:
            self._listeners.append(listener)

    def serving(self) -> bool:
        """The whole server ("") says SERVING."""
        with self._statuses_lock:
            return self._statuses.get("") == health_pb2.HealthCheckResponse.SERVING

    def statuses(self) -> dict[str, int]:
        """A copy of every service's status."""
        with self._statuses_lock:
            return dict(self._statuses)

    def List(self, request: health_pb2.HealthListRequest,
             context: grpc.ServicerContext) -> health_pb2.HealthListResponse:
        return health_pb2.HealthListResponse(
            statuses={name: health_pb2.HealthCheckResponse(status=s) for name, s in self.statuses().items()})
