"""Packed training windows over a prepared corpus's token stream, shuffled without any table over the windows.

The stream is the documents as [<sos>] + pieces + [<eos>], back to back (trainer/data/corpus.py). Window w of a span
[lo, hi) is tokens [lo + w * L, lo + w * L + L + overlap), L = pretrain.seq_len, overlap 1 for next-token
prediction (each window's last token is the next one's first, so every token of the span but its first is a target
once) and 0 for masked LM. A span has W = (hi - lo - overlap) // L windows; its ragged tail (< L tokens) is not
used. Every window is full, as in GPT-style packing: no padding, no length bucketing, and a window may hold the end of
one document and the start of the next (<eos> <sos> between them).

Order: epoch e visits the windows in the order of a keyed pseudo-random bijection of [0, W) (a 4-round Feistel
network with cycle walking, keyed by (seed, epoch)). Global batch b is the windows at positions [b * G, (b + 1) * G)
of that order, computed when asked in O(G): no rank holds an array over all windows, whatever the corpus size, and
the order depends only on (W, G, seed, epoch), never on the number of ranks. Each rank then reads only its part of
a global batch (trainer/engine/loop.py `micro_batches`): 2 ranks x B read exactly the windows of 1 rank x 2B.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

import numpy as np

from trainer.data.corpus import PreparedCorpus

_M1, _M2, _M3 = np.uint64(0x9E3779B97F4A7C15), np.uint64(0xBF58476D1CE4E5B9), np.uint64(0x94D049BB133111EB)
ROUNDS = 4  # Feistel rounds: 4 give a pseudo-random permutation (Luby-Rackoff)


def _keys(seed: int, epoch: int) -> np.ndarray:
    return np.random.SeedSequence([seed, epoch, 0x57494E]).generate_state(ROUNDS, dtype=np.uint64)  # (ROUNDS,)


def _round(r: np.ndarray, key: np.uint64) -> np.ndarray:
    """splitmix64 of (r + key): a well-mixed 64-bit hash, elementwise (uint64 arithmetic wraps)."""
    z = (r + key) * _M1
    z = (z ^ (z >> np.uint64(30))) * _M2
    z = (z ^ (z >> np.uint64(27))) * _M3
    return z ^ (z >> np.uint64(31))


def _feistel(x: np.ndarray, half: int, keys: np.ndarray) -> np.ndarray:
    """A bijection of [0, 4 ** half): a balanced Feistel network on the two half-bit halves of x."""
    h, mask = np.uint64(half), np.uint64((1 << half) - 1)
    left, right = x >> h, x & mask
    for k in keys:
        left, right = right, left ^ (_round(right, k) & mask)
    return (left << h) | right


def permute(i: np.ndarray, n: int, seed: int, epoch: int) -> np.ndarray:
    """Positions i (any shape, 0 <= i < n) -> windows: a bijection of [0, n) keyed by (seed, epoch).

    Cycle walking: the Feistel bijection of [0, 4 ** half), 4 ** half >= n, is applied again until the value falls in
    [0, n); that restricted map is itself a bijection of [0, n). 4 ** half < 4 n, so a walk takes < 4 steps on
    average (numpy over the whole batch at once)."""
    i = np.asarray(i, dtype=np.int64)
    if n < 1 or i.size and (i.min() < 0 or i.max() >= n):
        raise IndexError(f"positions must lie in [0, {n})")
    half = max(1, ((n - 1).bit_length() + 1) // 2)
    keys = _keys(seed, epoch)
    y = _feistel(i.astype(np.uint64), half, keys)
    out = y >= np.uint64(n)
    while out.any():
        y[out] = _feistel(y[out], half, keys)
        out = y >= np.uint64(n)
    return y.astype(np.int64)


class TokenStream(Protocol):
    """What windows read: a prepared corpus on disk, or `MemoryStream`."""

    n_tokens: int

    def read(self, a: int, b: int) -> np.ndarray:
        """Ids [a, b) of the stream, (b - a,) int64."""


class MemoryStream:
    """Sequences of ids back to back in memory (fine-tuning's task-text stage: trainer/tasks/task_lm.py)."""

    def __init__(self, seqs: Sequence[Sequence[int]]) -> None:
        self.ids = np.concatenate([np.asarray(x, dtype=np.int64) for x in seqs]) if seqs else np.empty(0, np.int64)
        self.n_tokens = len(self.ids)

    def read(self, a: int, b: int) -> np.ndarray:
        return self.ids[a:b]


class Windows:
    """Full windows of seq_len + overlap tokens over the stream span [lo, hi) of a prepared corpus (or any
    TokenStream)."""

    def __init__(self, corpus: TokenStream, lo: int, hi: int, seq_len: int, overlap: int) -> None:
        if seq_len < 1 or overlap not in (0, 1) or not 0 <= lo <= hi <= corpus.n_tokens:
            raise ValueError(f"bad windows: seq_len {seq_len}, overlap {overlap}, span [{lo}, {hi})")
        self.corpus, self.lo, self.hi, self.seq_len, self.overlap = corpus, lo, hi, seq_len, overlap
        self.n = max(0, (hi - lo - overlap) // seq_len)

    def __len__(self) -> int:
        return self.n

    def global_batch(self, epoch: int, b: int, size: int, seed: int) -> list[int]:
        """The window ids of global batch b of `epoch` (batches of `size`; a last partial one is not used)."""
        if not 0 <= b < self.n // size:
            raise IndexError(f"global batch {b} outside [0, {self.n // size})")
        return permute(np.arange(b * size, (b + 1) * size), self.n, seed, epoch).tolist()

    def tokens(self, ids: Sequence[int]) -> np.ndarray:
        """(len(ids), seq_len + overlap) int64 ids of windows `ids`: one slice of the stream each."""
        width = self.seq_len + self.overlap
        out = np.empty((len(ids), width), dtype=np.int64)
        for row, w in enumerate(ids):  # a loop over windows, never over pieces
            if not 0 <= w < self.n:
                raise IndexError(f"window {w} outside [0, {self.n})")
            a = self.lo + int(w) * self.seq_len
            out[row] = self.corpus.read(a, a + width)
        return out


class EpochOrder(Sequence[list[int]]):
    """An epoch's global batches as the training loop takes them (`len`, `[b]`), each made when asked: O(G)."""

    def __init__(self, windows: Windows, epoch: int, size: int, seed: int) -> None:
        self.windows, self.epoch, self.size, self.seed = windows, epoch, size, seed

    def __len__(self) -> int:
        return len(self.windows) // self.size

    def __getitem__(self, b: int) -> list[int]:  # type: ignore[override]
        if not 0 <= b < len(self):
            raise IndexError(b)
        return self.windows.global_batch(self.epoch, b, self.size, self.seed)


def split(corpus: PreparedCorpus, eval_docs: int, seq_len: int, overlap: int) -> tuple[Windows, Windows]:
    """Training windows over all but the last `eval_docs` documents, held-out windows over those (kept whole:
    no window holds tokens of both)."""
    eval_docs = min(eval_docs, corpus.n_docs - 1)
    cut = corpus.doc_start(corpus.n_docs - eval_docs)
    return Windows(corpus, 0, cut, seq_len, overlap), Windows(corpus, cut, corpus.n_tokens, seq_len, overlap)
