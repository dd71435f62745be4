"""The optimizer and its learning-rate schedule, for both training stages: which parameters it updates in which
groups, with which settings, and how the lr moves from step to step.

DeepSpeed builds the optimizer from `ds_section` (the "optimizer" of its JSON) over `param_groups`, and steps the
scheduler `schedule` builds once per optimizer step (trainer/engine/deepspeed_engine.py, initialize);
bench/train_throughput.py's plain loop builds torch's Adam from the same groups and schedule.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from trainer.config.schema import OptimConfig

Scheduler = torch.optim.lr_scheduler.LambdaLR


@dataclass(frozen=True)
class LrGroup:
    """One optimizer parameter group and its share of the schedule's lr: `rate` from step `start` on, 0 before it
    (Adam leaves a parameter at lr 0 exactly as it is: a frozen group). trainer/tasks/lr_groups.py builds them for
    layer-wise decay and gradual unfreezing."""

    name: str
    params: list[torch.nn.Parameter]
    rate: float = 1.0
    start: int = 0

    def factor(self, step: int, optim: OptimConfig, total_steps: int) -> float:
        return self.rate * lr_factor(step, optim, total_steps) if step >= self.start else 0.0


def param_groups(model: torch.nn.Module, groups: list[LrGroup] | None = None) -> list[dict[str, Any]]:
    """The optimizer's parameter groups: one of every parameter at the stage's lr and weight decay, or `groups`'
    (None: the one). A group's own "lr" or "weight_decay" would override the optimizer's for its parameters
    (torch.optim's rule, kept by DeepSpeed and its ZeRO stages); the schedule scales each group's lr by its factor."""
    if not groups:
        return [{"params": list(model.parameters())}]
    return [{"params": g.params} for g in groups]


def ds_section(optim: OptimConfig, cuda: bool) -> dict[str, Any]:
    """DeepSpeed's "optimizer" section: Adam or AdamW with the stage's lr, betas and weight decay."""
    return {
        # DeepSpeed's "Adam" is AdamW unless adam_w_mode is false: say which one we mean.
        "type": "AdamW" if optim.name == "adamw" else "Adam",
        "params": {
            "lr": optim.lr,
            "betas": list(optim.betas),
            "eps": 1e-8,
            "weight_decay": optim.weight_decay,
            "adam_w_mode": optim.name == "adamw",
            # Without torch_adam DeepSpeed picks FusedAdam, which JIT-compiles C++ before the first step on a CPU.
            **({} if cuda else {"torch_adam": True}),
        },
    }


def schedule(optim: OptimConfig, total_steps: int,
             groups: list[LrGroup] | None = None) -> Callable[[torch.optim.Optimizer], Scheduler]:
    """What builds the lr scheduler from the optimizer (DeepSpeed's `lr_scheduler` argument takes such a callable):
    one factor per group of `param_groups(model, groups)`, each group at its share (LrGroup.factor)."""
    if not groups:
        factors: Any = lambda s: lr_factor(s, optim, total_steps)  # noqa: E731
    else:
        factors = [functools.partial(g.factor, optim=optim, total_steps=total_steps) for g in groups]

    def build(opt: torch.optim.Optimizer) -> Scheduler:
        return Scheduler(opt, factors)

    return build


def lr_factor(step: int, optim: OptimConfig, total_steps: int) -> float:
    """Multiplier of optim.lr for optimizer step `step` (0-based).

    Linear warmup from lr/warmup (never 0: DeepSpeed's WarmupLR with warmup_min_lr 0 trains step 1 at lr 0), then
    constant, linear or cosine decay that ends at 0.1 x lr on the last step.
    """
    w = optim.warmup_steps
    if step < w:
        return (step + 1) / w
    if optim.schedule == "constant":
        return 1.0
    progress = min(1.0, (step - w) / max(1, total_steps - 1 - w))
    if optim.schedule == "linear":
        return 1.0 - 0.9 * progress
    return 0.1 + 0.9 * 0.5 * (1.0 + math.cos(math.pi * progress))
