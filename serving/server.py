"""The gRPC sentiment server: one bundle, two protocols (sentiment.v1 and KServe v2), health, reflection, metrics.

    python -m serving.server BUNDLE [--port 50051] [--metrics-port 8002] [--health-port 50052] [--max-texts 64] ...
    (the same as the console script `sentiment-server`; `--help` lists every option of ServerConfig)

A threaded grpc server: handlers block on the batcher's futures while onnxruntime runs in the batcher's threads
(it releases the GIL). bench/grpc_mode_bench.py measured the threaded server faster than grpc.aio on this
machine (health Check p50 0.40 vs 0.46 ms alone, 2,100 vs 1,300 calls/s at 64 callers; docs/
BENCHMARKS.md, Serving), and blocking code stays simple. What a thread-per-call server owes to hostile clients
(a token checked before the body is read, a bound on the time to send it, slots, answers held for slow readers,
per-connection limits) is in serving/gate.py and the transport options below. The health port alone is served by
grpc.aio (serving/health_port.py): probes need answers while half-open calls wait there, not throughput.

Lifecycle: the bundle is loaded and verified, and every port (gRPC, health, metrics) is checked free, before
anything listens (a bad bundle or a taken port exits 2 with one line). SIGTERM or SIGINT: health goes NOT_SERVING
and new requests get UNAVAILABLE, in-flight requests finish (up to grace_s), the batcher drains, exit 0.
"""

from __future__ import annotations

import argparse
import dataclasses
import logging
import os
import signal
import socket
import sys
import threading
import time
import types
import typing
from concurrent import futures
from pathlib import Path

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from contract.comments import comments
from serving import reflection
from serving.batcher import Batcher
from serving.config import ServerConfig
from serving.errors import BundleError, ServerConfigError
from serving.gate import Gate
from serving.gen.inference import grpc_service_pb2, grpc_service_pb2_grpc
from serving.gen.sentiment.v1 import sentiment_service_pb2, sentiment_service_pb2_grpc
from serving.health import SERVICE_NAME as HEALTH_SERVICE
from serving.health import Health
from serving.health_port import HealthPort
from serving.kserve import KServeServicer
from serving.memory import Reclaimer
from serving.metrics import Metrics, MetricsServer
from serving.predictor import Predictor
from serving.servicer import SentimentServicer, ServingCore

log = logging.getLogger("serving.server")

SENTIMENT_SERVICE = sentiment_service_pb2.DESCRIPTOR.services_by_name["SentimentService"].full_name
KSERVE_SERVICE = grpc_service_pb2.DESCRIPTOR.services_by_name["GRPCInferenceService"].full_name
# Calls gRPC itself may hold at once besides our pools' threads (refusals queued for the refusal pool): past this
# backstop gRPC refuses in its polling thread, before any of our code runs. Only a flood reaches it.
_BACKSTOP = 512


def transport_options(cfg: ServerConfig) -> list[tuple[str, int]]:
    """gRPC core's per-connection bounds, from the config (each field's comment says why its default)."""
    ms = lambda seconds: int(seconds * 1000)  # noqa: E731
    return [
        ("grpc.max_receive_message_length", cfg.max_message_bytes),
        ("grpc.max_send_message_length", cfg.max_message_bytes),
        ("grpc.so_reuseport", 0),  # a taken port is an error, not a silently shared one
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

    def __init__(self, bundle: str | Path, cfg: ServerConfig | None = None) -> None:
        self.cfg = cfg = cfg or ServerConfig()
        self.predictor = Predictor(bundle, device=cfg.device, intra_op_threads=cfg.intra_op_threads,
                                   inter_op_threads=cfg.inter_op_threads, optimization=cfg.optimization,
                                   spinning=cfg.ort_spinning)
        cfg.check_bundle_fit(self.predictor.max_len)
        metrics_host = cfg.metrics_host or cfg.host
        check_ports_free([("gRPC", cfg.host, cfg.port), ("health", cfg.host, cfg.health_port),
                          ("metrics", metrics_host, cfg.metrics_port)])
        self.metrics = Metrics()
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
            interceptors=[self.gate], options=transport_options(cfg),
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
        log.info("listening on %s:%d (%s%s), model %r on %s, batching %s, health port %s, metrics %s",
                 self.cfg.host, self.port,
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


# ---------------------------------------------------------------------------------------------------- CLI


EXAMPLES = """examples:
  python -m serving.server runs/demo/bundle                              # 127.0.0.1:50051, metrics on :8002
  python -m serving.server runs/demo/bundle --host 0.0.0.0 --port 50051 --device cuda
  python -m serving.server runs/demo/bundle --max-texts 16 --long-text refuse --auth-token-file token.txt
  python -m serving.client --target 127.0.0.1:50051 "Un livre magnifique."   # then, from another shell

A bundle is the folder `python -m trainer export ARTIFACT --out BUNDLE` writes (not the training artifact).
SIGTERM or Ctrl-C: NOT_SERVING, --drain-delay-s of serving, --grace-s for requests in flight, exit 0.
"""


def _parser() -> argparse.ArgumentParser:
    """One flag per ServerConfig field (`max_texts` -> `--max-texts`), typed from its annotation, its help the
    field's comment in serving/config.py."""
    p = argparse.ArgumentParser(prog="sentiment-server", description="Serve a sentiment bundle over gRPC.",
                                formatter_class=argparse.RawDescriptionHelpFormatter, epilog=EXAMPLES)
    p.add_argument("bundle", type=Path, help="bundle folder written by `python -m trainer export`")
    hints = typing.get_type_hints(ServerConfig)
    defaults = ServerConfig()
    meaning = comments(ServerConfig)
    for f in dataclasses.fields(ServerConfig):
        if f.name in ("auth_token", "metrics_port", "batching"):
            continue
        tp, flag = hints[f.name], "--" + f.name.replace("_", "-")
        default = getattr(defaults, f.name)
        text = meaning.get(f.name, "").replace("%", "%%")
        if tp is bool:  # every bool option is off by default: the flag turns it on
            p.add_argument(flag, action="store_true", help=f"{text} (default: off)")
            continue
        text += f" (default: {'none' if default is None else default})"
        if typing.get_origin(tp) in (typing.Union, types.UnionType):  # X | None: the flag takes an X
            tp = next(a for a in typing.get_args(tp) if a is not type(None))
        if typing.get_origin(tp) is typing.Literal:
            p.add_argument(flag, choices=typing.get_args(tp), default=default, help=text)
        else:
            p.add_argument(flag, type=tp, default=default, help=text)
    p.add_argument("--metrics-port", type=int, default=8002, help="Prometheus port (0 = any free port) (default: 8002)")
    p.add_argument("--no-metrics", action="store_true", help="no Prometheus exporter")
    p.add_argument("--no-batching", action="store_true", help="run every request alone (benchmark baseline)")
    p.add_argument("--auth-token-file", type=Path,
                   help="require 'authorization: Bearer <token>' with the token in this file (also: the "
                        "SENTIMENT_AUTH_TOKEN variable); never on the command line, where `ps` shows it")
    p.add_argument("--log-level", default="INFO", choices=["DEBUG", "INFO", "WARNING", "ERROR"],
                   help="(default: INFO)")
    return p


def config_from_args(args: argparse.Namespace) -> ServerConfig:
    values = {f.name: getattr(args, f.name) for f in dataclasses.fields(ServerConfig) if hasattr(args, f.name)}
    values["metrics_port"] = None if args.no_metrics else args.metrics_port
    values["batching"] = not args.no_batching
    # An empty token is a mistake (a Secret mounted without its key), never a request to serve without auth.
    token, source = os.environ.get("SENTIMENT_AUTH_TOKEN"), "SENTIMENT_AUTH_TOKEN"
    if args.auth_token_file:
        source = f"--auth-token-file {args.auth_token_file}"
        try:
            token = args.auth_token_file.read_text(encoding="utf-8").strip()
        except OSError as e:
            raise ServerConfigError(f"{source}: {e.strerror}") from None
    if token is not None and not token.strip():
        raise ServerConfigError(f"{source}: the token is empty (unset the variable or leave out the option to serve "
                          "without authentication)")
    values["auth_token"] = token.strip() if token is not None else None
    return ServerConfig(**values)


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    logging.basicConfig(level=args.log_level, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        server = SentimentServer(args.bundle, config_from_args(args))
    except (BundleError, ServerConfigError) as e:
        print(f"sentiment-server: error: {e}", file=sys.stderr)
        return 2
    stop = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda signum, frame: stop.set())
    server.start()
    while not stop.wait(0.5):  # a timed wait lets the signal handler run promptly
        pass
    log.info("signal received: NOT_SERVING, draining in-flight requests (grace %.1f s)", server.cfg.grace_s)
    server.stop()
    return 0


if __name__ == "__main__":
    sys.exit(main())
