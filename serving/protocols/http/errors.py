"""What an HTTP client gets for each refusal: the HTTP status that fits, and a JSON body `{"code": ..., "error": ...}`
whose code is the gRPC status name a gRPC client gets for the same refusal (stable, for programs) and whose `error`
is the message (the field KServe v2 REST and tritonclient read)."""

from __future__ import annotations

import orjson

from serving.errors import ServingError

STATUS = {  # gRPC code -> HTTP status
    "INVALID_ARGUMENT": 400,
    "UNAUTHENTICATED": 401,
    "NOT_FOUND": 404,
    "PERMISSION_DENIED": 403,  # the repository API while it is closed (no token and not repository_api_open)
    "FAILED_PRECONDITION": 400,  # a model version that failed its verification or warm-up (KServe answers 400)
    "CANCELLED": 408,  # the body did not arrive within body_timeout_s (a client that left gets no answer)
    "RESOURCE_EXHAUSTED": 429,  # overload: every model slot taken, the queue or the answers' budget full
    "INTERNAL": 500,
    "UNIMPLEMENTED": 405,  # a known path with another method
    "UNAVAILABLE": 503,  # starting or draining
    "DEADLINE_EXCEEDED": 504,
}


class HttpError(ServingError):
    """A refusal of the HTTP layer itself, with its own HTTP status: a body too large (413), a content type or
    encoding the server does not read (415), a path or method it does not serve."""

    def __init__(self, status: int, code: str, message: str, headers: tuple[tuple[bytes, bytes], ...] = ()) -> None:
        super().__init__(message)
        self.status, self.code, self.headers = status, code, headers


def status_of(error: ServingError) -> int:
    return error.status if isinstance(error, HttpError) else STATUS.get(error.code, 500)


def error_body(code: str, message: str) -> bytes:
    return orjson.dumps({"code": code, "error": message})
