"""`export --check`: verify a bundle (contract.bundle.verify_bundle, the server's own check), open each of its graphs
the way the server does, and score it on a labelled file against the PyTorch model it came from."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from contract.bundle import check_session, verify_bundle
from contract.errors import BundleError, one_line
from contract.manifest import DEVICES, TOKENIZER_DIR
from contract.tokens import PAD, TOKENIZER_FILES
from trainer import artifact as artifact_mod
from trainer.data.tokenizer import Tokenizer
from trainer.export.errors import ExportError
from trainer.export.graph import open_session
from trainer.export.score import encode_file, score_data, torch_reference


def check_bundle(bundle: str | Path, data_file: str | Path, artifact_dir: str | Path | None = None,
                 batch_size: int = 32, limit: int = 0, prefer_gpu: bool = True, compare_torch: bool = True,
                 text_field: str | None = None, label_field: str | None = None) -> dict[str, Any]:
    """Accuracy of each graph of a bundle on a labelled file, in an onnxruntime session opened the way the server
    opens it (a graph the manifest serves on CUDA runs there when a GPU is present), and its agreement with the
    PyTorch model of `artifact_dir` (default: the manifest's source, if present; compare_torch=False: none).

    Returns {"bundle", "bundle_sha256", "file", "examples", "artifact", "graphs": {file: {"precision", "serves"
    (devices), "provider", "bundle_accuracy", and with PyTorch "torch_accuracy", "accuracy_change_points",
    "label_agreement", "max_abs_diff"}}, "labels": {value: name}}. The file's fields: `text_field` / `label_field`,
    else the source artifact's, else "text" / "label"."""
    b = verify_bundle(bundle)
    m = b.manifest
    source = (artifact_dir or m.source_artifact.get("path")) if compare_torch else None
    model, fields = None, ("text", "label")
    if source is not None and Path(source).is_dir():
        art = artifact_mod.load(source)
        if art.task != "classifier":
            raise ExportError(f"{art.path}: task {art.task!r}; --artifact must be a classifier artifact")
        model, fields = art.model(), (art.cfg.data.text_field, art.cfg.data.label_field)
    elif artifact_dir is not None:
        raise ExportError(f"--artifact {artifact_dir}: not a folder")
    tok = Tokenizer.from_files({n: b.files[f"{TOKENIZER_DIR}/{n}"] for n in TOKENIZER_FILES}, b.folder / TOKENIZER_DIR,
                               max_len=m.max_len)
    # The labelled file holds the data's raw label values; the bundle answers with names in the same order.
    seqs, labels = encode_file(tok, Path(data_file), m.label_values, m.max_len, limit, text_field or fields[0],
                               label_field or fields[1])
    reference = torch_reference(model, seqs, PAD, batch_size) if model is not None else None
    graphs: dict[str, dict[str, Any]] = {}
    for name, graph in m.graphs.items():
        serves = [d for d in DEVICES if m.serve[d] == name]
        try:
            session = open_session(b.graph_bytes(name), m.runtime.graph_optimization_level,
                                   prefer_gpu=prefer_gpu and "cuda" in serves)
        except Exception as e:  # onnxruntime raises its own Fail/InvalidGraph/... types
            raise BundleError(f"{b.folder / name}: onnxruntime cannot load it ({one_line(e)})") from None
        check_session(session, b, name)
        report = score_data(session, seqs, labels, PAD, reference, batch_size)
        graphs[name] = {"precision": graph.precision, "serves": serves, "provider": session.get_providers()[0],
                        **report}
    return {"bundle": str(b.folder), "bundle_sha256": b.bundle_sha256, "file": str(data_file),
            "examples": len(seqs), "artifact": str(source) if model is not None else None, "graphs": graphs,
            "labels": dict(zip(m.label_values, m.label_names, strict=True))}
