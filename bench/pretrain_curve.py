"""What pretraining buys: accuracy against pretraining compute, over seeds, with where the trend would cross a line.

For each budget (pretraining steps) it pretrains once (`python -m trainer pretrain`, the preset's schedule ending at
that step), then fine-tunes both arms at N seeds (`finetune --compare --seeds N`), and reports test accuracy of each
arm (mean and spread), the gain with its paired test, against the tokens the encoder was pretrained on, the
TF-IDF baseline drawn beside them. A line fitted to the pretrained arm's seed accuracies against log2(tokens)
(least squares) says, with the 95% confidence band of that line, at how many tokens it would reach each target.

Every stage runs with `--resume auto` and a finished one is skipped: run the same command again after an
interruption and it goes on where it stopped (one tokenized corpus, WORK/prepared, is shared by every budget).
  python bench/pretrain_curve.py --work runs/curve --steps 1500,3000,6000,12000 --seeds 3
  python bench/pretrain_curve.py --work runs/curve --steps 1500,3000,6000,12000 --report-only
  python bench/pretrain_curve.py --work runs/redraw --from-csv docs/figures/pretrain-curve.csv
writes WORK/curve.{md,csv,json,png}; docs/RESULTS.md ("What pretraining buys") has the demo's, and its curve.csv is
docs/figures/pretrain-curve.csv (the third command draws its figure again, the runs' folders gone).
"""

from __future__ import annotations

import argparse
import csv
import json
import math
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np

REPO = Path(__file__).resolve().parent.parent
TARGETS = (80.0,)  # accuracies the fitted trend is solved for, beside the TF-IDF baseline's
CSV = ("steps", "tokens", "seeds", "scratch_mean", "scratch_sd", "pretrained_mean", "pretrained_sd", "gain", "gain_lo",
       "gain_hi", "p", "ece_after", "tfidf")  # curve.csv: a budget a row, enough to report and draw it again


def _run(cmd: list[str], log: Path) -> None:
    print(f"  $ {' '.join(cmd)}  (log: {log})", flush=True)
    with open(log, "a") as f:
        p = subprocess.run(cmd, cwd=REPO, stdout=f, stderr=subprocess.STDOUT)
    if p.returncode:
        sys.exit(f"error: exit {p.returncode}: {' '.join(cmd)}; its output: {log}")


def train(work: Path, steps: int, preset: str, seeds: int, sets: list[str]) -> None:
    py = [sys.executable, "-m", "trainer"]
    extra = [a for s in sets for a in ("--set", s)]
    if not (work / "prepared" / "manifest.json").is_file():
        _run([*py, "prepare", "--preset", preset, *extra, "--out", str(work / "prepared")], work / "prepare.log")
    pre, ft = work / f"pre-{steps}", work / f"ft-{steps}"
    t0 = time.monotonic()
    if not (pre / "artifact" / "artifact.json").is_file():
        _run([*py, "pretrain", "--preset", preset, *extra, "--set", f"pretrain.max_steps={steps}", "--set",
              f"data.prepared={work / 'prepared'}", "--resume", "auto", "--out", str(pre)], work / f"pre-{steps}.log")
    if not (ft / "artifact" / "artifact.json").is_file():
        _run([*py, "finetune", "--preset", preset, *extra, "--pretrained", str(pre / "artifact"), "--compare",
              "--seeds", str(seeds), "--resume", "auto", "--out", str(ft)], work / f"ft-{steps}.log")
    print(f"budget {steps} steps: done ({time.monotonic() - t0:,.0f} s this run)", flush=True)


def row(work: Path, steps: int) -> dict[str, Any] | None:
    """One budget's figures from its artifacts; None while it is unfinished."""
    pre, ft = work / f"pre-{steps}" / "artifact" / "artifact.json", work / f"ft-{steps}" / "artifact" / "artifact.json"
    if not (pre.is_file() and ft.is_file()):
        return None
    lm, cls = json.loads(pre.read_text(encoding="utf-8")), json.loads(ft.read_text(encoding="utf-8"))
    s, base = cls["seeds"], cls.get("tfidf_baseline") or {}
    return {"steps": lm["steps"], "tokens": lm["tokens"],
            "scratch": s["test_accuracy"]["scratch"], "pretrained": s["test_accuracy"]["pretrained"],
            "scratch_mean": s["test_accuracy_stats"]["scratch"]["mean"],
            "scratch_sd": s["test_accuracy_stats"]["scratch"]["sd"],
            "pretrained_mean": s["test_accuracy_stats"]["pretrained"]["mean"],
            "pretrained_sd": s["test_accuracy_stats"]["pretrained"]["sd"],
            "gain": s["paired"]["gain_mean"], "gain_ci95": s["paired"]["ci95"], "p": s["paired"]["p"],
            "ece_after": float(np.mean(s["calibration"]["pretrained"]["test_ece_after"])),
            "tfidf": (base.get("test") or {}).get("accuracy")}


def read_csv(path: Path) -> list[dict[str, Any]]:
    """The rows of a curve.csv (this script's, or one written from a report's table): every CSV column, numbers."""
    try:
        with open(path, newline="", encoding="utf-8") as fh:
            rows = list(csv.DictReader(fh))
    except OSError as e:
        sys.exit(f"error: {path}: {e.strerror}")
    out = []
    for i, r in enumerate(rows, start=2):
        missing = [k for k in CSV if k not in r or (r[k] in ("", None) and k != "tfidf")]
        if missing:
            sys.exit(f"error: {path}, line {i}: no value for {', '.join(missing)} (columns: {','.join(CSV)})")
        try:
            v = {k: (int(r[k]) if k in ("steps", "tokens", "seeds") else float(r[k]) if r[k] else None) for k in CSV}
        except ValueError as e:
            sys.exit(f"error: {path}, line {i}: {e}")
        if v["seeds"] < 2 or v["tokens"] < 1:
            sys.exit(f"error: {path}, line {i}: seeds must be at least 2 and tokens positive")
        v["gain_ci95"] = [v.pop("gain_lo"), v.pop("gain_hi")]
        out.append(v)
    if len(out) < 1:
        sys.exit(f"error: {path}: no rows")
    steps = [r["steps"] for r in out]
    twice = sorted({s for s in steps if steps.count(s) > 1})
    if twice:
        sys.exit(f"error: {path}: a budget is written twice (steps {', '.join(map(str, twice))})")
    return sorted(out, key=lambda r: r["steps"])


def _arm(r: dict[str, Any]) -> tuple[float, float, int]:
    """The pretrained arm's mean, sd and seed count: from its seeds' accuracies, or from a curve.csv row."""
    if r.get("pretrained"):
        v = np.array(r["pretrained"], dtype=float)
        return float(v.mean()), float(v.std(ddof=1)) if len(v) > 1 else 0.0, len(v)
    return float(r["pretrained_mean"]), float(r["pretrained_sd"]), int(r["seeds"])


def fit(rows: list[dict[str, Any]], targets: list[float]) -> dict[str, Any]:
    """accuracy = a + b log2(tokens), least squares over every seed's pretrained accuracy; for each target the tokens
    where the line reaches it, and where the 95% confidence band of the line does (the optimistic and the pessimistic
    crossing). Each budget's seeds share one x, so each budget's mean, sd and count are all the fit needs: the line is
    the means' fit weighted by seeds, the residual adds each budget's spread (the same figures as from the seeds)."""
    from scipy import stats

    x = np.array([math.log2(r["tokens"]) for r in rows])
    m, sd, k = (np.array(c, dtype=float) for c in zip(*(_arm(r) for r in rows), strict=True))
    n = int(k.sum())
    xm, ym = float(k @ x) / n, float(k @ m) / n
    sxx = float(k @ (x - xm) ** 2)
    b = float(k @ ((x - xm) * (m - ym))) / sxx
    a = ym - b * xm
    s = math.sqrt((float(k @ (m - a - b * x) ** 2) + float((k - 1) @ sd ** 2)) / (n - 2))
    tq = float(stats.t.ppf(0.975, n - 2))
    grid = np.linspace(x.min(), x.max() + 12, 2000)  # out to 4096x the largest budget
    half = tq * s * np.sqrt(1 / n + (grid - xm) ** 2 / sxx)
    out: dict[str, Any] = {"a": float(a), "b_per_doubling": float(b), "sd_residual": s, "n": n,
                           "slope_ci95": [float(b - tq * s / math.sqrt(sxx)), float(b + tq * s / math.sqrt(sxx))],
                           "crossings": {}}

    def first(curve: np.ndarray, t: float) -> float | None:
        hit = np.nonzero(curve >= t)[0]
        return float(2 ** grid[hit[0]]) if len(hit) else None

    line = a + b * grid
    for t in targets:
        out["crossings"][f"{t:.2f}"] = {"tokens": first(line, t), "earliest": first(line + half, t),
                                        "latest": first(line - half, t)}
    out["grid"], out["line"], out["half"] = grid.tolist(), line.tolist(), half.tolist()
    return out


def _tok(v: float | None) -> str:
    return "beyond 4096x the largest budget" if v is None else f"{v / 1e6:,.0f} M"


def report(work: Path, rows: list[dict[str, Any]], demo_steps: int) -> None:
    tfidf = next((r["tfidf"] for r in rows if r["tfidf"] is not None), None)
    f = fit(rows, [*TARGETS, *([tfidf] if tfidf else [])]) if len(rows) >= 2 else None
    lines = ["| budget | steps | tokens | scratch | pretrained | gain (95% CI) | p | ECE after |", "|---" * 8 + "|"]
    for r in rows:
        lo, hi = r["gain_ci95"]
        lines.append(f"| {r['steps'] / demo_steps:.3g}x | {r['steps']:,} | {r['tokens'] / 1e6:,.1f} M | "
                     f"{r['scratch_mean']:.2f} (sd {r['scratch_sd']:.2f}) | {r['pretrained_mean']:.2f} (sd "
                     f"{r['pretrained_sd']:.2f}) | {r['gain']:+.2f} ({lo:+.2f} to {hi:+.2f}) | {r['p']:.3g} | "
                     f"{r['ece_after']:.3f} |")
    if tfidf is not None:
        lines += ["", f"TF-IDF baseline (same splits): {tfidf:.2f}"]
    if f:
        lines += ["", f"Fitted: pretrained accuracy = {f['a']:.2f} + {f['b_per_doubling']:.2f} x log2(tokens) "
                      f"(slope 95% CI {f['slope_ci95'][0]:+.2f} to {f['slope_ci95'][1]:+.2f} points a doubling; "
                      f"{f['n']} seed runs)."]
        for t, c in f["crossings"].items():
            if c["tokens"] is None and c["earliest"] is None:
                lines.append(f"- reaches {t}: not within 4096x the largest budget, nor does the line's 95% band")
                continue
            lines.append(f"- reaches {t}: at {_tok(c['tokens'])} tokens (95% band: {_tok(c['earliest'])} to "
                         f"{_tok(c['latest'])})")
    (work / "curve.md").write_text("\n".join(lines) + "\n", encoding="utf-8")
    (work / "curve.json").write_text(json.dumps({"rows": rows, "fit": f and {k: v for k, v in f.items()
                                                 if k not in ("grid", "line", "half")}}, indent=1) + "\n")
    with open(work / "curve.csv", "w", newline="") as fh:
        w = csv.DictWriter(fh, CSV)
        w.writeheader()
        for r in rows:
            lo, hi = (round(v, 4) for v in r["gain_ci95"])
            w.writerow({"seeds": _arm(r)[2], "gain_lo": lo, "gain_hi": hi,
                        **{k: round(r[k], 4) if isinstance(r[k], float) else r[k] for k in CSV if k in r}})
    plot(work / "curve.png", rows, f, tfidf)
    print("\n".join(lines))


def plot(path: Path, rows: list[dict[str, Any]], f: dict[str, Any] | None, tfidf: float | None) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.2))
    t = np.array([r["tokens"] for r in rows])
    for arm, color in (("scratch", "tab:gray"), ("pretrained", "tab:blue")):
        m, sd = np.array([r[f"{arm}_mean"] for r in rows]), np.array([r[f"{arm}_sd"] for r in rows])
        ax.errorbar(t, m, yerr=sd, marker="o", capsize=3, color=color, label=f"{arm} (mean, sd over seeds)")
    if f:
        g = 2 ** np.array(f["grid"])
        keep = g <= t.max() * 64
        line, half = np.array(f["line"])[keep], np.array(f["half"])[keep]
        ax.plot(g[keep], line, "--", color="tab:blue", lw=1, label="fitted trend (log2 tokens)")
        ax.fill_between(g[keep], line - half, line + half, color="tab:blue", alpha=0.12, label="95% band of the fit")
    if tfidf is not None:
        ax.axhline(tfidf, color="tab:red", lw=1, label=f"TF-IDF baseline {tfidf:.2f}")
    ax.set_xscale("log", base=2)
    ax.set_xlabel("pretraining tokens seen")
    ax.set_ylabel("test accuracy (%)")
    ax.legend(fontsize=8, loc="lower left", ncol=2)
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def _preset_steps(name: str) -> int | None:
    """The preset's own pretraining steps (`make demo`'s 1,500 for demo): the 1x of the budget column."""
    sys.path.insert(0, str(REPO))
    from trainer.config.presets import preset

    try:
        return preset(name).pretrain.max_steps
    except ValueError:
        return None


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--work", type=Path, required=True, help="folder of the runs and the report")
    p.add_argument("--steps", help="pretraining budgets in optimizer steps, e.g. 1500,3000,6000")
    p.add_argument("--seeds", type=int, default=3, help="fine-tuning seeds per arm and budget (default 3)")
    p.add_argument("--preset", default="demo", help="the preset of every run (default: demo)")
    p.add_argument("--set", dest="sets", action="append", default=[], metavar="KEY=VALUE",
                   help="a config override for every run (repeatable)")
    p.add_argument("--report-only", action="store_true", help="report the finished budgets; train nothing")
    p.add_argument("--from-csv", type=Path, metavar="CSV",
                   help="report (table, fit, figure) from a curve.csv instead of the runs; train nothing")
    a = p.parse_args(argv)
    a.work.mkdir(parents=True, exist_ok=True)
    if a.from_csv:
        rows = read_csv(a.from_csv)
        report(a.work, rows, _preset_steps(a.preset) or rows[0]["steps"])
        return 0
    if not a.steps:
        p.error("--steps is needed (or --from-csv)")
    try:
        budgets = sorted({int(s) for s in a.steps.split(",")})
    except ValueError:
        p.error(f"--steps {a.steps!r}: comma-separated step counts, e.g. 1500,3000")
    if not budgets or budgets[0] < 1 or a.seeds < 2:
        p.error("--steps needs positive counts and --seeds at least 2 (the spread and the paired test)")
    for i, steps in enumerate(budgets):
        if not a.report_only:
            print(f"[{i + 1}/{len(budgets)}] budget {steps} steps", flush=True)
            train(a.work, steps, a.preset, a.seeds, a.sets)
    rows = [r for r in (row(a.work, s) for s in budgets) if r]
    if not rows:
        sys.exit("error: no budget has finished yet")
    report(a.work, rows, _preset_steps(a.preset) or budgets[0])
    return 0


if __name__ == "__main__":
    sys.exit(main())
