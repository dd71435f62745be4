"""/metrics as Prometheus reads it (prometheus_client's own parser), one process and --workers: the model and build
info metrics, `sentiment_serving` following health, Prometheus' naming conventions, and docs/OBSERVABILITY.md's
table naming exactly the metrics served."""

from __future__ import annotations

import importlib.metadata
import platform
import re
import urllib.request
from pathlib import Path

import grpc
import pytest
from procs import REPO
from prometheus_client.parser import text_string_to_metric_families
from serving_fixtures import ServerProcess, wait_until

from contract.bundle import verify_bundle
from serving.gen.sentiment.v1 import sentiment_service_pb2 as pb
from serving.gen.sentiment.v1 import sentiment_service_pb2_grpc as pb_grpc

TEXT = "Un roman lumineux, des personnages attachants."
DOC = REPO / "docs" / "OBSERVABILITY.md"


def _families(port: int) -> dict[str, object]:
    page = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10).read().decode()
    return {f.name: f for f in text_string_to_metric_families(page) if not f.name.endswith("_created")}


def _samples(families: dict, name: str) -> list:
    return list(families[name].samples) if name in families else []


def _exposed(family) -> str:
    """The name a query uses: a counter's with _total."""
    return family.name + "_total" if family.type == "counter" else family.name


def _documented() -> set[str]:
    """The metric names of the docs' table (its rows start with | `name` |)."""
    return set(re.findall(r"^\| `((?:sentiment|process)_\w+)` \|", DOC.read_text(encoding="utf-8"), re.M))


def _calls(port: int) -> None:
    """One answered and one refused call: every labelled family gets a series."""
    with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
        stub = pb_grpc.SentimentServiceStub(channel)
        stub.Classify(pb.ClassifyRequest(texts=[TEXT]), timeout=30)
        with pytest.raises(grpc.RpcError):
            stub.Classify(pb.ClassifyRequest(texts=[" "]), timeout=30)


def _check_conventions(families: dict) -> None:
    for name, f in families.items():
        assert re.fullmatch(r"(sentiment|process)_[a-z0-9_]+", name), name
        assert not re.search(r"_(ms|milliseconds|kb|mb|percent)(_|$)", name), f"{name}: not a base unit"
        if f.type == "counter":
            assert all(s.name.endswith("_total") for s in f.samples), name
        if name.endswith("_info"):
            assert f.type == "gauge" and [s.value for s in f.samples] == [1.0], name
        if f.type == "histogram":
            assert {s.name.removeprefix(name) for s in f.samples} == {"_bucket", "_count", "_sum"}, name


def _check_info(families: dict, bundle: Path) -> None:
    (model,) = _samples(families, "sentiment_model_info")
    assert model.labels == {"bundle_sha256": verify_bundle(bundle).bundle_sha256, "precision": "fp32",
                            "provider": "CPUExecutionProvider", "model": "sentiment", "version": "1"}
    (build,) = _samples(families, "sentiment_build_info")
    assert build.labels == {"version": importlib.metadata.version("transfer-sentiment"),
                            "onnxruntime": __import__("onnxruntime").__version__, "grpcio": grpc.__version__,
                            "python": platform.python_version()}


def test_info_serving_and_conventional_names_in_one_process_and_workers_all_in_the_docs(tiny_bundle: Path) -> None:
    seen: set[str] = set()
    server = ServerProcess(tiny_bundle, "--device", "cpu", "--metrics-port", "0", "--drain-delay-s", "30")
    try:
        _calls(server.wait_listening())
        families = _families(server.metrics_port)
        _check_conventions(families)
        _check_info(families, tiny_bundle)
        assert [s.value for s in _samples(families, "sentiment_serving")] == [1.0]
        seen |= {_exposed(f) for f in families.values()}
        server.proc.send_signal(15)  # SIGTERM: NOT_SERVING for drain_delay_s, still answering
        wait_until(lambda: [s.value for s in _samples(_families(server.metrics_port), "sentiment_serving")] == [0.0],
                   what="sentiment_serving 0 once draining")
    finally:
        server.close()
    server = ServerProcess(tiny_bundle, "--device", "cpu", "--workers", "2", "--metrics-port", "0")
    try:
        _calls(server.wait_listening())
        families = _families(server.metrics_port)
        _check_conventions(families)
        _check_info(families, tiny_bundle)  # one series each: the largest over the live workers
        assert [s.value for s in _samples(families, "sentiment_serving")] == [1.0]
        seen |= {_exposed(f) for f in families.values()}
    finally:
        server.close()
    # The table names every metric one process or a --workers parent serves, and nothing else.
    assert _documented() == seen
