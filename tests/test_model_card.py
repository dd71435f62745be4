"""Calibration in every graph and the model card in every bundle (bundle format 4): the exporter bakes the artifact's
temperature into each graph, the manifest and each graph say it, the verifier holds the card and the temperature to
the manifest, and older bundles are still read. The card's figures against a real fine-tuned run's manifest, and the
server's metadata: tests/test_recipes.py. The card's outline (Hugging Face's template) against
docs/MODEL_CARD.example.md, and what a demo-shaped run records for it."""

from __future__ import annotations

import hashlib
import json
import re
import shutil
import sys
from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort
import procs
import pytest
import torch
import yaml
from bundles import as_format_3, edit_manifest, reseal
from procs import REPO

from contract.bundle import verify_bundle
from contract.errors import BundleError
from contract.manifest import CARD_FILE
from serving.model.predictor import Predictor
from trainer import artifact
from trainer.calibration import softmax
from trainer.export import ExportOptions, card, export_bundle

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


# ---------------------------------------------------------------------------------------------- the card's outline

EXAMPLE = REPO / "docs" / "MODEL_CARD.example.md"


def trainer_cli(args: list[str]) -> str:
    p = procs.run([sys.executable, "-m", "trainer", *args], 600, cwd=REPO, env=procs.env())
    assert p.returncode == 0, f"rc {p.returncode}\n{(p.stdout + p.stderr)[-4000:]}"
    return p.stdout


@pytest.fixture(scope="module")
def demo_shaped(tmp_path_factory: pytest.TempPathFactory, data_dir: Path, tiny_tokenizer_dir: Path) -> Path:
    """`make demo`'s pipeline at the tiny preset (pretrain, fine-tune from it, export), on capped data: a bundle
    whose card has every part the demo's has (a pretrained encoder, its corpus, calibration, the data's checksums)."""
    run = tmp_path_factory.mktemp("demo-shaped")
    base = ["--preset", "tiny", "--set", f"data.root={data_dir}", "--set", "finetune.tfidf_baseline=word"]
    trainer_cli(["pretrain", *base, "--tokenizer", str(tiny_tokenizer_dir), "--out", str(run / "pretrain")])
    trainer_cli(["finetune", *base, "--set", "data.max_train_examples=52", "--set", "finetune.epochs=1",
                 "--pretrained", str(run / "pretrain" / "artifact"), "--out", str(run / "finetune")])
    trainer_cli(["export", str(run / "finetune" / "artifact"), "--out", str(run / "bundle")])
    return run / "bundle"


def outline(card: str) -> tuple[list[str], list[str]]:
    """The card's headings below its title (##, ###, ####, in order) and its metadata keys."""
    head, body = card.split("---\n")[1], card.split("---\n", 2)[2]
    body = re.sub(r"^```.*?^```", "", body, flags=re.S | re.M)  # a fenced line starting with # is no heading
    return re.findall(r"^#{2,4} .+$", body, flags=re.M), [line.split(":", 1)[0] for line in head.splitlines()]


def test_the_example_card_has_the_outline_export_writes(demo_shaped: Path, tiny_bundle: Path) -> None:
    """docs/MODEL_CARD.example.md is the demo bundle's card: its sections and metadata keys are those of a card
    exported now (a section added to trainer/export/card.py and not to the example fails here); every card has them,
    a model trained from scratch, uncalibrated and without recorded data included (less base_model and datasets)."""
    example = EXAMPLE.read_text(encoding="utf-8")
    card = (demo_shaped / CARD_FILE).read_text(encoding="utf-8")
    headings, keys = outline(card)
    assert outline(example) == (headings, keys)
    assert headings[:3] == ["## Model Details", "### Model Description", "### Labels"] and len(headings) >= 30
    for section in ("## Uses", "## Bias, Risks, and Limitations", "### Recommendations",
                    "## How to Get Started with the Model", "## Training Details", "## Evaluation", "### Results",
                    "### Calibration", "## Environmental Impact", "## Technical Specifications", "## Citation",
                    "## Model Card Contact"):
        assert section in headings
    scratch_headings, scratch_keys = outline((tiny_bundle / CARD_FILE).read_text(encoding="utf-8"))
    assert scratch_headings == headings and scratch_keys == [k for k in keys if k not in ("base_model", "datasets")]


def test_the_metadata_is_yaml_with_the_hub_keys(demo_shaped: Path) -> None:
    card = (demo_shaped / CARD_FILE).read_text(encoding="utf-8")
    meta = yaml.safe_load(card.split("---\n")[1])
    assert meta["license"] == "apache-2.0" and meta["language"] == "fr" and meta["datasets"] == ["cls-books-fr"]
    assert meta["base_model"] == "transfer-sentiment-tiny-clm"
    assert re.fullmatch(r"[\w.-]+", meta["base_model"])  # a model id's shape (the Hub's repo-id characters)
    assert meta["model-index"][0]["results"][0]["dataset"]["name"] == "cls-books-fr/test.review.spm"


def test_the_card_renders_again_from_the_manifest_alone(demo_shaped: Path) -> None:
    """`python -m trainer.export.render_card BUNDLE` gives the exported card byte for byte: the card is a function
    of the manifest, the export command included (derived from the graphs and runtime it records)."""
    tool = [sys.executable, "-m", "trainer.export.render_card"]
    p = procs.run([*tool, str(demo_shaped)], 120, cwd=REPO, env=procs.env())
    assert p.returncode == 0 and not p.stderr, p.stderr
    assert p.stdout == (demo_shaped / CARD_FILE).read_text(encoding="utf-8")
    bad = procs.run([*tool, str(demo_shaped / "tokenizer")], 120, cwd=REPO, env=procs.env())
    assert bad.returncode == 2 and "manifest.json" in bad.stderr and len(bad.stderr.strip().splitlines()) == 1


def test_the_card_says_how_the_run_was_made(demo_shaped: Path, data_dir: Path) -> None:
    """Pretraining records its corpus (each file's sha256, the prepared manifest's), hardware and wall time; the
    classifier its own and its encoder's; the card prints them, with the calls that reach the served model."""
    m = verify_bundle(demo_shaped).manifest
    card, pre = (demo_shaped / CARD_FILE).read_text(encoding="utf-8"), m.evaluation["pretrained_from"]
    files = pre["corpus"]["files"]
    assert [Path(f["file"]).name for f in files] == ["train.review.txt"]
    for f in files:
        assert f["sha256"] == hashlib.sha256(Path(f["file"]).read_bytes()).hexdigest() and f"`{f['sha256']}`" in card
    assert f"`{pre['corpus']['manifest_sha256']}`" in card
    for c in (m.evaluation["compute"], pre["compute"]):
        assert c["device"] == "cpu" and c["world_size"] == 1 and c["wall_seconds"] > 0 and c["steps_timed"] > 0
    assert pre["compute"]["steps_timed"] == pre["steps"] == 6
    assert f"6 optimizer steps, 1 rank(s) on cpu ({pre['compute']['device_name']})" in card
    assert "localhost:8000/v1/classify" in card and "sentiment.v1.SentimentService/Classify" in card
    assert "sentiment-client --target 127.0.0.1:50051" in card
    assert f"at most {m.max_len} token ids" in card and "Negation and sarcasm" in card and "Webis-CLS-10" in card
    assert "- **Version:** transfer-sentiment " in card and "@software{transfer_sentiment_" in card


def test_the_citation_comes_from_citation_cff_or_the_package(tiny_bundle: Path, tmp_path: Path) -> None:
    m = verify_bundle(tiny_bundle).manifest
    cff = card.read_cff((REPO / "CITATION.cff").read_text(encoding="utf-8"))
    here = card.citation(m)
    assert here["title"] == cff["title"] and here["authors"] == cff["authors"] == "the transfer-sentiment authors"
    assert here["license"] == cff["license"] == "Apache-2.0" and here["version"] == m.versions["transfer-sentiment"]
    wheel = card.citation(m, tmp_path / "CITATION.cff")  # an installed wheel: no CITATION.cff beside the code
    assert wheel["title"].startswith("transfer-sentiment: ") and wheel["license"] == "Apache-2.0"
    assert wheel["version"] == here["version"]
    assert "## Citation" in card.render(m, "python -m trainer export A --out BUNDLE")


def test_the_card_says_when_the_tokenizer_folds_case(demo_shaped: Path) -> None:
    """Export records the config's tokenizer.case_fold (the tiny preset keeps case) and the card's preprocessing line
    says "case-folded" only when it is set: a user reads there why « ENNUYEUX » and « ennuyeux » score alike."""
    import dataclasses

    m = verify_bundle(demo_shaped).manifest
    assert m.evaluation["case_fold"] is False
    kept = card.render(m, "python -m trainer export A --out BUNDLE")
    folded = card.render(dataclasses.replace(m, evaluation={**m.evaluation, "case_fold": True}),
                         "python -m trainer export A --out BUNDLE")
    assert "Texts are cut into sentencepiece pieces" in kept and "case-folded" not in kept
    assert "Texts are case-folded and cut into sentencepiece pieces" in folded
