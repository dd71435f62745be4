"""Readers for the files users have: documents for pretraining and the tokenizer, labelled examples for fine-tuning.

Formats, chosen by the file name (a trailing .gz means gzip, any format):
  .txt    one document a line; blank lines skipped. Labeled: labels in a sibling .label file (line i <-> line i).
  .jsonl  one JSON object a line; `text_field` / `label_field` name the keys (IMDB: "text", "label").
  .tsv    tab-separated with a header row (SST-2), CRLF tolerated; `text_field` / `label_field` name the columns.
          Quoted as Python's csv module and pandas write it (a field that starts with " ends at the next lone ",
          may hold tabs and newlines, and "" inside is one "), so a .tsv and a .csv of the same table read the same.
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

Blank texts (empty or whitespace only) are one rule everywhere: a labelled reader skips them and lists where
(`read_labeled(..., skipped=)`, which training and `export --check` report), `read_rows` keeps them (so that
`predict` writes a row for every input row), and an unlabelled corpus has no blank documents (`iter_texts`).
`STDIN` ("-") reads standard input in a format given by name (`stdin_lines`).

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
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import IO, BinaryIO

from trainer.data.errors import DataError, name_it

FORMATS = (".txt", ".jsonl", ".tsv", ".spm", ".csv", ".parquet")
LABEL_SUFFIX = ".label"
STDIN = "-"  # a file name that means standard input (predict --data -)
SHOWN_LINES = 8  # lines listed in an error that names many


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
             lines: Iterator[tuple[int, str]] | None = None, fmt: str | None = None,
             blank_lines: bool = False) -> Iterator[tuple[int, str, object]]:
    """(line, text or pieces line, raw label or None) of every record of a file (a record's text may be blank); a
    .txt/.spm blank line is a record only with `blank_lines`. `lines`: parse these (numbered) lines instead of
    reading the file (a block after its header: `block_texts`; standard input), in format `fmt`."""
    from trainer.data import tables  # the table formats (.tsv/.csv/.parquet)

    fmt = fmt or file_format(path)
    if fmt == ".parquet":
        yield from tables.parquet_records(path, text_field, label_field, labeled)
        return
    lines = _lines(path) if lines is None else lines
    if fmt in (".csv", ".tsv"):
        yield from tables.csv_records(path, lines, text_field, label_field, labeled, fmt)
    elif fmt in (".txt", ".spm"):
        for n, line in lines:
            if blank_lines or line.strip():
                yield n, line, None
    else:  # .jsonl
        yield from jsonl_records(path, lines, text_field, label_field, labeled)


def jsonl_records(path: Path, lines: Iterable[tuple[int, str]], text_field: str, label_field: str,
                  labeled: bool, fields_are_the_users: bool = True) -> Iterator[tuple[int, str, object]]:
    """(line, text, label as its JSON text: 1 -> "1", true -> "true") of every non-blank line of a .jsonl file;
    DataError names the line of a row that is not an object holding a string text (and a label). A missing field's
    message tells the user how to name theirs, unless the fields are a pinned source's (trainer/data/convert.py)."""
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
                hint = f"; {name_it(option)}" if fields_are_the_users else ""
                raise DataError(f"{path}:{n}: no field {key!r} (fields: {sorted(obj)}){hint}")
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


def is_blank(ex: Example) -> bool:
    """An example with no text: empty or whitespace only (a .spm line without pieces)."""
    return not (ex.text.strip() if ex.text is not None else ex.pieces)


def read_labeled(path: str | Path, labels: Sequence[str], text_field: str = "text", label_field: str = "label",
                 skipped: list[str] | None = None, lines: Iterable[tuple[int, str]] | None = None,
                 fmt: str | None = None) -> list[Example]:
    """All examples of a labeled file; each label must be one of `labels` (its index becomes `Example.label`). A
    blank text is no example: it is skipped, and its "file:line" appended to `skipped` when given. `lines`, `fmt`:
    parse these numbered lines (standard input: `stdin_lines`) in that format instead of reading `path`."""
    path = Path(path)
    fmt = fmt or file_format(path)
    index = {str(lab): i for i, lab in enumerate(labels)}
    out: list[Example] = []
    blank = 0
    for n, text, value, where in _labelled(path, text_field, label_field, lines, fmt):
        if not text.strip():
            blank += 1
            if skipped is not None:
                skipped.append(f"{path}:{n}")
            continue
        if value not in index:
            raise DataError(f"{where}: unknown label {value!r}; the declared labels (data.labels) are {list(index)}")
        out.append(_example(path, fmt, n, text, index[value]))
    if not out:
        raise DataError(f"{path}: no examples: the text of each of its {blank} records is blank")
    return out


def read_rows(path: str | Path, labels: Sequence[str] | None, text_field: str = "text", label_field: str = "label",
              lines: Iterable[tuple[int, str]] | None = None, fmt: str | None = None) -> list[Example]:
    """Every input row of a file, in order, blank texts included (`is_blank`; their label is None): what `predict`
    answers row by row. A .txt/.spm line is a row, blank or not. `labels`: each other row's label must be one of
    them (its index becomes `Example.label`); None: labels are not read."""
    path = Path(path)
    fmt = fmt or file_format(path)
    if labels is None:
        return [_example(path, fmt, n, text, None) for n, text, _ in
                _records(path, text_field, label_field, False, None if lines is None else iter(lines), fmt, True)]
    index = {str(lab): i for i, lab in enumerate(labels)}
    out = []
    for n, text, value, where in _labelled(path, text_field, label_field, lines, fmt):
        if text.strip() and value not in index:
            raise DataError(f"{where}: unknown label {value!r}; the model's label values are {list(index)}")
        out.append(_example(path, fmt, n, text, index[value] if text.strip() else None))
    return out


@dataclass(frozen=True)
class Occurrences:
    """Where one label value occurs in a labelled file."""

    count: int
    where: list[str]  # "file:line" of its first SHOWN_LINES examples


def label_occurrences(path: str | Path, text_field: str = "text",
                      label_field: str = "label") -> dict[str, Occurrences]:
    """Each distinct label value of a labelled file's examples (blank texts skipped), in sorted order (`sort_values`),
    with its count and first lines."""
    counts: dict[str, int] = {}
    where: dict[str, list[str]] = {}
    for _, text, value, at in _labelled(Path(path), text_field, label_field):
        if not text.strip():
            continue
        counts[value] = counts.get(value, 0) + 1
        if len(seen := where.setdefault(value, [])) < SHOWN_LINES:
            seen.append(at)
    return {v: Occurrences(counts[v], where[v]) for v in sort_values(counts)}


def label_values(path: str | Path, text_field: str = "text", label_field: str = "label") -> list[str]:
    """The distinct label values of a labeled file, sorted (`sort_values`)."""
    return list(label_occurrences(path, text_field, label_field))


def sort_values(values: Iterable[str]) -> list[str]:
    """Label values sorted: numerically when all are numbers ("2" < "10"), else as strings."""
    try:
        return sorted(values, key=float)
    except ValueError:
        return sorted(values)


def has_labels(path: str | Path, label_field: str = "label", lines: Iterable[tuple[int, str]] | None = None,
               fmt: str | None = None) -> bool:
    """Whether a file carries labels: a sibling .label file (.txt/.spm), else `label_field` in its first record."""
    path = Path(path)
    fmt = fmt or file_format(path)
    if fmt in (".txt", ".spm"):
        if lines is not None:
            return False  # standard input: one text a line, no sibling file
        try:
            return _label_path(path) is not None
        except DataError:
            return False
    if fmt == ".parquet":
        from trainer.data.tables import parquet_file

        return label_field in parquet_file(path).schema_arrow.names
    for _, line in _lines(path) if lines is None else lines:
        if not line.strip():
            continue
        if fmt == ".jsonl":
            try:
                obj = json.loads(line)
            except json.JSONDecodeError:
                return True  # malformed: let the labeled reader name the line
            return not isinstance(obj, dict) or label_field in obj
        return label_field in next(csv.reader([line], delimiter="," if fmt == ".csv" else "\t"))
    return False


def stdin_lines(stream: BinaryIO, name: str = "<stdin>") -> list[tuple[int, str]]:
    """Every line of a binary stream (standard input), numbered from 1 and decoded as `_lines` does a file's."""
    return list(stream_lines(stream, name))


def stream_lines(stream: IO[bytes], name: str) -> Iterator[tuple[int, str]]:
    """The lines of a binary stream (an archive's member, standard input), streamed, numbered from 1 and decoded
    as `_lines` does a file's; `name` is what an error calls the stream."""
    return ((n, _decode_line(Path(name), n, raw)) for n, raw in enumerate(stream, 1))


def _labelled(path: Path, text_field: str, label_field: str, lines: Iterable[tuple[int, str]] | None = None,
              fmt: str | None = None) -> Iterator[tuple[int, str, str, str]]:
    """(line, text or pieces line, label value stripped, "file:line" of the label) of every record, blank texts
    included (their callers skip or keep them)."""
    fmt = fmt or file_format(path)
    if lines is None and not path.is_file():  # before looking for a sibling .label file
        raise DataError(f"{path}: file not found")
    count = 0
    if fmt in (".spm", ".txt"):
        if lines is not None:
            raise DataError(f"{path}: one text a line carries no labels (a .label file is read beside a file only)")
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
            count += 1
            yield n, text, tag.strip(), f"{label_path}:{m}"
    else:
        for n, text, raw in _records(path, text_field, label_field, True, None if lines is None else iter(lines),
                                     fmt):
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
