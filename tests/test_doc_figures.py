"""A figure the README repeats from docs/RESULTS.md is the same figure there: the README's results table (a summary
a newcomer reads first) cannot drift from the tables that carry the commands that measured them."""

from __future__ import annotations

import re
from pathlib import Path

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


# ------------------------------------------------------------------------------------------------- pictures

DOCS = [REPO / "README.md", REPO / "launch" / "README.md", *sorted((REPO / "docs").glob("*.md"))]
IMAGE = re.compile(r"!\[[^\]]*\]\(([^)\s]+)\)")  # ![alt](path)
NAMED = re.compile(r"(?<![\w/.-])((?:docs/)?figures/[\w.-]+\.(?:png|svg|jpg))")  # a figure named in prose


def figure_problems(docs: dict[Path, str], figures: set[Path]) -> list[str]:
    """What is wrong between the docs and docs/figures: an image or figure a doc names that does not exist, and a
    figure that no doc shows (an image link, not a mention)."""
    problems, shown = [], set()
    for doc, text in docs.items():
        for m in IMAGE.finditer(text):
            target = (doc.parent / m.group(1)).resolve()
            shown.add(target)
            if target not in figures and not target.exists():
                problems.append(f"{doc.name}: shows {m.group(1)}, which does not exist")
        for m in NAMED.finditer(IMAGE.sub("", text)):
            target = (REPO / m.group(1) if m.group(1).startswith("docs/") else doc.parent / m.group(1)).resolve()
            if target not in figures and not target.exists():
                problems.append(f"{doc.name}: names {m.group(1)}, which does not exist")
    problems += [f"docs/figures/{f.name} is shown by no doc" for f in sorted(figures) if f not in shown]
    return problems


def test_every_figure_shown_exists_and_every_figure_is_shown() -> None:
    files = [p for p in (REPO / "docs" / "figures").iterdir() if p.is_file()]
    figures = {p.resolve() for p in files if p.suffix in (".png", ".svg", ".jpg")}
    docs = {d: d.read_text(encoding="utf-8") for d in DOCS}
    assert figure_problems(docs, figures) == []
    # a figure's data beside it (docs/figures/pretrain-curve.csv draws pretrain-curve.png) is named where it is used
    text = "".join(docs.values())
    assert [p.name for p in files if p.resolve() not in figures and f"docs/figures/{p.name}" not in text] == []


def test_a_missing_or_unshown_figure_is_caught() -> None:
    doc = REPO / "docs" / "X.md"
    kept, unshown = (REPO / "docs" / "figures" / n for n in ("kept.png", "unshown.png"))
    text = "![a](figures/kept.png) ![b](figures/gone.png) and docs/figures/also-gone.png\n"
    assert figure_problems({doc: text}, {kept.resolve(), unshown.resolve()}) == [
        "X.md: shows figures/gone.png, which does not exist",
        "X.md: names docs/figures/also-gone.png, which does not exist",
        "docs/figures/unshown.png is shown by no doc",
    ]
