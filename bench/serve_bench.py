"""Serving benchmark: throughput and p50/p99 latency over loopback at several concurrencies, for
  - the in-process predictor (the limit: the same closed-loop callers, no gRPC, no batching),
  - the server with dynamic batching on,
  - the same server with batching off (every request its own run),
  - with `--modes floor`, a bare grpcio server over the same predictor (bench/grpc_floor.py): what gRPC alone costs,
  - with `--eager SIZE`, the same model in PyTorch eager in-process (the random weights `--make-bundle` exports:
    rebuilt from the same seed), on `--device`, `--eager-dtype` fp32 or fp16,
with review-length texts (cls-books-fr test reviews), `--per-call` texts per request (1 by default; 64 = a client
that batches itself), on `--device` cpu (default) or cuda.

    python bench/serve_bench.py --make-bundle /tmp/lab-bundle        # once: lab-size classifier, random weights
    python bench/serve_bench.py --bundle /tmp/lab-bundle [--concurrency 1 8 64] [--seconds 5] [--json out.json]
    python bench/serve_bench.py --make-bundle /tmp/lab-fp16 --precision fp16      # one fp16 graph, for CUDA
    python bench/serve_bench.py --bundle /tmp/lab-bundle --device cuda --per-call 1 64 --eager lab \
        --concurrency 1 8 64 256 --server-args "--max-batch-tokens 32768 --max-queue 20000"

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
from bench_texts import DEFAULT_DATA, test_texts  # noqa: E402


def random_classifier(data_root: Path, size: str = "lab"):
    """(model, config) of the classifier `make_bundle` exports: `lab` (vocab 50,001, d 200, 4 layers, max_len 512)
    or `tiny` (the tests' size), random weights from seed 0, so that PyTorch eager (--eager) runs the very weights
    the bundle holds."""
    import torch

    from trainer.config.presets import lab, tiny
    from trainer.config.schema import override
    from trainer.model.encoder import build

    cfg = override({"lab": lab, "tiny": tiny}[size](), {"data.root": str(data_root)})
    torch.manual_seed(0)
    return build(cfg.model, "classifier").eval(), cfg


def make_bundle(out: Path, data_root: Path, precision: str = "auto", size: str = "lab") -> Path:
    """The lab's classifier with random weights, exported by the project's own exporter with the lab tokenizer: the
    serving cost of the real thing, without training it (`tiny`: the tests' size, its tokenizer trained here).
    precision: `export --precision` ("auto": what export writes by default, int8 on the CPU within its bound)."""
    import tempfile

    from trainer import artifact
    from trainer.data.tokenizer import Tokenizer
    from trainer.export import ExportOptions, export_bundle

    model, cfg = random_classifier(data_root, size)
    books = data_root / "cls-books-fr"
    tc = cfg.tokenizer
    tok = Tokenizer.from_lab(books / "sentencepiece.french.model", books / "dict.txt", tc.max_len) if size == "lab" \
        else Tokenizer.train([books / "train.review.txt"], vocab_size=tc.vocab_size, max_len=tc.max_len,
                             train_lines=tc.train_lines, seed=0)
    with tempfile.TemporaryDirectory() as tmp:
        art = artifact.save(Path(tmp) / "artifact", model, cfg, "classifier", tok,
                            extra={"note": "random weights: serving benchmark only"})
        return export_bundle(art, out, ExportOptions(precision=precision))


def percentile(values: list[float], q: float) -> float:
    return float(np.percentile(np.asarray(values), q)) if values else float("nan")


def summarize(name: str, c: int, latencies: list[float], texts: int, seconds: float, extra: dict | None = None):
    """One row; `per_call` (texts per request) is 1 unless `extra` says otherwise."""
    return {"mode": name, "concurrency": c, "per_call": 1, "texts_per_s": texts / seconds,
            "p50_ms": 1e3 * percentile(latencies, 50), "p99_ms": 1e3 * percentile(latencies, 99),
            "requests": len(latencies), **(extra or {})}


def pick(rng: random.Random, texts: list[str], k: int) -> list[str]:
    return [rng.choice(texts) for _ in range(k)]


def closed_loop(call, texts: list[str], c: int, seconds: float, per_call: int) -> tuple[list[float], float]:
    """c threads, each calling call(texts of one request) in a closed loop for `seconds`: latencies, elapsed."""
    stop_at = time.perf_counter() + seconds
    latencies: list[list[float]] = [[] for _ in range(c)]

    def caller(i: int) -> None:
        rng = random.Random(i)
        while time.perf_counter() < stop_at:
            batch = pick(rng, texts, per_call)
            t0 = time.perf_counter()
            call(batch)
            latencies[i].append(time.perf_counter() - t0)

    start = time.perf_counter()
    workers = [threading.Thread(target=caller, args=(i,)) for i in range(c)]
    for w in workers:
        w.start()
    for w in workers:
        w.join()
    return [x for lat in latencies for x in lat], time.perf_counter() - start


def bench_in_process(bundle: Path, texts: list[str], c: int, seconds: float, threads: int, per_call: int = 1,
                     device: str = "cpu", predictor=None) -> dict:
    """The server's load without gRPC: c threads, each calling predict(texts) in a closed loop, one shared
    predictor (onnxruntime runs concurrently; each run has `threads` intra-op threads). `predictor`: one already
    loaded with those settings (a sweep of points loads it once)."""
    from serving.model.predictor import Predictor

    p = predictor or Predictor(bundle, device=device, intra_op_threads=threads)
    p.predict(texts[:8])  # warm-up
    cpu0 = time.process_time()
    flat, elapsed = closed_loop(p.predict, texts, c, seconds, per_call)
    return summarize("in-process predictor", c, flat, len(flat) * per_call, elapsed, {
        "per_call": per_call, "device": device, "precision": p.precision,
        "cpu": (time.process_time() - cpu0) / (elapsed * (os.cpu_count() or 1))})


def eager_caller(bundle: Path, data_root: Path, size: str, device: str = "cpu", dtype: str = "fp32"):
    """PyTorch eager on the bundle's weights (rebuilt from the seed `make_bundle` used) and `device`, called like
    the predictor: texts -> (n, C) probabilities on the host, tokenized by the bundle's own encoder, right-padded.
    Returns the call and the largest probability difference from the bundle's graph on 8 texts."""
    import torch

    from contract.tokens import PAD
    from serving.model.predictor import Predictor, softmax

    if device == "cpu":
        torch.set_num_threads(1)  # as the predictor's onnxruntime runs (--threads 1)
    model, _ = random_classifier(data_root, size)
    model = model.to(device=device, dtype=torch.float16 if dtype == "fp16" else torch.float32)
    reference = Predictor(bundle, device=device, intra_op_threads=1)

    def call(batch: list[str]) -> np.ndarray:
        encoded = reference.encode(batch)
        T = max(len(e.ids) for e in encoded)
        ids = torch.full((len(encoded), T), PAD, dtype=torch.long)  # (n, T)
        pad = torch.ones((len(encoded), T), dtype=torch.bool)  # (n, T), True = padding
        for i, e in enumerate(encoded):
            ids[i, : len(e.ids)] = torch.as_tensor(e.ids)
            pad[i, : len(e.ids)] = False
        with torch.inference_mode():
            logits = model(ids.to(device), pad.to(device))  # (n, C)
        return softmax(logits.float().cpu().numpy())

    return call, lambda texts: float(np.abs(call(texts) - np.stack([x.probabilities for x in
                                                                     reference.predict(texts)])).max())


def bench_eager(call, drift: float, texts: list[str], c: int, seconds: float, per_call: int = 1,
                device: str = "cpu", dtype: str = "fp32") -> dict:
    """PyTorch eager in-process (`eager_caller`), the predictor's closed loop."""
    call(texts[:8])  # warm-up
    cpu0 = time.process_time()
    flat, elapsed = closed_loop(call, texts, c, seconds, per_call)
    return summarize(f"PyTorch eager {dtype}", c, flat, len(flat) * per_call, elapsed, {
        "per_call": per_call, "device": device, "precision": dtype, "max_prob_diff_vs_bundle": drift,
        "cpu": (time.process_time() - cpu0) / (elapsed * (os.cpu_count() or 1))})


def sweep(bundle: Path, texts: list[str], sizes: list[int], threads: int, device: str = "cpu") -> list[dict]:
    """Milliseconds per text of in-process runs of b texts, lengths sorted (least padding) or shuffled."""
    from serving.model.predictor import Predictor

    p = Predictor(bundle, device=device, intra_op_threads=threads)
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

    def __init__(self, bundle: Path, *args: str, floor: bool = False, device: str = "cpu",
                 cpus: str | None = None, tree: Path | None = None) -> None:
        """floor: run bench/grpc_floor.py (a bare grpcio server over the same predictor) instead. cpus: a taskset
        list (e.g. 0-13) the server and its workers run on, leaving the other cores to the load generator. tree:
        run the serving/ of that checkout (another commit's) instead of this one's."""
        program = [str(REPO / "bench" / "grpc_floor.py")] if floor else ["-m", "serving.server"]
        pin = ["taskset", "-c", cpus] if cpus else []  # taskset execs the server: the pid stays the server's
        cmd = [*pin, sys.executable, *program, str(bundle), "--port", "0", "--metrics-port", "0", "--device", device,
               *args]
        self.proc = subprocess.Popen(cmd, cwd=tree or REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
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
        """The sum of the series of `name` (one per model version: labels model, version), nan when none."""
        values = re.findall(rf"^{name}(?:{{[^}}]*}})? ([0-9.e+-]+)$", self.scrape(), re.M)
        return sum(map(float, values)) if values else float("nan")

    def stop(self) -> None:
        self.proc.send_signal(signal.SIGTERM)
        self.proc.wait(60)


def cpu_seconds(pids: list[int]) -> float:
    """User + system CPU seconds of live processes so far (/proc/PID/stat)."""
    from serving.process.workers import proc_usage

    return sum((proc_usage(pid) or (0.0, 0))[0] for pid in pids)


def bench_server(server: Server, name: str, texts: list[str], c: int, seconds: float, channels: int = 8,
                 per_call: int = 1) -> dict:
    """c closed-loop callers over min(c, channels) connections (a connection stays with one worker of
    --workers N), `per_call` texts a request. Also: the CPU share of this process (the client) and of the server's
    processes, of all cores."""
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
            request = pb.ClassifyRequest(texts=pick(rng, texts, per_call))
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
    return summarize(name, c, latencies, len(latencies) * per_call, elapsed, {
        "per_call": per_call, "mean_batch": mean_batch, "errors": errors,
        "client_cpu": (client1 - client0) / (elapsed * cores), "server_cpu": (server1 - server0) / (elapsed * cores)})


def table(rows: list[dict]) -> str:
    out = ["| mode | device, graph | texts per call | concurrency | texts/s | p50 ms | p99 ms | mean texts per ORT run "
           "| CPU: client / server |", "|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        batch = f"{r['mean_batch']:.1f}" if "mean_batch" in r else str(r["per_call"])
        cpu = f"{100 * r['client_cpu']:.0f}% / {100 * r['server_cpu']:.0f}%" if "client_cpu" in r else \
            f"{100 * r['cpu']:.0f}% (one process)"
        errors = f" ({sum(r['errors'].values())} refused)" if r.get("errors") else ""
        out.append(f"| {r['mode']} | {r.get('device', 'cpu')}, {r.get('precision', '')} | {r['per_call']} | "
                   f"{r['concurrency']} | {r['texts_per_s']:.1f}{errors} | {r['p50_ms']:.2f} | {r['p99_ms']:.2f} | "
                   f"{batch} | {cpu} |")
    return "\n".join(out)


def ratios(rows: list[dict], modes: dict[str, tuple[str, list[str]]], chosen: list[str]) -> list[str]:
    """The comparisons the rows allow, one line each: server / in-process, server / floor, batching on / off,
    ONNX Runtime / PyTorch eager (texts/s, same concurrency and texts per call)."""
    by = {(r["mode"], r["concurrency"], r["per_call"]): r for r in rows}
    out = []

    def line(a: str, b: str, label: str) -> None:
        for (mode, c, k), r in sorted(by.items(), key=lambda x: (x[0][2], x[0][1])):
            other = by.get((b, c, k))
            if mode == a and other is not None and other["texts_per_s"] > 0:
                out.append(f"{label}, {k} per call, concurrency {c}: {r['texts_per_s'] / other['texts_per_s']:.2f}x, "
                           f"p50 {r['p50_ms'] - other['p50_ms']:+.2f} ms")

    served = [modes[m][0] for m in chosen if m != "floor"]
    for name in served:
        line(name, "in-process predictor", f"{name} / in-process")
        if "floor" in chosen:
            line(name, modes["floor"][0], f"{name} / floor")
    if "on" in chosen and "off" in chosen:
        line(modes["on"][0], modes["off"][0], "batching on / off")
    for eager in sorted({r["mode"] for r in rows if r["mode"].startswith("PyTorch eager")}):
        line("in-process predictor", eager, f"in-process ONNX Runtime / {eager}")
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--bundle", type=Path, help="bundle folder to serve")
    ap.add_argument("--make-bundle", type=Path, help="write the random-weight bundle (--size, --precision) here, exit")
    ap.add_argument("--size", choices=["lab", "tiny"], default="lab", help="--make-bundle's and --eager's model")
    ap.add_argument("--precision", choices=["auto", "fp32", "fp16", "int8"], default="auto",
                    help="--make-bundle: export --precision (auto: fp32 for CUDA + int8 for the CPU)")
    ap.add_argument("--data", type=Path, default=DEFAULT_DATA, help="folder holding cls-books-fr/")
    ap.add_argument("--device", choices=["cpu", "cuda"], default="cpu", help="where onnxruntime (and --eager) run")
    ap.add_argument("--concurrency", type=int, nargs="+", default=[1, 8, 64], help="closed-loop callers, one row each")
    ap.add_argument("--per-call", type=int, nargs="+", default=[1], help="texts per request (each value measured)")
    ap.add_argument("--seconds", type=float, default=5.0, help="measured seconds per point (after warm-up)")
    ap.add_argument("--texts", type=int, default=256, help="distinct reviews drawn from the test split")
    ap.add_argument("--threads", type=int, default=1,
                    help="onnxruntime intra-op threads per run, in-process and server alike (0 = one per core)")
    ap.add_argument("--server-args", default="", help="extra server options, e.g. '--max-batch-tokens 8192'")
    ap.add_argument("--channels", type=int, default=8,
                    help="client connections (at most one per caller): each stays with one server worker")
    ap.add_argument("--modes", nargs="*", default=["on", "off"], choices=["on", "off", "floor"],
                    help="servers to run: batching on, batching off, the bare grpcio floor (bench/grpc_floor.py)")
    ap.add_argument("--no-in-process", action="store_true", help="skip the in-process predictor's rows")
    ap.add_argument("--in-process-max-texts", type=int, default=1024,
                    help="in-process and eager points whose callers hold more texts at once (concurrency x texts "
                         "per call) are skipped: every caller's run is in flight on the device at once, unbatched")
    ap.add_argument("--eager", choices=["lab", "tiny"],
                    help="also PyTorch eager in-process: the random weights --make-bundle --size SIZE exported")
    ap.add_argument("--eager-dtype", nargs="+", choices=["fp32", "fp16"], default=["fp32"],
                    help="--eager's weights and activations, one row set each")
    ap.add_argument("--sweep", type=int, nargs="*", default=[1, 4, 8, 16, 32, 64],
                    help="batch sizes of the in-process cost-per-text sweep (none: skip it)")
    ap.add_argument("--json", type=Path, help="also write the rows as JSON here")
    args = ap.parse_args()
    if args.make_bundle:
        print(make_bundle(args.make_bundle, args.data, args.precision, args.size))
        return 0
    if not args.bundle:
        ap.error("--bundle is required (or --make-bundle DIR first)")
    if min(args.concurrency + args.per_call) < 1 or args.seconds <= 0:
        ap.error("--concurrency and --per-call take counts >= 1, --seconds a positive time")
    texts = test_texts(ap, args.data, args.texts)
    swept = sweep(args.bundle, texts, args.sweep, args.threads, args.device) if args.sweep else []
    points = [(k, c) for k in args.per_call for c in args.concurrency]
    local = [(k, c) for k, c in points if k * c <= args.in_process_max_texts]  # in-process and eager
    skipped = [f"{k} per call at concurrency {c}" for k, c in points if (k, c) not in local]
    rows = []
    if not args.no_in_process:
        from serving.model.predictor import Predictor

        predictor = Predictor(args.bundle, device=args.device, intra_op_threads=args.threads)
        rows += [bench_in_process(args.bundle, texts, c, args.seconds, args.threads, k, args.device, predictor)
                 for k, c in local]
        del predictor
    for dtype in args.eager_dtype if args.eager else []:
        call, drift_of = eager_caller(args.bundle, args.data, args.eager, args.device, dtype)
        drift = drift_of(texts[:8])
        rows += [bench_eager(call, drift, texts, c, args.seconds, k, args.device, dtype) for k, c in local]
        del call, drift_of
    threads = ["--intra-op-threads", str(args.threads), *args.server_args.split()]
    modes = {"on": ("server, batching on", []), "off": ("server, batching off", ["--no-batching"]),
             "floor": ("bare grpcio server (floor)", [])}
    for mode in args.modes:
        name, extra = modes[mode]
        server = Server(args.bundle, *threads, *extra, floor=mode == "floor", device=args.device)
        try:
            for k, c in points:
                row = bench_server(server, name, texts, c, args.seconds, args.channels, k)
                rows.append({**row, "device": args.device})
        finally:
            server.stop()
    from contract.bundle import verify_bundle

    manifest = verify_bundle(args.bundle).manifest  # the graph the server runs on this device, as it chooses it
    for r in rows:
        r.setdefault("precision", manifest.graphs[manifest.graph_for(args.device)].precision)
    if swept:
        print("| texts per run | ms per text, lengths sorted | ms per text, shuffled |\n|---|---|---|")
        for r in swept:
            print(f"| {r['batch']} | {r['sorted']:.2f} | {r['shuffled']:.2f} |")
        print()
    print(table(rows))
    print("\n".join(ratios(rows, modes, args.modes)))
    if skipped and (not args.no_in_process or args.eager):
        print(f"in-process and eager rows skipped (more than {args.in_process_max_texts} texts at once): "
              + ", ".join(skipped))
    mean_chars = np.mean([len(t) for t in texts])
    print(f"texts: {len(texts)} test reviews, mean {mean_chars:.0f} characters; device {args.device}; machine: "
          f"{platform.machine()}, {os.cpu_count()} cores; {time.strftime('%Y-%m-%d')}")
    if args.json:
        args.json.write_text(json.dumps({"rows": rows, "sweep": swept, "in_process_skipped": skipped,
                                         "args": sys.argv[1:]}, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
