"""One server process: the bundle's predictor and batcher, the gRPC server with its gate, health, reflection and
metrics, and its lifecycle (start, drain, stop). `python -m serving.server` (serving/server.py) builds one from the
command line; `--workers N` runs N of them on one port under a parent (serving/workers.py).
"""

from __future__ import annotations

import logging
import socket
import threading
import time
from concurrent import futures
from pathlib import Path

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from serving import reflection
from serving.batcher import Batcher
from serving.config import ServerConfig
from serving.errors import ServerConfigError
from serving.gate import Gate
from serving.gen.inference import grpc_service_pb2, grpc_service_pb2_grpc
from serving.gen.sentiment.v1 import sentiment_service_pb2, sentiment_service_pb2_grpc
from serving.health import SERVICE_NAME as HEALTH_SERVICE
from serving.health import Health
from serving.health_port import HealthPort
from serving.kserve import KServeServicer
from serving.memory import Reclaimer, fix_mmap_threshold
from serving.metrics import Metrics, MetricsServer
from serving.predictor import Predictor
from serving.servicer import SentimentServicer, ServingCore

log = logging.getLogger("serving.server")

SENTIMENT_SERVICE = sentiment_service_pb2.DESCRIPTOR.services_by_name["SentimentService"].full_name
KSERVE_SERVICE = grpc_service_pb2.DESCRIPTOR.services_by_name["GRPCInferenceService"].full_name
# Calls gRPC itself may hold at once besides our pools' threads (refusals queued for the refusal pool): past this
# backstop gRPC refuses in its polling thread, before any of our code runs. Only a flood reaches it.
_BACKSTOP = 512


def transport_options(cfg: ServerConfig, shared_port: bool = False) -> list[tuple[str, int]]:
    """gRPC core's per-connection bounds, from the config (each field's comment says why its default).
    shared_port: the port is shared with the other workers of serving/workers.py (SO_REUSEPORT)."""
    ms = lambda seconds: int(seconds * 1000)  # noqa: E731
    return [
        ("grpc.max_receive_message_length", cfg.max_message_bytes),
        ("grpc.max_send_message_length", cfg.max_message_bytes),
        ("grpc.so_reuseport", int(shared_port)),  # else a taken port is an error, not a silently shared one
        ("grpc.max_concurrent_streams", cfg.max_streams_per_connection),
        ("grpc.server_handshake_timeout_ms", ms(cfg.handshake_timeout_s)),
        ("grpc.max_connection_idle_ms", ms(cfg.max_connection_idle_s)),
        ("grpc.max_connection_age_ms", ms(cfg.max_connection_age_s)),
        ("grpc.max_connection_age_grace_ms", ms(cfg.max_connection_age_grace_s)),
        ("grpc.http2.min_ping_interval_without_data_ms", ms(cfg.min_client_ping_interval_s)),
        ("grpc.http2.max_ping_strikes", cfg.max_ping_strikes),
        ("grpc.keepalive_permit_without_calls", int(cfg.keepalive_without_calls)),
    ]


class SentimentServer:
    """Load a bundle, serve it. `start()`, then `stop()` (or `with SentimentServer(...) as s:`)."""

    def __init__(self, bundle: str | Path, cfg: ServerConfig | None = None, *, shared_port: bool = False) -> None:
        """shared_port: one worker of serving/workers.py, whose parent holds `cfg.port` (SO_REUSEPORT) and serves
        health and metrics for all."""
        self.cfg = cfg = cfg or ServerConfig()
        self.shared_port = shared_port
        fix_mmap_threshold(cfg.malloc_mmap_threshold_bytes)  # process-wide, before the model's and gRPC's buffers
        self.predictor = Predictor(bundle, device=cfg.device, intra_op_threads=cfg.intra_op_threads,
                                   inter_op_threads=cfg.inter_op_threads, optimization=cfg.optimization,
                                   spinning=cfg.ort_spinning)
        cfg.check_bundle_fit(self.predictor.max_len)
        metrics_host = cfg.metrics_host or cfg.host
        check_ports_free([("gRPC", cfg.host, None if shared_port else cfg.port), ("health", cfg.host, cfg.health_port),
                          ("metrics", metrics_host, cfg.metrics_port)])
        self.metrics = Metrics(per_worker=shared_port)
        self.batcher = Batcher(
            self.predictor.infer,
            max_batch_size=cfg.max_batch_size,
            max_batch_tokens=cfg.max_batch_tokens,
            max_queue_delay_s=cfg.max_queue_delay_ms / 1000,
            max_queue=cfg.max_queue,
            max_padding=cfg.max_padding,
            workers=cfg.batch_workers,
            enabled=cfg.batching,
            metrics=self.metrics,
        )
        self.core = ServingCore(self.predictor, self.batcher, cfg)
        self.health = Health()
        limit = cfg.max_concurrent_rpcs or cfg.max_workers
        # Memory freed by a burst of model calls goes back to the system once they are over (serving/memory.py).
        self.reclaimer: Reclaimer | None = None
        if cfg.memory_reclaim_idle_s > 0:
            self.reclaimer = Reclaimer(settle_s=cfg.memory_reclaim_idle_s,
                                       on_reclaim=self.metrics.memory_reclaim_seconds.observe)
        self.gate = Gate(self.metrics, auth_token=cfg.auth_token, max_calls=limit, health_workers=cfg.health_workers,
                         body_timeout_s=cfg.body_timeout_s, max_message_bytes=cfg.max_message_bytes,
                         max_response_bytes=cfg.max_response_bytes_in_flight, reclaimer=self.reclaimer)
        # The gate counts a call until its behaviour returns; the thread then still sends the answer, so a caller
        # that sends its next request at once can need a second thread. Without spare threads, 128 closed-loop
        # callers at max_workers 128 were refused 184 times in 159k requests (bench/soak.py, docs/RELIABILITY.md):
        # the pool gets a headroom of a quarter (at least 8).
        threads = cfg.max_workers + max(8, limit // 4)
        self.grpc_server = grpc.server(
            futures.ThreadPoolExecutor(max_workers=threads, thread_name_prefix="grpc"),
            interceptors=[self.gate], options=transport_options(cfg, shared_port),
            maximum_concurrent_rpcs=threads + cfg.health_workers + _BACKSTOP,
        )
        sentiment_service_pb2_grpc.add_SentimentServiceServicer_to_server(SentimentServicer(self.core),
                                                                         self.grpc_server)
        grpc_service_pb2_grpc.add_GRPCInferenceServiceServicer_to_server(KServeServicer(self.core), self.grpc_server)
        health_pb2_grpc.add_HealthServicer_to_server(self.health, self.grpc_server)
        reflection.enable(self.grpc_server, {SENTIMENT_SERVICE: sentiment_service_pb2.DESCRIPTOR,
                                             KSERVE_SERVICE: grpc_service_pb2.DESCRIPTOR,
                                             HEALTH_SERVICE: health_pb2.DESCRIPTOR})
        self.health_server: HealthPort | None = None
        self.health_port: int | None = None
        self._metrics_server: MetricsServer | None = None
        self.metrics_port: int | None = None
        try:
            self.port = _add_port(self.grpc_server, cfg.host, cfg.port, _server_credentials(cfg), "gRPC")
            if cfg.health_port is not None:  # health alone, for probes: serving/health_port.py
                self.health_server = HealthPort(self.health, self.metrics, cfg.host, cfg.health_port,
                                                transport_options(cfg), cfg.body_timeout_s, self.reclaimer)
                self.health_port = self.health_server.port
            if cfg.metrics_port is not None:
                try:
                    self._metrics_server = MetricsServer(self.metrics.registry, metrics_host, cfg.metrics_port)
                except OSError as e:
                    raise ServerConfigError(f"cannot listen on {metrics_host}:{cfg.metrics_port} (metrics): "
                                      f"{e.strerror or e}") from None
                self.metrics_port = self._metrics_server.port
        except ServerConfigError:
            self._close_listeners()
            self.batcher.close(timeout=0)
            raise
        self._stopped = threading.Event()

    def start(self) -> SentimentServer:
        self.grpc_server.start()
        if self.health_server is not None:
            self.health_server.start()
        if self._metrics_server is not None:
            self._metrics_server.start()
        for service in ("", SENTIMENT_SERVICE, KSERVE_SERVICE):
            self.health.set(service, health_pb2.HealthCheckResponse.SERVING)
        self.core.ready = True
        # A worker's line must not read as the server's "listening on" (scripts wait for that one, the parent's).
        log.info("%s %s:%d (%s%s), model %r on %s, batching %s, health port %s, metrics %s",
                 "worker serving on" if self.shared_port else "listening on", self.cfg.host, self.port,
                 "mutual TLS" if self.cfg.tls_client_ca else "TLS" if self.cfg.tls_cert else "plaintext",
                 ", token auth" if self.cfg.auth_token else "", self.cfg.model_name, self.predictor.provider,
                 "on" if self.cfg.batching else "off",
                 f":{self.health_port}" if self.health_port is not None else "off",
                 f"on {self.cfg.metrics_host or self.cfg.host}:{self.metrics_port}" if self.metrics_port is not None
                 else "off")
        return self

    def stop(self, grace: float | None = None) -> None:
        """Health NOT_SERVING; after drain_delay_s refuse new requests (UNAVAILABLE) and let in-flight ones
        finish within `grace` seconds; drain the batcher; close."""
        if self._stopped.is_set():
            return
        grace = self.cfg.grace_s if grace is None else grace
        self.core.draining = True
        self.health.enter_graceful_shutdown()
        if self.cfg.drain_delay_s:
            log.info("NOT_SERVING; still serving for drain_delay_s=%.1f s", self.cfg.drain_delay_s)
            time.sleep(self.cfg.drain_delay_s)
        # Refuse new work ourselves (UNAVAILABLE, which clients retry elsewhere) and let accepted work finish
        # before closing the listener: gRPC cancels calls that reach it during its own shutdown before a
        # handler picks them up, and a client reads CANCELLED.
        end = time.monotonic() + grace
        if not self.core.refuse_and_wait(grace):
            log.warning("grace %.1f s over with requests still running: they are cancelled", grace)
        self.grpc_server.stop(max(0.0, end - time.monotonic())).wait()
        self.batcher.close(timeout=grace)
        self._close_listeners()
        self._stopped.set()
        log.info("stopped")

    def _close_listeners(self) -> None:
        if self.health_server is not None:
            self.health_server.stop()
        if self._metrics_server is not None:
            self._metrics_server.close()
        self.gate.close()
        if self.reclaimer is not None:
            self.reclaimer.close()

    def __enter__(self) -> SentimentServer:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()


def check_ports_free(listeners: list[tuple[str, str, int | None]]) -> None:
    """ServerConfigError naming the first port that is taken (or given twice), before anything listens. Port 0 and
    None (a listener that is off) are skipped."""
    seen: dict[int, str] = {}
    for what, host, port in listeners:
        if not port:
            continue
        if port in seen:
            raise ServerConfigError(f"port {port} is given to both {seen[port]} and {what}")
        seen[port] = what
        try:
            family, kind, proto, _, address = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM,
                                                                 flags=socket.AI_PASSIVE)[0]
            with socket.socket(family, kind, proto) as probe:
                probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as gRPC and http.server bind
                probe.bind(address)
        except OSError as e:
            raise ServerConfigError(f"cannot listen on {host}:{port} ({what}): {e.strerror or e}") from None


def _add_port(server: grpc.Server, host: str, port: int, credentials: grpc.ServerCredentials | None,
              what: str) -> int:
    address = f"{host}:{port}"
    try:
        if credentials is not None:
            return server.add_secure_port(address, credentials)
        return server.add_insecure_port(address)
    except RuntimeError as e:
        raise ServerConfigError(f"cannot listen on {address} ({what}): {e}") from None


def _server_credentials(cfg: ServerConfig) -> grpc.ServerCredentials | None:
    if not cfg.tls_cert:
        return None
    key, cert = Path(cfg.tls_key).read_bytes(), Path(cfg.tls_cert).read_bytes()
    ca = Path(cfg.tls_client_ca).read_bytes() if cfg.tls_client_ca else None
    return grpc.ssl_server_credentials([(key, cert)], root_certificates=ca, require_client_auth=ca is not None)
