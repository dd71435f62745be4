"""Child processes that never outlive their test.

Each command starts as the leader of a new process group (`start_new_session`), so every process it spawns
(DeepSpeed's launcher and its ranks, a server and its workers) shares that group. On timeout and on the way out the
whole group is SIGKILLed: a timed-out launcher killed alone would leave its ranks running (or spinning on a dead peer)
under the rest of the suite.
"""

from __future__ import annotations

import os
import random
import signal
import socket
import subprocess
import sys
from collections.abc import Sequence
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
BIN = Path(sys.executable).parent  # the virtualenv's bin: python, deepspeed
# Why a CUDA test of onnxruntime skips: a GPU alone is not enough (a bare CUDA image has onnxruntime's CPU build).
NO_ORT_CUDA = ("needs onnxruntime's CUDA provider (onnxruntime-gpu) and the NVIDIA driver "
               "(contract.runtime.cuda_driver_present)")


def env() -> dict[str, str]:
    """The environment of a DeepSpeed launch from a test: our venv first on PATH, and no rank variables or
    DS_ACCELERATOR inherited from whatever runs pytest (rank variables would make a launcher's child think it is one
    rank; the trainer sets DeepSpeed's accelerator to the device it trains on)."""
    e = dict(os.environ)
    e.setdefault("TORCH_EXTENSIONS_DIR", str(REPO / ".cache" / "torch_extensions"))
    e["PATH"] = f"{BIN}{os.pathsep}{e.get('PATH', '')}"
    for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "DS_ACCELERATOR"):
        e.pop(k, None)
    return e


_PORTS = random.SystemRandom()  # not the global generator: a test may seed that, and two workers then agree


def free_port() -> int:
    """A free port for a listener that another process binds later (a server, a DeepSpeed rank, a container started
    by podman-compose or `buildah run`), below the kernel's ephemeral range (32768-60999 by default). A port of that
    range may be taken meanwhile by any test's outgoing connection or port-0 bind: CI 2026-11-28, compose's proxy
    found its port 47685 taken, and the front proxy of tests/test_edge.py did not start."""
    low = int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    if low < 21000:  # a machine whose ephemeral range starts low has no quiet ports: any free one
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            return int(s.getsockname()[1])
    for _ in range(200):
        port = _PORTS.randrange(20000, low)
        with socket.socket() as s:
            try:
                s.bind(("0.0.0.0", port))
            except OSError:
                continue
            return port
    raise RuntimeError(f"no free port in 20000-{low}")


def popen(cmd: Sequence[str], **kw: object) -> subprocess.Popen[str]:
    """subprocess.Popen in a new session (process group = its pid); pair with `kill_group` in a finally."""
    return subprocess.Popen(list(cmd), start_new_session=True, text=True, **kw)  # type: ignore[call-overload]


def kill_group(proc: subprocess.Popen[str]) -> None:
    """SIGKILL everything left in `proc`'s process group (also after `proc` itself has exited), then reap it."""
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass
    if proc.poll() is None:
        proc.wait()


def run(cmd: Sequence[str], timeout: float, **kw: object) -> subprocess.CompletedProcess[str]:
    """subprocess.run(capture_output=True, text=True) whose timeout also kills the command's descendants."""
    proc = popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, **kw)
    try:
        out, err = proc.communicate(timeout=timeout)
    finally:
        kill_group(proc)
    return subprocess.CompletedProcess(proc.args, proc.returncode, out, err)
