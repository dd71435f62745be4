"""A tokenized corpus for pretraining: every document's piece ids in one flat array, saved as one .npz.

Layers: trainer/data.py reads the files, trainer/tokenizer.py turns their texts into ids, this module keeps the ids.
"""

from __future__ import annotations

import itertools
import os
import sys
import tempfile
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from trainer.atomic import temp_file
from trainer.data import DataError, Example, detokenize, iter_texts
from trainer.tokenizer import Tokenizer


@dataclass
class Corpus:
    """Tokenized documents in one flat array: document i is tokens[offsets[i]:offsets[i + 1]].

    Piece ids only, no <sos>/<eos> and no cut to max_len: the pretraining stage cuts windows and adds specials."""

    tokens: np.ndarray  # (n_tokens,) uint16 when the vocabulary fits, else int32
    offsets: np.ndarray  # (n_docs + 1,) int64, offsets[0] == 0
    vocab_size: int
    fingerprint: str = ""  # Tokenizer.fingerprint of the tokenizer that made it

    def __len__(self) -> int:
        return len(self.offsets) - 1

    @property
    def n_tokens(self) -> int:
        return int(self.offsets[-1])

    def lengths(self) -> np.ndarray:
        """(n_docs,) int64 document lengths."""
        return np.diff(self.offsets)

    def doc(self, i: int) -> np.ndarray:
        if not 0 <= i < len(self):
            raise IndexError(f"document {i} out of range [0, {len(self)})")
        return self.tokens[self.offsets[i] : self.offsets[i + 1]]

    def save(self, path: str | Path) -> Path:
        """Write one .npz (uncompressed) atomically."""
        path = Path(path)
        if path.suffix != ".npz":
            raise DataError(f"{path}: a corpus is saved as .npz")
        fd, tmp = temp_file(path.parent, f".{path.name}.", ".npz")
        try:
            with os.fdopen(fd, "wb") as f:
                np.savez(f, tokens=self.tokens, offsets=self.offsets, vocab_size=np.int64(self.vocab_size),
                         fingerprint=np.array(self.fingerprint))
                f.flush()
                os.fsync(f.fileno())
            os.replace(tmp, path)
        finally:
            if os.path.exists(tmp):
                os.remove(tmp)
        return path

    @classmethod
    def load(cls, path: str | Path, fingerprint: str | None = None) -> Corpus:
        """Read a saved corpus; with `fingerprint`, refuse one made by another tokenizer."""
        path = Path(path)
        if not path.is_file():
            raise DataError(f"{path}: corpus file not found")
        try:
            with np.load(path, allow_pickle=False) as z:
                corpus = cls(z["tokens"], z["offsets"], int(z["vocab_size"]), str(z["fingerprint"]))
        except (KeyError, ValueError, OSError) as e:
            raise DataError(f"{path}: not a saved corpus ({e})") from None
        if corpus.offsets[0] != 0 or corpus.n_tokens != len(corpus.tokens):
            raise DataError(f"{path}: offsets end at {corpus.n_tokens} but there are {len(corpus.tokens)} tokens")
        if fingerprint is not None and corpus.fingerprint != fingerprint:
            raise DataError(f"{path}: made by tokenizer {corpus.fingerprint[:12]}, this run uses {fingerprint[:12]}")
        return corpus


def encode_corpus(
    paths: Iterable[str | Path],
    tokenizer: Tokenizer,
    max_docs: int | None = None,
    chunk_docs: int = 512,
    progress: bool = False,
) -> Corpus:
    """Tokenize unlabeled documents, streamed in chunks of `chunk_docs`, into one flat array.

    Memory: each chunk's ids go to an unnamed temporary file, read back once at the end, so the peak is one token
    array (2 bytes a piece below 65,536 ids) plus one chunk, not the usual 2x of concatenating in-memory chunks."""
    dtype = np.uint16 if tokenizer.vocab_size <= 65536 else np.int32
    lengths: list[np.ndarray] = []
    n_docs = n_tokens = 0
    bar = _progress(progress, "tokenizing")
    with tempfile.TemporaryFile() as spool:
        for path in paths:
            docs = iter_texts(path)
            while max_docs is None or n_docs < max_docs:
                take = chunk_docs if max_docs is None else min(chunk_docs, max_docs - n_docs)
                batch = list(itertools.islice(docs, take))
                if not batch:
                    break
                ids, lens = _encode_chunk(batch, tokenizer)
                spool.write(ids.astype(dtype).tobytes())
                lengths.append(lens)
                n_docs += len(batch)
                n_tokens += len(ids)
                if bar is not None:
                    bar.update(len(batch))
        spool.seek(0)
        tokens = np.fromfile(spool, dtype=dtype, count=n_tokens)
    if bar is not None:
        bar.close()
    offsets = np.zeros(n_docs + 1, dtype=np.int64)
    if n_docs:
        np.cumsum(np.concatenate(lengths), out=offsets[1:])
    return Corpus(tokens, offsets, tokenizer.vocab_size, tokenizer.fingerprint)


def _encode_chunk(batch: list[Example], tokenizer: Tokenizer) -> tuple[np.ndarray, np.ndarray]:
    """Piece ids (flat) and lengths of a chunk; texts go through one threaded call, lab pieces map directly."""
    if all(ex.text is not None for ex in batch):
        return tokenizer.piece_ids([ex.text for ex in batch])  # type: ignore[misc]
    if tokenizer.kind == "lab":  # pieces from the lab's model: the contract's lookup, no re-encoding
        docs = [tokenizer.encode_pieces(ex.pieces or [], max_len=len(ex.pieces or []) + 2)[1:-1] for ex in batch]
        lens = np.array([len(d) for d in docs], dtype=np.int64)
        return np.fromiter(itertools.chain.from_iterable(docs), dtype=np.int64, count=int(lens.sum())), lens
    return tokenizer.piece_ids([ex.text if ex.text is not None else detokenize(ex.pieces or []) for ex in batch])


def _progress(enabled: bool, desc: str) -> Any:
    """A tqdm bar, or None when disabled or when stderr is no terminal (a bar redrawn into a log file is one
    endless line; the caller prints its totals). tqdm is imported only when shown."""
    if not enabled or not sys.stderr.isatty():
        return None
    from tqdm import tqdm

    return tqdm(desc=desc, unit=" docs")
