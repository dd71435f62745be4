"""Token ids, the tokenizer folder and TokenEncoder (text -> ids): the one definition the trainer and the server run.

Ids: <sos>=0 <pad>=1 <eos>=2 <oov>=3, then the piece on line i (0-based) of vocab.txt has id i + 4. A sequence is
[<sos>] + piece ids + [<eos>], cut to max_len ids in total (pieces cut to max_len - 2, <eos> kept). Pieces come from
the folder's sentencepiece model; a piece that is not in vocab.txt (sentencepiece's <unk> surface strings included)
is <oov>.

A tokenizer folder holds spm.model (the sentencepiece model proto), vocab.txt (one piece a line, "\\n"-separated,
UTF-8) and meta.json (format, kind, vocab_size = pieces + 4, specials). It holds no cut: max_len belongs to whoever
cuts (`check_max_len`). meta.json was called tokenizer.json before: the name of the Hugging Face tokenizers format,
which it is not (`tokenizers` cannot parse it); a folder written then is still read (`meta_path`), a bundle must be
exported again. An earlier version's meta.json also holds max_len, the copy of its artifact's config.json: no reader
takes it.
"""

from __future__ import annotations

import copy
import functools
import itertools
import json
import numbers
import os
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

import numpy as np
import sentencepiece as spm

from contract.errors import TokenizerError

SOS, PAD, EOS, OOV = 0, 1, 2, 3
SPECIALS = {"sos": SOS, "pad": PAD, "eos": EOS, "oov": OOV}
SPECIAL_PIECES = ("<sos>", "<pad>", "<eos>", "<oov>")  # how ids 0..3 are shown
N_SPECIALS = 4

TOKENIZER_FORMAT = 1  # meta.json "format"
TOKENIZER_META = "meta.json"
LEGACY_TOKENIZER_META = "tokenizer.json"  # meta.json's name in folders written before the rename
TOKENIZER_FILES = ("spm.model", "vocab.txt", TOKENIZER_META)
Kind = Literal["lab", "train"]  # the lab's model + dict.txt, or a model trained on the user's corpus


def meta_path(folder: Path) -> Path:
    """A tokenizer folder's meta file: meta.json, or tokenizer.json in a folder written before the rename."""
    legacy = folder / LEGACY_TOKENIZER_META
    if not (folder / TOKENIZER_META).exists() and legacy.is_file():
        return legacy
    return folder / TOKENIZER_META


# max_len: the longest id sequence, <sos> and <eos> included. Stored once per folder: an artifact's config.json
# (tokenizer.max_len, the run's setting) and a bundle's manifest.json (max_len; each graph's metadata_props repeat it
# for other ONNX tools, checked equal). Called max_len in configs, files and CLIs (`export --max-len`), and max_tokens
# on the wire (sentiment.v1 GetModelMetadataResponse.max_tokens: a published proto field, not renamed).
MIN_MAX_LEN = 3  # <sos>, one piece, <eos>


def check_max_len(value: object, what: str = "max_len", error: type[ValueError] = TokenizerError) -> int:
    """`value` if it is a max_len (an int >= MIN_MAX_LEN); else `error` saying so, `what` naming where it was read."""
    if not isinstance(value, numbers.Integral) or isinstance(value, bool) or value < MIN_MAX_LEN:
        raise error(f"{what} must be an int >= {MIN_MAX_LEN} (<sos>, one piece, <eos>), got {value!r}")
    return int(value)


def piece_id(line: int) -> int:
    """The id of the piece on 0-based line `line` of vocab.txt."""
    return line + N_SPECIALS


@dataclass(frozen=True)
class Encoded:
    """One encoded text."""

    ids: np.ndarray  # (n,) int64, <sos> ... <eos>, 3 <= n <= max_len (2 for a text with no pieces)
    truncated: bool  # True when pieces were cut to fit max_len

    @property
    def token_count(self) -> int:
        return int(self.ids.shape[0])


def text_lines(raw: bytes, path: Path | str, keep_blank: bool = False) -> Iterator[tuple[int, str]]:
    """(line number from 1, line) of UTF-8 bytes, split on "\\n" only: str.splitlines would also split on \\x1c,
    U+2028, ... which can be inside pieces. A line that is not UTF-8 is an error naming it."""
    try:  # one decode for the whole file: the byte 0x0a is never inside a UTF-8 sequence, so its lines are the same
        lines = raw.decode("utf-8").split("\n")
    except UnicodeDecodeError as e:
        line, start = raw.count(b"\n", 0, e.start) + 1, raw.rfind(b"\n", 0, e.start) + 1  # the bad line, its 1st byte
        raise TokenizerError(f"{path}:{line}: not valid UTF-8 (byte 0x{raw[e.start]:02x} at column "
                             f"{e.start - start + 1})") from None
    if lines and lines[-1] == "":
        lines.pop()
    for n, line in enumerate(lines, 1):
        if line or keep_blank:
            yield n, line


@dataclass(frozen=True)
class TokenizerMeta:
    """meta.json."""

    kind: Kind
    vocab_size: int  # pieces in vocab.txt + N_SPECIALS

    def to_json(self) -> str:
        meta = {"format": TOKENIZER_FORMAT, "kind": self.kind, "vocab_size": self.vocab_size,
                "specials": dict(SPECIALS)}
        return json.dumps(meta, indent=2) + "\n"

    @classmethod
    def parse(cls, raw: bytes, path: Path) -> TokenizerMeta:
        try:
            meta = json.loads(raw.decode("utf-8"))
        except (json.JSONDecodeError, UnicodeDecodeError, RecursionError) as e:
            raise TokenizerError(f"{path}: invalid JSON: {e}") from None
        if not isinstance(meta, dict):
            raise TokenizerError(f"{path}: expected a JSON object, got {type(meta).__name__}")
        for key, want in (("format", int), ("kind", str), ("vocab_size", int), ("specials", dict)):
            if not isinstance(meta.get(key), want) or isinstance(meta.get(key), bool):
                raise TokenizerError(f"{path}: field {key!r} must be {want.__name__}, got {meta.get(key)!r}")
        if meta["format"] != TOKENIZER_FORMAT:
            raise TokenizerError(f"{path}: format {meta['format']} is not supported (this code reads "
                                 f"{TOKENIZER_FORMAT})")
        if meta["specials"] != SPECIALS:
            raise TokenizerError(f"{path}: specials {meta['specials']} differ from {SPECIALS}")
        if meta["kind"] not in ("lab", "train"):
            raise TokenizerError(f"{path}: tokenizer kind must be 'lab' or 'train', got {meta['kind']!r}")
        return cls(meta["kind"], meta["vocab_size"])


@dataclass(frozen=True)
class TokenizerFiles:
    """A tokenizer folder's contents, checked against each other."""

    meta: TokenizerMeta
    pieces: list[str]  # vocab.txt: pieces[i] has id piece_id(i)
    model_proto: bytes  # spm.model


def read_tokenizer_files(files: Mapping[str, bytes], folder: Path) -> TokenizerFiles:
    """Check the three files' bytes against meta.json (a bundle passes the bytes whose checksums it verified, so
    nothing changes between the check and the use); `folder` names them in errors."""
    meta = TokenizerMeta.parse(files[TOKENIZER_META], folder / TOKENIZER_META)
    vocab = files["vocab.txt"]
    # Count before decoding: a vocabulary far larger than its meta.json says is refused without building it.
    n_lines = vocab.count(b"\n") + (not vocab.endswith(b"\n") and bool(vocab))
    if n_lines + N_SPECIALS != meta.vocab_size:
        raise TokenizerError(f"{folder}: vocab.txt has {n_lines} pieces (+{N_SPECIALS} specials = "
                             f"{n_lines + N_SPECIALS} ids) but {TOKENIZER_META} says vocab_size {meta.vocab_size}")
    pieces = [line for _, line in text_lines(vocab, folder / "vocab.txt", keep_blank=True)]
    return TokenizerFiles(meta, pieces, files["spm.model"])


@functools.lru_cache(maxsize=4)
def _encoder(model_proto: bytes, pieces: tuple[str, ...]) -> TokenEncoder:
    """The encoder of these files (every user takes a copy cutting at its own max_len)."""
    return TokenEncoder(model_proto, pieces, MIN_MAX_LEN)


def _threads() -> int:
    """Threads for sentencepiece batch encoding (its output does not depend on it)."""
    try:
        n = len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        n = os.cpu_count() or 1
    return max(1, min(n, 8))


class TokenEncoder:
    """Text -> [<sos>] + piece ids + [<eos>], cut to `max_len`, for one sentencepiece model and one vocabulary."""

    def __init__(self, model_proto: bytes, pieces: Sequence[str], max_len: int) -> None:
        """`pieces[i]` gets id piece_id(i)."""
        self.max_len = check_max_len(max_len)
        if not pieces:
            raise TokenizerError("the vocabulary is empty")
        self.processor = spm.SentencePieceProcessor()
        try:
            self.processor.LoadFromSerializedProto(model_proto)
        except (RuntimeError, OSError) as e:  # sentencepiece's errors on a corrupt proto
            raise TokenizerError(f"not a sentencepiece model: {e}") from None
        self.pieces = list(pieces)
        self.vocab_size = len(self.pieces) + N_SPECIALS
        self.piece_to_id: dict[str, int] = {}  # the rule itself; the table below is its fast form
        for line, p in enumerate(self.pieces):
            if p in self.piece_to_id:
                raise TokenizerError(f"vocabulary line {line + 1}: piece {p!r} repeats line "
                                     f"{self.piece_to_id[p] - N_SPECIALS + 1}")
            self.piece_to_id[p] = piece_id(line)
        # Text goes spm id -> our id in one numpy gather. The rule maps the *surface* piece, and spm's <unk> covers
        # characters the model lacks, so no model piece can equal an <unk>'s surface: <unk> -> <oov>. Only a
        # vocabulary with pieces the model does not have (a foreign dict) needs the surface lookup, so there <unk>
        # maps to -1 and those positions are resolved one by one in `piece_ids`.
        sp = self.processor
        unk = sp.unk_id()
        foreign = any(sp.piece_to_id(p) == unk for p in self.pieces)
        self.spm_to_id = np.full(sp.get_piece_size(), -1 if foreign else OOV, dtype=np.int64)  # (n_spm,)
        for s in range(sp.get_piece_size()):
            if not (sp.is_unknown(s) or sp.is_control(s)):
                self.spm_to_id[s] = self.piece_to_id.get(sp.id_to_piece(s), OOV)

    def __repr__(self) -> str:
        return f"TokenEncoder(vocab_size={self.vocab_size}, max_len={self.max_len})"

    @classmethod
    def from_files(cls, files: TokenizerFiles, max_len: int) -> TokenEncoder:
        """The encoder of a checked folder, cutting at `max_len` (a bundle's: its manifest's). The tables of the last
        few tokenizers are kept: the versions of a fine-tuned model share their pretraining's, and building them (a
        Python loop over every piece, under the interpreter lock) slows the calls a server answers while loading."""
        return _encoder(files.model_proto, tuple(files.pieces)).with_max_len(max_len)

    def piece_ids(self, texts: Sequence[str], threads: int | None = None) -> tuple[np.ndarray, np.ndarray]:
        """Piece ids of many texts, no specials and no cut: (flat ids int64 (N,), lengths int64 (len(texts),)).
        One sentencepiece call on `threads` threads (default: the cores, at most 8), then the gather."""
        if len(texts) == 1:  # the server's case: a thread pool per call would cost more than the text
            spm_ids = [self.processor.encode(texts[0])]
        else:
            spm_ids = self.processor.encode(list(texts), num_threads=threads or _threads())  # lists of spm ids
        lengths = np.fromiter((len(x) for x in spm_ids), dtype=np.int64, count=len(spm_ids))
        flat = np.fromiter(itertools.chain.from_iterable(spm_ids), dtype=np.int64, count=int(lengths.sum()))
        ids = self.spm_to_id[flat]
        holes = np.flatnonzero(ids < 0)  # <unk> with a foreign vocabulary: look the surface piece up in vocab.txt
        if holes.size:
            starts = np.concatenate([[0], np.cumsum(lengths)[:-1]])
            docs = np.searchsorted(starts, holes, side="right") - 1
            for d in np.unique(docs):
                surface = self.processor.encode(texts[d], out_type=str)
                for h in holes[docs == d]:
                    ids[h] = self.piece_to_id.get(surface[h - starts[d]], OOV)
        return ids, lengths

    def with_max_len(self, max_len: int) -> TokenEncoder:
        """This vocabulary cutting at `max_len` instead (sharing the sentencepiece model and the tables)."""
        other = copy.copy(self)
        other.max_len = check_max_len(max_len)
        return other

    def wrap(self, ids: np.ndarray) -> Encoded:
        """Piece ids (int64 (n,), no specials) -> [<sos>] + ids + [<eos>], the ids cut to max_len - 2: the one place
        the cut is made."""
        keep = min(len(ids), self.max_len - 2)
        row = np.empty(keep + 2, dtype=np.int64)  # (t,) <sos> ids <eos>
        row[0], row[-1] = SOS, EOS
        row[1:-1] = ids[:keep]
        return Encoded(row, truncated=len(ids) > keep)

    def encode(self, text: str) -> Encoded:
        """One text -> [<sos>] + ids + [<eos>], at most `max_len` ids."""
        return self.wrap(self.piece_ids([text])[0])

    def encode_many(self, texts: Sequence[str], threads: int | None = 1) -> list[Encoded]:
        """`encode` of each text, in one sentencepiece call and one gather. One thread by default: the server's
        request path, where every moment the interpreter lock is held is one that gRPC's polling thread waits for;
        threads=None: the cores, at most 8 (a batch of a data set)."""
        if len(texts) <= 1:
            return [self.encode(t) for t in texts]
        ids, lengths = self.piece_ids(texts, threads=threads)
        ends = np.cumsum(lengths).tolist()
        return [self.wrap(ids[end - n:end]) for n, end in zip(lengths.tolist(), ends, strict=True)]

