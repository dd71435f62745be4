"""Named errors of the serving package and the gRPC status code each one maps to.

Everything below raises these; each protocol maps them to its codes in one place (gRPC: `Gate` in
serving/protocols/grpc/interceptor.py; HTTP: serving/protocols/http/errors.py gives each code its status). The code is
a name of `grpc.StatusCode` so that this module (imported by the predictor) needs no gRPC. Any other exception is a
bug and becomes INTERNAL with a generic message (details in the log).
"""

from __future__ import annotations

from typing import Any

# A bundle the server cannot load (raised by contract/bundle.py, the verifier the exporter shares).
from contract.errors import BundleError as BundleError

# The names of grpc.StatusCode (tests/test_serving_errors.py holds them to grpc's own). A class whose code is not one
# of them is refused when it is defined, not when the gRPC layer would first fail to look it up in a live call.
STATUS_CODES = frozenset({
    "OK", "CANCELLED", "UNKNOWN", "INVALID_ARGUMENT", "DEADLINE_EXCEEDED", "NOT_FOUND", "ALREADY_EXISTS",
    "PERMISSION_DENIED", "RESOURCE_EXHAUSTED", "FAILED_PRECONDITION", "ABORTED", "OUT_OF_RANGE", "UNIMPLEMENTED",
    "INTERNAL", "UNAVAILABLE", "DATA_LOSS", "UNAUTHENTICATED",
})


class ServingError(Exception):
    """Base class: `code` is the gRPC status code name the client sees; the message is sent as details.

    A subclass names its code in its header, `class Overloaded(ServingError, code="RESOURCE_EXHAUSTED")`, or keeps
    its parent's."""

    code = "INTERNAL"

    def __init_subclass__(cls, code: str | None = None, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        if code is not None:
            cls.code = code
        if cls.code not in STATUS_CODES:
            raise ValueError(f"{cls.__name__}: code {cls.code!r} is not a grpc.StatusCode name")


class InvalidInput(ServingError, code="INVALID_ARGUMENT"):
    """The request is malformed or breaks a limit; the message names the field, the value and the limit."""


class ModelNotFound(ServingError, code="NOT_FOUND"):
    """A KServe request names a model or version this server does not hold."""


class Unauthenticated(ServingError, code="UNAUTHENTICATED"):
    """Auth is on and the request's bearer token is missing or wrong."""


class Overloaded(ServingError, code="RESOURCE_EXHAUSTED"):
    """The batching queue is full: refused at once rather than queued without limit."""


class NotReady(ServingError, code="UNAVAILABLE"):
    """The server is starting or draining; retry elsewhere or later."""


class Retired(NotReady):
    """The model version a call picked was unloaded (a newer one took over) before the call reached it: a call that
    named no version is run again on the newest one (serving/model/models.py), one that named this version gets
    UNAVAILABLE."""


class PermissionDenied(ServingError, code="PERMISSION_DENIED"):
    """A repository call (load, unload) on a server that keeps that API closed: no token is configured and
    repository_api_open is off."""


class LoadFailed(ServingError, code="FAILED_PRECONDITION"):
    """A model version could not be loaded: its bundle failed verification or its warm-up call; the old version keeps
    serving. The message names the version and the reason. logged: each version's reason is in the log already (the
    repository's poller does not log the whole again)."""

    def __init__(self, message: str, logged: bool = False) -> None:
        super().__init__(message)
        self.logged = logged


class DeadlineExpired(ServingError, code="DEADLINE_EXCEEDED"):
    """The request's deadline passed before its texts were computed (they were dropped, not run)."""


class Cancelled(ServingError, code="CANCELLED"):
    """The client cancelled the request before its texts were computed (they were dropped, not run)."""


class BodyTimeout(ServingError, code="CANCELLED"):
    """A request message did not arrive within body_timeout_s of its call's start: the call was cancelled (its
    client sees CANCELLED)."""


class ServerConfigError(ValueError):
    """A server option is invalid; the message names the option, the value and the allowed range."""
