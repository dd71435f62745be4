"""bench/train_throughput.py's report: one row per (task, loop, precision) from the measured windows, its markdown
table, the machine it ran on, and the scaling against another run's rows."""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import platform
import statistics
from pathlib import Path
from typing import Any

import step_profile
import torch

from trainer.config.schema import RunConfig
from trainer.engine import deepspeed_engine as eng
from training.loops import Window
from training.tasks import Task


def baseline_of(kind: str, kinds: dict[tuple[str, str], Any], prec: str) -> str | None:
    """The plain loop a loop is compared with: the compiled plain loop for the compiled engine (where it ran), else
    the eager plain loop."""
    if kind == "deepspeed-compiled" and ("plain-compiled", prec) in kinds:
        return "plain-compiled"
    return "plain" if kind != "plain" and ("plain", prec) in kinds else None



def rows_for(task: Task, windows: dict[tuple[str, str], list[Window]], cfg: RunConfig, plan: eng.BatchPlan,
             info: eng.DistInfo, peak: float, args: argparse.Namespace,
             profiles: dict[tuple[str, str], dict[str, Any]]) -> list[dict[str, Any]]:
    rows = []
    rate = {key: [w.tokens / w.seconds for w in ws[args.warmup:]] for key, ws in windows.items()}
    med = {key: statistics.median(r) for key, r in rate.items()}
    for (k, prec), ws in windows.items():
        measured = ws[args.warmup:]
        tps = med[(k, prec)]
        flops = task.flops_per_token * tps
        row: dict[str, Any] = {
            "task": task.name, "loop": k, "processes": info.world_size, "threads_per_process": torch.get_num_threads(),
            "device": info.device.type, "precision": prec, "preset": cfg.preset,
            "micro_batch": plan.micro_batch, "grad_accum": plan.grad_accum, "global_batch": plan.global_batch,
            "seq_len": args.seq_len, "steps_per_window": args.steps, "warmup_windows": args.warmup,
            "measured_windows": len(measured),
            "tokens_per_s": tps, "tokens_per_s_per_process": tps / info.world_size,
            "step_ms": 1000 * statistics.median(w.seconds / args.steps for w in measured),
            "data_wait_fraction": statistics.median(w.data_fraction for w in measured),
            "pad_fraction": 1 - sum(w.tokens for w in measured) / max(1, sum(w.positions for w in measured)),
            "flops_per_token": task.flops_per_token, "achieved_flops": flops,
            "peak_flops": peak, "utilisation": flops / peak if peak > 0 else None,
            "tokens_per_s_windows": rate[(k, prec)],
            "tokens_per_window": [w.tokens for w in ws],  # warm-up included: the same list for every loop
            "loss_windows": [w.loss for w in ws],
        }
        base = baseline_of(k, windows, prec)
        if base is not None:
            row["baseline"] = base
            row["ratio_vs_plain"] = med[(k, prec)] / med[(base, prec)]
            row["ratio_paired_median"] = statistics.median(d / p for d, p in zip(rate[(k, prec)],
                                                                                   rate[(base, prec)], strict=True))
        eager = k.removesuffix("-compiled")
        if eager != k and (eager, prec) in windows:  # compiled against the same loop eager, same run
            row["ratio_vs_eager"] = med[(k, prec)] / med[(eager, prec)]
            row["ratio_vs_eager_paired_median"] = statistics.median(
                a / b for a, b in zip(rate[(k, prec)], rate[(eager, prec)], strict=True))
        if (k, prec) in profiles:
            row["profile"] = profiles[(k, prec)]
            if base is not None and (base, prec) in profiles:
                row["profile_extra_ops"] = step_profile.extra_ops(profiles[(k, prec)], profiles[(base, prec)])
        if prec != "fp32" and (k, "fp32") in windows:  # the same loop in fp32, timed in the same run
            ref = windows[(k, "fp32")]
            row["ratio_vs_fp32"] = med[(k, prec)] / med[(k, "fp32")]
            row["ratio_vs_fp32_paired_median"] = statistics.median(
                a / b for a, b in zip(rate[(k, prec)], rate[(k, "fp32")], strict=True))
            row["loss_vs_fp32"] = max(abs(a - b) / abs(b) for a, b in zip(
                [w.loss for w in ws], [w.loss for w in ref], strict=True))  # worst relative gap, any window
        rows.append(row)
    return rows


# ---------------------------------------------------------------------------------------------- report


def machine() -> dict[str, Any]:
    cpu = ""
    with contextlib.suppress(OSError):
        cpu = next((ln.split(":", 1)[1].strip() for ln in Path("/proc/cpuinfo").read_text().splitlines()
                    if ln.startswith("model name")), "")
    mem = 0
    with contextlib.suppress(OSError, StopIteration, ValueError):
        mem = int(next(ln.split()[1] for ln in Path("/proc/meminfo").read_text().splitlines()
                       if ln.startswith("MemTotal"))) // (1024 * 1024)
    gpu = torch.cuda.get_device_name(0) if torch.cuda.is_available() else None
    return {"cpu": cpu, "cores": len(os.sched_getaffinity(0)), "memory_gib": mem, "gpu": gpu,
            "machine": platform.machine(), **eng.package_versions()}


def markdown(rows: list[dict[str, Any]], meta: dict[str, Any]) -> str:
    m = meta["machine"]
    lines = [f"Training throughput, {meta['date']}: {m['machine']} {m['cpu'] or ''} ({m['cores']} cores, "
             f"{m['memory_gib']} GiB){', GPU ' + m['gpu'] if m['gpu'] else ', no GPU'}; torch {m['torch']}, "
             f"deepspeed {m['deepspeed']}; load average {meta['loadavg_start']} at start, "
             f"{meta['loadavg_end']} at end.",
             f"peak: {meta['peak']} = {meta['peak_flops'] / 1e9:.1f} GFLOP/s per process; "
             f"{meta['windows']} windows of {meta['steps']} steps after {meta['warmup']} warm-up windows, "
             f"median per loop.", "",
             "| task | loop | precision | processes x threads | global batch x seq | step ms | tokens/s | tokens/s per "
             "process | vs plain | vs eager | vs fp32 (loss gap) | data wait % | pad % | MFLOP/token | GFLOP/s | "
             "of peak % | loss, last window |",
             "|---|---|---|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for r in rows:
        ratio = (f"{r['ratio_vs_plain']:.3f} (paired {r['ratio_paired_median']:.3f}"
                 f"{'' if r['baseline'] == 'plain' else ', vs ' + r['baseline']})") if "ratio_vs_plain" in r else ""
        eager = (f"{r['ratio_vs_eager']:.3f} (paired {r['ratio_vs_eager_paired_median']:.3f})"
                 if "ratio_vs_eager" in r else "")
        vs32 = (f"{r['ratio_vs_fp32']:.3f} (paired {r['ratio_vs_fp32_paired_median']:.3f}; "
                f"{100 * r['loss_vs_fp32']:.2f}%)" if "ratio_vs_fp32" in r else "")
        util = f"{100 * r['utilisation']:.1f}" if r["utilisation"] is not None else "-"
        lines.append(
            f"| {r['task']} | {r['loop']} | {r['precision']} | {r['processes']} x {r['threads_per_process']} | "
            f"{r['global_batch']} x {r['seq_len']} | {r['step_ms']:.0f} | {r['tokens_per_s']:.0f} | "
            f"{r['tokens_per_s_per_process']:.0f} | {ratio} | {eager} | {vs32} | {100 * r['data_wait_fraction']:.2f} | "
            f"{100 * r['pad_fraction']:.1f} | {r['flops_per_token'] / 1e6:.3f} | {r['achieved_flops'] / 1e9:.2f} | "
            f"{util} | {r['loss_windows'][-1]:.4f} |")
    lines += step_profile.tables(rows)
    scaled = [r for r in rows if "scaling_vs_baseline" in r]
    if scaled:
        lines += ["", f"Scaling against {meta['baseline']} (same task, loop, micro-batch and sequence length):", "",
                  "| task | loop | processes | baseline processes | baseline tokens/s | tokens/s | scaling |",
                  "|---|---|---:|---:|---:|---:|---:|"]
        for r in scaled:
            b = r["scaling_vs_baseline"]
            lines.append(f"| {r['task']} | {r['loop']} | {r['processes']} | {b['processes']} | "
                         f"{b['tokens_per_s']:.0f} | {r['tokens_per_s']:.0f} | {b['factor']:.3f} |")
    return "\n".join(lines) + "\n"


def add_scaling(rows: list[dict[str, Any]], path: str) -> None:
    """Global tokens/s over a baseline run's (e.g. 2 processes over 1) for matching rows."""
    base = json.loads(Path(path).read_text(encoding="utf-8"))["rows"]
    key = ("task", "loop", "micro_batch", "seq_len", "preset", "precision")
    for r in rows:
        match = [b for b in base if all(b[k] == r[k] for k in key)]
        if match:
            b = match[0]
            r["scaling_vs_baseline"] = {"processes": b["processes"], "tokens_per_s": b["tokens_per_s"],
                                        "factor": r["tokens_per_s"] / b["tokens_per_s"]}

