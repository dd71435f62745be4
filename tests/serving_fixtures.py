"""Helpers for the serving tests: real servers on 127.0.0.1 (in-process or as a subprocess), real certificates.

Plain functions (no fixtures), imported by tests/test_serving_*.py; the `tiny_bundle` fixture comes from conftest.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import grpc
from procs import REPO as REPO_ROOT

from serving.config import ServerConfig
from serving.server import SentimentServer

LISTENING = re.compile(r"listening on ([\d.]+):(\d+)")


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


class HeldRuns:
    """Holds the server's batch workers inside their onnxruntime runs (a gate around the real `Predictor.infer`)
    until `release()`, so that requests queue behind them deterministically, whatever the machine's load.
    Installed when made; as a context manager, on exit the real infer is back and every held run goes on."""

    def __init__(self, server: SentimentServer) -> None:
        self.batcher, self.real = server.batcher, server.batcher.infer
        self.sizes: list[int] = []  # texts per run, in the order the runs started
        self._entered = threading.Semaphore(0)
        self._open = threading.Event()
        self.batcher.infer = self

    def __enter__(self) -> HeldRuns:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop_holding()
        self.release()

    def __call__(self, rows):  # noqa: ANN001, ANN204
        self.sizes.append(len(rows))
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


def target(server: SentimentServer) -> str:
    return f"127.0.0.1:{server.port}"


def wait_ready(channel: grpc.Channel, timeout: float = 10.0) -> None:
    grpc.channel_ready_future(channel).result(timeout=timeout)


class ServerProcess:
    """`python -m serving.server BUNDLE --port 0 ...` as a subprocess; its log is collected in `lines`."""

    def __init__(self, bundle: Path | str, *args: str, env: dict[str, str] | None = None) -> None:
        cmd = [sys.executable, "-m", "serving.server", str(bundle), "--port", "0", "--no-metrics", *args]
        self.proc = subprocess.Popen(cmd, cwd=REPO_ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                     text=True, env={**os.environ, **(env or {})})
        self.lines: list[str] = []
        self.port: int | None = None
        self._found = threading.Event()
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            self.lines.append(line)
            m = LISTENING.search(line)
            if m and self.port is None:
                self.port = int(m.group(2))
                self._found.set()
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

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(10)


def make_certs(folder: Path) -> dict[str, Path]:
    """A CA, a server certificate for localhost/127.0.0.1 and a client certificate signed by it, plus a client
    certificate signed by another CA (the rogue). EC P-256 keys: fast to generate. Needs the openssl CLI."""
    folder.mkdir(parents=True, exist_ok=True)

    def run(*args: str) -> None:
        subprocess.run(["openssl", *args], cwd=folder, check=True, capture_output=True)

    ec = ["-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes"]
    for ca in ("ca", "rogue-ca"):
        run("req", "-x509", *ec, "-keyout", f"{ca}.key", "-out", f"{ca}.pem", "-days", "2", "-subj", f"/CN={ca}",
            "-addext", "basicConstraints=critical,CA:TRUE", "-addext", "keyUsage=critical,keyCertSign,cRLSign")
    leaves = {
        "server": ("ca", "subjectAltName=DNS:localhost,IP:127.0.0.1\nextendedKeyUsage=serverAuth\n"),
        "client": ("ca", "extendedKeyUsage=clientAuth\n"),
        "rogue-client": ("rogue-ca", "extendedKeyUsage=clientAuth\n"),
    }
    for name, (ca, ext) in leaves.items():
        (folder / f"{name}.ext").write_text(ext)
        run("req", *ec, "-keyout", f"{name}.key", "-out", f"{name}.csr", "-subj", f"/CN={name}")
        run("x509", "-req", "-in", f"{name}.csr", "-CA", f"{ca}.pem", "-CAkey", f"{ca}.key", "-CAcreateserial",
            "-out", f"{name}.pem", "-days", "2", "-extfile", f"{name}.ext")
    return {
        "ca": folder / "ca.pem",
        "server_cert": folder / "server.pem",
        "server_key": folder / "server.key",
        "client_cert": folder / "client.pem",
        "client_key": folder / "client.key",
        "rogue_cert": folder / "rogue-client.pem",
        "rogue_key": folder / "rogue-client.key",
    }
