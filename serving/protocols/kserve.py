"""KServe v2 / Triton `inference.GRPCInferenceService` for the one served model.

Input "TEXT": BYTES, shape [n] or [n, 1], UTF-8 texts, carried either in raw_input_contents (each element
prefixed by its byte length as a little-endian uint32, what tritonclient sends) or in contents.bytes_contents.
Outputs (all unless the request names some, each at most once): "probabilities" FP32 [n, C], "label" BYTES [n],
"token_count" INT32 [n], "truncated" BOOL [n]; returned in raw_output_contents, as Triton does.
"""

from __future__ import annotations

import struct
from importlib import metadata

import grpc
import numpy as np

from serving.errors import InvalidInput, ModelNotFound
from serving.gen.inference import grpc_service_pb2 as pb
from serving.gen.inference import grpc_service_pb2_grpc as pb_grpc
from serving.model.core import ServingCore
from serving.protocols.calls import cancelled_of, deadline_of

INPUT = "TEXT"
VERSION = "1"  # the one version of the one model
OUTPUTS = ("probabilities", "label", "token_count", "truncated")


def _server_version() -> str:
    try:
        return metadata.version("transfer-sentiment")
    except metadata.PackageNotFoundError:
        return "0+unknown"


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


class KServeServicer(pb_grpc.GRPCInferenceServiceServicer):
    """Health, metadata and inference in the KServe v2 protocol, on the shared ServingCore."""

    def __init__(self, core: ServingCore) -> None:
        self.core = core

    @property
    def name(self) -> str:
        return self.core.cfg.model_name

    def _check_model(self, name: str, version: str) -> None:
        if name != self.name:
            raise ModelNotFound(f"unknown model {name!r}; this server holds {self.name!r}")
        if version not in ("", VERSION):
            raise ModelNotFound(f"model {name!r} has no version {version!r}; versions: [{VERSION!r}]")

    def ServerLive(self, request, context):
        return pb.ServerLiveResponse(live=True)

    def ServerReady(self, request, context):
        return pb.ServerReadyResponse(ready=self.core.reports_ready)

    def ModelReady(self, request, context):
        self._check_model(request.name, request.version)
        return pb.ModelReadyResponse(ready=self.core.reports_ready)

    def ServerMetadata(self, request, context):
        return pb.ServerMetadataResponse(name="sentiment-server", version=_server_version(), extensions=[])

    def ModelMetadata(self, request, context):
        self._check_model(request.name, request.version)
        T = pb.ModelMetadataResponse.TensorMetadata
        C = len(self.core.predictor.label_names)
        return pb.ModelMetadataResponse(
            name=self.name,
            versions=[VERSION],
            platform="onnxruntime_onnx",
            inputs=[T(name=INPUT, datatype="BYTES", shape=[-1])],
            outputs=[
                T(name="probabilities", datatype="FP32", shape=[-1, C]),
                T(name="label", datatype="BYTES", shape=[-1]),
                T(name="token_count", datatype="INT32", shape=[-1]),
                T(name="truncated", datatype="BOOL", shape=[-1]),
            ],
        )

    def ModelInfer(self, request: pb.ModelInferRequest, context: grpc.ServicerContext) -> pb.ModelInferResponse:
        self._check_model(request.model_name, request.model_version)
        wanted = self._outputs(request)
        texts = self._texts(request)
        preds = self.core.classify(texts, deadline_of(context), cancelled_of(context))
        n, C = len(preds), len(self.core.predictor.label_names)
        tensors = {  # built only when asked for
            "probabilities": lambda: ("FP32", [n, C],
                                      np.stack([p.probabilities for p in preds]).astype("<f4").tobytes()),
            "label": lambda: ("BYTES", [n], encode_bytes([p.label.encode("utf-8") for p in preds])),
            "token_count": lambda: ("INT32", [n], np.array([p.token_count for p in preds], dtype="<i4").tobytes()),
            "truncated": lambda: ("BOOL", [n], np.array([p.truncated for p in preds], dtype=np.bool_).tobytes()),
        }
        response = pb.ModelInferResponse(model_name=self.name, model_version=VERSION, id=request.id)
        for name in wanted:
            datatype, shape, raw = tensors[name]()
            response.outputs.add(name=name, datatype=datatype, shape=shape)
            response.raw_output_contents.append(raw)
        return response

    def _outputs(self, request: pb.ModelInferRequest) -> list[str]:
        """The requested outputs (all when none is named), checked before anything is computed: each known, each
        at most once."""
        if len(request.outputs) > len(OUTPUTS):  # counted without reading them: 60,000 entries cost nothing
            raise InvalidInput(f"{len(request.outputs)} outputs requested; the model has {len(OUTPUTS)}: "
                               f"{list(OUTPUTS)}, name each at most once")
        wanted = [o.name for o in request.outputs] or list(OUTPUTS)
        for o in request.outputs:
            if o.name not in OUTPUTS:
                raise InvalidInput(f"unknown output {o.name!r}; outputs: {list(OUTPUTS)}")
            if "classification" in o.parameters:
                raise InvalidInput(f"output {o.name!r}: the classification extension is not supported; "
                                   "read 'label' and 'probabilities'")
        if len(set(wanted)) != len(wanted):
            twice = sorted({name for name in wanted if wanted.count(name) > 1})
            raise InvalidInput(f"outputs {twice} requested more than once; name each output at most once")
        return wanted

    def _texts(self, request: pb.ModelInferRequest) -> list[str]:
        """The request's one BYTES input as decoded texts; InvalidInput naming what is wrong."""
        if len(request.inputs) != 1 or request.inputs[0].name != INPUT:
            raise InvalidInput(f"expected exactly one input named {INPUT!r}, got {[i.name for i in request.inputs]}")
        tensor = request.inputs[0]
        if tensor.datatype != "BYTES":
            raise InvalidInput(f"input {INPUT}: datatype must be BYTES, got {tensor.datatype!r}")
        shape = list(tensor.shape)
        if not (len(shape) == 1 or (len(shape) == 2 and shape[1] == 1)) or shape[0] < 0:
            raise InvalidInput(f"input {INPUT}: shape must be [n] or [n, 1], got {shape}")
        count = shape[0]
        limit = self.core.cfg.max_texts
        if count > limit:
            raise InvalidInput(f"input {INPUT}: {count} texts > max_texts={limit}; split the request")
        if request.raw_input_contents:
            if len(request.raw_input_contents) != 1 or tensor.HasField("contents"):
                raise InvalidInput(f"input {INPUT}: give its data once, in raw_input_contents or in contents")
            items = decode_bytes(request.raw_input_contents[0], count)
        else:
            c = tensor.contents
            others = [f.name for f, _ in c.ListFields() if f.name != "bytes_contents"]
            if others:
                raise InvalidInput(f"input {INPUT}: BYTES data belongs in bytes_contents, got {others}")
            items = list(c.bytes_contents)
            if len(items) != count:
                raise InvalidInput(f"input {INPUT}: shape {shape} holds {count} elements, got {len(items)}")
        texts = []
        for i, b in enumerate(items):
            try:
                texts.append(b.decode("utf-8"))
            except UnicodeDecodeError as e:
                raise InvalidInput(f"input {INPUT}: element {i} is not valid UTF-8 (byte {e.start}: "
                                   f"{b[e.start:e.start + 1]!r})") from None
        return texts
