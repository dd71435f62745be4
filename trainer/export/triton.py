"""`export --triton-repo DIR`: a bundle's graph as a Triton Inference Server model repository, for users who already
run Triton (onnxruntime backend):

  DIR/NAME/config.pbtxt    platform onnxruntime_onnx; token ids in, logits out (names, dtypes and shapes from the
                           bundle's manifest, i.e. contract/graph.py); batch up to max_batch_size
  DIR/NAME/labels.txt      the label names in logit order (Triton's classification extension answers with them)
  DIR/NAME/1/model.onnx    the bundle's graph for the chosen device, byte for byte (its metadata_props say what it is)

The client tokenizes: ids as the bundle's tokenizer/ gives them (contract/tokens.py: <sos> pieces <eos>, right-padded
with <pad> = 1, at most max_len), attention_mask 1 for real tokens. Triton's dynamic batcher joins requests of the same
length only, and is left off for a dynamic int8 graph (whose answers would then depend on the other requests); a
longer sequence than max_len is not refused by Triton (the graph reads up to its positional table).
DIR/NAME is replaced atomically; other models in DIR stay.
"""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

from contract.bundle import Bundle, verify_bundle
from contract.graph import TensorSpec
from contract.manifest import DEVICES
from trainer.atomic import replace_dir, temp_dir
from trainer.export.errors import ExportError

# numpy dtype names of the manifest -> Triton's DataType names (model_config.proto)
TRITON_DTYPES = {"int64": "TYPE_INT64", "int32": "TYPE_INT32", "float32": "TYPE_FP32", "float16": "TYPE_FP16"}
LABELS_FILE = "labels.txt"
VERSION = "1"
_NAME = re.compile(r"[A-Za-z0-9_.-]+")


def _q(text: str) -> str:
    """A protobuf text-format string literal."""
    return json.dumps(text, ensure_ascii=False)


def _tensor(spec: TensorSpec, label_file: str | None = None) -> str:
    """One input or output: dims without the batch axis (Triton adds it: max_batch_size > 0); symbolic dims -1."""
    dims = ", ".join("-1" if isinstance(d, str) else str(d) for d in spec.shape[1:])
    labels = f"\n    label_filename: {_q(label_file)}" if label_file else ""
    return (f"  {{\n    name: {_q(spec.name)}\n    data_type: {TRITON_DTYPES[spec.dtype]}\n"
            f"    dims: [ {dims} ]{labels}\n  }}")


def config_pbtxt(name: str, bundle: Bundle, device: str, max_batch_size: int) -> str:
    """The model's config.pbtxt for a verified bundle (graph: its manifest's for `device`)."""
    m = bundle.manifest
    graph = m.graph_for(device)
    params = {"bundle_sha256": m.bundle_sha256, "bundle_graph": graph, "precision": m.graphs[graph].precision,
              "max_len": str(m.max_len), "label_names": json.dumps(m.label_names, ensure_ascii=False),
              "pad_id": str(m.special_ids["pad"])}
    lines = [
        f"# Written by `python -m trainer export --triton-repo` from the bundle {bundle.folder.name} "
        f"(bundle_sha256 {m.bundle_sha256[:16]}...).",
        f"name: {_q(name)}",
        'platform: "onnxruntime_onnx"',
        f"max_batch_size: {max_batch_size}",
        "input [\n" + ",\n".join(_tensor(s) for s in m.inputs) + "\n]",
        "output [\n" + ",\n".join(_tensor(s, LABELS_FILE) for s in m.outputs) + "\n]",
    ]
    if m.graphs[graph].per_row:  # dynamic int8: one activation scale per run (contract/manifest.py, Graph.per_row)
        lines.append("# No dynamic batching: this graph quantizes activations per run, so texts batched together "
                     "would change each other's answers; a client's own batch is run as sent.")
    else:
        lines += ["# Requests of the same sequence length are batched together, up to max_batch_size.",
                  "dynamic_batching { }"]
    if device == "cpu":
        lines.append("instance_group [\n  {\n    kind: KIND_CPU\n  }\n]")
    for key, value in params.items():  # free-form: the onnxruntime backend ignores keys it does not know
        lines.append(f"parameters {{\n  key: {_q(key)}\n  value {{\n    string_value: {_q(value)}\n  }}\n}}")
    return "\n".join(lines) + "\n"


def write_triton_repo(bundle_dir: str | Path, repo: str | Path, name: str = "sentiment", device: str = "cuda",
                      max_batch_size: int = 64) -> Path:
    """Write (or replace) `repo/name` from a verified bundle; returns that folder. device: which of the bundle's
    graphs ("cuda": the fp32/fp16 graph, which also runs on a CPU-only Triton; "cpu": the CPU graph, int8 where
    the bundle has it, with a CPU instance group)."""
    if device not in DEVICES:
        raise ExportError(f"--triton-device {device!r}; choose one of {list(DEVICES)}")
    if not _NAME.fullmatch(name) or name in (".", ".."):
        raise ExportError(f"--triton-name {name!r}: letters, digits, '_', '.', '-' only (a folder name)")
    if not 1 <= max_batch_size <= 1 << 16:
        raise ExportError(f"--triton-max-batch {max_batch_size}: between 1 and 65536")
    bundle_dir, repo = Path(bundle_dir), Path(repo)
    b = verify_bundle(bundle_dir)
    graph = b.manifest.graph_for(device)
    if any("\n" in label or "\r" in label for label in b.manifest.label_names):
        raise ExportError(f"{bundle_dir}: a label name holds a line break; {LABELS_FILE} has one label a line")
    if repo.exists() and not repo.is_dir():
        raise ExportError(f"--triton-repo {repo}: exists and is not a folder")
    repo.mkdir(parents=True, exist_ok=True)
    out = repo / name
    if out.exists() and not (out / "config.pbtxt").is_file():
        raise ExportError(f"{out} exists and is not a Triton model (no config.pbtxt); choose another --triton-name")
    tmp = temp_dir(repo, f".{name}.tmp-")
    try:
        (tmp / VERSION).mkdir()
        (tmp / VERSION / "model.onnx").write_bytes(b.graph_bytes(graph))
        (tmp / LABELS_FILE).write_text("".join(f"{label}\n" for label in b.manifest.label_names), encoding="utf-8")
        (tmp / "config.pbtxt").write_text(config_pbtxt(name, b, device, max_batch_size), encoding="utf-8")
        replace_dir(tmp, out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return out
