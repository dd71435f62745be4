"""serving/process/stop_signal.py: SIGTERM ends a server's main loop whenever it lands, and never hangs it.

A worker once never drained after its SIGTERM (killed after its grace, in a full CI run): the handler was
`threading.Event.set()`, which waits for a lock its own main thread may hold at that moment. The stress test below
sends SIGTERM at random moments of a loop that spends most of its time inside `wait`; with the Event handler it hung
within its first three rounds, three times out of three.
"""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path

from serving.process.stop_signal import StopSignal

ROOT = Path(__file__).resolve().parents[1]

STRESS = textwrap.dedent("""
    import os, random, signal, threading, time
    from serving.process.stop_signal import StopSignal

    def later(pid):
        time.sleep(random.random() * 0.002)
        os.kill(pid, signal.SIGTERM)

    for _ in range(300):
        with StopSignal() as stop:
            sender = threading.Thread(target=later, args=(os.getpid(),))
            sender.start()
            while not stop.wait(0):  # wait(0): the loop is almost always inside wait, the worst case
                pass
            sender.join()
            assert stop.signum == signal.SIGTERM
    print("done")
""")


def test_sigterm_at_any_moment_of_the_loop_ends_it_and_never_hangs() -> None:
    proc = subprocess.Popen([sys.executable, "-c", STRESS], cwd=ROOT, stdout=subprocess.PIPE, text=True)
    try:
        out, _ = proc.communicate(timeout=60)
    except subprocess.TimeoutExpired:
        proc.kill()  # SIGTERM would land in the hung handler too
        proc.communicate()
        raise AssertionError("the loop hung on a SIGTERM") from None
    assert proc.returncode == 0 and out.strip() == "done"


def test_wait_returns_at_once_whichever_thread_the_signal_reaches() -> None:
    """The kernel may hand a process's signal to any thread: the wakeup byte ends select even when the main thread
    was not the one interrupted."""
    with StopSignal() as stop:
        assert not stop.wait(0.01) and stop.signum == 0
        threading.Timer(0.2, os.kill, (os.getpid(), signal.SIGTERM)).start()
        start = time.monotonic()
        while not stop.wait(30):
            pass
        assert time.monotonic() - start < 10
        assert stop.signum == signal.SIGTERM


def test_another_signal_wakes_wait_but_does_not_count_and_handlers_come_back() -> None:
    before = signal.getsignal(signal.SIGTERM), signal.getsignal(signal.SIGINT), signal.set_wakeup_fd(-1)
    signal.set_wakeup_fd(before[2])
    got: list[int] = []
    previous = signal.signal(signal.SIGUSR2, lambda signum, frame: got.append(signum))
    try:
        with StopSignal() as stop:
            os.kill(os.getpid(), signal.SIGUSR2)
            assert not stop.wait(0.2)  # woken by SIGUSR2's byte, which it drains
            assert got == [signal.SIGUSR2] and stop.signum == 0
            os.kill(os.getpid(), signal.SIGINT)
            assert stop.wait(5) and stop.signum == signal.SIGINT
    finally:
        signal.signal(signal.SIGUSR2, previous)
    assert (signal.getsignal(signal.SIGTERM), signal.getsignal(signal.SIGINT)) == before[:2]
    assert signal.set_wakeup_fd(-1) == before[2]
    signal.set_wakeup_fd(before[2])
