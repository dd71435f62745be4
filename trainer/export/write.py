"""Stage 4: the bundle folder. `export_bundle(artifact, out, ExportOptions(...))` runs every stage and writes the graph
files, tokenizer/ and manifest.json (contract/manifest.py) into a temporary sibling folder, then renames it into
place, so a failed export leaves nothing behind and an earlier bundle at `out` stays until the new one is whole.

Which graphs, by `ExportOptions.precision`:
  "auto" (the default)  model.onnx in fp32, the CUDA graph (or model.fp16.onnx with gpu_precision="fp16"), and
                        model.int8.onnx, the CPU graph, when its drift from PyTorch stays within `int8_bound`
                        (INT8_CPU_BOUND, trainer/export/quantize.py); beyond it export says why, leaves int8 out and
                        the CPU serves model.onnx
  "fp32", "int8", "fp16"  one graph, model.onnx, served on every device (the bundles of earlier versions)
"""

from __future__ import annotations

import datetime as dt
import platform
import shlex
import shutil
import time
from dataclasses import asdict, dataclass, field, replace
from importlib import metadata
from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort
import torch

from contract.graph import expected_io
from contract.manifest import (
    CARD_FILE,
    EXTRA_GRAPH_FILES,
    MANIFEST_FILE,
    MODEL_FILE,
    PRECISIONS,
    TOKENIZER_BUNDLE_FILES,
    TOKENIZER_DIR,
    Graph,
    Manifest,
    Runtime,
    graph_metadata,
)
from contract.runtime import DEFAULT_OPT_LEVEL, OPT_LEVELS, inference_session
from contract.tokens import SPECIALS, check_max_len
from trainer import artifact as artifact_mod
from trainer.artifact import replace_dir, write_text_atomic
from trainer.atomic import sha256_file, temp_dir
from trainer.config.schema import check_positions
from trainer.data.tokenizer import Tokenizer
from trainer.export import card
from trainer.export.errors import ExportError, ExportValidationError
from trainer.export.graph import check_graph, export_onnx
from trainer.export.quantize import INT8_CPU_BOUND, TOLERANCES, Tolerance, convert_fp16, quantize_int8
from trainer.export.score import data_check, encode_file, torch_reference
from trainer.export.validate import validate_graph

AUTO = "auto"


@dataclass(frozen=True)
class ExportOptions:
    """How to export; the defaults give model.onnx (fp32, CUDA) + model.int8.onnx (CPU, within INT8_CPU_BOUND),
    fused attention, validated at graph level 'basic'."""

    precision: str = AUTO  # "auto" (module docstring), or one of PRECISIONS for a bundle of that one graph
    gpu_precision: str = "fp32"  # auto: the CUDA graph, fp32 (model.onnx) or fp16 (model.fp16.onnx, besides it)
    int8_bound: Tolerance = field(default=INT8_CPU_BOUND)  # auto: the drift within which the CPU serves int8
    optimize: str = DEFAULT_OPT_LEVEL  # onnxruntime level the bundle is validated at and the manifest recommends
    save_optimized: bool = False  # store the graphs onnxruntime optimised at `optimize` (basic or extended only)
    fuse_attention: bool = True  # one onnxruntime Attention node per layer instead of the exporter's decomposition
    per_channel: bool = False  # int8: per-channel weight scales
    # int8: 8-bit weights. Off by default, 7-bit weights: without VNNI (AVX2, AVX-512 without VNNI) onnxruntime's
    # u8 x s8 kernel adds pairs of products into int16 (VPMADDUBSW), which 8-bit weights overflow (2 x 255 x 127 >
    # 32,767) and 7-bit ones cannot; a bundle is served on CPUs its export never saw (docs/BENCHMARKS.md, Export).
    full_range: bool = False
    max_len: int | None = None  # longest sequence served; None: the artifact's tokenizer.max_len
    opset: int | None = None  # None: the exporter's default
    data_file: Path | None = None  # labelled file whose accuracy change is recorded and held to the tolerance
    data_limit: int = 0  # score only the first N examples of data_file (0: all)
    text_field: str | None = None  # data_file's text field (.jsonl key, .tsv column); None: the artifact's
    label_field: str | None = None  # data_file's label field; None: the artifact's data.label_field

    def __post_init__(self) -> None:
        if self.precision not in (AUTO, *PRECISIONS):
            raise ExportError(f"precision={self.precision!r}; choose one of {(AUTO, *PRECISIONS)}")
        if self.gpu_precision not in ("fp32", "fp16"):
            raise ExportError(f"gpu_precision={self.gpu_precision!r}; choose fp32 or fp16")
        if self.precision != AUTO and (self.gpu_precision != "fp32" or self.int8_bound != INT8_CPU_BOUND):
            raise ExportError(f"gpu_precision and the int8 bound choose among the graphs of the default export; "
                              f"precision={self.precision!r} writes that one graph only")
        if self.optimize not in OPT_LEVELS:
            raise ExportError(f"optimize={self.optimize!r}; choose one of {sorted(OPT_LEVELS)}")
        if self.save_optimized and self.optimize not in ("basic", "extended"):
            raise ExportError(f"save_optimized needs optimize 'basic' or 'extended', got {self.optimize!r} "
                              "('all' writes a graph laid out for this machine's CPU)")
        if (self.per_channel or self.full_range) and self.precision not in (AUTO, "int8"):
            raise ExportError(f"per_channel and full_range apply to int8 only, not to {self.precision}")
        if self.max_len is not None:
            check_max_len(self.max_len, "max_len", ExportError)
        if self.data_limit < 0:
            raise ExportError(f"data_limit must be >= 0, got {self.data_limit}")

    @property
    def quantization(self) -> dict[str, object]:
        """An int8 graph's quantization record in the manifest."""
        return {"method": "dynamic", "weight_type": "int8", "per_channel": self.per_channel,
                "reduce_range": not self.full_range}

    def command(self, artifact: Path) -> str:
        """The export command with these options (those at their defaults left out); --out BUNDLE, so that exporting
        one artifact gives the same bytes wherever the bundle goes."""
        flags = [("--precision", self.precision, AUTO), ("--gpu-precision", self.gpu_precision, "fp32"),
                 ("--optimize", self.optimize, DEFAULT_OPT_LEVEL), ("--max-len", self.max_len, None)]
        parts = ["python", "-m", "trainer", "export", str(artifact), "--out", "BUNDLE"]
        parts += [x for flag, value, default in flags if value != default for x in (flag, str(value))]
        parts += [flag for flag, on in (("--save-optimized", self.save_optimized), ("--per-channel", self.per_channel),
                                        ("--full-range", self.full_range),
                                        ("--no-fuse-attention", not self.fuse_attention)) if on]
        return shlex.join(parts)

    def graphs(self) -> list[tuple[str, str]]:
        """(graph file, precision) to write, model.onnx first."""
        if self.precision != AUTO:
            return [(MODEL_FILE, self.precision)]
        planned = [(MODEL_FILE, "fp32"), (EXTRA_GRAPH_FILES["int8"], "int8")]
        if self.gpu_precision == "fp16":
            planned.append((EXTRA_GRAPH_FILES["fp16"], "fp16"))
        return planned


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
    # label_values: the raw values of the data (data.labels); label_names: what the server answers (data.label_names)
    label_values, label_names = check_labels(art)
    tok = art.tokenizer() if opt.max_len is None else art.tokenizer().with_max_len(opt.max_len)
    max_len = tok.max_len  # the manifest's, the bundle's one copy
    check_positions(max_len, mcfg, f"{art.path}: max_len")
    model = art.model()

    out = Path(out_dir)
    _prepare_out(out)
    tmp = temp_dir(out.parent, f".{out.name}.tmp-")
    try:
        tok.save(tmp / TOKENIZER_DIR)
        tokenizer_sha256 = {rel: sha256_file(tmp / rel) for rel in TOKENIZER_BUNDLE_FILES}
        fp32 = tmp / ".fp32.onnx"
        graph = export_onnx(model, fp32, max_len, opt.opset, opt.fuse_attention)
        check_graph(graph, mcfg.num_classes, "exported fp32 graph")
        opset_imports = {o.domain or "ai.onnx": o.version for o in graph.opset_import}
        del graph  # the lab-size graph holds 48 MB of weights; the stages below read it from disk
        calibration = card.calibration_of(art.meta)
        for name, precision in opt.graphs():
            meta = graph_metadata(label_names, label_values, max_len, SPECIALS, tokenizer_sha256, precision,
                                  temperature=calibration["temperature"])
            _write_graph(fp32, tmp, name, precision, opt, meta, mcfg.num_classes)
        fp32.unlink()

        graphs, cpu_int8 = _validate(model, tmp, opt, tok, label_values, mcfg.vocab_size, mcfg.pad_id,
                                     (opt.text_field or art.cfg.data.text_field,
                                      opt.label_field or art.cfg.data.label_field))
        cpu = EXTRA_GRAPH_FILES["int8"] if EXTRA_GRAPH_FILES["int8"] in graphs and opt.precision == AUTO else MODEL_FILE
        cuda = EXTRA_GRAPH_FILES["fp16"] if EXTRA_GRAPH_FILES["fp16"] in graphs else MODEL_FILE
        inputs, outputs = expected_io(mcfg.num_classes)
        manifest = Manifest(
            label_names=label_names,
            label_values=label_values,
            max_len=max_len,
            data_fields={"text_field": art.cfg.data.text_field, "label_field": art.cfg.data.label_field},
            special_ids=dict(SPECIALS),
            opset=opset_imports["ai.onnx"],
            opset_imports=opset_imports,
            inputs=inputs,
            outputs=outputs,
            graphs=graphs,
            serve={"cpu": cpu, "cuda": cuda},
            cpu_int8=cpu_int8,
            runtime=Runtime(opt.optimize, opt.save_optimized, opt.fuse_attention),
            files={**{name: sha256_file(tmp / name) for name in graphs}, **tokenizer_sha256},
            source_artifact={
                "path": str(art.path.resolve()),
                "weights_sha256": art.meta.get("weights_sha256"),
                "created": art.meta.get("created"),
                "preset": art.cfg.preset,
                "parameters": art.meta.get("parameters"),
                "model": asdict(mcfg),
            },
            calibration=calibration,
            evaluation=card.evaluation(art.meta, art.cfg),
            versions=exporter_versions(),
            created=dt.datetime.now(dt.UTC).isoformat(timespec="seconds"),
            export_seconds=round(time.perf_counter() - t0, 2),
        )
        # The card reads the manifest; then the manifest lists the card (and its digest covers it).
        write_text_atomic(tmp / CARD_FILE, card.render(manifest, opt.command(art.path)))
        manifest = replace(manifest, files={**manifest.files, CARD_FILE: sha256_file(tmp / CARD_FILE)})
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
    for key, want in (("label_values", values), ("label_names", names)):
        if key in art.meta and art.meta[key] != want:
            raise ExportError(f"{art.path / 'artifact.json'}: {key} {art.meta[key]} but config.json gives {want}: "
                              "the artifact was edited or assembled from two runs")
    return values, names


def _write_graph(fp32: Path, tmp: Path, name: str, precision: str, opt: ExportOptions, meta: dict[str, str],
                 num_classes: int) -> None:
    """tmp/name: the fp32 graph converted to `precision`, optionally optimised offline, with its metadata_props
    (contract/manifest.py, graph_metadata), checked."""
    staged = fp32
    if precision == "int8":
        staged = tmp / f".{name}.int8"
        quantize_int8(fp32, staged, per_channel=opt.per_channel, reduce_range=not opt.full_range)
    elif precision == "fp16":
        staged = tmp / f".{name}.fp16"
        convert_fp16(fp32, staged)
    if opt.save_optimized:
        # onnxruntime writes the graph it optimised, so a server skips that work at load time (whether that pays:
        # docs/BENCHMARKS.md, Export).
        optimized = tmp / f".{name}.optimized"
        inference_session(staged, opt.optimize, "cpu", optimized_out=optimized)
        if staged != fp32:
            staged.unlink()
        staged = optimized
    graph = onnx.load(str(staged))
    if staged != fp32:
        staged.unlink()
    del graph.metadata_props[:]
    for key, value in meta.items():
        graph.metadata_props.add(key=key, value=value)
    onnx.save(graph, str(tmp / name))
    check_graph(graph, num_classes, f"{precision} graph")


def _validate(model: torch.nn.Module, tmp: Path, opt: ExportOptions, tok: Tokenizer, label_values: list[str],
              vocab_size: int, pad_id: int,
              fields: tuple[str, str]) -> tuple[dict[str, Graph], dict[str, object] | None]:
    """Each graph against PyTorch at lengths up to the tokenizer's max_len (and on --data); returns the graphs kept
    and, for the default export, the int8 decision. Beyond its tolerance a graph fails the export, except the
    default's int8 graph: it is left out."""
    references: dict[str, np.ndarray] = {}
    data = None
    if opt.data_file is not None:
        seqs, labels = encode_file(tok, Path(opt.data_file), label_values, opt.data_limit, *fields)
        data = (seqs, labels, torch_reference(model, seqs, pad_id))
    graphs: dict[str, Graph] = {}
    cpu_int8: dict[str, object] | None = None
    for name, precision in opt.graphs():
        auto_int8 = opt.precision == AUTO and precision == "int8"
        tol = opt.int8_bound if auto_int8 else TOLERANCES[precision]
        path = tmp / name
        try:
            validation = validate_graph(model, path, precision, opt.optimize, tok.max_len, vocab_size, pad_id, tol,
                                        references)
            if data is not None:
                per_row = Graph(precision, opt.quantization if precision == "int8" else None).per_row
                validation["data"] = data_check(path, precision, opt.optimize, *data, pad_id, Path(opt.data_file),
                                                tol, per_row)
        except ExportValidationError as e:
            if not auto_int8:
                raise
            path.unlink()
            cpu_int8 = {"bound": asdict(tol), "accepted": False,
                        "reason": f"{e}; the CPU serves {MODEL_FILE} (fp32)"}
            continue
        if auto_int8:
            where = " and on --data" if data is not None else ""
            cpu_int8 = {"bound": asdict(tol), "accepted": True,
                        "reason": f"int8 within the bound on {len(validation['cases'])} validation batches{where}: "
                                  f"the CPU serves {name}"}
        graphs[name] = Graph(precision, opt.quantization if precision == "int8" else None, validation)
    return graphs, cpu_int8
