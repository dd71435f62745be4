"""The unmodified `tritonclient` package talks to our server (KServe v2 / Triton gRPC protocol).

tritonclient 2.73 requires protobuf < 7 and our generated code protobuf >= 7.35.1, so the client runs from its
own virtualenv (.venv-triton, `make triton-venv`, pinned in requirements-triton.lock) as a subprocess:
tests/triton_client_check.py. Outside CI a missing .venv-triton skips these tests; in CI it fails them.
"""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import numpy as np
import pytest
from serving_fixtures import REPO_ROOT, reviews, running_server, target

from serving.gen.inference import grpc_service_pb2
from serving.model.predictor import Predictor

TRITON_PYTHON = Path(os.environ.get("TRITON_PYTHON", REPO_ROOT / ".venv-triton" / "bin" / "python"))
SCRIPT = REPO_ROOT / "tests" / "triton_client_check.py"
TOKEN = "triton-test-token-0123456789"


def _run(*args: str, stdin: str) -> dict:
    if not TRITON_PYTHON.exists():
        message = f"{TRITON_PYTHON} missing: run `make triton-venv` (tritonclient needs its own protobuf < 7)"
        if os.environ.get("CI"):
            pytest.fail(message)
        pytest.skip(message)
    out = subprocess.run([str(TRITON_PYTHON), str(SCRIPT), *args], input=stdin, capture_output=True, text=True,
                         timeout=120, env={k: v for k, v in os.environ.items() if k != "PYTHONPATH"})
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout)


def test_tritonclient_gets_the_in_process_answers(tiny_bundle: Path, data_dir: Path) -> None:
    texts = reviews(data_dir, 6) + ["Un très beau livre.", "Décevant."]
    with running_server(tiny_bundle, device="cpu", auth_token=TOKEN) as server:
        got = _run("infer", target(server), "sentiment", TOKEN, stdin=json.dumps(texts))
    ref = Predictor(tiny_bundle, device="cpu").predict(texts)
    assert got["live"] and got["ready"] and got["model_ready"]
    assert got["server"]["name"] == "sentiment-server"
    assert got["model"]["platform"] == "onnxruntime_onnx" and got["model"]["inputs"][0]["datatype"] == "BYTES"
    assert got["id"] == "triton-1"
    np.testing.assert_allclose(got["probabilities"], np.stack([r.probabilities for r in ref]), atol=1e-5)
    assert got["label"] == [r.label for r in ref]
    assert got["token_count"] == [r.token_count for r in ref]
    assert got["truncated"] == [r.truncated for r in ref]
    assert got["only_label"] == ["label"]
    errors = got["errors"]
    assert errors["unknown model"]["status"] == "StatusCode.NOT_FOUND"
    assert errors["invalid utf-8"]["status"] == "StatusCode.INVALID_ARGUMENT"
    assert "UTF-8" in errors["invalid utf-8"]["message"]
    assert errors["wrong datatype"]["status"] == "StatusCode.INVALID_ARGUMENT"
    assert errors["no token"]["status"] == "StatusCode.UNAUTHENTICATED"


def _fields(d) -> dict:
    return {
        "fields": {f.name: [f.number, f.type, f.is_repeated, f.message_type.name if f.message_type else None,
                            f.containing_oneof.name if f.containing_oneof else None] for f in d.fields},
        "nested": {n.name: _fields(n) for n in d.nested_types},
    }


def test_our_kserve_messages_match_tritonclients_field_by_field() -> None:
    """Wire compatibility for every client of the protocol, not only the calls the test above makes."""
    names = list(grpc_service_pb2.DESCRIPTOR.message_types_by_name)
    theirs = _run("descriptors", stdin=json.dumps(names))
    ours = {n: _fields(grpc_service_pb2.DESCRIPTOR.message_types_by_name[n]) for n in names}
    assert ours == theirs
