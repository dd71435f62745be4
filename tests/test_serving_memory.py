"""Memory a call leaves behind (serving/process/memory.py): a refused call frees its texts when it ends, without
waiting for Python's cyclic collector, and the reclaimer gives memory back once a burst is over, never during it.

The whole chain against a real server subprocess (RSS back within 5% after 100 unread answers, twice) is
tests/test_reliability_attacks.py::test_unread_answers_are_bounded_and_memory_returns_after_the_client_leaves.
"""

from __future__ import annotations

import gc
import threading
import weakref
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest

from serving.config import ServerConfig
from serving.errors import Cancelled
from serving.model.batcher import Batcher
from serving.model.core import ServingCore
from serving.model.predictor import Predictor
from serving.process.memory import Reclaimer, fix_mmap_threshold


@contextmanager
def _no_cycle_collector() -> Iterator[None]:
    """Only reference counts free objects inside (what an idle server gets: the collector runs on allocations)."""
    gc.collect()
    gc.disable()
    try:
        yield
    finally:
        gc.enable()


class _Texts(list):
    """A list of texts that a weak reference can watch."""


def test_a_cancelled_call_frees_its_texts_when_it_ends(tiny_bundle: Path) -> None:
    """The batcher fails a cancelled call's future with Cancelled; the caller re-raises it. The exception's traceback
    holds the caller's frame, which held the future, which holds the exception: before the fix that cycle kept every
    refused call's texts, tokens and request alive until the cyclic collector ran (31 calls of 512 texts, 13 MB, in
    the attack test's server, for as long as it stayed idle)."""
    predictor = Predictor(tiny_bundle, device="cpu", intra_op_threads=1)
    batcher = Batcher(predictor.infer)
    core = ServingCore(predictor, batcher, ServerConfig())
    core.ready = True
    try:
        with _no_cycle_collector():
            texts = _Texts(["Un livre qui attend son tour."] * 8)
            watch = weakref.ref(texts)
            try:
                core.classify(texts, cancelled=lambda: True)
            except Cancelled:
                pass
            else:
                raise AssertionError("a cancelled call was answered")
            del texts
            assert watch() is None, "the texts of a cancelled call outlived it (a reference cycle holds them)"
    finally:
        batcher.close()


class _Node:
    """An object in a reference cycle with itself."""

    def __init__(self) -> None:
        self.me = self


def test_the_reclaimer_runs_once_after_a_burst_and_never_during_it() -> None:
    done = threading.Semaphore(0)
    reclaimer = Reclaimer(settle_s=0.05, every_s=0.0, on_reclaim=lambda seconds: done.release())
    try:
        with _no_cycle_collector():
            garbage = weakref.ref(_Node())  # unreachable at once, freed only by a collection
            assert garbage() is not None
            reclaimer.enter()
            reclaimer.enter()
            reclaimer.leave()
            assert not done.acquire(timeout=0.5), "reclaimed while a call was still in progress"
            reclaimer.leave()
            assert done.acquire(timeout=20), "no reclaim once the burst was over"
            assert garbage() is None  # the collection ran
            assert not done.acquire(timeout=0.5), "reclaimed again with no work in between"
            reclaimer.enter()
            reclaimer.leave()
            assert done.acquire(timeout=20)
            assert reclaimer.reclaims == 2
    finally:
        reclaimer.close()


def test_the_mmap_threshold_is_set_unless_the_user_chose(monkeypatch: pytest.MonkeyPatch) -> None:
    """glibc's mallopt answers 1 when it took the value; 0 keeps glibc's own; the environment variable wins;
    the config refuses what mallopt would not take (over 32 MiB) with one line naming the field."""
    import ctypes

    from serving.errors import ServerConfigError

    monkeypatch.delenv("MALLOC_MMAP_THRESHOLD_", raising=False)
    glibc = hasattr(ctypes.CDLL(None), "mallopt")
    assert fix_mmap_threshold(ServerConfig().malloc_mmap_threshold_bytes) is glibc
    assert fix_mmap_threshold(0) is False
    monkeypatch.setenv("MALLOC_MMAP_THRESHOLD_", "131072")
    assert fix_mmap_threshold(64 * 1024) is False
    with pytest.raises(ServerConfigError, match=r"malloc_mmap_threshold_bytes must be an integer in \[0, 33554432\]"):
        ServerConfig(malloc_mmap_threshold_bytes=64 * 1024 * 1024)
