"""Export the classifier's mean pooling so that a row's answer has the same bits whatever its batch.

onnxruntime's ReduceSum adds the positions of a (B, T, d) tensor in an order that depends on the whole tensor's
shape, so a text's fp32 logits moved in their last bit with the batch size (measured: bench/batch_invariance.py,
docs/BENCHMARKS.md). At export time only, `MeanPool` is swapped for `ScanMeanPool`: the same mean, summed by a running
sum (CumSum, a scan: each position added to the previous total, in order) read at the last position. Padding adds
exact zeros at the end, so neither the batch nor its padded width changes a row's total. The PyTorch model that
training runs is untouched, and export validation compares the graph with it (the two sums differ by rounding only).
"""

from __future__ import annotations

import copy

import torch
from torch import nn

from trainer.model.encoder import MeanPool


class ScanMeanPool(nn.Module):
    """MeanPool's mean with the positions added in order (a running sum), whatever the batch's shape."""

    def forward(self, h: torch.Tensor, padding_mask: torch.Tensor) -> torch.Tensor:
        """(B, T, d), (B, T) True at <pad> -> (B, d)."""
        real = (~padding_mask).unsqueeze(-1).to(h.dtype)  # (B, T, 1)
        total = torch.cumsum(h * real, dim=1)[:, -1]  # (B, d): the running sum at the last position
        return total / real.sum(dim=1).clamp(min=1.0)  # counts of 0/1 values: exact in any order


def with_scan_pooling(model: nn.Module) -> nn.Module:
    """A copy of a Classifier whose mean pooling is ScanMeanPool (no weights change); `model` is unchanged."""
    if not isinstance(getattr(model, "pool", None), MeanPool):
        return model
    swapped = copy.deepcopy(model)
    swapped.pool = ScanMeanPool()
    return swapped.eval()
