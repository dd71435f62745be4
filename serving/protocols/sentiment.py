"""sentiment.v1.SentimentService: Classify and GetModelMetadata, messages in and out of the shared ServingCore."""

from __future__ import annotations

import grpc

from serving.gen.sentiment.v1 import sentiment_service_pb2 as pb
from serving.gen.sentiment.v1 import sentiment_service_pb2_grpc as pb_grpc
from serving.model.core import ServingCore
from serving.protocols.calls import cancelled_of, deadline_of


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


def metadata(core: ServingCore) -> pb.GetModelMetadataResponse:
    """The model's labels and the server's limits (GetModelMetadata's answer; /v1/metadata's, as JSON)."""
    p, cfg = core.predictor, core.cfg
    policy = {"truncate": pb.LONG_TEXT_POLICY_TRUNCATE, "refuse": pb.LONG_TEXT_POLICY_REFUSE}[cfg.long_text]
    return pb.GetModelMetadataResponse(
        model_name=cfg.model_name,
        labels=p.label_names,  # the proto's `labels` field: the names
        max_tokens=p.max_len,
        bundle_sha256=p.bundle_sha256,
        execution_provider=p.provider,
        precision=p.precision,
        max_texts=cfg.max_texts,
        max_chars=cfg.max_chars,
        long_text_policy=policy,
        label_values=p.label_values,
        probabilities_calibrated=p.manifest.calibrated,
        calibration_temperature=p.manifest.temperature,
        model_card=p.model_card,
    )
