"""Requests/s ceiling of the server against its number of worker processes (`--workers N`), and the CPU time each
request costs the server's processes outside onnxruntime.

    python bench/soak.py --make-bundle /tmp/tiny-bundle --size tiny     # once: the tests' tiny model
    python bench/workers_bench.py --bundle /tmp/tiny-bundle [--workers 1 2] [--seconds 5] [--json out.json]
    python bench/workers_bench.py --bundle /tmp/tiny-bundle --workers 1 --profile /tmp/request-path.txt

--profile FILE samples the (first) worker with py-spy (a dev dependency) during the measured seconds, writes the
stacks to FILE (py-spy's raw format: one collapsed stack and its count a line) and prints where the thread
holding the interpreter lock spent its samples: by function, and by area (gRPC, protobuf, tokenizer, batcher...).

With the tiny model (vocab 99, width 32, 2 layers) onnxruntime costs next to nothing: what is measured is the
request path (gRPC, protobuf, tokenization, batching, futures) in Python. The load generator is h2load (Debian:
nghttp2-client), a C HTTP/2 client that sends one ready-made gRPC request (one review) over `--connections`
connections, `--streams` calls at a time on each: it costs the cores far less than a Python client would, and its
own CPU share is printed. Calls are counted by the server (sentiment_requests_total{code="OK"}), not by h2load,
which does not read gRPC status trailers.

Per request, from /proc/PID/stat of the server's processes (the workers, or the one server) over the measured
seconds: CPU ms (user + system, every thread: gRPC's, the handlers', the batcher's and onnxruntime's) and the
wall ms of onnxruntime runs (sentiment_inference_seconds); their difference is the CPU spent outside onnxruntime
(a lower bound when a run is preempted, as its wall time then exceeds its CPU time).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import re
import resource
import shutil
import struct
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "bench"))

from serve_bench import DEFAULT_DATA, Server, cpu_seconds  # noqa: E402

CLASSIFY = "/sentiment.v1.SentimentService/Classify"


def grpc_body(text: str) -> bytes:
    """One ClassifyRequest as a gRPC message on the wire: flag 0 (uncompressed), 4-byte big-endian length, bytes."""
    from serving.gen.sentiment.v1 import sentiment_service_pb2 as pb

    message = pb.ClassifyRequest(texts=[text]).SerializeToString()
    return struct.pack(">BI", 0, len(message)) + message


def ok_calls(server: Server) -> float:
    page = server.scrape()
    m = re.search(r'^sentiment_requests_total\{code="OK",method="sentiment.v1.SentimentService/Classify"\} (\S+)$',
                  page, re.M)
    return float(m.group(1)) if m else 0.0


def h2load(port: int, body: Path, seconds: float, connections: int, streams: int) -> tuple[str, float]:
    """h2load's report and the CPU seconds it used."""
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    out = subprocess.run(["h2load", "-D", f"{max(1, round(seconds))}s", "-c", str(connections), "-m", str(streams),
                          "-t", "1", "-d", str(body), "-H", "content-type: application/grpc", "-H", "te: trailers",
                          f"http://127.0.0.1:{port}{CLASSIFY}"], capture_output=True, text=True, check=True)
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    return out.stdout, (after.ru_utime + after.ru_stime) - (before.ru_utime + before.ru_stime)


AREAS = [  # (area, substring of a frame's file), first match wins
    ("onnxruntime run", "onnxruntime"), ("tokenizer (sentencepiece, contract/tokens.py)", "sentencepiece"),
    ("tokenizer (sentencepiece, contract/tokens.py)", "contract/tokens.py"), ("protobuf", "protobuf"),
    ("prometheus_client", "prometheus_client"), ("gRPC Python (grpc/)", "grpc/"), ("batcher", "serving/batcher.py"),
    ("gate", "serving/gate.py"), ("servicer", "serving/servicer.py"), ("predictor", "serving/predictor.py"),
    ("numpy", "numpy"), ("threading / futures", "threading.py"), ("threading / futures", "concurrent/futures"),
]


def profile_summary(raw: Path, top: int = 15) -> str:
    """Samples by leaf function and by area, as shares of all samples (py-spy --gil: of the thread holding the
    interpreter lock, the Python that one process runs one thread at a time)."""
    by_leaf: dict[str, int] = {}
    by_area: dict[str, int] = {}
    total = 0
    for line in raw.read_text().splitlines():
        stack, _, count = line.rpartition(" ")
        if not stack:
            continue
        n = int(count)
        frames = stack.split(";")
        leaf = re.sub(r":\d+\)$", ")", frames[-1])
        by_leaf[leaf] = by_leaf.get(leaf, 0) + n
        area = next((name for name, key in AREAS if key in frames[-1]), "other")
        # A leaf in a library called from our code counts as that library; a leaf in the standard library (a
        # lock, a queue) counts as the caller's area when one of ours is in the stack.
        if area == "other":
            area = next((name for f in reversed(frames) for name, key in AREAS if key in f), "other")
        by_area[area] = by_area.get(area, 0) + n
        total += n
    out = [f"{total} samples of the thread holding the GIL", "", "| function (leaf frame) | share |", "|---|---|"]
    out += [f"| `{k}` | {100 * v / total:.1f}% |" for k, v in sorted(by_leaf.items(), key=lambda x: -x[1])[:top]]
    out += ["", "| area (leaf frame's, else the nearest caller's) | share |", "|---|---|"]
    out += [f"| {k} | {100 * v / total:.1f}% |" for k, v in sorted(by_area.items(), key=lambda x: -x[1])]
    return "\n".join(out)


def measure(bundle: Path, workers: int, body: Path, args: argparse.Namespace, floor: bool = False) -> dict:
    server = Server(bundle, "--workers", str(workers), "--intra-op-threads", "1", *args.server_args.split(),
                    floor=floor)
    try:
        h2load(server.port, body, min(2.0, args.seconds / 2), args.connections, args.streams)  # warm-up
        calls0, runs0 = ok_calls(server), server.metric("sentiment_inference_seconds_sum")
        cpu0, t0 = cpu_seconds(server.pids), time.perf_counter()
        spy = None
        if args.profile:
            spy = subprocess.Popen([str(Path(sys.executable).parent / "py-spy"), "record", "-p", str(server.pids[0]),
                                    "-d", str(max(1, int(args.seconds) - 1)), "-r", "200", "-f", "raw", "-o",
                                    str(args.profile), "--nonblocking", "--gil"], stdout=subprocess.DEVNULL,
                                   stderr=subprocess.DEVNULL)
        report, client_cpu = h2load(server.port, body, args.seconds, args.connections, args.streams)
        if spy is not None:
            spy.wait(60)
        elapsed, cpu1 = time.perf_counter() - t0, cpu_seconds(server.pids)
        calls1, runs1 = ok_calls(server), server.metric("sentiment_inference_seconds_sum")
        sent = re.search(r"requests: (\d+) total", report)
    finally:
        server.stop()
    calls, cores = calls1 - calls0, os.cpu_count() or 1
    return {"workers": "floor" if floor else workers, "requests_per_s": calls / elapsed, "calls": calls,
            "h2load_requests": int(sent.group(1)) if sent else None,
            "server_cpu_ms": 1e3 * (cpu1 - cpu0) / calls, "ort_wall_ms": 1e3 * (runs1 - runs0) / calls,
            "server_cpu_share": (cpu1 - cpu0) / (elapsed * cores), "client_cpu_share": client_cpu / (elapsed * cores)}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--bundle", type=Path, required=True, help="bundle to serve (the tiny one: see above)")
    ap.add_argument("--workers", type=int, nargs="+", default=[1, 2], help="worker process counts to measure")
    ap.add_argument("--seconds", type=float, default=5.0, help="measured seconds per count (after a warm-up)")
    ap.add_argument("--connections", type=int, default=32, help="h2load connections (spread over the workers)")
    ap.add_argument("--streams", type=int, default=4, help="calls at once on each connection")
    ap.add_argument("--data", type=Path, default=DEFAULT_DATA, help="folder holding cls-books-fr/")
    ap.add_argument("--server-args", default="", help="extra server options")
    ap.add_argument("--json", type=Path, help="also write the rows as JSON here")
    ap.add_argument("--profile", type=Path, help="py-spy the first worker during the measure; stacks to this file")
    ap.add_argument("--floor", action="store_true",
                    help="also measure the bare grpcio server (bench/grpc_floor.py, one process) under the same load")
    args = ap.parse_args()
    if shutil.which("h2load") is None:
        ap.error("h2load not found: install it (Debian/Ubuntu: apt-get install nghttp2-client)")
    lines = (args.data / "cls-books-fr" / "test.review.txt").read_text(encoding="utf-8").split("\n")
    reviews = sorted((t for t in lines if t.strip()), key=len)
    text = reviews[len(reviews) // 2]  # the median length
    with tempfile.TemporaryDirectory() as tmp:
        body = Path(tmp) / "classify.grpc"
        body.write_bytes(grpc_body(text))
        rows = [measure(args.bundle, n, body, args) for n in args.workers]
        floor = measure(args.bundle, 1, body, args, floor=True) if args.floor else None
    print("| workers | requests/s | server CPU ms per request | of which onnxruntime runs (wall) ms | outside "
          "onnxruntime ms | CPU share: server / h2load |\n|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['workers']} | {r['requests_per_s']:.0f} | {r['server_cpu_ms']:.3f} | {r['ort_wall_ms']:.3f} | "
              f"{r['server_cpu_ms'] - r['ort_wall_ms']:.3f} | {100 * r['server_cpu_share']:.0f}% / "
              f"{100 * r['client_cpu_share']:.0f}% |")
    if floor is not None:
        # Its runs' wall time is not a cost: 128 handler threads run them, waiting for the interpreter lock.
        print(f"| bare grpcio server (floor) | {floor['requests_per_s']:.0f} | {floor['server_cpu_ms']:.3f} | "
              f"not comparable (runs in the handler threads) | | {100 * floor['server_cpu_share']:.0f}% / "
              f"{100 * floor['client_cpu_share']:.0f}% |")
        rows.append(floor)
    base = rows[0]["requests_per_s"]
    for r in rows[1:]:
        print(f"{r['workers']} workers / {rows[0]['workers']}: {r['requests_per_s'] / base:.2f}x"
              if r is not floor else f"1 worker / floor: {base / r['requests_per_s']:.2f}x")
    print(f"one review of {len(text)} characters (the median) per call; {args.connections} connections x "
          f"{args.streams} streams; machine: {platform.machine()}, {os.cpu_count()} cores; {time.strftime('%Y-%m-%d')}")
    if args.profile:
        print("\n" + profile_summary(args.profile))
    if args.json:
        args.json.write_text(json.dumps({"rows": rows, "args": sys.argv[1:]}, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
