"""Training throughput: a plain PyTorch loop against our DeepSpeed engine, same model, data and batches.

One run, one process or several (`deepspeed --num_gpus 2 bench/train_throughput.py ...`), for each task:
  (a) plain: the objective module of trainer/tasks/pretrain.py (LMObjective) or trainer/tasks/finetune.py
      (ClassifierObjective), torch.optim.Adam (AdamW when the config says adamw) with the config's lr/betas/weight
      decay, clip_grad_norm_ to optim.grad_clip (0.5), the same loss scaling as our loops;
      torch DistributedDataParallel when world > 1.
  (b) deepspeed: the same module wrapped by trainer.engine.deepspeed_engine.initialize with the JSON that
      trainer.engine.ds_config derives, exactly as pretrain.py / finetune.py build it, stepped by their own step
      (trainer/engine/loop.py's optimizer_step).
  --compile adds plain-compiled and deepspeed-compiled: (a) with the module compiled in place (Module.compile(),
  inductor) and (b) with engine.compile=on (DeepSpeed's engine.compile(), which does the same to its module); their
  compile time falls in the warm-up windows. In bf16 (b) runs the plain loop's arithmetic (torch.autocast over fp32
  weights: DeepSpeed's torch_autocast, as the trainers do); deepspeed-bf16 (bf16 only) runs DeepSpeed's own bf16 mode
  instead (bf16 weights, fp32 masters in its optimizer wrapper: what the trainers ran before 2026-11-27, and what a
  user's JSON enabling "bf16" gets). `--loops` picks any of these.
Both start from the same weights (same seed) and see the same global batches in the same order: window k of (a) and
window k of (b) train on identical batches. Windows of --steps optimizer steps alternate between (a) and (b) in the
same process (a-b, then b-a, ...) so that load from other processes hits both alike; the first --warmup windows of
each are discarded. Reported per loop: the median over windows of tokens/s (real, non-pad input tokens of the whole
global batch per second), the ratio deepspeed/plain of the medians (and the median of the per-window ratios), the
fraction of step time spent producing the next batch (batching; the host-to-device copy counts as step time), model
FLOPs per token and
achieved FLOP/s, and the utilisation against a matrix-multiply peak measured in the same process (bf16 on GPU, fp32
on CPU).

Data: the training reviews the config names (`data.train`), tokenized as the config says (`tokenizer.*`). LM: the
reviews prepared as pretraining prepares them and read as packed next-token windows of --seq-len tokens
(trainer/data/windows.py + trainer/tasks/pretrain.py's WindowBatcher, objective clm: full windows, no padding).
Classifier: the reviews cut to --seq-len ids (tokenizer.max_len), labels from train.label.

Model FLOPs per token (training = 3 x forward): 6 x N + 12 x L x d x T, where N counts the weights of every matrix
multiply a token goes through (per layer: attention in-projection 3d^2, out-projection d^2, feed-forward 2 d d_ff;
plus the LM head d V for the language model, whose every real input token is predicted under clm) and 12 L d T is the
attention score and value products (QK^T and AV, 2 x 2 T d per layer forward) at T = --seq-len. Not counted:
embedding lookups, biases, layer norms, softmax, the classifier's head (once per sequence, d C), padded positions.

  .venv/bin/python bench/train_throughput.py --task both --json runs/bench-train/p1.json
  deepspeed --num_gpus 2 bench/train_throughput.py --task both --baseline runs/bench-train/p1.json
  .venv/bin/python bench/train_throughput.py --task lm --profile   # + two steps of each loop counted
--profile runs two more steps of each loop after the measured windows and counts what each does (bench/step_profile.py:
host operators and device kernels, host reads of tensor values, synchronize calls, copies to the host, collectives,
tensor copies, optimizer steps, Python calls), with the host time of forward, backward and the optimizer step; then
the operators the engine runs more often than the plain loop.
Only rank 0 prints and writes; every rank ends through trainer.engine.deepspeed_engine.finish (gloo ranks can abort at a
normal interpreter exit; engine.finish says why). What is trained, the two loops and the report are bench/training/'s.
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import sys
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))  # bench/, for training/ and step_profile
from training.loops import ALL, COMPILED, LOOPS, matmul_peak, measure
from training.report import add_scaling, machine, markdown, rows_for
from training.tasks import classifier_task, lm_task

from trainer.artifact import write_text_atomic
from trainer.config.presets import preset
from trainer.config.schema import RunConfig, override
from trainer.engine import deepspeed_engine as eng
from trainer.engine.stage import on_every_rank


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--preset", default="lab", help="config preset whose model and optimizers are measured (lab)")
    p.add_argument("--task", choices=["lm", "classifier", "both"], default="both", help="which model to train (both)")
    p.add_argument("--micro-batch", type=int, default=8, help="sequences per process per micro-step (8)")
    p.add_argument("--seq-len", type=int, default=128, help="LM window / classifier cut, in ids (128)")
    p.add_argument("--steps", type=int, default=3, help="optimizer steps per window (3)")
    p.add_argument("--warmup", type=int, default=3, help="warm-up windows per loop, discarded (3)")
    p.add_argument("--windows", type=int, default=5, help="measured windows per loop (5)")
    p.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                   help="config override, as for `python -m trainer` (repeatable)")
    p.add_argument("--precisions", default="", metavar="LIST",
                   help="fp32, bf16, or fp32,bf16: each loop in each, windows interleaved in one run (default: bf16 "
                        "on a GPU, fp32 on a CPU; engine.precision=auto resolves to what the hardware has)")
    p.add_argument("--json", metavar="PATH", help="also write the rows (and run details) as JSON")
    p.add_argument("--loops", default=",".join(LOOPS), metavar="LIST",
                   help=f"which loops, in order: any of {', '.join(ALL)} (default: {','.join(LOOPS)})")
    p.add_argument("--compile", action="store_true",
                   help="also time both loops compiled (plain-compiled, deepspeed-compiled: inductor; the compile time "
                        "is in the warm-up)")
    p.add_argument("--profile", action="store_true",
                   help="also profile one step of each loop with torch.profiler (module docstring)")
    p.add_argument("--tokenizer", metavar="DIR",
                   help="a saved tokenizer folder instead of building the preset's (e.g. python -m trainer tokenizer)")
    p.add_argument("--baseline", metavar="JSON", help="a --json of another run (e.g. 1 process): report scaling")
    p.add_argument("--local_rank", type=int, default=None, help=argparse.SUPPRESS)  # from the DeepSpeed launcher
    args = p.parse_args(argv)
    if any(x not in ("fp32", "bf16") for x in args.precisions.split(",") if args.precisions):
        p.error(f"--precisions takes fp32, bf16 or fp32,bf16, got {args.precisions!r}")
    loops = [x for x in args.loops.split(",") if x]
    if not loops or any(x not in ALL for x in loops) or len(set(loops)) != len(loops):
        p.error(f"--loops takes distinct names among {', '.join(ALL)}, got {args.loops!r}")
    args.loops = loops + [x for x in COMPILED if args.compile and x not in loops]
    for name in ("micro_batch", "seq_len", "steps", "warmup", "windows"):
        if getattr(args, name) < (0 if name == "warmup" else 1):
            p.error(f"--{name.replace('_', '-')} must be >= {0 if name == 'warmup' else 1}, got {getattr(args, name)}")
    return args


def config(args: argparse.Namespace) -> RunConfig:
    cuda = torch.cuda.is_available()
    cfg = override(preset(args.preset), {
        "pretrain.micro_batch": args.micro_batch, "finetune.micro_batch": args.micro_batch,
        "pretrain.seq_len": args.seq_len, "pretrain.objective": "clm", "tokenizer.max_len": args.seq_len,
        "engine.precision": "bf16" if cuda else "fp32",  # the issue: fp32 on CPU, bf16 on GPU
    })
    cfg = override(cfg, args.overrides)
    if cfg.model.max_positions < args.seq_len:
        raise ValueError(f"--seq-len {args.seq_len} exceeds model.max_positions={cfg.model.max_positions}")
    return cfg


def run(args: argparse.Namespace) -> None:
    cfg = config(args)
    info = eng.init_distributed()
    main = eng.is_main()
    load0 = " ".join(f"{x:.2f}" for x in os.getloadavg())
    peak, peak_what = matmul_peak(info)
    need = (args.warmup + args.windows) * args.steps + 2  # + the profiled steps
    rows: list[dict[str, Any]] = []
    for name in (["lm", "classifier"] if args.task == "both" else [args.task]):
        section = "pretrain" if name == "lm" else "finetune"
        variants = {}
        for prec in args.precisions.split(",") if args.precisions else [cfg.engine.precision]:
            c = override(cfg, {"engine.precision": prec})
            ds, plan = eng.ds_config(c, section, info.world_size, c.engine.deepspeed_config or None)
            variants[prec] = (c, ds)
        task = (lm_task if name == "lm" else classifier_task)(cfg, plan, need, args.tokenizer)
        windows, profiles = measure(task, variants, plan, info, args)
        rows += rows_for(task, windows, cfg, plan, info, peak, args, profiles)
    meta = {"date": dt.datetime.now(dt.UTC).strftime("%Y-%m-%d %H:%M UTC"), "machine": machine(),
            "command": " ".join([Path(sys.argv[0]).name, *sys.argv[1:]]), "processes": info.world_size,
            "loadavg_start": load0, "loadavg_end": " ".join(f"{x:.2f}" for x in os.getloadavg()),
            "peak": peak_what, "peak_flops": peak, "warmup": args.warmup, "windows": args.windows,
            "steps": args.steps, "baseline": args.baseline}
    if args.baseline:
        add_scaling(rows, args.baseline)
    if main:
        print(markdown(rows, meta), end="", flush=True)
        if args.json:
            write_text_atomic(Path(args.json), json.dumps({"meta": meta, "rows": rows}, indent=1) + "\n")


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    on_every_rank(lambda: run(args))  # ends the process through engine.finish on every rank


if __name__ == "__main__":
    main()
