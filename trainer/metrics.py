"""Classification metrics from a confusion matrix: what a user needs to trust a classifier beyond its accuracy.

numpy only (no torch): fine-tuning sums each rank's confusion matrix and reads the metrics here; `trainer predict`
and `export --check` do the same on a whole file. Every rate is in percent. Rows of the matrix are the true class,
columns the predicted one (scikit-learn's convention).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np


def confusion(true: np.ndarray, pred: np.ndarray, classes: int) -> np.ndarray:
    """(C, C) int64 counts: [i, j] = examples of class i predicted as j."""
    cm = np.zeros((classes, classes), dtype=np.int64)
    np.add.at(cm, (np.asarray(true, dtype=np.int64), np.asarray(pred, dtype=np.int64)), 1)
    return cm


def summarize(cm: np.ndarray, names: Sequence[str]) -> dict[str, Any]:
    """Accuracy, macro-F1, the majority-class baseline, per-class precision/recall/F1 and counts, the matrix itself.

    A class never predicted has precision 0 (scikit-learn's zero_division=0) and is listed in `never_predicted`."""
    cm = np.asarray(cm, dtype=np.int64)
    n = int(cm.sum())
    support, predicted, right = cm.sum(axis=1), cm.sum(axis=0), np.diag(cm)
    precision = np.divide(100.0 * right, predicted, out=np.zeros(len(names)), where=predicted > 0)
    recall = np.divide(100.0 * right, support, out=np.zeros(len(names)), where=support > 0)
    denom = precision + recall
    f1 = np.divide(2 * precision * recall, denom, out=np.zeros(len(names)), where=denom > 0)
    present = support > 0  # macro-F1 over the classes the split holds
    return {
        "examples": n,
        "accuracy": 100.0 * float(right.sum()) / max(1, n),
        "macro_f1": float(f1[present].mean()) if present.any() else 0.0,
        "majority_baseline": 100.0 * float(support.max()) / max(1, n),
        "class_counts": {name: int(c) for name, c in zip(names, support, strict=True)},
        "predicted_counts": {name: int(c) for name, c in zip(names, predicted, strict=True)},
        "per_class": {name: {"precision": float(p), "recall": float(r), "f1": float(f), "support": int(s)}
                      for name, p, r, f, s in zip(names, precision, recall, f1, support, strict=True)},
        "confusion": cm.tolist(),
        "never_predicted": [name for name, c, s in zip(names, predicted, support, strict=True) if c == 0 and n > 0],
    }


def summary_line(m: dict[str, Any]) -> str:
    """"accuracy 81.20% (majority class 50.10%), macro-F1 81.17%" plus what the model never predicts."""
    line = (f"accuracy {m['accuracy']:.2f}% (majority class {m['majority_baseline']:.2f}%), "
            f"macro-F1 {m['macro_f1']:.2f}%")
    if m["never_predicted"]:
        line += f"; never predicts {', '.join(repr(x) for x in m['never_predicted'])}"
    return line


def warning(m: dict[str, Any], where: str) -> str | None:
    """A warning when the model never predicts a class, else None."""
    if not m["never_predicted"]:
        return None
    answers = [f"{name!r} {n}" for name, n in m["predicted_counts"].items() if n]
    return (f"warning: the model never predicts {', '.join(repr(x) for x in m['never_predicted'])} on {where} (its "
            f"answers: {', '.join(answers)} of {m['examples']}); accuracy {m['accuracy']:.2f}% against "
            f"{m['majority_baseline']:.2f}% for always answering the majority class; try "
            "finetune.class_weights=balanced, more epochs or more data")


def table(m: dict[str, Any]) -> list[str]:
    """Per-class precision/recall/F1 and the confusion matrix as Markdown lines."""
    names = list(m["per_class"])
    out = ["| class | examples | predicted | precision | recall | F1 |", "|---|---:|---:|---:|---:|---:|"]
    out += [f"| {name} | {c['support']} | {m['predicted_counts'][name]} | {c['precision']:.2f} | {c['recall']:.2f} | "
            f"{c['f1']:.2f} |" for name, c in m["per_class"].items()]
    out += ["", "| true \\ predicted | " + " | ".join(names) + " |", "|---|" + "---:|" * len(names)]
    out += [f"| {name} | " + " | ".join(str(v) for v in row) + " |"
            for name, row in zip(names, m["confusion"], strict=True)]
    return out


def text_table(m: dict[str, Any]) -> list[str]:
    """The same for a terminal: one line per class with its confusion-matrix row."""
    names = list(m["per_class"])
    width = max(8, *(len(x) for x in names))
    out = [f"  {'class':<{width}} {'n':>6} {'prec':>7} {'recall':>7} {'F1':>7}   predicted as: "
           + " ".join(f"{x:>{width}}" for x in names)]
    for name, row in zip(names, m["confusion"], strict=True):
        c = m["per_class"][name]
        out.append(f"  {name:<{width}} {c['support']:>6} {c['precision']:>7.2f} {c['recall']:>7.2f} {c['f1']:>7.2f}   "
                   + " " * len("predicted as: ") + " ".join(f"{v:>{width}}" for v in row))
    return out


def balanced_weights(labels: np.ndarray, classes: int) -> np.ndarray:
    """(C,) float32 loss weights n / (C x n_c) (scikit-learn's "balanced"); a class absent from `labels` gets 0."""
    counts = np.bincount(np.asarray(labels, dtype=np.int64), minlength=classes).astype(np.float64)
    return np.divide(len(labels), classes * counts, out=np.zeros(classes), where=counts > 0).astype(np.float32)
