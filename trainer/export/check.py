"""`export --check`: verify a bundle (contract.bundle.verify_bundle, the server's own check), open each of its graphs
the way the server does, and score it on a labelled file against the PyTorch model it came from and against the
TF-IDF + logistic regression baseline fitted on that model's own training split (trainer/baseline.py)."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from contract.bundle import verify_bundle
from contract.errors import one_line
from contract.manifest import DEVICES, Manifest
from contract.tokens import PAD
from trainer import artifact as artifact_mod
from trainer import baseline
from trainer.config.schema import ConfigError
from trainer.data import labelled
from trainer.data.readers import DataError, Example, read_labeled
from trainer.export.errors import ExportError
from trainer.export.score import score_data, torch_reference
from trainer.export.served import bundle_tokenizer, served_graph


def check_bundle(bundle: str | Path, data_file: str | Path, artifact_dir: str | Path | None = None,
                 batch_size: int = 32, limit: int = 0, prefer_gpu: bool = True, compare_torch: bool = True,
                 text_field: str | None = None, label_field: str | None = None,
                 tfidf: bool = True, fitted: SourceBaseline | None = None) -> dict[str, Any]:
    """Accuracy of each graph of a bundle on a labelled file, in an onnxruntime session opened the way the server
    opens it (a graph the manifest serves on CUDA runs there when a GPU is present), and its agreement with the
    PyTorch model of `artifact_dir` (default: the manifest's source, if present; compare_torch=False: none).

    Returns {"bundle", "bundle_sha256", "file", "fields", "examples", "blank_skipped", "artifact", "graphs": {file:
    {"precision", "serves" (devices), "provider", "bundle_accuracy", and with PyTorch "torch_accuracy",
    "accuracy_change_points", "label_agreement", "max_abs_diff"}}, "label_values", "label_names", "tfidf_baseline":
    {method, recipe, C, "accuracy", "macro_f1", "verdicts": {graph: line}} or {"skipped": why}, "calibration": the
    manifest's}; each graph's report also holds "ece_served" and "ece_uncalibrated" (its logits times the
    manifest's temperature: what they were before it). The file's fields:
    `text_field` / `label_field`, else those the bundle was trained with (manifest data_fields). Blank texts are
    skipped and counted. tfidf=False: no baseline (it needs the source artifact's training data); `fitted`: the
    baseline already fitted (source_baseline), instead of fitting it here."""
    b = verify_bundle(bundle)
    m = b.manifest
    art = source_artifact(m, artifact_dir) if compare_torch else None
    model, trained_with = None, m.data_fields
    if art is not None:
        model = art.model()
        if m.format == 2:  # its manifest has no data_fields: the source artifact knows them
            trained_with = {"text_field": art.cfg.data.text_field, "label_field": art.cfg.data.label_field}
    fields = (text_field or trained_with["text_field"], label_field or trained_with["label_field"])
    # The labelled file holds the data's raw label values; the bundle answers with names in the same order.
    blank: list[str] = []
    examples = read_labeled(Path(data_file), m.label_values, *fields, skipped=blank)[:limit or None]
    tok = bundle_tokenizer(b)
    seqs = [tok.encode_example(ex) for ex in examples]  # cut at the manifest's max_len
    labels = np.array([ex.label for ex in examples], dtype=np.int64)
    reference = torch_reference(model, seqs, PAD, batch_size) if model is not None else None
    graphs: dict[str, dict[str, Any]] = {}
    for name, graph in m.graphs.items():
        serves = [d for d in DEVICES if m.serve[d] == name]
        served = served_graph(b, name, prefer_gpu=prefer_gpu and "cuda" in serves)
        report = score_data(served.session, seqs, labels, PAD, reference, batch_size, graph.per_row,
                            m.temperature)
        graphs[name] = {"precision": graph.precision, "serves": serves, "provider": served.provider, **report}
    base = tfidf_baseline(fitted or source_baseline(art), examples, graphs, str(data_file)) if tfidf else None
    return {"bundle": str(b.folder), "bundle_sha256": b.bundle_sha256, "file": str(data_file),
            "fields": dict(zip(("text_field", "label_field"), fields, strict=True)), "examples": len(seqs),
            "blank_skipped": len(blank), "artifact": str(art.path) if model is not None else None, "graphs": graphs,
            "label_values": list(m.label_values), "label_names": list(m.label_names), "tfidf_baseline": base,
            "calibration": m.calibration}


def source_artifact(m: Manifest, artifact_dir: str | Path | None) -> artifact_mod.Artifact | None:
    """The classifier artifact a bundle came from: `artifact_dir` (--artifact), else the manifest's source when that
    folder is still there, else None. A named folder that is missing, or not a classifier, is an error."""
    source = artifact_dir or m.source_artifact.get("path")
    if source is not None and Path(source).is_dir():
        art = artifact_mod.load(source)
        if art.task != "classifier":
            raise ExportError(f"{art.path}: task {art.task!r}; --artifact must be a classifier artifact")
        return art
    if artifact_dir is not None:
        raise ExportError(f"--artifact {artifact_dir}: not a folder")
    return None


@dataclass(frozen=True)
class SourceBaseline:
    """The baseline fitted once on the source artifact's own training split (its config's files, split as in
    training, its texts without data.crops'), or why it was not: --data and --behaviour's set share one fit (the
    `english` preset's takes minutes)."""

    fitted: baseline.Baseline | None
    names: tuple[str, ...] = ()
    trained_on: str = ""
    skipped: str = ""

    def scores(self, scored: dict[str, list[Example]]) -> dict[str, Any]:
        """Each of `scored`: on_splits' report plus "trained_on", or {"skipped": why}."""
        if self.fitted is None:
            return {"skipped": self.skipped}
        return {**baseline.scores(self.fitted, self.names, scored), "trained_on": self.trained_on}


def source_baseline(art: artifact_mod.Artifact | None) -> SourceBaseline:
    """Fit the baseline on `art`'s training split (the manifest's source artifact, or --artifact)."""
    if art is None:
        return SourceBaseline(None, skipped="no source artifact to take the training split from (the manifest's is "
                                            "not here: pass --artifact ARTIFACT)")
    try:
        data = labelled.load(art.cfg)
    except (DataError, ConfigError, OSError) as e:
        return SourceBaseline(None, skipped=f"the training data of {art.path} cannot be read ({one_line(e)})")
    b = baseline.fit_splits(art.cfg, data.train.originals, data.valid.examples)
    if isinstance(b, str):
        return SourceBaseline(None, skipped=b)
    return SourceBaseline(b, tuple(art.cfg.data.names), data.train.source)


def tfidf_baseline(fitted: SourceBaseline, examples: list[Example], graphs: dict[str, dict[str, Any]],
                   file: str) -> dict[str, Any]:
    """The baseline on the checked examples, with a verdict per graph."""
    base = fitted.scores({"file": examples})
    if "skipped" in base:
        return base
    scored = base.pop("file")
    base.update(accuracy=scored["accuracy"], macro_f1=scored["macro_f1"], examples=scored["examples"])
    base["verdicts"] = {name: baseline.verdict(f"{name} ({', '.join(g['serves']) or 'no device'})",
                                               g["bundle_accuracy"], scored["accuracy"], where=file)
                        for name, g in graphs.items()}
    return base
