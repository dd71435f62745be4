"""gRPC load from h2load (Debian: nghttp2-client), a C HTTP/2 client: one ready-made request sent over and over on
`connections` connections, `streams` calls at a time on each. It costs the cores far less than a Python client
would, which matters where the load and the server share a machine's few cores (bench/workers_bench.py,
bench/model_swap_bench.py). h2load reads no gRPC status trailers: count the calls from the server's metrics.
"""

from __future__ import annotations

import resource
import shutil
import struct
import subprocess
from collections.abc import Sequence
from pathlib import Path

CLASSIFY = "/sentiment.v1.SentimentService/Classify"
MISSING = "h2load not found: install it (Debian/Ubuntu: apt-get install nghttp2-client)"


def available() -> bool:
    return shutil.which("h2load") is not None


def grpc_body(texts: Sequence[str], **fields: str) -> bytes:
    """One ClassifyRequest of `texts` (and `fields`, e.g. model_name) as a gRPC message on the wire: flag 0
    (uncompressed), 4-byte big-endian length, bytes."""
    from serving.gen.sentiment.v1 import sentiment_service_pb2 as pb

    message = pb.ClassifyRequest(texts=list(texts), **fields).SerializeToString()
    return struct.pack(">BI", 0, len(message)) + message


def command(port: int, body: Path, seconds: float, connections: int, streams: int, threads: int = 1,
            cpus: str | None = None) -> list[str]:
    """h2load sending `body` to Classify for `seconds` (whole, at least 1); pinned to `cpus` (taskset) when given."""
    pin = ["taskset", "-c", cpus] if cpus else []
    return [*pin, "h2load", "-D", f"{max(1, round(seconds))}s", "-c", str(connections), "-m", str(streams), "-t",
            str(threads), "-d", str(body), "-H", "content-type: application/grpc", "-H", "te: trailers",
            f"http://127.0.0.1:{port}{CLASSIFY}"]


def run(port: int, body: Path, seconds: float, connections: int, streams: int, threads: int = 1,
        cpus: str | None = None) -> tuple[str, float]:
    """h2load's report and the CPU seconds it used."""
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    out = subprocess.run(command(port, body, seconds, connections, streams, threads, cpus), capture_output=True,
                         text=True, check=True)
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    return out.stdout, (after.ru_utime + after.ru_stime) - (before.ru_utime + before.ru_stime)
