"""What sentiment.v1 answers, whatever carries it: the model's metadata as the proto's GetModelMetadataResponse, which
gRPC sends as it is (serving/protocols/grpc/sentiment.py) and HTTP as JSON (GET /v1/metadata,
serving/protocols/http/routes.py). A protobuf message, no gRPC."""

from __future__ import annotations

from serving.gen.sentiment.v1 import sentiment_service_pb2 as pb
from serving.model.core import ServingCore


def metadata(core: ServingCore) -> pb.GetModelMetadataResponse:
    """The model's labels and the server's limits (GetModelMetadata's answer; /v1/metadata's, as JSON)."""
    p, cfg = core.predictor, core.cfg
    policy = {"truncate": pb.LONG_TEXT_POLICY_TRUNCATE, "refuse": pb.LONG_TEXT_POLICY_REFUSE}[cfg.long_text]
    return pb.GetModelMetadataResponse(
        model_name=core.name,
        model_version=core.version,
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
