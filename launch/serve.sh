#!/usr/bin/env bash
# Serve an exported bundle over gRPC (sentiment.v1 + KServe v2, health, reflection, Prometheus metrics).
#   launch/serve.sh BUNDLE [--host 127.0.0.1] [--port 50051] [--metrics-port 8002] [...]
# Every option: launch/serve.sh BUNDLE --help. SIGTERM drains in-flight requests and exits 0.
# PY picks the interpreter (default: the project's .venv); exec keeps the server as the signalled process.
set -euo pipefail
ROOT="$(cd "$(dirname "$0")/.." && pwd)"
PY="${PY:-$ROOT/.venv/bin/python}"
exec "$PY" -m serving.server "$@"
