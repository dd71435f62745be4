"""`finetune --compare --seeds N`: the same comparison at N training seeds, and whether the gain is more than noise.

Each seed s (cfg.seed, cfg.seed + 1, ...) trains both arms with the same head initialisation, data order and dropout
(the scratch arm's encoder initialisation too), on the same splits, the pretrained arms all from the one pretrained
encoder. The gain of a seed is its pretrained run's test score minus its scratch run's (the kept weights of each);
the gains are compared with zero by a paired t-test over the seeds (scipy.stats.ttest_rel, two-sided): pairing by
seed removes what a seed does to both arms alike (the data order), so the test asks whether the gain is larger than
its own seed-to-seed spread.

Writes RUN/compare.{md,csv,png} (each seed, the mean and the standard deviation over seeds, the verdict) and
RUN/artifact: the pretrained classifier of the seed with the best validation score (the first of a tie), with the
summary in its artifact.json ("seeds"). Rank 0 only; numbers in percent.
"""

from __future__ import annotations

import csv
import io
import json
import math
import shutil
import sys
from pathlib import Path
from typing import Any

import numpy as np

from trainer import artifact
from trainer.artifact import replace_dir, write_text_atomic
from trainer.atomic import temp_dir
from trainer.config.schema import RunConfig

ARMS = ("scratch", "pretrained")
TEST_NAME = "paired t-test over seeds (scipy.stats.ttest_rel, two-sided)"
ALPHA = 0.05  # the verdict's significance level


def paired_test(pretrained: list[float], scratch: list[float]) -> dict[str, Any]:
    """Gains (pretrained - scratch, one per seed): mean, sd (n - 1), the 95% confidence interval of the mean, the
    paired t-test's t and p, and on how many seeds pretrained led. n >= 2."""
    from scipy import stats

    d = np.subtract(pretrained, scratch, dtype=np.float64)
    n, mean = len(d), float(d.mean())
    sd = float(d.std(ddof=1))
    if sd == 0.0:  # every seed the same gain: no spread to test against
        t, p = (math.copysign(math.inf, mean), 0.0) if mean else (0.0, 1.0)
    else:
        r = stats.ttest_rel(pretrained, scratch)
        t, p = float(r.statistic), float(r.pvalue)
    half = float(stats.t.ppf(0.975, n - 1)) * sd / math.sqrt(n)
    return {"test": TEST_NAME, "n": n, "gain_mean": mean, "gain_sd": sd, "ci95": [mean - half, mean + half],
            "t": t, "p": p, "ahead": int((d > 0).sum()), "exceeds_noise": bool(p < ALPHA and mean > 0)}


def verdict(t: dict[str, Any]) -> str:
    """One line: the mean gain, its interval, the test and what it says."""
    lo, hi = t["ci95"]
    says = (f"the gain exceeds the seed-to-seed noise (p < {ALPHA:g})" if t["exceeds_noise"] else
            f"the gain is not distinguishable from the seed-to-seed noise (p >= {ALPHA:g} or not positive)")
    return (f"gain {t['gain_mean']:+.2f} points (pretrained - scratch, test accuracy, mean of {t['n']} seeds, sd "
            f"{t['gain_sd']:.2f}, 95% CI {lo:+.2f} to {hi:+.2f}); {t['test']}: t = {t['t']:.2f}, p = {t['p']:.3g}, "
            f"{t['n'] - 1} degrees of freedom: {says}; pretrained ahead on {t['ahead']} of {t['n']} seeds")


def _stats(values: list[float]) -> dict[str, float]:
    return {"mean": float(np.mean(values)), "sd": float(np.std(values, ddof=1))}


def summarize(results: dict[int, dict[str, dict[str, Any]]], cfg: RunConfig) -> dict[str, Any]:
    """What every report of the seeds says: per seed and arm the kept epoch and scores, their means and spreads,
    the paired test, the seed exported."""
    seeds = sorted(results)
    per = {arm: {key: [results[s][arm]["final"]["test"][key] for s in seeds] for key in ("accuracy", "macro_f1")}
           for arm in ARMS}
    extra = {f: {arm: [results[s][arm]["final"]["extra"][f]["accuracy"] for s in seeds] for arm in ARMS}
             for f in results[seeds[0]]["pretrained"]["final"]["extra"]}
    return {
        "seeds": seeds,
        "selected_on": f"valid {cfg.finetune.select_metric}",
        "exported_seed": exported(results, cfg),
        "kept_epoch": {arm: [results[s][arm]["kept"]["epoch"] for s in seeds] for arm in ARMS},
        "valid_accuracy": {arm: [results[s][arm]["final"]["valid"]["accuracy"] for s in seeds] for arm in ARMS},
        "test_accuracy": {arm: per[arm]["accuracy"] for arm in ARMS},
        "test_macro_f1": {arm: per[arm]["macro_f1"] for arm in ARMS},
        "test_accuracy_stats": {arm: _stats(per[arm]["accuracy"]) for arm in ARMS},
        "test_macro_f1_stats": {arm: _stats(per[arm]["macro_f1"]) for arm in ARMS},
        "extra_accuracy": extra,
        "paired": paired_test(per["pretrained"]["accuracy"], per["scratch"]["accuracy"]),
        "calibration": {arm: {"temperature": [results[s][arm]["calibration"]["temperature"] for s in seeds],
                              **{f"test_{k}": [results[s][arm]["calibration"]["test"][k] for s in seeds]
                                 for k in ("ece_before", "ece_after")}} for arm in ARMS},
    }


def exported(results: dict[int, dict[str, dict[str, Any]]], cfg: RunConfig) -> int:
    """The seed whose pretrained classifier RUN/artifact holds: the best validation score (select_metric), the first
    seed of a tie. Validation chooses, never test."""
    metric = cfg.finetune.select_metric
    return max(sorted(results), key=lambda s: (results[s]["pretrained"]["final"]["valid"][metric], -s))


def finish(run_dir: Path, results: dict[int, dict[str, dict[str, Any]]], cfg: RunConfig,
           pretrained: artifact.Artifact | None, tfidf: dict[str, Any] | None, folder: Path) -> dict[str, Any]:
    """The reports and RUN/artifact (a copy of `folder`/artifact, the exported seed's, with the summary added);
    returns the summary."""
    summary = summarize(results, cfg)
    base = tfidf if tfidf and "skipped" not in tfidf else None
    write_text_atomic(run_dir / "compare.csv", compare_csv(results, summary, base))
    write_text_atomic(run_dir / "compare.md", "\n".join(compare_md(results, summary, cfg, pretrained, base)))
    plot(run_dir, results, summary, cfg, pretrained, base)
    copy_artifact(folder / "artifact", run_dir / "artifact", summary)
    print(f"comparison over {len(results)} seeds: {run_dir / 'compare.md'}, {run_dir / 'compare.png'}", file=sys.stdout)
    return summary


def copy_artifact(src: Path, dst: Path, summary: dict[str, Any]) -> None:
    """`src` copied to `dst` atomically, its artifact.json with "seeds" added (the weights and their checksum are
    the same files)."""
    tmp = temp_dir(dst.parent, f".{dst.name}.tmp-")
    try:
        shutil.copytree(src, tmp, dirs_exist_ok=True)
        meta = json.loads((tmp / "artifact.json").read_text(encoding="utf-8"))
        meta["seeds"] = summary
        (tmp / "artifact.json").write_text(json.dumps(meta, indent=2) + "\n", encoding="utf-8")
        replace_dir(tmp, dst)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


def compare_csv(results: dict[int, dict[str, dict[str, Any]]], summary: dict[str, Any],
                base: dict[str, Any] | None) -> str:
    """compare.csv's columns with a seed column first: each seed's epochs, then its kept weights (epoch "kept"),
    then the mean and the sd over seeds of the kept weights' scores."""
    buf = io.StringIO()
    w = csv.writer(buf, lineterminator="\n")
    w.writerow(["seed", "epoch", "scratch_valid_accuracy", "pretrained_valid_accuracy", "scratch_test_accuracy",
                "pretrained_test_accuracy", "test_difference", "tfidf_valid_accuracy", "tfidf_test_accuracy"])
    fixed = [f"{base['valid']['accuracy']:.2f}", f"{base['test']['accuracy']:.2f}"] if base else ["", ""]
    for seed in summary["seeds"]:
        s, p = results[seed]["scratch"], results[seed]["pretrained"]
        rows = [(a["epoch"], a["valid"]["accuracy"], b["valid"]["accuracy"], a["test"]["accuracy"],
                 b["test"]["accuracy"]) for a, b in zip(s["history"], p["history"], strict=False)]
        rows.append(("kept", s["final"]["valid"]["accuracy"], p["final"]["valid"]["accuracy"],
                     s["final"]["test"]["accuracy"], p["final"]["test"]["accuracy"]))
        w.writerows([seed, e, f"{sv:.2f}", f"{pv:.2f}", f"{st:.2f}", f"{pt:.2f}", f"{pt - st:+.2f}", *fixed]
                    for e, sv, pv, st, pt in rows)
    gains = np.subtract(summary["test_accuracy"]["pretrained"], summary["test_accuracy"]["scratch"])
    for stat, fn, sign in (("mean", np.mean, "+"), ("sd", lambda v: np.std(v, ddof=1), "")):
        valid, test = summary["valid_accuracy"], summary["test_accuracy"]
        w.writerow([stat, "kept", f"{fn(valid['scratch']):.2f}", f"{fn(valid['pretrained']):.2f}",
                    f"{fn(test['scratch']):.2f}", f"{fn(test['pretrained']):.2f}", f"{fn(gains):{sign}.2f}", *fixed])
    return buf.getvalue()


def compare_md(results: dict[int, dict[str, dict[str, Any]]], summary: dict[str, Any], cfg: RunConfig,
               pretrained: artifact.Artifact | None, base: dict[str, Any] | None) -> list[str]:
    seeds, t = summary["seeds"], summary["paired"]
    objective = pretrained.meta.get("objective") if pretrained else None
    test = cfg.data.test or f"{cfg.data.test_split:.0%} of `{cfg.data.train}`"
    acc, f1 = summary["test_accuracy"], summary["test_macro_f1"]
    md = [f"Pretrained vs from scratch, preset `{cfg.preset}`, {len(seeds)} seeds ({', '.join(map(str, seeds))}: "
          f"head initialisation, data order and dropout; the same splits); pretrained encoder: "
          f"`{pretrained.path if pretrained else ''}` (objective {objective}). Each run keeps the weights of its "
          f"epoch with the best validation {cfg.finetune.select_metric}; every number below is those weights' "
          f"score on the test set ({test}, all of it).", "",
          f"**Verdict:** {verdict(t)}.", "",
          "| seed | epoch kept, scratch | epoch kept, pretrained | test accuracy, scratch | test accuracy, "
          "pretrained | gain | test macro-F1, scratch | test macro-F1, pretrained |",
          "|---|---:|---:|---:|---:|---:|---:|---:|"]
    for i, seed in enumerate(seeds):
        md.append(f"| {seed} | {summary['kept_epoch']['scratch'][i]} | {summary['kept_epoch']['pretrained'][i]} | "
                  f"{acc['scratch'][i]:.2f} | {acc['pretrained'][i]:.2f} | "
                  f"{acc['pretrained'][i] - acc['scratch'][i]:+.2f} | {f1['scratch'][i]:.2f} | "
                  f"{f1['pretrained'][i]:.2f} |")
    gains = np.subtract(acc["pretrained"], acc["scratch"])
    for stat, fn, sign in (("**mean**", np.mean, "+"), ("sd (spread)", lambda v: np.std(v, ddof=1), "")):
        md.append(f"| {stat} | | | {fn(acc['scratch']):.2f} | {fn(acc['pretrained']):.2f} | {fn(gains):{sign}.2f} | "
                  f"{fn(f1['scratch']):.2f} | {fn(f1['pretrained']):.2f} |")
    if base:
        md.append(f"| TF-IDF + LR baseline (C={base['C']:g}) | | | {base['test']['accuracy']:.2f} | | | "
                  f"{base['test']['macro_f1']:.2f} | |")
    for f, arms in summary["extra_accuracy"].items():
        d = np.subtract(arms["pretrained"], arms["scratch"])
        md += ["", f"`{f}` accuracy, mean (sd) over seeds: scratch {np.mean(arms['scratch']):.2f} "
                   f"({np.std(arms['scratch'], ddof=1):.2f}), pretrained {np.mean(arms['pretrained']):.2f} "
                   f"({np.std(arms['pretrained'], ddof=1):.2f}), gain {d.mean():+.2f} ({d.std(ddof=1):.2f})"
                   + (f"; TF-IDF + LR baseline {base[f]['accuracy']:.2f}" if base and f in base else "")]
    cal = summary["calibration"]
    md += ["", "Test ECE (15 bins), raw -> calibrated by the temperature each run fitted on validation, mean over "
               "seeds: " + "; ".join(f"{arm} {np.mean(cal[arm]['test_ece_before']):.3f} -> "
                                     f"{np.mean(cal[arm]['test_ece_after']):.3f} (highest "
                                     f"{max(cal[arm]['test_ece_after']):.3f}, T {min(cal[arm]['temperature']):.2f} - "
                                     f"{max(cal[arm]['temperature']):.2f})" for arm in ARMS)
           + " (`reliability.png`: the exported classifier's diagram)"]
    e = summary["exported_seed"]
    valid = results[e]["pretrained"]["final"]["valid"][cfg.finetune.select_metric]
    md += ["", f"`artifact/` holds the pretrained classifier of seed {e}, the best validation "
               f"{cfg.finetune.select_metric} of the {len(seeds)} ({valid:.2f}%); each seed's runs are in "
               "`seed<N>/scratch` and `seed<N>/pretrained`.", "",
           "Per epoch, test accuracy (a curve: it never chooses the epoch kept), mean over seeds (lowest - highest):",
           "", "| epoch | scratch | pretrained | difference |", "|---:|---:|---:|---:|"]
    for epoch, (s_row, p_row) in enumerate(zip(_curves(results, "scratch"), _curves(results, "pretrained"),
                                                strict=False), start=1):
        md.append(f"| {epoch} | {np.mean(s_row):.2f} ({min(s_row):.2f} - {max(s_row):.2f}) | {np.mean(p_row):.2f} "
                  f"({min(p_row):.2f} - {max(p_row):.2f}) | {np.mean(p_row) - np.mean(s_row):+.2f} |")
    return [*md, ""]


def _curves(results: dict[int, dict[str, dict[str, Any]]], arm: str) -> list[list[float]]:
    """Per epoch, the test accuracy of each seed that reached it (early stopping may end a seed sooner)."""
    longest = max(len(r[arm]["history"]) for r in results.values())
    return [[r[arm]["history"][e]["test"]["accuracy"] for r in results.values() if len(r[arm]["history"]) > e]
            for e in range(longest)]


def plot(run_dir: Path, results: dict[int, dict[str, dict[str, Any]]], summary: dict[str, Any], cfg: RunConfig,
         pretrained: artifact.Artifact | None, base: dict[str, Any] | None) -> None:
    """Left: each seed's per-epoch test curve (thin) and their mean (thick), per arm. Right: each seed's kept
    weights, scratch and pretrained joined by a line, the means as bars' tops."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import matplotlib.ticker

    objective = pretrained.meta.get("objective") if pretrained else None
    fig, (ax, bx) = plt.subplots(1, 2, figsize=(10.5, 4.2), dpi=120, gridspec_kw={"width_ratios": [3, 2]})
    for arm, label in (("scratch", "from scratch"), ("pretrained", f"pretrained ({objective})")):
        colour = None
        for r in results.values():
            hist = r[arm]["history"]
            line = ax.plot([h["epoch"] for h in hist], [h["test"]["accuracy"] for h in hist], linewidth=0.8,
                           alpha=0.45, color=colour)[0]
            colour = line.get_color()
        means = [float(np.mean(v)) for v in _curves(results, arm)]
        ax.plot(range(1, len(means) + 1), means, linewidth=2.2, color=colour, marker="o",
                label=f"{label}: test, mean of {len(results)} seeds")
    if base is not None:
        for a in (ax, bx):
            a.axhline(base["test"]["accuracy"], color="grey", linestyle=":",
                      label=f"TF-IDF + LR baseline ({base['test']['accuracy']:.1f})")
    ax.set_xlabel("epoch")
    ax.xaxis.set_major_locator(matplotlib.ticker.MaxNLocator(integer=True))
    ax.set_ylabel("test accuracy per epoch (%)")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7)
    acc = summary["test_accuracy"]
    for i, seed in enumerate(summary["seeds"]):
        bx.plot([0, 1], [acc["scratch"][i], acc["pretrained"][i]], marker="o", color="tab:grey", alpha=0.6)
        bx.annotate(str(seed), (1.03, acc["pretrained"][i]), fontsize=7, va="center")
    for x, arm in enumerate(ARMS):
        m = summary["test_accuracy_stats"][arm]
        bx.errorbar([x], [m["mean"]], yerr=[m["sd"]], marker="_", markersize=24, capsize=6, linewidth=2,
                    color="tab:blue" if arm == "scratch" else "tab:orange")
    bx.set_xticks([0, 1], ["from scratch", "pretrained"])
    bx.set_xlim(-0.4, 1.4)
    bx.set_ylabel("test accuracy, kept weights (%)")
    t = summary["paired"]
    bx.set_title(f"gain {t['gain_mean']:+.2f} (sd {t['gain_sd']:.2f}), paired t-test p = {t['p']:.3g}", fontsize=9)
    bx.grid(alpha=0.3)
    fig.suptitle(f"{Path(cfg.data.test).parent.name or cfg.preset}: pretrained vs scratch over "
                 f"{len(results)} seeds ({cfg.preset})", fontsize=10)
    fig.tight_layout()
    tmp = run_dir / ".compare.png.tmp"
    fig.savefig(tmp, format="png")
    plt.close(fig)
    tmp.replace(run_dir / "compare.png")
