"""The learning-rate schedule of both training stages (DeepSpeed runs it as a LambdaLR:
trainer/engine/deepspeed_engine.py)."""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from trainer.config.schema import OptimConfig


@dataclass(frozen=True)
class LrGroup:
    """One optimizer parameter group and its share of the schedule's lr: `rate` from step `start` on, 0 before it
    (Adam leaves a parameter at lr 0 exactly as it is: a frozen group). trainer/tasks/lr_groups.py builds them."""

    name: str
    params: list[torch.nn.Parameter]
    rate: float = 1.0
    start: int = 0

    def factor(self, step: int, optim: OptimConfig, total_steps: int) -> float:
        return self.rate * lr_factor(step, optim, total_steps) if step >= self.start else 0.0


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
