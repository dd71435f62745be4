"""Prometheus metrics of one server, in a registry of its own (several servers can live in one test process).

Served over HTTP on a port of its own (`Metrics.serve`), never on the gRPC port.
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, start_http_server

# Latency buckets from 0.5 ms to 10 s: loopback round trips start near 0.5 ms here.
_SECONDS = (0.0005, 0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1.0, 2.0, 5.0, 10.0)
_SIZES = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512)


class Metrics:
    """Requests and errors by code, queue time, batch size and tokens, inference time, queue depth."""

    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        r = self.registry = registry or CollectorRegistry()
        self.requests = Counter("sentiment_requests", "RPCs answered, by method and status code",
                                ["method", "code"], registry=r)
        self.request_seconds = Histogram("sentiment_request_seconds", "RPC handling time, by method",
                                         ["method"], buckets=_SECONDS, registry=r)
        self.texts = Counter("sentiment_texts", "texts classified", registry=r)
        self.queue_seconds = Histogram("sentiment_queue_seconds", "time a text waited in the batching queue",
                                       buckets=_SECONDS, registry=r)
        self.batch_size = Histogram("sentiment_batch_size", "texts per onnxruntime run", buckets=_SIZES, registry=r)
        self.batch_tokens = Histogram("sentiment_batch_tokens", "padded token ids per onnxruntime run",
                                      buckets=tuple(64 * s for s in _SIZES), registry=r)
        self.inference_seconds = Histogram("sentiment_inference_seconds", "time of one onnxruntime run",
                                           buckets=_SECONDS, registry=r)
        self.queue_depth = Gauge("sentiment_queue_depth", "texts waiting in the batching queue", registry=r)
        self.dropped = Counter("sentiment_dropped_texts", "texts dropped before compute, by reason",
                               ["reason"], registry=r)

    def serve(self, host: str, port: int) -> tuple[object, int]:
        """Start the HTTP exporter on host:port (0 = a free port); returns (server, bound port)."""
        server, _thread = start_http_server(port, addr=host, registry=self.registry)
        return server, server.server_port
