"""The optimizer and its learning-rate schedule, for both training stages: which parameters it updates in which
groups, with which settings, and how the lr moves from step to step.

DeepSpeed builds the optimizer from `ds_section` (the "optimizer" of its JSON) over `param_groups`, and steps the
scheduler `schedule` builds once per optimizer step (trainer/engine/deepspeed_engine.py, initialize);
bench/train_throughput.py's plain loop builds torch's Adam from the same groups and schedule.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import torch

from trainer.config.schema import OptimConfig

Scheduler = torch.optim.lr_scheduler.LambdaLR


def param_groups(model: torch.nn.Module) -> list[dict[str, Any]]:
    """The optimizer's parameter groups: today one, every parameter at the stage's lr and weight decay. A group's own
    "lr" or "weight_decay" overrides the optimizer's for its parameters (torch.optim's rule, kept by DeepSpeed and
    its ZeRO stages); the schedule then scales each group's lr by `lr_factor`."""
    return [{"params": list(model.parameters())}]


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


def schedule(optim: OptimConfig, total_steps: int) -> Callable[[torch.optim.Optimizer], Scheduler]:
    """What builds the lr scheduler from the optimizer (DeepSpeed's `lr_scheduler` argument takes such a callable)."""
    def build(opt: torch.optim.Optimizer) -> Scheduler:
        return Scheduler(opt, lambda s: lr_factor(s, optim, total_steps))

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
