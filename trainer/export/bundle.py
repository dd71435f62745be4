"""Stage 4: the bundle folder. `export_bundle(artifact, out, ExportOptions(...))` runs every stage and writes
model.onnx, tokenizer/ and manifest.json (contract/manifest.py) into a temporary sibling folder, then renames it
into place, so a failed export leaves nothing behind and an earlier bundle at `out` stays until the new one is whole.
"""

from __future__ import annotations

import datetime as dt
import platform
import shutil
import tempfile
import time
from dataclasses import asdict, dataclass
from importlib import metadata
from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort
import torch

from contract.graph import expected_io
from contract.manifest import BUNDLE_FILES, MANIFEST_FILE, MODEL_FILE, PRECISIONS, TOKENIZER_DIR, Manifest, Runtime
from contract.runtime import DEFAULT_OPT_LEVEL, OPT_LEVELS
from contract.tokens import SPECIALS, TOKENIZER_FILES
from trainer import artifact as artifact_mod
from trainer.artifact import replace_dir, sha256_file, write_text_atomic
from trainer.export.errors import ExportError
from trainer.export.graph import check_graph, export_onnx, open_session
from trainer.export.precision import convert_fp16, quantize_int8
from trainer.export.score import data_check
from trainer.export.validate import validate_graph
from trainer.tokenizer import Tokenizer


@dataclass(frozen=True)
class ExportOptions:
    """How to export; the defaults give the fp32, fused-attention bundle validated at graph level 'basic'."""

    precision: str = "fp32"  # one of PRECISIONS: fp32, int8 (dynamic, for CPU serving), fp16 (for GPU serving)
    optimize: str = DEFAULT_OPT_LEVEL  # onnxruntime level the bundle is validated at and the manifest recommends
    save_optimized: bool = False  # store the graph onnxruntime optimised at `optimize` (basic or extended only)
    fuse_attention: bool = True  # one onnxruntime Attention node per layer instead of the exporter's decomposition
    per_channel: bool = False  # int8: per-channel weight scales
    reduce_range: bool = False  # int8: 7-bit weights (older x86 CPUs)
    max_len: int | None = None  # longest sequence served; None: the tokenizer's max_len
    opset: int | None = None  # None: the exporter's default
    data_file: Path | None = None  # labelled file whose accuracy change is recorded and held to the tolerance
    data_limit: int = 0  # score only the first N examples of data_file (0: all)
    text_field: str | None = None  # data_file's text field (.jsonl key, .tsv column); None: the artifact's
    label_field: str | None = None  # data_file's label field; None: the artifact's data.label_field

    def __post_init__(self) -> None:
        if self.precision not in PRECISIONS:
            raise ExportError(f"precision={self.precision!r}; choose one of {PRECISIONS}")
        if self.optimize not in OPT_LEVELS:
            raise ExportError(f"optimize={self.optimize!r}; choose one of {sorted(OPT_LEVELS)}")
        if self.save_optimized and self.optimize not in ("basic", "extended"):
            raise ExportError(f"save_optimized needs optimize 'basic' or 'extended', got {self.optimize!r} "
                              "('all' writes a graph laid out for this machine's CPU)")
        if (self.per_channel or self.reduce_range) and self.precision != "int8":
            raise ExportError(f"per_channel and reduce_range apply to int8 only, not to {self.precision}")
        if self.max_len is not None and self.max_len < 3:
            raise ExportError(f"max_len must be >= 3 (<sos>, one piece, <eos>), got {self.max_len}")
        if self.data_limit < 0:
            raise ExportError(f"data_limit must be >= 0, got {self.data_limit}")

    @property
    def quantization(self) -> dict[str, object] | None:
        """The manifest's runtime.quantization."""
        if self.precision != "int8":
            return None
        return {"method": "dynamic", "weight_type": "int8", "per_channel": self.per_channel,
                "reduce_range": self.reduce_range}


def exporter_versions() -> dict[str, str]:
    def version(name: str) -> str:
        try:
            return metadata.version(name)
        except metadata.PackageNotFoundError:
            return "absent"

    return {"python": platform.python_version(), "torch": torch.__version__, "onnx": onnx.__version__,
            "onnxruntime": ort.__version__, "onnxscript": version("onnxscript"), "numpy": np.__version__,
            "transfer-sentiment": version("transfer-sentiment")}


def _prepare_out(out: Path) -> None:
    """Replacing an earlier bundle is fine; replacing some other folder is not."""
    if out.exists() and not (out / MANIFEST_FILE).is_file() and (not out.is_dir() or any(out.iterdir())):
        raise ExportError(f"{out} exists and is not a bundle (no {MANIFEST_FILE}); choose another --out")
    out.parent.mkdir(parents=True, exist_ok=True)


def export_bundle(artifact_dir: str | Path, out_dir: str | Path, options: ExportOptions | None = None) -> Path:
    """Export a classifier artifact to a validated bundle folder at `out_dir`, atomically; returns its path."""
    t0 = time.perf_counter()
    opt = options or ExportOptions()
    art = artifact_mod.load(artifact_dir)
    if art.task != "classifier":
        raise ExportError(f"{art.path}: task {art.task!r}; only classifier artifacts are exported")
    mcfg = art.cfg.model
    label_values, label_names = check_labels(art)
    tok = Tokenizer.load(art.tokenizer_dir)
    max_len = tok.max_len if opt.max_len is None else opt.max_len
    if max_len > mcfg.max_positions:
        raise ExportError(f"max_len {max_len} exceeds the model's positional table: model.max_positions="
                          f"{mcfg.max_positions} is the longest sequence {art.path} accepts")
    model = art.model()

    out = Path(out_dir)
    _prepare_out(out)
    tmp = Path(tempfile.mkdtemp(dir=out.parent, prefix=f".{out.name}.tmp-"))
    try:
        final = tmp / MODEL_FILE
        opset_imports = _write_graph(model, tmp, max_len, opt, mcfg.num_classes)
        (tmp / TOKENIZER_DIR).mkdir()
        for name in TOKENIZER_FILES:
            shutil.copy2(art.tokenizer_dir / name, tmp / TOKENIZER_DIR / name)

        validation = validate_graph(model, final, opt.precision, opt.optimize, max_len, mcfg.vocab_size,
                                    mcfg.pad_id)
        if opt.data_file is not None:
            validation["data"] = data_check(model, final, opt.precision, opt.optimize, tok, Path(opt.data_file),
                                            label_values, max_len, mcfg.pad_id, opt.data_limit,
                                            (opt.text_field or art.cfg.data.text_field,
                                             opt.label_field or art.cfg.data.label_field))
        inputs, outputs = expected_io(mcfg.num_classes)
        manifest = Manifest(
            label_names=label_names,
            label_values=label_values,
            max_len=max_len,
            special_ids=dict(SPECIALS),
            opset=opset_imports["ai.onnx"],
            opset_imports=opset_imports,
            precision=opt.precision,
            inputs=inputs,
            outputs=outputs,
            runtime=Runtime(opt.optimize, opt.save_optimized, opt.fuse_attention, opt.quantization),
            files={rel: sha256_file(tmp / rel) for rel in BUNDLE_FILES},
            source_artifact={
                "path": str(art.path.resolve()),
                "weights_sha256": art.meta.get("weights_sha256"),
                "created": art.meta.get("created"),
                "preset": art.cfg.preset,
                "parameters": art.meta.get("parameters"),
                "model": asdict(mcfg),
            },
            versions=exporter_versions(),
            validation=validation,
            created=dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"),
            export_seconds=round(time.perf_counter() - t0, 2),
        )
        write_text_atomic(tmp / MANIFEST_FILE, manifest.to_json())
        replace_dir(tmp, out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return out


def check_labels(art: artifact_mod.Artifact) -> tuple[list[str], list[str]]:
    """The label values (data.labels: what the data says, in logit order) and the names served for them
    (data.label_names, else the values): one per logit, distinct, and the same in artifact.json as in config.json."""
    data, classes = art.cfg.data, art.cfg.model.num_classes
    values, names = list(data.labels), data.names
    if len(values) != classes or len(set(values)) != len(values) or len(set(names)) != len(names) \
            or not all(n.strip() for n in names):
        raise ExportError(f"{art.path}: labels {values} named {names} for a head of model.num_classes={classes}: "
                          "need one distinct value and one distinct non-empty name per class")
    for key, want in (("labels", values), ("label_names", names)):
        if key in art.meta and art.meta[key] != want:
            raise ExportError(f"{art.path / 'artifact.json'}: {key} {art.meta[key]} but config.json gives {want}: "
                              "the artifact was edited or assembled from two runs")
    return values, names


def _write_graph(model: torch.nn.Module, tmp: Path, max_len: int, opt: ExportOptions,
                 num_classes: int) -> dict[str, int]:
    """Export, convert to the precision, optionally optimise offline: tmp/model.onnx, checked. Returns the opset
    of each domain the exported fp32 graph imports ("ai.onnx" for the default domain)."""
    final = tmp / MODEL_FILE
    fp32_path = tmp / ("fp32.onnx" if opt.precision != "fp32" or opt.save_optimized else MODEL_FILE)
    graph = export_onnx(model, fp32_path, max_len, opt.opset, opt.fuse_attention)
    check_graph(graph, num_classes, "exported fp32 graph")
    opset_imports = {o.domain or "ai.onnx": o.version for o in graph.opset_import}
    del graph  # the lab-size graph holds 48 MB of weights; the stages below read it from disk
    staged = fp32_path
    if opt.precision == "int8":
        staged = tmp / ("int8.onnx" if opt.save_optimized else MODEL_FILE)
        quantize_int8(fp32_path, staged, per_channel=opt.per_channel, reduce_range=opt.reduce_range)
    elif opt.precision == "fp16":
        staged = tmp / ("fp16.onnx" if opt.save_optimized else MODEL_FILE)
        convert_fp16(fp32_path, staged)
    if opt.save_optimized:
        # onnxruntime writes the graph it optimised, so a server skips that work at load time. Measured: at
        # BASIC the dynamo graph (already folded by onnxscript) comes back with the same nodes; see
        # docs/BENCHMARKS.md (Export).
        open_session(staged, opt.optimize, prefer_gpu=False, optimized_out=final)
    for p in (fp32_path, staged):
        if p != final:
            p.unlink(missing_ok=True)
    check_graph(onnx.load(str(final)), num_classes, f"{opt.precision} graph")
    return opset_imports
