"""The measured-results docs stay short enough to read through: each has a limit in lines, and a doc that grows past
it cuts repetition (one place per fact, the others pointing to it) before it drops a figure."""

from __future__ import annotations

from pathlib import Path

import pytest
from procs import REPO

LIMITS = {"docs/RESULTS.md": 300, "docs/BENCHMARKS.md": 550, "docs/RELIABILITY.md": 450}


def too_long(name: str, text: str, limit: int) -> str | None:
    """A one-line problem when `text` has more than `limit` lines, else None."""
    lines = len(text.splitlines())
    return f"{name} has {lines} lines, more than its {limit}" if lines > limit else None


@pytest.mark.parametrize("name", sorted(LIMITS))
def test_each_results_doc_stays_within_its_length(name: str) -> None:
    path: Path = REPO / name
    assert too_long(name, path.read_text(encoding="utf-8"), LIMITS[name]) is None


def test_a_doc_past_its_limit_is_named() -> None:
    assert too_long("docs/X.md", "row\n" * 301, 300) == "docs/X.md has 301 lines, more than its 300"
    assert too_long("docs/X.md", "row\n" * 300, 300) is None
