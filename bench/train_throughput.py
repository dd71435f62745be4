"""Training throughput: a plain PyTorch loop against our DeepSpeed engine, same model, data and batches.

One run, one process or several (`deepspeed --num_gpus 2 bench/train_throughput.py ...`), for each task:
  (a) plain: the objective module of trainer/tasks/pretrain.py (LMObjective) or trainer/tasks/finetune.py
      (ClassifierObjective), torch.optim.Adam (AdamW when the config says adamw) with the config's lr/betas/weight
      decay, clip_grad_norm_ to optim.grad_clip (0.5), the same loss scaling as our loops;
      torch DistributedDataParallel when world > 1.
  (b) deepspeed: the same module wrapped by trainer.engine.deepspeed_engine.initialize with the JSON that
      deepspeed_engine.ds_config derives, exactly as pretrain.py / finetune.py build it, stepped by their own step
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
  .venv/bin/python bench/train_throughput.py --task lm --profile   # + one step of each loop under torch.profiler
--profile runs one more step of each loop under torch.profiler after the measured windows and reports, per loop:
operators launched on the host (aten ops), device kernels, host-device syncs (`.item()`/`float()` on a device tensor
= aten::_local_scalar_dense, cuda*Synchronize), collectives (c10d ops), tensor copies (aten::copy_, aten::cat: the
flat-buffer copies), and the host time of forward, backward and the optimizer step; then the operators the engine
runs more often than the plain loop.
Only rank 0 prints and writes; every rank ends through trainer.engine.deepspeed_engine.finish (gloo ranks can abort at a
normal interpreter exit; engine.finish says why).
"""

from __future__ import annotations

import argparse
import atexit
import contextlib
import dataclasses
import datetime as dt
import io
import json
import os
import platform
import shutil
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.distributed as dist

from contract.tokens import TOKENIZER_FILES, TOKENIZER_META, meta_path
from trainer.artifact import write_text_atomic
from trainer.config.presets import preset
from trainer.config.schema import ModelConfig, OptimConfig, RunConfig, check_tokenizer, override
from trainer.data.batching import bucket_batches
from trainer.data.corpus import PreparedCorpus
from trainer.data.prepare import prepare
from trainer.data.tokenizer import Tokenizer, build_tokenizer
from trainer.data.windows import EpochOrder, Windows
from trainer.engine import deepspeed_engine as eng
from trainer.engine import loop
from trainer.engine.distributed import host_collectives
from trainer.engine.stage import on_every_rank
from trainer.model.encoder import forward_flops_per_token
from trainer.tasks.finetune import ClassifierObjective, load_split
from trainer.tasks.pretrain import LMObjective, WindowBatcher

LOOPS = ("plain", "deepspeed")  # the default; --compile adds COMPILED, --loops picks any of ALL
COMPILED = ("plain-compiled", "deepspeed-compiled")
# bf16 only: DeepSpeed's own bf16 mode (bf16 weights, fp32 masters in an optimizer wrapper) instead of the
# trainers' torch_autocast (fp32 weights under torch.autocast).
DS_BF16 = "deepspeed-bf16"
ALL = (*LOOPS, *COMPILED, DS_BF16)


# ---------------------------------------------------------------------------------------------- tasks


@dataclass
class Task:
    """What both loops need for one task: batches, how to make a micro-batch, the loss denominator, the model."""

    name: str  # "lm" | "classifier"
    stage: str  # "pretrain" | "finetune": which config section (micro-batch, optimizer) and ds_config stage
    batches: list[list[int]]  # global batches of example/window indices, in training order
    make: Callable[[list[int]], tuple[torch.Tensor, ...]]  # (input_ids (B, T), padding_mask (B, T), ...) on CPU
    denominator: Callable[[list[int]], int]  # the global batch's summed loss is divided by this (as in our loops)
    new_model: Callable[[], torch.nn.Module]  # the objective module (loss inside forward), fresh weights per seed
    optim: OptimConfig
    flops_per_token: float


def model_flops_per_token(m: ModelConfig, task: str, seq_len: int) -> float:
    """Training FLOPs per token: forward + backward = 3 x forward (module docstring says what is counted)."""
    return 3 * forward_flops_per_token(m, task, seq_len)


def global_batches(lengths: np.ndarray, plan: eng.BatchPlan, seed: int, need: int) -> list[list[int]]:
    """The first `need` global batches in our loops' order (bucketed, seeded per epoch), over enough epochs."""
    out: list[list[int]] = []
    epoch = 0
    while len(out) < need:
        got = loop.full_batches(bucket_batches(lengths, plan.global_batch, seed, epoch), plan)
        if not got:
            raise ValueError(f"{len(lengths)} examples cannot fill one global batch of {plan.global_batch}")
        out += got
        epoch += 1
    return out[:need]


def tokenizer(cfg: RunConfig, folder: str | None) -> Tokenizer:
    """The config's tokenizer (built: a trained one learns data.pretrain), or the one saved in `folder`
    (--tokenizer), cut at tokenizer.max_len (= --seq-len) and checked against the model's ids."""
    if folder is None:
        return build_tokenizer(cfg)
    saved = Tokenizer.load(folder)
    files = {n: (Path(folder) / n).read_bytes() for n in TOKENIZER_FILES[:-1]}
    files[TOKENIZER_META] = meta_path(Path(folder)).read_bytes()
    tok = Tokenizer.from_files(files, Path(folder), cfg.tokenizer.max_len)
    check_tokenizer(tok.vocab_size, tok.max_len, cfg, f"--tokenizer {folder}")
    assert tok.fingerprint == saved.fingerprint
    return tok


def lm_task(cfg: RunConfig, plan: eng.BatchPlan, need: int, tok_folder: str | None = None) -> Task:
    """Next-token windows as pretrain.py reads them: the reviews prepared (trainer/data/prepare.py, one worker) into a
    temporary folder, packed windows of seq_len + 1 ids (trainer/data/windows.py) in the order of its epochs."""
    tok = tokenizer(cfg, tok_folder)
    folder = Path(tempfile.mkdtemp(prefix="train-throughput-prepared-"))
    atexit.register(shutil.rmtree, folder, True)
    prepare([cfg.data.path(cfg.data.train)], tok, folder, workers=1, log=io.StringIO())
    corpus = PreparedCorpus(folder, tok.fingerprint)
    windows = Windows(corpus, 0, corpus.n_tokens, cfg.pretrain.seq_len, overlap=1)  # clm windows
    batcher = WindowBatcher(windows, "clm", cfg.pretrain.mask_prob, tok.vocab_size, cfg.seed)
    batches: list[list[int]] = []
    for epoch in range(need):  # as many epochs as it takes
        order = EpochOrder(windows, epoch, plan.global_batch, cfg.seed)
        if not len(order):
            raise ValueError(f"{len(windows)} windows cannot fill one global batch of {plan.global_batch}")
        batches += [order[b] for b in range(min(len(order), need - len(batches)))]
        if len(batches) == need:
            break
    return Task("lm", "pretrain", batches, make=lambda part: batcher.make(part, 0), denominator=batcher.n_predicted,
                new_model=lambda: LMObjective(cfg.model, causal=True), optim=cfg.pretrain.optim,
                flops_per_token=model_flops_per_token(cfg.model, "lm", cfg.pretrain.seq_len))


def classifier_task(cfg: RunConfig, plan: eng.BatchPlan, need: int, tok_folder: str | None = None) -> Task:
    tok = tokenizer(cfg, tok_folder)  # max_len = --seq-len: reviews are cut there
    split = load_split(cfg, cfg.data.train, tok, 0)
    return Task("classifier", "finetune", global_batches(split.lengths, plan, cfg.seed, need),
                make=split.batch, denominator=len, new_model=lambda: ClassifierObjective(cfg.model),
                optim=cfg.finetune.optim,
                flops_per_token=model_flops_per_token(cfg.model, "classifier", cfg.tokenizer.max_len))


# ---------------------------------------------------------------------------------------------- the two loops


@dataclass
class Window:
    seconds: float  # wall time of the window (slowest rank)
    tokens: int  # real input tokens of the window, all ranks
    positions: int  # input positions incl. padding, all ranks
    data_fraction: float  # time producing batches / window time (worst rank)
    loss: float  # mean loss per predicted token (LM) or per example (classifier) over the window


class Loop:
    """One way of training the task's model: `window(batches)` runs len(batches) optimizer steps and times them."""

    def __init__(self, kind: str, task: Task, cfg: RunConfig, ds: dict[str, Any], plan: eng.BatchPlan,
                 info: eng.DistInfo, total_steps: int) -> None:
        self.kind, self.task, self.cfg, self.plan, self.info = kind, task, cfg, plan, info
        self.step = 0
        torch.manual_seed(cfg.seed)  # both loops start from the same weights (as pretrain.py / finetune.py seed)
        model = task.new_model()
        compiled = kind.endswith("-compiled")
        if kind == DS_BF16:
            ds = {**ds, "bf16": {**ds["bf16"], "enabled": True}, "torch_autocast": {"enabled": False}}
        if kind.startswith("deepspeed"):
            self.engine = eng.initialize(model, ds, task.optim, total_steps,
                                         dataclasses.replace(cfg.engine, compile="on" if compiled else "off"))
            return
        model.to(info.device).train()
        self.module = model
        if compiled:  # in place, as DeepSpeed's engine.compile() does to its module: the same graphs, names kept
            model.compile()
        if info.world_size > 1:
            # The positions buffer is a pure function of the config: broadcasting it every forward is wasted work.
            self.module = torch.nn.parallel.DistributedDataParallel(
                model, device_ids=[info.device.index] if info.device.type == "cuda" else None,
                forward_sync_buffers=False)
        o = task.optim
        cls = torch.optim.AdamW if o.name == "adamw" else torch.optim.Adam
        fused = {"fused": True} if info.device.type == "cuda" else {}  # the fastest torch Adam where it exists
        self.opt = cls(model.parameters(), lr=o.lr, betas=tuple(o.betas), eps=1e-8, weight_decay=o.weight_decay,
                       **fused)
        self.sched = torch.optim.lr_scheduler.LambdaLR(self.opt, lambda s: eng.lr_factor(s, o, total_steps))
        bf16 = cfg.engine.precision == "bf16"
        # bf16 here: autocast over fp32 weights, as the engine's torch_autocast does.
        self.autocast = (lambda: torch.autocast(info.device.type, dtype=torch.bfloat16)) if bf16 \
            else contextlib.nullcontext

    def window(self, batches: list[list[int]]) -> Window:
        info = self.info
        timed = Timed(self.task)
        sync(info)
        t0 = time.perf_counter()
        denom = 0
        loss_acc = torch.zeros((), device=info.device)  # stays on the device: no sync inside the window
        for batch in batches:
            denom += self.one_step(batch, timed, loss_acc)
        sync(info)
        seconds = time.perf_counter() - t0
        # Outside the timed region: one sync per window, then a few numbers across ranks.
        t_max, frac_max = reduce([seconds, timed.seconds / seconds], dist.ReduceOp.MAX, info)
        tok_sum, pos_sum, loss_sum = reduce([timed.tokens, timed.positions, float(loss_acc)], dist.ReduceOp.SUM, info)
        return Window(t_max, int(tok_sum), int(pos_sum), frac_max, loss_sum / max(1, denom))

    def one_step(self, batch: list[int], timed: Timed, loss_acc: torch.Tensor) -> int:
        """One optimizer step on `batch`; adds its summed loss to `loss_acc`; returns the loss denominator."""
        info, plan, task = self.info, self.plan, self.task
        if self.kind.startswith("deepspeed"):  # pretrain.py / finetune.py's own step
            n, _, _ = loop.optimizer_step(self.engine, timed, batch, 0, self.step, plan, info, self.cfg.seed,
                                          loss_acc)
        else:
            n = timed.denominator(batch)  # the whole global batch's count: every rank knows it
            parts = loop.micro_batches(batch, plan)[info.rank::plan.world_size]
            for micro, part in enumerate(parts):
                inputs = loop.to_device(timed.inputs(part, 0), info.device)  # as the trainers do
                last = micro == len(parts) - 1
                no_sync = self.module.no_sync if info.world_size > 1 and not last else contextlib.nullcontext
                with no_sync():
                    with torch.profiler.record_function("step.forward"), self.autocast():
                        loss = self.module(*inputs)
                    with torch.profiler.record_function("step.backward"):
                        (loss * (plan.world_size / max(1, n))).backward()  # gradient of (global sum / n)
                loss_acc += loss.detach()
            with torch.profiler.record_function("step.optimizer"):
                torch.nn.utils.clip_grad_norm_(self.module.parameters(), task.optim.grad_clip)
                self.opt.step()
                self.opt.zero_grad(set_to_none=True)
                self.sched.step()
        self.step += 1
        return n


class Timed:
    """A task as trainer/engine/loop.py's Task sees it (`inputs`, `denominator`), timing how long making the batches
    takes
    and counting their real (non-pad) tokens and positions: the same accounting for both loops."""

    def __init__(self, task: Task) -> None:
        self.task, self.seconds, self.tokens, self.positions = task, 0.0, 0, 0

    def inputs(self, part: list[int], epoch: int) -> tuple[torch.Tensor, ...]:
        t0 = time.perf_counter()
        inputs = self.task.make(part)
        self.tokens += inputs[0].numel() - int(inputs[1].sum())  # CPU tensors: no device sync
        self.positions += inputs[0].numel()
        self.seconds += time.perf_counter() - t0
        return inputs

    def denominator(self, batch: list[int]) -> int:
        t0 = time.perf_counter()
        n = self.task.denominator(batch)
        self.seconds += time.perf_counter() - t0
        return n


def sync(info: eng.DistInfo) -> None:
    if info.device.type == "cuda":
        torch.cuda.synchronize(info.device)


def reduce(values: list[float], op: dist.ReduceOp, info: eng.DistInfo) -> list[float]:
    t = torch.tensor(values, dtype=torch.float64)
    if dist.is_initialized() and dist.get_world_size() > 1:
        t = t if host_collectives() else t.to(info.device)
        dist.all_reduce(t, op=op)
    return [float(v) for v in t.cpu()]


# ---------------------------------------------------------------------------------------------- measuring


def matmul_peak(info: eng.DistInfo) -> tuple[float, str]:
    """FLOP/s of a large square matmul on this process's device: bf16 8192^2 on GPU, fp32 1536^2 on CPU."""
    cuda = info.device.type == "cuda"
    n, dtype, reps = (8192, torch.bfloat16, 20) if cuda else (1536, torch.float32, 4)
    a = torch.randn(n, n, device=info.device, dtype=dtype)
    b = torch.randn(n, n, device=info.device, dtype=dtype)
    torch.matmul(a, b)  # warm-up (cuBLAS handles, CPU thread pool)
    best = float("inf")
    for _ in range(3):
        sync(info)
        t0 = time.perf_counter()
        for _ in range(reps):
            torch.matmul(a, b)
        sync(info)
        best = min(best, (time.perf_counter() - t0) / reps)
    return 2.0 * n**3 / best, f"{'bf16' if cuda else 'fp32'} {n}x{n} matmul"


def measure(task: Task, variants: dict[str, tuple[RunConfig, dict[str, Any]]], plan: eng.BatchPlan,
            info: eng.DistInfo, args: argparse.Namespace
            ) -> tuple[dict[tuple[str, str], list[Window]], dict[tuple[str, str], dict[str, Any]]]:
    """Alternate windows of every loop in every precision (`variants`: precision -> its config and DeepSpeed JSON);
    returns every window (warm-up first) per (loop, precision), and with --profile each loop's profiled step."""
    n_windows = args.warmup + args.windows
    keys = [(k, p) for k in kinds_of(args) for p in variants if not (k == DS_BF16 and p != "bf16")]
    loops = {(k, p): Loop(k, task, variants[p][0], variants[p][1], plan, info, n_windows * args.steps + 1)
             for k, p in keys}
    out: dict[tuple[str, str], list[Window]] = {key: [] for key in keys}
    for w in range(n_windows):
        batches = task.batches[w * args.steps:(w + 1) * args.steps]  # the same batches for every loop
        for key in keys if w % 2 == 0 else keys[::-1]:
            out[key].append(loops[key].window(batches))
    profiles = {key: profile_step(loops[key], task.batches[n_windows * args.steps], info)
                for key in keys} if args.profile else {}
    return out, profiles


def kinds_of(args: argparse.Namespace) -> tuple[str, ...]:
    return tuple(args.loops)


def baseline_of(kind: str, kinds: dict[tuple[str, str], Any], prec: str) -> str | None:
    """The plain loop a loop is compared with: the compiled plain loop for the compiled engine (where it ran), else
    the eager plain loop."""
    if kind == "deepspeed-compiled" and ("plain-compiled", prec) in kinds:
        return "plain-compiled"
    return "plain" if kind != "plain" and ("plain", prec) in kinds else None


# ---------------------------------------------------------------------------------------------- profile

PHASES = ("step.forward", "step.backward", "step.optimizer")
ITEM = "aten::_local_scalar_dense"  # what .item(), float(t), int(t), bool(t) run: a sync when t is on a device
DEVICE_SYNCS = ("cudaStreamSynchronize", "cudaDeviceSynchronize", "cudaEventSynchronize")
COPIES = ("aten::copy_", "aten::cat", "aten::_foreach_copy_")  # flat buffers are built by cat and filled by copy_


def annotate(engine: Any) -> None:
    """Name the engine's forward, backward and step in the profile as the plain loop names its own (instance
    attributes: nn.Module.__call__ and our loop look them up on the engine)."""
    for name, label in zip(("forward", "backward", "step"), PHASES, strict=True):
        fn = getattr(engine, name)

        def wrapped(*a: Any, _fn: Callable[..., Any] = fn, _label: str = label, **k: Any) -> Any:
            with torch.profiler.record_function(_label):
                return _fn(*a, **k)

        setattr(engine, name, wrapped)


def profile_step(lp: Loop, batch: list[int], info: eng.DistInfo) -> dict[str, Any]:
    """One more optimizer step of a warmed-up loop under torch.profiler: counts and host times (module docstring)."""
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile

    if lp.kind.startswith("deepspeed"):
        annotate(lp.engine)
    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if info.device.type == "cuda" else [])
    loss_acc = torch.zeros((), device=info.device)
    sync(info)
    with profile(activities=acts) as prof:
        t0 = time.perf_counter()
        lp.one_step(batch, Timed(lp.task), loss_acc)
        sync(info)
        wall = time.perf_counter() - t0
    events = prof.events()
    host = [e for e in events if e.device_type == DeviceType.CPU]
    count: dict[str, int] = {}
    self_ms: dict[str, float] = {}
    for e in host:
        name = "compiled graph" if e.name.startswith("## Call CompiledFxGraph") else e.name  # drop the graph's hash
        count[name] = count.get(name, 0) + 1
        self_ms[name] = self_ms.get(name, 0.0) + e.self_cpu_time_total / 1000
    return {
        "wall_ms": 1000 * wall,
        "aten_ops": sum(c for n, c in count.items() if n.startswith("aten::")),
        "kernels": sum(1 for e in events if e.device_type == DeviceType.CUDA),
        "item_calls": count.get(ITEM, 0),
        "device_syncs": sum(count.get(n, 0) for n in DEVICE_SYNCS),
        "collectives": {n: c for n, c in count.items() if n.startswith("c10d::")},
        "copies": {n: count.get(n, 0) for n in COPIES},
        "phases_ms": {ph: sum(e.cpu_time_total for e in host if e.name == ph) / 1000 for ph in PHASES},
        "ops": {n: [c, round(self_ms[n], 3)] for n, c in count.items()},
    }


def extra_ops(loop_: dict[str, Any], base: dict[str, Any], top: int = 12) -> list[tuple[str, int, float, float]]:
    """Operators a loop's step runs more often than its baseline's: (name, extra calls, self ms of all its calls in
    the loop, in the baseline), most extra calls first."""
    rows = [(n, c - base["ops"].get(n, [0, 0.0])[0], ms, base["ops"].get(n, [0, 0.0])[1])
            for n, (c, ms) in loop_["ops"].items() if n not in PHASES and c > base["ops"].get(n, [0, 0.0])[0]]
    return sorted(rows, key=lambda r: (-r[1], -r[2]))[:top]


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
                row["profile_extra_ops"] = extra_ops(profiles[(k, prec)], profiles[(base, prec)])
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
    lines += profile_tables(rows)
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


def profile_tables(rows: list[dict[str, Any]]) -> list[str]:
    """--profile: one step of each loop side by side, per task and precision; then what the engine adds."""
    out: list[str] = []
    groups: dict[tuple[str, str], list[dict[str, Any]]] = {}
    for r in rows:
        if "profile" in r:
            groups.setdefault((r["task"], r["precision"]), []).append(r)
    for (task, prec), rs in groups.items():
        out += ["", f"One profiled step, {task}, {prec} (torch.profiler; host times include the profiler's own cost):",
                "", "| | " + " | ".join(r["loop"] for r in rs) + " |", "|---|" + "---:|" * len(rs)]
        metric = [("wall ms", lambda p: f"{p['wall_ms']:.1f}"),
                  *[(f"{ph.split('.')[1]} host ms", lambda p, ph=ph: f"{p['phases_ms'][ph]:.1f}") for ph in PHASES],
                  ("aten ops", lambda p: str(p["aten_ops"])), ("device kernels", lambda p: str(p["kernels"])),
                  (".item()/float() (_local_scalar_dense)", lambda p: str(p["item_calls"])),
                  ("device syncs (cuda*Synchronize)", lambda p: str(p["device_syncs"])),
                  ("collectives", lambda p: ", ".join(f"{n.split('::')[1]} {c}" for n, c in p["collectives"].items())
                   or "0"),
                  ("copy_ / cat / _foreach_copy_", lambda p: " / ".join(str(c) for c in p["copies"].values()))]
        out += [f"| {name} | " + " | ".join(fmt(r["profile"]) for r in rs) + " |" for name, fmt in metric]
        for r in rs:
            if r.get("profile_extra_ops"):
                out += ["", f"{r['loop']} runs more often than {r['baseline']} ({task}, {prec}; calls more, self "
                        f"ms of all calls there / in {r['baseline']}): "
                        + "; ".join(f"{n} +{c} ({ms:.2f} / {base_ms:.2f})"
                                    for n, c, ms, base_ms in r["profile_extra_ops"])]
    return out


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


# ---------------------------------------------------------------------------------------------- entry


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
    need = (args.warmup + args.windows) * args.steps + 1  # + the profiled step
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
