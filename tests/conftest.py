"""Session fixtures shared by the test files: the data folder, a tiny tokenizer, a tiny trained classifier artifact,
the fp32 bundle exported from it by the real exporter (the CI export step: train -> export -> validate) and the
server's in-process predictor on that bundle.

Each is built once per test session under pytest's tmp folder; together they take about 15 s on 2 cores.
"""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np
import pytest
import torch
from procs import REPO

# The data sets of the tests: $TS_DATA, else this project's CI copy beside the checkout, for the tests' own reads and
# for every CLI and launcher they start (the presets read $TS_DATA, else the user's cache).
if not os.environ.get("TS_DATA") and (REPO.parent / "shared" / "data").is_dir():
    os.environ["TS_DATA"] = str((REPO.parent / "shared" / "data").resolve())

# The tiny classifier's short training run: enough steps that its logits leave zero (validation then compares
# decided predictions, not coin flips), few enough to stay around 3 s.
TINY_TRAIN_EXAMPLES = 104
TINY_TRAIN_STEPS = 40


@pytest.fixture(scope="session")
def data_dir() -> Path:
    """The shared data sets: $TS_DATA, else ../shared/data beside the checkout."""
    path = Path(os.environ.get("TS_DATA") or REPO.parent / "shared" / "data").resolve()
    if not (path / "cls-books-fr").is_dir():
        pytest.skip(f"data sets not found at {path} (set TS_DATA to the folder holding cls-books-fr/)")
    return path


@pytest.fixture(scope="session")
def tiny_tokenizer_dir(tmp_path_factory: pytest.TempPathFactory, data_dir: Path) -> Path:
    """The saved `tokenizer/` folder of `tiny_tokenizer`."""
    from trainer.config.presets import tiny
    from trainer.data.tokenizer import Tokenizer

    tc = tiny().tokenizer
    tok = Tokenizer.train([data_dir / "cls-books-fr" / "train.review.txt"], vocab_size=tc.vocab_size,
                          max_len=tc.max_len, train_lines=tc.train_lines, seed=0)
    return tok.save(tmp_path_factory.mktemp("tiny-tokenizer") / "tokenizer")


@pytest.fixture(scope="session")
def tiny_tokenizer(tiny_tokenizer_dir: Path):
    """A Tokenizer trained on cls-books-fr train.review.txt with the `tiny` preset (95 pieces + 4 specials = 99
    ids, max_len 48), loaded back from its saved folder."""
    from trainer.config.presets import tiny
    from trainer.data.tokenizer import Tokenizer

    return Tokenizer.load(tiny_tokenizer_dir, tiny().tokenizer.max_len)


@pytest.fixture(scope="session")
def tiny_classifier_artifact(tmp_path_factory: pytest.TempPathFactory, data_dir: Path, tiny_tokenizer) -> Path:
    """A `tiny` classifier artifact trained for a few Adam steps on the training reviews of cls-books-fr (plain
    PyTorch)."""
    from trainer import artifact
    from trainer.config.presets import tiny
    from trainer.config.schema import override
    from trainer.data.batching import pad_batch
    from trainer.data.readers import read_labeled
    from trainer.model.encoder import build

    cfg = override(tiny(), {"data.root": str(data_dir)})
    examples = read_labeled(data_dir / "cls-books-fr" / "train.review.txt", cfg.data.labels)
    rng = np.random.default_rng(0)  # the file is sorted by label: sample both classes
    picked = [examples[i] for i in rng.permutation(len(examples))[:TINY_TRAIN_EXAMPLES]]
    seqs = tiny_tokenizer.encode_batch([ex.text for ex in picked])
    labels = torch.tensor([ex.label for ex in picked])

    torch.manual_seed(0)
    model = build(cfg.model, "classifier").train()
    opt = torch.optim.Adam(model.parameters(), lr=cfg.finetune.optim.lr)
    batch = cfg.finetune.micro_batch
    for step in range(TINY_TRAIN_STEPS):
        start = (step * batch) % len(seqs)
        ids, pad = pad_batch(seqs[start:start + batch], tiny_tokenizer.PAD)
        loss = torch.nn.functional.cross_entropy(model(ids, pad), labels[start:start + batch])
        opt.zero_grad()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.finetune.optim.grad_clip)
        opt.step()
    out = tmp_path_factory.mktemp("tiny-classifier") / "artifact"
    return artifact.save(out, model.eval(), cfg, "classifier", tiny_tokenizer,
                         extra={"steps": TINY_TRAIN_STEPS, "final_loss": round(loss.item(), 4)})


@pytest.fixture(scope="session")
def tiny_bundle(tmp_path_factory: pytest.TempPathFactory, tiny_classifier_artifact: Path) -> Path:
    """The fp32 ONNX bundle exported (and validated) from `tiny_classifier_artifact` by trainer.export: one graph,
    model.onnx, served on every device (`export --precision fp32`), run in batches. (The default bundle's int8 graph
    runs one text per run: tests/test_owndata_batch.py.)"""
    from trainer.export import ExportOptions, export_bundle

    return export_bundle(tiny_classifier_artifact, tmp_path_factory.mktemp("tiny-bundle") / "bundle",
                         ExportOptions(precision="fp32"))


@pytest.fixture(scope="session")
def default_bundle(tmp_path_factory: pytest.TempPathFactory, tiny_classifier_artifact: Path) -> Path:
    """The bundle `export` writes by default from `tiny_classifier_artifact`: model.onnx (fp32) for CUDA and
    model.int8.onnx for the CPU."""
    from trainer.export import export_bundle

    return export_bundle(tiny_classifier_artifact, tmp_path_factory.mktemp("default-bundle") / "bundle")


@pytest.fixture(scope="session")
def predictor(tiny_bundle: Path):
    """serving.model.predictor.Predictor on `tiny_bundle`, CPU, one onnxruntime thread (thread-safe: shared)."""
    from serving.model.predictor import Predictor

    return Predictor(tiny_bundle, device="cpu", intra_op_threads=1)


@pytest.fixture(scope="session")
def reference(predictor):
    """`predictor` in its role in the server tests: the in-process answers every served answer must equal."""
    return predictor
