"""KServe v2 / Triton `inference.GRPCInferenceService` for the one served model, and the protocol's rules that its
REST half (serving/protocols/http/kserve_rest.py) shares: model names, the text input, the outputs, metadata.

Input "TEXT": BYTES, shape [n] or [n, 1], UTF-8 texts, carried either in raw_input_contents (each element
prefixed by its byte length as a little-endian uint32, what tritonclient sends) or in contents.bytes_contents.
Outputs (all unless the request names some, each at most once): "probabilities" FP32 [n, C], "label" BYTES [n],
"token_count" INT32 [n], "truncated" BOOL [n]; returned in raw_output_contents, as Triton does.
"""

from __future__ import annotations

import struct
from collections.abc import Sequence
from dataclasses import dataclass

import grpc
import numpy as np

from serving.errors import InvalidInput, ModelNotFound
from serving.gen.inference import grpc_service_pb2 as pb
from serving.gen.inference import grpc_service_pb2_grpc as pb_grpc
from serving.metrics import package_version
from serving.model.core import ServingCore
from serving.model.predictor import Prediction
from serving.protocols.calls import cancelled_of, deadline_of

INPUT = "TEXT"
VERSION = "1"  # the one version of the one model
OUTPUTS = ("probabilities", "label", "token_count", "truncated")
SERVER_NAME = "sentiment-server"


def server_version() -> str:
    """This package's version (ServerMetadata, the traces' service.version)."""
    return package_version("transfer-sentiment") or "0+unknown"


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


# ------------------------------------------------------------------------------- the protocol's rules, both halves


def check_model(core: ServingCore, name: str, version: str) -> None:
    """ModelNotFound unless `name` (and `version`, "" = the latest) is the served model."""
    if name != core.cfg.model_name:
        raise ModelNotFound(f"unknown model {name!r}; this server holds {core.cfg.model_name!r}")
    if version not in ("", VERSION):
        raise ModelNotFound(f"model {name!r} has no version {version!r}; versions: [{VERSION!r}]")


def model_metadata(core: ServingCore) -> dict:
    """The model's metadata (ModelMetadataResponse's fields; the REST answer as it is)."""
    C = len(core.predictor.label_names)
    return {
        "name": core.cfg.model_name,
        "versions": [VERSION],
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


# ---------------------------------------------------------------------------------------------------- gRPC


class KServeServicer(pb_grpc.GRPCInferenceServiceServicer):
    """Health, metadata and inference in the KServe v2 protocol, on the shared ServingCore."""

    def __init__(self, core: ServingCore) -> None:
        self.core = core

    def ServerLive(self, request, context):
        return pb.ServerLiveResponse(live=True)

    def ServerReady(self, request, context):
        return pb.ServerReadyResponse(ready=self.core.reports_ready)

    def ModelReady(self, request, context):
        check_model(self.core, request.name, request.version)
        return pb.ModelReadyResponse(ready=self.core.reports_ready)

    def ServerMetadata(self, request, context):
        return pb.ServerMetadataResponse(name=SERVER_NAME, version=server_version(), extensions=[])

    def ModelMetadata(self, request, context):
        check_model(self.core, request.name, request.version)
        meta = model_metadata(self.core)
        T = pb.ModelMetadataResponse.TensorMetadata
        return pb.ModelMetadataResponse(name=meta["name"], versions=meta["versions"], platform=meta["platform"],
                                        inputs=[T(**t) for t in meta["inputs"]],
                                        outputs=[T(**t) for t in meta["outputs"]])

    def ModelInfer(self, request: pb.ModelInferRequest, context: grpc.ServicerContext) -> pb.ModelInferResponse:
        check_model(self.core, request.model_name, request.model_version)
        # counted without reading them: 60,000 entries cost nothing
        names = [o.name for o in request.outputs] if len(request.outputs) <= len(OUTPUTS) else request.outputs
        wanted = wanted_outputs(names, [o.name for o in request.outputs[:len(OUTPUTS)]
                                        if "classification" in o.parameters])
        texts = self._texts(request)
        preds = self.core.classify(texts, deadline_of(context), cancelled_of(context))
        response = pb.ModelInferResponse(model_name=self.core.cfg.model_name, model_version=VERSION, id=request.id)
        for tensor in output_tensors(preds, wanted):
            response.outputs.add(name=tensor.name, datatype=tensor.datatype, shape=tensor.shape)
            response.raw_output_contents.append(tensor.raw())
        return response

    def _texts(self, request: pb.ModelInferRequest) -> list[str]:
        """The request's one BYTES input as decoded texts; InvalidInput naming what is wrong."""
        first = request.inputs[0] if request.inputs else None
        count = text_count([i.name for i in request.inputs], first.datatype if first else "",
                           first.shape if first else [], self.core.cfg.max_texts)
        assert first is not None
        if request.raw_input_contents:
            if len(request.raw_input_contents) != 1 or first.HasField("contents"):
                raise InvalidInput(f"input {INPUT}: give its data once, in raw_input_contents or in contents")
            items = decode_bytes(request.raw_input_contents[0], count)
        else:
            c = first.contents
            others = [f.name for f, _ in c.ListFields() if f.name != "bytes_contents"]
            if others:
                raise InvalidInput(f"input {INPUT}: BYTES data belongs in bytes_contents, got {others}")
            items = list(c.bytes_contents)
            if len(items) != count:
                raise InvalidInput(f"input {INPUT}: shape {list(first.shape)} holds {count} elements, got "
                                   f"{len(items)}")
        return decode_texts(items)
