"""The baseline every published accuracy sits beside (docs/RESULTS.md): TF-IDF word 1-2 grams + logistic regression.

    .venv/bin/python bench/tfidf_baseline.py [--sets cls-books-fr sst2 imdb]

Reads the data through trainer/data/readers.py (the same readers a user's files go through) and prints a markdown table.
scikit-learn is a benchmark-only dependency (the `dev` extra).
"""

from __future__ import annotations

import argparse
import platform
import time

from sklearn.feature_extraction.text import TfidfVectorizer
from sklearn.linear_model import LogisticRegression

from trainer.config.schema import DataConfig
from trainer.data.readers import detokenize, read_labeled

# name -> (train file, [(split name, eval file)]); paths relative to the data root.
SETS = {
    "cls-books-fr": ("cls-books-fr/train.review.txt", [("test", "cls-books-fr/test.review.txt")]),
    "sst2": ("sst2/train.tsv", [("dev", "sst2/dev.tsv"), ("test", "sst2/test.tsv")]),
    "imdb": ("imdb/train.jsonl.gz", [("test", "imdb/test.jsonl.gz")]),
}


def _texts(path: str, data: DataConfig) -> tuple[list[str], list[int]]:
    examples = read_labeled(data.path(path), data.labels, data.text_field, data.label_field)
    texts = [ex.text if ex.text is not None else detokenize(ex.pieces or []) for ex in examples]
    return texts, [int(ex.label) for ex in examples]  # type: ignore[arg-type]


def run(name: str, data: DataConfig) -> list[tuple[str, str, float, float]]:
    train_file, evals = SETS[name]
    t0 = time.perf_counter()
    x, y = _texts(train_file, data)
    vec = TfidfVectorizer(ngram_range=(1, 2), sublinear_tf=True, min_df=2)
    clf = LogisticRegression(max_iter=2000).fit(vec.fit_transform(x), y)
    rows = []
    for split, path in evals:
        xe, ye = _texts(path, data)
        acc = 100.0 * (clf.predict(vec.transform(xe)) == ye).mean()
        rows.append((name, f"{len(x)} -> {split} {len(xe)}", acc, time.perf_counter() - t0))
    return rows


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--sets", nargs="+", default=list(SETS), choices=list(SETS),
                   help="data sets to score (default: all)")
    args = p.parse_args()
    data = DataConfig()
    print(f"machine: {platform.machine()} {platform.processor() or ''}, python {platform.python_version()}")
    print("| data | train -> eval | TF-IDF + LR accuracy | wall time (s) |\n|---|---|---|---|")
    for name in args.sets:
        for set_name, split, acc, secs in run(name, data):
            print(f"| {set_name} | {split} | {acc:.2f}% | {secs:.1f} |", flush=True)


if __name__ == "__main__":
    main()
