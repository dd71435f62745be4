"""trainer/calibration.py: temperature scaling and the expected calibration error, on constructed logits whose
calibration is known."""

from __future__ import annotations

import numpy as np
import pytest

from trainer import calibration as cal


def overconfident(n: int = 4000, seed: int = 0, scale: float = 4.0) -> tuple[np.ndarray, np.ndarray]:
    """Binary logits whose true probability of class 1 is sigmoid(z), reported as z x scale: a classifier `scale`
    times too sure of itself. The temperature that calibrates it is `scale`."""
    rng = np.random.default_rng(seed)
    z = rng.normal(0.0, 1.5, n)
    labels = (rng.random(n) < 1 / (1 + np.exp(-z))).astype(np.int64)
    return np.stack([np.zeros(n), z * scale], axis=1), labels


def test_the_temperature_of_an_overconfident_classifier_is_found_and_lowers_its_ece() -> None:
    logits, labels = overconfident()
    t = cal.fit_temperature(logits, labels)
    assert t == pytest.approx(4.0, rel=0.1)
    before, after = cal.ece(cal.softmax(logits), labels), cal.ece(cal.softmax(logits, t), labels)
    assert before > 0.1 and after < 0.03
    assert cal.nll(logits, labels, t) < cal.nll(logits, labels)
    # A new sample of the same classifier (the test set): the validation's temperature calibrates it too.
    test, y = overconfident(seed=1)
    assert cal.ece(cal.softmax(test, t), y) < 0.03 < 0.1 < cal.ece(cal.softmax(test), y)
    assert (cal.softmax(test, t).argmax(1) == test.argmax(1)).all()  # no prediction changes


def test_a_calibrated_classifier_keeps_a_temperature_near_one() -> None:
    logits, labels = overconfident(scale=1.0)
    assert cal.fit_temperature(logits, labels) == pytest.approx(1.0, rel=0.1)


def test_ece_is_the_weighted_gap_of_the_bins() -> None:
    # four rows at confidence 0.9 (3 right) and two at 0.6 (both right): |0.75 - 0.9| x 4/6 + |1 - 0.6| x 2/6
    probs = np.array([[0.9, 0.1]] * 4 + [[0.4, 0.6]] * 2)
    labels = np.array([0, 0, 0, 1, 1, 1])
    assert cal.ece(probs, labels) == pytest.approx(0.15 * 4 / 6 + 0.4 * 2 / 6)
    bins = cal.reliability(probs, labels)
    assert [(b["count"], b["accuracy"]) for b in bins] == [(2, 1.0), (4, 0.75)]
    assert cal.softmax(np.array([[1000.0, 0.0]]))[0, 0] == 1.0  # no overflow


def test_report_names_the_sets_and_the_fit() -> None:
    logits, labels = overconfident(400)
    r = cal.report({"valid": (logits, labels)}, 4.0, "the validation split (400 examples)")
    assert r["temperature"] == 4.0 and r["valid"]["ece_after"] < r["valid"]["ece_before"]
    assert "temperature 4.000 (fitted on the validation split (400 examples))" in cal.summary_line(r, "valid")
    with pytest.raises(ValueError, match="at least one"):
        cal.fit_temperature(np.empty((0, 2)), np.empty(0, np.int64))
