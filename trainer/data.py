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

Blocks: `block_texts` parses raw whole lines of a file that one reader cut (trainer/blocks.py) and another process
received (trainer/prepare.py's workers); `parquet_texts` reads one row group (`parquet_row_groups` lists them).
"""

from __future__ import annotations

import csv
import glob
import gzip
import itertools
import json
import zlib
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

FORMATS = (".txt", ".jsonl", ".tsv", ".spm", ".csv", ".parquet")
LABEL_SUFFIX = ".label"
CSV_FIELD_CHARS = 1 << 28  # csv's default limit (131,072 characters) is shorter than one long document
PARQUET_BATCH_ROWS = 4096  # rows decoded at a time inside a row group


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
    fmt = file_format(path)
    if fmt == ".parquet":
        yield from _parquet_records(path, text_field, label_field, labeled)
        return
    lines = _lines(path) if lines is None else lines
    if fmt == ".csv":
        yield from _csv_records(path, lines, text_field, label_field, labeled)
    elif fmt in (".txt", ".spm"):
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


# ---------------------------------------------------------------------------------------------- csv, parquet


def _csv_records(path: Path, lines: Iterator[tuple[int, str]], text_field: str, label_field: str,
                 labeled: bool) -> Iterator[tuple[int, str, object]]:
    """(line a record starts on, text, raw label or None) of a .csv file's numbered lines, header first."""
    csv.field_size_limit(max(csv.field_size_limit(), CSV_FIELD_CHARS))
    pulled: list[int] = []  # numbers of the lines the reader took for the record it is reading

    def feed() -> Iterator[str]:
        for n, line in lines:
            pulled.append(n)
            yield line + "\n"  # a quoted field's newlines come back as "\n" (CRLF inside a field too)

    reader = csv.reader(feed(), strict=True)  # strict: a stray quote is an error, not a silently merged field
    rows = 0
    columns: list[str] | None = None
    text_col = label_col = 0
    while True:
        try:
            row = next(reader)
        except StopIteration:
            break
        except csv.Error as e:
            start = pulled[0] if pulled else 1
            raise DataError(f"{path}:{start}: malformed CSV record starting on line {start}: {e}") from None
        start = pulled[0]
        pulled.clear()
        if columns is None:
            columns = row
            text_col = _text_column(path, columns, text_field, label_field)
            if labeled:
                if label_field not in columns:
                    raise DataError(f"{path}:1: no column {label_field!r} in the header {columns}")
                label_col = columns.index(label_field)
            continue
        rows += 1
        if not row or row == [""]:  # a blank line
            continue
        if len(row) != len(columns):
            raise DataError(f"{path}:{start}: row {rows} (line {start}) has {len(row)} comma-separated fields, the "
                            f"header has {len(columns)} (a field holding a comma must be quoted)")
        yield start, row[text_col], (row[label_col] if labeled else None)
    if columns is None:
        raise DataError(f"{path}: file is empty (expected a header row)")


def _parquet_file(path: Path) -> Any:
    if not path.is_file():
        raise DataError(f"{path}: file not found")
    if path.name.endswith(".gz"):
        raise DataError(f"{path}: a parquet file is not read gzipped (parquet compresses its own pages); gunzip it")
    try:
        import pyarrow.parquet as pq
    except ImportError:
        raise DataError(f"{path}: reading .parquet needs pyarrow (pip install pyarrow)") from None
    try:
        return pq.ParquetFile(path)
    except Exception as e:  # pyarrow.ArrowInvalid, OSError: not a parquet file, truncated footer
        raise DataError(f"{path}: not a readable parquet file ({type(e).__name__}: {e})") from None


def parquet_row_groups(path: str | Path) -> list[int]:
    """Rows in each row group of a .parquet file (from its footer; no data is read)."""
    meta = _parquet_file(Path(path)).metadata
    return [meta.row_group(i).num_rows for i in range(meta.num_row_groups)]


def _parquet_records(path: Path, text_field: str, label_field: str, labeled: bool,
                     row_groups: Sequence[int] | None = None) -> Iterator[tuple[int, str, object]]:
    """(row in the file from 1, text, raw label or None) of a .parquet file, one row group at a time, `row_groups`
    only when given. A null or non-string text, or a null label, is an error naming the row."""
    import pyarrow as pa

    pf = _parquet_file(path)
    schema = pf.schema_arrow
    wanted = [text_field, label_field] if labeled else [text_field]
    for name in wanted:
        if name not in schema.names:
            raise DataError(f"{path}: no column {name!r} (columns: {schema.names}; set data.text_field / "
                            "data.label_field)")
    kind = schema.field(text_field).type
    if pa.types.is_dictionary(kind):
        kind = kind.value_type
    if not (pa.types.is_string(kind) or pa.types.is_large_string(kind) or pa.types.is_string_view(kind)):
        raise DataError(f"{path}: column {text_field!r} holds {kind}, expected strings")
    sizes = [pf.metadata.row_group(i).num_rows for i in range(pf.metadata.num_row_groups)]
    starts = list(itertools.accumulate([0, *sizes]))  # (G + 1,) first row of each group, 0-based
    for g in range(len(sizes)) if row_groups is None else row_groups:
        row = starts[g]
        for batch in pf.iter_batches(batch_size=PARQUET_BATCH_ROWS, row_groups=[g], columns=wanted):
            texts = batch.column(0).to_pylist()
            labels = batch.column(1).to_pylist() if labeled else [None] * len(texts)
            for text, label in zip(texts, labels, strict=True):
                row += 1
                if text is None:
                    raise DataError(f"{path}:{row}: row {row} (row group {g}): column {text_field!r} is null")
                if labeled and label is None:
                    raise DataError(f"{path}:{row}: row {row} (row group {g}): column {label_field!r} is null")
                if label is not None and not isinstance(label, str):
                    label = json.dumps(label)  # 1 -> "1", true -> "true": compared with the declared label strings
                yield row, text, label


# ---------------------------------------------------------------------------------------------- blocks


def block_texts(path: str | Path, first_line: int, data: bytes, header: bytes | None = None,
                text_field: str = "text", label_field: str = "label", after_line: int = 0) -> Iterator[Example]:
    """The documents (as `iter_texts` gives them) of raw whole lines of `path` that start at line `first_line`,
    past line `after_line`; `header`: the file's header record, raw (.tsv, .csv). trainer/blocks.py cuts them."""
    path = Path(path)
    fmt = file_format(path)
    lines: Iterable[tuple[int, str]] = _split_lines(path, data, first_line)
    if header is not None:
        lines = itertools.chain(_split_lines(path, header, 1), lines)
    for n, text, _ in _records(path, text_field, label_field, labeled=False, lines=iter(lines)):
        if n > after_line and text.strip():
            yield _example(path, fmt, n, text, None)


def parquet_texts(path: str | Path, row_group: int, text_field: str = "text",
                  after_row: int = 0) -> Iterator[Example]:
    """The documents of one row group of a .parquet file, past row `after_row`."""
    path = Path(path)
    for n, text, _ in _parquet_records(path, text_field, "label", labeled=False, row_groups=[row_group]):
        if n > after_row and text.strip():
            yield Example(text, None, None, f"{path}:{n}")


def _split_lines(path: Path, data: bytes, first: int) -> Iterator[tuple[int, str]]:
    """(number, decoded line) of raw whole lines starting at line `first` (split on "\\n" only, as `_lines`)."""
    if not data:
        return
    parts = data.split(b"\n")
    if data.endswith(b"\n"):
        parts.pop()
    for n, raw in enumerate(parts, first):
        yield n, _decode_line(path, n, raw)
