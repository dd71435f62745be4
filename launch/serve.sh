#!/usr/bin/env bash
# Serve an exported bundle over gRPC (sentiment.v1 + KServe v2, health, reflection) and HTTP (KServe v2 REST,
# POST /v1/classify, /openapi.json), with Prometheus metrics.
#   launch/serve.sh BUNDLE [--host 127.0.0.1] [--port 50051] [--http-port 8000] [--metrics-port 8002] [...]
#   curl -H 'Content-Type: application/json' -d '{"texts": ["Super livre"]}' localhost:8000/v1/classify
# Every option: launch/serve.sh BUNDLE --help. SIGTERM drains in-flight requests and exits 0.
# PY picks the interpreter (default: the project's .venv); exec keeps the server as the signalled process.
set -euo pipefail
ROOT="$(cd "$(dirname "$0")/.." && pwd)"
PY="${PY:-$ROOT/.venv/bin/python}"
exec "$PY" -m serving.server "$@"
