"""Soak test of the server: sustained concurrent load over loopback for a bounded time, then a verdict.

    python bench/soak.py --bundle BUNDLE [--seconds 600] [--concurrency 128] [--json soak.json]
    python bench/soak.py --make-bundle DIR [--size tiny|lab]     # once: a bundle to soak (random weights)

The server runs as a subprocess (`python -m serving.server BUNDLE --port 0 --device cpu`, its defaults unless
--server-args says otherwise) on 127.0.0.1; `--concurrency` client threads in this process each send one request
at a time (closed loop) with review-length texts from cls-books-fr test.review.txt, for `--warmup` seconds (not
measured) and then `--seconds` seconds, or until `--max-requests` requests: whichever comes first, then SIGTERM.

Recorded: requests served, errors by status code, p50/p99 latency per window (`--window`, default a minute),
the server's resident memory (VmRSS) when idle, at the end of the warm-up and at the end, the server's own counts
by status code (its Prometheus page), and whether every answer equalled the in-process predictor's for its text.
Pass, all of:
  - the only errors are RESOURCE_EXHAUSTED refusals of the batching queue, each past the configured limit
    (the refusal names "W texts waiting + n new > max_queue M": W + n > M and M is the server's --max-queue);
  - every answer equals the in-process predictor's (probabilities within 1e-5, same token count);
  - RSS at the end is less than 5% above RSS at the end of the warm-up (allocators and onnxruntime's arena grow
    to the load's working set first: that is what the warm-up is for; the idle RSS is reported beside it);
  - the server logged no error, health says SERVING at the end, and SIGTERM stops it with exit code 0.
Prints a markdown table and writes the JSON (`--json`). Exit code 0 on pass, 1 on fail.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import random
import re
import sys
import threading
import time
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "tests"))
from trainer.config.presets import data_sets  # noqa: E402

DEFAULT_DATA = Path(data_sets())
RSS_GROWTH_LIMIT = 0.05  # end RSS may exceed the post-warm-up RSS by less than this fraction
# The batcher's two refusals past max_queue: a request's texts that do not fit, and a call refused at admission
# (before its body is read) when a request of max_texts would not fit.
QUEUE_FULL = re.compile(r"queue full: (\d+) texts waiting \+ (\d+) new > max_queue (\d+)")
QUEUE_FULL_AT_ADMISSION = re.compile(r"queue full: (\d+) texts waiting, no room for a request of up to (\d+) texts "
                                     r"\(max_queue (\d+)\)")
ATOL = 1e-5  # served vs in-process probabilities (batched rows differ from lone rows by ~1e-6)


def make_bundle(out: Path, data_root: Path, size: str) -> Path:
    """A bundle with random weights, exported by the project's exporter: what it costs to serve, not what it
    answers (the soak compares answers with the in-process predictor on the same bundle). One fp32 graph: the soak
    holds served answers to ATOL, and an int8 graph's answers move with the other rows of a batch (~1e-3)."""
    if size == "lab":
        sys.path.insert(0, str(REPO / "bench"))
        from serve_bench import make_bundle as lab_bundle

        return lab_bundle(out, data_root, precision="fp32")
    import tempfile

    import torch

    from trainer import artifact
    from trainer.config.presets import tiny
    from trainer.config.schema import override
    from trainer.data.tokenizer import Tokenizer
    from trainer.export import ExportOptions, export_bundle
    from trainer.model.encoder import build

    cfg = override(tiny(), {"data.root": str(data_root)})
    tc = cfg.tokenizer
    tok = Tokenizer.train([data_root / "cls-books-fr" / "train.review.txt"], vocab_size=tc.vocab_size,
                          max_len=tc.max_len, train_lines=tc.train_lines, seed=0)
    torch.manual_seed(0)
    model = build(cfg.model, "classifier").eval()
    with tempfile.TemporaryDirectory() as tmp:
        art = artifact.save(Path(tmp) / "artifact", model, cfg, "classifier", tok,
                            extra={"note": "random weights: soak test only"})
        return export_bundle(art, out, ExportOptions(precision="fp32"))


def rss_bytes(pid: int) -> int:
    """Resident set size of a process (Linux /proc)."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    raise RuntimeError(f"no VmRSS for pid {pid}")


class Recorder:
    """Outcomes per window, thread-safe."""

    def __init__(self, window: float) -> None:
        self.window = window
        self.lock = threading.Lock()
        self.latencies: dict[int, list[float]] = {}  # window index -> seconds of OK requests
        self.errors: dict[int, dict[str, int]] = {}  # window index -> code -> count
        self.warmup = {"requests": 0, "errors": {}}
        self.bad_refusals: list[str] = []  # RESOURCE_EXHAUSTED that is not a queue refusal past the limit
        self.wrong: list[str] = []  # answers that differ from the in-process predictor's
        self.requests = 0  # measured requests sent and answered (any code)

    def add(self, window: int | None, code: str, seconds: float) -> None:
        with self.lock:
            if window is None:
                self.warmup["requests"] += 1
                if code != "OK":
                    self.warmup["errors"][code] = self.warmup["errors"].get(code, 0) + 1
                return
            self.requests += 1
            if code == "OK":
                self.latencies.setdefault(window, []).append(seconds)
            else:
                per = self.errors.setdefault(window, {})
                per[code] = per.get(code, 0) + 1


def run_load(port: int, texts: list[str], expected: np.ndarray, counts: np.ndarray, args: argparse.Namespace,
             max_queue: int,
             rec: Recorder, rss_at_warmup: list[int], pid: int) -> float:
    """Closed-loop callers until the time or count bound; returns the measured seconds."""
    import grpc

    from serving.gen.sentiment.v1 import sentiment_service_pb2 as pb
    from serving.gen.sentiment.v1 import sentiment_service_pb2_grpc as pb_grpc

    # Several connections (a local subchannel pool each), as many clients would open.
    channels = [grpc.insecure_channel(f"127.0.0.1:{port}", options=[("grpc.use_local_subchannel_pool", 1)])
                for _ in range(args.channels)]
    stubs = [pb_grpc.SentimentServiceStub(ch) for ch in channels]
    for stub in stubs:
        stub.Classify(pb.ClassifyRequest(texts=texts[:1]), timeout=60)
    k = args.texts_per_request
    t0 = time.monotonic()
    measure_from = t0 + args.warmup
    stop_at = measure_from + args.seconds
    remaining = [args.max_requests]
    count_lock = threading.Lock()

    def caller(i: int) -> None:
        rng = random.Random(i)
        stub = stubs[i % len(stubs)]
        while True:
            now = time.monotonic()
            if now >= stop_at:
                return
            if now >= measure_from:
                with count_lock:
                    if remaining[0] <= 0:
                        return
                    remaining[0] -= 1
            picks = [rng.randrange(len(texts)) for _ in range(k)]
            start = time.monotonic()
            if start >= stop_at:  # a caller held up past the end (a busy machine) would open a window past the last
                return
            try:
                r = stub.Classify(pb.ClassifyRequest(texts=[texts[j] for j in picks]), timeout=args.timeout)
                code, details = "OK", ""
            except grpc.RpcError as e:
                code, details = e.code().name, e.details() or ""
            end = time.monotonic()
            window = int((start - measure_from) // args.window) if start >= measure_from else None
            rec.add(window, code, end - start)
            if code == "OK":
                got = np.array([list(x.probabilities) for x in r.results], dtype=np.float32)  # (k, C)
                same_counts = [x.token_count for x in r.results] == counts[picks].tolist()
                if (got.shape != expected[picks].shape or not np.allclose(got, expected[picks], atol=ATOL, rtol=0)
                        or not same_counts):
                    with rec.lock:
                        rec.wrong.append(f"texts {picks}: got {got.tolist()}, expected {expected[picks].tolist()}")
            elif code == "RESOURCE_EXHAUSTED":
                m, a = QUEUE_FULL.search(details), QUEUE_FULL_AT_ADMISSION.search(details)
                past = (m and int(m.group(1)) + int(m.group(2)) > int(m.group(3)) and int(m.group(3)) == max_queue
                        or a and int(a.group(1)) + int(a.group(2)) > int(a.group(3)) == max_queue)
                if not past:
                    with rec.lock:
                        rec.bad_refusals.append(details)
                time.sleep(rng.uniform(0.0, 0.02))  # a refused client backs off a little before retrying

    threads = [threading.Thread(target=caller, args=(i,), daemon=True) for i in range(args.concurrency)]
    for t in threads:
        t.start()
    time.sleep(max(0.0, measure_from - time.monotonic()))
    rss_at_warmup.append(rss_bytes(pid))
    for t in threads:
        t.join()
    measured = time.monotonic() - measure_from
    for ch in channels:
        ch.close()
    return min(measured, args.seconds)


def health_status(port: int) -> str:
    import grpc
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    with grpc.insecure_channel(f"127.0.0.1:{port}") as ch:
        status = health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(), timeout=10).status
    return health_pb2.HealthCheckResponse.ServingStatus.Name(status)


def percentile_ms(values: list[float], q: float) -> float:
    return round(1e3 * float(np.percentile(np.asarray(values), q)), 2) if values else float("nan")


def soak(args: argparse.Namespace, texts: list[str]) -> dict:
    from serving_fixtures import ServerProcess

    from serving.model.predictor import Predictor

    reference = Predictor(args.bundle, device="cpu", intra_op_threads=1)
    preds = [p for i in range(0, len(texts), 16) for p in reference.predict(texts[i : i + 16])]
    expected = np.stack([p.probabilities for p in preds])  # (texts, C)
    counts = np.array([p.token_count for p in preds])  # (texts,)
    labels, max_len = reference.label_names, reference.max_len
    del reference

    server_args = args.server_args.split()
    max_queue = 512  # ServerConfig's default, unless --server-args sets it
    if "--max-queue" in server_args:
        max_queue = int(server_args[server_args.index("--max-queue") + 1])
    server = ServerProcess(args.bundle, "--host", "127.0.0.1", "--metrics-port", "0", "--device", "cpu",
                           *server_args)
    server.wait_listening()
    rec = Recorder(args.window)
    rss_at_warmup: list[int] = []
    try:
        rss_idle = rss_bytes(server.proc.pid)
        samples: list[tuple[float, int]] = []  # (seconds since the load began, RSS), every 10 s at most
        sampling = threading.Event()

        def sample() -> None:
            t0 = time.monotonic()
            while not sampling.wait(min(10.0, args.window / 2)):
                samples.append((round(time.monotonic() - t0, 1), rss_bytes(server.proc.pid)))

        sampler = threading.Thread(target=sample, daemon=True)
        sampler.start()
        measured = run_load(server.port, texts, expected, counts, args, max_queue, rec, rss_at_warmup,
                            server.proc.pid)
        sampling.set()
        sampler.join()
        time.sleep(1.0)  # let the last responses' buffers go
        rss_end = rss_bytes(server.proc.pid)
        health = health_status(server.port)
        server_codes = server.codes()
        alive_before_stop = server.proc.poll() is None
        rc = server.stop()
    finally:
        server.close()

    log = "".join(server.lines)
    log_errors = [line.rstrip() for line in server.lines if " ERROR " in line or "Traceback" in line]
    windows = []
    for w in sorted(set(rec.latencies) | set(rec.errors)):
        lat = rec.latencies.get(w, [])
        until = args.warmup + (w + 1) * args.window  # the window's end, in seconds since the load began
        rss = [r for t, r in samples if t <= until + 1]
        windows.append({"window": w, "start_s": w * args.window, "ok": len(lat), "errors": rec.errors.get(w, {}),
                        "p50_ms": percentile_ms(lat, 50), "p99_ms": percentile_ms(lat, 99),
                        "rss_mib": round(rss[-1] / 2**20, 1) if rss else None})
    errors: dict[str, int] = {}
    for per in rec.errors.values():
        for code, n in per.items():
            errors[code] = errors.get(code, 0) + n
    all_lat = [x for lat in rec.latencies.values() for x in lat]
    ok = len(all_lat)
    rss_start = rss_at_warmup[0]
    growth = (rss_end - rss_start) / rss_start
    disallowed = {c: n for c, n in errors.items() if c != "RESOURCE_EXHAUSTED"}
    checks = {
        "only queue refusals past the limit": not disallowed and not rec.bad_refusals
        and not {c: n for c, n in rec.warmup["errors"].items() if c != "RESOURCE_EXHAUSTED"},
        "every answer equals the in-process predictor's": not rec.wrong,
        f"RSS growth < {RSS_GROWTH_LIMIT:.0%}": growth < RSS_GROWTH_LIMIT,
        "no error in the server log": not log_errors,
        "alive and SERVING at the end": alive_before_stop and health == "SERVING",
        "SIGTERM exit code 0": rc == 0,
    }
    return {
        "passed": all(checks.values()),
        "checks": checks,
        "bundle": str(args.bundle),
        "model": {"labels": labels, "max_len": max_len},
        "server_command": " ".join(server.cmd[1:]),
        "concurrency": args.concurrency,
        "channels": args.channels,
        "texts_per_request": args.texts_per_request,
        "distinct_texts": len(texts),
        "mean_characters": round(float(np.mean([len(t) for t in texts])), 1),
        "warmup_s": args.warmup,
        "measured_s": round(measured, 1),
        "requests": rec.requests,
        "ok": ok,
        "requests_per_s": round(ok / measured, 1) if measured else float("nan"),
        "texts_per_s": round(ok * args.texts_per_request / measured, 1) if measured else float("nan"),
        "p50_ms": percentile_ms(all_lat, 50),
        "p99_ms": percentile_ms(all_lat, 99),
        "errors": errors,
        "warmup": rec.warmup,
        "refusals_not_past_the_limit": rec.bad_refusals[:10],
        "wrong_answers": len(rec.wrong),
        "wrong_examples": rec.wrong[:5],
        "rss_mib": {"idle": round(rss_idle / 2**20, 1), "after_warmup": round(rss_start / 2**20, 1),
                    "end": round(rss_end / 2**20, 1)},
        "rss_growth": round(growth, 4),
        "rss_samples_mib": [(t, round(r / 2**20, 1)) for t, r in samples],
        "server_codes": server_codes,
        "health_at_end": health,
        "exit_code": rc,
        "server_log_errors": log_errors[:10],
        "server_log_tail": log[-2000:] if log_errors or rc != 0 else "",
        "windows": windows,
        "machine": f"{platform.machine()}, {os.cpu_count()} cores",
        "date": time.strftime("%Y-%m-%d %H:%M"),
    }


def table(r: dict) -> str:
    out = ["| window | from s | OK | errors | p50 ms | p99 ms | server RSS MiB at its end |",
           "|---|---|---|---|---|---|---|"]
    for w in r["windows"]:
        errs = ", ".join(f"{c} {n}" for c, n in sorted(w["errors"].items())) or "0"
        out.append(f"| {w['window']} | {w['start_s']:g} | {w['ok']} | {errs} | {w['p50_ms']} | {w['p99_ms']} | "
                   f"{w['rss_mib']} |")
    errs = ", ".join(f"{c} {n}" for c, n in sorted(r["errors"].items())) or "0"
    rss = r["rss_mib"]
    out += [
        "",
        "| measure | value |",
        "|---|---|",
        f"| load | {r['concurrency']} closed-loop callers over {r['channels']} connections, "
        f"{r['texts_per_request']} text(s) per request, {r['measured_s']} s after {r['warmup_s']} s warm-up |",
        f"| requests answered OK | {r['ok']} ({r['requests_per_s']} requests/s) |",
        f"| errors by code | {errs} |",
        f"| latency p50 / p99 | {r['p50_ms']} / {r['p99_ms']} ms |",
        f"| answers unlike the in-process predictor's | {r['wrong_answers']} |",
        f"| server RSS idle / after warm-up / end | {rss['idle']} / {rss['after_warmup']} / {rss['end']} MiB "
        f"(growth {100 * r['rss_growth']:.2f}%) |",
        f"| server's own counts by code | {r['server_codes']} |",
        f"| health at end, SIGTERM exit code | {r['health_at_end']}, {r['exit_code']} |",
        "",
        "| check | result |",
        "|---|---|",
        *[f"| {name} | {'pass' if ok else 'FAIL'} |" for name, ok in r["checks"].items()],
    ]
    return "\n".join(out)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--bundle", type=Path, help="bundle folder to serve")
    ap.add_argument("--make-bundle", type=Path, help="write a random-weight bundle here (--size) and exit")
    ap.add_argument("--size", choices=["tiny", "lab"], default="tiny",
                    help="--make-bundle: the tests' tiny preset (tokenizer trained on cls-books-fr, max_len 48) or "
                         "the lab's model (vocabulary 50,001, d 200, 4 layers, max_len 512; bench/serve_bench.py's)")
    ap.add_argument("--data", type=Path, default=DEFAULT_DATA, help="folder holding cls-books-fr/")
    ap.add_argument("--seconds", type=float, default=600.0, help="measured duration (after the warm-up)")
    ap.add_argument("--warmup", type=float, default=180.0,
                    help="seconds of load before measuring: the RSS baseline is taken at its end (a loaded server's "
                         "RSS rose for about 3 minutes before it levelled off here; the table shows it per window)")
    ap.add_argument("--max-requests", type=int, default=5_000_000, help="stop after this many measured requests")
    ap.add_argument("--concurrency", type=int, default=128, help="closed-loop client threads")
    ap.add_argument("--channels", type=int, default=4, help="gRPC connections the callers share")
    ap.add_argument("--texts-per-request", type=int, default=1, help="texts in each request")
    ap.add_argument("--texts", type=int, default=256, help="distinct reviews drawn (seed 0) from the test split")
    ap.add_argument("--timeout", type=float, default=60.0, help="deadline of each request, seconds")
    ap.add_argument("--window", type=float, default=60.0, help="seconds per row of the latency table")
    ap.add_argument("--server-args", default="", help="extra server options, e.g. '--max-queue 64'")
    ap.add_argument("--json", type=Path, help="write the result here")
    args = ap.parse_args(argv)
    if args.make_bundle:
        print(make_bundle(args.make_bundle, args.data, args.size))
        return 0
    if not args.bundle:
        ap.error("--bundle is required (or --make-bundle DIR first)")
    from contract.bundle import verify_bundle

    try:
        verify_bundle(args.bundle)  # a missing or damaged bundle: one line, exit 2, before any process starts
    except ValueError as e:
        ap.error(f"--bundle: {e}")
    for name in ("seconds", "warmup", "window", "timeout"):
        if getattr(args, name) < 0 or (name != "warmup" and getattr(args, name) == 0):
            ap.error(f"--{name} must be > 0, got {getattr(args, name)}")
    if args.concurrency < 1 or args.channels < 1 or args.texts_per_request < 1 or args.max_requests < 1:
        ap.error("--concurrency, --channels, --texts-per-request and --max-requests must be >= 1")

    sys.path.insert(0, str(REPO / "bench"))
    from bench_texts import test_texts

    result = soak(args, test_texts(ap, args.data, args.texts))
    print(table(result))
    print(f"\n{'PASS' if result['passed'] else 'FAIL'}: bundle {result['bundle']}; machine {result['machine']}; "
          f"{result['date']}")
    if args.json:
        tmp = args.json.with_name(args.json.name + ".tmp")
        tmp.write_text(json.dumps(result, indent=2))
        os.replace(tmp, args.json)
    return 0 if result["passed"] else 1


if __name__ == "__main__":
    sys.exit(main())
