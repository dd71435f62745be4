"""KServe v2 / Triton `inference.GRPCInferenceService` for the served models, and the repository extension: messages
in and out of the models' ServingCores (serving/model/models.py), under the protocol's rules
(serving/protocols/kserve_v2.py, which its REST half shares; the repository's: serving/protocols/repository_api.py).
The texts come in raw_input_contents or contents.bytes_contents; the outputs go out in raw_output_contents, as Triton
sends them."""

from __future__ import annotations

import grpc

from serving.errors import InvalidInput
from serving.gen.inference import grpc_service_pb2 as pb
from serving.gen.inference import grpc_service_pb2_grpc as pb_grpc
from serving.model.models import Models
from serving.protocols.grpc.servicer_context import cancelled_of, deadline_of
from serving.protocols.kserve_v2 import (
    INPUT,
    OUTPUTS,
    SERVER_NAME,
    decode_bytes,
    decode_texts,
    model_metadata,
    model_ready,
    output_tensors,
    pick,
    server_version,
    text_count,
    wanted_outputs,
)
from serving.protocols.repository_api import RepositoryApi


class KServeServicer(pb_grpc.GRPCInferenceServiceServicer):
    """Health, metadata, inference and the model repository in the KServe v2 protocol."""

    def __init__(self, models: Models, repository: RepositoryApi) -> None:
        self.models, self.repository = models, repository

    def ServerLive(self, request, context):
        return pb.ServerLiveResponse(live=True)

    def ServerReady(self, request, context):
        return pb.ServerReadyResponse(ready=self.models.reports_ready)

    def ModelReady(self, request, context):
        return pb.ModelReadyResponse(ready=model_ready(self.models, request.name, request.version))

    def ServerMetadata(self, request, context):
        return pb.ServerMetadataResponse(name=SERVER_NAME, version=server_version(), extensions=["model_repository"])

    def ModelMetadata(self, request, context):
        core = pick(self.models, request.name, request.version)
        meta = model_metadata(core, self.models.versions(core.name))
        T = pb.ModelMetadataResponse.TensorMetadata
        return pb.ModelMetadataResponse(name=meta["name"], versions=meta["versions"], platform=meta["platform"],
                                        inputs=[T(**t) for t in meta["inputs"]],
                                        outputs=[T(**t) for t in meta["outputs"]])

    def ModelInfer(self, request: pb.ModelInferRequest, context: grpc.ServicerContext) -> pb.ModelInferResponse:
        core = pick(self.models, request.model_name, request.model_version)
        # counted without reading them: 60,000 entries cost nothing
        names = [o.name for o in request.outputs] if len(request.outputs) <= len(OUTPUTS) else request.outputs
        wanted = wanted_outputs(names, [o.name for o in request.outputs[:len(OUTPUTS)]
                                        if "classification" in o.parameters])
        texts = self._texts(request, core.cfg.max_texts)
        core, preds = self.models.classify(core.name, request.model_version, texts, deadline_of(context),
                                           cancelled_of(context))
        response = pb.ModelInferResponse(model_name=core.name, model_version=core.version, id=request.id)
        for tensor in output_tensors(preds, wanted):
            response.outputs.add(name=tensor.name, datatype=tensor.datatype, shape=tensor.shape)
            response.raw_output_contents.append(tensor.raw())
        return response

    def RepositoryIndex(self, request, context):
        M = pb.RepositoryIndexResponse.ModelIndex
        return pb.RepositoryIndexResponse(models=[M(**row) for row in self.repository.index(request.repository_name,
                                                                                             request.ready)])

    def RepositoryModelLoad(self, request, context):
        self.repository.load(request.model_name, request.repository_name)
        return pb.RepositoryModelLoadResponse()

    def RepositoryModelUnload(self, request, context):
        self.repository.unload(request.model_name, request.repository_name)
        return pb.RepositoryModelUnloadResponse()

    @staticmethod
    def _texts(request: pb.ModelInferRequest, max_texts: int) -> list[str]:
        """The request's one BYTES input as decoded texts; InvalidInput naming what is wrong."""
        first = request.inputs[0] if request.inputs else None
        count = text_count([i.name for i in request.inputs], first.datatype if first else "",
                           first.shape if first else [], max_texts)
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
