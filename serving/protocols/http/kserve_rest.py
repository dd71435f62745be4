"""KServe v2 / Open Inference Protocol over HTTP (the REST half; the protocol's rules, which its gRPC half shares, are
serving/protocols/kserve_v2.py: model names, the one BYTES input, the outputs, metadata), with Triton's binary tensor
data extension, which `tritonclient.http` uses by default.

POST /v2/models/{name}[/versions/{version}]/infer, a JSON body:
    {"id": "...", "parameters": {"timeout": µs, "binary_data_output": bool},
     "inputs": [{"name": "TEXT", "datatype": "BYTES", "shape": [n] or [n, 1], "data": ["text", ...]}],
     "outputs": [{"name": "label", "parameters": {"binary_data": bool}}, ...]}
or, with the header `Inference-Header-Content-Length: L`, L bytes of such JSON followed by the input's data, each
text prefixed by its byte length (uint32 little-endian), the input naming its size in "parameters":
{"binary_data_size": k}. The answer: {"model_name", "model_version", "id" (when given), "outputs": [{"name",
"datatype", "shape", "data": row-major values}]}; an output asked for in binary carries {"binary_data_size": k}
instead of "data", its bytes after the JSON (whose length the answer's Inference-Header-Content-Length gives).
"""

from __future__ import annotations

from typing import Any

import orjson

from serving.errors import InvalidInput
from serving.model.models import Models
from serving.protocols.http.exchange import Answer, HttpCall, parse_json
from serving.protocols.kserve_v2 import (
    INPUT,
    OUTPUTS,
    decode_bytes,
    decode_texts,
    output_tensors,
    pick,
    text_count,
    wanted_outputs,
)

HEADER_LENGTH = b"inference-header-content-length"
BODY_TYPES = (b"application/json", b"application/octet-stream")


def _get(obj: dict, key: str, kind: type | tuple[type, ...], where: str, default: Any = None) -> Any:
    value = obj.get(key, default)
    if value is not default and (not isinstance(value, kind) or isinstance(value, bool) and kind is not bool):
        names = kind.__name__ if isinstance(kind, type) else " or ".join(k.__name__ for k in kind)
        raise InvalidInput(f"{where}.{key}: expected {_JSON_NAMES.get(names, names)}, got {type(value).__name__}")
    return value


_JSON_NAMES = {"dict": "an object", "list": "an array", "str": "a string", "int": "an integer", "bool": "a boolean",
               "int or float": "a number"}


async def infer(models: Models, call: HttpCall) -> Answer:
    version = call.params.get("version", "")
    core = pick(models, call.params["name"], version)
    body = await call.body(BODY_TYPES)
    doc, binary = _split(body, call.header(HEADER_LENGTH))
    if not isinstance(doc, dict):
        raise InvalidInput(f"body: expected a JSON object (an inference request), got {type(doc).__name__}")
    request_id = _get(doc, "id", str, "request")
    parameters = _get(doc, "parameters", dict, "request", {})
    timeout = _get(parameters, "timeout", (int, float), "request.parameters")
    if timeout is not None:
        if not 0 < timeout <= 3.6e9:
            raise InvalidInput(f"request.parameters.timeout: {timeout} µs is not in (0, 3.6e9]")
        call.set_timeout(timeout / 1e6)
    binary_default = _get(parameters, "binary_data_output", bool, "request.parameters", False)
    outputs = _get(doc, "outputs", list, "request", [])
    if len(outputs) > len(OUTPUTS):  # refused on the count, before any is read
        wanted_outputs(outputs)
    asked = [_object(o, f"request.outputs[{i}]") for i, o in enumerate(outputs)]
    names = [_get(o, "name", str, f"request.outputs[{i}]", "") for i, o in enumerate(asked)]
    options = [_get(o, "parameters", dict, f"request.outputs[{i}]", {}) for i, o in enumerate(asked)]
    wanted = wanted_outputs(names, [n for n, p in zip(names, options, strict=True) if "classification" in p])
    in_binary = {n: bool(_get(p, "binary_data", bool, f"outputs {n!r}.parameters", binary_default))
                 for n, p in zip(names, options, strict=True)} if asked else dict.fromkeys(wanted, binary_default)
    texts = _texts(_get(doc, "inputs", list, "request", []), binary, core.cfg.max_texts)
    core, preds = await call.predictions(models, core.name, version, texts)

    answer: dict[str, Any] = {"model_name": core.name, "model_version": core.version}
    if request_id is not None:
        answer["id"] = request_id
    tensors, raws = [], []
    for t in output_tensors(preds, wanted):
        out: dict[str, Any] = {"name": t.name, "datatype": t.datatype, "shape": t.shape}
        if in_binary[t.name]:
            raw = t.raw()
            out["parameters"] = {"binary_data_size": len(raw)}
            raws.append(raw)
        else:
            out["data"] = t.values if isinstance(t.values, list) else t.values.reshape(-1).tolist()
        tensors.append(out)
    answer["outputs"] = tensors
    head = orjson.dumps(answer)
    if not raws:
        return Answer(head)
    return Answer(head + b"".join(raws), content_type=b"application/octet-stream",
                  headers=[(HEADER_LENGTH, str(len(head)).encode())])


def _object(value: Any, where: str) -> dict:
    if not isinstance(value, dict):
        raise InvalidInput(f"{where}: expected an object, got {type(value).__name__}")
    return value


def _split(body: bytes, header_length: bytes | None) -> tuple[Any, bytes]:
    """(the JSON, the binary data after it)."""
    if header_length is None:
        return parse_json(body), b""
    if not header_length.isdigit() or int(header_length) > len(body):
        raise InvalidInput(f"header Inference-Header-Content-Length: {header_length[:32].decode('latin-1')!r} is not "
                           f"a length within the body's {len(body)} bytes")
    n = int(header_length)
    return parse_json(body[:n]), body[n:]


def _texts(inputs: list, binary: bytes, max_texts: int) -> list[str]:
    """The one BYTES input's texts, from its JSON data or its binary data."""
    tensors = [_object(t, f"request.inputs[{i}]") for i, t in enumerate(inputs[:2])]
    names = [_get(t, "name", str, f"request.inputs[{i}]", "") for i, t in enumerate(tensors)]
    first = tensors[0] if tensors else {}
    shape = _get(first, "shape", list, "request.inputs[0]", [])
    bad = next((i for i, d in enumerate(shape) if not isinstance(d, int) or isinstance(d, bool)), None)
    if bad is not None:  # named by its type: the repr of a list 1,000 levels deep raises RecursionError
        raise InvalidInput(f"input {INPUT}: shape must be a list of integers, got {type(shape[bad]).__name__} at "
                           f"shape[{bad}]")
    count = text_count(names if len(inputs) < 2 else [*names, "..."],
                       _get(first, "datatype", str, "request.inputs[0]", ""), shape, max_texts)
    size = _get(_get(first, "parameters", dict, "request.inputs[0]", {}), "binary_data_size", int,
                "request.inputs[0].parameters")
    if size is not None:
        if "data" in first:
            raise InvalidInput(f"input {INPUT}: give its data once, in \"data\" or as binary data")
        if size != len(binary):
            raise InvalidInput(f"input {INPUT}: binary_data_size {size} but {len(binary)} bytes follow the JSON")
        return decode_texts(decode_bytes(binary, count))
    if binary:
        raise InvalidInput(f"{len(binary)} bytes follow the JSON but no input declares binary_data_size")
    data = _get(first, "data", list, "request.inputs[0]")
    if data is None:
        raise InvalidInput(f"input {INPUT}: no \"data\" (nor parameters.binary_data_size)")
    if len(shape) == 2 and all(isinstance(d, list) for d in data):  # [[text], [text]]: nested row-major
        data = [x for row in data for x in (row if len(row) == 1 else [row])]
    if len(data) != count or not all(isinstance(d, str) for d in data):
        bad = next((i for i, d in enumerate(data) if not isinstance(d, str)), None)
        raise InvalidInput(f"input {INPUT}: shape {shape} holds {count} texts, got {len(data)} elements" if bad is None
                           else f"input {INPUT}: element {bad} is not a string")
    return data
