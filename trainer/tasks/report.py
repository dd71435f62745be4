"""What fine-tuning writes for people: metrics.json per run, and compare.csv / compare.md / compare.png for
`finetune --compare` (pretrained vs from scratch). Rank 0 only; numbers in percent.

The reported numbers are those of the kept weights (the epoch with the best validation score). The per-epoch test
accuracy is a curve, labelled as such: it never picks anything. Each report puts the TF-IDF + logistic regression
baseline of the same splits beside them (trainer/baseline.py) with a one-line verdict.
"""

from __future__ import annotations

import csv
import io
import json
import sys
from pathlib import Path
from typing import Any

from trainer import artifact, baseline
from trainer.artifact import write_text_atomic
from trainer.config.schema import RunConfig
from trainer.metrics import table


def verdicts(who: str, final: dict[str, Any], tfidf: dict[str, Any] | None) -> list[str]:
    """One line per scored set (test, then each extra file): the kept weights' accuracy against the baseline's."""
    if not tfidf or "skipped" in tfidf:
        return [baseline.summary_line(tfidf)] if tfidf else []
    lines = [baseline.verdict(who, final["test"]["accuracy"], tfidf["test"]["accuracy"])]
    lines += [baseline.verdict(who, m["accuracy"], tfidf[f]["accuracy"], where=f) for f, m in final["extra"].items()
              if f in tfidf]
    return lines


def run_metrics(cfg: RunConfig, name: str, result: dict[str, Any],
                tfidf: dict[str, Any] | None = None) -> dict[str, Any]:
    """metrics.json of one run: the kept epoch, its scores on every set, the baseline's beside them with the
    verdicts, and the per-epoch curves."""
    kept, final = result["kept"], result["final"]
    return {
        "run": name,
        "kept_epoch": kept["epoch"],
        "kept_step": kept["step"],
        "selected_on": f"valid {cfg.finetune.select_metric}",
        "files": {"train": cfg.data.train, "valid": cfg.data.valid or f"{cfg.data.valid_split:.0%} of train",
                  "test": cfg.data.test or f"{cfg.data.test_split:.0%} of train"},
        "label_values": list(cfg.data.labels),
        "label_names": cfg.data.names,
        "valid": final["valid"],
        "test": final["test"],
        "extra_test": final["extra"],
        "tfidf_baseline": tfidf,
        "calibration": result.get("calibration"),
        "verdicts": verdicts(name, final, tfidf),
        "per_epoch": [{"epoch": h["epoch"], "step": h["step"], "train_loss": h["train_loss"],
                       "valid_accuracy": h["valid"]["accuracy"], "valid_macro_f1": h["valid"]["macro_f1"],
                       "test_accuracy_curve": h["test"]["accuracy"]} for h in result["history"]],
    }


def write_metrics(run_dir: Path, summary: dict[str, Any]) -> None:
    write_text_atomic(run_dir / "metrics.json", json.dumps(summary, indent=2) + "\n")


def write_compare(run_dir: Path, results: dict[str, dict[str, Any]], cfg: RunConfig,
                  pretrained: artifact.Artifact | None, tfidf: dict[str, Any] | None = None) -> None:
    """compare.csv (per epoch), compare.md (the kept weights, then per epoch) and compare.png (the curves), each
    with the TF-IDF baseline's scores (the same on every row of compare.csv: it has no epochs)."""
    s, p = results["scratch"], results["pretrained"]
    base = tfidf if tfidf and "skipped" not in tfidf else None
    epochs = list(zip(s["history"], p["history"], strict=False))  # early stopping may end one run sooner
    buf = io.StringIO()
    w = csv.writer(buf, lineterminator="\n")
    w.writerow(["epoch", "scratch_valid_accuracy", "pretrained_valid_accuracy", "scratch_test_accuracy",
                "pretrained_test_accuracy", "test_difference", "tfidf_valid_accuracy", "tfidf_test_accuracy"])
    fixed = [f"{base['valid']['accuracy']:.2f}", f"{base['test']['accuracy']:.2f}"] if base else ["", ""]
    w.writerows([a["epoch"], f"{a['valid']['accuracy']:.2f}", f"{b['valid']['accuracy']:.2f}",
                 f"{a['test']['accuracy']:.2f}", f"{b['test']['accuracy']:.2f}",
                 f"{b['test']['accuracy'] - a['test']['accuracy']:+.2f}", *fixed] for a, b in epochs)
    write_text_atomic(run_dir / "compare.csv", buf.getvalue())
    write_text_atomic(run_dir / "compare.md", "\n".join(compare_md(results, cfg, pretrained, tfidf)))
    plot(run_dir, results, cfg, pretrained, base)
    print(f"comparison: {run_dir / 'compare.md'}, {run_dir / 'compare.png'}", file=sys.stdout)


def compare_md(results: dict[str, dict[str, Any]], cfg: RunConfig, pretrained: artifact.Artifact | None,
               tfidf: dict[str, Any] | None = None) -> list[str]:
    s, p = results["scratch"], results["pretrained"]
    objective = pretrained.meta.get("objective") if pretrained else None
    metric = cfg.finetune.select_metric
    valid = cfg.data.valid or f"{cfg.data.valid_split:.0%} of `{cfg.data.train}`"
    test = cfg.data.test or f"{cfg.data.test_split:.0%} of `{cfg.data.train}`"

    base = tfidf if tfidf and "skipped" not in tfidf else None

    def row(label: str, a: float, b: float, diff: bool = True, tf: float | None = None) -> str:
        return f"| {label} | {a:.2f} | {b:.2f} | {f'{b - a:+.2f}' if diff else ''} | " \
               f"{'' if tf is None else f'{tf:.2f}'} |"

    def tf(where: str, key: str = "accuracy") -> float | None:
        return base[where][key] if base and where in base else None

    c_chosen = f"C={base['C']:g}" if base else ""

    fs, fp = s["final"], p["final"]
    md = [f"Pretrained vs from scratch, preset `{cfg.preset}`, seed {cfg.seed}; pretrained encoder: "
          f"`{pretrained.path if pretrained else ''}` (objective {objective}). Each run keeps the weights of its "
          f"epoch with the best validation {metric} (validation: {valid}); every number below is those weights' "
          f"(test: {test}, all of it).", "",
          "| kept weights | from scratch | pretrained | difference | TF-IDF + LR baseline |",
          "|---|---:|---:|---:|---:|",
          f"| epoch kept | {s['kept']['epoch']} of {len(s['history'])} | {p['kept']['epoch']} of "
          f"{len(p['history'])} | | {c_chosen} |",
          row("validation accuracy (%)", fs["valid"]["accuracy"], fp["valid"]["accuracy"], tf=tf("valid")),
          row("test accuracy (%)", fs["test"]["accuracy"], fp["test"]["accuracy"], tf=tf("test")),
          row("test macro-F1 (%)", fs["test"]["macro_f1"], fp["test"]["macro_f1"], tf=tf("test", "macro_f1")),
          row("test majority-class baseline (%)", fs["test"]["majority_baseline"], fp["test"]["majority_baseline"],
              diff=False)]
    md += [row(f"`{f}` accuracy (%)", m["accuracy"], fp["extra"][f]["accuracy"], tf=tf(f))
           for f, m in fs["extra"].items()]
    if s.get("calibration") and p.get("calibration"):
        def ece(r: dict[str, Any]) -> str:
            c = r["calibration"]
            return f"{c['test']['ece_before']:.3f} -> {c['test']['ece_after']:.3f} (T = {c['temperature']:.2f})"

        md.append(f"| test ECE, raw -> calibrated (temperature fitted on validation) | {ece(s)} | {ece(p)} | | |")
    if tfidf:
        md += ["", *(f"- {line}" for name, r in (("from scratch", s), ("pretrained", p))
                     for line in verdicts(name, r["final"], tfidf))]
        if base:
            md += [f"- the baseline: {baseline.NAME} over {base['recipe']} n-grams, fitted on the same training "
                   f"split, C chosen on the same validation split ({base['fit_seconds']:.1f} s; trainer/baseline.py)"]
    for name, r in (("from scratch", s), ("pretrained", p)):
        md += ["", f"Test set, kept weights, {name}:", "", *table(r["final"]["test"])]
    md += ["", "Per epoch. The test columns are a curve: they never choose the epoch kept (* marks it).", "",
           "| epoch | valid, scratch | valid, pretrained | test, scratch | test, pretrained | test difference |",
           "|---:|---:|---:|---:|---:|---:|"]
    for a, b in zip(s["history"], p["history"], strict=False):
        mark = ("*" if a["epoch"] == s["kept"]["epoch"] else "", "*" if b["epoch"] == p["kept"]["epoch"] else "")
        md.append(f"| {a['epoch']} | {a['valid']['accuracy']:.2f}{mark[0]} | {b['valid']['accuracy']:.2f}{mark[1]} | "
                  f"{a['test']['accuracy']:.2f} | {b['test']['accuracy']:.2f} | "
                  f"{b['test']['accuracy'] - a['test']['accuracy']:+.2f} |")
    return [*md, ""]


def plot(run_dir: Path, results: dict[str, dict[str, Any]], cfg: RunConfig,
         pretrained: artifact.Artifact | None, base: dict[str, Any] | None = None) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    objective = pretrained.meta.get("objective") if pretrained else None
    fig, ax = plt.subplots(figsize=(6.4, 4.2), dpi=120)
    for name, marker, label in (("scratch", "o", "from scratch"), ("pretrained", "s", f"pretrained ({objective})")):
        hist, kept = results[name]["history"], results[name]["kept"]
        epochs = [h["epoch"] for h in hist]
        line = ax.plot(epochs, [h["test"]["accuracy"] for h in hist], marker=marker, label=f"{label}: test")[0]
        ax.plot(epochs, [h["valid"]["accuracy"] for h in hist], marker=marker, linestyle="--", alpha=0.6,
                color=line.get_color(), label=f"{label}: validation")
        ax.plot([kept["epoch"]], [kept["valid"]["accuracy"]], marker="*", markersize=14, color=line.get_color())
    if base is not None:
        ax.axhline(base["test"]["accuracy"], color="grey", linestyle=":",
                   label=f"TF-IDF + LR baseline: test ({base['test']['accuracy']:.1f})")
    ax.set_xlabel("epoch (star: the epoch kept, chosen on validation)")
    ax.set_ylabel("accuracy per epoch (%)")
    ax.set_title(f"{Path(cfg.data.test).parent.name or cfg.preset}: pretrained vs scratch ({cfg.preset})")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    tmp = run_dir / ".compare.png.tmp"
    fig.savefig(tmp, format="png")
    plt.close(fig)
    tmp.replace(run_dir / "compare.png")
