"""Accuracy on a labelled file: a graph's, PyTorch's, and how often they agree (`export --data`, `--check`)."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import onnxruntime as ort
from torch import nn

from contract.runtime import inference_session
from trainer.calibration import ece, softmax
from trainer.data.readers import read_labeled
from trainer.data.tokenizer import Tokenizer
from trainer.export.errors import ExportValidationError
from trainer.export.quantize import TOLERANCES, Tolerance
from trainer.export.validate import ort_logits, torch_logits


def encode_file(tok: Tokenizer, data_file: Path, label_values: list[str], limit: int = 0,
                text_field: str = "text", label_field: str = "label",
                skipped: list[str] | None = None) -> tuple[list[list[int]], np.ndarray]:
    """Ids (cut at the tokenizer's max_len, <eos> kept) and label indices of a labelled file, read with the project's
    readers (blank texts skipped: their "file:line" go to `skipped`)."""
    examples = read_labeled(data_file, label_values, text_field, label_field, skipped)
    if limit:
        examples = examples[:limit]
    seqs = [tok.encode_example(ex) for ex in examples]
    labels = np.array([ex.label for ex in examples], dtype=np.int64)
    return seqs, labels


def graph_logits(session: ort.InferenceSession, per_row: bool) -> Callable[[np.ndarray, np.ndarray], np.ndarray]:
    """How a graph runs a right-padded batch ((B, T) ids, (B, T) mask -> (B, C) logits): whole, or, for a per-row
    graph (dynamic int8: contract/manifest.py, Graph.per_row), each row alone at its own length, as the server
    runs it."""
    if not per_row:
        return lambda ids, mask: ort_logits(session, ids, mask)

    def each(ids: np.ndarray, mask: np.ndarray) -> np.ndarray:
        return np.concatenate([ort_logits(session, ids[i:i + 1, :n], mask[i:i + 1, :n])
                               for i, n in enumerate(mask.sum(axis=1))])

    return each


def predict(run: Callable[[np.ndarray, np.ndarray], np.ndarray], seqs: list[list[int]], pad_id: int,
            batch_size: int = 32) -> np.ndarray:
    """(N, C) logits of id sequences in their order; `run(ids, mask)` is ORT or PyTorch. Batches are sorted by
    length so that they pad little."""
    order = sorted(range(len(seqs)), key=lambda i: len(seqs[i]))
    out: np.ndarray | None = None
    for start in range(0, len(order), batch_size):
        idx = order[start:start + batch_size]
        width = max(len(seqs[i]) for i in idx)
        ids = np.full((len(idx), width), pad_id, dtype=np.int64)
        mask = np.zeros((len(idx), width), dtype=np.int64)
        for row, i in enumerate(idx):
            ids[row, :len(seqs[i])] = seqs[i]
            mask[row, :len(seqs[i])] = 1
        logits = run(ids, mask)
        if out is None:
            out = np.zeros((len(seqs), logits.shape[1]), dtype=np.float32)
        out[idx] = logits
    assert out is not None, "no sequences"
    return out


def score_data(session: ort.InferenceSession, seqs: list[list[int]], labels: np.ndarray, pad_id: int,
               reference: np.ndarray | None = None, batch_size: int = 32, per_row: bool = False,
               temperature: float | None = None) -> dict[str, Any]:
    """Accuracy of a graph (run as `graph_logits` says) and, given PyTorch's (N, C) logits on the same sequences
    (`reference`), PyTorch's accuracy and their label agreement. With the `temperature` the graph divides its logits
    by: the expected calibration error of its probabilities as served and as they were before (logits x T)."""
    got = predict(graph_logits(session, per_row), seqs, pad_id, batch_size)
    out: dict[str, Any] = {"examples": len(seqs), "bundle_accuracy": accuracy(got, labels)}
    if temperature is not None:
        out["ece_served"] = ece(softmax(got), labels)
        out["ece_uncalibrated"] = ece(softmax(got, 1.0 / temperature), labels)
    if reference is not None:
        out["torch_accuracy"] = accuracy(reference, labels)
        out["accuracy_change_points"] = round(out["bundle_accuracy"] - out["torch_accuracy"], 3)
        out["label_agreement"] = float((got.argmax(1) == reference.argmax(1)).mean())
        out["max_abs_diff"] = float(np.abs(got - reference).max())
    return out


def torch_reference(model: nn.Module, seqs: list[list[int]], pad_id: int, batch_size: int = 32) -> np.ndarray:
    """PyTorch fp32's (N, C) logits on the sequences: computed once, compared with every graph."""
    return predict(lambda i, m: torch_logits(model, i, m), seqs, pad_id, batch_size)


def accuracy(logits: np.ndarray, labels: np.ndarray) -> float:
    """Percent of rows whose argmax is the label, rounded to 3 decimals."""
    return round(100.0 * float((logits.argmax(1) == labels).mean()), 3)


def data_check(path: Path, precision: str, level: str, seqs: list[list[int]], labels: np.ndarray,
               reference: np.ndarray, pad_id: int, data_file: Path, tol: Tolerance | None = None,
               per_row: bool = False) -> dict[str, Any]:
    """Accuracy change of the graph at `path` on a labelled file, held to `tol` (default: the precision's), run as
    it will be served (`per_row`)."""
    tol = tol or TOLERANCES[precision]
    session = inference_session(path, level, "cpu")
    report = score_data(session, seqs, labels, pad_id, reference, per_row=per_row)
    report["file"] = str(data_file)
    drop = -report["accuracy_change_points"]
    if report["label_agreement"] < tol.min_data_agreement or drop > tol.max_accuracy_drop:
        raise ExportValidationError(
            f"{precision} bundle on {data_file} ({report['examples']} examples): label agreement with PyTorch "
            f"{report['label_agreement']:.2%} (required >= {tol.min_data_agreement:.1%}), accuracy "
            f"{report['bundle_accuracy']:.2f} vs {report['torch_accuracy']:.2f} (drop allowed "
            f"<= {tol.max_accuracy_drop} points)")
    return report
