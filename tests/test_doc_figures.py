"""A figure the README repeats from docs/RESULTS.md is the same figure there: the README's results table (a summary
a newcomer reads first) cannot drift from the tables that carry the commands that measured them."""

from __future__ import annotations

import re

from procs import REPO

FIGURE = re.compile(r"\b\d+\.\d\d\b")  # accuracies are written with two decimals


def missing_figures(readme: str, results: str) -> list[tuple[str, str]]:
    """(row, figure) for each figure of the README's results table (under "## Results") that `results` lacks."""
    section = readme[readme.index("## Results"):]
    end = section.find("\n## ", 1)
    rows = [r.strip() for r in section[:end if end > 0 else None].splitlines() if r.strip().startswith("|")]
    rows = [r for r in rows if FIGURE.search(r)]
    if not rows:
        return [("", "no results table under '## Results'")]
    held = set(FIGURE.findall(results))
    return [(row, f) for row in rows for f in FIGURE.findall(row) if f not in held]


def test_the_readmes_results_are_those_of_docs_results() -> None:
    readme = (REPO / "README.md").read_text(encoding="utf-8")
    results = (REPO / "docs" / "RESULTS.md").read_text(encoding="utf-8")
    assert missing_figures(readme, results) == []


def test_a_figure_results_does_not_hold_is_caught() -> None:
    readme = "## Results\n\n| set | scratch | pretrained |\n|---|---:|---:|\n| test | 72.35 | 74.26 |\n\n## Next\n"
    assert missing_figures(readme, "| test | 72.35 | 74.25 |") == [("| test | 72.35 | 74.26 |", "74.26")]
    assert missing_figures("## Results\n\nno table\n", "72.35") == [("", "no results table under '## Results'")]
