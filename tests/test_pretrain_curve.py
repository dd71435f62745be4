"""bench/pretrain_curve.py: accuracy against pretraining compute. The fitted trend against points whose line is known,
and the whole study on the tiny preset: two budgets, two seeds, its report, and a second run that trains nothing."""

from __future__ import annotations

import importlib.util
import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
from procs import REPO

spec = importlib.util.spec_from_file_location("pretrain_curve", REPO / "bench" / "pretrain_curve.py")
curve = importlib.util.module_from_spec(spec)
spec.loader.exec_module(curve)  # type: ignore[union-attr]


def _row(tokens: int, accs: list[float]) -> dict:
    return {"tokens": tokens, "pretrained": accs}


def test_the_fit_finds_two_points_a_doubling_and_where_the_line_crosses() -> None:
    # 70, 72, 74 at 2^20, 2^21, 2^22 tokens, each seed +-0.5 around it: 2 points a doubling, 80 at 2^25
    rows = [_row(2 ** (20 + i), [70 + 2 * i - 0.5, 70 + 2 * i + 0.5]) for i in range(3)]
    f = curve.fit(rows, [80.0, 200.0])
    assert f["b_per_doubling"] == pytest.approx(2.0) and f["a"] == pytest.approx(30.0)
    c = f["crossings"]["80.00"]
    assert math.log2(c["tokens"]) == pytest.approx(25, abs=0.02)
    assert c["earliest"] < c["tokens"] < c["latest"]  # the band's crossings surround the line's
    assert f["crossings"]["200.00"] == {"tokens": None, "earliest": None, "latest": None}  # out of reach: said so


@pytest.mark.slow  # 2 pretraining runs and 8 fine-tuning runs of the tiny preset
def test_the_study_on_the_tiny_preset_reports_each_budget_and_a_second_run_trains_nothing(tmp_path: Path) -> None:
    cmd = [sys.executable, "bench/pretrain_curve.py", "--work", str(tmp_path), "--preset", "tiny", "--steps", "4,6",
           "--seeds", "2"]
    p = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=1200, env=os.environ)
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    report = json.loads((tmp_path / "curve.json").read_text())
    assert [r["steps"] for r in report["rows"]] == [4, 6] and report["rows"][0]["tokens"] < report["rows"][1]["tokens"]
    assert all(len(r["pretrained"]) == 2 for r in report["rows"])
    assert (tmp_path / "curve.png").stat().st_size > 0 and "| 1.5x | 6 |" in (tmp_path / "curve.md").read_text()
    again = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=300, env=os.environ)
    assert again.returncode == 0 and "$ " not in again.stdout, again.stdout  # every stage finished: none started
