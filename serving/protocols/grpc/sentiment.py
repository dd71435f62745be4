"""sentiment.v1.SentimentService: Classify and GetModelMetadata, messages in and out of the models' ServingCores
(serving/model/models.py)."""

from __future__ import annotations

import grpc

from serving.gen.sentiment.v1 import sentiment_service_pb2 as pb
from serving.gen.sentiment.v1 import sentiment_service_pb2_grpc as pb_grpc
from serving.model.models import Models
from serving.protocols.grpc.servicer_context import cancelled_of, deadline_of
from serving.protocols.sentiment_v1 import metadata


class SentimentServicer(pb_grpc.SentimentServiceServicer):
    """sentiment.v1.SentimentService: messages in and out of the models."""

    def __init__(self, models: Models) -> None:
        self.models = models

    def Classify(self, request: pb.ClassifyRequest, context: grpc.ServicerContext) -> pb.ClassifyResponse:
        core, preds = self.models.classify(request.model_name, request.model_version, list(request.texts),
                                           deadline_of(context), cancelled_of(context))
        return pb.ClassifyResponse(model_name=core.name, model_version=core.version, results=[
            pb.Classification(
                label=p.label,
                label_index=p.label_index,
                probabilities=p.probabilities.tolist(),
                token_count=p.token_count,
                truncated=p.truncated,
            )
            for p in preds
        ])

    def GetModelMetadata(self, request: pb.GetModelMetadataRequest,
                         context: grpc.ServicerContext) -> pb.GetModelMetadataResponse:
        return metadata(self.models.get(request.model_name, request.model_version))
