"""Serving benchmark: throughput and p50/p99 latency over loopback at several concurrencies, for
  - the in-process predictor (the limit: the same closed-loop callers, no gRPC, no batching),
  - the server with dynamic batching on,
  - the same server with batching off (every request its own run),
  - with `--modes floor`, a bare grpcio server over the same predictor (bench/grpc_floor.py): what gRPC alone costs,
with review-length texts (cls-books-fr test reviews), one text per request.

    python bench/serve_bench.py --make-bundle /tmp/lab-bundle        # once: lab-size classifier, random weights
    python bench/serve_bench.py --bundle /tmp/lab-bundle [--concurrency 1 8 64] [--seconds 5] [--json out.json]

The server runs as a subprocess (`python -m serving.server`), the load generator here: c threads, each sending
one request at a time (closed loop). Both share this machine's cores, as a client and a server on one host do.
A sweep first prints the in-process cost per text against texts per run (lengths sorted or shuffled): what
batching can gain on this hardware at all.
Prints a markdown table; docs/BENCHMARKS.md (Serving) records a run with its command, machine and date.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import random
import re
import signal
import subprocess
import sys
import threading
import time
import urllib.request
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

DEFAULT_DATA = Path(os.environ.get("TS_DATA") or REPO.parent / "shared" / "data")


def make_bundle(out: Path, data_root: Path, precision: str = "auto") -> Path:
    """The lab's classifier (vocab 50,001, d 200, 4 layers, max_len 512) with random weights, exported by the
    project's own exporter with the lab tokenizer: the serving cost of the real thing, without training it.
    precision: `export --precision` ("auto": what export writes by default, int8 on the CPU within its bound)."""
    import tempfile

    import torch

    from trainer import artifact
    from trainer.config.presets import lab
    from trainer.config.schema import override
    from trainer.data.tokenizer import Tokenizer
    from trainer.export import ExportOptions, export_bundle
    from trainer.model.encoder import build

    cfg = override(lab(), {"data.root": str(data_root)})
    books = data_root / "cls-books-fr"
    tok = Tokenizer.from_lab(books / "sentencepiece.french.model", books / "dict.txt", cfg.tokenizer.max_len)
    torch.manual_seed(0)
    model = build(cfg.model, "classifier").eval()
    with tempfile.TemporaryDirectory() as tmp:
        art = artifact.save(Path(tmp) / "artifact", model, cfg, "classifier", tok,
                            extra={"note": "random weights: serving benchmark only"})
        return export_bundle(art, out, ExportOptions(precision=precision))


def percentile(values: list[float], q: float) -> float:
    return float(np.percentile(np.asarray(values), q)) if values else float("nan")


def summarize(name: str, c: int, latencies: list[float], texts: int, seconds: float, extra: dict | None = None):
    return {"mode": name, "concurrency": c, "texts_per_s": texts / seconds, "p50_ms": 1e3 * percentile(latencies, 50),
            "p99_ms": 1e3 * percentile(latencies, 99), "requests": len(latencies), **(extra or {})}


def bench_in_process(bundle: Path, texts: list[str], c: int, seconds: float, threads: int) -> dict:
    """The server's load without gRPC: c threads, each calling predict([text]) in a closed loop, one shared
    predictor (onnxruntime runs concurrently; each run has `threads` intra-op threads)."""
    from serving.predictor import Predictor

    p = Predictor(bundle, device="cpu", intra_op_threads=threads)
    p.predict(texts[:8])  # warm-up
    stop_at = time.perf_counter() + seconds
    latencies: list[list[float]] = [[] for _ in range(c)]

    def caller(i: int) -> None:
        rng = random.Random(i)
        while time.perf_counter() < stop_at:
            t0 = time.perf_counter()
            p.predict([rng.choice(texts)])
            latencies[i].append(time.perf_counter() - t0)

    start, cpu0 = time.perf_counter(), time.process_time()
    workers = [threading.Thread(target=caller, args=(i,)) for i in range(c)]
    for w in workers:
        w.start()
    for w in workers:
        w.join()
    flat = [x for lat in latencies for x in lat]
    elapsed = time.perf_counter() - start
    return summarize("in-process predictor", c, flat, len(flat), elapsed,
                     {"cpu": (time.process_time() - cpu0) / (elapsed * (os.cpu_count() or 1))})


def sweep(bundle: Path, texts: list[str], sizes: list[int], threads: int) -> list[dict]:
    """Milliseconds per text of in-process runs of b texts, lengths sorted (least padding) or shuffled."""
    from serving.predictor import Predictor

    p = Predictor(bundle, device="cpu", intra_op_threads=threads)
    encoded = sorted(p.encode(texts), key=lambda e: e.token_count)
    shuffled = random.Random(1).sample(encoded, len(encoded))
    p.infer([e.ids for e in encoded[:8]])  # warm-up
    rows = []
    for b in sizes:
        row = {"batch": b}
        for name, order in (("sorted", encoded), ("shuffled", shuffled)):
            start = time.perf_counter()
            for i in range(0, len(order), b):
                p.infer([e.ids for e in order[i : i + b]])
            row[name] = 1e3 * (time.perf_counter() - start) / len(order)
        rows.append(row)
    return rows


class Server:
    """`python -m serving.server` in a subprocess on a free loopback port, with metrics on another."""

    def __init__(self, bundle: Path, *args: str, floor: bool = False) -> None:
        """floor: run bench/grpc_floor.py (a bare grpcio server over the same predictor) instead."""
        program = [str(REPO / "bench" / "grpc_floor.py")] if floor else ["-m", "serving.server"]
        cmd = [sys.executable, *program, str(bundle), "--port", "0", "--metrics-port", "0", "--device", "cpu", *args]
        self.proc = subprocess.Popen(cmd, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            m = re.search(r"listening on [\d.]+:(\d+).*metrics on [\d.]*:(\d+)", line)
            if m:
                self.port, self.metrics_port = int(m.group(1)), int(m.group(2))
                # The processes that serve: the workers (--workers N > 1, "pids ..." in this line) or this one.
                workers = re.search(r"pids ([\d ]+)", line)
                self.pids = [int(p) for p in workers.group(1).split()] if workers else [self.proc.pid]
                break
        else:
            raise RuntimeError(f"server did not start: {' '.join(cmd)}")
        threading.Thread(target=lambda: [None for _ in self.proc.stdout], daemon=True).start()  # drain the log

    def scrape(self) -> str:
        return urllib.request.urlopen(f"http://127.0.0.1:{self.metrics_port}/metrics", timeout=5).read().decode()

    def metric(self, name: str) -> float:
        page = self.scrape()
        m = re.search(rf"^{name} ([0-9.e+-]+)$", page, re.M)
        return float(m.group(1)) if m else float("nan")

    def stop(self) -> None:
        self.proc.send_signal(signal.SIGTERM)
        self.proc.wait(60)


def cpu_seconds(pids: list[int]) -> float:
    """User + system CPU seconds of live processes so far (/proc/PID/stat)."""
    from serving.workers import proc_usage

    return sum((proc_usage(pid) or (0.0, 0))[0] for pid in pids)


def bench_server(server: Server, name: str, texts: list[str], c: int, seconds: float, channels: int = 8) -> dict:
    """c closed-loop callers over min(c, channels) connections (a connection stays with one worker of
    --workers N). Also: the CPU share of this process (the client) and of the server's processes, of all cores."""
    import grpc

    from serving.gen.sentiment.v1 import sentiment_service_pb2 as pb
    from serving.gen.sentiment.v1 import sentiment_service_pb2_grpc as pb_grpc

    opened = [grpc.insecure_channel(f"127.0.0.1:{server.port}", options=[("grpc.use_local_subchannel_pool", 1)])
              for _ in range(min(c, channels))]
    stubs = [pb_grpc.SentimentServiceStub(ch) for ch in opened]
    for stub in stubs:
        stub.Classify(pb.ClassifyRequest(texts=texts[:1]), timeout=30)
    stop_at = [0.0]
    measuring = threading.Event()
    lock = threading.Lock()
    latencies: list[float] = []
    errors: dict[str, int] = {}

    def caller(seed: int) -> None:
        rng = random.Random(seed)
        stub = stubs[seed % len(stubs)]
        while time.perf_counter() < stop_at[0]:
            request = pb.ClassifyRequest(texts=[rng.choice(texts)])
            t0 = time.perf_counter()
            try:
                stub.Classify(request, timeout=60)
                code = None
            except grpc.RpcError as e:
                code = e.code().name
            dt = time.perf_counter() - t0
            if measuring.is_set():
                with lock:
                    if code is None:
                        latencies.append(dt)
                    else:
                        errors[code] = errors.get(code, 0) + 1

    warmup = min(2.0, seconds / 2)
    stop_at[0] = time.perf_counter() + warmup + seconds
    threads = [threading.Thread(target=caller, args=(i,)) for i in range(c)]
    for t in threads:
        t.start()
    time.sleep(warmup)
    runs0, texts0 = server.metric("sentiment_batch_size_count"), server.metric("sentiment_batch_size_sum")
    measuring.set()
    start, client0, server0 = time.perf_counter(), time.process_time(), cpu_seconds(server.pids)
    time.sleep(seconds)
    client1, server1 = time.process_time(), cpu_seconds(server.pids)
    runs1, texts1 = server.metric("sentiment_batch_size_count"), server.metric("sentiment_batch_size_sum")
    measuring.clear()
    elapsed = time.perf_counter() - start
    for t in threads:
        t.join()
    for ch in opened:
        ch.close()
    mean_batch = (texts1 - texts0) / (runs1 - runs0) if runs1 > runs0 else float("nan")
    cores = os.cpu_count() or 1
    return summarize(name, c, latencies, len(latencies), elapsed, {
        "mean_batch": mean_batch, "errors": errors, "client_cpu": (client1 - client0) / (elapsed * cores),
        "server_cpu": (server1 - server0) / (elapsed * cores)})


def table(rows: list[dict]) -> str:
    out = ["| mode | concurrency | texts/s | p50 ms | p99 ms | mean texts per ORT run | CPU: client / server |",
           "|---|---|---|---|---|---|---|"]
    for r in rows:
        batch = f"{r['mean_batch']:.1f}" if "mean_batch" in r else "1"
        cpu = f"{100 * r['client_cpu']:.0f}% / {100 * r['server_cpu']:.0f}%" if "client_cpu" in r else \
            f"{100 * r['cpu']:.0f}% (one process)"
        out.append(f"| {r['mode']} | {r['concurrency']} | {r['texts_per_s']:.1f} | {r['p50_ms']:.2f} | "
                   f"{r['p99_ms']:.2f} | {batch} | {cpu} |")
    return "\n".join(out)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--bundle", type=Path, help="bundle folder to serve")
    ap.add_argument("--make-bundle", type=Path, help="write the lab-size random-weight bundle here and exit")
    ap.add_argument("--data", type=Path, default=DEFAULT_DATA, help="folder holding cls-books-fr/")
    ap.add_argument("--concurrency", type=int, nargs="+", default=[1, 8, 64], help="closed-loop callers, one row each")
    ap.add_argument("--seconds", type=float, default=5.0, help="measured seconds per point (after warm-up)")
    ap.add_argument("--texts", type=int, default=256, help="distinct reviews drawn from the test split")
    ap.add_argument("--threads", type=int, default=1,
                    help="onnxruntime intra-op threads per run, in-process and server alike (0 = one per core)")
    ap.add_argument("--server-args", default="", help="extra server options, e.g. '--max-batch-tokens 8192'")
    ap.add_argument("--channels", type=int, default=8,
                    help="client connections (at most one per caller): each stays with one server worker")
    ap.add_argument("--modes", nargs="+", default=["on", "off"], choices=["on", "off", "floor"],
                    help="servers to run: batching on, batching off, the bare grpcio floor (bench/grpc_floor.py)")
    ap.add_argument("--sweep", type=int, nargs="*", default=[1, 4, 8, 16, 32, 64],
                    help="batch sizes of the in-process cost-per-text sweep (none: skip it)")
    ap.add_argument("--json", type=Path, help="also write the rows as JSON here")
    args = ap.parse_args()
    if args.make_bundle:
        print(make_bundle(args.make_bundle, args.data))
        return 0
    if not args.bundle:
        ap.error("--bundle is required (or --make-bundle DIR first)")

    lines = (args.data / "cls-books-fr" / "test.review.txt").read_text(encoding="utf-8").split("\n")
    texts = random.Random(0).sample([t for t in lines if t.strip()], args.texts)
    swept = sweep(args.bundle, texts, args.sweep, args.threads) if args.sweep else []
    rows = [bench_in_process(args.bundle, texts, c, args.seconds, args.threads) for c in args.concurrency]
    threads = ["--intra-op-threads", str(args.threads), *args.server_args.split()]
    modes = {"on": ("server, batching on", []), "off": ("server, batching off", ["--no-batching"]),
             "floor": ("bare grpcio server (floor)", [])}
    for mode in args.modes:
        name, extra = modes[mode]
        server = Server(args.bundle, *threads, *extra, floor=mode == "floor")
        try:
            rows += [bench_server(server, name, texts, c, args.seconds, args.channels) for c in args.concurrency]
        finally:
            server.stop()
    if swept:
        print("| texts per run | ms per text, lengths sorted | ms per text, shuffled |\n|---|---|---|")
        for r in swept:
            print(f"| {r['batch']} | {r['sorted']:.2f} | {r['shuffled']:.2f} |")
        print()
    print(table(rows))

    by = {(r["mode"], r["concurrency"]): r for r in rows}
    cmax = max(args.concurrency)
    first = modes[args.modes[0]][0]
    for c in args.concurrency:
        limit, served = by[("in-process predictor", c)], by[(first, c)]
        print(f"concurrency {c}: {first} / in-process = {100 * served['texts_per_s'] / limit['texts_per_s']:.0f}%, "
              f"p50 server - in-process = {served['p50_ms'] - limit['p50_ms']:.2f} ms")
    if "floor" in args.modes:
        for mode in (m for m in args.modes if m != "floor"):
            for c in args.concurrency:
                served, floor = by[(modes[mode][0], c)], by[(modes["floor"][0], c)]
                print(f"concurrency {c}: {modes[mode][0]} / floor = "
                      f"{100 * served['texts_per_s'] / floor['texts_per_s']:.0f}%, "
                      f"p50 server - floor = {served['p50_ms'] - floor['p50_ms']:.2f} ms")
    if "on" in args.modes and "off" in args.modes:
        on, off = by[("server, batching on", cmax)], by[("server, batching off", cmax)]
        print(f"concurrency {cmax}: batching on / off = {on['texts_per_s'] / off['texts_per_s']:.2f}x")
    mean_tokens = np.mean([len(t) for t in texts])
    print(f"texts: {len(texts)} test reviews, mean {mean_tokens:.0f} characters; machine: {platform.machine()}, "
          f"{os.cpu_count()} cores; {time.strftime('%Y-%m-%d')}")
    if args.json:
        args.json.write_text(json.dumps({"rows": rows, "sweep": swept, "args": sys.argv[1:]}, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
