"""Calibration in every graph and the model card in every bundle (bundle format 4): the exporter bakes the artifact's
temperature into each graph, the manifest and each graph say it, the verifier holds the card and the temperature to
the manifest, and older bundles are still read. The card's figures against a real fine-tuned run's manifest, and the
server's metadata: tests/test_recipes.py."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort
import pytest
import torch
from bundles import as_format_3, edit_manifest, reseal

from contract.bundle import verify_bundle
from contract.errors import BundleError
from contract.manifest import CARD_FILE
from serving.model.predictor import Predictor
from trainer import artifact
from trainer.calibration import softmax
from trainer.export import ExportOptions, export_bundle

T = 2.5


def with_temperature(src: Path, dst: Path, t: float) -> Path:
    """A copy of a classifier artifact whose artifact.json holds a fitted temperature, as fine-tuning writes it."""
    art = Path(shutil.copytree(src, dst))
    meta = json.loads((art / "artifact.json").read_text())
    meta["calibration"] = {"method": "temperature scaling", "temperature": t, "fitted_on": "a constructed case",
                           "bins": 15, "test": {"examples": 1, "ece_before": 0.2, "ece_after": 0.01,
                                                "nll_before": 0.7, "nll_after": 0.6}}
    (art / "artifact.json").write_text(json.dumps(meta))
    return art


@pytest.fixture(scope="module")
def calibrated(tmp_path_factory: pytest.TempPathFactory, tiny_classifier_artifact: Path) -> Path:
    """fp32, int8 and fp16 graphs of the tiny classifier with temperature T."""
    art = with_temperature(tiny_classifier_artifact, tmp_path_factory.mktemp("cal") / "artifact", T)
    return export_bundle(art, tmp_path_factory.mktemp("cal-bundle") / "bundle", ExportOptions(gpu_precision="fp16"))


def batch(n: int = 5, width: int = 9) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(0)
    ids = rng.integers(4, 99, (n, width)).astype(np.int64)
    mask = np.ones((n, width), dtype=np.int64)
    for row, length in enumerate(rng.integers(3, width + 1, n)):  # right-padded rows of various lengths
        ids[row, length:], mask[row, length:] = 1, 0
        ids[row, 0], ids[row, length - 1] = 0, 2
    return ids, mask


def test_every_graph_divides_its_logits_by_the_same_temperature(calibrated: Path,
                                                                tiny_classifier_artifact: Path) -> None:
    ids, mask = batch()
    raw = artifact.load(tiny_classifier_artifact).model()  # no temperature: the logits as trained
    with torch.no_grad():
        want = raw(torch.from_numpy(ids), torch.from_numpy(mask == 0)).numpy() / T
    m = json.loads((calibrated / "manifest.json").read_text())
    assert set(m["graphs"]) == {"model.onnx", "model.int8.onnx", "model.fp16.onnx"}
    assert m["calibration"]["temperature"] == T and m["calibration"]["applied_in_graphs"] is True
    for name, tol in (("model.onnx", 1e-5), ("model.int8.onnx", 0.05), ("model.fp16.onnx", 0.01)):
        props = {p.key: p.value for p in onnx.load(str(calibrated / name)).metadata_props}
        assert float(props["calibration_temperature"]) == T, name
        session = ort.InferenceSession(str(calibrated / name), providers=["CPUExecutionProvider"])
        got = session.run(["logits"], {"input_ids": ids, "attention_mask": mask})[0].astype(np.float64)
        assert np.abs(got - want).max() <= tol * max(1.0, np.abs(want).max()), name
    # The server's probabilities are the softmax of the divided logits: calibrated with no serving change.
    p = Predictor(calibrated, device="cpu")
    assert p.manifest.calibrated and p.manifest.temperature == T
    rows = [ids[i, :mask[i].sum()] for i in range(len(ids))]
    assert np.allclose(p.infer(rows), softmax(want), atol=0.05)


def test_an_artifact_without_a_temperature_exports_raw_logits_and_says_so(default_bundle: Path) -> None:
    m = verify_bundle(default_bundle).manifest
    assert m.calibration == {"method": "none", "temperature": 1.0, "applied_in_graphs": False}
    assert not m.calibrated and m.temperature == 1.0
    assert "Not calibrated: the probabilities are the raw softmax" in (default_bundle / CARD_FILE).read_text()


def test_the_card_is_a_bundle_file_checked_like_every_other(calibrated: Path, tmp_path: Path) -> None:
    b = verify_bundle(calibrated)
    assert CARD_FILE in b.manifest.files and b.model_card.startswith("---\n") and "T = 2.5000" in b.model_card
    assert Predictor(calibrated, device="cpu").model_card == b.model_card
    edited = Path(shutil.copytree(calibrated, tmp_path / "edited"))
    (edited / CARD_FILE).write_text(b.model_card.replace("2.5000", "1.0000"))
    with pytest.raises(BundleError, match=r"MODEL_CARD.md: checksum mismatch"):
        verify_bundle(edited)
    (edited / CARD_FILE).unlink()
    with pytest.raises(BundleError, match=r"MODEL_CARD.md"):
        verify_bundle(edited)
    edit_manifest(edited, lambda m: m["files"].pop(CARD_FILE))  # resealed: the digest is not what catches it
    with pytest.raises(BundleError, match=r"field 'files' lacks 'MODEL_CARD.md'"):
        verify_bundle(edited)


def test_a_temperature_the_graphs_do_not_apply_is_refused(calibrated: Path, tmp_path: Path) -> None:
    bundle = Path(shutil.copytree(calibrated, tmp_path / "bundle"))
    edit_manifest(bundle, lambda m: m["calibration"].update(temperature=1.0), sealed=False)
    reseal(bundle, graphs=False)  # the manifest's digest matches again; the graphs still say 2.5
    with pytest.raises(BundleError, match=r"metadata_props differ from manifest.json on calibration_temperature"):
        verify_bundle(bundle)
    for bad in (None, 0, -1.0, "2.5", True):
        edit_manifest(bundle, lambda m, bad=bad: m.update(calibration={"temperature": bad}), sealed=False)
        reseal(bundle, graphs=False)
        with pytest.raises(BundleError, match=r"field 'calibration' must be an object whose temperature is a number"):
            verify_bundle(bundle)


def test_a_format_3_bundle_is_still_served_without_a_card(calibrated: Path, tmp_path: Path) -> None:
    bundle = Path(shutil.copytree(calibrated, tmp_path / "bundle"))
    as_format_3(bundle)
    p = Predictor(bundle, device="cpu")
    assert p.manifest.format == 3 and p.model_card == "" and not p.manifest.calibrated
    assert p.manifest.temperature == 1.0 and not (bundle / CARD_FILE).exists()
