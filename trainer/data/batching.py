"""Length-bucketed batching of id sequences, and right-padding into the model's tensors. Needs no tokenizer."""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import TYPE_CHECKING

import numpy as np

from contract.tokens import PAD

if TYPE_CHECKING:
    import torch


def bucket_batches(
    lengths: Sequence[int], batch_size: int, seed: int, epoch: int, shuffle: bool = True, chunk_batches: int = 64
) -> list[list[int]]:
    """Index batches of similar lengths, so padding is small; every index appears exactly once.

    Shuffle all indices, sort each chunk of `chunk_batches * batch_size` by length, cut it into batches, shuffle
    the batch order. Chunks (rather than one global sort) keep batches random enough for SGD. Deterministic in
    (seed, epoch). With shuffle=False: indices in order, sorted within chunks, batches in order (evaluation)."""
    if batch_size < 1:
        raise ValueError(f"batch_size must be >= 1, got {batch_size}")
    if chunk_batches < 1:
        raise ValueError(f"chunk_batches must be >= 1, got {chunk_batches}")
    lens = np.asarray(lengths, dtype=np.int64)
    rng = np.random.default_rng([seed, epoch])
    order = rng.permutation(len(lens)) if shuffle else np.arange(len(lens))
    span = chunk_batches * batch_size
    batches: list[list[int]] = []
    for start in range(0, len(order), span):
        chunk = order[start : start + span]
        chunk = chunk[np.argsort(lens[chunk], kind="stable")]
        batches += [chunk[i : i + batch_size].tolist() for i in range(0, len(chunk), batch_size)]
    if shuffle:
        batches = [batches[i] for i in rng.permutation(len(batches))]
    return batches


def padding_fraction(lengths: Sequence[int], batches: Iterable[Sequence[int]]) -> float:
    """Fraction of padded positions when each batch is padded to its longest member."""
    lens = np.asarray(lengths, dtype=np.int64)
    padded = real = 0
    for b in batches:
        lb = lens[np.asarray(b, dtype=np.int64)]
        padded += int(lb.max()) * len(lb) if len(lb) else 0
        real += int(lb.sum())
    return 0.0 if padded == 0 else 1.0 - real / padded


def pad_batch(seqs: Sequence[Sequence[int]], pad_id: int = PAD) -> tuple[torch.Tensor, torch.Tensor]:
    """Right-pad id sequences: (input_ids (B, T) int64, padding_mask (B, T) bool, True at <pad>)."""
    import torch  # here, so that bucketing works without torch

    if not seqs:
        raise ValueError("pad_batch needs at least one sequence")
    lens = np.fromiter((len(s) for s in seqs), dtype=np.int64, count=len(seqs))
    ids = np.full((len(seqs), int(lens.max())), pad_id, dtype=np.int64)  # (B, T)
    for row, s in zip(ids, seqs, strict=True):
        row[: len(s)] = s
    mask = np.arange(ids.shape[1])[None, :] >= lens[:, None]  # (B, T) True past each sequence's end
    return torch.from_numpy(ids), torch.from_numpy(mask)
