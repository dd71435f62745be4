"""Giving memory back to the system once a burst of model calls is over.

A server's memory after a burst is not what its live objects need. 100 KServe calls of 512 texts whose answers a
client never read, after 100 calls that each listed an output 7,400 times (tests/test_reliability_attacks.py), left
the server 26-28% above its resident size before them for as long as it stayed idle. Found with /proc/PID/smaps,
tracemalloc and gc.DEBUG_SAVEALL, in order of size:
  - glibc kept the pages of freed blocks in its per-thread arenas (19 MB here): malloc_trim(0) returns them;
  - reference cycles held the texts, tokens and request of every refused or cancelled call (31 calls of 512 texts,
    about 13 MB): Python's cyclic collector frees them only after enough new allocations, which an idle server
    never makes. Ours (a failed future and the frame that waited on it) is broken where it forms
    (serving/servicer.py); gRPC keeps each cancelled call's RpcError in a list that its frames hold (small):
    gc.collect() here frees those;
  - Python's small-object allocator frees a 1 MiB arena only when every object in it is gone; reading 7,400 output
    entries made 15,000 Python objects per call and grew it from 24 to 32 arenas, which the thread-pool threads
    started during the burst then pinned. serving/kserve.py now counts the entries instead of reading them.
With the three, the server is back within 1.5-2.3% (3 runs). A fourth showed later (+7-11%, idle or loaded; the
pages of glibc's per-thread arenas): glibc's mmap threshold, which rises to the size of every large block freed,
so that later request-sized buffers (127 KB for 512 texts) are carved from the arenas instead of mapped alone, and
pin arena pages while a few of them live. `fix_mmap_threshold` sets it once (64 KiB by default): +0.8-1.5%.

`Reclaimer` counts model calls in progress and answers held for their clients; once none has been for `settle_s`,
it runs gc.collect() and malloc_trim(0) in a thread of its own, at most once per `every_s`, and only when work
happened since the last time. Under steady load, or traffic whose pauses are shorter than `settle_s`, it never
runs. What it costs: its pause (a full collection, most of it, and the trim) lands on a server idle for
`settle_s`; the next burst then faults its pages in again. Two servers side by side, one reclaiming and one not,
bursts of 1,000 calls after 6 s pauses (bench/memory_reclaim.py): median ratio of the rounds' rates 0.969, range
0.934-1.099, on a shared 2-core machine.
"""

from __future__ import annotations

import ctypes
import gc
import logging
import os
import threading
import time
from collections.abc import Callable

log = logging.getLogger("serving.server")


def _malloc_trim() -> Callable[[int], int] | None:
    """glibc's malloc_trim, or None where the C library is not glibc (musl, macOS: nothing to trim there)."""
    try:
        trim = ctypes.CDLL(None).malloc_trim
    except (OSError, AttributeError):
        return None
    trim.argtypes, trim.restype = [ctypes.c_size_t], ctypes.c_int
    return trim


_M_MMAP_THRESHOLD = -3  # mallopt's parameter number (malloc.h)


def fix_mmap_threshold(nbytes: int) -> bool:
    """Give blocks of at least `nbytes` a mapping of their own (glibc's mallopt(M_MMAP_THRESHOLD), which also stops
    the threshold from rising). Does nothing where the C library is not glibc, when `nbytes` is 0, or when
    MALLOC_MMAP_THRESHOLD_ is set (the user's choice wins). True when set."""
    if nbytes <= 0 or "MALLOC_MMAP_THRESHOLD_" in os.environ:
        return False
    try:
        mallopt = ctypes.CDLL(None).mallopt
    except (OSError, AttributeError):
        return False
    mallopt.argtypes, mallopt.restype = [ctypes.c_int, ctypes.c_int], ctypes.c_int
    return mallopt(_M_MMAP_THRESHOLD, nbytes) == 1


class Reclaimer:
    """`enter()` when a call starts using memory, `leave()` when it is done with it; see the module docstring."""

    def __init__(self, settle_s: float = 5.0, every_s: float = 10.0,
                 on_reclaim: Callable[[float], None] = lambda seconds: None) -> None:
        self.settle_s, self.every_s = settle_s, every_s
        self.on_reclaim = on_reclaim
        self.reclaims = 0  # done so far
        self._trim = _malloc_trim()
        self._cond = threading.Condition()
        self._busy = 0  # calls (and held answers) in progress
        self._dirty = False  # some started since the last reclaim
        self._idle_since = time.monotonic()
        self._last = -float("inf")  # time.monotonic() of the last reclaim
        self._closed = False
        self._thread = threading.Thread(target=self._loop, name="memory-reclaim", daemon=True)
        self._thread.start()

    def enter(self) -> None:
        with self._cond:
            self._busy += 1
            self._dirty = True

    def leave(self) -> None:
        with self._cond:
            self._busy -= 1
            if self._busy == 0:
                self._idle_since = time.monotonic()
                self._cond.notify()

    def close(self) -> None:
        with self._cond:
            self._closed = True
            self._cond.notify()
        self._thread.join(5)

    def _loop(self) -> None:
        with self._cond:
            while not self._closed:
                if self._busy or not self._dirty:
                    self._cond.wait()
                    continue
                left = max(self._idle_since + self.settle_s, self._last + self.every_s) - time.monotonic()
                if left > 0:
                    self._cond.wait(left)
                    continue
                self._dirty = False
                self._cond.release()  # calls may come and go while it runs: they only mark it dirty again
                try:
                    self._reclaim()
                finally:
                    self._cond.acquire()
                self._last = time.monotonic()

    def _reclaim(self) -> None:
        start = time.perf_counter()
        found = gc.collect()
        if self._trim is not None:
            self._trim(0)  # ctypes releases the GIL for the call
        seconds = time.perf_counter() - start
        self.reclaims += 1
        log.debug("memory reclaimed after a burst: %d unreachable objects, %.1f ms", found, 1000 * seconds)
        self.on_reclaim(seconds)
