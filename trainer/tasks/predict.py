"""Predict the label of every text of a file, offline, with a classifier artifact (PyTorch, fp32) or an exported
bundle (verified, then run in onnxruntime and tokenized the way the server does): no server to start.

The file is read by the readers training uses (.csv, .tsv, .jsonl, .parquet, .txt/.spm) with the same field
options. When it carries labels (a `--label-field` column or key, or a sibling .label file) the metrics are
printed too: accuracy, the majority-class baseline, macro-F1, per-class precision/recall/F1 and the confusion
matrix (trainer/metrics.py). Predictions go to `--out` as JSONL or CSV (by its suffix), one row per text, in file
order: its line, the label's name and data value, the probability of every label, and the true label if known.
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
from trainer.data.readers import DataError, Example, has_labels, iter_texts, read_labeled
from trainer.data.tokenizer import Tokenizer
from trainer.export.errors import ExportError

EXAMPLES = """examples:
  python -m trainer predict runs/mine/artifact --data reviews_test.jsonl --text-field review --label-field sentiment
  python -m trainer predict runs/mine/bundle --data new_reviews.txt --out predictions.csv
  python -m trainer predict runs/mine/bundle --data reviews.tsv --out - | head     # JSONL on stdout
"""


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("model", metavar="ARTIFACT_OR_BUNDLE",
                        help="a classifier artifact folder (finetune's RUN/artifact) or a bundle folder (export's)")
    parser.add_argument("--data", required=True, metavar="FILE",
                        help="texts to predict: .csv, .tsv, .jsonl, .parquet, .txt (one a line) or .spm")
    parser.add_argument("--out", metavar="FILE", help="write the predictions: FILE.jsonl or FILE.csv; '-': JSONL on "
                                                      "stdout (default: none, only the metrics of a labelled file)")
    add_field_arguments(parser)
    parser.add_argument("--no-labels", action="store_true", help="predict only, even when the file has labels")
    parser.add_argument("--with-text", action="store_true", help="copy each text into its prediction row")
    parser.add_argument("--metrics", metavar="FILE", help="also write the metrics as JSON to FILE")
    parser.add_argument("--limit", type=int, default=0, metavar="N", help="only the first N texts (default: all)")
    parser.add_argument("--batch-size", type=int, default=64, metavar="N", help="texts per forward (default: 64)")


@dataclasses.dataclass
class Model:
    """A classifier of either kind, as `predict` needs it."""

    kind: str  # "artifact" | "bundle"
    values: list[str]  # label values of the data, in logit order
    names: list[str]  # what the server answers for each
    max_len: int
    tokenizer: Tokenizer
    fields: tuple[str, str]  # (text_field, label_field) it was trained with
    logits: Callable[[np.ndarray, np.ndarray], np.ndarray]  # (B, T) ids, (B, T) 0/1 mask -> (B, C) logits
    about: str  # for the log line


def open_model(path: Path) -> Model:
    """A bundle (manifest.json) or a classifier artifact (artifact.json); anything else is one line naming it."""
    if (path / MANIFEST_FILE).is_file():
        import onnxruntime as ort

        from contract.bundle import check_session, verify_bundle
        from contract.manifest import TOKENIZER_DIR
        from contract.runtime import CUDA, cuda_driver_present
        from contract.tokens import TOKENIZER_FILES
        from trainer.export.graph import open_session
        from trainer.export.validate import ort_logits

        b = verify_bundle(path)
        m = b.manifest
        # The graph the server would run here: the CUDA one where onnxruntime has a GPU, else the CPU one (int8 in
        # a default bundle), tokenized with the manifest's max_len (the bundle's one copy).
        device = "cuda" if cuda_driver_present() and CUDA in ort.get_available_providers() else "cpu"
        graph = m.graph_for(device)
        session = open_session(b.graph_bytes(graph), m.runtime.graph_optimization_level, prefer_gpu=device == "cuda")
        check_session(session, b, graph)
        tok = Tokenizer.from_files({n: b.files[f"{TOKENIZER_DIR}/{n}"] for n in TOKENIZER_FILES},
                                   b.folder / TOKENIZER_DIR, max_len=m.max_len)
        return Model("bundle", list(m.label_values), list(m.label_names), m.max_len, tok, ("text", "label"),
                     lambda i, a: ort_logits(session, i, a),
                     f"bundle, {graph} ({m.graphs[graph].precision}), {session.get_providers()[0]}")
    if (path / "artifact.json").is_file():
        from trainer import artifact
        from trainer.export.validate import torch_logits

        art = artifact.load(path)
        if art.task != "classifier":
            raise ExportError(f"{path}: task {art.task!r}; predict needs a classifier artifact (finetune's)")
        model, d = art.model(), art.cfg.data
        return Model("artifact", list(d.labels), d.names, art.cfg.tokenizer.max_len, Tokenizer.load(art.tokenizer_dir),
                     (d.text_field, d.label_field), lambda i, a: torch_logits(model, i, a), "artifact, PyTorch fp32")
    raise ExportError(f"{path}: neither a classifier artifact (artifact.json) nor a bundle ({MANIFEST_FILE})")


def main(args: argparse.Namespace) -> int:
    if args.limit < 0 or args.batch_size < 1:
        raise DataError(f"--limit must be >= 0 and --batch-size >= 1, got {args.limit} and {args.batch_size}")
    model = open_model(Path(args.model))
    data = Path(args.data)
    text_field, label_field = args.text_field or model.fields[0], args.label_field or model.fields[1]
    labelled = not args.no_labels and has_labels(data, label_field)
    if not labelled and not args.out:
        raise DataError(f"{data} has no labels to score (no {label_field!r} field): give --out FILE.jsonl or .csv "
                        "for the predictions (or --label-field NAME)")
    examples: list[Example] = read_labeled(data, model.values, text_field, label_field) if labelled \
        else list(iter_texts(data, text_field, label_field))
    examples = examples[:args.limit or None]
    probs = predict(model, examples, args.batch_size)
    report = sys.stderr if args.out == "-" else sys.stdout
    if args.out:
        write_predictions(args.out, model, examples, probs, args.with_text)
    print(f"predict: {len(examples)} texts of {data} with {args.model} ({model.about})"
          + ("" if labelled else f"; no labels (no {label_field!r} field): predictions only"), file=report)
    if labelled:
        true = np.array([ex.label for ex in examples], dtype=np.int64)
        m = metrics.summarize(metrics.confusion(true, probs.argmax(1), len(model.names)), model.names)
        print(metrics.summary_line(m), file=report)
        print("\n".join(metrics.text_table(m)), file=report)
        if (text := metrics.warning(m, str(data))) is not None:
            print(text, file=report)
        if args.metrics:
            _write_atomic(args.metrics, json.dumps({"file": str(data), "model": str(args.model), **m}, indent=2) + "\n")
    if args.out and args.out != "-":
        print(f"predictions: {args.out}", file=report)
    return 0


def predict(model: Model, examples: list[Example], batch_size: int) -> np.ndarray:
    """(N, C) float64 probabilities, in the examples' order."""
    from trainer.export.score import predict as run

    if not examples:
        return np.zeros((0, len(model.names)))
    seqs = [model.tokenizer.encode_example(ex, model.max_len) for ex in examples]
    logits = run(model.logits, seqs, Tokenizer.PAD, batch_size).astype(np.float64)
    e = np.exp(logits - logits.max(axis=1, keepdims=True))
    return e / e.sum(axis=1, keepdims=True)


def rows(model: Model, examples: list[Example], probs: np.ndarray, with_text: bool) -> list[dict[str, Any]]:
    out = []
    for ex, p in zip(examples, probs, strict=True):
        k = int(p.argmax())
        row: dict[str, Any] = {"line": int(ex.source.rpartition(":")[2]), "label": model.names[k],
                               "label_value": model.values[k],
                               **{f"p_{name}": round(float(v), 6) for name, v in zip(model.names, p, strict=True)}}
        if ex.label is not None:
            row["true_label_value"] = model.values[ex.label]
        if with_text:
            row["text"] = ex.text if ex.text is not None else " ".join(ex.pieces or [])
        out.append(row)
    return out


def write_predictions(out: str, model: Model, examples: list[Example], probs: np.ndarray, with_text: bool) -> None:
    """JSONL (stdout for '-', or a .jsonl file) or CSV (a .csv file), written atomically."""
    table = rows(model, examples, probs, with_text)
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
        w = csv.DictWriter(buf, fieldnames=list(table[0]) if table else ["line", "label"], lineterminator="\n")
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
