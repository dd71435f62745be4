"""What the core needs to know of a gRPC call: its deadline and whether its client is still there."""

from __future__ import annotations

import time
from collections.abc import Callable

import grpc

_NO_DEADLINE = 1e6  # grpc reports "no deadline" as a huge time_remaining()


def deadline_of(context: grpc.ServicerContext) -> float | None:
    """The RPC's deadline as time.monotonic() seconds, or None."""
    left = context.time_remaining()
    return None if left is None or left > _NO_DEADLINE else time.monotonic() + left


def cancelled_of(context: grpc.ServicerContext) -> Callable[[], bool]:
    return lambda: not context.is_active()
