"""The bounds of admission, each a small object with its own lock (serving/limits/admission.py holds them; the gRPC
interceptor also bounds its health threads with `Slots`). No protocol here:

- `Slots`: calls in progress at once, refused past the limit (no queue);
- `ResponseBudget`: bytes of answers built and not yet delivered;
- `Watchdog`: cancels a call whose request message has not arrived in time (one thread for all calls).
Each one that holds work in progress tells a `Busy` (the memory reclaimer, serving/process/memory.py).
"""

from __future__ import annotations

import heapq
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Protocol

from serving.errors import Overloaded
from serving.telemetry.prometheus import Metrics


class Busy(Protocol):
    """Told when work starts and ends (serving/process/memory.py's Reclaimer gives memory back once none is left)."""

    def enter(self) -> None: ...

    def leave(self) -> None: ...


class Watch:
    """One armed wait for a message (Watchdog.arm); `fired`: the watchdog cancelled the call."""

    __slots__ = ("token", "cancel", "fired")

    def __init__(self, token: int, cancel: Callable[[], None]) -> None:
        self.token, self.cancel = token, cancel
        self.fired = False


class Watchdog:
    """Cancels a call whose next request message has not arrived `timeout` s after it was armed (`arm`, then
    `disarm` once it has). One thread for all calls: arming is a heap push (deadlines come in order, so the thread
    is woken only when idle)."""

    def __init__(self, timeout: float, on_fire: Callable[[], None] = lambda: None) -> None:
        self.timeout = timeout
        self.on_fire = on_fire
        self._lock = threading.RLock()  # `with` takes it, not the Condition: its __enter__ is Python
        self._cond = threading.Condition(self._lock)
        self._heap: list[tuple[float, int]] = []  # (deadline, token), lazily cleaned
        self._armed: dict[int, Watch] = {}  # token -> the watch of a call waiting for a message
        self._next = 0
        self._closed = False
        self._thread = threading.Thread(target=self._loop, name="body-watchdog", daemon=True)
        self._thread.start()

    def arm(self, cancel: Callable[[], None]) -> Watch:
        """Watch a call until `disarm`: `cancel` is called if that has not come within `timeout`."""
        with self._lock:
            watch = Watch(self._next, cancel)
            self._next += 1
            self._armed[watch.token] = watch
            heapq.heappush(self._heap, (time.monotonic() + self.timeout, watch.token))
            if len(self._heap) == 1:
                self._cond.notify()
        return watch

    def disarm(self, watch: Watch) -> bool:
        """The call's message has come (or it has ended): True when the watchdog had already cancelled it."""
        with self._lock:
            self._armed.pop(watch.token, None)
        return watch.fired

    def _loop(self) -> None:
        with self._lock:
            while not self._closed:
                if not self._heap:
                    self._cond.wait()
                    continue
                deadline, token = self._heap[0]
                left = deadline - time.monotonic()
                if left > 0:
                    self._cond.wait(left)
                    continue
                heapq.heappop(self._heap)
                watch = self._armed.pop(token, None)
                if watch is not None:  # still waiting for its message: cancel (non-blocking in gRPC)
                    watch.fired = True
                    watch.cancel()
                    self.on_fire()

    def close(self) -> None:
        with self._lock:
            self._closed = True
            self._cond.notify()
        self._thread.join(5)


class ResponseBudget:
    """Bytes of answers built and not yet delivered: reserved when an answer is built, released when its call
    ends (delivered, or cancelled by its client). gRPC keeps an answer that its client does not read in memory;
    this bounds the sum. A held answer counts as work in progress for the reclaimer (serving/process/memory.py)."""

    def __init__(self, limit: int, metrics: Metrics, reclaimer: Busy | None = None) -> None:
        self.limit = limit
        self.used = 0
        self._lock = threading.Lock()
        self._gauge = metrics.live(metrics.response_bytes, lambda: self.used)  # None: a scrape reads `used`
        self._reclaimer = reclaimer

    @property
    def spent(self) -> bool:
        return self.used >= self.limit

    def reserve(self, size: int) -> None:
        """Raises Overloaded when `size` more bytes would pass the limit."""
        with self._lock:
            if self.used + size > self.limit:
                raise Overloaded(f"{self.used} bytes of answers wait for their clients + {size} > "
                                 f"max_response_bytes_in_flight {self.limit}; retry later")
            self.used += size
            if self._gauge is not None:
                self._gauge.set(self.used)
        if self._reclaimer is not None:
            self._reclaimer.enter()

    def release(self, size: int) -> None:
        """Runs in gRPC's polling thread (a call's done-callback): a lock and a notify, nothing more."""
        with self._lock:
            self.used -= size
            if self._gauge is not None:
                self._gauge.set(self.used)
        if self._reclaimer is not None:
            self._reclaimer.leave()


class Slots:
    """Calls in progress at once, up to `limit`; past it a call is refused at once (no queue). A slot taken counts as
    work in progress for `reclaimer` (serving/process/memory.py), when given."""

    def __init__(self, limit: int, what: str, reclaimer: Busy | None = None) -> None:
        self.limit, self.what = limit, what
        self.used = 0
        self._lock = threading.Lock()
        self._reclaimer = reclaimer

    def acquire(self) -> Overloaded | None:
        """Take a slot (then `release` it once), or say why none is free."""
        with self._lock:
            if self.used >= self.limit:
                return Overloaded(f"server busy: {self.used} {self.what} calls in progress (limit {self.limit}); "
                                  "retry later")
            self.used += 1
        if self._reclaimer is not None:
            self._reclaimer.enter()
        return None

    def release(self) -> None:
        with self._lock:
            self.used -= 1
        if self._reclaimer is not None:
            self._reclaimer.leave()

    @contextmanager
    def take(self) -> Iterator[None]:
        refusal = self.acquire()
        if refusal is not None:
            raise refusal
        try:
            yield
        finally:
            self.release()
