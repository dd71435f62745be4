"""Prometheus metrics of one server, in a registry of its own (several servers can live in one test process), and
the HTTP exporter that serves them.

The exporter listens on a port (and address) of its own, never the gRPC port. It answers `GET /metrics` (and HEAD)
and 404 to every other path, so that a KServe HTTP client pointed at it by mistake does not read it as a live
server. A request's line and headers must arrive within HEADER_TIMEOUT_S in all (a client that sends them a byte at
a time gets no longer), and at most MAX_CONNECTIONS are handled at once (more are closed at once): half-sent
requests cannot pin its threads.
"""

from __future__ import annotations

import io
import platform
import socket
import threading
import time
from collections.abc import Callable
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from importlib import metadata
from urllib.parse import urlsplit

from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Gauge, Histogram, ProcessCollector
from prometheus_client.exposition import generate_latest

from contract.version import package_version

# Latency buckets from 0.5 ms to 10 s: loopback round trips start near 0.5 ms here.
_SECONDS = (0.0005, 0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1.0, 2.0, 5.0, 10.0)
_SIZES = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512)
HEADER_TIMEOUT_S = 5.0  # request line + headers, in all
MAX_CONNECTIONS = 32  # scrapes handled at once (a Prometheus server scrapes one at a time)


class Metrics:
    """Requests and errors by code, queue time, batch size and tokens, inference time, queue depth, the bounds
    against hostile clients, the model and build served (`*_info`), and the process (`process_*`: CPU, resident
    memory, open files, threads). docs/OBSERVABILITY.md has the table of every metric."""

    def __init__(self, registry: CollectorRegistry | None = None, per_worker: bool = False) -> None:
        """per_worker: a worker of serving/process/workers.py (prometheus_client's multiprocess mode, which sums
        counters and histograms over the workers): also count its texts in a series of its own, labelled by its pid."""
        r = self.registry = registry or CollectorRegistry()
        self.per_worker = per_worker
        ProcessCollector(registry=r)
        # protocol: grpc or http; method: the RPC's full name, or an HTTP call's method and route ("POST
        # /v1/classify"); code: the gRPC status name, also over HTTP (serving/protocols/http/errors.py maps them)
        self.requests = Counter("sentiment_requests", "calls answered, by protocol, method and the status code the "
                                "client got", ["protocol", "method", "code"], registry=r)
        self.request_seconds = Histogram("sentiment_request_seconds", "call handling time, by protocol and method",
                                         ["protocol", "method"], buckets=_SECONDS, registry=r)
        self._counts: dict[tuple[str, str, str], Callable[[], None]] = {}  # `answered`'s children, by their labels
        self._seconds: dict[tuple[str, str], Callable[[float], None]] = {}
        # Per model version (labels model, version; serving/model/models.py): the batcher's and the calls' series,
        # each made through `for_model`, removed when the version is unloaded.
        mv = ["model", "version"]
        self.texts = Counter("sentiment_texts", "texts classified", mv, registry=r)
        self.queue_seconds = Histogram("sentiment_queue_seconds", "time a text waited in the batching queue", mv,
                                       buckets=_SECONDS, registry=r)
        self.batch_size = Histogram("sentiment_batch_size", "texts per onnxruntime run", mv, buckets=_SIZES,
                                    registry=r)
        self.batch_tokens = Histogram("sentiment_batch_tokens", "padded token ids per onnxruntime run", mv,
                                      buckets=tuple(64 * s for s in _SIZES), registry=r)
        self.inference_seconds = Histogram("sentiment_inference_seconds", "time of one onnxruntime run", mv,
                                           buckets=_SECONDS, registry=r)
        # Gauges: the sum over the live workers (multiprocess mode; one process reads the same). The two numbers to
        # scale on (docs/OBSERVABILITY.md says which and why).
        self.queue_depth = Gauge("sentiment_queue_depth", "texts waiting in the batching queue of a model version",
                                 mv, registry=r, multiprocess_mode="livesum")
        self.calls_in_flight = Gauge("sentiment_calls_in_flight", "model calls accepted by a model version and not "
                                     "answered yet (queued or computing)", mv, registry=r, multiprocess_mode="livesum")
        self.dropped = Counter("sentiment_dropped_texts", "texts dropped before compute, by reason",
                               [*mv, "reason"], registry=r)
        self.model_loads = Counter("sentiment_model_loads", "model versions loaded, refused (a bundle that failed "
                                   "verification or its warm-up call) and unloaded, by model and result",
                                   ["model", "result"], registry=r)
        self.response_bytes = Gauge("sentiment_response_bytes_in_flight",
                                    "bytes of answers built and not yet delivered to their clients", registry=r,
                                    multiprocess_mode="livesum")
        self.body_timeouts = Counter("sentiment_body_timeouts", "calls cancelled because their request message "
                                     "did not arrive within body_timeout_s", registry=r)
        self.memory_reclaim_seconds = Histogram("sentiment_memory_reclaim_seconds", "collections of unreachable "
                                                "objects + glibc trims after a burst of model calls, and how long "
                                                "each took (serving/process/memory.py)", buckets=_SECONDS, registry=r)
        self.auth_failures = Counter("sentiment_auth_failures", "calls refused for a missing or wrong bearer token",
                                     registry=r)
        self.suppressed_logs = Counter("sentiment_suppressed_tracebacks", "internal-error tracebacks not logged "
                                       "(rate limit)", registry=r)
        self.suppressed_access_logs = Counter("sentiment_suppressed_access_log_lines", "access log lines not "
                                              "written (rate limit: access_log_rate per method and status)",
                                              registry=r)
        self.serving = Gauge("sentiment_serving", "1 while the server's health says SERVING (grpc.health.v1, the "
                             "whole server): 0 while it starts and from SIGTERM on, and in a --workers parent while no "
                             "worker is ready", registry=r, multiprocess_mode="livemin")
        # Info metrics (value 1, the facts in the labels): the largest over the live workers, so that N workers
        # serving one bundle show one series, and a rollout's old and new bundles two.
        self.model_info = Gauge("sentiment_model_info", "the model this server holds: its bundle's digest, the "
                                "graph's precision, the onnxruntime provider it runs on, its name and version",
                                ["bundle_sha256", "precision", "provider", "model", "version"], registry=r,
                                multiprocess_mode="livemax")
        build = Gauge("sentiment_build_info", "the server's version and the versions of what it runs on",
                      ["version", "onnxruntime", "grpcio", "python"], registry=r, multiprocess_mode="livemax")
        build.labels(package_version() or "unknown", *(_installed(p) or "unknown" for p in ("onnxruntime", "grpcio")),
                     platform.python_version()).set(1)
        self.worker_texts: Gauge | None = None
        if per_worker:  # a gauge: multiprocess mode keeps a gauge's pid label ("liveall"), sums a counter's away
            self.worker_texts = Gauge("sentiment_worker_texts", "texts classified by this worker process since it "
                                      "started, by pid (--workers > 1)", registry=r, multiprocess_mode="liveall")

    def answered(self, protocol: str, method: str, code: str, seconds: float | None = None) -> None:
        """A call ended with `code` (sentiment_requests_total), after `seconds` of handling when it was handled
        (sentiment_request_seconds; a refusal before its handler is counted alone). Each series' child is looked up
        once: `labels()` takes a lock and checks its values on every call."""
        key = (protocol, method, code)
        count = self._counts.get(key)
        if count is None:
            count = self._counts[key] = self.requests.labels(*key).inc
        count()
        if seconds is not None:
            observe = self._seconds.get(key[:2])
            if observe is None:
                observe = self._seconds[key[:2]] = self.request_seconds.labels(protocol, method).observe
            observe(seconds)

    def live(self, gauge: Gauge, read: Callable[[], float]) -> Gauge | None:
        """A gauge of a value the server keeps anyway (texts queued, calls or answer bytes in flight). In a server of
        one process a scrape reads it (`set_function`) and the call path writes nothing: None is returned. A worker of
        several gets the gauge back, to set as the value changes (prometheus_client's multiprocess mode, which sums
        the workers' files, has no gauges read by a function)."""
        if self.per_worker:
            return gauge
        gauge.set_function(read)
        return None

    def for_model(self, model: str, version: str) -> ModelMetrics:
        """The series of one model version (what its batcher and core count)."""
        return ModelMetrics(self, model, version)


class ModelMetrics:
    """One model version's children of the labelled metrics, with the attributes the batcher and the core use;
    `remove()` ends its series when the version is unloaded."""

    def __init__(self, m: Metrics, model: str, version: str) -> None:
        self.labels = (model, version)
        self.parent = m
        self.texts = m.texts.labels(*self.labels)
        self.queue_seconds = m.queue_seconds.labels(*self.labels)
        self.batch_size = m.batch_size.labels(*self.labels)
        self.batch_tokens = m.batch_tokens.labels(*self.labels)
        self.inference_seconds = m.inference_seconds.labels(*self.labels)
        self.queue_depth = m.queue_depth.labels(*self.labels)
        self.calls_in_flight = m.calls_in_flight.labels(*self.labels)
        self.dropped = _Dropped(m.dropped, self.labels)
        for reason in ("DeadlineExpired", "Cancelled"):  # every reason there is, from 0: a rate query finds it
            self.dropped.labels(reason)
        self.worker_texts = m.worker_texts
        self.live = m.live
        self._info: tuple[str, ...] | None = None

    def info(self, bundle_sha256: str, precision: str, provider: str) -> None:
        """sentiment_model_info's series for this version."""
        self._info = (bundle_sha256, precision, provider, *self.labels)
        self.parent.model_info.labels(*self._info).set(1)

    def remove(self) -> None:
        m = self.parent
        for gauge in (self.queue_depth, self.calls_in_flight):
            if m.per_worker:
                gauge.set(0)
            else:  # let go of the function a scrape read (it holds the version's batcher or core) now: the child and
                gauge.set_function(lambda: 0.0)  # its function are a cycle, freed only when the collector runs

        if self._info is not None:
            m.model_info.labels(*self._info).set(0)
        if m.per_worker:  # multiprocess mode cannot remove a series: a worker's unloaded version reads 0 until restart
            return
        if self._info is not None:
            _remove(m.model_info, *self._info)
        for metric in (m.texts, m.queue_seconds, m.batch_size, m.batch_tokens, m.inference_seconds, m.queue_depth,
                       m.calls_in_flight):
            _remove(metric, *self.labels)
        for reason in ("DeadlineExpired", "Cancelled"):
            _remove(m.dropped, *self.labels, reason)


class _Dropped:
    """`dropped.labels(reason)` for one model version."""

    def __init__(self, counter: Counter, labels: tuple[str, str]) -> None:
        self.counter, self.model_labels = counter, labels

    def labels(self, reason: str):
        return self.counter.labels(*self.model_labels, reason)


def _remove(metric, *labels: str) -> None:
    try:
        metric.remove(*labels)
    except KeyError:
        pass


def _installed(package: str) -> str | None:
    """A dependency's installed version (None when not installed as one); onnxruntime-gpu counts as onnxruntime."""
    for name in (package, f"{package}-gpu"):
        try:
            return metadata.version(name)
        except metadata.PackageNotFoundError:
            continue
    return None


class MetricsServer:
    """The HTTP exporter of one registry. Binds in the constructor (OSError when the port is taken) and serves
    from `start()` to `stop()`."""

    def __init__(self, registry: CollectorRegistry, host: str, port: int) -> None:
        handler = type("Handler", (_Handler,), {"registry": registry})
        self.httpd = _Server((host, port), handler)
        self.port: int = self.httpd.server_port
        self._thread = threading.Thread(target=self.httpd.serve_forever, name="metrics-http", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        if self._thread.is_alive():
            self.httpd.shutdown()
        self.httpd.server_close()


class _Server(ThreadingHTTPServer):
    daemon_threads = True
    # Connections the kernel holds for accept(): socketserver's 5 made a flood of connections wait for SYN
    # retransmits (1, 3, 7 s...) before the cap below could close them (300 half-sent requests took 55 s to be
    # accepted and closed, 6 s with this)
    request_queue_size = 128

    def __init__(self, address: tuple[str, int], handler: type[BaseHTTPRequestHandler]) -> None:
        self._slots = threading.BoundedSemaphore(MAX_CONNECTIONS)
        super().__init__(address, handler)

    def process_request(self, request: socket.socket, client_address: object) -> None:
        if not self._slots.acquire(blocking=False):
            self.shutdown_request(request)  # too many at once: closed without a thread
            return
        super().process_request(request, client_address)

    def process_request_thread(self, request: socket.socket, client_address: object) -> None:
        try:
            super().process_request_thread(request, client_address)
        finally:
            self._slots.release()


class _DeadlineReader(io.RawIOBase):
    """A socket's bytes, each read given only what is left of one deadline."""

    def __init__(self, sock: socket.socket, deadline: float) -> None:
        self.sock, self.deadline = sock, deadline

    def readable(self) -> bool:
        return True

    def readinto(self, buffer) -> int:
        left = self.deadline - time.monotonic()
        if left <= 0:
            raise TimeoutError("request headers not received in time")
        self.sock.settimeout(left)
        return self.sock.recv_into(buffer)


class _Handler(BaseHTTPRequestHandler):
    registry: CollectorRegistry
    timeout = HEADER_TIMEOUT_S  # also bounds each write of the answer

    def setup(self) -> None:
        super().setup()
        self.rfile = io.BufferedReader(_DeadlineReader(self.connection, time.monotonic() + HEADER_TIMEOUT_S))

    def do_GET(self) -> None:
        self._answer(body=True)

    def do_HEAD(self) -> None:
        self._answer(body=False)

    def _answer(self, body: bool) -> None:
        if urlsplit(self.path).path != "/metrics":
            self.send_error(404, "not found: metrics are at /metrics")
            return
        page = generate_latest(self.registry)
        self.send_response(200)
        self.send_header("Content-Type", CONTENT_TYPE_LATEST)
        self.send_header("Content-Length", str(len(page)))
        self.end_headers()
        if body:
            self.wfile.write(page)

    def log_message(self, format: str, *args: object) -> None:
        pass  # one log line per scrape (or per probe of a scanner) is noise
