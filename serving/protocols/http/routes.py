"""The HTTP API: its routes, each a method, a path and its work, every call served by HttpCalls.serve
(serving/protocols/http/exchange.py). The paths, bodies and answers are described in the OpenAPI document the server
serves at /openapi.json (serving/protocols/http/openapi.py).

Open (no token): GET /v2/health/live, /v2/health/ready, /openapi.json, and the try-it page at / when it is on.
With the token: the models' metadata (GET /v1/metadata[?model_name=&model_version=], /v2,
/v2/models/{name}[/versions/{v}][/ready]), the repository (POST /v2/repository/index,
/v2/repository/models/{name}/load and /unload: serving/protocols/repository_api.py) and the model calls (POST
/v1/classify, /v2/models/{name}[/versions/{v}]/infer), which alone take a model slot.

Starlette's router with plain ASGI endpoints, on uvicorn with httptools (serving/protocols/http/server.py): FastAPI
on the same stack served fewer texts/s (docs/BENCHMARKS.md, "HTTP stacks") and reads a body before the checks that
must refuse a call without reading it.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from typing import Any
from urllib.parse import parse_qs

import orjson
from google.protobuf import json_format
from starlette.routing import Route, Router

from serving.errors import InvalidInput
from serving.model.models import Models
from serving.protocols import kserve_v2
from serving.protocols.http import kserve_rest, openapi, page
from serving.protocols.http.errors import HttpError
from serving.protocols.http.exchange import Answer, HttpCall, HttpCalls, Receive, Scope, Send, parse_json
from serving.protocols.repository_api import RepositoryApi
from serving.protocols.sentiment_v1 import metadata

CLASSIFY_FIELDS = {"texts", "model_name", "model_version"}


def _json(obj: Any, status: int = 200) -> Answer:
    return Answer(orjson.dumps(obj), status)


def _string(doc: dict, key: str) -> str:
    value = doc.get(key, "")
    if not isinstance(value, str):
        raise InvalidInput(f"{key}: expected a string, got {type(value).__name__}")
    return value


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


def router(models: Models, repository: RepositoryApi, calls: HttpCalls, *, page_on: bool) -> Router:
    """Every route of the API on `models`."""

    async def live(call: HttpCall) -> Answer:
        return _json({"live": True})

    async def ready(call: HttpCall) -> Answer:
        ok = models.reports_ready
        return _json({"ready": ok}, 200 if ok else 503)

    async def server_metadata(call: HttpCall) -> Answer:
        return _json({"name": kserve_v2.SERVER_NAME, "version": kserve_v2.server_version(),
                      "extensions": ["binary_tensor_data", "model_repository"]})

    async def model_metadata(call: HttpCall) -> Answer:
        core = kserve_v2.pick(models, call.params["name"], call.params.get("version", ""))
        return _json(kserve_v2.model_metadata(core, models.versions(core.name)))

    async def model_ready(call: HttpCall) -> Answer:
        name = call.params["name"]
        ok = kserve_v2.model_ready(models, name, call.params.get("version", ""))
        return _json({"name": name, "ready": ok}, 200 if ok else 503)

    async def infer(call: HttpCall) -> Answer:
        return await kserve_rest.infer(models, call)

    async def classify(call: HttpCall) -> Answer:
        doc = await call.json()
        if not isinstance(doc, dict) or not isinstance(doc.get("texts"), list):
            raise InvalidInput('body: expected {"texts": ["a review", ...]}')
        unknown = sorted(set(doc) - CLASSIFY_FIELDS)
        if unknown:
            raise InvalidInput(f"body: unknown field {unknown[0][:80]!r}; the request has \"texts\" and, optionally, "
                               "\"model_name\" and \"model_version\"")
        name, version = (_string(doc, key) for key in ("model_name", "model_version"))
        texts = doc["texts"]
        bad = next((i for i, t in enumerate(texts) if not isinstance(t, str)), None)
        if bad is not None:
            raise InvalidInput(f"texts[{bad}]: expected a string, got {type(texts[bad]).__name__}")
        core, preds = await call.predictions(models, name, version, texts)
        return _json({"model_name": core.name, "model_version": core.version,
                      "results": [{"label": p.label, "label_index": p.label_index,
                                   "probabilities": p.probabilities.tolist(), "token_count": p.token_count,
                                   "truncated": p.truncated} for p in preds]})

    async def v1_metadata(call: HttpCall) -> Answer:
        query = parse_qs(call.scope.get("query_string", b"").decode("latin-1"))
        core = models.get(*(query.get(key, [""])[0] for key in ("model_name", "model_version")))
        return _json(json_format.MessageToDict(metadata(core), preserving_proto_field_name=True,
                                               always_print_fields_with_no_presence=True))

    async def openapi_json(call: HttpCall) -> Answer:
        return Answer(orjson.dumps(openapi.document(models)))

    async def repository_index(call: HttpCall) -> Answer:
        body = await call.body() if call.header(b"content-length") not in (None, b"0") else b""
        doc = parse_json(body) if body else {}
        if not isinstance(doc, dict) or not isinstance(doc.get("ready", False), bool):
            raise InvalidInput('body: expected {"ready": true|false} or nothing')
        return _json(repository.index("", doc.get("ready", False)))

    def repository_change(work: Callable[[str], None]) -> Callable[[HttpCall], Awaitable[Answer]]:
        async def change(call: HttpCall) -> Answer:  # seconds: never on the loop, nor in the loop's own pool
            await asyncio.get_running_loop().run_in_executor(repository.pool, work, call.params["name"])
            return _json({})

        return change

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
        at("/v2/repository/index", {"POST": repository_index}),
        at("/v2/repository/models/{name}/load", {"POST": repository_change(repository.load)}),
        at("/v2/repository/models/{name}/unload", {"POST": repository_change(repository.unload)}),
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

