"""The sentiment server's command line: one bundle, two protocols (sentiment.v1 and KServe v2) over gRPC and over
HTTP (with a JSON /v1/classify), health, reflection, metrics. The server object itself is serving/process/app.py.

    python -m serving.server BUNDLE [--port 50051] [--http-port 8000] [--metrics-port 8002] [--health-port 50052] ...
    (the same as the console script `sentiment-server`; `--help` lists every option of ServerConfig)

A threaded gRPC server: handlers block on the batcher's futures while onnxruntime runs in the batcher's threads (it
releases the GIL); bench/grpc_mode_bench.py measured it faster than grpc.aio (docs/BENCHMARKS.md), and blocking code
stays simple. What a thread-per-call server owes to hostile clients is in serving/limits/admission.py (both protocols),
serving/protocols/grpc/interceptor.py and the transport options of serving/process/app.py; per-address limits are the
front proxy's (deploy/proxy/).

Lifecycle: the bundle is loaded and verified, then every port (gRPC, health, metrics) is bound, each once, before
anything is served: a bad bundle, an unreadable or mismatched TLS file or a taken port exits 2 with one line naming
it. SIGTERM or SIGINT: health goes NOT_SERVING and new requests get UNAVAILABLE, in-flight requests finish (up to
grace_s), the batcher drains, exit 0. `--workers N` runs N such servers on one port (serving/process/workers.py).
"""

from __future__ import annotations

import argparse
import dataclasses
import logging
import os
import sys
import types
import typing
from pathlib import Path

from contract.comments import comments
from contract.extras import missing_extra
from contract.version import version_line
from serving.config import ServerConfig
from serving.errors import BundleError, ServerConfigError
from serving.process.stop_signal import StopSignal
from serving.telemetry import logs, tracing

log = logging.getLogger("serving.server")  # its own name also when run as __main__


# ---------------------------------------------------------------------------------------------------- CLI


EXAMPLES = """examples:
  python -m serving.server runs/demo/bundle                 # gRPC on 127.0.0.1:50051, HTTP on :8000, metrics on :8002
  python -m serving.server runs/demo/bundle --host 0.0.0.0 --port 50051 --device cuda
  python -m serving.server runs/demo/bundle --max-texts 16 --long-text refuse --auth-token-file token.txt
  python -m serving.server --model-repository models --model-control poll --auth-token-file token.txt
      # every model of models/NAME/VERSION/; a version renamed into place is loaded, verified, then swapped in
  python -m serving.client --target 127.0.0.1:50051 "Un livre magnifique."   # then, from another shell
  curl -H 'Content-Type: application/json' -d '{"texts": ["Un livre magnifique."]}' localhost:8000/v1/classify

A bundle is the folder `python -m trainer export ARTIFACT --out BUNDLE` writes (not the training artifact).
SIGTERM or Ctrl-C: NOT_SERVING, --drain-delay-s of serving, --grace-s for requests in flight, exit 0.
"""


def _parser() -> argparse.ArgumentParser:
    """One flag per ServerConfig field (`max_texts` -> `--max-texts`), typed from its annotation, its help the
    field's comment in serving/config.py."""
    p = argparse.ArgumentParser(prog="sentiment-server", description="Serve a sentiment bundle over gRPC and HTTP.",
                                formatter_class=argparse.RawDescriptionHelpFormatter, epilog=EXAMPLES)
    p.add_argument("bundle", type=Path, nargs="?",
                   help="bundle folder written by `python -m trainer export` (or --model-repository DIR)")
    hints = typing.get_type_hints(ServerConfig)
    defaults = ServerConfig()
    meaning = comments(ServerConfig)
    for f in dataclasses.fields(ServerConfig):
        if f.name in ("auth_token", "metrics_port", "http_port", "batching"):
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
    p.add_argument("--http-port", type=int, default=8000,
                   help="HTTP/JSON port: KServe v2 REST, /v1/classify, /openapi.json; the same model, limits, token "
                        "and TLS as --port (0 = any free port) (default: 8000, Triton's)")
    p.add_argument("--no-http", action="store_true", help="no HTTP port: gRPC only")
    p.add_argument("--no-batching", action="store_true", help="run every request alone (benchmark baseline)")
    p.add_argument("--auth-token-file", type=Path,
                   help="require 'authorization: Bearer <token>' with the token in this file (also: the "
                        "SENTIMENT_AUTH_TOKEN variable) on every call but health's, gRPC and HTTP alike: the "
                        "scheme in any case (RFC 6750), one space or more, then the token exactly; never on the "
                        "command line, where `ps` shows it")
    p.add_argument("--log-level", default="INFO", choices=["DEBUG", "INFO", "WARNING", "ERROR"],
                   help="lowest level of the log lines written to stderr (default: INFO)")
    p.add_argument("--log-format", default="text", choices=logs.FORMATS,
                   help="stderr's lines: text, or one JSON object per line for a log collector; the same fields "
                        "either way: timestamp, level, logger, message, request_id, trace_id (default: text)")
    p.add_argument("--version", action="version", version=version_line("sentiment-server"))
    return p


def config_from_args(args: argparse.Namespace) -> ServerConfig:
    values = {f.name: getattr(args, f.name) for f in dataclasses.fields(ServerConfig) if hasattr(args, f.name)}
    values["metrics_port"] = None if args.no_metrics else args.metrics_port
    values["http_port"] = None if args.no_http else args.http_port
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
    try:  # onnxruntime, numpy, uvicorn...: after --help and --version, and absent with the `client` extra alone
        from serving.process.app import SentimentServer, configure_process
    except ModuleNotFoundError as e:
        return missing_extra("sentiment-server", "serve", e)

    logs.configure(args.log_level, args.log_format)
    try:
        cfg = config_from_args(args)
        if cfg.workers > 1:
            from serving.process import workers  # the parent of several processes: its own module

            return workers.serve(args.bundle, cfg, args.log_level, args.log_format)
        configure_process(cfg)
        server = SentimentServer(args.bundle, cfg).bind()
    except (BundleError, ServerConfigError) as e:
        print(f"sentiment-server: error: {e}", file=sys.stderr)
        return 2
    with StopSignal() as stop:  # kept through the drain: a second SIGTERM does not cut it short
        server.start()
        while not stop.wait(0.5):
            pass
        log.info("signal received: NOT_SERVING, draining in-flight requests (grace %.1f s)", server.cfg.grace_s)
        server.stop()
    tracing.shutdown()  # the spans still queued are exported
    return 0


if __name__ == "__main__":
    sys.exit(main())
