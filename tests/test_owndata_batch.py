"""A text's served answer does not depend on the texts batched with it, on every graph a CPU server runs.

It did: the int8 graph quantized activations with one scale per batch (a text's label could change with other
clients' requests), and the fp32 graph's mean pooling (onnxruntime's ReduceSum) added positions in an order that
depends on the batch's shape, so fp32 probabilities moved in their last bit. Now the int8 graph runs one text per
onnxruntime run (contract/manifest.py, Graph.per_row) and the mean pooling is exported as a running sum
(trainer/model/onnx_pooling.py). The bound: none is needed, int8 included: the same texts in batches of 1, 7 and 64,
in shuffled company, give bitwise-identical probabilities.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
from pathlib import Path

import numpy as np
import pytest
import torch
from serving_fixtures import reviews, running_server

from serving.client import SentimentClient
from serving.model.predictor import Predictor
from trainer import artifact
from trainer.config.presets import tiny
from trainer.export import ExportOptions, export_bundle
from trainer.model.encoder import build

SIZES = (7, 64)


@pytest.fixture(scope="module")
def texts(data_dir: Path) -> list[str]:
    """70 reviews of many lengths, some longer than max_len (cut), and a one-word one."""
    return [*reviews(data_dir, 69), "Bof."]


@pytest.fixture(scope="module")
def mean_pooled(tmp_path_factory: pytest.TempPathFactory, tiny_tokenizer, data_dir: Path) -> Path:
    """The tiny model with mean pooling (the demo's and english's readout), seeded weights, exported by default:
    model.onnx (fp32) and model.int8.onnx (the CPU's)."""
    cfg = tiny()
    cfg = dataclasses.replace(cfg, model=dataclasses.replace(cfg.model, pooling="mean", classifier_causal=False))
    torch.manual_seed(0)
    folder = tmp_path_factory.mktemp("mean-pooled")
    art = artifact.save(folder / "artifact", build(cfg.model, "classifier").eval(), cfg, "classifier", tiny_tokenizer)
    return export_bundle(art, folder / "bundle")


def alone_and_in_company(run, encoded: list[np.ndarray], seed: int) -> tuple[np.ndarray, dict[int, np.ndarray]]:
    alone = np.concatenate([run([e]) for e in encoded])
    rng = np.random.default_rng(seed)
    company = {}
    for size in SIZES:
        order, got = rng.permutation(len(encoded)), np.zeros_like(alone)
        for start in range(0, len(order), size):
            idx = order[start:start + size]
            got[idx] = run([encoded[i] for i in idx])
        company[size] = got
    return alone, company


@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("graph", ["model.onnx", "model.int8.onnx"])
@pytest.mark.parametrize("which", ["mean pooling", "last token"])
def test_each_graph_answers_a_text_the_same_in_any_company(mean_pooled: Path, default_bundle: Path,
                                                           texts: list[str], which: str, graph: str,
                                                           threads: int) -> None:
    bundle = mean_pooled if which == "mean pooling" else default_bundle
    p = Predictor(bundle, device="cpu", graph=graph, intra_op_threads=threads)
    assert p.per_row == (graph == "model.int8.onnx")
    encoded = [e.ids for e in p.encode(texts)]
    alone, company = alone_and_in_company(p.infer, encoded, seed=threads)
    for size, got in company.items():
        assert np.array_equal(got, alone), f"{graph}, batches of {size}: {int((got != alone).any(1).sum())} rows moved"


def test_without_the_fixes_the_answers_moved(mean_pooled: Path, texts: list[str],
                                             monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """What the two fixes remove, measured on the same texts: int8 run as one batch, and fp32 exported with the
    model's own mean (ReduceSum)."""
    p = Predictor(mean_pooled, device="cpu", graph="model.int8.onnx", intra_op_threads=1)
    encoded = [e.ids for e in p.encode(texts)]
    batched = p._run  # the whole padded batch in one run: one activation scale for all its texts
    alone, company = alone_and_in_company(batched, encoded, seed=0)
    assert all((got != alone).any() for got in company.values())
    import trainer.model.onnx_pooling as pooling

    monkeypatch.setattr(pooling, "with_scan_pooling", lambda model: model)
    art = Path(str(mean_pooled).replace("bundle", "artifact"))
    old = export_bundle(art, tmp_path / "reduce-sum", ExportOptions(precision="fp32"))
    q = Predictor(old, device="cpu", intra_op_threads=1)
    alone, company = alone_and_in_company(q.infer, [e.ids for e in q.encode(texts)], seed=0)
    assert any((got != alone).any() for got in company.values())


def test_served_answers_do_not_depend_on_other_clients_requests(mean_pooled: Path, texts: list[str]) -> None:
    """Through the server and its batcher (which merges concurrent requests): requests of 1, 7 and 64 texts in
    shuffled order from three clients at once, against each text asked alone. The CPU serves the int8 graph."""
    with running_server(mean_pooled, device="cpu", max_queue_delay_ms=20) as s:
        assert s.core.predictor.graph == "model.int8.onnx"
        target = f"127.0.0.1:{s.port}"
        with SentimentClient(target) as c:
            alone = {t: c.classify([t])[0] for t in texts}

        def ask(size: int) -> list[tuple[str, object]]:
            order = np.random.default_rng(size).permutation(len(texts))
            out = []
            with SentimentClient(target) as c:
                for start in range(0, len(order), size):
                    chunk = [texts[i] for i in order[start:start + size]]
                    out += list(zip(chunk, c.classify(chunk), strict=True))
            return out

        with concurrent.futures.ThreadPoolExecutor(3) as pool:
            answers = [a for got in pool.map(ask, (1, *SIZES)) for a in got]
    assert len(answers) == 3 * len(texts)
    for text, r in answers:
        assert r.probabilities == alone[text].probabilities and r.label == alone[text].label, text[:40]
