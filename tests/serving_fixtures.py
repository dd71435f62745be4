"""Helpers for the serving tests: real servers on 127.0.0.1 (in-process or as a subprocess), real certificates
(one factory, `make_certs`, and its session fixture `certs`), a gate around the batcher's runs (`HeldRuns`).

Imported by tests/test_serving_*.py and tests/test_reliability_*.py; the `tiny_bundle` fixture comes from conftest.
"""

from __future__ import annotations

import contextlib
import datetime as dt
import ipaddress
import os
import re
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from collections.abc import Callable, Iterable, Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path

import grpc
import numpy as np
import psutil
import pytest
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID
from images import PROXY_NOFILE, config, ok, proxy_image
from procs import REPO as REPO_ROOT
from procs import free_port, kill_group, popen, run
from prometheus_client.parser import text_string_to_metric_families

from serving.config import ServerConfig
from serving.model.batcher import Batcher
from serving.process.app import SentimentServer

LISTENING = re.compile(r"listening on ([\d.]+):(\d+)")
METRICS_ON = re.compile(r"metrics on ([\d.]+):(\d+)")
HTTP_ON = re.compile(r"HTTP on ([\d.]+):(\d+)")


def reviews(data_dir: Path, n: int, split: str = "test") -> list[str]:
    """The first n non-blank reviews of cls-books-fr/{split}.review.txt (review-length real texts)."""
    lines = (data_dir / "cls-books-fr" / f"{split}.review.txt").read_text(encoding="utf-8").split("\n")
    return [line for line in lines if line.strip()][:n]


@contextmanager
def running_server(bundle: Path, **options: object) -> Iterator[SentimentServer]:
    """A started in-process server on 127.0.0.1, any free port; stopped on exit."""
    cfg = ServerConfig(port=0, **options)
    server = SentimentServer(bundle, cfg).start()
    try:
        yield server
    finally:
        server.stop(grace=2.0)


def flood_and_one_more_are_refused(stubs: Sequence, load: object, metadata: list, last: object, wording: str) -> None:
    """While the model's run is held: 200 calls of `load` over stubs[1:], then one call of `last` on stubs[0], every
    one refused RESOURCE_EXHAUSTED with `wording` in its details (an overload made, not raced)."""
    flood = [stubs[1 + i % (len(stubs) - 1)].Classify.future(load, timeout=60, metadata=metadata) for i in range(200)]
    refusals = [f.exception(timeout=60) for f in flood]  # all ended while the run is held
    with pytest.raises(grpc.RpcError) as authorised:
        stubs[0].Classify(last, timeout=10, metadata=metadata)
    for refused in [*refusals, authorised.value]:
        assert refused is not None and refused.code() == grpc.StatusCode.RESOURCE_EXHAUSTED, refused
        assert wording in refused.details(), refused.details()


class HeldRuns:
    """A gate around a batcher's real infer function (`Predictor.infer`): records each run's row lengths and, while
    holding (the default), keeps every run that starts inside it until `release()`, so that requests queue behind
    them deterministically, whatever the machine's load. Installed when made (on a Batcher, or on a server's);
    as a context manager, on exit the real infer is back and every held run goes on."""

    def __init__(self, batcher: Batcher | SentimentServer, hold: bool = True) -> None:
        self.batcher = batcher.core.batcher if isinstance(batcher, SentimentServer) else batcher
        self.real: Callable[[Sequence[np.ndarray]], np.ndarray] = self.batcher.infer
        self.batches: list[list[int]] = []  # token ids per row, one list per run, in the order the runs started
        self._entered = threading.Semaphore(0)
        self._open = threading.Event()
        if not hold:
            self._open.set()
        self.batcher.infer = self

    @property
    def sizes(self) -> list[int]:
        """Texts per run."""
        return [len(b) for b in self.batches]

    def __enter__(self) -> HeldRuns:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop_holding()
        self.release()

    def __call__(self, rows: Sequence[np.ndarray]) -> np.ndarray:
        self.batches.append([len(r) for r in rows])
        if not self._open.is_set():
            self._entered.release()
            assert self._open.wait(30), "the test never released the held runs"
        return self.real(rows)

    def wait_entered(self, timeout: float = 20.0) -> bool:
        """True once one more run is held (call once per run expected)."""
        return self._entered.acquire(timeout=timeout)

    def stop_holding(self) -> None:
        """Runs that start from now on are neither held nor recorded; the held ones stay held."""
        self.batcher.infer = self.real

    def release(self) -> None:
        self._open.set()


def wait_until(condition: Callable[[], object], timeout: float = 20.0, what: str = "condition") -> None:
    """Polls `condition` (a state, never a duration) until it holds; fails after `timeout` s."""
    end = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < end, f"{what} not reached in {timeout} s"
        time.sleep(0.005)


def waited_out_the_server(outcomes: Iterable[tuple], sigterm_at: float, server: ServerProcess) -> list[tuple]:
    """The calls, (start, end, code, details, ...) by time.monotonic(), that were sent after SIGTERM and waited out
    their deadline in the client after every process of `server` had gone. Once in CI a call sent just after SIGTERM
    waited out its deadline so, its connection having got a GOAWAY "Server shutdown"; not seen here in 140 runs of
    tests/test_serving_workers.py's drain. gRPC's client retries a stream that a closing server never saw on a new
    connection. Such a wait is the client's, not a server's: no connection of ours held the call when it ended (the
    second of margin is for the closing connections to reach the client), and the status is the client's own. A
    server's DEADLINE_EXCEEDED (texts kept in a queue past their deadline) or a call held while it ran is not one."""
    gone = server.gone_at
    return [o for o in outcomes if o[2] == "DEADLINE_EXCEEDED" and o[3] == "Deadline Exceeded" and o[0] > sigterm_at
            and gone is not None and gone + 1 < o[1]]


def sigterm_under_load(bundle: Path, args: list[str], texts: list[str], answers: int, own_connections: bool
                       ) -> tuple[ServerProcess, list[tuple[float, float, str, object]], float, int]:
    """`python -m serving.server BUNDLE --device cpu ARGS` sent SIGTERM while 12 callers send Classify(texts) back to
    back, each until its first refusal: after a warm-up call, once `answers` answers came back. Each caller on a
    connection of its own (`own_connections`: the kernel spreads them over the workers) or all on one. Returns the
    server (stopped; its log kept), the calls (start, end, code, (n, C) probabilities or the refusal's details;
    time.monotonic()), the time of SIGTERM and the server's exit code."""
    server = ServerProcess(bundle, "--device", "cpu", *args)
    try:
        server.wait_listening()
        return server, *_classify_until_sigterm(server, texts, answers, own_connections)
    finally:
        server.close()


def _classify_until_sigterm(server: ServerProcess, texts: list[str], answers: int,
                            own_connections: bool) -> tuple[list[tuple[float, float, str, object]], float, int]:
    from serving.gen.sentiment.v1 import sentiment_service_pb2 as pb
    from serving.gen.sentiment.v1 import sentiment_service_pb2_grpc as pb_grpc

    def connect() -> grpc.Channel:
        return grpc.insecure_channel(f"127.0.0.1:{server.port}", options=[("grpc.use_local_subchannel_pool", 1)])

    shared = None if own_connections else connect()
    outcomes: list[tuple[float, float, str, object]] = []
    lock = threading.Lock()

    def caller() -> None:
        channel = shared or connect()
        stub = pb_grpc.SentimentServiceStub(channel)
        while True:
            start = time.monotonic()
            try:
                r = stub.Classify(pb.ClassifyRequest(texts=texts), timeout=30)
                item = (start, time.monotonic(), "OK", np.array([x.probabilities for x in r.results]))
            except grpc.RpcError as e:
                item = (start, time.monotonic(), e.code().name, e.details() or "")
            with lock:
                outcomes.append(item)
            if item[2] != "OK":
                break
        if channel is not shared:
            channel.close()

    with connect() as warm:
        pb_grpc.SentimentServiceStub(warm).Classify(pb.ClassifyRequest(texts=["chauffe"]), timeout=30)
    threads = [threading.Thread(target=caller) for _ in range(12)]
    for t in threads:
        t.start()
    wait_until(lambda: len(outcomes) >= answers, 60, what="answers to the callers")  # load is flowing
    # The batcher answers the callers' calls in waves and each caller sends its next call at once, so the moment
    # the answers reach `answers` is a wave's end, when the next wave may not have reached a handler yet: SIGTERM
    # then found nothing accepted in flight (CI, once, under load). Half a call later the next wave is inside.
    with lock:
        half_a_call = float(np.median([o[1] - o[0] for o in outcomes])) / 2
    time.sleep(half_a_call)
    sigterm_at = time.monotonic()
    server.proc.send_signal(signal.SIGTERM)
    for t in threads:
        t.join(60)
    rc = server.wait_exit(60)
    if shared is not None:
        shared.close()
    return outcomes, sigterm_at, rc


def target(server: SentimentServer) -> str:
    return f"127.0.0.1:{server.port}"


def wait_ready(channel: grpc.Channel, timeout: float = 10.0) -> None:
    grpc.channel_ready_future(channel).result(timeout=timeout)


class ServerProcess:
    """`python -m serving.server BUNDLE --port 0 ...` as a subprocess; its log is collected in `lines`. The tests'
    and the bench scripts' (bench/soak.py, bench/protocol_attacks.py) one way to run the server apart."""

    def __init__(self, bundle: Path | str | None, *args: str, env: dict[str, str] | None = None,
                 repo: Path = REPO_ROOT, cpus: str | None = None) -> None:
        """bundle: None when `args` give --model-repository. Metrics and HTTP are off unless `args` name a
        --metrics-port, an --http-port. repo: the tree whose server runs (another one for a benchmark's "before"
        column). cpus: the cores it may run on (taskset's list, e.g. '0-3')."""
        metrics = [] if any(a.startswith("--metrics-port") for a in args) else ["--no-metrics"]
        has_http = (Path(repo) / "serving" / "protocols" / "http").is_dir()  # a "before" tree may predate it
        if has_http and not any(a.startswith("--http-port") for a in args):
            metrics.append("--no-http")
        pinned = ["taskset", "-c", cpus] if cpus else []
        self.cmd = cmd = [*pinned, sys.executable, "-m", "serving.server",
                          *([] if bundle is None else [str(bundle)]), "--port", "0", *metrics,
                          *args]
        # PYTHONPATH: `repo`'s own serving/, not the one installed or this tree's
        self.proc = subprocess.Popen(cmd, cwd=repo, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                     text=True, env={**os.environ, "PYTHONPATH": str(repo), **(env or {})})
        self.lines: list[str] = []
        self.gone_at: float | None = None  # time.monotonic() when its log closed: the server and every worker gone
        self.port: int | None = None
        self.metrics_port: int | None = None  # when its args turn metrics on
        self.http_port: int | None = None  # when its args turn HTTP on
        self._found = threading.Event()
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            self.lines.append(line)
            m = LISTENING.search(line)
            if m and self.port is None:
                metrics = METRICS_ON.search(line)
                self.metrics_port = int(metrics.group(2)) if metrics else None
                http = HTTP_ON.search(line)
                self.http_port = int(http.group(2)) if http else None
                self.port = int(m.group(2))
                self._found.set()
        self.gone_at = time.monotonic()
        self._found.set()  # exited

    def wait_listening(self, timeout: float = 30.0) -> int:
        if not self._found.wait(timeout) or self.port is None:
            self.proc.kill()
            raise AssertionError(f"server did not start; log:\n{self.log}")
        return self.port

    def wait_exit(self, timeout: float = 30.0) -> int:
        rc = self.proc.wait(timeout)
        self._reader.join(5)
        return rc

    @property
    def log(self) -> str:
        return "".join(self.lines)

    def metric(self, name: str, labels: dict[str, str] | None = None) -> float | None:
        """One sample of its Prometheus page (None when absent); needs --metrics-port. A series of the model
        versions' (labelled model, version) is the one bundle's unless `labels` name them."""
        assert self.metrics_port is not None, "started without --metrics-port"
        with urllib.request.urlopen(f"http://127.0.0.1:{self.metrics_port}/metrics", timeout=10) as r:
            page = r.read().decode()
        for family in text_string_to_metric_families(page):
            for sample in family.samples:
                own = {k: v for k, v in sample.labels.items() if k not in ("model", "version") or k in (labels or {})}
                if sample.name == name and own == (labels or {}):
                    return sample.value
        return None

    def codes(self) -> dict[str, float]:
        """The server's own count of answered RPCs by status code, all methods; needs --metrics-port."""
        with urllib.request.urlopen(f"http://127.0.0.1:{self.metrics_port}/metrics", timeout=10) as r:
            page = r.read().decode()
        out: dict[str, float] = {}
        for family in text_string_to_metric_families(page):
            for sample in family.samples:
                if sample.name == "sentiment_requests_total":
                    out[sample.labels["code"]] = out.get(sample.labels["code"], 0.0) + sample.value
        return out

    def _tree(self) -> list[psutil.Process]:
        """The server and its worker processes (--workers)."""
        top = psutil.Process(self.proc.pid)
        return [top, *top.children(recursive=True)]

    def cpu_seconds(self) -> float:
        """User + system CPU seconds of the server and its workers so far."""
        return cpu_seconds(self._tree())

    def threads(self) -> int:
        """Threads of the server and its workers."""
        total = 0
        for p in self._tree():
            with contextlib.suppress(psutil.NoSuchProcess):
                total += p.num_threads()
        return total

    def stop(self, timeout: float = 60.0) -> int:
        """SIGTERM, then its exit code (subprocess.TimeoutExpired past `timeout`: `close()` in a finally)."""
        self.proc.send_signal(signal.SIGTERM)
        return self.wait_exit(timeout)

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(10)


def cpu_seconds(processes: Iterable[psutil.Process]) -> float:
    """User + system CPU seconds of `processes` so far (those that have ended count nothing)."""
    total = 0.0
    for p in processes:
        with contextlib.suppress(psutil.NoSuchProcess):
            times = p.cpu_times()
            total += times.user + times.system
    return total


class FrontProxy:
    """The proxy's image (Containerfile.proxy, built by tests/images.py) in front of the server port `backend` (and its
    HTTP port `http_backend`): HAProxy with the image's deploy/proxy/haproxy.cfg, run by `buildah run` on the host's
    network and listening on free loopback ports (`port`, `http_port`); `settings` (MODEL_CALLS, HEADERS_TIMEOUT...)
    through the environment, the file's defaults for the others, a Path among them (PROXY_TLS_CERT) mounted
    read-only at the same path; `cpus`: the cores it runs on (taskset's list). A context manager; started once it
    accepts a connection. tests/test_front_proxy.py and bench/protocol_attacks.py --via-haproxy run it."""

    def __init__(self, backend: int, settings: dict[str, object] | None = None, cpus: str | None = None,
                 http_backend: int | None = None) -> None:
        image = proxy_image()
        self.port, self.http_port = free_port(), free_port()
        settings = {"PROXY_BIND": f"127.0.0.1:{self.port}", "SERVER_ADDR": f"127.0.0.1:{backend}",
                    "HTTP_BIND": f"127.0.0.1:{self.http_port}",
                    "HTTP_SERVER_ADDR": f"127.0.0.1:{http_backend or free_port()}", **(settings or {})}
        mounts = [a for v in settings.values() if isinstance(v, Path) for a in ("--volume", f"{v}:{v}:ro")]
        env = [a for k, v in settings.items() for a in ("--env", f"{k}={v}")]
        self.container = ok(["buildah", "from", "--pull-never", "--ulimit", f"nofile={PROXY_NOFILE}:{PROXY_NOFILE}",
                             image], timeout=120).stdout.strip()
        pinned = ["taskset", "-c", cpus] if cpus else []
        self.log = tempfile.TemporaryFile("w+")  # haproxy's warnings: a file never blocks it, a full pipe would
        self.proc = popen([*pinned, "buildah", "run", "--isolation", "chroot", *mounts, *env, self.container, "--",
                           *config(image)["Entrypoint"]], stdout=subprocess.DEVNULL, stderr=self.log)
        end = time.monotonic() + 30
        while True:
            try:
                socket.create_connection(("127.0.0.1", self.port), timeout=1).close()
                break
            except OSError:
                if self.proc.poll() is not None or time.monotonic() > end:
                    said = self.output()  # before close() closes the log
                    self.close()
                    raise RuntimeError(f"haproxy did not start (exit {self.proc.returncode}): {said}") from None
                time.sleep(0.05)
        (self.haproxy,) = [p for p in psutil.Process(self.proc.pid).children(recursive=True) if p.name() == "haproxy"]

    def output(self) -> str:
        """What haproxy wrote so far (its warnings and alerts)."""
        self.log.seek(0)
        return self.log.read()

    def cpu_seconds(self) -> float:
        """User + system CPU seconds of the proxy so far."""
        return cpu_seconds([self.haproxy])

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()  # buildah passes it on to haproxy
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                pass
        kill_group(self.proc)
        run(["buildah", "rm", self.container], timeout=120)
        self.log.close()

    def __enter__(self) -> FrontProxy:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _name(cn: str) -> x509.Name:
    return x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, cn)])


def _cert(subject: str, key: ec.EllipticCurvePrivateKey, issuer: tuple[str, ec.EllipticCurvePrivateKey] | None,
          *, ca: bool = False, server: bool = False, expired: bool = False) -> x509.Certificate:
    """A certificate for `key`, signed by issuer (None: self-signed). EC P-256: fast to generate."""
    now = dt.datetime.now(dt.UTC)
    start, end = (now - dt.timedelta(days=10), now - dt.timedelta(days=1)) if expired else \
        (now - dt.timedelta(minutes=5), now + dt.timedelta(days=1))
    issuer_name, issuer_key = (subject, key) if issuer is None else issuer
    b = (x509.CertificateBuilder().subject_name(_name(subject)).issuer_name(_name(issuer_name))
         .public_key(key.public_key()).serial_number(x509.random_serial_number())
         .not_valid_before(start).not_valid_after(end)
         .add_extension(x509.BasicConstraints(ca=ca, path_length=None), critical=True))
    if ca:
        b = b.add_extension(x509.KeyUsage(digital_signature=True, content_commitment=False, key_encipherment=False,
                                          data_encipherment=False, key_agreement=False, key_cert_sign=True,
                                          crl_sign=True, encipher_only=False, decipher_only=False), critical=True)
    elif server:
        b = b.add_extension(x509.SubjectAlternativeName([x509.DNSName("localhost"),
                                                         x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]),
                            critical=False)
        b = b.add_extension(x509.ExtendedKeyUsage([ExtendedKeyUsageOID.SERVER_AUTH]), critical=False)
    else:
        b = b.add_extension(x509.ExtendedKeyUsage([ExtendedKeyUsageOID.CLIENT_AUTH]), critical=False)
    return b.sign(issuer_key, hashes.SHA256())


def make_certs(folder: Path) -> dict[str, Path]:
    """PEM files in `folder`: ca, server (for localhost/127.0.0.1, signed by ca), client (signed by ca),
    rogue_client (signed by another CA, rogue_ca), expired_client (signed by ca, expired); each with its `_key`."""
    folder.mkdir(parents=True, exist_ok=True)
    keys = {n: ec.generate_private_key(ec.SECP256R1()) for n in
            ("ca", "rogue_ca", "server", "client", "rogue_client", "expired_client")}
    made = {
        "ca": _cert("test-ca", keys["ca"], None, ca=True),
        "rogue_ca": _cert("rogue-ca", keys["rogue_ca"], None, ca=True),
        "server": _cert("localhost", keys["server"], ("test-ca", keys["ca"]), server=True),
        "client": _cert("client", keys["client"], ("test-ca", keys["ca"])),
        "rogue_client": _cert("rogue-client", keys["rogue_client"], ("rogue-ca", keys["rogue_ca"])),
        "expired_client": _cert("expired-client", keys["expired_client"], ("test-ca", keys["ca"]), expired=True),
    }
    out = {}
    for name, cert in made.items():
        out[name] = folder / f"{name}.pem"
        out[name].write_bytes(cert.public_bytes(serialization.Encoding.PEM))
        out[f"{name}_key"] = folder / f"{name}.key"
        out[f"{name}_key"].write_bytes(keys[name].private_bytes(serialization.Encoding.PEM,
                                                                serialization.PrivateFormat.PKCS8,
                                                                serialization.NoEncryption()))
    return out


@pytest.fixture(scope="session")
def certs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """make_certs() once per session (import it into a test module to use it)."""
    return make_certs(tmp_path_factory.mktemp("certs"))


def secure_channel(server: SentimentServer, certs: dict[str, Path], client: str | None = None,
                   ca: str = "ca") -> grpc.Channel:
    """A TLS channel trusting `ca`, presenting the `client` certificate when given (mutual TLS)."""
    creds = grpc.ssl_channel_credentials(
        root_certificates=certs[ca].read_bytes(),
        private_key=certs[f"{client}_key"].read_bytes() if client else None,
        certificate_chain=certs[client].read_bytes() if client else None,
    )
    return grpc.secure_channel(target(server), creds)
