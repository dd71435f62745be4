"""The baseline every published accuracy sits beside (docs/RESULTS.md): TF-IDF + logistic regression, the function
`finetune` and `export --check` run (trainer/baseline.py), on a preset's own splits.

    .venv/bin/python bench/tfidf_baseline.py [--presets demo english] [--recipe word+char|word]

For each preset, the splits its fine-tuning uses (trainer/data/labelled.py: its training file less the validation
share, or its validation file; its test file and extra test files), the recipe of the preset unless --recipe says
otherwise, C chosen on validation. Prints a markdown table: each set's accuracy and macro-F1, the time to fit (the
vectorizer and every C) and the time in all (reading the files, scoring every set).
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import platform
import time

from trainer import baseline
from trainer.config.presets import preset
from trainer.data import labelled


def run(name: str, recipe: str | None) -> list[str]:
    cfg = preset(name)
    if recipe:
        cfg = dataclasses.replace(cfg, finetune=dataclasses.replace(cfg.finetune, tfidf_baseline=recipe))
    t0 = time.perf_counter()
    data = labelled.load(cfg)
    scored = {"test": data.test.examples, **{f: p.examples for f, p in data.extra.items() if f != cfg.data.test}}
    base = baseline.on_splits(cfg, data.train.originals, data.valid.examples, scored)
    if "skipped" in base:
        return [f"| {name} | {base['skipped']} | | | | | | | |"]
    seconds = time.perf_counter() - t0

    def named(where: str) -> str:
        if where in ("valid", "test"):
            return getattr(cfg.data, where) or f"{getattr(cfg.data, where + '_split'):.0%} of {cfg.data.train}"
        return where

    return [f"| {name} | {len(data.train.originals)} | {named(w)} ({base[w]['examples']}) | {base['recipe']} | "
            f"{base['C']:g} | {base[w]['accuracy']:.2f} | {base[w]['macro_f1']:.2f} | {base['fit_seconds']:.1f} | "
            f"{seconds:.1f} |"
            for w in ("valid", *scored)]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--presets", nargs="+", default=["demo", "english"],
                   help="the presets whose splits are scored (default: demo english)")
    p.add_argument("--recipe", choices=baseline.RECIPES[:2],
                   help="the n-grams to use instead of each preset's finetune.tfidf_baseline")
    args = p.parse_args()
    print(f"machine: {platform.machine()}, {os.cpu_count()} cores, python {platform.python_version()}; load "
          f"average {os.getloadavg()[0]:.2f}; {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}")
    print("| preset | training texts | scored on (examples) | n-grams | C | accuracy | macro-F1 | fit (s) | "
          "in all, reading included (s) |\n|---|---:|---|---|---:|---:|---:|---:|---:|")
    for name in args.presets:
        for row in run(name, args.recipe):
            print(row, flush=True)


if __name__ == "__main__":
    main()
