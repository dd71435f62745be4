"""Admission, written once for every protocol: the bearer token, the model slots, the answers' budget, room in the
batching queue and the time a call may take to send its body. No protocol here: the gRPC interceptor
(serving/protocols/grpc/interceptor.py) and the HTTP layer (serving/protocols/http/exchange.py) each read what they
need off a call, ask here, and say the answer in their own protocol (serving/errors.py has the codes, the HTTP layer
their statuses):

    if not admission.authorized(value_of_the_authorization_header):   # UNAUTHENTICATED, 401
        ...
    permit = admission.admit()                     # a model slot; Overloaded (RESOURCE_EXHAUSTED, 429) when
    try:                                           # every slot is taken, the answers' budget is spent or the
        ...the call's work...                      # batching queue has no room for a call of max_texts
    finally:
        permit.release()
    admission.hold_answer(size)                    # Overloaded past max_response_bytes_in_flight
    ...send it...; admission.answer_gone(size)

A permit is the call's model slot, as text-embeddings-inference's `Infer` hands out a semaphore permit that its HTTP and
gRPC servers both hold while a request is in progress: it is taken before the body is read (a refused call costs no
read and no thread) and given back when the work is done, before the answer leaves (the answer's bytes count against
the budget until it has left).

The token rule (RFC 6750 section 2.1, whose credentials are RFC 7235's `auth-scheme 1*SP token68`): the scheme
"Bearer" in any case, one space or more, then the token, compared whole and in constant time (hmac.compare_digest).
Health is open on both protocols; which calls are health is each protocol's to say.
"""

from __future__ import annotations

import hmac
from collections.abc import Callable

from serving.errors import BodyTimeout, Overloaded
from serving.limits.bounds import Busy, ResponseBudget, Slots, Watch, Watchdog
from serving.telemetry.prometheus import Metrics

_SCHEME = b"bearer"


class Permit:
    """One model call's slot, held from `Admission.admit` (or `take`) until `release`; releasing twice gives back one
    slot."""

    __slots__ = ("_slots",)

    def __init__(self, slots: Slots) -> None:
        self._slots: Slots | None = slots

    def release(self) -> None:
        slots, self._slots = self._slots, None
        if slots is not None:
            slots.release()


class Admission:
    """See the module docstring. One per server process, shared by its protocols."""

    def __init__(self, metrics: Metrics, *, auth_token: str | None, max_calls: int, body_timeout_s: float,
                 max_response_bytes: int, reclaimer: Busy | None = None,
                 queue_full: Callable[[], str | None] = lambda: None) -> None:
        """auth_token: None serves every call. max_calls: model calls in progress at once. queue_full: why the
        batcher might have no room for a call's texts (their number is known only once its body is read), or None.
        reclaimer: told of every model call in progress and every answer held (serving/process/memory.py)."""
        self._token = auth_token.encode() if auth_token else None
        self._usual = b"Bearer " + self._token if self._token is not None else None  # the form clients send
        self._auth_failures = metrics.auth_failures
        self._body_timeouts = metrics.body_timeouts
        self._slots = Slots(max_calls, "model", reclaimer)
        self._budget = ResponseBudget(max_response_bytes, metrics, reclaimer)
        self._queue_full = queue_full
        self.body_timeout_s = body_timeout_s
        self._watchdog = Watchdog(body_timeout_s, on_fire=metrics.body_timeouts.inc)

    def close(self) -> None:
        self._watchdog.close()

    @property
    def guarded(self) -> bool:
        """Calls need the token."""
        return self._token is not None

    @property
    def in_progress(self) -> int:
        """Model calls holding a permit now."""
        return self._slots.used

    @property
    def answer_bytes(self) -> int:
        """Bytes of answers built and not yet delivered."""
        return self._budget.used

    def authorized(self, credentials: str | bytes | None) -> bool:
        """Whether an Authorization value carries the token (always, when none is set); a failure is counted."""
        if self._token is None:
            return True
        if credentials is not None:
            given = credentials.encode() if isinstance(credentials, str) else credentials
            if hmac.compare_digest(given, self._usual):  # the usual form, in one comparison: the per-call path
                return True
            scheme, _, token = given.partition(b" ")
            if scheme.lower() == _SCHEME and hmac.compare_digest(token.lstrip(b" "), self._token):
                return True
        self._auth_failures.inc()
        return False

    def check(self) -> None:
        """Overloaded when a model call would be refused now: every slot taken, the answers in flight over their
        budget, or the batching queue without room for a call of max_texts. Read without a lock: the slot itself is
        taken later, and refuses on its own."""
        slots = self._slots
        if slots.used >= slots.limit:
            raise Overloaded(f"server busy: {slots.used} model calls in progress (limit {slots.limit}); retry later")
        self.check_answers()
        full = self._queue_full()
        if full:
            raise Overloaded(full)

    def admit(self) -> Permit:
        """`check`, then a model slot: the permit of a call about to read its body and do its work."""
        self.check()
        refusal = self._slots.acquire()
        if refusal is not None:
            raise refusal
        return Permit(self._slots)

    def take(self) -> Permit:
        """A model slot alone (a stream, checked when it began, takes its slot when it starts); Overloaded when none
        is free."""
        refusal = self._slots.acquire()
        if refusal is not None:
            raise refusal
        return Permit(self._slots)

    def check_answers(self) -> None:
        """Overloaded while the answers in flight fill their budget: checked again before a call computes anything."""
        budget = self._budget
        if budget.used >= budget.limit:  # ResponseBudget.spent, without a call: on every call's path
            raise Overloaded(f"{budget.used} bytes of answers wait for their clients (max_response_bytes_in_flight "
                             f"{budget.limit}); retry later")

    def hold_answer(self, size: int) -> None:
        """Count an answer of `size` bytes until `answer_gone(size)`; Overloaded when it would pass the budget."""
        self._budget.reserve(size)

    def answer_gone(self, size: int) -> None:
        """The answer has left (or its client has): its bytes no longer count. Cheap: a lock and a notify."""
        self._budget.release(size)

    def watch(self, cancel: Callable[[], None]) -> Watch:
        """For a reader that blocks a thread (gRPC's), before it waits for a message: the body watchdog calls (and
        counts) `cancel` when the message has not come within body_timeout_s. Give what it returns to `unwatch` once
        the wait is over: True then says that the watchdog fired."""
        return self._watchdog.arm(cancel)

    def unwatch(self, watch: Watch) -> bool:
        return self._watchdog.disarm(watch)

    def late_body(self) -> BodyTimeout:
        """For a reader on an event loop, which times its own read (a thread cannot cancel the read without racing
        it): the call's body did not come within body_timeout_s. Counted as the watchdog counts; the error to raise."""
        self._body_timeouts.inc()
        return BodyTimeout(f"request body not received within body_timeout_s={self.body_timeout_s}")
