"""`export --check` as a CI step (thresholds, exit codes, JSON and JUnit reports) and `export --triton-repo` (a model
repository whose config.pbtxt Triton's own schema parses, matching the graph it serves)."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import xml.etree.ElementTree as ET
from pathlib import Path

import onnx
import pytest
from bundles import edit_manifest
from procs import REPO

from trainer.__main__ import main as cli

TEST_FILE = "cls-books-fr/test.review.txt"
LIMIT = "300"
TRITON_PYTHON = Path(os.environ.get("TRITON_PYTHON", REPO / ".venv-triton" / "bin" / "python"))


def check(bundle: Path, data_dir: Path, *thresholds: str) -> list[str]:
    return ["export", "--check", str(bundle), "--data", str(data_dir / TEST_FILE), "--limit", LIMIT, *thresholds]


@pytest.fixture
def swapped(tiny_bundle: Path, tmp_path: Path) -> Path:
    """The tiny bundle with its two label values swapped: on two classes, accuracy 100 - the tiny bundle's."""
    out = Path(shutil.copytree(tiny_bundle, tmp_path / "swapped"))
    edit_manifest(out, lambda m: m.update(label_values=m["label_values"][::-1]))
    return out


def test_met_thresholds_exit_0_with_json_and_junit_reports(default_bundle: Path, swapped: Path, data_dir: Path,
                                                           tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    reports = tmp_path / "reports"
    reports.mkdir()
    rc = cli(check(default_bundle, data_dir, "--min-accuracy", "1", "--min-agreement", "90", "--baseline",
                   str(swapped), "--max-drop", "20", "--json", str(reports / "c.json"),
                   "--junit", str(reports / "c.xml")))
    out = capsys.readouterr().out
    assert rc == 0, out
    report = json.loads((reports / "c.json").read_text())
    assert report["passed"] is True and report["exit_code"] == 0 and report["examples"] == 300
    assert report["bundle_sha256"] == json.loads((default_bundle / "manifest.json").read_text())["bundle_sha256"]
    assert {(t["threshold"], t["graph"]) for t in report["thresholds"]} == {
        ("min-accuracy", "model.int8.onnx"), ("min-accuracy", "model.onnx"), ("min-agreement", "model.int8.onnx"),
        ("min-agreement", "model.onnx"), ("max-drop", "model.int8.onnx"), ("max-drop", "model.onnx")}
    assert report["baseline"]["bundle"] == str(swapped)
    cpu_acc = report["graphs"]["model.int8.onnx"]["bundle_accuracy"]
    assert f"PASS min-accuracy: model.int8.onnx (cpu): accuracy {cpu_acc:.2f}% >= 1%" in out
    suite = ET.parse(reports / "c.xml").getroot().find("testsuite")
    assert suite.get("tests") == "8" and suite.get("failures") == "0"  # 2 graphs scored + 6 thresholds
    assert {c.get("name") for c in suite.iter("testcase")} == {"verify and score", "min-accuracy", "min-agreement",
                                                                "max-drop"}


def test_a_threshold_not_met_exits_1_and_the_reports_say_which(tiny_bundle: Path, swapped: Path, data_dir: Path,
                                                         tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """The tiny bundle is the swapped one's accuracy mirrored (below 50% one way, above the other): against it as
    baseline, the drop is the difference of the two."""
    rc = cli(check(swapped, data_dir, "--json", str(tmp_path / "s.json")))
    assert rc == 0
    better = json.loads((tmp_path / "s.json").read_text())["graphs"]["model.onnx"]["bundle_accuracy"]
    rc = cli(check(tiny_bundle, data_dir, "--min-accuracy", "99.5", "--baseline", str(swapped), "--max-drop", "0",
                   "--json", str(tmp_path / "c.json"), "--junit", str(tmp_path / "c.xml")))
    out = capsys.readouterr().out
    assert rc == 1
    report = json.loads((tmp_path / "c.json").read_text())
    acc = report["graphs"]["model.onnx"]["bundle_accuracy"]
    assert acc + better == pytest.approx(100.0) and acc < better  # the tiny model is worse than a coin: 48%
    assert report["passed"] is False and report["exit_code"] == 1
    limits = {t["threshold"]: t for t in report["thresholds"]}
    assert limits["min-accuracy"]["passed"] is False and limits["min-accuracy"]["value"] == acc
    assert limits["max-drop"]["passed"] is False and limits["max-drop"]["serves"] == ["cpu", "cuda"]
    assert limits["max-drop"]["value"] == pytest.approx(acc - better, abs=1e-3)
    assert f"FAIL min-accuracy: model.onnx (cpu, cuda): accuracy {acc:.2f}% < 99.5%" in out
    suite = ET.parse(tmp_path / "c.xml").getroot().find("testsuite")
    failures = [c.find("failure") for c in suite.iter("testcase") if c.find("failure") is not None]
    assert suite.get("failures") == "2" and len(failures) == 2
    assert {f.get("type") for f in failures} == {"min-accuracy", "max-drop"}


def test_bad_input_exits_2_in_one_line_and_writes_no_report(tiny_bundle: Path, data_dir: Path, tmp_path: Path,
                                                            capsys: pytest.CaptureFixture[str]) -> None:
    report = tmp_path / "c.json"
    cases = {
        "baseline without drop": (check(tiny_bundle, data_dir, "--baseline", str(tiny_bundle)),
                                  "--baseline BUNDLE and --max-drop POINTS go together"),
        "percent out of range": (check(tiny_bundle, data_dir, "--min-accuracy", "120"),
                                 "--min-accuracy 120.0: a percentage in [0, 100]"),
        "no data": (["export", "--check", str(tiny_bundle), "--data", str(tmp_path / "none.tsv")], "none.tsv"),
        "no baseline": (check(tiny_bundle, data_dir, "--baseline", str(tmp_path / "gone"), "--max-drop", "1"),
                        "gone: bundle folder not found"),
        "threshold without check": (["export", "--min-accuracy", "50"], "go with --check BUNDLE"),
    }
    for name, (argv, message) in cases.items():
        rc = cli([*argv, "--json", str(report)])
        err = capsys.readouterr().err
        assert rc == 2 and err.count("\n") == 1 and message in err, (name, err)
        assert not report.exists(), name


def test_min_agreement_needs_the_pytorch_model(tiny_bundle: Path, data_dir: Path, tmp_path: Path,
                                               tiny_classifier_artifact: Path,
                                               capsys: pytest.CaptureFixture[str]) -> None:
    moved = Path(shutil.copytree(tiny_bundle, tmp_path / "moved"))
    edit_manifest(moved, lambda m: m["source_artifact"].update(path=str(tmp_path / "elsewhere")))
    assert cli(check(moved, data_dir, "--min-agreement", "90")) == 2
    assert "--min-agreement compares with the PyTorch model" in capsys.readouterr().err
    assert cli(check(moved, data_dir, "--min-agreement", "90", "--artifact", str(tiny_classifier_artifact))) == 0


# ---------------------------------------------------------------------------------------------- Triton

PARSE_CONFIG = """
import json, sys
from google.protobuf import json_format, text_format
from tritonclient.grpc import model_config_pb2

config = text_format.Parse(open(sys.argv[1], encoding="utf-8").read(), model_config_pb2.ModelConfig())
print(json.dumps(json_format.MessageToDict(config, preserving_proto_field_name=True)))
"""

TRITON_TYPES = {onnx.TensorProto.INT64: "TYPE_INT64", onnx.TensorProto.FLOAT: "TYPE_FP32"}


def triton_config(path: Path) -> dict:
    """config.pbtxt parsed by protobuf's text format with Triton's own ModelConfig (tritonclient, .venv-triton)."""
    if not TRITON_PYTHON.exists():
        pytest.fail(f"{TRITON_PYTHON} missing: run `make triton-venv`")
    run = subprocess.run([str(TRITON_PYTHON), "-c", PARSE_CONFIG, str(path)], capture_output=True, text=True,
                         timeout=120, env={k: v for k, v in os.environ.items() if k != "PYTHONPATH"})
    assert run.returncode == 0, run.stderr[-3000:]
    return json.loads(run.stdout)


def as_triton(values: list[onnx.ValueInfoProto]) -> list[dict]:
    """An ONNX graph's inputs or outputs as Triton declares them with max_batch_size > 0: without the batch axis,
    symbolic dims as -1 (MessageToDict writes int64 as strings)."""
    out = []
    for v in values:
        t = v.type.tensor_type
        dims = [str(-1 if d.dim_param else d.dim_value) for d in t.shape.dim[1:]]
        out.append({"name": v.name, "data_type": TRITON_TYPES[t.elem_type], "dims": dims})
    return out


@pytest.mark.parametrize("device", ["cuda", "cpu"])
def test_triton_repository_matches_the_graph_it_serves(default_bundle: Path, tmp_path: Path, device: str,
                                                       capsys: pytest.CaptureFixture[str]) -> None:
    repo = tmp_path / "triton"
    (repo / "other").mkdir(parents=True)  # another model of the repository stays
    rc = cli(["export", "--triton-repo", str(repo), "--from-bundle", str(default_bundle), "--triton-device", device])
    assert rc == 0, capsys.readouterr().err
    manifest = json.loads((default_bundle / "manifest.json").read_text())
    graph_file = manifest["serve"][device]
    model = repo / "sentiment"
    assert sorted(str(p.relative_to(repo)) for p in repo.rglob("*")) == [
        "other", "sentiment", "sentiment/1", "sentiment/1/model.onnx", "sentiment/config.pbtxt",
        "sentiment/labels.txt"]
    assert (model / "1" / "model.onnx").read_bytes() == (default_bundle / graph_file).read_bytes()
    assert (model / "labels.txt").read_text().split("\n")[:-1] == manifest["label_names"]

    config = triton_config(model / "config.pbtxt")
    graph = onnx.load(str(model / "1" / "model.onnx")).graph
    assert config["name"] == "sentiment" and config["platform"] == "onnxruntime_onnx"
    # the CPU's int8 graph quantizes per run: Triton must not join other requests to it
    assert config["max_batch_size"] == 64 and ("dynamic_batching" in config) == (device == "cuda")
    assert [{k: i[k] for k in ("name", "data_type", "dims")} for i in config["input"]] == as_triton(graph.input)
    assert [{k: o[k] for k in ("name", "data_type", "dims")} for o in config["output"]] == as_triton(graph.output)
    assert config["output"][0]["label_filename"] == "labels.txt"
    params = {k: v["string_value"] for k, v in config["parameters"].items()}
    assert params["bundle_sha256"] == manifest["bundle_sha256"] and params["bundle_graph"] == graph_file
    assert params["precision"] == manifest["graphs"][graph_file]["precision"]
    assert int(params["max_len"]) == manifest["max_len"] and params["pad_id"] == "1"
    assert config.get("instance_group", [{}])[0].get("kind") == ("KIND_CPU" if device == "cpu" else None)


def test_triton_repository_refuses_to_replace_another_folder(default_bundle: Path, tmp_path: Path,
                                                             capsys: pytest.CaptureFixture[str]) -> None:
    (tmp_path / "triton" / "sentiment").mkdir(parents=True)
    (tmp_path / "triton" / "sentiment" / "keep.txt").write_text("mine")
    rc = cli(["export", "--triton-repo", str(tmp_path / "triton"), "--from-bundle", str(default_bundle)])
    assert rc == 2 and "is not a Triton model (no config.pbtxt)" in capsys.readouterr().err
    assert (tmp_path / "triton" / "sentiment" / "keep.txt").read_text() == "mine"
