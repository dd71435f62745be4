"""ServerConfig: every server option, with safe defaults, validated on construction."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

from serving.errors import ServerConfigError


@dataclass
class ServerConfig:
    """Options of `serving.server`; the CLI flags have the same names (`--max-texts`, ...). Each field's comment is
    its --help (contract/comments.py says where a comment belongs)."""

    # Network
    host: str = "127.0.0.1"  # bind address; loopback unless asked otherwise
    port: int = 50051  # gRPC port; 0 = any free port (the bound one is logged and returned)
    metrics_port: int | None = None  # Prometheus exporter port (0 = any free port, None = off); the CLI's
    # default is 8002, the port Triton serves its metrics on
    metrics_host: str | None = None  # bind address of the metrics exporter (None = `host`)
    http_port: int | None = None  # HTTP/JSON port: KServe v2 REST, /v1/classify, /openapi.json (0 = any free port,
    # None = off; the CLI's default is 8000, Triton's HTTP port). The same model, limits, token and TLS as `port`
    http_page: bool = False  # on the HTTP port, a page at / where a person types reviews and reads their labels
    health_port: int | None = None  # a plain-text listener serving only grpc.health.v1, for probes that speak no
    # TLS (Kubernetes' gRPC probes); 0 = any free port, None = off. grpc.health.v1 stays on `port` too
    # Processes
    workers: int = 1  # server processes sharing `port` and `http_port` (SO_REUSEPORT), each with its own predictor,
    # batcher and threads, so that the request path's Python runs on several cores. Every limit below is per worker;
    # the health and metrics ports are the parent's, for all workers
    # Model
    model_name: str = "sentiment"  # the name of a bundle given on the command line (a repository's models are named
    # by their folders), in every protocol's requests and answers
    model_repository: str | None = None  # serve every model under this folder, as DIR/NAME/VERSION/ (a bundle in
    # each VERSION, a folder named by digits alone), instead of one bundle (serving/model/repository.py)
    model_control: Literal["none", "poll", "explicit"] = "none"  # with model_repository: none = the versions found
    # at start, no change while serving; poll = the folder is read again every repository_poll_s and the load and
    # unload API works too; explicit = only the API (KServe v2 repository extension) loads and unloads
    repository_poll_s: float = 2.0  # seconds between two reads of the repository (model_control=poll)
    repository_api_open: bool = False  # let the repository API load and unload without a token when none is
    # configured (it is refused then, by default: anyone who reaches the port could change the model)
    device: Literal["auto", "cpu", "cuda"] = "auto"  # auto: CUDA when it really loads, else CPU
    intra_op_threads: int = 1  # onnxruntime threads per run (0 = one per core): 1 per run, batch_workers runs at
    # once, fills the cores under load; 0 lowers a lone request's latency
    inter_op_threads: int = 0  # onnxruntime inter-op pool (0 = default; the graph runs sequentially)
    ort_spinning: bool = False  # idle onnxruntime threads spin (lower latency alone, steals CPU when shared)
    optimization: Literal["disable", "basic", "extended", "all"] | None = None  # onnxruntime graph level; None =
    # the bundle's (manifest runtime.graph_optimization_level)
    # Batching
    batching: bool = True  # False: every request runs alone (the benchmark's baseline)
    max_batch_size: int = 64  # texts per onnxruntime run
    max_batch_tokens: int = 4096  # padded token ids per run (texts x longest); must hold one max_len text; a GPU
    # gains from more
    max_padding: float = 0.1  # padding ids at most this fraction of a batch's real ids (groups similar lengths)
    batch_workers: int = 2  # batches computed at once, each by one onnxruntime run
    max_queue_delay_ms: float = 2.0  # longest wait for company before a batch runs
    fair_calls: int = 16  # with several models busy: model calls in the model path (tokenizing, queue, run) at
    # once, the rest waiting their turn in their thread, each free place to the model served least
    # (serving/model/turns.py), so that a flooded model cannot take another's share of the cores. On 2 cores 4 left
    # them waiting, and 32 gave the flooded model more calls than the other (docs/BENCHMARKS.md, "Model repository
    # under load"). A model alone is not bounded by it
    max_queue: int = 512  # texts waiting; past it calls get RESOURCE_EXHAUSTED at once. A call is admitted only
    # while a request of max_texts would fit (its size is known only once its body is read)
    # Request limits
    max_texts: int = 64  # texts per request
    max_chars: int = 20_000  # characters (code points) per text; longer -> INVALID_ARGUMENT
    long_text: Literal["truncate", "refuse"] = "truncate"  # over max_len tokens: cut (truncated=true) or refuse
    max_message_bytes: int = 4 * 1024 * 1024  # largest request message; larger -> RESOURCE_EXHAUSTED (gRPC)
    max_workers: int = 128  # gRPC handler threads: each call in progress holds one while it waits
    max_concurrent_rpcs: int | None = None  # authenticated calls in progress at once (None = max_workers); past
    # it a call is refused at once with RESOURCE_EXHAUSTED rather than queued unseen. Health has its own threads
    # and limit (health_workers) and never counts here
    max_response_bytes_in_flight: int = 64 * 1024 * 1024  # bytes of answers built and not yet taken by their
    # clients (a client that does not read keeps its answer in the server); past it, calls are refused with
    # RESOURCE_EXHAUSTED
    # Connections
    body_timeout_s: float = 10.0  # a request message must arrive within this long after its call's headers (or
    # after the previous message of a stream), else the call is cancelled and its thread and slot freed
    health_workers: int = 4  # threads (and calls at once) for grpc.health.v1 on `port`, apart from max_workers
    max_streams_per_connection: int = 100  # HTTP/2 SETTINGS_MAX_CONCURRENT_STREAMS: calls at once on one
    # connection (100: the floor RFC 9113 recommends); a client's further calls wait in the client
    handshake_timeout_s: float = 10.0  # a connection must finish its TLS/HTTP/2 handshake within this
    max_connection_idle_s: float = 300.0  # a connection without calls for this long is closed (GOAWAY)
    max_connection_age_s: float = 1800.0  # every connection is closed after about this long (GOAWAY, +-10%
    # jitter by gRPC), so that clients spread again over replicas
    max_connection_age_grace_s: float = 30.0  # calls still open on an aged-out connection get this long
    min_client_ping_interval_s: float = 60.0  # a client may ping (keepalive) at most this often without calls
    max_ping_strikes: int = 2  # pings faster than min_client_ping_interval_s tolerated before GOAWAY
    # too_many_pings
    keepalive_without_calls: bool = False  # accept keepalive pings on a connection with no call in progress
    max_connections: int = 1000  # connections open at once on the gRPC port; gRPC closes further ones at accept
    # (each costs a file descriptor and tens of KB: keep it under the open-file limit)
    behind_proxy: bool = False  # a front proxy owns the edge (deploy/proxy/) and its per-address limits: no
    # warning when bound beyond loopback. Bind where only the proxy reaches (loopback in its pod)
    # Process
    memory_reclaim_idle_s: float = 5.0  # once no model call has been in progress (nor an answer held) for this
    # long after a burst, unreachable cycles are collected and glibc's free pages given back; at most every 10 s.
    # 0 = never
    malloc_mmap_threshold_bytes: int = 64 * 1024  # glibc: blocks of at least this size get mappings of their own,
    # given back when freed (glibc's own threshold grows, and freed request buffers then stay resident). 0 =
    # glibc's own; MALLOC_MMAP_THRESHOLD_ in the environment wins
    switch_interval_ms: float = 1.0  # Python's interpreter-lock switch interval: gRPC's one polling thread, where
    # every call arrives and admission refuses, waits at most this long behind the handler threads. 0 = Python's
    # own (5 ms)
    # Telemetry
    access_log_rate: int = 20  # access log lines per second at most for each method and status (one line per call:
    # method, peer, status, texts, tokens, ms, request id); the rest are counted in
    # sentiment_suppressed_access_log_lines_total. 0 = no access log. Traces: the OTEL_* variables
    # (docs/OBSERVABILITY.md)
    # Lifecycle
    drain_delay_s: float = 0.0  # after SIGTERM: health says NOT_SERVING but requests are still served this
    # long, so that load balancers watching health stop routing here first; then grace_s begins
    grace_s: float = 10.0  # after SIGTERM and drain_delay_s: new requests are refused and in-flight ones get this
    # long to finish
    # Security
    tls_cert: str | None = None  # PEM server certificate (chain); with tls_key turns TLS on
    tls_key: str | None = None  # PEM private key of tls_cert
    tls_client_ca: str | None = None  # PEM CA bundle: clients must present a certificate it signed (mutual TLS)
    # when set, every call but health's needs "authorization: Bearer <token>" (serving/limits/admission.py's rule)
    auth_token: str | None = None

    def __post_init__(self) -> None:
        _in_range("port", self.port, 0, 65535)
        if self.metrics_port is not None:
            _in_range("metrics_port", self.metrics_port, 0, 65535)
        if self.health_port is not None:
            _in_range("health_port", self.health_port, 0, 65535)
        if self.http_port is not None:
            _in_range("http_port", self.http_port, 0, 65535)
        if self.http_page and self.http_port is None:
            raise ServerConfigError("http_page needs the HTTP port (http_port)")
        _in_range("workers", self.workers, 1, 256)
        if self.device not in ("auto", "cpu", "cuda"):
            raise ServerConfigError(f"device must be 'auto', 'cpu' or 'cuda', got {self.device!r}")
        if self.optimization not in (None, "disable", "basic", "extended", "all"):
            raise ServerConfigError(f"optimization must be disable, basic, extended or all, got {self.optimization!r}")
        if self.long_text not in ("truncate", "refuse"):
            raise ServerConfigError(f"long_text must be 'truncate' or 'refuse', got {self.long_text!r}")
        if not self.model_name or "/" in self.model_name:
            raise ServerConfigError(f"model_name must be a non-empty name without '/', got {self.model_name!r}")
        if self.model_control not in ("none", "poll", "explicit"):
            raise ServerConfigError(f"model_control must be 'none', 'poll' or 'explicit', got {self.model_control!r}")
        if self.model_control != "none" and self.model_repository is None:
            raise ServerConfigError(f"model_control={self.model_control} needs a model repository "
                                    "(model_repository); a single bundle has nothing to load")
        if self.model_control == "explicit" and self.workers > 1:
            raise ServerConfigError("model_control=explicit with workers > 1: a load call reaches one worker only; "
                                    "use model_control=poll, which every worker follows")
        _in_range("repository_poll_s", self.repository_poll_s, 0.05, 3600.0, integer=False)
        _in_range("intra_op_threads", self.intra_op_threads, 0, 1024)
        _in_range("inter_op_threads", self.inter_op_threads, 0, 1024)
        _in_range("max_batch_size", self.max_batch_size, 1, 4096)
        _in_range("max_batch_tokens", self.max_batch_tokens, 3, 10_000_000)
        _in_range("max_queue_delay_ms", self.max_queue_delay_ms, 0.0, 1000.0, integer=False)
        _in_range("max_padding", self.max_padding, 0.0, 1000.0, integer=False)
        _in_range("batch_workers", self.batch_workers, 1, 64)
        _in_range("fair_calls", self.fair_calls, 1, 100_000)
        _in_range("max_texts", self.max_texts, 1, 10_000)
        if self.max_queue < self.max_texts:
            raise ServerConfigError(f"max_queue={self.max_queue} must be >= max_texts={self.max_texts}: one full "
                              "request must fit in the queue")
        _in_range("max_queue", self.max_queue, 1, 1_000_000)
        _in_range("max_chars", self.max_chars, 1, 10_000_000)
        _in_range("max_message_bytes", self.max_message_bytes, 1024, 1 << 30)
        _in_range("max_workers", self.max_workers, 1, 10_000)
        if self.max_concurrent_rpcs is not None:
            _in_range("max_concurrent_rpcs", self.max_concurrent_rpcs, 1, 1_000_000)
        _in_range("max_response_bytes_in_flight", self.max_response_bytes_in_flight, self.max_message_bytes, 1 << 40)
        _in_range("body_timeout_s", self.body_timeout_s, 0.01, 3600.0, integer=False)
        _in_range("memory_reclaim_idle_s", self.memory_reclaim_idle_s, 0.0, 3600.0, integer=False)
        _in_range("malloc_mmap_threshold_bytes", self.malloc_mmap_threshold_bytes, 0, 32 * 1024 * 1024)
        _in_range("switch_interval_ms", self.switch_interval_ms, 0.0, 100.0, integer=False)
        _in_range("health_workers", self.health_workers, 1, 1024)
        _in_range("max_streams_per_connection", self.max_streams_per_connection, 1, 1_000_000)
        _in_range("handshake_timeout_s", self.handshake_timeout_s, 0.1, 3600.0, integer=False)
        _in_range("max_connection_idle_s", self.max_connection_idle_s, 1.0, 1e7, integer=False)
        _in_range("max_connection_age_s", self.max_connection_age_s, 1.0, 1e7, integer=False)
        _in_range("max_connection_age_grace_s", self.max_connection_age_grace_s, 0.0, 1e7, integer=False)
        _in_range("min_client_ping_interval_s", self.min_client_ping_interval_s, 0.0, 1e7, integer=False)
        _in_range("max_ping_strikes", self.max_ping_strikes, 0, 1000)
        _in_range("max_connections", self.max_connections, 1, 1_000_000)
        _in_range("access_log_rate", self.access_log_rate, 0, 1_000_000)
        _in_range("grace_s", self.grace_s, 0.0, 3600.0, integer=False)
        _in_range("drain_delay_s", self.drain_delay_s, 0.0, 3600.0, integer=False)
        if (self.tls_cert is None) != (self.tls_key is None):
            raise ServerConfigError(f"tls_cert and tls_key go together, got tls_cert={self.tls_cert!r}, "
                              f"tls_key={self.tls_key!r}")
        if self.tls_client_ca is not None and self.tls_cert is None:
            raise ServerConfigError("tls_client_ca (mutual TLS) needs tls_cert and tls_key (TLS) as well")
        for name in ("tls_cert", "tls_key", "tls_client_ca"):
            path = getattr(self, name)
            if path is not None and not Path(path).is_file():
                raise ServerConfigError(f"{name}: file not found: {path}")
        if self.auth_token is not None and (len(self.auth_token) < 16 or not self.auth_token.isprintable()
                                            or " " in self.auth_token):
            raise ServerConfigError("auth_token must be at least 16 printable characters without spaces "
                              f"(got {len(self.auth_token)} characters)")

    def check_bundle_fit(self, max_len: int) -> None:
        """The token budget must hold one text of the bundle's max_len."""
        if self.max_batch_tokens < max_len:
            raise ServerConfigError(f"max_batch_tokens={self.max_batch_tokens} must be >= the bundle's "
                                    f"max_len {max_len}")

    def replace(self, **changes: object) -> ServerConfig:
        return dataclasses.replace(self, **changes)


def _in_range(name: str, value: object, low: float, high: float, integer: bool = True) -> None:
    kinds = (int,) if integer else (int, float)
    if isinstance(value, bool) or not isinstance(value, kinds) or not low <= value <= high:
        kind = "an integer" if integer else "a number"
        raise ServerConfigError(f"{name} must be {kind} in [{low}, {high}], got {value!r}")
