"""Draw serving throughput and p99 latency against concurrency from `bench/serve_bench.py --json`'s report: one line
per mode (in-process predictor, server with batching on or off, bare grpcio floor, eager) and texts per call.

    python bench/serve_bench.py --bundle /tmp/lab-bundle --concurrency 1 2 4 8 16 --json serve.json
    python bench/plot_serving.py serve.json --out docs/figures/serving-concurrency.png [--title "..."]

docs/BENCHMARKS.md ("Throughput against concurrency") shows the figure with the run's command, machine, date and load.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections import defaultdict
from pathlib import Path


def series(rows: list[dict]) -> dict[str, list[tuple[int, float, float]]]:
    """{label: [(concurrency, texts/s, p99 ms), ...] sorted by concurrency}; a label is the mode, plus its texts per
    call and precision where the report holds more than one of them."""
    per_calls = {r.get("per_call", 1) for r in rows}
    precisions = {r.get("precision") for r in rows}
    out: dict[str, list[tuple[int, float, float]]] = defaultdict(list)
    for r in rows:
        label = r["mode"]
        if len(per_calls) > 1:
            label += f", {r.get('per_call', 1)} per call"
        if len(precisions) > 1 and r.get("precision"):
            label += f" ({r['precision']})"
        out[label].append((int(r["concurrency"]), float(r["texts_per_s"]), float(r["p99_ms"])))
    return {k: sorted(v) for k, v in out.items()}


def plot(report: dict, out: Path, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    lines = series(report["rows"])
    if not lines:
        raise ValueError("the report holds no rows")
    fig, (rate, tail) = plt.subplots(1, 2, figsize=(11, 4.2))
    for label, points in lines.items():
        cs = [p[0] for p in points]
        rate.plot(cs, [p[1] for p in points], marker="o", label=label)
        tail.plot(cs, [p[2] for p in points], marker="o", label=label)
    ticks = sorted({p[0] for points in lines.values() for p in points})
    for ax, ylabel in ((rate, "texts/s"), (tail, "p99 latency (ms)")):
        ax.set_xscale("log", base=2)
        ax.set_xticks(ticks, [str(t) for t in ticks])
        ax.set_xlabel("concurrent callers (closed loop)")
        ax.set_ylabel(ylabel)
        ax.grid(alpha=0.3)
        ax.set_ylim(bottom=0)
    rate.legend(fontsize=8)
    fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_name(f".{out.name}.tmp")
    fig.savefig(tmp, format="png", dpi=100)
    plt.close(fig)
    tmp.replace(out)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("report", type=Path, help="the JSON file bench/serve_bench.py --json wrote")
    ap.add_argument("--out", type=Path, required=True, help="the PNG to write")
    ap.add_argument("--title", default="serving: throughput and p99 against concurrency",
                    help="the figure's title (say the model, the machine and the load)")
    args = ap.parse_args()
    try:
        report = json.loads(args.report.read_text(encoding="utf-8"))
        plot(report, args.out, args.title)
    except (OSError, ValueError, KeyError, TypeError) as e:
        print(f"error: {args.report}: {e}", file=sys.stderr)
        return 2
    print(args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
