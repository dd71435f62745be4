"""The gRPC loads of bench/model_swap_bench.py, from Python clients that read every answer: an open loop at a fixed
rate (the swap), closed-loop callers of one model (the two models), each call one review of cls-books-fr."""

from __future__ import annotations

import random
import threading
import time
from collections import Counter

import grpc
import numpy as np

from serving.gen.sentiment.v1 import sentiment_service_pb2 as pb
from serving.gen.sentiment.v1 import sentiment_service_pb2_grpc as pb_grpc

Row = tuple[float, float, str, str]  # a call: scheduled send time, latency from it, status, version or details


def stats(rows: list[Row]) -> dict:
    """Calls, failed calls, p50 and p99 of the OK ones (ms)."""
    lat = np.asarray([r[1] for r in rows if r[2] == "OK"])
    q = np.percentile(lat, [50, 99]) * 1e3 if lat.size else [float("nan")] * 2
    return {"calls": len(rows), "failed": sum(r[2] != "OK" for r in rows), "p50_ms": round(float(q[0]), 2),
            "p99_ms": round(float(q[1]), 2)}


def stubs(port: int, k: int) -> list:
    # A local subchannel pool each: k connections, as k clients would open.
    return [pb_grpc.SentimentServiceStub(grpc.insecure_channel(f"127.0.0.1:{port}",
                                                               options=[("grpc.use_local_subchannel_pool", 1)]))
            for _ in range(k)]


class OpenLoop:
    """`rate` calls a second of one review each, sent on schedule whatever the answers (gRPC futures); the latency
    counts from the scheduled time, so that a stalled server is not hidden by a stalled sender."""

    def __init__(self, port: int, texts: list[str], rate: float, channels: int, timeout: float = 10.0) -> None:
        self.stubs, self.texts, self.rate, self.timeout = stubs(port, channels), texts, rate, timeout
        self.rows: list[Row] = []
        self.sent = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        t0 = time.monotonic()
        while not self._stop.wait(max(0.0, t0 + self.sent / self.rate - time.monotonic())):
            req = pb.ClassifyRequest(texts=[self.texts[self.sent % len(self.texts)]])
            future = self.stubs[self.sent % len(self.stubs)].Classify.future(req, timeout=self.timeout)
            future.add_done_callback(lambda f, at=t0 + self.sent / self.rate: self._done(f, at))
            self.sent += 1

    def _done(self, future, at: float) -> None:
        try:  # (in gRPC's thread; list.append is atomic)
            self.rows.append((at, time.monotonic() - at, "OK", future.result().model_version))
        except grpc.RpcError as e:
            self.rows.append((at, time.monotonic() - at, e.code().name, e.details() or ""))

    def stop(self) -> list[Row]:
        """Stops sending, waits for every answer (the calls' timeout at most); the calls by send time."""
        self._stop.set()
        self._thread.join()
        end = time.monotonic() + self.timeout + 5
        while len(self.rows) < self.sent and time.monotonic() < end:
            time.sleep(0.05)
        return sorted(self.rows)


def closed_loop(port: int, texts: list[str], callers: int, seconds: float, model: str, channels: int = 4,
                warmup: float = 1.0) -> dict:
    """`callers` threads, each one call of one review at a time to `model`; counts the calls started in the
    `seconds` after `warmup`."""
    opened = stubs(port, min(callers, channels))
    start = time.monotonic() + warmup
    rows: list[Row] = []  # list.append is atomic: the threads share it

    def caller(i: int) -> None:
        rng = random.Random(i)
        while (t0 := time.monotonic()) < start + seconds:
            try:
                opened[i % len(opened)].Classify(pb.ClassifyRequest(texts=[rng.choice(texts)], model_name=model),
                                                 timeout=30)
                code = "OK"
            except grpc.RpcError as e:
                code = e.code().name
            if t0 >= start:
                rows.append((t0, time.monotonic() - t0, code, ""))

    threads = [threading.Thread(target=caller, args=(i,)) for i in range(callers)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return {"callers": callers, "texts_per_s": round(sum(r[2] == "OK" for r in rows) / seconds, 1), **stats(rows),
            "codes": dict(Counter(r[2] for r in rows))}
