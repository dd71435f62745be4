"""Threaded vs asyncio gRPC server on this machine: round-trip latency and throughput of a trivial rpc
(the standard health Check), so the choice in serving/process/app.py rests on a measurement.

    python bench/grpc_mode_bench.py [--calls 2000] [--concurrency 1 64]

Each server runs in its own subprocess on a free loopback port; the client here sends `calls` requests from
`c` threads (closed loop) through one channel.
"""

from __future__ import annotations

import argparse
import asyncio
import subprocess
import sys
import threading
import time
from concurrent import futures

import grpc
import numpy as np
from grpc_health.v1 import health, health_pb2, health_pb2_grpc


def serve_threaded() -> None:
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=128))
    servicer = health.HealthServicer(experimental_non_blocking=True)
    health_pb2_grpc.add_HealthServicer_to_server(servicer, server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    print(port, flush=True)
    sys.stdin.read()  # until the parent closes our stdin
    server.stop(0)


async def serve_aio() -> None:
    from grpc_health.v1 import _async as aio_health

    server = grpc.aio.server()
    health_pb2_grpc.add_HealthServicer_to_server(aio_health.HealthServicer(), server)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    print(port, flush=True)
    await asyncio.get_running_loop().run_in_executor(None, sys.stdin.read)
    await server.stop(0)


def measure(port: int, calls: int, c: int) -> tuple[float, float, float]:
    """(p50 ms, p99 ms, calls/s)."""
    with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
        stub = health_pb2_grpc.HealthStub(channel)
        request = health_pb2.HealthCheckRequest()
        for _ in range(200):
            stub.Check(request)
        latencies: list[float] = []
        lock = threading.Lock()
        per_thread = max(1, calls // c)

        def caller() -> None:
            own = []
            for _ in range(per_thread):
                t0 = time.perf_counter()
                stub.Check(request)
                own.append(time.perf_counter() - t0)
            with lock:
                latencies.extend(own)

        start = time.perf_counter()
        threads = [threading.Thread(target=caller) for _ in range(c)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        elapsed = time.perf_counter() - start
    lat = np.asarray(latencies) * 1e3
    return float(np.percentile(lat, 50)), float(np.percentile(lat, 99)), len(latencies) / elapsed


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--calls", type=int, default=2000, help="health Check calls per row")
    ap.add_argument("--concurrency", type=int, nargs="+", default=[1, 64], help="callers at once, one row each")
    ap.add_argument("--serve", choices=["threaded", "aio"], help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.serve == "threaded":
        serve_threaded()
        return 0
    if args.serve == "aio":
        asyncio.run(serve_aio())
        return 0
    print("| server | concurrency | p50 ms | p99 ms | calls/s |\n|---|---|---|---|---|")
    for mode in ("threaded", "aio"):
        proc = subprocess.Popen([sys.executable, __file__, "--serve", mode], stdin=subprocess.PIPE,
                                stdout=subprocess.PIPE, text=True)
        try:
            port = int(proc.stdout.readline())
            for c in args.concurrency:
                p50, p99, rate = measure(port, args.calls, c)
                print(f"| {mode} | {c} | {p50:.3f} | {p99:.3f} | {rate:.0f} |")
        finally:
            proc.stdin.close()
            proc.wait(30)
    return 0


if __name__ == "__main__":
    sys.exit(main())
