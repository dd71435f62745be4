"""trainer/metrics.py against scikit-learn on the same predictions, including a class the model never predicts and a
class absent from the split."""

from __future__ import annotations

import numpy as np
import pytest
from sklearn.metrics import accuracy_score, confusion_matrix, f1_score, precision_recall_fscore_support
from sklearn.utils.class_weight import compute_class_weight

from trainer.metrics import balanced_weights, confusion, summarize, summary_line, table, warning

NAMES = ["neg", "neutral", "pos"]


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_metrics_equal_scikit_learn(seed: int) -> None:
    rng = np.random.default_rng(seed)
    true = rng.choice(3, size=97, p=[0.6, 0.1, 0.3])
    pred = np.where((rng.random(97) < 0.7) & (true != 1), true, rng.choice([0, 2], size=97))  # never "neutral"
    m = summarize(confusion(true, pred, 3), NAMES)
    assert m["confusion"] == confusion_matrix(true, pred, labels=[0, 1, 2]).tolist()
    assert m["accuracy"] == pytest.approx(100 * accuracy_score(true, pred))
    p, r, f, s = precision_recall_fscore_support(true, pred, labels=[0, 1, 2], zero_division=0)
    for i, name in enumerate(NAMES):
        c = m["per_class"][name]
        assert (c["precision"], c["recall"], c["f1"]) == pytest.approx((100 * p[i], 100 * r[i], 100 * f[i]))
        assert c["support"] == s[i]
    assert m["macro_f1"] == pytest.approx(100 * f1_score(true, pred, average="macro", zero_division=0))
    assert m["majority_baseline"] == pytest.approx(100 * np.bincount(true).max() / len(true))
    assert m["never_predicted"] == ["neutral"] and m["predicted_counts"]["neutral"] == 0
    assert "never predicts 'neutral'" in summary_line(m)
    text = warning(m, "test.jsonl")
    assert text is not None and text.startswith("warning: the model never predicts 'neutral' on test.jsonl")
    assert "finetune.class_weights=balanced" in text


def test_a_class_absent_from_the_split_is_left_out_of_macro_f1() -> None:
    true, pred = np.array([0, 0, 2, 2, 2]), np.array([0, 2, 2, 2, 0])
    m = summarize(confusion(true, pred, 3), NAMES)
    assert m["macro_f1"] == pytest.approx(100 * f1_score(true, pred, average="macro", labels=[0, 2]))
    assert m["never_predicted"] == ["neutral"] and m["class_counts"] == {"neg": 2, "neutral": 0, "pos": 3}


def test_a_majority_only_model_is_flagged_and_its_accuracy_is_the_baseline() -> None:
    true = np.array([0] * 56 + [1] * 44)
    m = summarize(confusion(true, np.zeros(100, dtype=int), 2), ["neg", "pos"])
    assert m["accuracy"] == m["majority_baseline"] == 56.0 and m["macro_f1"] == pytest.approx(100 * 56 / 156)
    assert warning(m, "x") is not None and warning(summarize(confusion(true, true, 2), ["neg", "pos"]), "x") is None
    md = "\n".join(table(m))
    assert "| neg | 56 | 100 | 56.00 | 100.00 | 71.79 |" in md and "| pos | 44 | 0 |" in md


def test_balanced_class_weights_equal_scikit_learn() -> None:
    labels = np.array([0] * 60 + [1] * 30 + [2] * 10)
    want = compute_class_weight("balanced", classes=np.arange(3), y=labels)
    assert balanced_weights(labels, 3) == pytest.approx(want)
    assert balanced_weights(np.array([0, 0, 1]), 3).tolist()[2] == 0.0  # a class with no example weighs nothing
