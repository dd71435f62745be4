"""Dynamic batching: texts of concurrent requests share onnxruntime runs.

Callers `submit` a request's encoded rows and get a Future of its (n, C) probabilities, rows in request order.
`workers` threads (each one onnxruntime run at a time) form batches:
  - a batch holds at most `max_batch_size` texts and `max_batch_tokens` padded ids (texts x longest text);
  - it always includes the oldest waiting text (no starvation), then the texts whose lengths are closest to it,
    in arrival order among equals, as long as padding stays under `max_padding` of the real ids: padding
    costs compute (attention grows with the square of the padded length);
  - before forming one, the worker waits for company at most `max_queue_delay_s` after the oldest text
    arrived, and stops waiting as soon as as many texts wait as the previous batch held: under steady load the
    callers of the last batch are back, while a lone caller (previous batch of 1) pays no delay at all;
  - a lone caller that blocks on its answer (`inline`) and finds nothing queued and a slot free computes its
    batch in its own thread: no hand-over to a worker and back, two thread wake-ups on its path (the workers and
    such callers together never run more than `workers` batches at once);
  - a graph that runs one text per run (`per_row`: int8 on the CPU) gains nothing from company: its workers never
    wait for it, a blocking caller computes its batch itself whenever a slot is free, and each request of a batch
    is answered as soon as its own rows are, not once the whole batch has run;
  - texts whose request expired or was cancelled are dropped before compute (the caller gets DEADLINE_EXCEEDED
    or CANCELLED);
  - the queue is bounded (`max_queue` texts): past it, `submit` raises Overloaded at once.
With `enabled=False` (the benchmark's baseline) each request runs alone in its caller's thread.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from serving.errors import Cancelled, DeadlineExpired, NotReady, Overloaded
from serving.model.turns import Turns
from serving.telemetry import tracing
from serving.telemetry.prometheus import Metrics, ModelMetrics

Infer = Callable[[Sequence[np.ndarray]], np.ndarray]  # rows of ids -> (n, C) probabilities, one run


@dataclass(eq=False)
class _Request:
    rows: Sequence[np.ndarray]  # each (t,) int64
    deadline: float | None  # time.monotonic() seconds, None = no deadline
    cancelled: Callable[[], bool] | None  # True once the client has gone away
    enqueued: float  # time.monotonic() at submit
    trace: Any = None  # the span context of its call when traced and sampled (links hold contexts, never calls)
    queued_ns: int = 0  # time.time_ns() at submit, when traced: its queue wait's span starts there
    future: Future = field(default_factory=Future)
    out: np.ndarray | None = None  # (n, C), allocated at the first computed row
    remaining: int = 0  # rows not computed yet

    def dead(self, now: float) -> Exception | None:
        if self.deadline is not None and now >= self.deadline:
            return DeadlineExpired(f"deadline passed after {now - self.enqueued:.3f} s in the queue; "
                                   "the texts were not computed")
        if self.cancelled is not None and self.cancelled():
            return Cancelled("request cancelled by the client; the texts were not computed")
        return None


@dataclass(eq=False)
class _Row:
    request: _Request
    index: int  # position in the request
    length: int  # token ids


class Batcher:
    """Merges concurrent requests into onnxruntime runs. Thread-safe."""

    def __init__(
        self,
        infer: Infer,
        *,
        max_batch_size: int = 64,
        max_batch_tokens: int = 4096,
        max_queue_delay_s: float = 0.002,
        max_queue: int = 512,
        max_padding: float = 0.1,
        workers: int = 1,
        enabled: bool = True,
        metrics: ModelMetrics | None = None,
        span_attributes: Mapping[str, Any] | None = None,
        turns: Turns | None = None,
        model: str = "",
        per_row: bool = False,
    ) -> None:
        """span_attributes: what a batch's span says of the model besides the batch (graph, provider). turns: the
        process' runs, shared fairly with the other models' batchers (serving/model/turns.py); model: whose.
        per_row: `infer` runs each row alone (Predictor.per_row), so a batch only saves hand-overs."""
        self.infer = infer
        self.span_attributes = dict(span_attributes or {})
        self.turns, self.model = turns, model
        self.max_batch_size = max_batch_size
        self.max_batch_tokens = max_batch_tokens
        self.max_queue_delay_s = max_queue_delay_s
        self.max_queue = max_queue
        self.max_padding = max_padding
        self.enabled = enabled
        self.per_row = per_row
        self.metrics = metrics or Metrics().for_model("model", "1")
        self._lock = threading.RLock()  # `with` takes it, not the Condition: its __enter__ is Python
        self._cond = threading.Condition(self._lock)
        self._pending: list[_Row] = []  # arrival order
        self._in_flight = 0  # texts accepted and not answered (the bound when batching is off)
        self._last_batch = 1  # texts in the previous batch: how much company to wait for
        self._closing = False
        self._waiting = 0  # workers waiting for company before forming a batch
        self._slots = workers if enabled else 0  # batches computed at once, by workers or by callers (below)
        self._busy = 0  # batches being taken or computed now
        self._depth = self.metrics.live(self.metrics.queue_depth, lambda: len(self._pending))  # None: nothing to set
        self._workers = [threading.Thread(target=self._loop, name=f"batcher-{i}", daemon=True)
                         for i in range(workers if enabled else 0)]
        for w in self._workers:
            w.start()

    # ------------------------------------------------------------------------------------------ callers

    def submit(
        self,
        rows: Sequence[np.ndarray],
        deadline: float | None = None,
        cancelled: Callable[[], bool] | None = None,
        trace: Any = None,
        inline: bool = False,
    ) -> Future:
        """Queue one request's rows; the Future gives (n, C) probabilities or raises a ServingError. trace: the span
        context of its call (serving/telemetry/call_log.py, Call.link), for the spans of its queue wait and batch.
        inline: the caller blocks on the Future anyway (never an event loop): when nothing is queued and a slot is
        free, it computes its rows' batch in its own thread before returning (`_run_batch`)."""
        now = time.monotonic()
        req = _Request(rows, deadline, cancelled, now, trace, time.time_ns() if trace is not None else 0,
                       remaining=len(rows))
        idle = False
        with self._lock:
            if self._closing:
                raise NotReady("server is shutting down: no new requests")
            full = self.no_room(len(rows))  # under the lock: exact
            if full:
                raise Overloaded(full)
            if not self.enabled:
                self._in_flight += len(rows)
            else:
                idle = inline and self._busy < self._slots and (self.per_row or self._last_batch <= 1
                                                                and not self._pending and not self._waiting)
                self._pending.extend(_Row(req, i, int(r.shape[0])) for i, r in enumerate(rows))
                if self._depth is not None:
                    self._depth.set(len(self._pending))
                # A lone caller (the previous batch held one text: no company to wait for) that finds nothing
                # queued and a slot free computes its batch itself (below); under load the workers form batches.
                if idle:
                    self._busy += 1
                elif self._busy < self._slots or self._waiting:
                    # a worker may take them now, or one waits for company; with every slot busy the one that
                    # frees a slot takes them (`_run_batch`): a wake here would find no slot and sleep again
                    self._cond.notify()
        if idle:
            self._run_batch(worker=False)
        if not self.enabled:
            try:
                self._run_alone(req)
            finally:
                with self._lock:
                    self._in_flight -= len(rows)
        return req.future

    def _run_batch(self, worker: bool = True) -> None:
        """Take the next batch and compute it, holding the slot its caller took (a worker, or a lone caller that
        blocks on its answer: `submit(inline=True)`, no hand-over to a worker and back); the slot is given back
        after; a caller's thread wakes a worker for any texts left queued (a worker goes back for them itself)."""
        if self.turns is not None:  # the cores, shared with the other models' batchers (serving/model/turns.py)
            self.turns.take(self.model)
        start = time.monotonic()
        back = False  # a worker returns to its loop for the texts left queued
        try:
            with self._lock:
                batch = self._take(time.monotonic())
                if self._depth is not None:
                    self._depth.set(len(self._pending))
            if batch:
                self._compute(batch)
            back = worker
        finally:
            if self.turns is not None:
                self.turns.give(self.model, time.monotonic() - start)
            with self._lock:
                self._busy -= 1
                if self._pending and not back:  # a caller's thread, or a worker that a bug ends: wake another
                    self._cond.notify()

    def _run_alone(self, req: _Request) -> None:
        error = req.dead(time.monotonic())
        if error is not None:
            self.metrics.dropped.labels(type(error).__name__).inc(len(req.rows))
            req.future.set_exception(error)
            return
        if self.turns is not None:
            self.turns.take(self.model)
        start = time.monotonic()
        try:
            self._compute([_Row(req, i, int(r.shape[0])) for i, r in enumerate(req.rows)])
        finally:
            if self.turns is not None:
                self.turns.give(self.model, time.monotonic() - start)

    def no_room_for_any(self, max_texts: int) -> str | None:
        """Why a call of up to `max_texts` texts might not fit now, or None: admission's question, asked before the
        call's body, and so its size, is known (read without the lock: an estimate; `submit` decides). A call is
        admitted only while the largest one would fit; refused there it costs the server no thread, no body read
        and no tokenizing, where a call admitted on room for one text and refused once its texts were counted was
        refused after all three (bench/protocol_attacks.py overload-rate, docs/RELIABILITY.md). Worded as
        `submit`'s refusal, with the figures, so that a client can tell the two apart from other refusals
        (bench/soak.py does)."""
        waiting = len(self._pending) if self.enabled else self._in_flight
        if waiting + max_texts <= self.max_queue:
            return None
        return (f"queue full: {waiting} texts waiting, no room for a request of up to {max_texts} texts (max_queue "
                f"{self.max_queue}); retry later")

    def no_room(self, texts: int) -> str | None:
        """Why `texts` more texts would be refused now, or None. Without the lock an estimate (for a call that has
        not tokenized its texts yet); `submit` asks it under the lock and decides."""
        waiting = len(self._pending) if self.enabled else self._in_flight
        if waiting + texts <= self.max_queue:
            return None
        return f"queue full: {waiting} texts waiting + {texts} new > max_queue {self.max_queue}; retry later"

    @property
    def queued(self) -> int:
        """Texts waiting for a batch."""
        with self._lock:
            return len(self._pending)

    @property
    def waiting_for_company(self) -> int:
        """Workers that have texts to run and wait (up to max_queue_delay_s) for more to join them."""
        with self._lock:
            return self._waiting

    @property
    def closing(self) -> bool:
        """close() has begun: new requests are refused, queued ones still run."""
        with self._lock:
            return self._closing

    def close(self, timeout: float | None = None) -> None:
        """Refuse new requests, finish the queued ones, stop the worker."""
        with self._lock:
            self._closing = True
            self._cond.notify_all()
        end = None if timeout is None else time.monotonic() + timeout
        for w in self._workers:
            w.join(None if end is None else max(0.0, end - time.monotonic()))

    # ------------------------------------------------------------------------------------------ worker

    def _loop(self) -> None:
        while True:
            with self._lock:
                while (not self._pending or self._busy >= self._slots) and not self._closing:
                    self._cond.wait()
                if not self._pending:  # closing and drained
                    return
                self._busy += 1
                if not self.per_row:
                    self._wait_for_company()
            self._run_batch()

    def _wait_for_company(self) -> None:
        """Called with the lock held and a non-empty queue."""
        expected = min(self._last_batch, self.max_batch_size)
        until = self._pending[0].request.enqueued + self.max_queue_delay_s
        self._waiting += 1
        try:
            while not self._closing and len(self._pending) < expected:
                if sum(r.length for r in self._pending) >= self.max_batch_tokens:
                    return
                left = until - time.monotonic()
                if left <= 0:
                    return
                self._cond.wait(left)
        finally:
            self._waiting -= 1

    def _take(self, now: float) -> list[_Row]:
        """Remove and return the next batch (lock held). Expired or cancelled requests are failed here."""
        dead: dict[_Request, Exception | None] = {}
        rows_of: dict[_Request, int] = {}
        for row in self._pending:
            if row.request not in dead:
                dead[row.request] = row.request.dead(now)
            rows_of[row.request] = rows_of.get(row.request, 0) + 1
        for req, error in dead.items():
            if error is not None:
                self.metrics.dropped.labels(type(error).__name__).inc(rows_of[req])
                if not req.future.done():
                    req.future.set_exception(error)
        live = [r for r in self._pending if dead[r.request] is None]
        if not live:
            self._pending = []
            return []
        anchor = live[0].length
        # Closest lengths to the oldest text first; sorted() is stable, so arrival order breaks ties.
        batch: list[_Row] = []
        longest = real = 0
        for row in sorted(live, key=lambda r: abs(r.length - anchor)):
            width = max(longest, row.length)
            padded = (len(batch) + 1) * width
            if padded > self.max_batch_tokens or (batch and padded > (1 + self.max_padding) * (real + row.length)):
                continue
            batch.append(row)
            longest, real = width, real + row.length
            if len(batch) == self.max_batch_size:
                break
        taken = set(map(id, batch))
        self._pending = [r for r in live if id(r) not in taken]
        self._last_batch = len(batch)
        return batch

    def _compute(self, batch: list[_Row]) -> None:
        start = time.monotonic()
        traced: dict[int, _Request] = {}  # the traced requests served, oldest first (none when tracing is off)
        for row in batch:
            self.metrics.queue_seconds.observe(start - row.request.enqueued)
            if row.request.trace is not None:
                traced[id(row.request)] = row.request
        start_ns = time.time_ns() if traced else 0
        try:
            if self.per_row:  # one run a row anyway: each request is answered once its rows are, not at the batch's end
                for row in batch:
                    self._deliver([row], self.infer([row.request.rows[row.index]]))
            else:
                self._deliver(batch, self.infer([row.request.rows[row.index] for row in batch]))
        except Exception as e:  # a failed run fails its batch's requests not answered yet, and only those
            if traced:
                self._trace(batch, traced, start_ns, time.time_ns(), e)
            with self._lock:
                for req in {id(r.request): r.request for r in batch}.values():
                    if not req.future.done():
                        req.future.set_exception(e)
            return
        end_ns = time.time_ns() if traced else 0
        m = self.metrics
        m.inference_seconds.observe(time.monotonic() - start)
        m.batch_size.observe(len(batch))
        m.batch_tokens.observe(len(batch) * max(r.length for r in batch))
        m.texts.inc(len(batch))
        if m.worker_texts is not None:
            m.worker_texts.inc(len(batch))
        if traced:
            self._trace(batch, traced, start_ns, end_ns, None)

    def _deliver(self, rows: list[_Row], probs: np.ndarray) -> None:
        """probs (len(rows), C) into their requests; a request whose last row this is gets its answer."""
        with self._lock:  # several workers may finish rows of one request
            for row, p in zip(rows, probs, strict=True):
                req = row.request
                if req.future.done():  # failed earlier (expired between two of its batches)
                    continue
                if req.out is None:
                    req.out = np.empty((len(req.rows), probs.shape[1]), dtype=probs.dtype)
                req.out[row.index] = p
                req.remaining -= 1
                if req.remaining == 0:
                    req.future.set_result(req.out)

    def _trace(self, batch: list[_Row], traced: dict[int, _Request], start_ns: int, end_ns: int,
               error: Exception | None) -> None:
        """The run's span, linked to the traced calls it served, and their queue waits (serving/telemetry); after
        the answers are handed over, so that no caller waits for it."""
        t = tracing.active()
        if t is None:
            return
        served = sorted(traced.values(), key=lambda r: r.queued_ns)
        lengths = [r.length for r in batch]
        attributes = {**self.span_attributes, "sentiment.batch.texts": len(batch),
                      "sentiment.batch.calls": len({id(r.request) for r in batch}),
                      "sentiment.batch.tokens": sum(lengths),
                      "sentiment.batch.padded_tokens": len(batch) * max(lengths)}
        t.batch([(r.trace, r.queued_ns) for r in served], start_ns, end_ns, attributes, error)
