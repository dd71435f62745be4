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
    its --help (contract/comments.py says where a comment belongs). The bounds against hostile clients are enforced
    in serving/gate.py (docs/RELIABILITY.md, "Attacks")."""

    # Network
    host: str = "127.0.0.1"  # bind address; loopback unless asked otherwise
    port: int = 50051  # gRPC port; 0 = any free port (the bound one is logged and returned)
    metrics_port: int | None = None  # Prometheus exporter port (0 = any free port, None = off); the CLI's
    # default is 8002, the port Triton serves its metrics on (9090 is Prometheus' own port)
    metrics_host: str | None = None  # bind address of the metrics exporter (None = `host`)
    health_port: int | None = None  # a second, plain-text listener serving only grpc.health.v1, by an asyncio
    # server whose half-open calls hold no thread (serving/health_port.py; 0 = any free port, None = off): what
    # Kubernetes' gRPC probes (which speak no TLS) should target. grpc.health.v1 stays on `port` too.
    # Processes
    workers: int = 1  # server processes sharing `port` (SO_REUSEPORT; serving/workers.py), each with its own
    # predictor, batcher and handler threads: the request path's Python then runs on several cores. Every limit
    # below is per worker; the health and metrics ports are the parent's, for all workers (what it gains:
    # docs/BENCHMARKS.md, Serving)
    # Model
    model_name: str = "sentiment"  # the model's name in KServe v2 requests and in metadata
    device: Literal["auto", "cpu", "cuda"] = "auto"  # auto: CUDA when it really loads, else CPU
    intra_op_threads: int = 1  # onnxruntime threads per run (0 = one per core); with batch_workers runs at once,
    # 1 x 2 filled 2 cores best under load (bench/serve_bench.py); 0 lowers a lone request's latency
    inter_op_threads: int = 0  # onnxruntime inter-op pool (0 = default; the graph runs sequentially)
    ort_spinning: bool = False  # idle onnxruntime threads spin (lower latency alone, steals CPU when shared)
    optimization: Literal["disable", "basic", "extended", "all"] | None = None  # ORT graph level; None = the
    # bundle's (manifest runtime.graph_optimization_level), else basic ('all' measured slower on this CPU)
    # Batching
    batching: bool = True  # False: every request runs alone (the benchmark's baseline)
    max_batch_size: int = 64  # texts per onnxruntime run
    max_batch_tokens: int = 4096  # padded token ids per run (texts x longest); must hold one max_len text. On
    # a CPU a batch costs its padded ids (the sweep of bench/serve_bench.py): batching saves little there;
    # raise it on a GPU
    max_padding: float = 0.1  # padding ids at most this fraction of a batch's real ids (groups similar lengths)
    batch_workers: int = 2  # batches computed at once, each by one onnxruntime run
    max_queue_delay_ms: float = 2.0  # longest wait for company before a batch runs
    max_queue: int = 512  # texts waiting; past it requests get RESOURCE_EXHAUSTED at once. A call is admitted
    # only while a request of max_texts would fit (its size is known only once its body is read): refused then
    # before its body, without a thread
    # Request limits
    max_texts: int = 64  # texts per request
    max_chars: int = 20_000  # characters (code points) per text; longer -> INVALID_ARGUMENT
    long_text: Literal["truncate", "refuse"] = "truncate"  # over max_len tokens: cut (truncated=true) or refuse
    max_message_bytes: int = 4 * 1024 * 1024  # largest request message; larger -> RESOURCE_EXHAUSTED (gRPC)
    max_workers: int = 128  # gRPC handler threads: each in-progress request holds one while it waits
    max_concurrent_rpcs: int | None = None  # authenticated calls in progress at once (None = max_workers); past
    # it a call is refused at once with RESOURCE_EXHAUSTED instead of queueing unseen in front of the batcher.
    # Above max_workers, the pool gets a thread for each. Health has its own threads and limit (health_workers),
    # and never counts here
    max_response_bytes_in_flight: int = 64 * 1024 * 1024  # bytes of answers built and not yet taken by their
    # clients (a client that does not read keeps its answer in the server); past it, calls are refused with
    # RESOURCE_EXHAUSTED (before computing when the budget is already spent)
    # Hostile clients
    body_timeout_s: float = 10.0  # a request message must arrive within this long after its call's headers (or
    # after the previous message of a stream), else the call is cancelled and its thread and slot freed
    memory_reclaim_idle_s: float = 5.0  # once no model call has been in progress (nor an answer held) for this
    # long after a burst, unreachable cycles are collected and glibc's free pages given back (serving/memory.py);
    # at most every 10 s, never under steady load or traffic with shorter pauses. 0 = never
    malloc_mmap_threshold_bytes: int = 64 * 1024  # glibc: a block of at least this size gets a mapping of its
    # own, unmapped when freed. glibc's default threshold rises (up to 32 MiB) each time such a block is freed;
    # request-sized buffers then come from the per-thread arenas, and the few still live pin their pages: +7-11%
    # RSS after the unread-answers attack (docs/RELIABILITY.md), +0.8-1.5% with it fixed here. 0 = glibc's own;
    # MALLOC_MMAP_THRESHOLD_ in the environment wins
    switch_interval_ms: float = 1.0  # Python's interpreter-lock switch interval in the server process: how long
    # a thread that wants the lock waits before its holder is made to drop it. Every call's events pass through
    # gRPC's one polling thread, which waited that long behind the handler threads: with Python's 5 ms the intake
    # became the bottleneck under overload and calls queued unseen in gRPC's core, before admission could refuse
    # them (docs/RELIABILITY.md, "Protocol attacks"). 0 = Python's own
    health_workers: int = 4  # threads (and calls at once) for grpc.health.v1 on `port`, apart from max_workers
    max_streams_per_connection: int = 100  # HTTP/2 SETTINGS_MAX_CONCURRENT_STREAMS: calls at once on one
    # connection (100: the floor RFC 9113 recommends); a client's further calls wait in the client
    handshake_timeout_s: float = 10.0  # a connection must finish its TLS/HTTP/2 handshake within this
    max_connection_idle_s: float = 300.0  # a connection without calls for this long is closed (GOAWAY)
    max_connection_age_s: float = 1800.0  # every connection is closed after about this long (GOAWAY, +-10%
    # jitter by gRPC): long-held connections cannot pin resources, and clients spread again over replicas
    max_connection_age_grace_s: float = 30.0  # calls still open on an aged-out connection get this long
    min_client_ping_interval_s: float = 60.0  # a client may ping (keepalive) at most this often without calls
    # (max_ping_strikes says what a faster one gets)
    max_ping_strikes: int = 2  # a client that pings more often than min_client_ping_interval_s is disconnected
    # (GOAWAY too_many_pings) after this many such pings
    keepalive_without_calls: bool = False  # accept keepalive pings on a connection with no call in progress
    # Hostile peers: per connection and per address (the connection guard, serving/guard.py)
    max_connections: int = 1000  # connections open at once on the gRPC port; gRPC closes further ones at accept.
    # Each costs a file descriptor and gRPC's buffers (tens of KB); keep it under the process' open-file limit
    max_connections_per_peer: int = 100  # connections at once from one address; the newest beyond are cut within
    # 0.1 s. Behind a proxy or NAT every client shares its address: raise it there
    max_control_bytes_per_s: int = 16 * 1024  # bytes a connection may send that none of its calls explain (PING,
    # SETTINGS, WINDOW_UPDATE, RST_STREAM...), with 4 s of burst; past it the connection is cut (a flood)
    max_cancels_per_s: int = 200  # calls one connection may cancel in a second; past it the connection is cut
    # (rapid reset of calls that reached the server). A quarter of it cut when they were cancelled within a second
    # of their start, not by their deadline, and are more than half of the connection's calls (serving/guard.py)
    send_stall_s: float = 1.0  # a connection is cut once an answer has waited this long for it and not one byte
    # reached it meanwhile (flow-control window 0, or a peer that does not read)
    ban_s: float = 10.0  # after a flood, resets or stalled answers, new connections from that address are cut for
    # this long (0 = no ban). Behind a proxy or NAT a ban hits every client of that address
    behind_proxy: bool = False  # every client comes through a front proxy that limits each address itself
    # (deploy/proxy/): here every peer is the proxy, whose connections carry all clients' calls, so the connection
    # guard (its cuts, bans and per-address limits) and the failed-authentication throttle are off, else one client
    # would get every client cut or locked out. max_connections still holds. Listen where only the proxy reaches
    # (loopback in its pod): a client that reaches the server directly bypasses every per-address limit
    auth_failures_per_peer: int = 10  # failed authentications one address may make in auth_failure_window_s;
    # past it all its calls are refused UNAUTHENTICATED (whatever their token) until the window ends
    auth_failure_window_s: float = 10.0  # seconds: the window auth_failures_per_peer counts in
    # Lifecycle
    drain_delay_s: float = 0.0  # after SIGTERM: health says NOT_SERVING but requests are still served this
    # long, so that load balancers watching health stop routing here first (Kubernetes-style); then grace_s begins
    grace_s: float = 10.0  # after SIGTERM and drain_delay_s: new requests are refused and in-flight ones get this
    # long to finish
    # Security
    tls_cert: str | None = None  # PEM server certificate (chain); with tls_key turns TLS on
    tls_key: str | None = None  # PEM private key of tls_cert
    tls_client_ca: str | None = None  # PEM CA bundle: clients must present a certificate it signed (mutual TLS)
    auth_token: str | None = None  # when set, every RPC but health needs "authorization: Bearer <token>"

    def __post_init__(self) -> None:
        _in_range("port", self.port, 0, 65535)
        if self.metrics_port is not None:
            _in_range("metrics_port", self.metrics_port, 0, 65535)
        if self.health_port is not None:
            _in_range("health_port", self.health_port, 0, 65535)
        _in_range("workers", self.workers, 1, 256)
        if self.device not in ("auto", "cpu", "cuda"):
            raise ServerConfigError(f"device must be 'auto', 'cpu' or 'cuda', got {self.device!r}")
        if self.optimization not in (None, "disable", "basic", "extended", "all"):
            raise ServerConfigError(f"optimization must be disable, basic, extended or all, got {self.optimization!r}")
        if self.long_text not in ("truncate", "refuse"):
            raise ServerConfigError(f"long_text must be 'truncate' or 'refuse', got {self.long_text!r}")
        if not self.model_name or "/" in self.model_name:
            raise ServerConfigError(f"model_name must be a non-empty name without '/', got {self.model_name!r}")
        _in_range("intra_op_threads", self.intra_op_threads, 0, 1024)
        _in_range("inter_op_threads", self.inter_op_threads, 0, 1024)
        _in_range("max_batch_size", self.max_batch_size, 1, 4096)
        _in_range("max_batch_tokens", self.max_batch_tokens, 3, 10_000_000)
        _in_range("max_queue_delay_ms", self.max_queue_delay_ms, 0.0, 1000.0, integer=False)
        _in_range("max_padding", self.max_padding, 0.0, 1000.0, integer=False)
        _in_range("batch_workers", self.batch_workers, 1, 64)
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
        _in_range("max_connections_per_peer", self.max_connections_per_peer, 1, 1_000_000)
        _in_range("max_control_bytes_per_s", self.max_control_bytes_per_s, 1024, 1 << 30)
        _in_range("max_cancels_per_s", self.max_cancels_per_s, 1, 1_000_000)
        _in_range("send_stall_s", self.send_stall_s, 0.2, 3600.0, integer=False)
        _in_range("ban_s", self.ban_s, 0.0, 86400.0, integer=False)
        _in_range("auth_failures_per_peer", self.auth_failures_per_peer, 1, 1_000_000)
        _in_range("auth_failure_window_s", self.auth_failure_window_s, 0.1, 86400.0, integer=False)
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
