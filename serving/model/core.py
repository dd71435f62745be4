"""The classification core every protocol shares: a call's texts checked against the limits, tokenized, queued in
the batcher and awaited within the call's deadline. No protocol here: errors are ServingError subclasses, which each
protocol turns into its own status codes."""

from __future__ import annotations

import re
import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import Future
from concurrent.futures import TimeoutError as FutureTimeout

from contract.tokens import Encoded
from serving.config import ServerConfig
from serving.errors import Cancelled, DeadlineExpired, InvalidInput, NotReady, Overloaded, Retired
from serving.model.batcher import Batcher
from serving.model.predictor import Prediction, Predictor
from serving.model.turns import Turns
from serving.telemetry import call_log

# A letter or a digit (str.isalnum: Unicode categories L and N). A text without one (NUL, control or format
# characters, punctuation, symbols, emoji) gives the model nothing it was trained to read: refused, not answered
# with a confident label.
_LETTER_OR_DIGIT = re.compile(r"[^\W_]")


class ServingCore:
    """Limits + tokenizer + batcher for one predictor: one version of one model (serving/model/models.py holds them)."""

    def __init__(self, predictor: Predictor, batcher: Batcher, cfg: ServerConfig, *, name: str | None = None,
                 version: str = "1", call_turns: Turns | None = None) -> None:
        """call_turns: the process' model calls, shared fairly with the other models' (serving/model/turns.py)."""
        self.predictor = predictor
        self.batcher = batcher
        self.cfg = cfg
        self.name = name or cfg.model_name  # what answers say answered
        self.version = version
        self.ready = False  # requests are accepted (False while starting and once draining refuses them)
        self.draining = False  # shutdown began: readiness reads false, requests may still be served
        self.retired = False  # unloaded: a newer version (or none) takes the calls
        self.max_active = 1 << 30  # calls accepted at once (its model's share when several are served)
        self._active = 0  # accepted classify calls not answered yet
        self._lock = threading.RLock()  # `with` takes it, not the Condition: its __enter__ is Python
        self._idle = threading.Condition(self._lock)
        self.call_turns = call_turns
        self._in_flight = batcher.metrics.live(batcher.metrics.calls_in_flight, lambda: self._active)  # None: unset

    @property
    def reports_ready(self) -> bool:
        """What health and KServe readiness say."""
        return self.ready and not self.draining

    def classify(
        self,
        texts: Sequence[str],
        deadline: float | None = None,
        cancelled: Callable[[], bool] | None = None,
    ) -> list[Prediction]:
        self._enter(len(texts), deadline, cancelled)
        try:
            self._check_alive(len(texts), deadline, cancelled)
            return self._classify(texts, deadline, cancelled)
        finally:
            self._leave()

    def submit(
        self,
        texts: Sequence[str],
        deadline: float | None = None,
        cancelled: Callable[[], bool] | None = None,
    ) -> Future:
        """`classify` without blocking, for an event loop: the texts are checked, tokenized and queued now (a
        ServingError is raised here), the Future gives their predictions or the batcher's ServingError. The call
        counts as accepted, and a drain waits for it, until the Future is done."""
        self._enter(len(texts), deadline, cancelled)
        try:
            self._check_alive(len(texts), deadline, cancelled)
            encoded = self._encode(texts)
            queued = self._queue(encoded, deadline, cancelled)
        except BaseException:
            self._leave()
            raise
        answer: Future = Future()

        def done(probs: Future) -> None:  # probs: (n, C)
            try:
                error = probs.exception()  # read, not raised: a raised one's traceback would hold this frame
                if error is None:
                    answer.set_result(self.predictor.predictions(encoded, probs.result()))
                else:
                    answer.set_exception(error)
            except Exception as e:  # a bug: its caller answers INTERNAL rather than wait forever
                answer.set_exception(e)
            finally:
                self._leave()

        queued.add_done_callback(done)
        return answer

    def _enter(self, texts: int, deadline: float | None, cancelled: Callable[[], bool] | None) -> None:
        """Wait for this model's turn when several are busy (`call_turns`); then count an accepted call, the check
        and the count together, so that refuse_and_wait sees every one."""
        turns = self.call_turns
        if turns is not None and not turns.take(self.name, deadline, cancelled):
            self._check_alive(texts, deadline, cancelled)  # the deadline passed or the client left: raises
            raise DeadlineExpired("deadline passed while the call waited for its model's turn")
        try:
            self._count()
        except BaseException:
            if turns is not None:
                turns.give(self.name, 1.0)
            raise

    def _count(self) -> None:
        with self._lock:
            if not self.ready:
                if self.retired:
                    raise Retired(f"model {self.name!r} version {self.version} was unloaded; retry (the newest "
                                  "version takes calls that name none)")
                raise NotReady("server is not ready (starting or draining); retry another replica or later")
            if self._active >= self.max_active:
                raise Overloaded(f"model {self.name!r} holds its share of the server's model calls "
                                 f"({self.max_active}, of max_concurrent_rpcs; the rest is kept for the other "
                                 "models); retry later")
            self._active += 1
            if self._in_flight is not None:
                self._in_flight.inc()

    def _check_alive(self, texts: int, deadline: float | None, cancelled: Callable[[], bool] | None) -> None:
        """A call whose deadline has passed or whose client has gone costs nothing more: dropped before its texts are
        checked, tokenized or queued (counted as the batcher counts the ones it drops)."""
        if deadline is not None and time.monotonic() >= deadline:
            kind: type[Exception] = DeadlineExpired
            why = "deadline passed before the call reached the model; nothing computed"
        elif cancelled is not None and cancelled():
            kind, why = Cancelled, "request cancelled by the client before it reached the model; nothing computed"
        else:
            return
        self.batcher.metrics.dropped.labels(kind.__name__).inc(texts)
        raise kind(why)  # made here, not held in a local: its traceback's frame would hold it, a cycle

    def _leave(self) -> None:
        with self._lock:
            self._active -= 1
            if self._in_flight is not None:
                self._in_flight.dec()
            if not self.ready:  # refuse_and_wait is waiting (it made ready false first, under this lock)
                self._idle.notify_all()
        if self.call_turns is not None:
            self.call_turns.give(self.name, 1.0)

    def close(self) -> None:
        """After a drain: its metric series go (serving/telemetry/prometheus.py), its graph is let go with it."""
        self.batcher.metrics.remove()

    def refuse_and_wait(self, timeout: float) -> bool:
        """Refuse new calls (UNAVAILABLE), wait up to `timeout` s for the accepted ones; True when all done."""
        with self._lock:
            self.ready = False
            return self._idle.wait_for(lambda: self._active == 0, timeout)

    def _classify(
        self,
        texts: Sequence[str],
        deadline: float | None,
        cancelled: Callable[[], bool] | None,
    ) -> list[Prediction]:
        encoded = self._encode(texts)
        future = self._queue(encoded, deadline, cancelled, inline=True)  # this thread waits for it anyway
        timeout = None if deadline is None else max(0.0, deadline - time.monotonic())
        try:
            probs = future.result(timeout)  # (n, C)
        except FutureTimeout:
            raise DeadlineExpired("deadline passed while the texts waited for a batch") from None
        finally:
            # A failed future holds its exception, whose traceback holds this frame, which holds the future: a
            # cycle that kept every refused or cancelled call's texts, tokens and request message alive until
            # Python's cyclic collector ran, which an idle server never does (31 calls of 512 texts, 13 MB).
            del future
        return self.predictor.predictions(encoded, probs)

    def _queue(self, encoded: list[Encoded], deadline: float | None, cancelled: Callable[[], bool] | None,
               inline: bool = False) -> Future:
        """The texts into the batcher, with their call's span context when traced (its queue wait and batch spans);
        inline: Batcher.submit's, for a caller that blocks on the answer."""
        call = call_log.current()
        return self.batcher.submit([e.ids for e in encoded], deadline, cancelled,
                                   trace=call.link() if call is not None and call.traced else None, inline=inline)

    def _encode(self, texts: Sequence[str]) -> list[Encoded]:
        """The texts checked against the limits, then tokenized; InvalidInput or Overloaded naming the problem."""
        cfg = self.cfg
        call = call_log.current()  # the protocol's record of this call: texts and tokens for its access line
        if call is not None:
            call.texts = len(texts)
            call.model, call.model_version = self.name, self.version
        if not texts:
            raise InvalidInput(f"texts: empty list; send 1 to max_texts={cfg.max_texts} texts")
        if len(texts) > cfg.max_texts:
            raise InvalidInput(f"texts: {len(texts)} texts > max_texts={cfg.max_texts}; split the request")
        for i, t in enumerate(texts):
            if not t.strip():
                raise InvalidInput(f"texts[{i}]: empty or blank text")
            if len(t) > cfg.max_chars:
                raise InvalidInput(f"texts[{i}]: {len(t)} characters > max_chars={cfg.max_chars}")
            if not _LETTER_OR_DIGIT.search(t):
                raise InvalidInput(f"texts[{i}]: no letter or digit (only punctuation, symbols, emoji, control or "
                                   "format characters): nothing to classify")
        full = self.batcher.no_room(len(texts))
        if full:  # refused before its texts are tokenized, work the batcher would throw away
            raise Overloaded(full)
        start = time.time_ns() if call is not None and call.traced else 0
        encoded = self.predictor.encode(texts)
        if call is not None:
            if start:
                call.timed("tokenize", start)  # a child span of a sampled call
            call.tokens = sum([e.token_count for e in encoded])
        for i, e in enumerate(encoded):
            if e.token_count <= 2:  # <sos> <eos> only: nothing to classify, answered as blank text is
                raise InvalidInput(f"texts[{i}]: no tokens: the text holds only characters the tokenizer drops "
                                   "(zero-width or format characters such as U+200B or a byte-order mark)")
        if cfg.long_text == "refuse":
            for i, e in enumerate(encoded):
                if e.truncated:
                    raise InvalidInput(f"texts[{i}]: more than max_tokens={self.predictor.max_len} tokens and "
                                       "the server refuses long texts (long_text=refuse)")
        return encoded
