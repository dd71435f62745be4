"""The learning-rate schedule of both training stages (DeepSpeed runs it as a LambdaLR:
trainer/engine/deepspeed_engine.py)."""

from __future__ import annotations

import math

from trainer.config.schema import OptimConfig


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
