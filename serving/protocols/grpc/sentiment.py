"""sentiment.v1.SentimentService: Classify and GetModelMetadata, messages in and out of the shared ServingCore."""

from __future__ import annotations

import grpc

from serving.gen.sentiment.v1 import sentiment_service_pb2 as pb
from serving.gen.sentiment.v1 import sentiment_service_pb2_grpc as pb_grpc
from serving.model.core import ServingCore
from serving.protocols.grpc.servicer_context import cancelled_of, deadline_of
from serving.protocols.sentiment_v1 import metadata


class SentimentServicer(pb_grpc.SentimentServiceServicer):
    """sentiment.v1.SentimentService: messages in and out of ServingCore."""

    def __init__(self, core: ServingCore) -> None:
        self.core = core

    def Classify(self, request: pb.ClassifyRequest, context: grpc.ServicerContext) -> pb.ClassifyResponse:
        preds = self.core.classify(list(request.texts), deadline_of(context), cancelled_of(context))
        return pb.ClassifyResponse(results=[
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
        return metadata(self.core)
