"""The measured-results docs stay short enough to read through: each has a limit in lines, and a doc that grows past
it cuts repetition (one place per fact, the others pointing to it) before it drops a figure. So do the modules of the
product and of its benchmarks: one a reader holds in their head, split by what each part does past MODULE_LINES."""

from __future__ import annotations

from pathlib import Path

import pytest
from procs import REPO

LIMITS = {"docs/RESULTS.md": 300, "docs/BENCHMARKS.md": 550, "docs/RELIABILITY.md": 450}
MODULE_LINES = 450
MODULE_FOLDERS = ("trainer", "serving", "contract", "bench")  # serving/gen/ is generated (make proto): not read


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


def test_no_module_of_the_product_or_its_benchmarks_is_over_its_length() -> None:
    modules = [p for folder in MODULE_FOLDERS for p in sorted((REPO / folder).rglob("*.py"))
               if "gen" not in p.relative_to(REPO).parts]
    assert len(modules) > 100  # the folders were found
    problems = [too_long(str(p.relative_to(REPO)), p.read_text(encoding="utf-8"), MODULE_LINES) for p in modules]
    assert not [p for p in problems if p], [p for p in problems if p]
