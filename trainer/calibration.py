"""Calibrated probabilities: temperature scaling (Guo et al., "On Calibration of Modern Neural Networks", 2017) and
the expected calibration error that measures it.

A classifier's softmax is over-confident after fine-tuning on a small set: it says 95% where it is right 80% of the
time. One scalar T > 0, fitted on the validation split by minimising the negative log-likelihood of softmax(z / T),
fixes most of that without changing a single prediction (the argmax of z / T is the argmax of z). Fine-tuning fits T
on the kept weights' validation logits and keeps it in the artifact (artifact.json "calibration"); the classifier
then divides its logits by it (trainer/model/encoder.py, Classifier.temperature), so every graph the export writes
answers calibrated probabilities through the server's own softmax.

ECE: the rows binned by their confidence (the top class's probability) into `BINS` equal-width bins of [0, 1]; the
mean over rows of |accuracy of the bin - mean confidence of the bin|. 0 is perfect calibration.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import numpy as np

BINS = 15  # equal-width confidence bins of the ECE and the reliability diagram (Guo et al.'s 15)
T_RANGE = (0.05, 20.0)  # the temperatures searched


def softmax(logits: np.ndarray, temperature: float = 1.0) -> np.ndarray:
    """(N, C) logits -> (N, C) probabilities of softmax(logits / temperature), float64."""
    z = np.asarray(logits, dtype=np.float64) / temperature
    z -= z.max(axis=1, keepdims=True)
    e = np.exp(z)
    return e / e.sum(axis=1, keepdims=True)


def nll(logits: np.ndarray, labels: np.ndarray, temperature: float = 1.0) -> float:
    """Mean negative log-likelihood of the labels under softmax(logits / temperature)."""
    z = np.asarray(logits, dtype=np.float64) / temperature
    m = z.max(axis=1, keepdims=True)
    log_z = (m + np.log(np.exp(z - m).sum(axis=1, keepdims=True)))[:, 0]
    return float(np.mean(log_z - z[np.arange(len(labels)), labels]))


def fit_temperature(logits: np.ndarray, labels: np.ndarray) -> float:
    """The T in T_RANGE that minimises the validation NLL (bounded scalar search over log T: the NLL is convex in
    1/T, so the search finds its one minimum)."""
    from scipy.optimize import minimize_scalar

    if len(labels) == 0:
        raise ValueError("a temperature needs at least one labelled example")
    lo, hi = (math.log(t) for t in T_RANGE)
    r = minimize_scalar(lambda s: nll(logits, labels, math.exp(s)), bounds=(lo, hi), method="bounded",
                        options={"xatol": 1e-6})
    return float(math.exp(r.x))


def reliability(probs: np.ndarray, labels: np.ndarray, bins: int = BINS) -> list[dict[str, float]]:
    """Per non-empty confidence bin: its range, row count, mean confidence and accuracy."""
    conf, right = probs.max(axis=1), (probs.argmax(axis=1) == labels)
    edges = np.linspace(0.0, 1.0, bins + 1)
    which = np.clip(np.digitize(conf, edges[1:-1], right=True), 0, bins - 1)  # bin i holds (edges[i], edges[i+1]]
    out = []
    for i in range(bins):
        rows = which == i
        if rows.any():
            out.append({"lo": float(edges[i]), "hi": float(edges[i + 1]), "count": int(rows.sum()),
                        "confidence": float(conf[rows].mean()), "accuracy": float(right[rows].mean())})
    return out


def ece(probs: np.ndarray, labels: np.ndarray, bins: int = BINS) -> float:
    """Expected calibration error (module docstring), in [0, 1]."""
    n = len(labels)
    return float(sum(b["count"] / n * abs(b["accuracy"] - b["confidence"]) for b in reliability(probs, labels, bins)))


def report(logits: dict[str, tuple[np.ndarray, np.ndarray]], temperature: float, fitted_on: str) -> dict[str, Any]:
    """artifact.json's "calibration": the temperature, where it was fitted, and per set ("valid", "test", ...) of
    raw (N, C) logits and labels, the ECE and NLL before (T = 1) and after."""
    out: dict[str, Any] = {"method": "temperature scaling", "temperature": temperature, "fitted_on": fitted_on,
                           "bins": BINS}
    for name, (z, y) in logits.items():
        out[name] = {"examples": len(y), "ece_before": ece(softmax(z), y), "ece_after": ece(softmax(z, temperature), y),
                     "nll_before": nll(z, y), "nll_after": nll(z, y, temperature)}
    return out


def summary_line(cal: dict[str, Any], where: str = "test") -> str:
    """"temperature 1.83 (fitted on ...); test ECE 0.112 -> 0.024, NLL 0.61 -> 0.52"."""
    s = cal.get(where)
    tail = f"; {where} ECE {s['ece_before']:.3f} -> {s['ece_after']:.3f}, NLL {s['nll_before']:.3f} -> " \
           f"{s['nll_after']:.3f}" if s else ""
    return f"temperature {cal['temperature']:.3f} (fitted on {cal['fitted_on']}){tail}"


def plot(path: Path, raw: np.ndarray, labels: np.ndarray, temperature: float, title: str) -> None:
    """A reliability diagram of one set: accuracy against confidence per bin, before (T = 1) and after, with the
    diagonal of perfect calibration and each curve's ECE in its label. Written atomically."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(4.8, 4.4), dpi=120)
    ax.plot([0, 1], [0, 1], color="grey", linestyle=":", label="perfect calibration")
    for t, marker, name in ((1.0, "o", "raw"), (temperature, "s", f"temperature {temperature:.2f}")):
        probs = softmax(raw, t)
        bins = reliability(probs, labels)
        ax.plot([b["confidence"] for b in bins], [b["accuracy"] for b in bins], marker=marker,
                label=f"{name}: ECE {ece(probs, labels):.3f}")
    ax.set_xlabel("confidence (top class probability)")
    ax.set_ylabel("accuracy")
    ax.set_xlim(0.45 if raw.shape[1] == 2 else 0.0, 1.0)
    ax.set_ylim(0.0, 1.02)
    ax.set_title(title, fontsize=9)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8, loc="upper left")
    fig.tight_layout()
    tmp = path.with_name(f".{path.name}.tmp")
    fig.savefig(tmp, format="png")
    plt.close(fig)
    tmp.replace(path)
