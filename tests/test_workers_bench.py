"""bench/workers_bench.py --switches: a thread's context switches, read from /proc and summed by its Python name with a
pool's numbers cut, so that a pool of handler threads is one figure."""

from __future__ import annotations

import importlib.util
import os
import threading

from procs import REPO

spec = importlib.util.spec_from_file_location("workers_bench", REPO / "bench" / "workers_bench.py")
workers_bench = importlib.util.module_from_spec(spec)
spec.loader.exec_module(workers_bench)  # type: ignore[union-attr]


def test_a_pools_threads_count_as_one_name_and_each_wake_is_counted() -> None:
    ping, pong, stop = threading.Event(), threading.Event(), threading.Event()

    def player() -> None:  # woken 50 times: each wait that blocks is a switch away and back
        while not stop.is_set():
            if ping.wait(5):
                ping.clear()
                pong.set()

    threads = [threading.Thread(target=player, name=f"pool_{i}") for i in (3, 12)]
    for t in threads:
        t.start()
    names = {t.native_id: t.name for t in threads}
    before = workers_bench.switches(os.getpid(), names)
    for _ in range(50):
        ping.set()
        assert pong.wait(5)
        pong.clear()
    after = workers_bench.switches(os.getpid(), names)
    stop.set()
    ping.set()
    for t in threads:
        t.join(5)
    assert "pool_3" not in after and "pool_12" not in after
    assert after["pool"] - before["pool"] >= 50
