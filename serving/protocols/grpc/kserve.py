"""KServe v2 / Triton `inference.GRPCInferenceService` for the one served model: messages in and out of the shared
ServingCore, under the protocol's rules (serving/protocols/kserve_v2.py, which its REST half shares). The texts come
in raw_input_contents or contents.bytes_contents; the outputs go out in raw_output_contents, as Triton sends them."""

from __future__ import annotations

import grpc

from serving.errors import InvalidInput
from serving.gen.inference import grpc_service_pb2 as pb
from serving.gen.inference import grpc_service_pb2_grpc as pb_grpc
from serving.model.core import ServingCore
from serving.protocols.grpc.servicer_context import cancelled_of, deadline_of
from serving.protocols.kserve_v2 import (
    INPUT,
    OUTPUTS,
    SERVER_NAME,
    VERSION,
    check_model,
    decode_bytes,
    decode_texts,
    model_metadata,
    output_tensors,
    server_version,
    text_count,
    wanted_outputs,
)


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
