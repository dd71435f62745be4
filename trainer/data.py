"""Readers for the files users have, a tokenized corpus for pretraining, and length-bucketed batching.

Formats, chosen by the file name (a trailing .gz means gzip, any format):
  .txt    one document a line; blank lines skipped. Labeled: labels in a sibling .label file (line i <-> line i).
  .jsonl  one JSON object a line; `text_field` / `label_field` name the keys (IMDB: "text", "label").
  .tsv    tab-separated with a header row (SST-2), CRLF tolerated; `text_field` / `label_field` name the columns.
          When the header lacks `text_field` and has exactly one column besides `label_field`, that column is the
          text (SST-2's train/dev call it "sentence", its test "content").
  .spm    the lab's pre-tokenized sentencepiece pieces, space-separated; labels in the sibling .label file
          (train.review.spm -> train.label).
Every problem raises `DataError` naming the file and line. Lines are split on "\\n" only and decoded one at a
time, so a non-UTF-8 byte is reported with its line number and large files are streamed.
"""

from __future__ import annotations

import gzip
import itertools
import json
import os
import sys
import tempfile
import zlib
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

if TYPE_CHECKING:
    import torch

    from trainer.tokenizer import Tokenizer

FORMATS = (".txt", ".jsonl", ".tsv", ".spm")
LABEL_SUFFIX = ".label"


class DataError(ValueError):
    """A data file is missing, empty or malformed; the message names the file, the line and what was expected."""


@dataclass
class Example:
    """One document. Exactly one of `text` / `pieces` is set (`pieces` for the lab's .spm files)."""

    text: str | None
    pieces: list[str] | None
    label: int | None  # index into the declared labels; None when unlabeled
    source: str  # "file:line", for error messages and debugging


# ---------------------------------------------------------------------------------------------- lines


def file_format(path: str | Path) -> str:
    """The format of a file from its name: one of FORMATS (a trailing .gz is ignored)."""
    name = Path(path).name
    if name.endswith(".gz"):
        name = name[:-3]
    suffix = Path(name).suffix
    if suffix not in FORMATS:
        raise DataError(
            f"{path}: unsupported file type {suffix or '(none)'!r}; supported: "
            f"{', '.join(FORMATS)} (each may be gzipped: .gz)"
        )
    return suffix


def _lines(path: Path) -> Iterator[tuple[int, str]]:
    """(line number from 1, line without its "\\n" or "\\r\\n"), streamed; gzip if the name ends in .gz."""
    if not path.exists():
        raise DataError(f"{path}: file not found")
    if not path.is_file():
        raise DataError(f"{path}: not a file")
    opener = gzip.open if path.name.endswith(".gz") else open
    n = 0
    try:
        with opener(path, "rb") as f:
            for n, raw in enumerate(f, 1):  # binary iteration splits on b"\n" only
                if raw.endswith(b"\n"):
                    raw = raw[:-1]
                if raw.endswith(b"\r"):
                    raw = raw[:-1]
                if n == 1 and raw.startswith(b"\xef\xbb\xbf"):  # UTF-8 byte-order mark
                    raw = raw[3:]
                try:
                    line = raw.decode("utf-8")
                except UnicodeDecodeError as e:
                    raise DataError(
                        f"{path}:{n}: line {n} is not valid UTF-8 (byte 0x{raw[e.start]:02x} at column {e.start + 1})"
                    ) from None
                yield n, line
    except (gzip.BadGzipFile, EOFError, zlib.error) as e:
        raise DataError(f"{path}: corrupt gzip data after line {n}: {e}") from None


def _label_path(path: Path) -> Path:
    """The .label file beside a .spm/.txt file: train.review.spm -> train.label (else train.review.label)."""
    name = path.name[:-3] if path.name.endswith(".gz") else path.name
    stem = name[: -len(Path(name).suffix)]
    candidates = [stem.split(".")[0] + LABEL_SUFFIX, stem + LABEL_SUFFIX]
    candidates += [c + ".gz" for c in candidates]
    for c in dict.fromkeys(candidates):
        if (path.parent / c).is_file():
            return path.parent / c
    raise DataError(f"{path}: no label file beside it (looked for {', '.join(dict.fromkeys(candidates))})")


# ---------------------------------------------------------------------------------------------- records


def _records(path: Path, text_field: str, label_field: str, labeled: bool) -> Iterator[tuple[int, str, object]]:
    """(line, text or pieces line, raw label or None) for non-blank records of a .txt/.spm/.jsonl/.tsv file."""
    fmt = file_format(path)
    lines = _lines(path)
    if fmt in (".txt", ".spm"):
        for n, line in lines:
            if line.strip():
                yield n, line, None
    elif fmt == ".jsonl":
        for n, line in lines:
            if not line.strip():
                continue
            try:
                obj = json.loads(line)
            except json.JSONDecodeError as e:
                raise DataError(f"{path}:{n}: malformed JSON at column {e.colno}: {e.msg}") from None
            if not isinstance(obj, dict):
                raise DataError(f"{path}:{n}: expected a JSON object, got {type(obj).__name__}")
            for key in (text_field, label_field) if labeled else (text_field,):
                if key not in obj:
                    raise DataError(f"{path}:{n}: no field {key!r} (fields: {sorted(obj)})")
            text = obj[text_field]
            if not isinstance(text, str):
                raise DataError(f"{path}:{n}: field {text_field!r} must be a string, got {type(text).__name__}")
            label = obj[label_field] if labeled else None
            if label is not None and not isinstance(label, str):
                label = json.dumps(label)  # 1 -> "1", true -> "true": compared with the declared label strings
            yield n, text, label
    else:  # .tsv
        header = next(lines, None)
        if header is None:
            raise DataError(f"{path}: file is empty (expected a header row)")
        columns = header[1].split("\t")
        text_col = _text_column(path, columns, text_field, label_field)
        label_col = None
        if labeled:
            if label_field not in columns:
                raise DataError(f"{path}:1: no column {label_field!r} in the header {columns}")
            label_col = columns.index(label_field)
        for n, line in lines:
            if not line.strip():
                continue
            fields = line.split("\t")
            if len(fields) != len(columns):
                raise DataError(f"{path}:{n}: {len(fields)} tab-separated fields, the header has {len(columns)}")
            yield n, fields[text_col], (fields[label_col] if label_col is not None else None)


def _text_column(path: Path, columns: list[str], text_field: str, label_field: str) -> int:
    if text_field in columns:
        return columns.index(text_field)
    others = [i for i, c in enumerate(columns) if c != label_field]
    if len(others) == 1 and label_field in columns:
        return others[0]
    raise DataError(f"{path}:1: no column {text_field!r} in the header {columns} (set data.text_field)")


def _example(path: Path, fmt: str, n: int, text: str, label: int | None) -> Example:
    if fmt == ".spm":
        return Example(None, [p for p in text.split(" ") if p], label, f"{path}:{n}")
    return Example(text, None, label, f"{path}:{n}")


def detokenize(pieces: Sequence[str]) -> str:
    """Pieces of a .spm line -> text, without the sentencepiece model: join, "▁" -> space, strip.

    For the lab's files this gives the .txt sibling byte for byte (all 4,000 cls-books-fr reviews)."""
    return "".join(pieces).replace("\u2581", " ").strip()


# ---------------------------------------------------------------------------------------------- readers


def iter_texts(path: str | Path, text_field: str = "text", label_field: str = "label") -> Iterator[Example]:
    """Stream the documents of an unlabeled corpus (any format; labels ignored). Never loads the whole file."""
    path = Path(path)
    fmt = file_format(path)
    count = 0
    for n, text, _ in _records(path, text_field, label_field, labeled=False):
        if not text.strip():  # a blank .jsonl/.tsv text is no document either
            continue
        count += 1
        yield _example(path, fmt, n, text, None)
    if count == 0:
        raise DataError(f"{path}: file is empty (no non-blank lines)")


def read_labeled(
    path: str | Path, labels: Sequence[str], text_field: str = "text", label_field: str = "label"
) -> list[Example]:
    """All examples of a labeled file; each label must be one of `labels` (its index becomes `Example.label`)."""
    path = Path(path)
    fmt = file_format(path)
    if not path.is_file():  # before looking for a sibling .label file
        raise DataError(f"{path}: file not found")
    index = {str(lab): i for i, lab in enumerate(labels)}

    def label_id(raw: object, where: str) -> int:
        value = str(raw).strip()
        if value not in index:
            raise DataError(f"{where}: unknown label {value!r}; the declared labels (data.labels) are {list(index)}")
        return index[value]

    out: list[Example] = []
    if fmt in (".spm", ".txt"):
        label_path = _label_path(path)
        texts, tags = _lines(path), _lines(label_path)
        for pair in itertools.zip_longest(texts, tags):
            if pair[0] is None or pair[1] is None:  # one file ended first: count the rest of the other
                n_texts = len(out) + (pair[0] is not None) + sum(1 for _ in texts)
                n_tags = len(out) + (pair[1] is not None) + sum(1 for _ in tags)
                raise DataError(
                    f"{label_path} has {n_tags} lines but {path} has {n_texts}: "
                    f"the label file is {'shorter' if n_tags < n_texts else 'longer'} than its text file"
                )
            (n, text), (m, tag) = pair
            if not text.strip():
                raise DataError(f"{path}:{n}: empty document (it pairs with line {m} of {label_path})")
            out.append(_example(path, fmt, n, text, label_id(tag, f"{label_path}:{m}")))
    else:
        for n, text, raw in _records(path, text_field, label_field, labeled=True):
            out.append(_example(path, fmt, n, text, label_id(raw, f"{path}:{n}")))
    if not out:
        raise DataError(f"{path}: file is empty (no examples)")
    return out


# ---------------------------------------------------------------------------------------------- corpus


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
        fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".npz", dir=path.parent)
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


# ---------------------------------------------------------------------------------------------- batching


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


def pad_batch(seqs: Sequence[Sequence[int]], pad_id: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
    """Right-pad id sequences: (input_ids (B, T) int64, padding_mask (B, T) bool, True at <pad>)."""
    import torch  # here, so the readers (and tokenizer training through them) work without torch

    if not seqs:
        raise ValueError("pad_batch needs at least one sequence")
    lens = np.fromiter((len(s) for s in seqs), dtype=np.int64, count=len(seqs))
    ids = np.full((len(seqs), int(lens.max())), pad_id, dtype=np.int64)  # (B, T)
    for row, s in zip(ids, seqs, strict=True):
        row[: len(s)] = s
    mask = np.arange(ids.shape[1])[None, :] >= lens[:, None]  # (B, T) True past each sequence's end
    return torch.from_numpy(ids), torch.from_numpy(mask)
