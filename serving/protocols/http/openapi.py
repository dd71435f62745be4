"""The OpenAPI 3.0 document of the HTTP API, served at /openapi.json with this server's limits filled in
(max_texts, max_chars, max_message_bytes, the model's name and labels). tests/test_http_openapi.py checks it against
the server's routes and answers, and fuzzes the server from it (schemathesis)."""

from __future__ import annotations

from typing import Any

from serving.model.models import Models
from serving.protocols import kserve_v2
from serving.protocols.http.errors import STATUS
from serving.protocols.http.exchange import MAX_TIMEOUT_MS

_ERRORS = {  # status -> when
    400: "the request is malformed or breaks a limit (INVALID_ARGUMENT), or a model version failed its check "
         "(FAILED_PRECONDITION); the message names the field and the limit, or the version and the reason",
    401: "missing or wrong bearer token (UNAUTHENTICATED)",
    403: "the repository API is closed: no token is configured and repository_api_open is off (PERMISSION_DENIED)",
    404: "no such model or version (NOT_FOUND)",
    408: "the body did not arrive within body_timeout_s (CANCELLED)",
    413: "the body is over max_message_bytes (RESOURCE_EXHAUSTED)",
    415: "a content type or encoding the server does not read (INVALID_ARGUMENT)",
    429: "overloaded: every model slot taken, the queue or the answers' budget full; retry later (RESOURCE_EXHAUSTED)",
    500: "a bug; details in the server log only (INTERNAL)",
    503: "starting or draining; retry another replica (UNAVAILABLE)",
    504: "the request's deadline passed before its texts were computed (DEADLINE_EXCEEDED)",
}
_MODEL_CALL = (400, 401, 404, 408, 413, 415, 429, 500, 503, 504)
_METADATA = (401, 404, 500)


def _ref(name: str) -> dict:
    return {"$ref": f"#/components/schemas/{name}"}


def _json(schema: dict, description: str) -> dict:
    return {"description": description, "content": {"application/json": {"schema": schema}}}


def _responses(ok: dict, errors: tuple[int, ...]) -> dict:
    out = {"200": ok}
    for status in errors:
        out[str(status)] = {"$ref": f"#/components/responses/E{status}"}
    return out


def document(models: Models) -> dict[str, Any]:
    """The API as it is now: its models' names and labels (made again at each request: models come and go)."""
    cfg, cores = models.cfg, models.cores
    labels = list(dict.fromkeys(label for c in cores for label in c.predictor.label_names))
    C = max((len(c.predictor.label_names) for c in cores), default=len(labels))
    names = list(dict.fromkeys(c.name for c in cores))
    name_param = {"name": "name", "in": "path", "required": True,
                  "schema": {"type": "string", **({"enum": names} if names else {})}, "description": "the model's name"}
    version_param = {"name": "version", "in": "path", "required": True,
                     "schema": {"type": "string", "pattern": "^[0-9]{1,9}$"},
                     "description": "the model's version (its repository folder's number; 1 for a bundle given on "
                                    "the command line)"}
    timeout_header = {"name": "Request-Timeout-Ms", "in": "header", "required": False,
                      "schema": {"type": "number", "minimum": 0, "exclusiveMinimum": True,
                                 "maximum": MAX_TIMEOUT_MS},
                      "description": "the call's deadline, in milliseconds from its arrival: texts not computed "
                                     "by then are dropped and the call gets 504"}
    text = {"type": "string", "minLength": 1, "maxLength": cfg.max_chars}
    schemas = {
        "Error": {"type": "object", "required": ["code", "error"], "properties": {
            "code": {"type": "string", "enum": sorted(STATUS), "description": "the gRPC status name, stable"},
            "error": {"type": "string", "description": "what is wrong, naming the field and the limit"}}},
        "ClassifyRequest": {"type": "object", "required": ["texts"], "additionalProperties": False, "properties": {
            "texts": {"type": "array", "minItems": 1, "maxItems": cfg.max_texts, "items": text,
                      "description": "reviews; each needs a letter or a digit"},
            "model_name": {"type": "string", "description": "the model; leave it out on a server of one model"},
            "model_version": {"type": "string", "description": "its version; left out: its newest ready one"}}},
        "Classification": {"type": "object", "required": ["label", "label_index", "probabilities", "token_count",
                                                          "truncated"], "properties": {
            "label": {"type": "string", "enum": list(labels)},
            "label_index": {"type": "integer", "minimum": 0, "maximum": C - 1},
            "probabilities": {"type": "array", "minItems": C, "maxItems": C, "description": f"in the order {labels}",
                              "items": {"type": "number", "minimum": 0, "maximum": 1}},
            "token_count": {"type": "integer", "minimum": 3, "description": "ids the model read, <sos> and <eos> "
                                                                            "included"},
            "truncated": {"type": "boolean", "description": "the text was cut to the model's max_tokens"}}},
        "ClassifyResponse": {"type": "object", "required": ["results", "model_name", "model_version"], "properties": {
            "results": {"type": "array", "items": _ref("Classification")},
            "model_name": {"type": "string", "description": "the model that answered"},
            "model_version": {"type": "string", "description": "the version that answered"}}},
        "RepositoryIndex": {"type": "array", "items": {"type": "object", "required": ["name", "version", "state"],
                                                       "properties": {
            "name": {"type": "string"}, "version": {"type": "string"},
            "state": {"type": "string", "enum": ["READY", "LOADING", "UNLOADING", "UNAVAILABLE"]},
            "reason": {"type": "string", "description": "why a version is UNAVAILABLE"}}}},
        "Metadata": {"type": "object", "required": ["model_name", "labels", "max_tokens", "max_texts", "max_chars"],
                     "properties": {
                         "model_name": {"type": "string"}, "model_version": {"type": "string"},
                         "labels": {"type": "array", "items": {"type": "string"}},
                         "label_values": {"type": "array", "items": {"type": "string"}},
                         "max_tokens": {"type": "integer"}, "bundle_sha256": {"type": "string"},
                         "execution_provider": {"type": "string"}, "precision": {"type": "string"},
                         "max_texts": {"type": "integer"}, "max_chars": {"type": "integer"},
                         "long_text_policy": {"type": "string", "enum": ["LONG_TEXT_POLICY_TRUNCATE",
                                                                         "LONG_TEXT_POLICY_REFUSE"]}}},
        "InferInput": {"type": "object", "required": ["name", "datatype", "shape"], "properties": {
            "name": {"type": "string", "enum": [kserve_v2.INPUT]}, "datatype": {"type": "string", "enum": ["BYTES"]},
            "shape": {"type": "array", "minItems": 1, "maxItems": 2, "items": {"type": "integer", "minimum": 0}},
            "data": {"type": "array", "maxItems": cfg.max_texts, "items": {"oneOf": [
                text, {"type": "array", "minItems": 1, "maxItems": 1, "items": text}]}},
            "parameters": {"type": "object", "properties": {"binary_data_size": {"type": "integer", "minimum": 0}}}}},
        "InferRequest": {"type": "object", "required": ["inputs"], "properties": {
            "id": {"type": "string"},
            "parameters": {"type": "object", "properties": {
                "timeout": {"type": "number", "minimum": 0, "exclusiveMinimum": True, "maximum": 3.6e9,
                            "description": "deadline in microseconds (Triton's parameter)"},
                "binary_data_output": {"type": "boolean"}}},
            "inputs": {"type": "array", "minItems": 1, "maxItems": 1, "items": _ref("InferInput")},
            "outputs": {"type": "array", "maxItems": len(kserve_v2.OUTPUTS), "items": {
                "type": "object", "required": ["name"], "properties": {
                    "name": {"type": "string", "enum": list(kserve_v2.OUTPUTS)},
                    "parameters": {"type": "object", "properties": {"binary_data": {"type": "boolean"}}}}}}}},
        "InferResponse": {"type": "object", "required": ["model_name", "outputs"], "properties": {
            "model_name": {"type": "string"}, "model_version": {"type": "string"}, "id": {"type": "string"},
            "outputs": {"type": "array", "items": {"type": "object", "required": ["name", "datatype", "shape"],
                                                   "properties": {
                "name": {"type": "string", "enum": list(kserve_v2.OUTPUTS)},
                "datatype": {"type": "string", "enum": ["FP32", "BYTES", "INT32", "BOOL"]},
                "shape": {"type": "array", "items": {"type": "integer"}},
                "data": {"type": "array"}, "parameters": {"type": "object"}}}}}},
        "TensorMetadata": {"type": "object", "required": ["name", "datatype", "shape"], "properties": {
            "name": {"type": "string"}, "datatype": {"type": "string"},
            "shape": {"type": "array", "items": {"type": "integer"}}}},
        "ModelMetadata": {"type": "object", "required": ["name", "platform", "inputs", "outputs"], "properties": {
            "name": {"type": "string"}, "versions": {"type": "array", "items": {"type": "string"}},
            "platform": {"type": "string"},
            "inputs": {"type": "array", "items": _ref("TensorMetadata")},
            "outputs": {"type": "array", "items": _ref("TensorMetadata")}}},
        "ServerMetadata": {"type": "object", "required": ["name", "version", "extensions"], "properties": {
            "name": {"type": "string"}, "version": {"type": "string"},
            "extensions": {"type": "array", "items": {"type": "string"}}}},
        "Ready": {"type": "object", "required": ["ready"], "properties": {"name": {"type": "string"},
                                                                           "ready": {"type": "boolean"}}},
        "Live": {"type": "object", "required": ["live"], "properties": {"live": {"type": "boolean"}}},
    }
    responses = {f"E{s}": _json(_ref("Error"), why) for s, why in _ERRORS.items()}
    secured = [{"bearer": []}] if cfg.auth_token else []
    infer = {"post": {"summary": "classify texts (KServe v2 / Open Inference Protocol)", "security": secured,
                      "parameters": [timeout_header],
                      "requestBody": {"required": True, "content": {"application/json": {
                          "schema": _ref("InferRequest")}}},
                      "responses": _responses(_json(_ref("InferResponse"), "the outputs asked for"), _MODEL_CALL)}}
    model_meta = {"get": {"summary": "the model's inputs and outputs", "security": secured,
                          "responses": _responses(_json(_ref("ModelMetadata"), "metadata"), _METADATA)}}
    model_ready = {"get": {"summary": "whether the model serves", "security": secured,
                           "responses": _responses(_json(_ref("Ready"), "ready"), (*_METADATA, 503))}}
    with_version = lambda op: {m: {**o, "parameters": [name_param, version_param, *o.get("parameters", [])]}  # noqa: E731
                               for m, o in op.items()}
    with_name = lambda op: {m: {**o, "parameters": [name_param, *o.get("parameters", [])]}  # noqa: E731
                            for m, o in op.items()}
    change = {"post": {"summary": "", "security": secured, "parameters": [name_param],
                       "responses": _responses(_json({"type": "object"}, "done"), (400, 401, 403, 404, 500))}}
    paths = {
        "/v2/repository/index": {"post": {
            "summary": "every model version held or tried, with its state (KServe v2 repository extension)",
            "security": secured, "requestBody": {"required": False, "content": {"application/json": {"schema": {
                "type": "object", "properties": {"ready": {"type": "boolean"}}}}}},
            "responses": _responses(_json(_ref("RepositoryIndex"), "the index"), (400, 401, 500))}},
        "/v2/repository/models/{name}/load": {"post": {**change["post"], "summary": "load the model's versions from "
                                                       "the repository (again): new ones verified before they serve, "
                                                       "those its policy no longer lists drained and freed"}},
        "/v2/repository/models/{name}/unload": {"post": {**change["post"], "summary": "unload every version of the "
                                                         "model (each drains its calls in flight)"}},
        "/v1/classify": {"post": {
            "summary": "label texts: per text its label, probabilities, token count and truncation",
            "security": secured, "parameters": [timeout_header],
            "requestBody": {"required": True, "content": {"application/json": {"schema": _ref("ClassifyRequest"),
                                                                               "example": {"texts": ["Super livre"]}}}},
            "responses": _responses(_json(_ref("ClassifyResponse"), "one result per text, in order"),
                                    _MODEL_CALL)}},
        "/v1/metadata": {"get": {"summary": "labels and limits", "security": secured, "parameters": [
            {"name": "model_name", "in": "query", "required": False, "schema": {"type": "string"},
             "description": "the model; left out on a server of one model"},
            {"name": "model_version", "in": "query", "required": False, "schema": {"type": "string"},
             "description": "its version; left out: its newest ready one"}],
                                 "responses": _responses(_json(_ref("Metadata"), "metadata"), (400, 401, 404, 500,
                                                                                                503))}},
        "/v2/health/live": {"get": {"summary": "the process serves HTTP", "security": [],
                                    "responses": {"200": _json(_ref("Live"), "live")}}},
        "/v2/health/ready": {"get": {"summary": "the server takes model calls (503 while starting or draining)",
                                     "security": [], "responses": {"200": _json(_ref("Ready"), "ready"),
                                                                   "503": _json(_ref("Ready"), "not ready")}}},
        "/v2": {"get": {"summary": "the server's name, version and protocol extensions", "security": secured,
                        "responses": _responses(_json(_ref("ServerMetadata"), "metadata"), (401, 500))}},
        "/v2/models/{name}": with_name(model_meta),
        "/v2/models/{name}/versions/{version}": with_version(model_meta),
        "/v2/models/{name}/ready": with_name(model_ready),
        "/v2/models/{name}/versions/{version}/ready": with_version(model_ready),
        "/v2/models/{name}/infer": with_name(infer),
        "/v2/models/{name}/versions/{version}/infer": with_version(infer),
    }
    doc: dict[str, Any] = {
        "openapi": "3.0.3",
        "info": {"title": "sentiment-server", "version": kserve_v2.server_version(),
                 "description": f"Sentiment classification of texts by the models {names} (labels "
                                f"{labels}). Every error is {{\"code\", \"error\"}}: the gRPC status name and a "
                                f"message. Bodies up to {cfg.max_message_bytes} bytes."},
        "paths": paths,
        "components": {"schemas": schemas, "responses": responses},
    }
    if cfg.auth_token:
        doc["components"]["securitySchemes"] = {"bearer": {"type": "http", "scheme": "bearer"}}
    return doc
