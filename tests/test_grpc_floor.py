"""bench/grpc_floor.py, the bare grpcio server the benchmarks compare with: it stops on SIGTERM whichever of its
threads the kernel hands the signal to."""

from __future__ import annotations

import ctypes
import os
import platform
import signal
import subprocess
import sys
from pathlib import Path

import pytest
from procs import REPO


@pytest.mark.skipif(platform.machine() != "x86_64", reason="tgkill's syscall number is x86_64's")
def test_sigterm_to_a_grpc_thread_stops_the_floor_server(tiny_bundle: Path) -> None:
    """The signal sent to a thread other than the main one (tgkill), as the kernel may choose for a process-wide
    SIGTERM: the server still exits at once. Before, its main thread waited without a timeout and never ran the
    handler: the benchmark's stop timed out after 60 s in CI."""
    proc = subprocess.Popen([sys.executable, "bench/grpc_floor.py", str(tiny_bundle)], cwd=REPO,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        assert proc.stdout is not None
        assert "listening on" in proc.stdout.readline()
        # its handler is in place once it says it is up (before, SIGTERM could still kill it then: exit -15)
        caught = next(int(line.split()[1], 16) for line in Path(f"/proc/{proc.pid}/status").read_text().splitlines()
                      if line.startswith("SigCgt:"))
        assert caught & (1 << (signal.SIGTERM - 1)), f"SigCgt {caught:x}: no SIGTERM handler yet"
        other = next(int(t) for t in os.listdir(f"/proc/{proc.pid}/task") if int(t) != proc.pid)
        libc = ctypes.CDLL(None, use_errno=True)
        assert libc.syscall(234, proc.pid, other, signal.SIGTERM) == 0  # 234: tgkill on x86_64
        assert proc.wait(20) == 0
    finally:
        proc.kill()
        proc.wait()
