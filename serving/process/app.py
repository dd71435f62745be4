"""One server process: the bundle's predictor and batcher, one admission, the gRPC server with its gate, health,
reflection and metrics, the HTTP server on the same core and admission (serving/protocols/http/), and its lifecycle
(start, drain, stop).
`python -m serving.server` (serving/server.py) builds one from the command line; `--workers N` runs N of them on one
port under a parent (serving/process/workers.py).
"""

from __future__ import annotations

import ipaddress
import logging
import ssl
import sys
import threading
import time
from concurrent import futures
from pathlib import Path

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc
from prometheus_client import CollectorRegistry

from serving.config import ServerConfig
from serving.errors import ServerConfigError
from serving.gen.inference import grpc_service_pb2, grpc_service_pb2_grpc
from serving.gen.sentiment.v1 import sentiment_service_pb2, sentiment_service_pb2_grpc
from serving.limits.admission import Admission
from serving.model.batcher import Batcher
from serving.model.core import ServingCore
from serving.model.models import Models
from serving.model.predictor import Predictor
from serving.model.repository import RepositoryError
from serving.model.turns import Turns
from serving.process.memory import Reclaimer, fix_mmap_threshold
from serving.protocols.grpc import reflection
from serving.protocols.grpc.health import SERVICE_NAME as HEALTH_SERVICE
from serving.protocols.grpc.health import Health
from serving.protocols.grpc.health_port import HealthPort
from serving.protocols.grpc.interceptor import Gate
from serving.protocols.grpc.kserve import KServeServicer
from serving.protocols.grpc.sentiment import SentimentServicer
from serving.protocols.http.exchange import HttpCalls
from serving.protocols.http.routes import router
from serving.protocols.http.server import HttpServer
from serving.protocols.kserve_v2 import server_version
from serving.protocols.repository_api import RepositoryApi
from serving.telemetry import tracing
from serving.telemetry.call_log import CallLog
from serving.telemetry.logs import InternalErrors
from serving.telemetry.prometheus import Metrics, MetricsServer

log = logging.getLogger(__name__)

SENTIMENT_SERVICE = sentiment_service_pb2.DESCRIPTOR.services_by_name["SentimentService"].full_name
KSERVE_SERVICE = grpc_service_pb2.DESCRIPTOR.services_by_name["GRPCInferenceService"].full_name
# Calls gRPC itself may hold at once besides our pools' threads (calls queued for a thread: streams, health past its
# pool; refusals and unary model calls never queue, serving/protocols/grpc/interceptor.py): past this backstop gRPC
# refuses in its polling thread, before any of our code runs. Only a flood reaches it.
_BACKSTOP = 512
# the one-host deployment: the proxy in front of the server
COMPOSE_UP = "`docker compose up -d` or `podman-compose up -d` with the repository's compose.yaml"


def transport_options(cfg: ServerConfig, shared_port: bool = False) -> list[tuple[str, int]]:
    """gRPC core's per-connection bounds, from the config (each field's comment says why its default).
    shared_port: the port is shared with the other workers of serving/process/workers.py (SO_REUSEPORT)."""
    ms = lambda seconds: int(seconds * 1000)  # noqa: E731
    return [
        ("grpc.max_receive_message_length", cfg.max_message_bytes),
        ("grpc.max_send_message_length", cfg.max_message_bytes),
        ("grpc.so_reuseport", int(shared_port)),  # else a taken port is an error, not a silently shared one
        ("grpc.max_concurrent_streams", cfg.max_streams_per_connection),
        ("grpc.max_allowed_incoming_connections", cfg.max_connections),  # closed at accept past it
        # Each stream's receive window stays at 64 KiB (no BDP probe to grow it): a call refused before its body
        # was read, or over max_message_bytes, brings at most that much unread data into the server.
        ("grpc.http2.bdp_probe", 0),
        ("grpc.http2.lookahead_bytes", 64 * 1024),
        ("grpc.server_handshake_timeout_ms", ms(cfg.handshake_timeout_s)),
        ("grpc.max_connection_idle_ms", ms(cfg.max_connection_idle_s)),
        ("grpc.max_connection_age_ms", ms(cfg.max_connection_age_s)),
        ("grpc.max_connection_age_grace_ms", ms(cfg.max_connection_age_grace_s)),
        ("grpc.http2.min_ping_interval_without_data_ms", ms(cfg.min_client_ping_interval_s)),
        ("grpc.http2.max_ping_strikes", cfg.max_ping_strikes),
        ("grpc.keepalive_permit_without_calls", int(cfg.keepalive_without_calls)),
    ]


def configure_process(cfg: ServerConfig, worker: int | None = None) -> None:
    """Process-wide settings, once per server process and before the model's and gRPC's buffers exist: glibc's
    mmap threshold (serving/process/memory.py), the interpreter lock's switch interval (ServerConfig says why) and
    tracing (serving/telemetry/tracing.py: from the OTEL_* variables; a ServerConfigError names a bad one).
    `python -m serving.server` and each worker (`worker`: its index) call it; a server made inside another program (a
    test) leaves that program's allocator, interpreter and tracing as they are."""
    tracing.configure(server_version(), worker)
    fix_mmap_threshold(cfg.malloc_mmap_threshold_bytes)
    if cfg.switch_interval_ms > 0:
        sys.setswitchinterval(cfg.switch_interval_ms / 1000)


class SentimentServer:
    """Load a bundle, serve it, in three steps: construction (the model, the batcher, admission and the gRPC server,
    no port), `bind()` (every port, each bound once and kept: a taken one is a ServerConfigError naming it, and
    nothing is left bound), `start()` (serve; it binds first when `bind()` was not called). Then `stop()` (or
    `with SentimentServer(...) as s:`)."""

    def __init__(self, bundle: str | Path | None, cfg: ServerConfig | None = None, *,
                 shared_port: bool = False) -> None:
        """bundle: one bundle (model cfg.model_name, version 1), or None with cfg.model_repository (every model of
        the repository: serving/model/models.py). shared_port: one worker of serving/process/workers.py, whose
        parent holds `cfg.port` (SO_REUSEPORT) and serves health and metrics for all."""
        self.cfg = cfg = cfg or ServerConfig()
        self.shared_port = shared_port
        check_distinct_ports(cfg, shared_port)
        if (bundle is None) == (cfg.model_repository is None):
            raise ServerConfigError("give one bundle or a model repository (--model-repository DIR), not "
                                    f"{'both' if bundle is not None else 'neither'}")
        self.metrics = Metrics(per_worker=shared_port)
        # The runs at once and the model calls, each shared fairly by the models (serving/model/turns.py)
        self.turns = Turns(cfg.batch_workers)
        # calls take turns only where several models can be served: one bundle pays no lock for them
        self.call_turns = Turns(cfg.fair_calls, alone=True) if cfg.model_repository else None
        self.models = Models(cfg, self._open_version, on_change=lambda model, result: self.metrics.model_loads
                             .labels(model, result).inc(), call_turns=self.call_turns)
        if bundle is not None:
            self.models.add_bundle(cfg.model_name, Path(bundle))
        else:
            try:
                self.models.load_all()
            except RepositoryError as e:
                raise ServerConfigError(str(e)) from None
            if not self.models.cores:
                log.warning("no model of %s could be loaded: not ready until one is (the repository index says why)",
                            cfg.model_repository)
        self.health = Health()
        self.health.listen(lambda: self.metrics.serving.set(self.health.serving()))
        limit = cfg.max_concurrent_rpcs or cfg.max_workers
        # Memory freed by a burst of model calls goes back to the system once they are over (serving/process/memory.py)
        self.reclaimer: Reclaimer | None = None
        if cfg.memory_reclaim_idle_s > 0:
            self.reclaimer = Reclaimer(settle_s=cfg.memory_reclaim_idle_s,
                                       on_reclaim=self.metrics.memory_reclaim_seconds.observe)
        self.repository = RepositoryApi(self.models, cfg)  # load, unload, index: both protocols'
        # One admission (the token, model slots, the answers' budget, the body's time), asked by both protocols.
        self.admission = Admission(self.metrics, auth_token=cfg.auth_token, max_calls=limit,
                                   body_timeout_s=cfg.body_timeout_s,
                                   max_response_bytes=cfg.max_response_bytes_in_flight, reclaimer=self.reclaimer,
                                   queue_full=lambda: self.models.no_room_for_any(cfg.max_texts))
        self.calls = CallLog(cfg.access_log_rate, self.metrics.suppressed_access_logs.inc)
        self.errors = InternalErrors(self.metrics.suppressed_logs.inc)
        self.gate = Gate(self.admission, self.metrics, self.calls, self.errors, health_workers=cfg.health_workers,
                         max_message_bytes=cfg.max_message_bytes)
        # A model call holds its permit until its behaviour returns; the thread then still sends the answer, so a caller
        # that sends its next request at once can need a second thread. Without spare threads, 128 closed-loop
        # callers at max_workers 128 were refused 184 times in 159k requests (bench/soak.py, docs/RELIABILITY.md):
        # the pool gets a headroom of a quarter (at least 8). And a thread for every model slot: a unary model call
        # takes its permit at admission (serving/protocols/grpc/interceptor.py), and must then never wait in the
        # pool's queue, also when max_concurrent_rpcs is above max_workers.
        threads = max(cfg.max_workers, limit) + max(8, limit // 4)
        self.grpc_server = grpc.server(
            futures.ThreadPoolExecutor(max_workers=threads, thread_name_prefix="grpc"),
            interceptors=[self.gate], options=transport_options(cfg, shared_port),
            maximum_concurrent_rpcs=threads + cfg.health_workers + _BACKSTOP,
        )
        sentiment_service_pb2_grpc.add_SentimentServiceServicer_to_server(SentimentServicer(self.models),
                                                                         self.grpc_server)
        grpc_service_pb2_grpc.add_GRPCInferenceServiceServicer_to_server(
            KServeServicer(self.models, self.repository), self.grpc_server)
        health_pb2_grpc.add_HealthServicer_to_server(self.health, self.grpc_server)
        reflection.enable(self.grpc_server, {SENTIMENT_SERVICE: sentiment_service_pb2.DESCRIPTOR,
                                             KSERVE_SERVICE: grpc_service_pb2.DESCRIPTOR,
                                             HEALTH_SERVICE: health_pb2.DESCRIPTOR})
        self.port: int | None = None
        self.http: HttpServer | None = None
        self.http_port: int | None = None
        self.health_server: HealthPort | None = None
        self.health_port: int | None = None
        self._metrics_server: MetricsServer | None = None
        self.metrics_port: int | None = None
        self._stopped = threading.Event()

    def bind(self) -> SentimentServer:
        """Bind every port (gRPC, health, metrics), each once and kept until `stop()`. A ServerConfigError names
        the first that cannot be bound; the ones bound before it are released and the server is closed."""
        cfg = self.cfg
        try:
            self.port = _add_port(self.grpc_server, cfg.host, cfg.port, server_credentials(cfg), "gRPC")
            if cfg.http_port is not None:  # the same core, admission and files: serving/protocols/http/
                calls = HttpCalls(self.admission, self.metrics, self.calls, self.errors, cfg)
                app = router(self.models, self.repository, calls, page_on=cfg.http_page)
                self.http = HttpServer(app, cfg, cfg.http_port, self.shared_port)
                self.http_port = self.http.port
            if cfg.health_port is not None:  # health alone, for probes: serving/protocols/grpc/health_port.py
                self.health_server = HealthPort(self.health, self.metrics, cfg.host, cfg.health_port,
                                                transport_options(cfg), cfg.body_timeout_s, self.reclaimer)
                self.health_port = self.health_server.port
            if cfg.metrics_port is not None:
                self._metrics_server = metrics_server(self.metrics.registry, cfg.metrics_host or cfg.host,
                                                      cfg.metrics_port)
                self.metrics_port = self._metrics_server.port
        except ServerConfigError:
            self.grpc_server.stop(None)
            self._close_listeners()
            self.models.close(timeout=0)
            raise
        return self

    def start(self) -> SentimentServer:
        if self.port is None:
            self.bind()
        self.grpc_server.start()
        for listener in self._listeners():
            listener.start()
        for service in ("", SENTIMENT_SERVICE, KSERVE_SERVICE):
            self.health.set(service, health_pb2.HealthCheckResponse.SERVING)
        self.models.open()
        if self.cfg.model_control == "poll":
            self.models.poll(self.cfg.repository_poll_s)
        if not self.shared_port:  # a worker's parent warns for all, and its line is the one scripts wait for
            warn_if_open(self.cfg)
        log.info("%s %s:%d (%s%s), %s, model %r on %s, batching %s, health port %s, metrics %s",
                 "worker serving on" if self.shared_port else "listening on", self.cfg.host, self.port,
                 "mutual TLS" if self.cfg.tls_client_ca else "TLS" if self.cfg.tls_cert else "plaintext",
                 (", token auth" if self.cfg.auth_token else "")
                 + (", behind a proxy" if self.cfg.behind_proxy else ""),
                 f"HTTP on {self.cfg.host}:{self.http_port}" if self.http_port is not None else "HTTP off",
                 ", ".join(f"{c.name}:{c.version}" for c in self.models.cores) or "none",
                 ", ".join(sorted({c.predictor.provider for c in self.models.cores})) or "-",
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
        self.models.draining = True
        self.health.enter_graceful_shutdown()
        if self.cfg.drain_delay_s:
            log.info("NOT_SERVING; still serving for drain_delay_s=%.1f s", self.cfg.drain_delay_s)
            time.sleep(self.cfg.drain_delay_s)
        # Refuse new work ourselves (UNAVAILABLE, which clients retry elsewhere) and let accepted work finish
        # before closing the listener: gRPC cancels calls that reach it during its own shutdown before a
        # handler picks them up, and a client reads CANCELLED.
        end = time.monotonic() + grace
        if not self.models.refuse_and_wait(grace):
            log.warning("grace %.1f s over with requests still running: they are cancelled", grace)
        self.grpc_server.stop(max(0.0, end - time.monotonic())).wait()
        if self.http is not None:  # idle connections closed, answers in progress finished
            self.http.stop()
        self.models.close(timeout=grace)
        self._close_listeners()
        self._stopped.set()
        log.info("stopped")

    def _open_version(self, name: str, version: int, bundle: Path) -> ServingCore:
        """One model version: its predictor (the bundle verified, its graph run once), its batcher and its core, not
        taking calls until listed (serving/model/models.py)."""
        cfg = self.cfg
        p = Predictor(bundle, device=cfg.device, intra_op_threads=cfg.intra_op_threads,
                      inter_op_threads=cfg.inter_op_threads, optimization=cfg.optimization, spinning=cfg.ort_spinning)
        cfg.check_bundle_fit(p.max_len)
        series = self.metrics.for_model(name, str(version))
        series.info(p.bundle_sha256, p.precision, p.provider)
        batcher = Batcher(p.infer, max_batch_size=cfg.max_batch_size, max_batch_tokens=cfg.max_batch_tokens,
                          max_queue_delay_s=cfg.max_queue_delay_ms / 1000, max_queue=cfg.max_queue,
                          max_padding=cfg.max_padding, workers=cfg.batch_workers, enabled=cfg.batching,
                          metrics=series, turns=self.turns, model=name, per_row=p.per_row,
                          span_attributes={"sentiment.model": name, "sentiment.model_version": str(version),
                                           "sentiment.graph": p.graph, "sentiment.precision": p.precision,
                                           "sentiment.provider": p.provider, "sentiment.per_row": p.per_row})
        return ServingCore(p, batcher, cfg, name=name, version=str(version), call_turns=self.call_turns)

    @property
    def core(self) -> ServingCore:
        """The one model's newest version (a server of one bundle: its core)."""
        return self.models.get("", "")

    def _listeners(self) -> list[HttpServer | HealthPort | MetricsServer]:
        """The listeners beside gRPC's that this server opened (each binds in its constructor)."""
        return [x for x in (self.http, self.health_server, self._metrics_server) if x is not None]

    def _close_listeners(self) -> None:
        for listener in self._listeners():
            listener.stop()
        self.gate.close()
        self.admission.close()
        self.repository.pool.shutdown(wait=False, cancel_futures=True)
        if self.reclaimer is not None:
            self.reclaimer.close()

    def __enter__(self) -> SentimentServer:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()


def check_distinct_ports(cfg: ServerConfig, shared_port: bool = False) -> None:
    """ServerConfigError when one port number is given to two listeners on one address (port 0 and off are
    skipped). Nothing is bound here: each listener binds its port once, and reports a taken one itself."""
    seen: dict[tuple[str, int], str] = {}
    listeners = (("gRPC", cfg.host, None if shared_port else cfg.port),
                 ("HTTP", cfg.host, None if shared_port else cfg.http_port), ("health", cfg.host, cfg.health_port),
                 ("metrics", cfg.metrics_host or cfg.host, cfg.metrics_port))
    for what, host, port in listeners:
        if not port:
            continue
        for (other_host, other_port), other in seen.items():
            if other_port == port and (other_host == host or "0.0.0.0" in (host, other_host)):
                raise ServerConfigError(f"port {port} is given to both {other} and {what}")
        seen[(host, port)] = what


def metrics_server(registry: CollectorRegistry, host: str, port: int) -> MetricsServer:
    """The Prometheus exporter, bound; ServerConfigError naming host:port when it cannot be."""
    try:
        return MetricsServer(registry, host, port)
    except OSError as e:
        raise ServerConfigError(f"cannot listen on {host}:{port} (metrics): {e.strerror or e}") from None


def is_loopback(host: str) -> bool:
    """True for an address only this machine can reach (127.0.0.0/8, ::1, localhost)."""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


def warn_if_open(cfg: ServerConfig) -> None:
    """Warnings, once per server (its parent's with --workers), when it listens beyond loopback: without a front
    proxy nothing limits each client address, and without a token or TLS anyone who reaches the port can use the
    model."""
    if is_loopback(cfg.host):
        return
    if not cfg.behind_proxy:
        log.warning("listening on %s without a front proxy: no limit per client address (connections, call rate, "
                    "failed logins); put the proxy in front: %s on one host, `kubectl apply -k deploy/` on "
                    "Kubernetes (README, Deploy), and pass --behind-proxy", cfg.host, COMPOSE_UP)
    if cfg.auth_token is None and cfg.tls_cert is None:
        log.warning("listening on %s with neither a bearer token nor TLS: anyone who reaches port %d can call the "
                    "model; set SENTIMENT_AUTH_TOKEN or --auth-token-file, and --tls-cert/--tls-key (README, "
                    "Serving)", cfg.host, cfg.port)


def _add_port(server: grpc.Server, host: str, port: int, credentials: grpc.ServerCredentials | None,
              what: str) -> int:
    address = f"{host}:{port}"
    try:
        if credentials is not None:
            return server.add_secure_port(address, credentials)
        return server.add_insecure_port(address)
    except RuntimeError as e:
        raise ServerConfigError(f"cannot listen on {address} ({what}): {e}") from None


def server_credentials(cfg: ServerConfig) -> grpc.ServerCredentials | None:
    """TLS credentials from the PEM files of `cfg` (None without TLS); ServerConfigError naming the option and the
    file that cannot be read, or the files that do not load as a key and its certificate (checked with Python's
    ssl, which reads them as OpenSSL does: gRPC itself would only fail at the first handshake)."""
    if not cfg.tls_cert:
        return None
    pem = {}
    for name in ("tls_key", "tls_cert", "tls_client_ca"):
        path = getattr(cfg, name)
        if path:
            try:
                pem[name] = Path(path).read_bytes()
            except OSError as e:
                raise ServerConfigError(f"{name}: cannot read {path}: {e.strerror or e}") from None
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    try:
        context.load_cert_chain(cfg.tls_cert, cfg.tls_key)
    except (ssl.SSLError, OSError) as e:
        raise ServerConfigError(f"tls_cert {cfg.tls_cert} and tls_key {cfg.tls_key} do not load as a certificate and "
                                f"its private key: {e.reason or e}") from None
    ca = pem.get("tls_client_ca")
    if ca is not None:
        try:
            context.load_verify_locations(cadata=ca.decode("ascii", "replace"))
        except (ssl.SSLError, ValueError) as e:
            raise ServerConfigError(f"tls_client_ca {cfg.tls_client_ca}: no PEM CA certificate loads from it: "
                                    f"{getattr(e, 'reason', None) or e}") from None
    return grpc.ssl_server_credentials([(pem["tls_key"], pem["tls_cert"])], root_certificates=ca,
                                       require_client_auth=ca is not None)
