"""bench/workers_bench.py --switches: a thread's context switches and CPU time, read from /proc and summed by its Python
name with a pool's numbers cut, so that a pool of handler threads is one figure."""

from __future__ import annotations

import importlib.util
import os
import threading
import time

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


def test_a_threads_cpu_time_is_counted_under_its_pools_name() -> None:
    done, read = threading.Semaphore(0), threading.Event()

    def burn() -> None:  # 0.3 s of this thread's own CPU, then alive until it has been read (/proc forgets it after)
        start = time.thread_time()
        while time.thread_time() - start < 0.3:
            pass
        done.release()
        read.wait(10)

    threads = [threading.Thread(target=burn, name=f"burner_{i}") for i in (2, 7)]
    for t in threads:
        t.start()
    names = {t.native_id: t.name for t in threads}
    for _ in threads:
        assert done.acquire(timeout=10)
    after = workers_bench.thread_cpu(os.getpid(), names)
    read.set()
    for t in threads:
        t.join(5)
    assert "burner_2" not in after and "burner_7" not in after
    assert 0.55 <= after["burner"] < 2.0  # both threads' 0.3 s, in clock ticks; not the main thread's
