"""The KServe v2 / Open Inference Protocol's rules for the served models, shared by its gRPC half
(serving/protocols/grpc/kserve.py) and its REST half (serving/protocols/http/kserve_rest.py): model names, the text
input, the outputs, metadata. No gRPC and no HTTP here.

Input "TEXT": BYTES, shape [n] or [n, 1], UTF-8 texts, carried either in raw_input_contents (each element
prefixed by its byte length as a little-endian uint32, what tritonclient sends) or in contents.bytes_contents.
Outputs (all unless the request names some, each at most once): "probabilities" FP32 [n, C], "label" BYTES [n],
"token_count" INT32 [n], "truncated" BOOL [n]; returned in raw_output_contents, as Triton does.
"""

from __future__ import annotations

import struct
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from contract.version import package_version
from serving.errors import InvalidInput, ModelNotFound, NotReady
from serving.model.core import ServingCore
from serving.model.models import Models
from serving.model.predictor import Prediction

INPUT = "TEXT"
OUTPUTS = ("probabilities", "label", "token_count", "truncated")
SERVER_NAME = "sentiment-server"


def server_version() -> str:
    """This package's version (ServerMetadata, the traces' service.version)."""
    return package_version() or "0+unknown"


def encode_bytes(items: list[bytes]) -> bytes:
    """BYTES tensor -> raw: each element as <uint32 little-endian length><bytes>."""
    return b"".join(struct.pack("<I", len(b)) + b for b in items)


def decode_bytes(raw: bytes, count: int) -> list[bytes]:
    """Raw BYTES tensor of `count` elements -> elements; InvalidInput when the framing is wrong."""
    items, offset = [], 0
    for i in range(count):
        if offset + 4 > len(raw):
            raise InvalidInput(f"input {INPUT}: raw contents end before element {i} of {count} (truncated length)")
        (n,) = struct.unpack_from("<I", raw, offset)
        offset += 4
        if offset + n > len(raw):
            raise InvalidInput(f"input {INPUT}: element {i} declares {n} bytes, only {len(raw) - offset} remain")
        items.append(raw[offset : offset + n])
        offset += n
    if offset != len(raw):
        raise InvalidInput(f"input {INPUT}: {len(raw) - offset} bytes left after the {count} elements of its shape")
    return items


def pick(models: Models, name: str, version: str) -> ServingCore:
    """The version a KServe call names; a name is required, as the protocol's paths have it (ModelNotFound)."""
    if not name:
        raise ModelNotFound(f"unknown model ''; name one of {models.names()}")
    return models.get(name, version)


def model_ready(models: Models, name: str, version: str) -> bool:
    """ModelReady's answer: false for a known model with no version ready (unloaded, or every version failed)."""
    try:
        return pick(models, name, version).reports_ready
    except NotReady:
        return False


def model_metadata(core: ServingCore, versions: Sequence[str]) -> dict:
    """A model's metadata (ModelMetadataResponse's fields; the REST answer as it is). versions: its ready ones."""
    C = len(core.predictor.label_names)
    return {
        "name": core.name,
        "versions": list(versions),
        "platform": "onnxruntime_onnx",
        "inputs": [{"name": INPUT, "datatype": "BYTES", "shape": [-1]}],
        "outputs": [
            {"name": "probabilities", "datatype": "FP32", "shape": [-1, C]},
            {"name": "label", "datatype": "BYTES", "shape": [-1]},
            {"name": "token_count", "datatype": "INT32", "shape": [-1]},
            {"name": "truncated", "datatype": "BOOL", "shape": [-1]},
        ],
    }


def wanted_outputs(names: Sequence[str], classification: Sequence[str] = ()) -> list[str]:
    """The requested outputs in order (all when none is named), checked before anything is computed: each known,
    each at most once. classification: the names of those that ask for the classification extension."""
    if len(names) > len(OUTPUTS):
        raise InvalidInput(f"{len(names)} outputs requested; the model has {len(OUTPUTS)}: {list(OUTPUTS)}, name "
                           "each at most once")
    for name in names:
        if name not in OUTPUTS:
            raise InvalidInput(f"unknown output {name!r}; outputs: {list(OUTPUTS)}")
    if classification:
        raise InvalidInput(f"output {classification[0]!r}: the classification extension is not supported; read "
                           "'label' and 'probabilities'")
    if len(set(names)) != len(names):
        twice = sorted({name for name in names if names.count(name) > 1})
        raise InvalidInput(f"outputs {twice} requested more than once; name each output at most once")
    return list(names) or list(OUTPUTS)


def text_count(names: Sequence[str], datatype: str, shape: Sequence[int], max_texts: int) -> int:
    """The number of texts of a request whose inputs are `names`, the first of `datatype` and `shape`;
    InvalidInput unless it is the one BYTES input of shape [n] or [n, 1] with n <= max_texts."""
    if len(names) != 1 or names[0] != INPUT:
        raise InvalidInput(f"expected exactly one input named {INPUT!r}, got {list(names)}")
    if datatype != "BYTES":
        raise InvalidInput(f"input {INPUT}: datatype must be BYTES, got {datatype!r}")
    shape = list(shape)
    if not (len(shape) == 1 or (len(shape) == 2 and shape[1] == 1)) or shape[0] < 0:
        raise InvalidInput(f"input {INPUT}: shape must be [n] or [n, 1], got {shape}")
    if shape[0] > max_texts:
        raise InvalidInput(f"input {INPUT}: {shape[0]} texts > max_texts={max_texts}; split the request")
    return shape[0]


def decode_texts(items: Sequence[bytes]) -> list[str]:
    """BYTES elements -> texts; InvalidInput naming the first that is not UTF-8."""
    texts = []
    for i, b in enumerate(items):
        try:
            texts.append(b.decode("utf-8"))
        except UnicodeDecodeError as e:
            raise InvalidInput(f"input {INPUT}: element {i} is not valid UTF-8 (byte {e.start}: "
                               f"{b[e.start:e.start + 1]!r})") from None
    return texts


@dataclass(frozen=True)
class Tensor:
    """One output: its values as an array (labels as a list of str for BYTES)."""

    name: str
    datatype: str
    shape: list[int]
    values: np.ndarray | list[str]

    def raw(self) -> bytes:
        """Little-endian, row-major, BYTES length-prefixed: raw_output_contents, and the REST binary extension."""
        if self.datatype == "BYTES":
            return encode_bytes([v.encode("utf-8") for v in self.values])
        return self.values.tobytes()


def output_tensors(preds: Sequence[Prediction], wanted: Sequence[str]) -> list[Tensor]:
    """The outputs named in `wanted`, in that order, each built only when asked for."""
    n = len(preds)
    make = {
        "probabilities": lambda: Tensor("probabilities", "FP32", [n, len(preds[0].probabilities)],
                                        np.stack([p.probabilities for p in preds]).astype("<f4")),
        "label": lambda: Tensor("label", "BYTES", [n], [p.label for p in preds]),
        "token_count": lambda: Tensor("token_count", "INT32", [n], np.array([p.token_count for p in preds],
                                                                            dtype="<i4")),
        "truncated": lambda: Tensor("truncated", "BOOL", [n], np.array([p.truncated for p in preds],
                                                                      dtype=np.bool_)),
    }
    return [make[name]() for name in wanted]
