"""Text -> token ids, exactly as the trainer encodes (COMMON.md "Token ids"), without importing the trainer.

A sequence is [<sos>] + piece ids + [<eos>], cut to `max_len` ids in total: the pieces are cut to max_len - 2
and <eos> is kept. Pieces come from the folder's sentencepiece model (`encode(text, out_type=str)`); a piece on
line i (0-based) of vocab.txt has id i + 4; a piece not in vocab.txt is <oov>. tests/test_serving_tokenizer.py
checks that trainer/tokenizer.py gives the same ids on real reviews.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import sentencepiece as spm

from serving.errors import BundleError

SOS, PAD, EOS, OOV = 0, 1, 2, 3
SPECIALS = {"sos": SOS, "pad": PAD, "eos": EOS, "oov": OOV}


@dataclass(frozen=True)
class Encoded:
    """One encoded text."""

    ids: np.ndarray  # (n,) int64, <sos> ... <eos>, 3 <= n <= max_len (2 for a text with no pieces)
    truncated: bool  # True when pieces were cut to fit max_len

    @property
    def token_count(self) -> int:
        return int(self.ids.shape[0])


class Tokenizer:
    """Reads a tokenizer folder (spm.model, vocab.txt, tokenizer.json) and encodes texts."""

    def __init__(self, processor: spm.SentencePieceProcessor, vocab: dict[str, int], max_len: int) -> None:
        if max_len < 3:
            raise ValueError(f"max_len must be >= 3 (<sos>, one piece, <eos>), got {max_len}")
        self.processor = processor
        self.vocab = vocab  # piece -> id (>= 4)
        self.max_len = max_len

    @classmethod
    def load(cls, folder: str | Path, max_len: int | None = None) -> Tokenizer:
        """max_len: the cut (default: tokenizer.json's)."""
        folder = Path(folder)
        files = {}
        for name in ("spm.model", "vocab.txt", "tokenizer.json"):
            try:
                files[name] = (folder / name).read_bytes()
            except OSError as e:
                raise BundleError(f"{folder / name}: cannot read ({e.strerror})") from None
        return cls.from_bytes(files, folder, max_len)

    @classmethod
    def from_bytes(cls, files: dict[str, bytes], folder: Path, max_len: int | None = None) -> Tokenizer:
        """files: the contents of spm.model, vocab.txt and tokenizer.json (a bundle passes the bytes whose
        checksums it verified, so nothing can change between the check and the load); folder names them in
        errors."""
        meta = _parse_json(files["tokenizer.json"], folder / "tokenizer.json")
        if meta.get("format") != 1:
            raise BundleError(f"{folder / 'tokenizer.json'}: field 'format' must be 1, got {meta.get('format')!r}")
        if meta.get("specials") != SPECIALS:
            raise BundleError(f"{folder / 'tokenizer.json'}: field 'specials' must be {SPECIALS}, "
                              f"got {meta.get('specials')!r}")
        # Split on "\n" only: str.splitlines() also splits on \x1c, \x85, \u2028..., which a piece may contain.
        try:
            lines = files["vocab.txt"].decode("utf-8").split("\n")
        except UnicodeDecodeError as e:
            raise BundleError(f"{folder / 'vocab.txt'}: not UTF-8 ({e})") from None
        if lines and lines[-1] == "":
            lines.pop()
        vocab: dict[str, int] = {}
        for i, piece in enumerate(lines):
            if piece in vocab:
                raise BundleError(f"{folder / 'vocab.txt'}: line {i + 1}: piece {piece!r} repeats line "
                                  f"{vocab[piece] - 3}")
            vocab[piece] = i + 4
        if meta.get("vocab_size") != len(vocab) + 4:
            raise BundleError(f"{folder / 'tokenizer.json'}: vocab_size {meta.get('vocab_size')!r} != "
                              f"{len(vocab)} pieces in vocab.txt + 4 specials")
        try:
            processor = spm.SentencePieceProcessor(model_proto=files["spm.model"])
        except RuntimeError:
            raise BundleError(f"{folder / 'spm.model'}: not a sentencepiece model") from None
        limit = meta.get("max_len") if max_len is None else max_len
        if not isinstance(limit, int) or isinstance(limit, bool) or limit < 3:
            raise BundleError(f"{folder / 'tokenizer.json'}: max_len must be an int >= 3, got {limit!r}")
        return cls(processor, vocab, limit)

    def encode(self, text: str) -> Encoded:
        pieces = self.processor.encode(text, out_type=str)
        keep = self.max_len - 2
        ids = [SOS, *(self.vocab.get(p, OOV) for p in pieces[:keep]), EOS]
        return Encoded(np.asarray(ids, dtype=np.int64), truncated=len(pieces) > keep)


def _parse_json(data: bytes, path: Path) -> dict:
    try:
        obj = json.loads(data.decode("utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise BundleError(f"{path}: not valid JSON ({e})") from None
    if not isinstance(obj, dict):
        raise BundleError(f"{path}: expected a JSON object, got {type(obj).__name__}")
    return obj
