"""Whose batch runs next when several models wait for the cores, and whose call goes in next when several models'
calls wait for the request path: the process' onnxruntime runs and its model calls, shared fairly.

Each model has its own batcher and queue (serving/model/models.py), but they all run on the same cores. Left alone,
they share the cores in proportion to their callers: a model flooded by 64 callers takes most of them from one with
16. Here at most `slots` runs happen at once in the process, and a free slot goes to the waiting model that has
used the least run time so far (start-time fair queueing, as a CPU scheduler shares a core between processes): two
busy models get half of the run time each, whatever their callers. A model that was idle comes back at the level of
the least served of the others, never with saved-up credit. One model alone takes every slot as soon as it is free:
nothing changes for a server of one model but a lock per batch.

The runs are not all: on 2 cores the request path (gRPC, protobuf, tokenizing, under one interpreter lock) costs more
than the runs, and it is shared by calls, not runs. So the calls take turns too (`alone=True`, `slots` =
ServerConfig.fair_calls): while two models have calls in progress, at most that many are inside the server's model
path at once, the rest of each model's calls wait their turn in their thread, and a free place goes to the model
served least; a model alone is not bounded.
"""

from __future__ import annotations

import threading
import time
from collections import deque
from collections.abc import Callable


class Turns:
    """Thread-safe; `take(model)` before a run (blocks while it is not that model's turn), `give(model, cost)` after
    it: the run's seconds, or 1 for a call (then the models take turns by calls served). alone: a model that is the
    only one active is not bounded by `slots` (the call turns: a server of one model keeps its concurrency)."""

    def __init__(self, slots: int, alone: bool = False) -> None:
        self._lock = threading.Lock()
        self._free = slots
        self._alone = alone
        self._used: dict[str, float] = {}  # cost so far, per model with runs or calls waiting or running
        # per model with threads waiting for a place, one Condition a thread in arrival order: only the head of the
        # model served least is woken, and a thread that wakes to ask `gone` keeps its place (a Condition shared by
        # the model's threads would put it behind every later one, a tail of waits that grows with the flood)
        self._waiting: dict[str, deque[threading.Condition]] = {}
        self._running: dict[str, int] = {}

    def take(self, model: str, until: float | None = None, gone: Callable[[], bool] | None = None) -> bool:
        """Wait for `model`'s turn; False (no turn taken) once time.monotonic() passes `until` or `gone()` says the
        caller has left, which is asked every 0.1 s while it waits."""
        with self._lock:
            if not self._waiting and self._free > 0:  # a place is free and no one is before it: the turn is its own
                if model not in self._running:  # back from idle: no saved-up credit
                    others = [self._used[m] for m in self._running if m in self._used]
                    self._used[model] = max(self._used.get(model, 0.0), min(others, default=0.0))
                self._free -= 1
                self._running[model] = self._running.get(model, 0) + 1
                return True
            if model not in self._waiting and model not in self._running:  # back from idle: no saved-up credit
                others = [self._used[m] for m in self._active() if m in self._used]
                self._used[model] = max(self._used.get(model, 0.0), min(others, default=0.0))
            line = self._waiting.setdefault(model, deque())
            me = threading.Condition(self._lock)
            line.append(me)
            taken = False
            try:
                while not ((self._free > 0 or self._alone and self._only(model))
                           and min(self._waiting, key=self._used.__getitem__) == model and line[0] is me):
                    if (until is not None and time.monotonic() >= until) or (gone is not None and gone()):
                        return False
                    me.wait(0.1 if until is not None or gone is not None else None)
                self._free -= 1
                self._running[model] = self._running.get(model, 0) + 1
                taken = True
                return True
            finally:
                if line[0] is me:
                    line.popleft()
                else:  # gave up behind others
                    line.remove(me)
                if not line:
                    del self._waiting[model]
                    if not taken and model not in self._running:  # gave up, and nothing of it runs: idle again
                        del self._used[model]
                self._next()  # a place may still be free: the next in line

    @property
    def shared(self) -> bool:
        """More than one model is active: a `take` may wait."""
        with self._lock:
            return len(self._active()) > 1

    def give(self, model: str, cost: float) -> None:
        with self._lock:
            self._free += 1
            self._used[model] += cost
            self._running[model] -= 1
            if not self._running[model]:
                del self._running[model]
                if model not in self._waiting:  # idle: what it used is forgotten (take sets it again)
                    del self._used[model]
            if self._waiting:
                self._next()

    def _active(self) -> set[str]:
        return {*self._waiting, *self._running}

    def _only(self, model: str) -> bool:
        """No other model waits or runs (asked at every take: no set is built)."""
        return all(m == model for m in self._waiting) and all(m == model for m in self._running)

    def _next(self) -> None:
        """Wake one thread of the waiting model served least (the lock held): it takes the place, or waits again."""
        if self._waiting:
            self._waiting[min(self._waiting, key=self._used.__getitem__)][0].notify()
