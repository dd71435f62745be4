"""The baseline a user would compare a transformer with: TF-IDF n-grams + logistic regression (scikit-learn).

`finetune` scores it on the run's own splits beside the transformer (log, metrics.json, compare.md/csv/png) and
`export --check` on the checked file (its report, JSON and JUnit), each with a one-line verdict; docs/RESULTS.md and
bench/tfidf_baseline.py run the same function on the project's data sets.

The recipe (`finetune.tfidf_baseline`):
  word+char  word 1-2-grams and character 2-5-grams within word boundaries (char_wb: robust to inflection and
             typos), each TF-IDF with sublinear tf, side by side; the default
  word       word 1-2-grams only: for large English sets (character 2-5-grams took 6.5x the word n-grams' time to
             vectorize 3,000 IMDB reviews)
  none       no baseline
N-grams count when at least 2 training texts hold them (1 below 1,000 texts). Logistic regression's C is chosen on
the validation split from C_GRID by the run's finetune.select_metric (the smallest C of a tie), trained on the
training split only, as the transformer is; finetune.class_weights=balanced applies to it too. Seeded and
deterministic (lbfgs, the path of C values warm-started in increasing order).
"""

from __future__ import annotations

import copy
import time
import warnings
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from trainer.config.schema import RunConfig
from trainer.data.labelled import texts
from trainer.data.readers import Example
from trainer.metrics import confusion, summarize

RECIPES = ("word+char", "word", "none")
C_GRID = (0.1, 0.3, 1.0, 3.0, 10.0, 30.0, 100.0)  # inverse regularisation strengths tried on validation
NAME = "TF-IDF + logistic regression"


@dataclass
class Baseline:
    """A fitted baseline: its vectorizer, its classifier, and how it was chosen."""

    recipe: str
    c: float  # the C validation chose
    vectorizer: Any  # a fitted sklearn transformer: texts -> (N, F) sparse
    model: Any  # a fitted sklearn LogisticRegression
    valid: dict[str, Any]  # trainer.metrics.summarize on the validation split, at `c`
    seconds: float  # to fit: vectorizer and every C

    def predict(self, texts: Sequence[str]) -> np.ndarray:
        """(N,) int64 class indices."""
        return self.model.predict(self.vectorizer.transform(list(texts))).astype(np.int64)

    def score(self, texts: Sequence[str], labels: np.ndarray, names: Sequence[str]) -> dict[str, Any]:
        """trainer.metrics.summarize of its predictions on labelled texts."""
        return summarize(confusion(np.asarray(labels), self.predict(texts), len(names)), names)

    def about(self) -> dict[str, Any]:
        """What metrics.json and reports record of it."""
        return {"method": NAME, "recipe": self.recipe, "C": self.c, "C_grid": list(C_GRID),
                "selected_on": "validation", "fit_seconds": round(self.seconds, 2)}


def fit(recipe: str, train: tuple[Sequence[str], np.ndarray], valid: tuple[Sequence[str], np.ndarray],
        names: Sequence[str], seed: int, select_metric: str = "accuracy", class_weights: str = "none") -> Baseline:
    """Fit the recipe on `train` (texts, (N,) label indices), choose C on `valid` by `select_metric`."""
    from sklearn.exceptions import ConvergenceWarning
    from sklearn.linear_model import LogisticRegression

    if recipe not in RECIPES[:2]:
        raise ValueError(f"baseline recipe {recipe!r}; choose one of {RECIPES[:2]}")
    t0 = time.perf_counter()
    vectorizer = _vectorizer(recipe, len(train[0]))
    x_train = vectorizer.fit_transform(list(train[0]))
    x_valid = vectorizer.transform(list(valid[0]))
    best: tuple[float, float, Any] | None = None
    # The regularisation path, C increasing, each fit starting from the previous solution (warm start, as
    # scikit-learn's LogisticRegressionCV walks it). tol 1e-6: at the default 1e-4 lbfgs stopped early enough that
    # cold and warm starts disagreed on validation (0.5 to 1 point on cls-books-fr); at 1e-6 they give the same
    # predictions, the warm path in about half the time.
    model = LogisticRegression(max_iter=5000, tol=1e-6, random_state=seed, warm_start=True,
                               class_weight="balanced" if class_weights == "balanced" else None)
    for c in C_GRID:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", ConvergenceWarning)  # a large C on separable data: still a classifier
            model.set_params(C=c).fit(x_train, train[1])
        m = summarize(confusion(valid[1], model.predict(x_valid), len(names)), names)
        if best is None or m[select_metric] > best[0]:
            best = (m[select_metric], c, copy.deepcopy(model))
    assert best is not None
    _, c, model = best
    chosen = summarize(confusion(valid[1], model.predict(x_valid), len(names)), names)
    return Baseline(recipe, c, vectorizer, model, chosen, time.perf_counter() - t0)


def _vectorizer(recipe: str, n_train: int) -> Any:
    from sklearn.feature_extraction.text import TfidfVectorizer
    from sklearn.pipeline import FeatureUnion

    min_df = 2 if n_train >= 1000 else 1
    word = TfidfVectorizer(ngram_range=(1, 2), sublinear_tf=True, min_df=min_df)
    if recipe == "word":
        return word
    char = TfidfVectorizer(analyzer="char_wb", ngram_range=(2, 5), sublinear_tf=True, min_df=min_df)
    return FeatureUnion([("word", word), ("char", char)])


def verdict(who: str, score: float, base: float, metric: str = "accuracy", where: str = "test") -> str:
    """One line: "pretrained: test accuracy 74.25%, 9.70 points below the TF-IDF + logistic regression baseline
    (83.95%)"."""
    diff = score - base
    side = "above" if diff > 0 else "below" if diff < 0 else "level with"
    points = f"{abs(diff):.2f} points {side}" if diff else side
    shown = {"accuracy": "accuracy", "macro_f1": "macro-F1"}.get(metric, metric)
    return f"{who}: {where} {shown} {score:.2f}%, {points} the {NAME} baseline ({base:.2f}%)"


def on_splits(cfg: RunConfig, train: list[Example], valid: list[Example],
              scored: dict[str, list[Example]]) -> dict[str, Any]:
    """Fit the run's recipe (cfg.finetune.tfidf_baseline) on its training split, C chosen on its validation split,
    and score each of `scored` (name -> examples). Returns {method, recipe, C, ..., "valid": metrics, name: metrics}
    or {"skipped": why} when it cannot run (scikit-learn missing, one class only): a report goes on without it."""
    b = fit_splits(cfg, train, valid)
    return {"skipped": b} if isinstance(b, str) else scores(b, cfg.data.names, scored)


def fit_splits(cfg: RunConfig, train: list[Example], valid: list[Example]) -> Baseline | str:
    """on_splits' fit alone, for a caller that scores several sets at different times: the fitted baseline, or
    why it cannot run."""
    f = cfg.finetune
    if f.tfidf_baseline == "none":
        return "finetune.tfidf_baseline=none"
    try:
        return fit(f.tfidf_baseline, _xy(train), _xy(valid), cfg.data.names, cfg.seed, f.select_metric,
                   f.class_weights)
    except ImportError as e:
        return f"scikit-learn is not installed ({e}); pip install scikit-learn (the train extra)"
    except ValueError as e:  # e.g. a training split of one class, an empty vocabulary
        return f"{NAME} could not be fitted: {e}"


def scores(b: Baseline, names: Sequence[str], scored: dict[str, list[Example]]) -> dict[str, Any]:
    """on_splits' report of a fitted baseline: {method, recipe, C, ..., "valid": metrics, name: metrics}."""
    return {**b.about(), "valid": b.valid, **{name: b.score(*_xy(ex), names) for name, ex in scored.items()}}


def _xy(examples: list[Example]) -> tuple[list[str], np.ndarray]:
    return texts(examples), np.array([ex.label for ex in examples], dtype=np.int64)


def summary_line(base: dict[str, Any], where: str = "test") -> str:
    """"baseline: TF-IDF + logistic regression (word+char, C=3 chosen on validation, 2.1 s): valid accuracy 85.50%,
    test accuracy 85.30%", or why it was not scored."""
    if "skipped" in base:
        return f"baseline: {NAME} not scored: {base['skipped']}"
    return (f"baseline: {NAME} ({base['recipe']} n-grams, C={base['C']:g} chosen on validation, "
            f"{base['fit_seconds']:.1f} s): valid accuracy {base['valid']['accuracy']:.2f}%, {where} accuracy "
            f"{base[where]['accuracy']:.2f}%")
