"""Sentencepiece pieces -> the project's token ids, for the lab's model and for models trained on a user's corpus.

Ids (COMMON.md): <sos>=0 <pad>=1 <eos>=2 <oov>=3, then the piece on line i (0-based) of vocab.txt has id i + 4.
A sequence is [<sos>] + piece ids + [<eos>], cut to max_len ids in total (pieces cut to max_len - 2, <eos> kept).
Pieces that are not in vocab.txt (sentencepiece's <unk> surface strings included) map to <oov>.

Two sources, one encode API:
- `Tokenizer.from_lab(model, dict.txt, max_len)`: the lab's sentencepiece.french.model and its fairseq dict.txt
  ("piece count" lines), so the lab's ids are reproduced exactly (LAB.md "Tokens and data").
- `Tokenizer.train(corpus, vocab_size, ...)`: a new BPE sentencepiece model learned in-process (nothing written to
  the working directory) on a user's raw text; vocab.txt holds exactly `vocab_size` pieces, so the model needs
  `vocab_size + 4` ids.

Saved as the `tokenizer/` folder (spm.model, vocab.txt, tokenizer.json) that travels with every artifact and bundle.
This module needs sentencepiece and numpy only (no torch), like the server's reimplementation of the same contract.
"""

from __future__ import annotations

import hashlib
import io
import itertools
import json
import os
import random
import shutil
import tempfile
from collections.abc import Iterable, Iterator, Sequence
from pathlib import Path
from typing import Literal

import numpy as np
import sentencepiece as spm

from trainer.config import ConfigError, RunConfig
from trainer.data import Example, detokenize, iter_texts

__all__ = ["Tokenizer", "TokenizerError", "build_tokenizer", "detokenize"]

FORMAT = 1  # tokenizer.json "format"
SPECIALS = {"sos": 0, "pad": 1, "eos": 2, "oov": 3}
SPECIAL_PIECES = ["<sos>", "<pad>", "<eos>", "<oov>"]  # shown by id_to_piece for ids 0..3
N_SPECIALS = 4
FILES = ("spm.model", "vocab.txt", "tokenizer.json")

# Sentencepiece training. BPE like the lab's own model (its trainer_spec says model_type BPE); its result does not
# depend on the thread count, and a fixed count keeps the model bytes (which record it) identical across machines.
TRAIN_THREADS = 2
CHARACTER_COVERAGE = 0.9995  # rarer characters become <oov> instead of taking vocabulary rows
MAX_SENTENCE_BYTES = 1 << 16  # spm silently skips longer lines; the longest IMDB review is ~14k bytes


class TokenizerError(ValueError):
    """A tokenizer folder, model or vocabulary is missing or inconsistent; the message names file and value."""


def _threads() -> int:
    """Threads for sentencepiece batch encoding (output does not depend on it)."""
    try:
        n = len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        n = os.cpu_count() or 1
    return max(1, min(n, 8))


class Tokenizer:
    """Text or pre-tokenized pieces -> [<sos>] + ids + [<eos>], cut to `max_len`."""

    SOS = 0
    PAD = 1
    EOS = 2
    OOV = 3

    def __init__(self, model_proto: bytes, pieces: list[str], kind: Literal["lab", "train"], max_len: int) -> None:
        """`pieces[i]` gets id i + 4. Prefer `from_lab`, `train` or `load`."""
        if kind not in ("lab", "train"):
            raise TokenizerError(f"tokenizer kind must be 'lab' or 'train', got {kind!r}")
        if max_len < 3:
            raise TokenizerError(f"max_len must be >= 3 (<sos>, one piece, <eos>), got {max_len}")
        if not pieces:
            raise TokenizerError("the vocabulary is empty")
        self._sp = spm.SentencePieceProcessor()
        try:
            self._sp.LoadFromSerializedProto(model_proto)
        except RuntimeError as e:  # sentencepiece raises RuntimeError/OSError on a corrupt proto
            raise TokenizerError(f"not a sentencepiece model: {e}") from None
        self._model_proto = bytes(model_proto)
        self.pieces = list(pieces)
        self.kind: Literal["lab", "train"] = kind
        self.max_len = int(max_len)
        self.vocab_size = len(self.pieces) + N_SPECIALS
        # piece -> id; a dict lookup per piece is the contract's definition (and the .spm route).
        self._piece_to_id: dict[str, int] = {}
        for i, p in enumerate(self.pieces):
            if p in self._piece_to_id:
                raise TokenizerError(f"vocabulary line {i + 1}: piece {p!r} repeats line {self._piece_to_id[p] - 3}")
            self._piece_to_id[p] = i + N_SPECIALS
        # Fast path for text: spm id -> our id in one numpy gather. The contract maps the *surface* piece, and spm's
        # <unk> covers characters the model lacks, so no model piece can equal an <unk>'s surface: <unk> -> <oov>.
        # Only a vocabulary with pieces the model does not have (a foreign dict) needs the surface lookup, so there
        # <unk> maps to -1 and those positions are resolved one by one in `piece_ids`.
        n_spm = self._sp.get_piece_size()
        unk = self._sp.unk_id()
        foreign = any(self._sp.piece_to_id(p) == unk for p in self.pieces)
        self._spm_to_id = np.full(n_spm, -1 if foreign else self.OOV, dtype=np.int64)
        for s in range(n_spm):
            if not (self._sp.is_unknown(s) or self._sp.is_control(s)):
                self._spm_to_id[s] = self._piece_to_id.get(self._sp.id_to_piece(s), self.OOV)
        # Decoding: our id -> spm id (specials and pieces the model lacks -> spm's <unk>, printed " ⁇ ").
        self._id_to_spm = np.full(self.vocab_size, unk, dtype=np.int64)
        for i, p in enumerate(self.pieces):
            s = self._sp.piece_to_id(p)
            if s != unk:
                self._id_to_spm[i + N_SPECIALS] = s

    def __repr__(self) -> str:
        return f"Tokenizer(kind={self.kind!r}, vocab_size={self.vocab_size}, max_len={self.max_len})"

    # ------------------------------------------------------------------------------------------ encoding

    def _limit(self, max_len: int | None) -> int:
        n = self.max_len if max_len is None else int(max_len)
        if n < 3:
            raise ValueError(f"max_len must be >= 3 (<sos>, one piece, <eos>), got {n}")
        return n

    def _wrap(self, ids: Sequence[int], max_len: int | None) -> list[int]:
        n = self._limit(max_len)
        return [self.SOS, *ids[: n - 2], self.EOS]

    def piece_ids(self, texts: Sequence[str]) -> tuple[np.ndarray, np.ndarray]:
        """Piece ids of many texts, no specials and no cut: (flat ids int64 (N,), lengths int64 (len(texts),)).

        The building block of `encode_batch` and of `data.encode_corpus`: one threaded sentencepiece call, then a
        numpy gather from spm ids to ours."""
        spm_ids = self._sp.encode(list(texts), num_threads=_threads())  # list of lists of spm ids
        lengths = np.fromiter((len(x) for x in spm_ids), dtype=np.int64, count=len(spm_ids))
        flat = np.fromiter(itertools.chain.from_iterable(spm_ids), dtype=np.int64, count=int(lengths.sum()))
        ids = self._spm_to_id[flat]
        holes = np.flatnonzero(ids < 0)  # <unk> with a foreign vocabulary: look the surface piece up in vocab.txt
        if holes.size:
            starts = np.concatenate([[0], np.cumsum(lengths)[:-1]])
            docs = np.searchsorted(starts, holes, side="right") - 1
            for d in np.unique(docs):
                surface = self._sp.encode(texts[d], out_type=str)
                for h in holes[docs == d]:
                    ids[h] = self._piece_to_id.get(surface[h - starts[d]], self.OOV)
        return ids, lengths

    def encode(self, text: str, max_len: int | None = None) -> list[int]:
        """Raw text -> [<sos>] + ids + [<eos>], at most `max_len` ids (default: the tokenizer's)."""
        return self.encode_batch([text], max_len)[0]

    def encode_batch(self, texts: Sequence[str], max_len: int | None = None) -> list[list[int]]:
        """Many texts at once (threaded): each [<sos>] + ids + [<eos>], at most `max_len` ids."""
        n = self._limit(max_len)
        ids, lengths = self.piece_ids(texts)
        out, start = [], 0
        for length in lengths.tolist():
            out.append([self.SOS, *ids[start : start + min(length, n - 2)].tolist(), self.EOS])
            start += length
        return out

    def encode_pieces(self, pieces: Sequence[str], max_len: int | None = None) -> list[int]:
        """Pre-tokenized pieces (a line of the lab's .spm files) -> [<sos>] + ids + [<eos>]; unknown -> <oov>."""
        get, oov = self._piece_to_id.get, self.OOV
        n = self._limit(max_len)
        return self._wrap([get(p, oov) for p in pieces[: n - 2]], n)

    def encode_example(self, ex: Example, max_len: int | None = None) -> list[int]:
        """An `Example` from trainer.data: its text, or its pieces.

        Pieces come from the lab's sentencepiece model, so only a `lab` tokenizer maps them directly; a trained
        tokenizer re-encodes their detokenized text (for the lab's files that equals the .txt sibling exactly)."""
        if ex.text is not None:
            return self.encode(ex.text, max_len)
        if ex.pieces is None:
            raise ValueError(f"{ex.source}: example has neither text nor pieces")
        if self.kind == "lab":
            return self.encode_pieces(ex.pieces, max_len)
        return self.encode(detokenize(ex.pieces), max_len)

    # ------------------------------------------------------------------------------------------ decoding

    def decode(self, ids: Iterable[int]) -> str:
        """Ids -> text; <sos>/<pad>/<eos> are skipped, <oov> prints as sentencepiece's " ⁇ "."""
        keep = [int(i) for i in ids if int(i) not in (self.SOS, self.PAD, self.EOS)]
        bad = [i for i in keep if not 0 <= i < self.vocab_size]
        if bad:
            raise ValueError(f"id {bad[0]} is outside the vocabulary [0, {self.vocab_size})")
        return self._sp.decode(self._id_to_spm[np.asarray(keep, dtype=np.int64)].tolist())

    def id_to_piece(self, i: int) -> str:
        if not 0 <= i < self.vocab_size:
            raise ValueError(f"id {i} is outside the vocabulary [0, {self.vocab_size})")
        return SPECIAL_PIECES[i] if i < N_SPECIALS else self.pieces[i - N_SPECIALS]

    def piece_to_id(self, piece: str) -> int:
        """A vocabulary piece's id; anything else (special names included) is <oov>."""
        return self._piece_to_id.get(piece, self.OOV)

    @property
    def fingerprint(self) -> str:
        """sha256 of the model bytes and the vocabulary: equal fingerprints give equal piece ids (max_len aside)."""
        h = hashlib.sha256(self._model_proto)
        h.update("\n".join(self.pieces).encode("utf-8"))
        return h.hexdigest()

    # ------------------------------------------------------------------------------------------ constructors

    @classmethod
    def from_lab(cls, model_path: str | Path, dict_path: str | Path, max_len: int = 512) -> Tokenizer:
        """The lab's sentencepiece model + fairseq dict.txt ("piece count" per line; line i -> id i + 4)."""
        model_path, dict_path = Path(model_path), Path(dict_path)
        proto = _read_bytes(model_path, "sentencepiece model")
        pieces = []
        for lineno, line in _text_lines(dict_path, "fairseq dictionary"):
            if line.endswith(" #fairseq:overwrite"):  # fairseq's only flag; the lab's dict has none
                line = line[: -len(" #fairseq:overwrite")]
            piece, sep, count = line.rpartition(" ")
            if not sep or not piece or not count.isdigit():
                raise TokenizerError(f"{dict_path}:{lineno}: expected 'piece count', got {line[:80]!r}")
            pieces.append(piece)
        if not pieces:
            raise TokenizerError(f"{dict_path}: file is empty")
        try:
            return cls(proto, pieces, "lab", max_len)
        except TokenizerError as e:
            raise TokenizerError(f"{model_path} + {dict_path}: {e}") from None

    @classmethod
    def train(
        cls,
        source: Iterable[str] | Sequence[os.PathLike] | os.PathLike,
        vocab_size: int,
        max_len: int = 512,
        train_lines: int = 200_000,
        seed: int = 0,
    ) -> Tokenizer:
        """Learn a BPE sentencepiece model with `vocab_size` pieces (ids: vocab_size + 4) on raw text.

        `source` is a list of file paths given as `pathlib.Path` (read with trainer.data, any supported format,
        .spm pieces detokenized), or any iterable of text strings. At most `train_lines` non-blank lines are used,
        drawn by a seeded reservoir sample, so the model depends only on (input, vocab_size, train_lines, seed)."""
        if vocab_size < 8:
            raise TokenizerError(f"vocab_size must be >= 8, got {vocab_size}")
        texts = _iter_source(source)
        sample = _reservoir(texts, train_lines, seed)
        if not sample:
            raise TokenizerError("cannot train a tokenizer on an empty corpus (no non-blank lines)")
        model = io.BytesIO()
        try:
            spm.SentencePieceTrainer.train(
                sentence_iterator=iter(sample),
                model_writer=model,
                model_type="bpe",
                vocab_size=vocab_size + 1,  # + spm's <unk> (id 0), which is not written to vocab.txt
                character_coverage=CHARACTER_COVERAGE,
                byte_fallback=False,
                unk_id=0,  # spm needs an unknown piece; <s>, </s> and <pad> are ours, so spm has none of them
                bos_id=-1,
                eos_id=-1,
                pad_id=-1,
                input_sentence_size=0,  # we sampled already (deterministically)
                shuffle_input_sentence=False,
                max_sentence_length=MAX_SENTENCE_BYTES,
                num_threads=TRAIN_THREADS,
                minloglevel=2,  # errors only; spm logs every step otherwise
            )
        except RuntimeError as e:
            raise TokenizerError(
                f"sentencepiece could not learn {vocab_size} pieces from {len(sample)} lines: {e}"
            ) from None
        proto = model.getvalue()
        sp = spm.SentencePieceProcessor(model_proto=proto)
        pieces = [sp.id_to_piece(i) for i in range(sp.get_piece_size()) if not sp.is_unknown(i)]
        if len(pieces) != vocab_size:  # hard_vocab_limit makes spm fail instead, but keep the contract checked
            raise TokenizerError(f"sentencepiece learned {len(pieces)} pieces, asked for {vocab_size}")
        return cls(proto, pieces, "train", max_len)

    # ------------------------------------------------------------------------------------------ folder I/O

    def save(self, folder: str | Path) -> Path:
        """Write the tokenizer/ folder atomically: built in a temp sibling, then renamed over `folder`."""
        folder = Path(folder)
        folder.parent.mkdir(parents=True, exist_ok=True)
        tmp = Path(tempfile.mkdtemp(prefix=f".{folder.name}.", dir=folder.parent))
        try:
            (tmp / "spm.model").write_bytes(self._model_proto)
            (tmp / "vocab.txt").write_text("".join(p + "\n" for p in self.pieces), encoding="utf-8")
            meta = {"format": FORMAT, "kind": self.kind, "max_len": self.max_len, "vocab_size": self.vocab_size,
                    "specials": dict(SPECIALS)}
            (tmp / "tokenizer.json").write_text(json.dumps(meta, indent=2) + "\n", encoding="utf-8")
            for name in FILES:
                with open(tmp / name, "rb") as f:
                    os.fsync(f.fileno())
            if folder.exists():  # a directory cannot be replaced in one rename: move the old one aside first
                old = Path(tempfile.mkdtemp(prefix=f".{folder.name}.old.", dir=folder.parent))
                os.replace(folder, old / folder.name)
                os.replace(tmp, folder)
                shutil.rmtree(old)
            else:
                os.replace(tmp, folder)
        finally:
            if tmp.exists():
                shutil.rmtree(tmp)
        return folder

    @classmethod
    def load(cls, folder: str | Path) -> Tokenizer:
        """Read a tokenizer/ folder, checking it against its own tokenizer.json."""
        folder = Path(folder)
        if not folder.is_dir():
            raise TokenizerError(f"tokenizer folder not found: {folder}")
        missing = [n for n in FILES if not (folder / n).is_file()]
        if missing:
            raise TokenizerError(
                f"{folder}: missing {', '.join(missing)} (a tokenizer folder holds {', '.join(FILES)})"
            )
        meta_path = folder / "tokenizer.json"
        try:
            meta = json.loads(meta_path.read_text(encoding="utf-8"))
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            raise TokenizerError(f"{meta_path}: invalid JSON: {e}") from None
        if not isinstance(meta, dict):
            raise TokenizerError(f"{meta_path}: expected a JSON object, got {type(meta).__name__}")
        for key, want in (("format", int), ("kind", str), ("max_len", int), ("vocab_size", int), ("specials", dict)):
            if not isinstance(meta.get(key), want):
                raise TokenizerError(f"{meta_path}: field {key!r} must be {want.__name__}, got {meta.get(key)!r}")
        if meta["format"] != FORMAT:
            raise TokenizerError(f"{meta_path}: format {meta['format']} is not supported (this code reads {FORMAT})")
        if meta["specials"] != SPECIALS:
            raise TokenizerError(f"{meta_path}: specials {meta['specials']} differ from {SPECIALS}")
        pieces = [line for _, line in _text_lines(folder / "vocab.txt", "vocabulary", keep_blank=True)]
        if len(pieces) + N_SPECIALS != meta["vocab_size"]:
            raise TokenizerError(
                f"{folder}: vocab.txt has {len(pieces)} pieces (+{N_SPECIALS} specials = "
                f"{len(pieces) + N_SPECIALS} ids) but tokenizer.json says vocab_size {meta['vocab_size']}"
            )
        try:
            return cls((folder / "spm.model").read_bytes(), pieces, meta["kind"], meta["max_len"])
        except TokenizerError as e:
            raise TokenizerError(f"{folder}: {e}") from None


# ---------------------------------------------------------------------------------------------- helpers


def _read_bytes(path: Path, what: str) -> bytes:
    try:
        return path.read_bytes()
    except FileNotFoundError:
        raise TokenizerError(f"{what} not found: {path}") from None
    except IsADirectoryError:
        raise TokenizerError(f"{what} {path} is a directory, expected a file") from None


def _text_lines(path: Path, what: str, keep_blank: bool = False) -> Iterator[tuple[int, str]]:
    """(line number, line) of a UTF-8 file, split on "\\n" only (str.splitlines would also split on \\x1c,
    U+2028, ... which can be inside pieces)."""
    raw = _read_bytes(path, what)
    lines = raw.split(b"\n")
    if lines and lines[-1] == b"":
        lines.pop()
    for n, b in enumerate(lines, 1):
        try:
            line = b.decode("utf-8")
        except UnicodeDecodeError as e:
            raise TokenizerError(
                f"{path}:{n}: not valid UTF-8 (byte 0x{b[e.start]:02x} at column {e.start + 1})"
            ) from None
        if line or keep_blank:
            yield n, line


def _iter_source(source: Iterable[str] | Sequence[os.PathLike] | os.PathLike) -> Iterator[str]:
    """Texts of a training source: files (PathLike) are streamed through trainer.data, strings are texts."""
    if isinstance(source, os.PathLike):
        source = [source]
    items = list(source) if isinstance(source, (list, tuple)) else None
    if items and all(isinstance(p, os.PathLike) for p in items):
        for path in items:
            for ex in iter_texts(Path(path)):
                yield ex.text if ex.text is not None else detokenize(ex.pieces or [])
        return
    for text in items if items is not None else source:
        if not isinstance(text, str):
            raise TokenizerError(f"training texts must be str (file paths must be pathlib.Path), got {type(text)}")
        yield text


def _reservoir(texts: Iterable[str], k: int, seed: int) -> list[str]:
    """At most k non-blank texts, uniformly sampled in one streaming pass (Algorithm R), seeded; input order kept."""
    if k < 1:
        raise TokenizerError(f"train_lines must be >= 1, got {k}")
    rng = random.Random(seed)
    sample: list[tuple[int, str]] = []
    n = 0
    for text in texts:
        if not text.strip():
            continue
        if len(sample) < k:
            sample.append((n, text))
        else:
            j = rng.randrange(n + 1)
            if j < k:
                sample[j] = (n, text)
        n += 1
    sample.sort()
    return [t for _, t in sample]


def build_tokenizer(cfg: RunConfig) -> Tokenizer:
    """The tokenizer a config asks for: the lab's (kind=lab) or one trained on `data.pretrain` (kind=train).

    .spm inputs are detokenized for training (`detokenize`, equal to the lab's .txt files). The model's embedding
    must match: cfg.model.vocab_size == tokenizer.vocab_size, else ConfigError with both numbers."""
    tc = cfg.tokenizer
    if tc.kind == "lab":
        tok = Tokenizer.from_lab(cfg.data.path(tc.model), cfg.data.path(tc.vocab), tc.max_len)
    else:
        if tc.vocab_size + N_SPECIALS != cfg.model.vocab_size:  # fail before spending time on training
            raise ConfigError(
                f"tokenizer.vocab_size={tc.vocab_size} gives {tc.vocab_size + N_SPECIALS} ids with the 4 specials, "
                f"but model.vocab_size={cfg.model.vocab_size}; set model.vocab_size={tc.vocab_size + N_SPECIALS}"
            )
        paths = [cfg.data.path(p) for p in cfg.data.pretrain]
        tok = Tokenizer.train(paths, tc.vocab_size, tc.max_len, tc.train_lines, cfg.seed)
    if tok.vocab_size != cfg.model.vocab_size:
        raise ConfigError(
            f"the {tc.kind} tokenizer has {tok.vocab_size} ids but model.vocab_size={cfg.model.vocab_size}; "
            f"set model.vocab_size={tok.vocab_size}"
        )
    return tok
