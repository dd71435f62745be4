"""The gRPC sentiment server: one bundle, two protocols (sentiment.v1 and KServe v2), health, reflection, metrics.

    python -m serving.server BUNDLE [--port 50051] [--metrics-port 8002] [--max-texts 64] ...
    (the same as the console script `sentiment-server`; `--help` lists every option of ServerConfig)

A threaded grpc server: handlers block on the batcher's futures while onnxruntime runs in the batcher's threads
(it releases the GIL). bench/grpc_mode_bench.py measured the threaded server faster than grpc.aio on this
machine (health Check p50 0.40 vs 0.46 ms alone, 2,100 vs 1,300 calls/s at 64 callers; docs/
BENCHMARKS.md, Serving), and blocking code stays simple.

Lifecycle: the bundle is loaded and verified before the port opens (a bad bundle exits non-zero). SIGTERM or
SIGINT: health goes NOT_SERVING and new requests get UNAVAILABLE, in-flight requests finish (up to grace_s),
the batcher drains, exit 0.
"""

from __future__ import annotations

import argparse
import dataclasses
import hmac
import logging
import os
import signal
import sys
import threading
import time
import types
import typing
from collections.abc import Callable
from concurrent import futures
from pathlib import Path
from typing import Any

import grpc
from google.protobuf.message import DecodeError
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from contract.comments import comments
from serving.batcher import Batcher
from serving.config import ServerConfig
from serving.errors import BundleError, ConfigError, InvalidInput, ServingError, Unauthenticated
from serving.gen.inference import grpc_service_pb2, grpc_service_pb2_grpc
from serving.gen.sentiment.v1 import sentiment_service_pb2, sentiment_service_pb2_grpc
from serving.kserve import KServeServicer
from serving.metrics import Metrics
from serving.predictor import Predictor
from serving.servicer import SentimentServicer, ServingCore

log = logging.getLogger("serving.server")

SENTIMENT_SERVICE = sentiment_service_pb2.DESCRIPTOR.services_by_name["SentimentService"].full_name
KSERVE_SERVICE = grpc_service_pb2.DESCRIPTOR.services_by_name["GRPCInferenceService"].full_name
HEALTH_PREFIX = f"/{health.SERVICE_NAME}/"  # health stays open without a token (load balancers, probes)


class _Malformed:
    """Stands in for a request message that failed to parse (e.g. invalid UTF-8 in a string field)."""

    def __init__(self, error: Exception) -> None:
        self.error = error


def _safe(deserializer: Callable[[bytes], Any] | None) -> Callable[[bytes], Any] | None:
    """grpc answers a parse failure with INTERNAL; we want INVALID_ARGUMENT, so parse failures become values."""
    if deserializer is None:
        return None

    def parse(data: bytes) -> Any:
        try:
            return deserializer(data)
        except DecodeError as e:
            return _Malformed(e)

    return parse


class ServingInterceptor(grpc.ServerInterceptor):
    """The one place where exceptions become status codes. Also checks the bearer token (before anything is
    computed) and counts requests, errors by code and latency."""

    def __init__(self, metrics: Metrics, auth_token: str | None) -> None:
        self.metrics = metrics
        self.expected = f"Bearer {auth_token}".encode() if auth_token else None

    def _authorized(self, details: grpc.HandlerCallDetails) -> bool:
        if self.expected is None or details.method.startswith(HEALTH_PREFIX):
            return True
        for key, value in details.invocation_metadata or ():
            if key == "authorization":
                given = value.encode() if isinstance(value, str) else value
                return hmac.compare_digest(given, self.expected)
        return False

    def intercept_service(self, continuation, details):  # noqa: ANN001 (grpc's untyped interface)
        handler = continuation(details)
        if handler is None:
            return None  # unknown method: grpc answers UNIMPLEMENTED
        method = details.method.lstrip("/")
        if not self._authorized(details):
            self.metrics.requests.labels(method, "UNAUTHENTICATED").inc()
            return _refusal(handler, Unauthenticated("missing or wrong bearer token (metadata 'authorization: "
                                                     "Bearer <token>')"))
        if handler.unary_unary is None:
            return handler  # streaming rpcs (health Watch, reflection) are not ours: pass through
        inner = handler.unary_unary

        def behavior(request: Any, context: grpc.ServicerContext) -> Any:
            start, code = time.perf_counter(), "OK"
            try:
                if isinstance(request, _Malformed):
                    raise InvalidInput(f"request does not parse as {method}'s message: {request.error}")
                return inner(request, context)
            except ServingError as e:
                code = e.code
                context.abort(grpc.StatusCode[e.code], str(e))
            except Exception:
                code = "INTERNAL"
                log.exception("internal error in %s", method)
                context.abort(grpc.StatusCode.INTERNAL, "internal server error (details in the server log)")
            finally:
                self.metrics.requests.labels(method, code).inc()
                self.metrics.request_seconds.labels(method).observe(time.perf_counter() - start)

        return grpc.unary_unary_rpc_method_handler(
            behavior,
            request_deserializer=_safe(handler.request_deserializer),
            response_serializer=handler.response_serializer,
        )


def _refusal(handler: grpc.RpcMethodHandler, error: ServingError) -> grpc.RpcMethodHandler:
    """A handler of the same kind that only aborts: the real one never runs."""
    code = grpc.StatusCode[error.code]

    def abort(request_or_iterator: Any, context: grpc.ServicerContext) -> Any:
        context.abort(code, str(error))

    kinds = {
        (False, False): grpc.unary_unary_rpc_method_handler,
        (False, True): grpc.unary_stream_rpc_method_handler,
        (True, False): grpc.stream_unary_rpc_method_handler,
        (True, True): grpc.stream_stream_rpc_method_handler,
    }
    make = kinds[(handler.request_streaming, handler.response_streaming)]
    return make(abort, request_deserializer=None, response_serializer=handler.response_serializer)


class SentimentServer:
    """Load a bundle, serve it. `start()`, then `stop()` (or `with SentimentServer(...) as s:`)."""

    def __init__(self, bundle: str | Path, cfg: ServerConfig | None = None) -> None:
        self.cfg = cfg = cfg or ServerConfig()
        self.predictor = Predictor(bundle, device=cfg.device, intra_op_threads=cfg.intra_op_threads,
                                   inter_op_threads=cfg.inter_op_threads, optimization=cfg.optimization,
                                   spinning=cfg.ort_spinning)
        cfg.check_bundle_fit(self.predictor.max_len)
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
        self.health = health.HealthServicer(experimental_non_blocking=True)
        # gRPC counts an RPC until its handler's thread returns, which is after the client has its answer: a caller
        # that sends its next request at once can find its previous one still counted. With the limit equal to the
        # number of callers, 128 closed-loop callers were refused ("Concurrent RPC limit exceeded!") 184 times in
        # 159k requests (bench/soak.py, docs/RELIABILITY.md). So gRPC's limit gets a headroom, and the pool as many
        # more threads, so that callers within the limit are served and no accepted RPC waits unseen for a thread.
        limit = cfg.max_concurrent_rpcs or cfg.max_workers
        headroom = max(8, limit // 4)
        self.grpc_server = grpc.server(
            futures.ThreadPoolExecutor(max_workers=cfg.max_workers + headroom, thread_name_prefix="grpc"),
            interceptors=[ServingInterceptor(self.metrics, cfg.auth_token)],
            options=[
                ("grpc.max_receive_message_length", cfg.max_message_bytes),
                ("grpc.max_send_message_length", cfg.max_message_bytes),
                ("grpc.so_reuseport", 0),  # a taken port is an error, not a silently shared one
            ],
            maximum_concurrent_rpcs=limit + headroom,
        )
        sentiment_service_pb2_grpc.add_SentimentServiceServicer_to_server(SentimentServicer(self.core),
                                                                         self.grpc_server)
        grpc_service_pb2_grpc.add_GRPCInferenceServiceServicer_to_server(KServeServicer(self.core), self.grpc_server)
        health_pb2_grpc.add_HealthServicer_to_server(self.health, self.grpc_server)
        reflection.enable_server_reflection(
            [SENTIMENT_SERVICE, KSERVE_SERVICE, health.SERVICE_NAME, reflection.SERVICE_NAME], self.grpc_server)
        address = f"{cfg.host}:{cfg.port}"
        try:
            if cfg.tls_cert:
                self.port = self.grpc_server.add_secure_port(address, _server_credentials(cfg))
            else:
                self.port = self.grpc_server.add_insecure_port(address)
        except RuntimeError as e:
            raise ConfigError(f"cannot listen on {address}: {e}") from None
        self.metrics_port: int | None = None
        self._metrics_server: Any = None
        self._stopped = threading.Event()

    def start(self) -> SentimentServer:
        self.grpc_server.start()
        if self.cfg.metrics_port is not None:
            self._metrics_server, self.metrics_port = self.metrics.serve(self.cfg.host, self.cfg.metrics_port)
        for service in ("", SENTIMENT_SERVICE, KSERVE_SERVICE):
            self.health.set(service, health_pb2.HealthCheckResponse.SERVING)
        self.core.ready = True
        log.info("listening on %s:%d (%s%s), model %r on %s, batching %s, metrics %s", self.cfg.host, self.port,
                 "mutual TLS" if self.cfg.tls_client_ca else "TLS" if self.cfg.tls_cert else "plaintext",
                 ", token auth" if self.cfg.auth_token else "", self.cfg.model_name, self.predictor.provider,
                 "on" if self.cfg.batching else "off",
                 f"on :{self.metrics_port}" if self.metrics_port is not None else "off")
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
        if self._metrics_server is not None:
            self._metrics_server.shutdown()
        self._stopped.set()
        log.info("stopped")

    def __enter__(self) -> SentimentServer:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()


def _server_credentials(cfg: ServerConfig) -> grpc.ServerCredentials:
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
    token = os.environ.get("SENTIMENT_AUTH_TOKEN")
    if args.auth_token_file:
        try:
            token = args.auth_token_file.read_text(encoding="utf-8").strip()
        except OSError as e:
            raise ConfigError(f"--auth-token-file {args.auth_token_file}: {e.strerror}") from None
    values["auth_token"] = token or None
    return ServerConfig(**values)


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    logging.basicConfig(level=args.log_level, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        server = SentimentServer(args.bundle, config_from_args(args))
    except (BundleError, ConfigError) as e:
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
