"""The HTTP API: its routes, each a method, a path and its work, every call served by HttpCalls.serve
(serving/protocols/http/exchange.py). The paths, bodies and answers are described in the OpenAPI document the server
serves at /openapi.json (serving/protocols/http/openapi.py).

Open (no token): GET /v2/health/live, /v2/health/ready, /openapi.json, and the try-it page at / when it is on.
With the token: the model's metadata (GET /v1/metadata, /v2, /v2/models/{name}[/versions/{v}][/ready]) and the
model calls (POST /v1/classify, /v2/models/{name}[/versions/{v}]/infer), which alone take a model slot.

Starlette's router with plain ASGI endpoints, on uvicorn with httptools (serving/protocols/http/server.py): FastAPI
on the same stack served fewer texts/s (docs/BENCHMARKS.md, "HTTP stacks") and reads a body before the checks that
must refuse a call without reading it.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import Any

import orjson
from google.protobuf import json_format
from starlette.routing import Route, Router

from serving.errors import InvalidInput
from serving.model.core import ServingCore
from serving.protocols import kserve_v2
from serving.protocols.http import kserve_rest, openapi, page
from serving.protocols.http.errors import HttpError
from serving.protocols.http.exchange import Answer, HttpCall, HttpCalls, Receive, Scope, Send
from serving.protocols.sentiment_v1 import metadata

CLASSIFY_FIELDS = {"texts"}


def _json(obj: Any, status: int = 200) -> Answer:
    return Answer(orjson.dumps(obj), status)


class Endpoint:
    """One path: its methods' work; another method gets 405 (UNIMPLEMENTED) with an Allow header."""

    def __init__(self, calls: HttpCalls, path: str, methods: dict[str, Callable[[HttpCall], Awaitable[Answer]]], *,
                 model: bool = False, open: bool = False) -> None:
        self.calls, self.path, self.methods, self.model, self.open = calls, path, methods, model, open
        if "GET" in methods:
            methods.setdefault("HEAD", methods["GET"])

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        method = scope["method"]
        work = self.methods.get(method)
        if work is None:
            await self.calls.serve(scope, receive, send, f"{method} {self.path}", self._not_allowed, model=False,
                                   open=True)
            return
        await self.calls.serve(scope, receive, send, f"{method} {self.path}", work, model=self.model,
                               open=self.open)

    async def _not_allowed(self, call: HttpCall) -> Answer:
        allowed = ", ".join(m for m in self.methods if m != "HEAD")
        raise HttpError(405, "UNIMPLEMENTED", f"{call.scope['method']} is not served at {self.path}; use {allowed}",
                        ((b"allow", ", ".join(self.methods).encode()),))


def router(core: ServingCore, calls: HttpCalls, *, page_on: bool) -> Router:
    """Every route of the API on `core`."""
    cfg = core.cfg

    async def live(call: HttpCall) -> Answer:
        return _json({"live": True})

    async def ready(call: HttpCall) -> Answer:
        return _json({"ready": core.reports_ready}, 200 if core.reports_ready else 503)

    async def server_metadata(call: HttpCall) -> Answer:
        return _json({"name": kserve_v2.SERVER_NAME, "version": kserve_v2.server_version(),
                      "extensions": ["binary_tensor_data"]})

    async def model_metadata(call: HttpCall) -> Answer:
        kserve_v2.check_model(core, call.params["name"], call.params.get("version", ""))
        return _json(kserve_v2.model_metadata(core))

    async def model_ready(call: HttpCall) -> Answer:
        kserve_v2.check_model(core, call.params["name"], call.params.get("version", ""))
        return _json({"name": cfg.model_name, "ready": core.reports_ready}, 200 if core.reports_ready else 503)

    async def infer(call: HttpCall) -> Answer:
        return await kserve_rest.infer(core, call)

    async def classify(call: HttpCall) -> Answer:
        doc = await call.json()
        if not isinstance(doc, dict) or not isinstance(doc.get("texts"), list):
            raise InvalidInput('body: expected {"texts": ["a review", ...]}')
        unknown = sorted(set(doc) - CLASSIFY_FIELDS)
        if unknown:
            raise InvalidInput(f"body: unknown field {unknown[0]!r}; the request has only \"texts\"")
        texts = doc["texts"]
        bad = next((i for i, t in enumerate(texts) if not isinstance(t, str)), None)
        if bad is not None:
            raise InvalidInput(f"texts[{bad}]: expected a string, got {type(texts[bad]).__name__}")
        preds = await call.predictions(core, texts)
        return _json({"results": [{"label": p.label, "label_index": p.label_index,
                                   "probabilities": p.probabilities.tolist(), "token_count": p.token_count,
                                   "truncated": p.truncated} for p in preds]})

    async def v1_metadata(call: HttpCall) -> Answer:
        return _json(json_format.MessageToDict(metadata(core), preserving_proto_field_name=True,
                                               always_print_fields_with_no_presence=True))

    document = orjson.dumps(openapi.document(core))

    async def openapi_json(call: HttpCall) -> Answer:
        return Answer(document)

    async def try_it(call: HttpCall) -> Answer:
        return Answer(page.HTML, content_type=b"text/html; charset=utf-8", headers=page.HEADERS)

    def at(path: str, methods: dict, **kind: bool) -> Route:
        return Route(path, Endpoint(calls, path, methods, **kind))

    routes = [
        at("/v2/health/live", {"GET": live}, open=True),
        at("/v2/health/ready", {"GET": ready}, open=True),
        at("/v2", {"GET": server_metadata}),
        at("/v2/models/{name}", {"GET": model_metadata}),
        at("/v2/models/{name}/versions/{version}", {"GET": model_metadata}),
        at("/v2/models/{name}/ready", {"GET": model_ready}),
        at("/v2/models/{name}/versions/{version}/ready", {"GET": model_ready}),
        at("/v2/models/{name}/infer", {"POST": infer}, model=True),
        at("/v2/models/{name}/versions/{version}/infer", {"POST": infer}, model=True),
        at("/v1/classify", {"POST": classify}, model=True),
        at("/v1/metadata", {"GET": v1_metadata}),
        at("/openapi.json", {"GET": openapi_json}, open=True),
    ]
    if page_on:
        routes.append(at("/", {"GET": try_it}, open=True))

    async def not_found(scope: Scope, receive: Receive, send: Send) -> None:
        async def missing(call: HttpCall) -> Answer:
            raise HttpError(404, "NOT_FOUND", f"no such path: {scope['path'][:200]!r}; the API is described at "
                            "/openapi.json")
        # One label for every unknown path: a scanner's paths must not each make a series of their own.
        await calls.serve(scope, receive, send, "unknown path", missing, model=False, open=True)

    return Router(routes, redirect_slashes=False, default=not_found)

