"""Raw blocks of whole records of a text file, for a reader that parses and tokenizes in other processes.

One process reads (and gunzips) a file sequentially and cuts it into blocks of about `block_bytes` at record ends,
without decoding: far faster than a worker that parses and tokenizes the same bytes, so one reader feeds a pool of
workers (trainer/data/prepare.py). The workers decode, parse and report bad lines themselves with
`block_texts` here, which numbers the lines from the block's `first_line`.
"""

from __future__ import annotations

import gzip
import itertools
import zlib
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path

from trainer.data.readers import DataError, Example, _decode_line, _example, _records, file_format
from trainer.data.tables import parquet_records

MAX_RECORD_BYTES = 1 << 28  # one record longer than this is refused (an unclosed CSV quote, say)


@dataclass(frozen=True)
class Block:
    """Whole records of a text file, raw: lines `first_line`... of it, and the file's header record (.tsv/.csv)."""

    first_line: int  # number of the block's first line in the file, from 1
    data: bytes  # whole lines, each ending in "\n" (the file's last one may not)
    header: bytes | None  # the header record's raw bytes (lines 1..), None for headerless formats
    read_bytes: int  # bytes of the file (compressed, for .gz) read once this block was cut: for progress bars

    @property
    def last_line(self) -> int:
        return self.first_line + max(0, self.data.count(b"\n") + (not self.data.endswith(b"\n")) - 1)


def read_blocks(path: str | Path, block_bytes: int = 1 << 20) -> Iterator[Block]:
    """Cut a .txt/.spm/.jsonl/.tsv/.csv file (gzipped or not) into blocks of about `block_bytes` of whole records,
    without decoding them: the one sequential reader of a parallel prepare stays far faster than the workers that
    parse and tokenize. A .csv block ends only where the quotes seen so far are balanced, so a quoted field's
    newlines never split its record; a .tsv block too, when a field in it starts with a quote (else every quote in it
    is a character: `_opens_quote`). The header record goes with every block, not in one."""
    path = Path(path)
    fmt = file_format(path)
    if fmt == ".parquet":
        raise DataError(f"{path}: parquet files are read by row group, not in text blocks")
    if not path.is_file():
        raise DataError(f"{path}: file not found" if not path.exists() else f"{path}: not a file")
    table = fmt in (".tsv", ".csv")
    header: bytes | None = None
    line = 1  # number of the first line in `pending`
    pending = b""
    try:
        with open(path, "rb") as raw, (gzip.GzipFile(fileobj=raw) if path.name.endswith(".gz") else raw) as f:
            chunks = iter(lambda: f.read(block_bytes), b"")
            for chunk in itertools.chain(chunks, [None]):  # None: the end of the file
                if chunk is not None:
                    pending += chunk
                    if len(pending) < block_bytes:
                        continue
                while pending:
                    first = table and header is None
                    quoted = fmt == ".csv" or (fmt == ".tsv" and _opens_quote(pending))
                    end = _record_end(pending, quoted, first)
                    if end < 0 and chunk is not None:  # no whole record yet: read on
                        if len(pending) > MAX_RECORD_BYTES:
                            raise DataError(f"{path}:{line}: a record starting on line {line} runs past "
                                            f"{MAX_RECORD_BYTES >> 20} MiB" + (" (an unclosed quote?)" * table))
                        break
                    end = len(pending) - 1 if end < 0 else end  # the end of the file ends the last record
                    piece, pending = pending[:end + 1], pending[end + 1:]
                    if first:
                        header = piece
                    else:
                        yield Block(line, piece, header, raw.tell())
                    line += piece.count(b"\n")
                    if chunk is not None and not first:
                        break  # what is left is less than a record: read on
    except (gzip.BadGzipFile, EOFError, zlib.error) as e:
        raise DataError(f"{path}: corrupt gzip data after line {line}: {e}") from None


def _opens_quote(data: bytes) -> bool:
    """Whether a field of these whole lines of a .tsv starts with a quote (only such a quote opens a quoted field)."""
    return data.startswith(b'"') or b'\t"' in data or b'\n"' in data


def _record_end(data: bytes, quoted: bool, first: bool = False) -> int:
    """Index of the last (with `first`: the first) "\\n" in `data` that ends a record; -1 for none. `quoted` (CSV):
    a newline inside quotes ends no record; `data` starts at a record boundary, so an even count of '"' before a
    newline means it is outside quotes."""
    if first:
        end = data.find(b"\n")
        while quoted and end >= 0 and data.count(b'"', 0, end) % 2:
            end = data.find(b"\n", end + 1)
        return end
    end = data.rfind(b"\n")
    if not quoted or end < 0:
        return end
    odd = data.count(b'"', 0, end) % 2
    while end >= 0 and odd:
        prev = data.rfind(b"\n", 0, end)
        odd ^= data.count(b'"', prev + 1, end) % 2
        end = prev
    return end


# ---------------------------------------------------------------------------------------------- parsing


def block_texts(path: str | Path, first_line: int, data: bytes, header: bytes | None = None,
                text_field: str = "text", label_field: str = "label", after_line: int = 0) -> Iterator[Example]:
    """The documents (as `iter_texts` gives them) of raw whole lines of `path` that start at line `first_line`,
    past line `after_line`; `header`: the file's header record, raw (.tsv, .csv). `read_blocks` cuts them."""
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
    for n, text, _ in parquet_records(path, text_field, "label", labeled=False, row_groups=[row_group]):
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
