"""What giving memory back after a burst costs (serving/process/memory.py, `--memory-reclaim-idle-s`).

    python bench/memory_reclaim.py --bundle BUNDLE [--rounds 10] [--burst 2000] [--concurrency 32] [--gap 6]
    python bench/soak.py --make-bundle DIR --size tiny       # once: a bundle (random weights)

Two server subprocesses on one machine, the same bundle and options except that one reclaims (the default, after
5 s of idleness) and the other never does (`--memory-reclaim-idle-s 0`). Each round sends a burst of `--burst`
Classify calls (`--texts` review texts each, `--concurrency` closed-loop callers) to each server in turn, the order
alternating between rounds so that neither always runs first, with `--gap` seconds of idleness after each burst.
The reclaiming server reclaims in the gaps (at most every 10 s) and must then grow its memory again in the next
burst: that is the cost to measure (page faults; the collection itself runs while idle). Steady load never
reclaims: nothing to measure there.

Prints, per server: median calls/s of its bursts, its resident memory at rest after the last burst, and for the
reclaiming one how many reclaims it made and their mean duration (its Prometheus histogram); then the median of
the rounds' ratios (reclaiming / never; the two bursts of a round run back to back). Both servers share the
machine at every moment, so the ratio holds on a busy machine as well; the absolute rates do not.
"""

from __future__ import annotations

import argparse
import random
import re
import statistics
import sys
import threading
import time
import urllib.request
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "bench"))
sys.path.insert(0, str(REPO / "tests"))

from bench_texts import test_texts  # noqa: E402
from serving_fixtures import ServerProcess  # noqa: E402
from soak import DEFAULT_DATA, rss_bytes  # noqa: E402


def metric(server: ServerProcess, name: str) -> float:
    page = urllib.request.urlopen(f"http://127.0.0.1:{server.metrics_port}/metrics", timeout=10).read().decode()
    m = re.search(rf"^{name} (\S+)$", page, re.M)
    return float(m.group(1)) if m else 0.0


def burst(port: int, texts: list[str], n: int, concurrency: int, k: int) -> float:
    """`n` calls of `k` texts from `concurrency` closed-loop callers on one channel; returns calls/s."""
    import grpc

    from serving.gen.sentiment.v1 import sentiment_service_pb2 as pb
    from serving.gen.sentiment.v1 import sentiment_service_pb2_grpc as pb_grpc

    with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
        stub = pb_grpc.SentimentServiceStub(channel)
        stub.Classify(pb.ClassifyRequest(texts=texts[:1]), timeout=60)  # connected before the clock starts
        left, lock, failed = [n], threading.Lock(), []

        def caller(seed: int) -> None:
            rng = random.Random(seed)
            while True:
                with lock:
                    if left[0] == 0:
                        return
                    left[0] -= 1
                try:
                    stub.Classify(pb.ClassifyRequest(texts=rng.sample(texts, k)), timeout=60)
                except grpc.RpcError as e:
                    failed.append(e.code().name)

        threads = [threading.Thread(target=caller, args=(i,)) for i in range(concurrency)]
        start = time.perf_counter()
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        seconds = time.perf_counter() - start
    if failed:
        raise RuntimeError(f"{len(failed)} calls failed: {sorted(set(failed))}")
    return n / seconds


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--bundle", type=Path, required=True, help="bundle folder to serve")
    p.add_argument("--data", type=Path, default=DEFAULT_DATA, help="folder holding cls-books-fr/")
    p.add_argument("--rounds", type=int, default=10, help="bursts, each followed by --gap idle seconds")
    p.add_argument("--burst", type=int, default=2000, help="calls per burst")
    p.add_argument("--concurrency", type=int, default=32, help="callers at once during a burst")
    p.add_argument("--texts", type=int, default=8, help="texts per call")
    p.add_argument("--gap", type=float, default=6.0, help="idle seconds after each burst (> the 5 s to reclaim)")
    args = p.parse_args(argv)

    texts = test_texts(p, args.data, 500)
    common = ["--max-texts", str(args.texts), "--max-queue", str(4 * args.concurrency * args.texts)]
    server_args = ["--host", "127.0.0.1", "--metrics-port", "0", "--device", "cpu", *common]
    servers = {"reclaims": ServerProcess(args.bundle, *server_args),
               "never": ServerProcess(args.bundle, *server_args, "--memory-reclaim-idle-s", "0")}
    rates: dict[str, list[float]] = {name: [] for name in servers}
    try:
        for s in servers.values():
            s.wait_listening()
        for s in servers.values():  # warm-up: threads, arenas and onnxruntime at their working size
            burst(s.port, texts, args.burst // 2, args.concurrency, args.texts)
        time.sleep(args.gap)
        for r in range(args.rounds):
            order = list(servers) if r % 2 == 0 else list(reversed(servers))
            for name in order:
                rates[name].append(burst(servers[name].port, texts, args.burst, args.concurrency, args.texts))
                time.sleep(args.gap)
            print(f"round {r}: " + ", ".join(f"{n} {rates[n][-1]:.0f} calls/s" for n in servers), flush=True)
        time.sleep(args.gap)
        count = metric(servers["reclaims"], "sentiment_memory_reclaim_seconds_count")
        total = metric(servers["reclaims"], "sentiment_memory_reclaim_seconds_sum")
        print(f"\n{args.rounds} rounds of {args.burst} calls x {args.texts} texts, {args.concurrency} callers, "
              f"gap {args.gap} s")
        for name, s in servers.items():
            print(f"{name:>8}: median {statistics.median(rates[name]):.1f} calls/s, "
                  f"RSS at rest {rss_bytes(s.proc.pid) / 2**20:.1f} MiB")
        print(f"reclaims: {count:.0f}, mean {1000 * total / max(count, 1):.1f} ms each")
        ratios = sorted(a / b for a, b in zip(rates["reclaims"], rates["never"], strict=True))
        print(f"ratio reclaims / never, median of {len(ratios)} rounds: {statistics.median(ratios):.3f} "
              f"(min {ratios[0]:.3f}, max {ratios[-1]:.3f})")
    finally:
        for s in servers.values():
            s.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
