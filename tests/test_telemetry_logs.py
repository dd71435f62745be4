"""The server's log lines: one schema in text and JSON (workers too), the access line of every call with its request
id (taken from the client when sane, else made, and returned), and its rate limit."""

from __future__ import annotations

import json
import logging
import time
import urllib.request
import uuid
from pathlib import Path

import grpc
import pytest
from prometheus_client.parser import text_string_to_metric_families
from serving_fixtures import ServerProcess, running_server

from serving.gen.inference import grpc_service_pb2 as kserve_pb
from serving.gen.inference import grpc_service_pb2_grpc as kserve_grpc
from serving.gen.sentiment.v1 import sentiment_service_pb2 as pb
from serving.gen.sentiment.v1 import sentiment_service_pb2_grpc as pb_grpc
from serving.protocols.kserve_v2 import encode_bytes

TEXT = "Un roman lumineux, des personnages attachants."
CLASSIFY = "sentiment.v1.SentimentService/Classify"
SCHEMA = {"timestamp", "level", "logger", "message", "request_id", "trace_id"}


def _access(caplog: pytest.LogCaptureFixture) -> list[logging.LogRecord]:
    return [r for r in caplog.records if r.name == "serving.access"]


def _suppressed(port: int) -> float:
    page = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10).read().decode()
    return next(s.value for f in text_string_to_metric_families(page) for s in f.samples
                if s.name == "sentiment_suppressed_access_log_lines_total")


def test_json_lines_of_the_parent_and_its_workers_share_one_schema(tiny_bundle: Path) -> None:
    server = ServerProcess(tiny_bundle, "--device", "cpu", "--workers", "2", "--log-format", "json")
    try:
        port = server.wait_listening()  # the "listening on" line is found in JSON too
        with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
            pb_grpc.SentimentServiceStub(channel).Classify(pb.ClassifyRequest(texts=[TEXT, TEXT]), timeout=30,
                                                           metadata=[("x-request-id", "json-call-1")])
        assert server.stop() == 0
    finally:
        server.close()
    lines = [json.loads(line) for line in server.lines]  # every line is one JSON object
    assert all(SCHEMA <= set(line) for line in lines), [line for line in lines if not SCHEMA <= set(line)]
    assert all(line["timestamp"].endswith("Z") and line["timestamp"][10] == "T" for line in lines)
    workers = [line for line in lines if "worker" in line]
    assert {line["worker"] for line in workers} == {0, 1} and all(line["pid"] > 0 for line in workers)
    assert any(line["logger"] == "serving.process.workers" and "worker" not in line for line in lines)
    (access,) = [line for line in lines if line["logger"] == "serving.access"]
    assert access["request_id"] == "json-call-1" and access["trace_id"] is None
    assert (access["method"], access["status"], access["texts"]) == (CLASSIFY, "OK", 2)
    assert access["tokens"] > 4 and access["ms"] > 0 and access["peer"].startswith("ipv4:127.0.0.1:")
    assert (access["model"], access["model_version"]) == ("sentiment", "1")
    assert access["level"] == "INFO" and "worker" in access


def test_request_ids_are_taken_when_sane_made_otherwise_and_returned(tiny_bundle: Path,
                                                                     caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, logger="serving.access")
    hostile = ["x" * 129, "two words", "quote\"and{brace}", "a;b,c"]
    with running_server(tiny_bundle, device="cpu", auth_token="a-test-token-of-some-length") as server, \
            grpc.insecure_channel(f"127.0.0.1:{server.port}") as channel:
        stub = pb_grpc.SentimentServiceStub(channel)
        auth = ("authorization", "Bearer a-test-token-of-some-length")
        _, call = stub.Classify.with_call(pb.ClassifyRequest(texts=[TEXT]), timeout=30,
                                          metadata=[auth, ("x-request-id", "ok/id:1.2_3")])
        assert dict(call.trailing_metadata())["x-request-id"] == "ok/id:1.2_3"
        made = []
        for bad in hostile:
            _, call = stub.Classify.with_call(pb.ClassifyRequest(texts=[TEXT]), timeout=30,
                                              metadata=[auth, ("x-request-id", bad)])
            made.append(dict(call.trailing_metadata())["x-request-id"])
        assert len(set(made)) == len(hostile)
        for m in made:  # a random UUID, as uuid.uuid4() writes one (serving/telemetry/call_log.py makes it cheaper)
            assert str(uuid.UUID(m)) == m and uuid.UUID(m).version == 4 and uuid.UUID(m).variant == uuid.RFC_4122
        with pytest.raises(grpc.RpcError) as refused:  # refused at the gate, before any handler: an id all the same
            stub.Classify(pb.ClassifyRequest(texts=[TEXT]), timeout=30, metadata=[("x-request-id", "no-token")])
        assert refused.value.code() == grpc.StatusCode.UNAUTHENTICATED
        assert dict(refused.value.trailing_metadata())["x-request-id"] == "no-token"
        kserve = kserve_grpc.GRPCInferenceServiceStub(channel)  # the other protocol, the same ids
        request = kserve_pb.ModelInferRequest(model_name="sentiment", raw_input_contents=[encode_bytes([b"Bien."])])
        request.inputs.add(name="TEXT", datatype="BYTES", shape=[1])
        _, call = kserve.ModelInfer.with_call(request, timeout=30, metadata=[auth, ("x-request-id", "kserve-7")])
        assert dict(call.trailing_metadata())["x-request-id"] == "kserve-7"
    lines = _access(caplog)
    logged = {r.request_id: r for r in lines}
    assert {"ok/id:1.2_3", "no-token", "kserve-7", *made} <= set(logged)
    assert not any(bad in r.getMessage() or bad == r.request_id for bad in hostile for r in lines)
    assert logged["no-token"].status == "UNAUTHENTICATED" and logged["no-token"].texts == 0
    assert logged["kserve-7"].method == "inference.GRPCInferenceService/ModelInfer" and logged["kserve-7"].texts == 1


def test_the_access_log_is_rate_limited_per_method_and_status(tiny_bundle: Path,
                                                              caplog: pytest.LogCaptureFixture) -> None:
    """At most access_log_rate lines per second for each method and status: every call is either logged or counted,
    an error is not hidden by a flood of answered calls, and the next line written says how many were left out."""
    caplog.set_level(logging.INFO, logger="serving.access")
    with running_server(tiny_bundle, device="cpu", access_log_rate=2, metrics_port=0) as server, \
            grpc.insecure_channel(f"127.0.0.1:{server.port}") as channel:
        stub = pb_grpc.SentimentServiceStub(channel)
        for _ in range(30):
            stub.Classify(pb.ClassifyRequest(texts=[TEXT]), timeout=30)
        with pytest.raises(grpc.RpcError):
            stub.Classify(pb.ClassifyRequest(texts=[""]), timeout=30)
        ok = [r for r in _access(caplog) if r.status == "OK"]
        suppressed = _suppressed(server.metrics_port)
        assert len(ok) + suppressed == 30 and suppressed > 0
        assert [r.status for r in _access(caplog) if r.status != "OK"] == ["INVALID_ARGUMENT"]
        time.sleep(1.05)  # the throttle's window (1 s) is over: the next line carries what its key left out
        stub.Classify(pb.ClassifyRequest(texts=[TEXT]), timeout=30)
        ok = [r for r in _access(caplog) if r.status == "OK"]
        assert sum(r.suppressed for r in ok) == suppressed == _suppressed(server.metrics_port)
        for r in ok:
            assert (f"({r.suppressed} more like it not logged)" in r.getMessage()) == (r.suppressed > 0)
    with running_server(tiny_bundle, device="cpu", access_log_rate=0) as server, \
            grpc.insecure_channel(f"127.0.0.1:{server.port}") as channel:
        caplog.clear()
        pb_grpc.SentimentServiceStub(channel).Classify(pb.ClassifyRequest(texts=[TEXT]), timeout=30)
        assert _access(caplog) == []  # 0: no access log at all
