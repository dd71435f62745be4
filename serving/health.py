"""grpc.health.v1 for the server: Check and Watch from grpcio-health-checking, plus List (which its servicer leaves
unimplemented). One instance answers on the gRPC port and on the health port alike."""

from __future__ import annotations

import threading

import grpc
from grpc_health.v1 import health, health_pb2

SERVICE_NAME = health.SERVICE_NAME


class Health(health.HealthServicer):
    """Statuses by service name ("" = the whole server)."""

    def __init__(self) -> None:
        super().__init__(experimental_non_blocking=True)  # Watch holds no thread between its answers
        self._statuses: dict[str, int] = {"": health_pb2.HealthCheckResponse.SERVING}
        self._statuses_lock = threading.Lock()

    def set(self, service: str, status: int) -> None:
        super().set(service, status)
        with self._statuses_lock:  # enter_graceful_shutdown() goes through set() too
            self._statuses[service] = status

    def List(self, request: health_pb2.HealthListRequest,  # noqa: N802 (gRPC method names)
             context: grpc.ServicerContext) -> health_pb2.HealthListResponse:
        with self._statuses_lock:
            statuses = dict(self._statuses)
        return health_pb2.HealthListResponse(
            statuses={name: health_pb2.HealthCheckResponse(status=s) for name, s in statuses.items()})
