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

import numpy as np
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
    # the budget column counts the preset's own steps (tiny: 6) as 1x
    assert (tmp_path / "curve.png").stat().st_size > 0 and "| 0.667x | 4 |" in (tmp_path / "curve.md").read_text()
    again = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=300, env=os.environ)
    assert again.returncode == 0 and "$ " not in again.stdout, again.stdout  # every stage finished: none started


def test_the_fit_from_each_budgets_mean_and_sd_is_the_fit_from_its_seeds(tmp_path: Path) -> None:
    # curve.csv keeps a budget's mean, sd and seed count, not its seeds: the line and its band must come out the same
    accs = [[76.1, 77.9, 75.2], [74.0, 76.6, 75.1], [78.3, 73.9, 76.4], [75.0, 75.5, 77.7]]
    rows = [{"steps": 5 * 2 ** i, "tokens": 3 * 2 ** (20 + i), "pretrained": a, "scratch": [70.0, 71.0, 72.0],
             "scratch_mean": 71.0, "scratch_sd": 1.0, "pretrained_mean": sum(a) / 3,
             "pretrained_sd": float(np.std(a, ddof=1)), "gain": 1.0, "gain_ci95": [-1.0, 3.0], "p": 0.5,
             "ece_after": 0.02, "tfidf": 85.3} for i, a in enumerate(accs)]
    curve.report(tmp_path, rows, 5)
    again = curve.read_csv(tmp_path / "curve.csv")
    assert [r["steps"] for r in again] == [5, 10, 20, 40] and all(r["seeds"] == 3 for r in again)
    seeds, summary = curve.fit(rows, [80.0]), curve.fit(again, [80.0])
    for k in ("a", "b_per_doubling", "sd_residual"):
        assert summary[k] == pytest.approx(seeds[k], abs=1e-3)
    assert summary["slope_ci95"] == pytest.approx(seeds["slope_ci95"], abs=1e-3) and summary["n"] == 12


def test_a_curve_csv_without_a_column_is_refused_naming_the_line_and_the_column(tmp_path: Path) -> None:
    bad = tmp_path / "c.csv"
    bad.write_text("steps,tokens,seeds\n100,4096,3\n")
    p = subprocess.run([sys.executable, "bench/pretrain_curve.py", "--work", str(tmp_path), "--from-csv", str(bad)],
                       cwd=REPO, capture_output=True, text=True, timeout=60)
    assert p.returncode == 1 and f"{bad}, line 2: no value for scratch_mean" in p.stderr, p.stderr
    assert not (tmp_path / "curve.png").exists()
    twice = tmp_path / "twice.csv"  # one x for every seed: no line to fit
    row = "100,4096,3,70,1,72,1,2,0,4,0.1,0.02,80"
    twice.write_text(",".join(curve.CSV) + f"\n{row}\n{row}\n")
    p = subprocess.run([sys.executable, "bench/pretrain_curve.py", "--work", str(tmp_path), "--from-csv", str(twice)],
                       cwd=REPO, capture_output=True, text=True, timeout=60)
    assert p.returncode == 1 and "a budget is written twice (steps 100)" in p.stderr, p.stderr


def test_results_table_is_the_committed_curve_csv_that_draws_its_figure() -> None:
    # docs/figures/pretrain-curve.png is drawn from docs/figures/pretrain-curve.csv (the runs' folders are gone):
    # each row of the table in docs/RESULTS.md must say what the csv says
    rows = curve.read_csv(REPO / "docs" / "figures" / "pretrain-curve.csv")
    demo = curve._preset_steps("demo")  # its row is the headline's, in bold
    text = (REPO / "docs" / "RESULTS.md").read_text()
    for r in rows:
        lo, hi = r["gain_ci95"]
        cells = (f"| {r['steps']:,} | {r['tokens'] / 1e6:.1f} M |",
                 f"{r['scratch_mean']:.2f} (sd {r['scratch_sd']:.2f})",
                 f"{r['pretrained_mean']:.2f}** (sd {r['pretrained_sd']:.2f})" if r["steps"] == demo
                 else f"{r['pretrained_mean']:.2f} (sd {r['pretrained_sd']:.2f})",
                 f"{r['gain']:+.2f} ({lo:+.2f} to {hi:+.2f}) | {r['p']:.3f} | {r['ece_after']:.3f} |")
        line = next((x for x in text.splitlines() if x.startswith(f"| {r['steps']:,} |")), "")
        assert all(c in line for c in cells), (cells, line)
    assert "figures/pretrain-curve.png" in text
