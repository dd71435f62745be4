"""Readers for the files users have: documents for pretraining and the tokenizer, labelled examples for fine-tuning.

Formats, chosen by the file name (a trailing .gz means gzip, any format):
  .txt    one document a line; blank lines skipped. Labeled: labels in a sibling .label file (line i <-> line i).
  .jsonl  one JSON object a line; `text_field` / `label_field` name the keys (IMDB: "text", "label").
  .tsv    tab-separated with a header row (SST-2), CRLF tolerated; `text_field` / `label_field` name the columns.
          When the header lacks `text_field` and has exactly one column besides `label_field`, that column is the
          text (SST-2's train/dev call it "sentence", its test "content").
  .spm    the lab's pre-tokenized sentencepiece pieces, space-separated; labels in the sibling .label file
          (train.review.spm -> train.label).
  .csv    comma-separated with a header row (RFC 4180: fields quoted with ", which may hold commas, newlines and
          doubled quotes ""); `text_field` / `label_field` name the columns as for .tsv. A record's number is the
          line it starts on.
  .parquet  columns `text_field` (a string column) and `label_field`, read one row group at a time (a file is never
          loaded whole; pyarrow, imported only for these files). A record's number is its row in the file, from 1.
          Not gzipped (parquet compresses its own pages).
Every problem raises `DataError` naming the file and line (or row). Lines are split on "\\n" only and decoded one
at a time, so a non-UTF-8 byte is reported with its line number and large files are streamed.

Blocks of raw lines parsed in other processes (trainer/data/prepare.py's workers): trainer/data/blocks.py, on
`_records`.
"""

from __future__ import annotations

import csv
import glob
import gzip
import itertools
import json
import zlib
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

from trainer.data.errors import DataError, name_it

FORMATS = (".txt", ".jsonl", ".tsv", ".spm", ".csv", ".parquet")
LABEL_SUFFIX = ".label"




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
                yield n, _decode_line(path, n, raw)
    except (gzip.BadGzipFile, EOFError, zlib.error) as e:
        raise DataError(f"{path}: corrupt gzip data after line {n}: {e}") from None


def _decode_line(path: Path, n: int, raw: bytes) -> str:
    """Line n of `path` as bytes (with or without its "\\n" / "\\r\\n") -> text."""
    if raw.endswith(b"\n"):
        raw = raw[:-1]
    if raw.endswith(b"\r"):
        raw = raw[:-1]
    if n == 1 and raw.startswith(b"\xef\xbb\xbf"):  # UTF-8 byte-order mark
        raw = raw[3:]
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError as e:
        raise DataError(
            f"{path}:{n}: line {n} is not valid UTF-8 (byte 0x{raw[e.start]:02x} at column {e.start + 1})"
        ) from None


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


def _records(path: Path, text_field: str, label_field: str, labeled: bool,
             lines: Iterator[tuple[int, str]] | None = None) -> Iterator[tuple[int, str, object]]:
    """(line, text or pieces line, raw label or None) for non-blank records of a file; `lines`: parse these
    (numbered) lines of it instead of reading it (a block, after its header: `block_texts`)."""
    from trainer.data import tables  # the table formats (.tsv/.csv/.parquet)

    fmt = file_format(path)
    if fmt == ".parquet":
        yield from tables.parquet_records(path, text_field, label_field, labeled)
        return
    lines = _lines(path) if lines is None else lines
    if fmt == ".csv":
        yield from tables.csv_records(path, lines, text_field, label_field, labeled)
    elif fmt in (".txt", ".spm"):
        for n, line in lines:
            if line.strip():
                yield n, line, None
    elif fmt == ".jsonl":
        yield from _jsonl(path, lines, text_field, label_field, labeled)
    else:  # .tsv
        rows = ((n, line.split("\t")) for n, line in lines if line.strip())
        yield from tables.table(path, rows, text_field, label_field, labeled, "tab-separated")


def _jsonl(path: Path, lines: Iterator[tuple[int, str]], text_field: str, label_field: str,
           labeled: bool) -> Iterator[tuple[int, str, object]]:
    for n, line in lines:
        if not line.strip():
            continue
        try:
            obj = json.loads(line)
        except json.JSONDecodeError as e:
            raise DataError(f"{path}:{n}: malformed JSON at column {e.colno}: {e.msg}") from None
        if not isinstance(obj, dict):
            raise DataError(f"{path}:{n}: expected a JSON object, got {type(obj).__name__}")
        for key, option in ((text_field, "text_field"), (label_field, "label_field"))[:2 if labeled else 1]:
            if key not in obj:
                raise DataError(f"{path}:{n}: no field {key!r} (fields: {sorted(obj)}); {name_it(option)}")
        text = obj[text_field]
        if not isinstance(text, str):
            raise DataError(f"{path}:{n}: field {text_field!r} must be a string, got {type(text).__name__}")
        label = obj[label_field] if labeled else None
        if label is not None and not isinstance(label, str):
            label = json.dumps(label)  # 1 -> "1", true -> "true": compared with the declared label strings
        yield n, text, label


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
    index = {str(lab): i for i, lab in enumerate(labels)}
    out: list[Example] = []
    for n, text, value, where in _labelled(path, text_field, label_field):
        if value not in index:
            raise DataError(f"{where}: unknown label {value!r}; the declared labels (data.labels) are {list(index)}")
        out.append(_example(path, fmt, n, text, index[value]))
    return out


def label_values(path: str | Path, text_field: str = "text", label_field: str = "label") -> list[str]:
    """The distinct label values of a labeled file, sorted: numerically when all are numbers ("2" < "10")."""
    values = {value for _, _, value, _ in _labelled(Path(path), text_field, label_field)}
    try:
        return sorted(values, key=float)
    except ValueError:
        return sorted(values)


def has_labels(path: str | Path, label_field: str = "label") -> bool:
    """Whether a file carries labels: a sibling .label file (.txt/.spm), else `label_field` in its first record."""
    path = Path(path)
    fmt = file_format(path)
    if fmt in (".txt", ".spm"):
        try:
            return _label_path(path) is not None
        except DataError:
            return False
    if fmt == ".parquet":
        from trainer.data.tables import parquet_file

        return label_field in parquet_file(path).schema_arrow.names
    for _, line in _lines(path):
        if not line.strip():
            continue
        if fmt == ".jsonl":
            try:
                obj = json.loads(line)
            except json.JSONDecodeError:
                return True  # malformed: let the labeled reader name the line
            return not isinstance(obj, dict) or label_field in obj
        return label_field in (next(csv.reader([line])) if fmt == ".csv" else line.split("\t"))
    return False


def _labelled(path: Path, text_field: str, label_field: str) -> Iterator[tuple[int, str, str, str]]:
    """(line, text or pieces line, label value stripped, "file:line" of the label) of every example."""
    fmt = file_format(path)
    if not path.is_file():  # before looking for a sibling .label file
        raise DataError(f"{path}: file not found")
    count = 0
    if fmt in (".spm", ".txt"):
        label_path = _label_path(path)
        texts, tags = _lines(path), _lines(label_path)
        for pair in itertools.zip_longest(texts, tags):
            if pair[0] is None or pair[1] is None:  # one file ended first: count the rest of the other
                n_texts = count + (pair[0] is not None) + sum(1 for _ in texts)
                n_tags = count + (pair[1] is not None) + sum(1 for _ in tags)
                raise DataError(
                    f"{label_path} has {n_tags} lines but {path} has {n_texts}: "
                    f"the label file is {'shorter' if n_tags < n_texts else 'longer'} than its text file"
                )
            (n, text), (m, tag) = pair
            if not text.strip():
                raise DataError(f"{path}:{n}: empty document (it pairs with line {m} of {label_path})")
            count += 1
            yield n, text, tag.strip(), f"{label_path}:{m}"
    else:
        for n, text, raw in _records(path, text_field, label_field, labeled=True):
            count += 1
            yield n, text, str(raw).strip(), f"{path}:{n}"
    if not count:
        raise DataError(f"{path}: file is empty (no examples)")


def expand_inputs(patterns: Sequence[str | Path]) -> list[Path]:
    """Paths and globs -> files, in the given order, each glob's matches sorted. A glob matching nothing is an error."""
    out: list[Path] = []
    for p in patterns:
        if glob.has_magic(str(p)):
            hits = sorted(glob.glob(str(p), recursive=True))
            if not hits:
                raise DataError(f"{p}: no file matches this pattern")
            out += [Path(h) for h in hits]
        else:
            out.append(Path(p))
    for p in out:
        file_format(p)  # an unsupported name fails before any work
        if not p.is_file():
            raise DataError(f"{p}: file not found")
    return out
