"""Measure the server's memory for a bundle: resident set after loading, and its peak under full-size requests.
The Deployment's memory request and limit (deploy/deployment.yaml) come from these two figures.

    python deploy/measure_rss.py BUNDLE [--seconds 30] [--callers 8] [-- SERVER FLAGS...]

Starts `python -m serving.server BUNDLE` on a free loopback port (with the flags after `--`, e.g. the Deployment's),
waits for SERVING, reads VmRSS, then sends requests of max_texts texts each longer than the bundle's max_len
from `--callers` threads for `--seconds`, and reads VmHWM (the kernel's peak resident set of the process).
Memory, not speed: the figures do not depend on the machine's load. Prints one JSON object.
"""

from __future__ import annotations

import argparse
import json
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

from healthcheck import check  # deploy/healthcheck.py, beside this file

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
from serving.client import SentimentClient  # noqa: E402


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _status_kib(pid: int, field: str) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    raise KeyError(field)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("bundle", type=Path, help="bundle folder to serve")
    p.add_argument("--seconds", type=float, default=30.0, help="length of the load phase")
    p.add_argument("--callers", type=int, default=8, help="concurrent callers during the load phase")
    p.add_argument("server_flags", nargs="*", help="after `--`: extra flags for serving.server")
    args = p.parse_args(argv)

    port = _free_port()
    target = f"127.0.0.1:{port}"
    server = subprocess.Popen([sys.executable, "-m", "serving.server", str(args.bundle), "--port", str(port),
                               "--metrics-port", "0", *args.server_flags], cwd=REPO, stderr=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + 300
        while check(target) != "SERVING":
            if server.poll() is not None or time.monotonic() > deadline:
                raise SystemExit(f"measure_rss: the server did not come up (exit {server.poll()})")
            time.sleep(0.2)
        idle_kib = _status_kib(server.pid, "VmRSS")
        with SentimentClient(target, timeout=600) as probe:
            meta = probe.metadata()
        # Every text longer than max_len tokens (400 words, at least a token each): each batch is as large as
        # max_batch_tokens lets it be. Its words do not matter: the tensors are cut at max_len.
        text = " ".join(f"mot{i}" for i in range(400))
        texts = [text] * meta["max_texts"]
        stop_at = time.monotonic() + args.seconds
        requests = [0] * args.callers

        def caller(i: int) -> None:
            with SentimentClient(target, timeout=600) as client:
                while time.monotonic() < stop_at:
                    client.classify(texts)
                    requests[i] += 1

        threads = [threading.Thread(target=caller, args=(i,)) for i in range(args.callers)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        peak_kib = _status_kib(server.pid, "VmHWM")
    finally:
        server.terminate()
        server.wait(60)
    print(json.dumps({
        "bundle": str(args.bundle), "max_len": meta["max_tokens"],
        "bundle_mib": round(sum(f.stat().st_size for f in args.bundle.rglob("*") if f.is_file()) / 2**20, 1),
        "idle_rss_mib": round(idle_kib / 1024, 1), "peak_rss_mib": round(peak_kib / 1024, 1),
        "load": {"callers": args.callers, "seconds": args.seconds, "texts_per_request": len(texts),
                 "requests": sum(requests)},
        "server_flags": args.server_flags,
    }))
    return 0


if __name__ == "__main__":
    sys.exit(main())
