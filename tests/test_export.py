"""ONNX export: the bundle matches PyTorch on many shapes, describes itself (manifest and each graph's
metadata_props), loads without torch, refuses tampering, refuses lengths beyond the positional table, serves int8 on
the CPU only within its bound, is the same bytes for the same artifact, and its int8/fp16 graphs hold their stated
tolerances.

The CI export step is `default_bundle` and `tiny_bundle` (tests/conftest.py): train a tiny classifier a few steps,
export (by default, and with one fp32 graph), validate; `test_ci_export_step_loads_like_the_server` then opens it the
way the server does.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import onnx
import pytest
import torch
from bundles import edit_manifest
from procs import NO_ORT_CUDA, REPO

from contract.bundle import verify_bundle
from contract.errors import BundleError
from contract.graph import INPUTS, OUTPUT
from contract.runtime import CPU, cuda_driver_present, inference_session
from trainer import artifact
from trainer.__main__ import main as cli
from trainer.export import ExportError, ExportOptions, ExportValidationError, check_bundle, export_bundle
from trainer.export.cli import add_arguments, options_from_args
from trainer.export.graph import STACK_TRACE, check_graph
from trainer.export.quantize import INT8_CPU_BOUND, TOLERANCES, Tolerance
from trainer.export.validate import compare, make_batch, ort_logits, torch_logits, validate

TEST_FILE = "cls-books-fr/test.review.txt"


def manifest_of(bundle: Path) -> dict:
    return json.loads((bundle / "manifest.json").read_text(encoding="utf-8"))


def validation_of(bundle: Path, graph: str = "model.onnx") -> dict:
    return manifest_of(bundle)["graphs"][graph]["validation"]


def leftovers(parent: Path, name: str) -> list[Path]:
    """Temporary siblings an export might leave behind."""
    return [p for p in parent.iterdir() if p.name.startswith(f".{name}.")]


# ---------------------------------------------------------------------------------------------- fp32 bundle


def test_validation_of_the_tiny_trained_model_covers_every_shape(default_bundle):
    v = validation_of(default_bundle)
    assert v["passed"] is True and v["provider"] == "CPUExecutionProvider"
    names = [c["input"] for c in v["cases"]]
    for b in (1, 2, 13):
        for t in (1, 7, 48):
            assert f"{b}x{t}" in names
    assert sum("padded" in n for n in names) == 3
    assert v["max_abs_diff"] <= 1e-4 == v["tolerance"]["max_abs_diff"] and v["tolerance"]["rel_diff"] == 0
    assert v["label_agreement"] == 1.0
    # The CPU graph: the same cases, held to the bound under which int8 serves the CPU.
    int8 = validation_of(default_bundle, "model.int8.onnx")
    assert [c["input"] for c in int8["cases"]] == names and int8["passed"] is True
    assert int8["tolerance"] == dataclasses.asdict(INT8_CPU_BOUND)
    assert 0 < int8["max_abs_diff"] <= min(c["tolerance"] for c in int8["cases"])


def test_bundle_matches_pytorch_on_a_fresh_padded_batch(tiny_bundle, tiny_classifier_artifact):
    model = artifact.load(tiny_classifier_artifact).model()
    session = inference_session(tiny_bundle / "model.onnx", device="cpu")
    rng = np.random.default_rng(7)
    for lengths, width in (([5, 48, 1, 17, 30], 48), ([3] * 11, 3), ([31, 2, 9], 33)):
        ids, mask = make_batch(lengths, width, 99, 1, rng)
        ref, got = torch_logits(model, ids, mask), ort_logits(session, ids, mask)
        assert got.dtype == np.float32 and got.shape == (len(lengths), 2)
        np.testing.assert_allclose(got, ref, atol=1e-4, rtol=0)
    # The trained model decides: not every logit pair is a tie (else label checks would prove nothing).
    assert np.abs(ref[:, 0] - ref[:, 1]).max() > 1e-2


def test_validation_fails_naming_the_shape_when_logits_differ(tiny_bundle, tiny_classifier_artifact):
    model = artifact.load(tiny_classifier_artifact).model()
    with torch.no_grad():
        model.head.bias[0] += 1e-3  # PyTorch now differs from the exported graph by 1e-3 on every row
    session = inference_session(tiny_bundle / "model.onnx", device="cpu")
    with pytest.raises(ExportValidationError, match=r"fp32 bundle differs from PyTorch on input 1x1: "
                                                    r"max \|logit diff\| 0\.001 > tolerance 0\.0001"):
        validate(model, session, "fp32", 48, 99, 1)


def test_compare_counts_flips_only_outside_near_ties():
    ref = np.array([[0.0, 1.0], [0.0, 0.05], [2.0, 0.0]], dtype=np.float32)
    got = np.array([[1.0, 0.0], [0.05, 0.0], [2.0, 0.0]], dtype=np.float32)
    # bound 0.1: row 0 (gap 1.0) is decided and flipped; row 1 (gap 0.05 < 0.2) is a near-tie.
    assert compare(ref, got, 0.1) == (1.0, 1, 1)
    assert compare(ref, ref, 0.0) == (0.0, 0, 0)


def test_manifest_describes_the_bundle(default_bundle, tiny_classifier_artifact):
    m = manifest_of(default_bundle)
    src = json.loads((tiny_classifier_artifact / "artifact.json").read_text())
    assert m["format"] == 4 and m["task"] == "sentiment-classification"
    assert {n: g["precision"] for n, g in m["graphs"].items()} == {"model.onnx": "fp32", "model.int8.onnx": "int8"}
    assert m["serve"] == {"cpu": "model.int8.onnx", "cuda": "model.onnx"}
    assert m["cpu_int8"]["accepted"] is True and m["cpu_int8"]["bound"] == dataclasses.asdict(INT8_CPU_BOUND)
    assert m["graphs"]["model.int8.onnx"]["quantization"]["method"] == "dynamic"
    assert m["graphs"]["model.onnx"]["quantization"] is None
    assert m["label_names"] == ["negative", "positive"] and m["max_len"] == 48 and "labels" not in m
    assert m["data_fields"] == {"text_field": "text", "label_field": "label"}
    assert m["special_ids"] == {"sos": 0, "pad": 1, "eos": 2, "oov": 3}
    assert m["inputs"] == [{"name": n, "dtype": d, "shape": ["batch", "sequence"]} for n, d in INPUTS]
    assert m["outputs"] == [{"name": OUTPUT[0], "dtype": "float32", "shape": ["batch", 2]}]
    assert set(m["files"]) == {"model.onnx", "model.int8.onnx", "tokenizer/spm.model", "tokenizer/vocab.txt",
                               "tokenizer/meta.json", "MODEL_CARD.md"}
    assert m["source_artifact"]["weights_sha256"] == src["weights_sha256"]
    assert {"torch", "onnx", "onnxruntime", "onnxscript"} <= set(m["versions"])
    graph = onnx.load(str(default_bundle / "model.onnx"))
    assert m["opset"] == next(o.version for o in graph.opset_import if o.domain == "") >= 18
    assert not graph.graph.initializer or all(not t.external_data for t in graph.graph.initializer)
    assert sorted(p.name for p in default_bundle.iterdir()) == ["MODEL_CARD.md", "manifest.json", "model.int8.onnx",
                                                             "model.onnx", "tokenizer"]
    # The typed manifest writes back the very bytes the exporter wrote.
    b = verify_bundle(default_bundle)
    assert b.manifest.to_json() == (default_bundle / "manifest.json").read_text(encoding="utf-8")
    assert b.manifest.label_names == m["label_names"] and b.manifest.label_values == src["label_values"] == ["0", "1"]


def test_model_bytes_hold_no_path_of_the_machine_that_exported_them(tiny_bundle):
    """The dynamo exporter writes each node's Python stack (absolute paths of the checkout and the virtualenv): the
    exporter drops it, so the same artifact gives the same bundle bytes from any folder, and leaks none."""
    data = (tiny_bundle / "model.onnx").read_bytes()
    assert str(REPO).encode() not in data and sys.prefix.encode() not in data
    graph = onnx.load_model_from_string(data).graph
    assert all(p.key != STACK_TRACE for n in graph.node for p in n.metadata_props)
    assert any(p.key == "namespace" for p in graph.node[0].metadata_props)  # the rest of the metadata stays


def test_graph_check_catches_renamed_axes_and_checker_errors(tiny_bundle):
    graph = onnx.load(str(tiny_bundle / "model.onnx"))
    check_graph(graph, 2, "tiny")
    renamed = onnx.ModelProto()
    renamed.CopyFrom(graph)
    renamed.graph.input[1].type.tensor_type.shape.dim[1].dim_param = "tokens"
    with pytest.raises(ExportError, match=r"tiny: graph inputs .*'tokens'.* differ from the declared inputs"):
        check_graph(renamed, 2, "tiny")
    with pytest.raises(ExportError, match="differ from the declared"):
        check_graph(graph, 3, "tiny")  # a 3-class head was declared
    broken = onnx.ModelProto()
    broken.CopyFrom(graph)
    broken.graph.node[0].input[0] = "no_such_tensor"
    with pytest.raises(ExportError, match="tiny: onnx.checker failed"):
        check_graph(broken, 2, "tiny")


def test_ci_export_step_loads_like_the_server(tiny_bundle, tiny_tokenizer):
    session = inference_session(tiny_bundle / "model.onnx")
    assert [i.name for i in session.get_inputs()] == [n for n, _ in INPUTS]
    assert [o.name for o in session.get_outputs()] == [OUTPUT[0]]
    texts = ["Un livre magnifique, je le recommande.", "Ennuyeux.", "Pas terrible, une histoire sans intérêt " * 9]
    seqs = tiny_tokenizer.encode_batch(texts)
    assert len(seqs[2]) == 48  # cut to max_len
    ids, mask = make_batch([len(s) for s in seqs], max(map(len, seqs)), 99, 1, np.random.default_rng(0))
    for row, s in enumerate(seqs):
        ids[row, :len(s)] = s
    logits = ort_logits(session, ids, mask)
    assert logits.shape == (3, 2) and np.isfinite(logits).all()


FRESH_PROCESS = textwrap.dedent("""
    import hashlib, json, sys
    from pathlib import Path
    import numpy as np
    import onnxruntime as ort
    import sentencepiece as spm

    bundle = Path(sys.argv[1])
    manifest = json.loads((bundle / "manifest.json").read_text())
    for name, digest in manifest["files"].items():
        assert hashlib.sha256((bundle / name).read_bytes()).hexdigest() == digest, name
    sp = spm.SentencePieceProcessor(model_file=str(bundle / "tokenizer" / "spm.model"))
    vocab = {p: i + 4 for i, p in enumerate((bundle / "tokenizer" / "vocab.txt").read_text().split("\\n")[:-1])}
    texts = json.loads(sys.argv[2])
    n = manifest["max_len"]
    seqs = [[0] + [vocab.get(p, 3) for p in sp.encode(t, out_type=str)][: n - 2] + [2] for t in texts]
    width = max(map(len, seqs))
    ids = np.full((len(seqs), width), manifest["special_ids"]["pad"], dtype=np.int64)
    mask = np.zeros_like(ids)
    for r, s in enumerate(seqs):
        ids[r, : len(s)], mask[r, : len(s)] = s, 1
    session = ort.InferenceSession(str(bundle / "model.onnx"), providers=["CPUExecutionProvider"])
    logits = session.run([manifest["outputs"][0]["name"]],
                         {manifest["inputs"][0]["name"]: ids, manifest["inputs"][1]["name"]: mask})[0]
    print(json.dumps({"ids": ids.tolist(), "logits": logits.tolist(),
                      "modules": sorted(m for m in sys.modules if m.split(".")[0] in ("torch", "trainer"))}))
""")


def test_bundle_runs_in_a_fresh_process_without_torch_or_trainer(tiny_bundle, tiny_classifier_artifact,
                                                                  tiny_tokenizer):
    texts = ["Un roman passionnant du début à la fin.", "Je me suis ennuyé.", "Bof."]
    run = subprocess.run([sys.executable, "-I", "-c", FRESH_PROCESS, str(tiny_bundle), json.dumps(texts)],
                         capture_output=True, text=True, timeout=60, cwd=tiny_bundle)
    assert run.returncode == 0, run.stderr
    out = json.loads(run.stdout)
    assert out["modules"] == []  # neither torch nor trainer was imported to serve the bundle
    ids = np.array(out["ids"], dtype=np.int64)
    # Same ids as the project's tokenizer, same logits as PyTorch.
    for row, text in enumerate(texts):
        want = tiny_tokenizer.encode(text)
        assert ids[row, :len(want)].tolist() == want
    model = artifact.load(tiny_classifier_artifact).model()
    np.testing.assert_allclose(out["logits"], torch_logits(model, ids, (ids != 1).astype(np.int64)), atol=1e-4)


# ---------------------------------------------------------------------------------------------- fused attention


@pytest.mark.parametrize("causal", [True, False])
def test_fused_attention_swap_computes_the_plain_model(causal):
    from trainer.config.schema import ModelConfig
    from trainer.model.encoder import Classifier
    from trainer.model.onnx_attention import FusedSelfAttention, with_fused_attention

    torch.manual_seed(0)
    model = Classifier(ModelConfig(vocab_size=99, d_model=30, n_layers=2, n_heads=3, d_ff=7, max_positions=20,
                                   num_classes=3, classifier_causal=causal)).eval()
    fused = with_fused_attention(model)
    assert all(isinstance(layer.self_attn, FusedSelfAttention) for layer in fused.encoder.layers.layers)
    assert not any(isinstance(m, FusedSelfAttention) for m in model.modules())  # the model stays plain
    ids, mask = make_batch([13, 1, 7, 13, 2], 13, 99, 1, np.random.default_rng(0))
    np.testing.assert_allclose(torch_logits(fused, ids, mask), torch_logits(model, ids, mask), atol=1e-5)


def test_default_bundle_has_one_fused_attention_node_per_layer(tiny_bundle):
    graph = onnx.load(str(tiny_bundle / "model.onnx")).graph
    attention = [n for n in graph.node if n.op_type == "Attention" and n.domain == "com.microsoft"]
    assert len(attention) == 2  # tiny: 2 layers
    assert {a.name: onnx.helper.get_attribute_value(a) for a in attention[0].attribute} == \
        {"num_heads": 2, "unidirectional": 1}  # tiny classifies with the lab's causal mask
    m = manifest_of(tiny_bundle)
    assert m["runtime"]["fused_attention"] is True and m["opset_imports"]["com.microsoft"] == 1


@pytest.mark.slow  # 12 s; the unfused graph is an option, the default export is tested throughout
def test_unfused_export_uses_plain_onnx_ops_and_validates(tiny_classifier_artifact, tmp_path):
    out = export_bundle(tiny_classifier_artifact, tmp_path / "plain", ExportOptions(fuse_attention=False))
    m = manifest_of(out)
    assert m["runtime"]["fused_attention"] is False and set(m["opset_imports"]) == {"ai.onnx"}
    assert validation_of(out)["passed"] and validation_of(out)["max_abs_diff"] <= 1e-4
    assert not any(n.domain for n in onnx.load(str(out / "model.onnx")).graph.node)


def test_mean_pooled_bidirectional_classifier_exports_and_validates(tiny_classifier_artifact, tiny_tokenizer,
                                                                    tmp_path):
    """The English preset's classifier (mean pooling, no causal mask) through the real exporter and validation."""
    from trainer.model.encoder import Classifier

    src = artifact.load(tiny_classifier_artifact)
    model_cfg = dataclasses.replace(src.cfg.model, pooling="mean", classifier_causal=False)
    model = Classifier(model_cfg).eval()
    model.load_state_dict(src.state)
    art = artifact.save(tmp_path / "mean", model, dataclasses.replace(src.cfg, model=model_cfg), "classifier",
                        tiny_tokenizer)
    out = export_bundle(art, tmp_path / "bundle")
    m = manifest_of(out)
    assert validation_of(out)["passed"] and validation_of(out)["max_abs_diff"] <= 1e-4
    assert m["source_artifact"]["model"]["pooling"] == "mean"
    # Still one fused node per layer (2), now without the causal mask: unidirectional 0, written or by default.
    attention = [n for n in onnx.load(str(out / "model.onnx")).graph.node if n.op_type == "Attention"]
    causal = [{a.name: onnx.helper.get_attribute_value(a) for a in n.attribute}.get("unidirectional", 0)
              for n in attention]
    assert causal == [0, 0]


# ---------------------------------------------------------------------------------------------- tampering


@pytest.fixture
def bundle_copy(tiny_bundle, tmp_path) -> Path:
    return Path(shutil.copytree(tiny_bundle, tmp_path / "bundle"))


def test_tampered_model_is_rejected(bundle_copy):
    data = bytearray((bundle_copy / "model.onnx").read_bytes())
    data[len(data) // 2] ^= 0x01  # one bit in the weights
    (bundle_copy / "model.onnx").write_bytes(bytes(data))
    with pytest.raises(BundleError, match=r"model\.onnx: checksum mismatch: manifest\.json says sha256"):
        verify_bundle(bundle_copy)


def test_manifest_that_does_not_match_the_graph_is_rejected(bundle_copy):
    edit_manifest(bundle_copy, lambda m: m["inputs"][1].update(name="padding_mask"))
    with pytest.raises(BundleError, match=r"inputs .*padding_mask.* do not match model\.onnx's .*attention_mask"):
        verify_bundle(bundle_copy)


def test_manifest_with_wrong_label_count_or_missing_file_is_rejected(bundle_copy):
    original = {p: p.read_bytes() for p in bundle_copy.glob("*.*")}  # manifest.json and the graphs it reseals
    edit_manifest(bundle_copy, lambda m: m.update(label_names=["neg", "neutral", "pos"],
                                                  label_values=["0", "1", "2"]))
    with pytest.raises(BundleError, match=r"model\.onnx: logits has 2 classes but manifest\.json lists 3 labels"):
        verify_bundle(bundle_copy)
    for path, data in original.items():
        path.write_bytes(data)
    (bundle_copy / "tokenizer" / "vocab.txt").unlink()
    with pytest.raises(BundleError, match=r"tokenizer/vocab\.txt: listed in manifest\.json but missing"):
        verify_bundle(bundle_copy)


def test_check_command_refuses_a_tampered_bundle(bundle_copy, data_dir, capsys):
    (bundle_copy / "tokenizer" / "vocab.txt").write_text("tampered\n")
    rc = cli(["export", "--check", str(bundle_copy), "--data", str(data_dir / TEST_FILE)])
    assert rc == 2
    assert "vocab.txt: checksum mismatch: manifest.json says sha256" in capsys.readouterr().err


# ---------------------------------------------------------------------------------------------- refusals


def test_export_refused_beyond_the_positional_table(tiny_classifier_artifact, tmp_path):
    out = tmp_path / "bundle"
    with pytest.raises(ValueError, match=r"max_len=65 exceeds model\.max_positions=64"):
        export_bundle(tiny_classifier_artifact, out, ExportOptions(max_len=65))
    # An artifact whose tokenizer cuts at 48 but whose table holds 40 positions: its config is refused when read
    # (the run config checks tokenizer.max_len against model.max_positions, trainer/config/schema.py).
    short = Path(shutil.copytree(tiny_classifier_artifact, tmp_path / "short"))
    cfg = json.loads((short / "config.json").read_text())
    cfg["model"]["max_positions"] = 40  # the table is not in the weights (a function of the config)
    (short / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ValueError, match=r"config.json: tokenizer.max_len=48 exceeds model\.max_positions=40"):
        export_bundle(short, out)
    assert not out.exists() and not leftovers(tmp_path, "bundle")


def test_failed_validation_leaves_no_bundle_and_keeps_the_old_one(tiny_classifier_artifact, tiny_bundle,
                                                                   tmp_path, monkeypatch):
    out = Path(shutil.copytree(tiny_bundle, tmp_path / "bundle"))
    before = manifest_of(out)
    monkeypatch.setitem(TOLERANCES, "fp32", Tolerance(0.0, 0.0, 1.0, 0.0))  # nothing is exact enough
    with pytest.raises(ExportValidationError, match=r"on input 1x1: max \|logit diff\| .* > tolerance 0"):
        export_bundle(tiny_classifier_artifact, out)
    assert manifest_of(out) == before and not leftovers(tmp_path, "bundle")


def test_export_refuses_to_replace_a_folder_that_is_not_a_bundle(tiny_classifier_artifact, tmp_path):
    (tmp_path / "notes").mkdir()
    (tmp_path / "notes" / "keep.txt").write_text("mine")
    with pytest.raises(ExportError, match="is not a bundle"):
        export_bundle(tiny_classifier_artifact, tmp_path / "notes")
    assert (tmp_path / "notes" / "keep.txt").read_text() == "mine"


def test_export_refuses_a_language_model_artifact(tiny_classifier_artifact, tiny_tokenizer, tmp_path):
    from trainer.model.encoder import build

    cfg = artifact.load(tiny_classifier_artifact).cfg
    lm = artifact.save(tmp_path / "lm", build(cfg.model, "lm"), cfg, "lm", tiny_tokenizer)
    with pytest.raises(ExportError, match="task 'lm'; only classifier artifacts are exported"):
        export_bundle(lm, tmp_path / "bundle")


# ---------------------------------------------------------------------------------------------- precisions


def weight_bytes(bundle: Path, op_type: str) -> int:
    """Bytes of the initializers that feed `op_type` nodes, directly or through one DequantizeLinear/MatMulInteger."""
    graph = onnx.load(str(bundle / "model.onnx")).graph
    inits = {t.name: t for t in graph.initializer}
    ops = {op_type, "MatMulInteger", "DynamicQuantizeMatMul"}
    names = {i for n in graph.node if n.op_type in ops for i in n.input if i in inits}
    return sum(onnx.numpy_helper.to_array(inits[n]).nbytes for n in names)


def test_int8_export_through_the_cli_records_its_accuracy_change(tiny_classifier_artifact, tiny_bundle, data_dir,
                                                                  tmp_path, capsys):
    out = tmp_path / "int8"
    rc = cli(["export", str(tiny_classifier_artifact), "--out", str(out), "--precision", "int8",
              "--data", str(data_dir / TEST_FILE), "--limit", "400"])
    assert rc == 0, capsys.readouterr().err
    m = manifest_of(out)
    v, tol = m["graphs"]["model.onnx"]["validation"], TOLERANCES["int8"]
    assert m["graphs"]["model.onnx"]["precision"] == "int8" and m["cpu_int8"] is None  # one graph, as asked
    assert m["serve"] == {"cpu": "model.onnx", "cuda": "model.onnx"} and set(m["graphs"]) == {"model.onnx"}
    assert m["graphs"]["model.onnx"]["quantization"]["method"] == "dynamic"
    assert v["passed"] and v["tolerance"]["max_abs_diff"] == tol.max_abs_diff
    assert all(c["max_abs_diff"] <= c["tolerance"] for c in v["cases"])
    assert 0 < v["max_abs_diff"] <= tol.max_abs_diff + tol.rel_diff * 10  # int8 is not exact; logits here < 10
    d = v["data"]
    assert d["examples"] == 400 and d["label_agreement"] >= tol.min_data_agreement
    assert d["accuracy_change_points"] == pytest.approx(d["bundle_accuracy"] - d["torch_accuracy"], abs=1e-2)
    assert -d["accuracy_change_points"] <= tol.max_accuracy_drop
    assert "accuracy" in capsys.readouterr().out
    # int8 weights: the Linear (MatMul) initializers take about a quarter of their fp32 bytes (plus scales).
    assert 0 < weight_bytes(out, "MatMul") < 0.35 * weight_bytes(tiny_bundle, "MatMul")
    verify_bundle(out)
    # The old spelling still asks for the same one-graph bundle.
    assert cli(["export", str(tiny_classifier_artifact), "--out", str(tmp_path / "old"), "--quantize", "int8"]) == 0
    assert manifest_of(tmp_path / "old")["serve"] == {"cpu": "model.onnx", "cuda": "model.onnx"}


def test_fp16_export_keeps_the_served_signature(tiny_classifier_artifact, tmp_path):
    out = export_bundle(tiny_classifier_artifact, tmp_path / "fp16", ExportOptions(precision="fp16"))
    m = manifest_of(out)
    assert m["graphs"]["model.onnx"]["precision"] == "fp16" and m["outputs"][0]["dtype"] == "float32"
    graph = onnx.load(str(out / "model.onnx"))
    assert any(t.data_type == onnx.TensorProto.FLOAT16 for t in graph.graph.initializer)
    # The pinned onnxruntime runs this graph on the CPU provider, so it was validated there: fp16 is not exact,
    # and within its tolerance. (Were a release to drop the CPU kernels, the manifest would say "skipped" and this
    # test would fail: someone must look.)
    v = m["graphs"]["model.onnx"]["validation"]
    assert v["passed"] is True and v["provider"] == CPU and "skipped" not in v
    assert len(v["cases"]) == 12 and 0 < v["max_abs_diff"] <= TOLERANCES["fp16"].max_abs_diff


def test_int8_and_fp16_are_exclusive(tiny_classifier_artifact, tmp_path, capsys):
    rc = cli(["export", str(tiny_classifier_artifact), "--out", str(tmp_path / "b"), "--quantize", "int8", "--fp16"])
    assert rc == 2 and "exclusive" in capsys.readouterr().err
    rc = cli(["export", str(tiny_classifier_artifact), "--out", str(tmp_path / "b"), "--precision", "fp32", "--fp16"])
    assert rc == 2 and "--fp16 and --precision fp32 are exclusive" in capsys.readouterr().err
    with pytest.raises(ExportError, match="per_channel and full_range apply to int8 only"):
        ExportOptions(precision="fp16", per_channel=True)
    rc = cli(["export", str(tiny_classifier_artifact), "--out", str(tmp_path / "b"), "--reduce-range", "--full-range"])
    assert rc == 2 and "--reduce-range (7-bit int8 weights, the default) and --full-range are exclusive" in \
        capsys.readouterr().err
    rc = cli(["export", str(tiny_classifier_artifact), "--out", str(tmp_path / "b"), "--precision", "fp32",
              "--reduce-range"])
    assert rc == 2 and "--reduce-range applies to int8 only, not to fp32" in capsys.readouterr().err
    with pytest.raises(ExportError, match="precision='fp32' writes that one graph only"):
        ExportOptions(precision="fp32", gpu_precision="fp16")
    rc = cli(["export", str(tiny_classifier_artifact), "--out", str(tmp_path / "b"), "--int8-min-agreement", "150"])
    assert rc == 2 and "--int8-min-agreement 150.0: must be between 0 and 100" in capsys.readouterr().err
    rc = cli(["export", str(tiny_classifier_artifact), "--out", str(tmp_path / "b"), "--precision", "fp32",
              "--int8-max-drop", "1"])
    assert rc == 2 and "writes that one graph only" in capsys.readouterr().err
    assert not (tmp_path / "b").exists()


def test_every_export_flag_reaches_its_option() -> None:
    """Each flag, set away from its default, changes the ExportOptions field it names, and only that one."""
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    default = options_from_args(parser.parse_args(["art", "--out", "b"]))
    assert default == ExportOptions()
    cases = {
        ("--precision", "int8"): {"precision": "int8"},
        ("--quantize", "int8"): {"precision": "int8"},
        ("--fp16",): {"precision": "fp16"},
        ("--gpu-precision", "fp16"): {"gpu_precision": "fp16"},
        ("--optimize", "extended"): {"optimize": "extended"},
        ("--save-optimized",): {"save_optimized": True},
        ("--no-fuse-attention",): {"fuse_attention": False},
        ("--per-channel",): {"per_channel": True},
        ("--full-range",): {"full_range": True},
        ("--reduce-range",): {},  # 7-bit weights, the default: kept for the commands that name it
        ("--max-len", "37"): {"max_len": 37},
        ("--data", "d.tsv"): {"data_file": Path("d.tsv")},
        ("--limit", "9"): {"data_limit": 9},
        ("--text-field", "t"): {"text_field": "t"},
        ("--label-field", "l"): {"label_field": "l"},
        ("--int8-max-logit-diff", "0.5"): {"int8_bound": dataclasses.replace(INT8_CPU_BOUND, max_abs_diff=0.5,
                                                                             rel_diff=0.0)},
        ("--int8-min-agreement", "90"): {"int8_bound": dataclasses.replace(INT8_CPU_BOUND, min_data_agreement=0.9)},
        ("--int8-max-drop", "3"): {"int8_bound": dataclasses.replace(INT8_CPU_BOUND, max_accuracy_drop=3.0)},
    }
    for flags, changed in cases.items():
        got = options_from_args(parser.parse_args(["art", "--out", "b", *flags]))
        assert got == dataclasses.replace(default, **changed), flags


# ---------------------------------------------------------------------------------------------- check command


def test_check_reports_accuracy_and_agreement_with_pytorch(default_bundle, tiny_classifier_artifact, data_dir, capsys):
    report = check_bundle(default_bundle, data_dir / TEST_FILE, tiny_classifier_artifact, limit=300)
    assert report["examples"] == 300 and set(report["graphs"]) == {"model.onnx", "model.int8.onnx"}
    fp32, int8 = report["graphs"]["model.onnx"], report["graphs"]["model.int8.onnx"]
    assert fp32["serves"] == ["cuda"] and int8["serves"] == ["cpu"]
    assert fp32["label_agreement"] == 1.0 and fp32["bundle_accuracy"] == fp32["torch_accuracy"]
    assert fp32["max_abs_diff"] <= 1e-4
    assert 0 < int8["max_abs_diff"] < 0.1 and int8["torch_accuracy"] == fp32["torch_accuracy"]
    rc = cli(["export", "--check", str(default_bundle), "--data", str(data_dir / TEST_FILE), "--limit", "50"])
    out = capsys.readouterr().out
    assert rc == 0 and "model.int8.onnx (int8, serves cpu" in out and "label agreement 100.00%" in out


@pytest.mark.gpu
@pytest.mark.skipif(not cuda_driver_present(), reason=NO_ORT_CUDA)
def test_fp16_bundle_runs_on_cuda(tiny_classifier_artifact, tmp_path):
    out = export_bundle(tiny_classifier_artifact, tmp_path / "fp16", ExportOptions(precision="fp16"))
    session = inference_session(out / "model.onnx")
    assert session.get_providers()[0] == "CUDAExecutionProvider"
    model = artifact.load(tiny_classifier_artifact).model()
    ids, mask = make_batch([48, 3, 17], 48, 99, 1, np.random.default_rng(0))
    np.testing.assert_allclose(ort_logits(session, ids, mask), torch_logits(model, ids, mask),
                               atol=TOLERANCES["fp16"].max_abs_diff)
