"""SIGTERM and SIGINT as something a server's main loop can wait on.

Python runs a signal handler in the main thread, between two bytecodes, possibly while that thread holds a lock.
A handler that takes a lock can then wait forever for its own thread: `threading.Event.set()` takes the lock that
`Event.wait()` holds for a moment on every turn of a polling loop. A worker whose SIGTERM landed in that moment
never drained and was killed once its grace was over (in a full CI run; tests/test_serving_stop_signal.py makes it
happen at once). This handler takes no lock: it notes the signal. The byte Python's own C-level handler writes to a
pipe (signal.set_wakeup_fd) ends `wait`'s select at once, whichever thread the kernel gave the signal to.
"""
from __future__ import annotations

import os
import select
import signal
from types import FrameType

SIGNALS = (signal.SIGTERM, signal.SIGINT)


class StopSignal:
    """`with StopSignal() as stop:` handles SIGTERM and SIGINT (in the main thread) until the block ends;
    `stop.signum` is the last one received, 0 before any."""

    def __init__(self) -> None:
        self.signum = 0
        self._read, self._write = -1, -1
        self._previous: dict[int, object] = {}

    def __enter__(self) -> StopSignal:
        self._read, self._write = os.pipe()
        os.set_blocking(self._read, False)
        os.set_blocking(self._write, False)  # set_wakeup_fd's demand: a full pipe must not block a handler
        self._previous_fd = signal.set_wakeup_fd(self._write)
        self._previous = {sig: signal.signal(sig, self._handle) for sig in SIGNALS}
        return self

    def __exit__(self, *exc: object) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)  # type: ignore[arg-type]
        signal.set_wakeup_fd(self._previous_fd)
        os.close(self._read)
        os.close(self._write)

    def wait(self, timeout: float) -> bool:
        """True once a signal came; otherwise waits up to `timeout` seconds for one."""
        if not self.signum:  # a signal from here on writes its byte, and select returns at once
            if select.select([self._read], [], [], timeout)[0]:
                try:
                    os.read(self._read, 512)  # other signals' bytes too (SIGCHLD...): drained, not counted
                except BlockingIOError:
                    pass
        return bool(self.signum)

    def _handle(self, signum: int, frame: FrameType | None) -> None:
        self.signum = signum
