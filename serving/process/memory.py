"""Giving memory back to the system once a burst of model calls is over.

After a burst, an idle server holds more than its live objects need: glibc's per-thread arenas keep freed pages,
unreachable cycles wait for a collection an idle process never triggers, and glibc's rising mmap threshold carves
later request buffers from the arenas (docs/RELIABILITY.md, "Where an idle server's memory went", has the figures).
`Reclaimer` counts model calls in progress and answers held; once none has been for `settle_s`, it runs
gc.collect() and malloc_trim(0) in a thread of its own, at most once per `every_s`, and only when work happened
since. Under steady load it never runs. `fix_mmap_threshold` pins glibc's threshold once per process.
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
        self._lock = threading.RLock()  # `with` takes it, not the Condition: its __enter__ is Python
        self._cond = threading.Condition(self._lock)
        self._busy = 0  # calls (and held answers) in progress
        self._dirty = False  # some started since the last reclaim
        self._idle_since = time.monotonic()
        self._last = -float("inf")  # time.monotonic() of the last reclaim
        self._closed = False
        self._asleep = False  # the thread waits for an idle moment without a timeout (only `leave` wakes it)
        self._thread = threading.Thread(target=self._loop, name="memory-reclaim", daemon=True)
        self._thread.start()

    def enter(self) -> None:
        with self._lock:
            self._busy += 1
            self._dirty = True

    def leave(self) -> None:
        with self._lock:
            self._busy -= 1
            if self._busy == 0:
                self._idle_since = time.monotonic()
                if self._asleep:  # else it is counting down already, and sees the new idle_since when it wakes:
                    self._asleep = False  # one wake-up per burst, not one per call
                    self._cond.notify()

    def close(self) -> None:
        with self._lock:
            self._closed = True
            self._cond.notify()
        self._thread.join(5)

    def _loop(self) -> None:
        with self._lock:
            while not self._closed:
                if self._busy or not self._dirty:
                    self._asleep = True
                    self._cond.wait()
                    continue
                left = max(self._idle_since + self.settle_s, self._last + self.every_s) - time.monotonic()
                if left > 0:
                    self._cond.wait(left)
                    continue
                self._dirty = False
                self._lock.release()  # calls may come and go while it runs: they only mark it dirty again
                try:
                    self._reclaim()
                finally:
                    self._lock.acquire()
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
