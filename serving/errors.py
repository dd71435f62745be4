"""Named errors of the serving package and the gRPC status code each one maps to.

Everything below raises these; each protocol maps them to its codes in one place (gRPC: `Gate` in
serving/protocols/grpc/interceptor.py; HTTP: serving/protocols/http/errors.py gives each code its status). The code is
a name of `grpc.StatusCode` so that this module (imported by the predictor) needs no gRPC. Any other exception is a
bug and becomes INTERNAL with a generic message (details in the log).
"""

from __future__ import annotations

# A bundle the server cannot load (raised by contract/bundle.py, the verifier the exporter shares).
from contract.errors import BundleError as BundleError


class ServingError(Exception):
    """Base class: `code` is the gRPC status code name the client sees; the message is sent as details."""

    code = "INTERNAL"


class InvalidInput(ServingError):
    """The request is malformed or breaks a limit; the message names the field, the value and the limit."""

    code = "INVALID_ARGUMENT"


class ModelNotFound(ServingError):
    """A KServe request names a model or version this server does not hold."""

    code = "NOT_FOUND"


class Unauthenticated(ServingError):
    """Auth is on and the request's bearer token is missing or wrong."""

    code = "UNAUTHENTICATED"


class Overloaded(ServingError):
    """The batching queue is full: refused at once rather than queued without limit."""

    code = "RESOURCE_EXHAUSTED"


class NotReady(ServingError):
    """The server is starting or draining; retry elsewhere or later."""

    code = "UNAVAILABLE"


class Retired(NotReady):
    """The model version a call picked was unloaded (a newer one took over) before the call reached it: a call that
    named no version is run again on the newest one (serving/model/models.py), one that named this version gets
    UNAVAILABLE."""


class PermissionDenied(ServingError):
    """A repository call (load, unload) on a server that keeps that API closed: no token is configured and
    repository_api_open is off."""

    code = "PERMISSION_DENIED"


class LoadFailed(ServingError):
    """A model version could not be loaded: its bundle failed verification or its warm-up call; the old version keeps
    serving. The message names the version and the reason."""

    code = "FAILED_PRECONDITION"


class DeadlineExpired(ServingError):
    """The request's deadline passed before its texts were computed (they were dropped, not run)."""

    code = "DEADLINE_EXCEEDED"


class Cancelled(ServingError):
    """The client cancelled the request before its texts were computed (they were dropped, not run)."""

    code = "CANCELLED"


class BodyTimeout(ServingError):
    """A request message did not arrive within body_timeout_s of its call's start: the call was cancelled (its
    client sees CANCELLED)."""

    code = "CANCELLED"


class ServerConfigError(ValueError):
    """A server option is invalid; the message names the option, the value and the allowed range."""
