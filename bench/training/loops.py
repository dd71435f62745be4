"""bench/train_throughput.py's measurement: the plain PyTorch loop and our DeepSpeed engine on one task, timed
window by window (`measure`), and the matrix-multiply peak their FLOP/s are held against."""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import time
from dataclasses import dataclass
from typing import Any

import step_profile
import torch
import torch.distributed as dist

from trainer.config.schema import RunConfig
from trainer.engine import deepspeed_engine as eng
from trainer.engine import loop, optimizer
from trainer.engine.distributed import host_collectives
from training.tasks import Task

LOOPS = ("plain", "deepspeed")  # the default; --compile adds COMPILED, --loops picks any of ALL
COMPILED = ("plain-compiled", "deepspeed-compiled")
# bf16 only: DeepSpeed's own bf16 mode (bf16 weights, fp32 masters in an optimizer wrapper) instead of the
# trainers' torch_autocast (fp32 weights under torch.autocast).
DS_BF16 = "deepspeed-bf16"
ALL = (*LOOPS, *COMPILED, DS_BF16)


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
        # The engine's parameter groups and lr schedule (trainer/engine/optimizer.py), on torch's Adam.
        self.opt = cls(optimizer.param_groups(model), lr=o.lr, betas=tuple(o.betas), eps=1e-8,
                       weight_decay=o.weight_decay, **fused)
        self.sched = optimizer.schedule(o, total_steps)(self.opt)
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
        tok_sum, pos_sum, loss_sum = reduce([timed.real_tokens, timed.positions, float(loss_acc)], dist.ReduceOp.SUM,
                                            info)
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
                    with step_profile.phase("step.forward"), self.autocast():
                        loss = self.module(*inputs)
                    with step_profile.phase("step.backward"):
                        (loss * (plan.world_size / max(1, n))).backward()  # gradient of (global sum / n)
                loss_acc += loss.detach()
            with step_profile.phase("step.optimizer"):
                torch.nn.utils.clip_grad_norm_(self.module.parameters(), task.optim.grad_clip)
                self.opt.step()
                self.opt.zero_grad(set_to_none=True)
                self.sched.step()
        self.step += 1
        return n


class Timed:
    """A task as trainer/engine/loop.py's Step sees it (`inputs`, `denominator`, `tokens`), timing how long making the
    batches takes and counting their real (non-pad) tokens and positions: the same accounting for both loops."""

    def __init__(self, task: Task) -> None:
        self.task, self.seconds, self.real_tokens, self.positions = task, 0.0, 0, 0

    def inputs(self, part: list[int], epoch: int) -> tuple[torch.Tensor, ...]:
        t0 = time.perf_counter()
        inputs = self.task.make(part)
        self.real_tokens += self.task.tokens(part)
        self.positions += inputs[0].numel()
        self.seconds += time.perf_counter() - t0
        return inputs

    def tokens(self, part: list[int]) -> int:
        return self.task.tokens(part)

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
    profiled = task.batches[n_windows * args.steps:][:2]
    profiles = {key: profile_step(loops[key], profiled, info) for key in keys} if args.profile else {}
    return out, profiles


def kinds_of(args: argparse.Namespace) -> tuple[str, ...]:
    return tuple(args.loops)


def profile_step(lp: Loop, batches: list[list[int]], info: eng.DistInfo) -> dict[str, Any]:
    """Two more optimizer steps of a warmed-up loop, counted (bench/step_profile.py)."""
    if lp.kind.startswith("deepspeed"):
        step_profile.annotate(lp.engine)
    steps = iter(batches)
    return step_profile.profile(lambda: lp.one_step(next(steps), Timed(lp.task), torch.zeros((), device=info.device)),
                                info.device)

