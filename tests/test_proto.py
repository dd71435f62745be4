"""The committed generated code in serving/gen/ is what `make proto` (proto/gen.py) writes from proto/ now."""

from __future__ import annotations

import importlib.util
from pathlib import Path

from procs import REPO


def _gen():
    """proto/gen.py, a build script beside the .proto files (no package imports it), loaded from its path."""
    spec = importlib.util.spec_from_file_location("proto_gen", REPO / "proto" / "gen.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _files(root: Path) -> dict[str, bytes]:
    return {p.relative_to(root).as_posix(): p.read_bytes()
            for p in sorted(root.rglob("*")) if p.is_file() and "__pycache__" not in p.parts}


def test_generated_code_is_not_stale(tmp_path: Path) -> None:
    gen = _gen()
    fresh = _files(gen.generate(tmp_path))
    committed = _files(gen.REPO / gen.PACKAGE)
    assert sorted(fresh) == sorted(committed), "run `make proto`: generated files differ in name"
    stale = [name for name in fresh if fresh[name] != committed[name]]
    assert not stale, f"run `make proto`: {stale} differ from what proto/ generates"


def test_generated_modules_import_inside_the_package() -> None:
    from serving.gen.inference import grpc_service_pb2_grpc
    from serving.gen.sentiment.v1 import sentiment_service_pb2, sentiment_service_pb2_grpc

    assert sentiment_service_pb2.DESCRIPTOR.package == "sentiment.v1"
    assert hasattr(sentiment_service_pb2_grpc, "SentimentServiceStub")
    assert hasattr(grpc_service_pb2_grpc, "GRPCInferenceServiceStub")
