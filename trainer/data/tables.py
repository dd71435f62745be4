"""The table formats of trainer/data/readers.py: records of a file whose columns have names (.tsv, .csv, .parquet).

`data.text_field` / `data.label_field` name the columns (the header row of a .tsv / .csv, the schema of a .parquet).
.csv and .tsv are read as Python's csv module and pandas write them (RFC 4180 quoting: quoted fields may hold the
delimiter, newlines and doubled quotes), so the same table as .csv or .tsv gives the same records; a record's number
is the line it starts on. .parquet is read one row group at a time, in batches, never whole (pyarrow, imported for
these files only); a record's number is its row in the file, from 1. Every problem names the file and the line or
row.
"""

from __future__ import annotations

import csv
import itertools
import json
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

from trainer.data.errors import DataError, name_it

CSV_FIELD_CHARS = 1 << 28  # csv's default limit (131,072 characters) is shorter than one long document
PARQUET_BATCH_ROWS = 4096  # rows decoded at a time inside a row group


DIALECTS = {".csv": (",", "comma"), ".tsv": ("\t", "tab")}  # delimiter, and its name in messages


def text_column(path: Path, columns: list[str], text_field: str, label_field: str) -> int:
    if text_field in columns:
        return columns.index(text_field)
    others = [i for i, c in enumerate(columns) if c != label_field]
    if len(others) == 1 and label_field in columns:
        return others[0]
    raise DataError(f"{path}:1: no column {text_field!r} in the header {columns}; {name_it('text_field')}")


def _check_header(path: Path, columns: list[str], text_field: str, label_field: str) -> None:
    """A first row that reads like data (long or many-word cells, none of them a field name) is no header."""
    if text_field not in columns and label_field not in columns and any(len(c) > 40 or len(c.split()) > 3
                                                                        for c in columns):
        shown = [c if len(c) <= 24 else c[:21] + "..." for c in columns[:4]]
        raise DataError(f"{path}:1: no header row: the first line reads like data ({shown}); add a first line "
                        f"that names the columns ({label_field!r} and {text_field!r}, or set data.label_field and "
                        "data.text_field to its names)")


def csv_records(path: Path, lines: Iterator[tuple[int, str]], text_field: str, label_field: str,
                labeled: bool, fmt: str = ".csv") -> Iterator[tuple[int, str, object]]:
    """(line a record starts on, text, raw label or None) of a .csv or .tsv file's numbered lines, header first.

    Both are read as Python's csv module (and pandas) write them: a field that starts with a quote is quoted (it
    may hold the delimiter, newlines and doubled quotes ""), a quote inside an unquoted field is a character."""
    csv.field_size_limit(max(csv.field_size_limit(), CSV_FIELD_CHARS))
    delimiter, kind = DIALECTS[fmt]
    pulled: list[int] = []  # numbers of the lines the reader took for the record it is reading

    def feed() -> Iterator[str]:
        for n, line in lines:
            pulled.append(n)
            yield line + "\n"  # a quoted field's newlines come back as "\n" (CRLF inside a field too)

    # strict: a stray quote after a quoted field is an error, not a silently merged field
    reader = csv.reader(feed(), delimiter=delimiter, strict=True)
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
            raise DataError(f"{path}:{start}: malformed {fmt[1:].upper()} record starting on line {start}: {e}"
                            + (" (a field that starts with a quote must end with one; double a quote inside it)"
                               if "expected after" in str(e) or "unexpected end" in str(e) else "")) from None
        start = pulled[0]
        pulled.clear()
        if columns is None:
            if _blank_line(row):
                continue
            columns = row
            _check_header(path, columns, text_field, label_field)
            text_col = text_column(path, columns, text_field, label_field)
            if labeled:
                if label_field not in columns:
                    raise DataError(f"{path}:1: no column {label_field!r} in the header {columns}; "
                                    f"{name_it('label_field')}")
                label_col = columns.index(label_field)
            continue
        rows += 1
        if _blank_line(row):
            continue
        if len(row) != len(columns):
            raise DataError(f"{path}:{start}: row {rows} (line {start}) has {len(row)} {kind}-separated fields, "
                            f"the header has {len(columns)} (a field holding a {kind} must be quoted)")
        yield start, row[text_col], (row[label_col] if labeled else None)
    if columns is None:
        raise DataError(f"{path}: file is empty (expected a header row)")


def _blank_line(row: list[str]) -> bool:
    """A line with nothing but spaces: no record (a record whose text is blank is one: readers.py's rule)."""
    return not row or (len(row) == 1 and not row[0].strip())


def parquet_file(path: Path) -> Any:
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
    meta = parquet_file(Path(path)).metadata
    return [meta.row_group(i).num_rows for i in range(meta.num_row_groups)]


def parquet_records(path: Path, text_field: str, label_field: str, labeled: bool,
                     row_groups: Sequence[int] | None = None) -> Iterator[tuple[int, str, object]]:
    """(row in the file from 1, text, raw label or None) of a .parquet file, one row group at a time, `row_groups`
    only when given. A null or non-string text, or a null label, is an error naming the row."""
    import pyarrow as pa

    pf = parquet_file(path)
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
