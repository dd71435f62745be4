"""Predict the label of every text of a file, offline, with a classifier artifact (PyTorch, fp32) or an exported
bundle (verified, then run in onnxruntime and tokenized the way the server does): no server to start.

The file is read by the readers training uses (.csv, .tsv, .jsonl, .parquet, .txt/.spm) with the fields the model
was trained with (the artifact's config, the bundle's manifest), unless `--text-field` / `--label-field` say
otherwise; `--data -` reads standard input: one text a line, or `--format jsonl|csv|tsv`. When the file carries
labels (a label column or key, or a sibling .label file) the metrics are printed too: accuracy, the majority-class
baseline, macro-F1, per-class precision/recall/F1 and the confusion matrix (trainer/metrics.py).

Predictions go to `--out` as JSONL or CSV (by its suffix), one row per input row, in file order, so that outputs line
up with inputs: its line, the label's name and data value, the probability of every label, the true label if known,
and `reason`, empty unless the row got no prediction (a blank text: the one rule of trainer/data/readers.py; its
label and probabilities are then empty).
"""

from __future__ import annotations

import argparse
import csv
import dataclasses
import json
import os
import sys
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any, TextIO

import numpy as np

from contract.manifest import MANIFEST_FILE
from trainer import metrics
from trainer.cli import add_field_arguments
from trainer.data.readers import STDIN, DataError, Example, file_format, has_labels, is_blank, read_rows, stdin_lines
from trainer.data.tokenizer import Tokenizer
from trainer.export import ExportError, batched_logits, open_bundle, torch_logits

EXAMPLES = """examples:
  python -m trainer predict runs/mine/artifact --data reviews_test.jsonl          # the fields it was trained with
  python -m trainer predict runs/mine/bundle --data new_reviews.txt --out predictions.csv
  python -m trainer predict runs/mine/bundle --data reviews.tsv --out - | head     # JSONL on stdout
  printf 'Great book.\nDull.\n' | python -m trainer predict runs/mine/bundle --data - --out -
  cat reviews.jsonl | python -m trainer predict runs/mine/bundle --data - --format jsonl --out -
"""
BLANK = "blank text"  # the reason a row gets no prediction
STDIN_FORMATS = ("txt", "jsonl", "csv", "tsv")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("model", metavar="ARTIFACT_OR_BUNDLE",
                        help="a classifier artifact folder (finetune's RUN/artifact) or a bundle folder (export's)")
    parser.add_argument("--data", required=True, metavar="FILE",
                        help="texts to predict: .csv, .tsv, .jsonl, .parquet, .txt (one a line) or .spm; '-': "
                             "standard input (--format)")
    parser.add_argument("--format", choices=STDIN_FORMATS, default=None,
                        help="with --data -: what standard input holds (default txt: one text a line)")
    parser.add_argument("--out", metavar="FILE", help="write the predictions: FILE.jsonl or FILE.csv; '-': JSONL on "
                                                      "stdout (default: none, only the metrics of a labelled file)")
    add_field_arguments(parser)
    parser.add_argument("--no-labels", action="store_true", help="predict only, even when the file has labels")
    parser.add_argument("--with-text", action="store_true", help="copy each text into its prediction row")
    parser.add_argument("--metrics", metavar="FILE", help="also write the metrics as JSON to FILE")
    parser.add_argument("--limit", type=int, default=0, metavar="N", help="only the first N rows (default: all)")
    parser.add_argument("--batch-size", type=int, default=64, metavar="N", help="texts per forward (default: 64)")


@dataclasses.dataclass
class Model:
    """A classifier of either kind, as `predict` needs it."""

    kind: str  # "artifact" | "bundle"
    values: list[str]  # label values of the data, in logit order
    names: list[str]  # what the server answers for each
    tokenizer: Tokenizer  # cuts at the max_len the model was trained or exported with
    fields: tuple[str, str]  # (text_field, label_field) it was trained with
    logits: Callable[[np.ndarray, np.ndarray], np.ndarray]  # (B, T) ids, (B, T) 0/1 mask -> (B, C) logits
    about: str  # for the log line


def open_model(path: Path) -> Model:
    """A bundle (manifest.json) or a classifier artifact (artifact.json); anything else is one line naming it."""
    if (path / MANIFEST_FILE).is_file():
        served = open_bundle(path)  # the graph the server would run here, tokenized as it does
        m = served.bundle.manifest
        return Model("bundle", list(m.label_values), list(m.label_names), served.tokenizer,
                     (m.data_fields["text_field"], m.data_fields["label_field"]), served.logits,
                     f"bundle, {served.graph} ({served.precision}), {served.provider}")
    if (path / "artifact.json").is_file():
        from trainer import artifact

        art = artifact.load(path)
        if art.task != "classifier":
            raise ExportError(f"{path}: task {art.task!r}; predict needs a classifier artifact (finetune's)")
        model, d = art.model(), art.cfg.data
        return Model("artifact", list(d.labels), d.names, art.tokenizer(),
                     (d.text_field, d.label_field), lambda i, a: torch_logits(model, i, a), "artifact, PyTorch fp32")
    raise ExportError(f"{path}: neither a classifier artifact (artifact.json) nor a bundle ({MANIFEST_FILE})")


@dataclasses.dataclass
class Source:
    """Where the rows come from: a file, or standard input read whole (its lines, parsed in `fmt`)."""

    path: Path
    fmt: str  # one of readers.FORMATS
    lines: list[tuple[int, str]] | None = None  # standard input's


def source(data: str, fmt: str | None) -> Source:
    if data != STDIN:
        if fmt is not None:
            raise DataError(f"--format goes with --data - (standard input); {data}'s format comes from its name")
        return Source(Path(data), file_format(data))
    return Source(Path("<stdin>"), f".{fmt or 'txt'}", stdin_lines(sys.stdin.buffer))


def main(args: argparse.Namespace) -> int:
    if args.limit < 0 or args.batch_size < 1:
        raise DataError(f"--limit must be >= 0 and --batch-size >= 1, got {args.limit} and {args.batch_size}")
    src = source(args.data, args.format)
    model = open_model(Path(args.model))
    text_field, label_field = args.text_field or model.fields[0], args.label_field or model.fields[1]
    labelled = not args.no_labels and has_labels(src.path, label_field, src.lines, src.fmt)
    if not labelled and not args.out:
        raise DataError(f"{args.data} has no labels to score (no {label_field!r} field): give --out FILE.jsonl or "
                        ".csv for the predictions (or --label-field NAME)")
    rows = read_rows(src.path, model.values if labelled else None, text_field, label_field, src.lines, src.fmt)
    rows = rows[:args.limit or None]
    probs = predict(model, rows, args.batch_size)
    blank = sum(is_blank(ex) for ex in rows)
    report = sys.stderr if args.out == "-" else sys.stdout
    if args.out:
        write_predictions(args.out, model, rows, probs, args.with_text)
    print(f"predict: {len(rows)} row{'s' * (len(rows) != 1)} of {args.data} with {args.model} ({model.about})"
          + (f"; {blank} blank text{'s' * (blank != 1)}: no prediction (a row each, with the reason)" if blank
             else "")
          + ("" if labelled else f"; no labels (no {label_field!r} field): predictions only"), file=report)
    if labelled:
        scored = [i for i, ex in enumerate(rows) if not is_blank(ex)]
        if not scored:
            raise DataError(f"{args.data}: every text is blank: nothing to score")
        true = np.array([rows[i].label for i in scored], dtype=np.int64)
        m = metrics.summarize(metrics.confusion(true, probs[scored].argmax(1), len(model.names)), model.names)
        print(metrics.summary_line(m), file=report)
        print("\n".join(metrics.text_table(m)), file=report)
        if (text := metrics.warning(m, str(args.data))) is not None:
            print(text, file=report)
        if args.metrics:
            _write_atomic(args.metrics, json.dumps({"file": str(args.data), "model": str(args.model),
                                                    "blank_skipped": blank, **m}, indent=2) + "\n")
    if args.out and args.out != "-":
        print(f"predictions: {args.out}", file=report)
    return 0


def predict(model: Model, rows: list[Example], batch_size: int) -> np.ndarray:
    """(N, C) float64 probabilities, in the rows' order; a blank row's are NaN (no prediction)."""
    probs = np.full((len(rows), len(model.names)), np.nan)
    keep = [i for i, ex in enumerate(rows) if not is_blank(ex)]
    if not keep:
        return probs
    seqs = [model.tokenizer.encode_example(rows[i]) for i in keep]
    logits = batched_logits(model.logits, seqs, Tokenizer.PAD, batch_size).astype(np.float64)
    e = np.exp(logits - logits.max(axis=1, keepdims=True))
    probs[keep] = e / e.sum(axis=1, keepdims=True)
    return probs


def rows_of(model: Model, examples: list[Example], probs: np.ndarray, with_text: bool) -> list[dict[str, Any]]:
    out = []
    for ex, p in zip(examples, probs, strict=True):
        blank = is_blank(ex)
        k = None if blank else int(p.argmax())
        row: dict[str, Any] = {"line": int(ex.source.rpartition(":")[2]),
                               "label": "" if k is None else model.names[k],
                               "label_value": "" if k is None else model.values[k],
                               **{f"p_{name}": None if blank else round(float(v), 6)
                                  for name, v in zip(model.names, p, strict=True)}}
        if ex.label is not None:
            row["true_label_value"] = model.values[ex.label]
        row["reason"] = BLANK if blank else ""
        if with_text:
            row["text"] = ex.text if ex.text is not None else " ".join(ex.pieces or [])
        out.append(row)
    return out


def write_predictions(out: str, model: Model, examples: list[Example], probs: np.ndarray, with_text: bool) -> None:
    """JSONL (stdout for '-', or a .jsonl file) or CSV (a .csv file), written atomically."""
    table = rows_of(model, examples, probs, with_text)
    if out == "-":
        _jsonl(sys.stdout, table)
        return
    suffix = Path(out).suffix
    if suffix not in (".jsonl", ".csv"):
        raise DataError(f"--out {out}: the predictions file must end in .jsonl or .csv")
    buf = _Buffer()
    if suffix == ".jsonl":
        _jsonl(buf, table)
    else:
        # the union of the rows' keys in first-seen order: a labelled file's blank rows have no true label
        fields = list(dict.fromkeys(k for row in table for k in row)) or ["line", "label"]
        w = csv.DictWriter(buf, fieldnames=fields, lineterminator="\n")
        w.writeheader()
        w.writerows(table)
    _write_atomic(out, buf.getvalue())


def _jsonl(f: TextIO, table: list[dict[str, Any]]) -> None:
    for row in table:
        f.write(json.dumps(row, ensure_ascii=False) + "\n")


class _Buffer(list):  # a minimal text sink for csv/json writers
    def write(self, s: str) -> int:
        self.append(s)
        return len(s)

    def getvalue(self) -> str:
        return "".join(self)


def _write_atomic(path: str, text: str) -> None:
    """A temp file beside `path`, then a rename (the umask's modes, like any file the user writes)."""
    target = Path(path)
    if target.is_dir():
        raise DataError(f"{path}: is a folder; give a file name")
    target.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=target.parent, prefix=f".{target.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "w", encoding="utf-8", newline="") as f:
            f.write(text)
        mask = os.umask(0)
        os.umask(mask)
        os.chmod(tmp, 0o666 & ~mask)  # mkstemp makes 0600: give the file the modes open() would
        os.replace(tmp, target)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
