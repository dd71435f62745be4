"""The texts the serving benchmarks send: cls-books-fr's test split, from the folder `python -m trainer data fetch`
fills ($TS_DATA, else the user's cache: trainer/config/presets.py, `data_sets`)."""

from __future__ import annotations

import argparse
import random
from pathlib import Path

from trainer.config.presets import data_sets

DEFAULT_DATA = Path(data_sets())


def reviews(ap: argparse.ArgumentParser, data: Path) -> list[str]:
    """Every review of cls-books-fr's test split, in file order; a missing file exits 2 (ap.error)."""
    path = data / "cls-books-fr" / "test.review.txt"
    if not path.is_file():
        ap.error(f"{path} not found: --data names the folder holding cls-books-fr/ (python -m trainer data fetch "
                 "--preset demo puts it there)")
    return [t for t in path.read_text(encoding="utf-8").split("\n") if t.strip()]


def test_texts(ap: argparse.ArgumentParser, data: Path, n: int) -> list[str]:
    """n texts of cls-books-fr's test split, the same n at every run (seed 0); a missing file exits 2 (ap.error)."""
    return random.Random(0).sample(reviews(ap, data), n)
