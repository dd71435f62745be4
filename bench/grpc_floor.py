"""The floor of a Python gRPC server: what grpcio alone costs per call, for the serving benchmarks to compare with.

    python bench/grpc_floor.py BUNDLE [--port 0] [--metrics-port 0] [--intra-op-threads 1]

A bare `grpc.server` with a thread pool and one unary `Classify` that calls `Predictor.predict` in the handler's
thread: no authentication, no limits, no body timeout, no batching, no per-call metrics beyond the three counters
the benchmarks read. It is not a server to deploy (one slow client holds a thread, a large request is read whole);
it is the least any grpcio server does for a call, so `serving/` is measured against it: the difference between
this and `python -m serving.server` is what serving/ adds, the difference between this and the in-process
predictor is gRPC's own (the C core, HTTP/2, and grpcio's Python per call).

It prints the line the benchmarks wait for ("listening on 127.0.0.1:PORT ... metrics on 127.0.0.1:PORT") and
exports, on the metrics port, the series they read: sentiment_requests_total{code="OK",method=...,protocol="grpc"},
sentiment_batch_size (count and sum: one text per run) and sentiment_inference_seconds (sum).
"""

from __future__ import annotations

import argparse
import signal
import sys
import threading
import time
from concurrent import futures
from pathlib import Path

import grpc
from prometheus_client import CollectorRegistry, Counter, Histogram, start_http_server

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from serving.gen.sentiment.v1 import sentiment_service_pb2 as pb  # noqa: E402
from serving.gen.sentiment.v1 import sentiment_service_pb2_grpc as pb_grpc  # noqa: E402
from serving.model.predictor import Predictor  # noqa: E402

METHOD = "sentiment.v1.SentimentService/Classify"


class FloorServicer(pb_grpc.SentimentServiceServicer):
    def __init__(self, predictor: Predictor, registry: CollectorRegistry) -> None:
        self.predictor = predictor
        self.ok = Counter("sentiment_requests", "answered calls", ["code", "method", "protocol"],
                          registry=registry).labels("OK", METHOD, "grpc")
        self.batch_size = Histogram("sentiment_batch_size", "texts per run", registry=registry)
        self.inference = Histogram("sentiment_inference_seconds", "predict time", registry=registry)

    def Classify(self, request: pb.ClassifyRequest, context: grpc.ServicerContext) -> pb.ClassifyResponse:
        texts = list(request.texts)
        start = time.monotonic()
        preds = self.predictor.predict(texts)  # tokenize + one onnxruntime run + softmax, in this thread
        self.inference.observe(time.monotonic() - start)
        self.batch_size.observe(len(texts))
        self.ok.inc()
        return pb.ClassifyResponse(results=[
            pb.Classification(label=p.label, label_index=p.label_index, probabilities=p.probabilities.tolist(),
                              token_count=p.token_count, truncated=p.truncated)
            for p in preds])


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("bundle", type=Path, help="bundle folder to serve")
    ap.add_argument("--port", type=int, default=0, help="gRPC port (0: any free port)")
    ap.add_argument("--metrics-port", type=int, default=0, help="Prometheus port (0: any free port)")
    ap.add_argument("--intra-op-threads", type=int, default=1, help="onnxruntime threads per run")
    ap.add_argument("--max-workers", type=int, default=128, help="handler threads (serving/'s default)")
    ap.add_argument("--device", choices=["cpu", "cuda"], default="cpu", help="where onnxruntime runs the model")
    args, _ = ap.parse_known_args()  # the benchmarks' other server options (--workers 1, ...) are ignored
    predictor = Predictor(args.bundle, device=args.device, intra_op_threads=args.intra_op_threads)
    registry = CollectorRegistry()
    metrics_server, _ = start_http_server(args.metrics_port, addr="127.0.0.1", registry=registry)
    server = grpc.server(futures.ThreadPoolExecutor(args.max_workers))
    pb_grpc.add_SentimentServiceServicer_to_server(FloorServicer(predictor, registry), server)
    port = server.add_insecure_port(f"127.0.0.1:{args.port}")
    done = threading.Event()
    # before the line that says it is up: a SIGTERM sent as soon as it is read must stop it cleanly, not kill it
    signal.signal(signal.SIGTERM, lambda *_: done.set())
    server.start()
    print(f"bare grpcio floor: listening on 127.0.0.1:{port}, metrics on 127.0.0.1:{metrics_server.server_port}",
          flush=True)
    # A timed wait, as serving/server.py's: the kernel may hand SIGTERM to one of grpc's threads, and Python runs its
    # handler only when the main thread runs again, which an untimed wait never did (a stop that hung 60 s).
    while not done.wait(0.5):
        pass
    server.stop(5).wait()
    metrics_server.shutdown()
    return 0


if __name__ == "__main__":
    sys.exit(main())
