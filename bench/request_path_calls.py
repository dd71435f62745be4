"""Python function calls one Classify call costs the server, against the bare grpcio floor: a count, not a time.

    python bench/request_path_calls.py --bundle /tmp/tiny-bundle [--calls 200] [--top 25]

Each server runs in this process on 127.0.0.1 (serving/'s SentimentServer with its defaults, then
bench/grpc_floor.py's servicer in a bare grpc.server), every thread of it under a profiler that counts each Python
function entered (sys.setprofile); the client is this process' main thread, not counted. After a warm-up, `--calls`
calls of one review each, one at a time. On this machine's two shared cores a throughput moves 20% between runs of
one tree; the count of calls does not move between runs of one tree, and most of what serving/ adds to a call over the
floor is Python calls (the interpreter's own frames dominated the instructions callgrind counted): a change to the
request path is measured here first, then timed with bench/serve_bench.py. docs/BENCHMARKS.md has a run.
"""

from __future__ import annotations

import argparse
import collections
import os
import re
import sys
import threading
from concurrent import futures
from pathlib import Path

import grpc

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "bench"))
from bench_texts import DEFAULT_DATA, reviews  # noqa: E402

from serving.gen.sentiment.v1 import sentiment_service_pb2 as pb  # noqa: E402
from serving.gen.sentiment.v1 import sentiment_service_pb2_grpc as pb_grpc  # noqa: E402


class Counting:
    """Counts Python function entries (and C calls, apart) in every thread but the one that made it."""

    def __init__(self) -> None:
        self.on = False
        self.python: collections.Counter[str] = collections.Counter()
        self.c_calls = 0
        self._client = threading.get_ident()

    def __call__(self, frame, event: str, arg) -> None:
        if not self.on or threading.get_ident() == self._client:
            return
        if event == "call":
            code = frame.f_code
            where = re.sub(r".*/(site-packages|lib/python3\.\d+)/", "", code.co_filename)
            self.python[f"{os.path.relpath(where, REPO) if where.startswith(str(REPO)) else where}:{code.co_name}"] += 1
        elif event == "c_call":
            self.c_calls += 1


def measure(port: int, counting: Counting, calls: int, text: str) -> None:
    with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
        stub = pb_grpc.SentimentServiceStub(channel)
        for _ in range(20):  # warm-up: pools, first-call paths
            stub.Classify(pb.ClassifyRequest(texts=[text]), timeout=30)
        counting.on = True
        for _ in range(calls):
            stub.Classify(pb.ClassifyRequest(texts=[text]), timeout=30)
        counting.on = False


def serving_counts(bundle: Path, calls: int, text: str) -> Counting:
    from serving.config import ServerConfig
    from serving.process.app import SentimentServer

    counting = Counting()
    threading.setprofile(counting)  # the server's threads are made after this, each with the profiler
    server = SentimentServer(bundle, ServerConfig(port=0, device="cpu", intra_op_threads=1, metrics_port=None,
                                                  http_port=None)).start()
    try:
        measure(server.port, counting, calls, text)
    finally:
        threading.setprofile(None)
        server.stop(1)
    return counting


def floor_counts(bundle: Path, calls: int, text: str) -> Counting:
    import grpc_floor
    from prometheus_client import CollectorRegistry

    from serving.model.predictor import Predictor

    counting = Counting()
    threading.setprofile(counting)
    server = grpc.server(futures.ThreadPoolExecutor(128))
    servicer = grpc_floor.FloorServicer(Predictor(bundle, device="cpu", intra_op_threads=1), CollectorRegistry())
    pb_grpc.add_SentimentServiceServicer_to_server(servicer, server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    try:
        measure(port, counting, calls, text)
    finally:
        threading.setprofile(None)
        server.stop(1)
    return counting


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--bundle", type=Path, required=True, help="bundle to serve (the tests' tiny one will do)")
    ap.add_argument("--calls", type=int, default=200, help="counted calls, after 20 of warm-up")
    ap.add_argument("--top", type=int, default=25, help="serving/'s most called functions to list")
    ap.add_argument("--data", type=Path, default=DEFAULT_DATA,
                    help="folder holding cls-books-fr/ (a test review is the text sent)")
    args = ap.parse_args()
    text = reviews(ap, args.data)[0]
    rows = [("serving/", serving_counts(args.bundle, args.calls, text)),
            ("bare grpcio floor", floor_counts(args.bundle, args.calls, text))]
    print("| server | Python calls per Classify | C calls per Classify |\n|---|---:|---:|")
    for name, c in rows:
        print(f"| {name} | {sum(c.python.values()) / args.calls:.1f} | {c.c_calls / args.calls:.1f} |")
    print(f"\nserving/'s {args.top} most called Python functions, per Classify:")
    for where, n in rows[0][1].python.most_common(args.top):
        print(f"  {n / args.calls:6.2f}  {where}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
