"""The summary table of a bench/gpu_check.sh run, from the files it left in its output folder:

  parts.tsv       each part's status and seconds
  tests.txt       pytest's output (its last line: passed, failed, skipped)
  ratio.json      bench/train_throughput.py rows: engine vs plain loop, lab size
  mfu.json        the same for the gpu preset: utilisation of the timed bf16 matmul peak
  lab/            pretrain/metrics.csv and artifact/artifact.json, finetune/compare.md
  sdpa.json       bench/sdpa_check.py: which attention kernels ran

  python bench/gpu_summary.py runs/gpu-check

Prints Markdown; a part that left nothing says so instead of failing the summary.
"""

from __future__ import annotations

import argparse
import csv
import json
import sys
from pathlib import Path
from typing import Any


def read_json(path: Path) -> dict[str, Any] | None:
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None


def tests_line(out: Path) -> str:
    try:
        lines = [ln.strip() for ln in (out / "tests.txt").read_text(encoding="utf-8").splitlines() if ln.strip()]
    except OSError:
        return "no output"
    # pytest's closing line of each call, e.g. "4 passed, 3 skipped, 75 deselected in 96.01s"
    tail = [ln.strip("= ") for ln in lines if " in " in ln and any(w in ln for w in ("passed", "failed", "skipped"))
            and not ln.startswith(("FAILED", "SKIPPED", "ERROR"))]
    failed = [ln.split(" - ")[0] for ln in lines if ln.startswith("FAILED ")]
    return ("; ".join(tail) if tail else lines[-1][:120]) + (f"; {', '.join(failed)}" if failed else "")


def bench_rows(out: Path, name: str) -> list[dict[str, Any]]:
    data = read_json(out / f"{name}.json")
    return data["rows"] if data else []


def pct(x: float | None) -> str:
    return f"{100 * x:.1f}%" if x is not None else "-"


def ratio_line(rows: list[dict[str, Any]]) -> str:
    if not rows:
        return "no rows"
    parts = []
    for task in dict.fromkeys(r["task"] for r in rows):
        vs = [f"{r['loop']} {r['ratio_vs_plain']:.3f}" for r in rows if r["task"] == task and "ratio_vs_plain" in r]
        parts.append(f"{task}: {', '.join(vs)} of plain")
    return "; ".join(parts)


def mfu_line(rows: list[dict[str, Any]]) -> str:
    if not rows:
        return "no rows"
    return ", ".join(f"{r['loop']} {pct(r['utilisation'])}" for r in rows) + " of the matmul peak"


def lab_line(out: Path) -> str:
    lab = out / "lab"
    bits = []
    meta = read_json(lab / "pretrain" / "artifact" / "artifact.json")
    try:
        rows = list(csv.DictReader((lab / "pretrain" / "metrics.csv").open(encoding="utf-8")))
    except OSError:
        rows = []
    if rows:
        last = rows[-1]
        bits.append(f"pretrain {last['step']} steps, loss {float(last['loss']):.3f}"
                    + (f", eval loss {float(last['eval_loss']):.3f}" if last.get("eval_loss") else "")
                    + (f", {float(last['tokens_per_s']):,.0f} tokens/s" if last.get("tokens_per_s") else ""))
    if meta and "tokens" in meta:
        bits.append(f"{meta['tokens']:,} tokens")
    try:
        md = (lab / "finetune" / "compare.md").read_text(encoding="utf-8").splitlines()
        test = next(ln for ln in md if ln.startswith("| test accuracy (%)"))
        cells = [c.strip() for c in test.strip("|").split("|")]
        bits.append(f"test accuracy: scratch {cells[1]}, pretrained {cells[2]} ({cells[3]})")
    except (OSError, StopIteration, IndexError):
        bits.append("no finetune comparison")
    return "; ".join(bits) if bits else "no output"


def sdpa_line(out: Path) -> str:
    data = read_json(out / "sdpa.json")
    if not data:
        return "no output"
    rows = data["rows"] if isinstance(data, dict) else data
    ran: dict[str, list[str]] = {}
    for r in rows:
        if r.get("ran"):
            ran.setdefault(r["path"], []).append(r["backend"])
    return "; ".join(f"{path}: {', '.join(b)}" for path, b in ran.items()) or "no kernel ran"


def table(rows: list[dict[str, Any]], title: str) -> list[str]:
    if not rows:
        return []
    lines = ["", title, "", "| task | loop | precision | global batch x seq | step ms | tokens/s | vs plain | "
             "vs eager | MFLOP/token | of peak |", "|---|---|---|---|---:|---:|---:|---:|---:|---:|"]
    for r in rows:
        vs = f"{r['ratio_vs_plain']:.3f} (paired {r['ratio_paired_median']:.3f})" if "ratio_vs_plain" in r else ""
        if "ratio_vs_plain" in r and r.get("baseline", "plain") != "plain":
            vs += f" vs {r['baseline']}"
        eager = f"{r['ratio_vs_eager']:.3f}" if "ratio_vs_eager" in r else ""
        lines.append(f"| {r['task']} | {r['loop']} | {r['precision']} | {r['global_batch']} x {r['seq_len']} | "
                     f"{r['step_ms']:.1f} | {r['tokens_per_s']:,.0f} | {vs} | {eager} | "
                     f"{r['flops_per_token'] / 1e6:.1f} | {pct(r['utilisation'])} |")
    return lines


def summary(out: Path) -> str:
    status: dict[str, tuple[str, str]] = {}
    try:
        for row in csv.DictReader((out / "parts.tsv").open(encoding="utf-8"), delimiter="\t"):
            status[row["part"]] = (row["status"], row["seconds"])
    except OSError:
        pass
    machine = (out / "machine.txt").read_text(encoding="utf-8").strip() if (out / "machine.txt").is_file() else ""
    ratio, mfu = bench_rows(out, "ratio"), bench_rows(out, "mfu")
    results = {"tests": tests_line(out), "ratio": ratio_line(ratio), "mfu": mfu_line(mfu), "lab": lab_line(out),
               "sdpa": sdpa_line(out)}
    lines = ["## gpu_check summary", "", *(f"    {ln}" for ln in machine.splitlines()), "",
             "| part | status | seconds | result |", "|---|---|---:|---|"]
    for part, result in results.items():
        st, sec = status.get(part, ("not run", "0"))
        lines.append(f"| {part} | {st} | {sec} | {result if st != 'not run' else ''} |")
    peak = next((r["peak_flops"] for r in ratio + mfu), None)
    if peak:
        lines += ["", f"peak: {peak / 1e12:.1f} TFLOP/s (timed matmul, per process)"]
    lines += table(ratio, "Engine vs plain loop, lab size (bench/train_throughput.py):")
    lines += table(mfu, "gpu preset, MFU (bench/train_throughput.py):")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("out", type=Path, metavar="OUT_FOLDER", help="the folder bench/gpu_check.sh wrote its files into")
    args = p.parse_args(argv)
    if not args.out.is_dir():
        p.error(f"{args.out} is not a folder (the one bench/gpu_check.sh wrote)")
    print(summary(args.out), end="")
    return 0


if __name__ == "__main__":
    sys.exit(main())
