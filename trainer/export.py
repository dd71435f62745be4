"""Export a classifier artifact to a validated ONNX bundle, or check a bundle against a labelled file.

A bundle is a folder a server loads with no torch and no training code:
  model.onnx     one file (no external data): input_ids int64 [batch, sequence], attention_mask int64
                 [batch, sequence] (1 = real token, 0 = padding, right-padded) -> logits float32 [batch, classes]
  tokenizer/     copied from the artifact
  manifest.json  labels, max_len, special ids, opset, precision, input/output names, file checksums, the source
                 artifact, the exporter's versions, the validation results and the tolerances they were held to

The graph comes from the dynamo exporter (`torch.onnx.export(..., dynamo=True)`) with symbolic batch and sequence
axes; the TorchScript exporter bakes the attention reshape and fails on every other shape (STACK.md), so it is
never used. Each layer's self-attention becomes one onnxruntime `com.microsoft.Attention` node
(trainer/onnx_attention.py; `--no-fuse-attention` keeps plain ONNX ops).

Validation is always on: onnxruntime and PyTorch run the same batches (batch 1, 2, 13; lengths 1, 7, max; padded
rows of mixed lengths) and a difference beyond the precision's tolerance raises ExportValidationError naming the
shape. Everything is written into a temporary sibling folder and renamed into place, so a failed export leaves
nothing behind.
"""

from __future__ import annotations

import argparse
import contextlib
import ctypes.util
import datetime as dt
import json
import logging
import platform
import shutil
import sys
import tempfile
import time
import warnings
from collections.abc import Callable, Iterator, Sequence
from dataclasses import asdict, dataclass
from importlib import metadata
from pathlib import Path
from typing import Any

import numpy as np
import onnx
import onnxruntime as ort
import torch
from onnxruntime.capi.onnxruntime_pybind11_state import Fail as OrtFail
from onnxruntime.capi.onnxruntime_pybind11_state import NotImplemented as OrtNotImplemented
from torch import nn

from trainer import artifact as artifact_mod
from trainer.artifact import replace_dir, sha256_file, write_text_atomic

EXAMPLES = """examples:
  python -m trainer export runs/finetune/artifact --out runs/bundle
  python -m trainer export runs/finetune/artifact --out runs/bundle-int8 --quantize int8 \\
      --data ../shared/data/cls-books-fr/test.review.spm
  python -m trainer export runs/finetune/artifact --out runs/bundle-fp16 --fp16
  python -m trainer export --check runs/bundle --data ../shared/data/cls-books-fr/test.review.spm
"""

FORMAT = 1
TASK = "sentiment-classification"
MODEL_FILE = "model.onnx"
MANIFEST_FILE = "manifest.json"

# The graph's contract (COMMON.md "ONNX bundle folder"), declared once: passed to the exporter, written into the
# manifest and checked against the exported graph. The classes axis is static (the head's width).
BATCH_AXIS, SEQUENCE_AXIS = "batch", "sequence"
INPUTS: tuple[tuple[str, str], ...] = (("input_ids", "int64"), ("attention_mask", "int64"))
OUTPUT = ("logits", "float32")

PRECISIONS = ("fp32", "int8", "fp16")
# onnxruntime graph optimisation levels by the names the CLI and the manifest use.
OPT_LEVELS: dict[str, ort.GraphOptimizationLevel] = {
    "disable": ort.GraphOptimizationLevel.ORT_DISABLE_ALL,
    "basic": ort.GraphOptimizationLevel.ORT_ENABLE_BASIC,
    "extended": ort.GraphOptimizationLevel.ORT_ENABLE_EXTENDED,
    "all": ort.GraphOptimizationLevel.ORT_ENABLE_ALL,
}
# BASIC beat ALL for fp32 on the 2-core CPU (STACK.md; bench/export_bench.py re-measures it).
DEFAULT_OPT_LEVEL = "basic"


class ExportError(ValueError):
    """The artifact cannot be exported as asked (wrong task, length beyond the positional table, bad option)."""


class ExportValidationError(ExportError):
    """onnxruntime and PyTorch disagree on a validation batch beyond the precision's stated tolerance."""


class BundleError(ValueError):
    """A bundle folder is incomplete, or its files do not match its manifest."""


@dataclass(frozen=True)
class Tolerance:
    """How close a bundle's logits must stay to PyTorch fp32 eager; written into the manifest as is.

    On each validation batch, max |ORT - PyTorch| over its logits must be <= `max_abs_diff + rel_diff * scale`
    (scale: the batch's largest |PyTorch logit|), and every row whose PyTorch top-2 gap is at least twice that
    bound must keep its label. A smaller gap is a near-tie that an allowed difference can flip: counted, not failed.
    """

    max_abs_diff: float  # absolute part of the bound on |ORT - PyTorch| per logit
    rel_diff: float  # relative part, times the batch's largest |logit| (int8 error grows with the logits)
    min_data_agreement: float  # with --data: fraction of labelled examples whose predicted label must match
    max_accuracy_drop: float  # with --data: accuracy points the bundle may lose against PyTorch

    def bound(self, ref: np.ndarray) -> float:
        return self.max_abs_diff + self.rel_diff * (float(np.abs(ref).max()) if ref.size else 0.0)


# fp32: the issue's 1e-4 (STACK.md measured <= 6e-7; the fused graph <= 2e-6 at lab size).
# fp16: 10-bit mantissa; measured 4e-4..7e-4 on the tiny model.
# int8 (dynamic, per-tensor): measured 0.008 (tiny) and 0.043 (lab size, logits up to 3.4: bound 0.22);
# what a user sees is the label, so a labelled --data set is held to agreement and accuracy.
TOLERANCES: dict[str, Tolerance] = {
    "fp32": Tolerance(max_abs_diff=1e-4, rel_diff=0.0, min_data_agreement=0.999, max_accuracy_drop=0.1),
    "fp16": Tolerance(max_abs_diff=1e-2, rel_diff=1e-2, min_data_agreement=0.995, max_accuracy_drop=0.5),
    "int8": Tolerance(max_abs_diff=5e-2, rel_diff=5e-2, min_data_agreement=0.98, max_accuracy_drop=1.0),
}


class ExportWrapper(nn.Module):
    """The served signature around the plain model: an int64 attention mask (1 = real) instead of a bool
    padding mask (True = <pad>), so that clients need no bool tensors and the model stays as trained."""

    def __init__(self, model: nn.Module) -> None:
        super().__init__()
        self.model = model

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
        """(B, T) int64, (B, T) int64 -> (B, C) float32 logits."""
        return self.model(input_ids, attention_mask == 0)


# ---------------------------------------------------------------------------------------------- sessions


def cuda_present() -> bool:
    """onnxruntime-gpu lists CUDA even on a machine without a GPU, then logs an error and falls back (STACK.md):
    ask for CUDA only where an NVIDIA driver exists, and trust `session.get_providers()` after that."""
    if "CUDAExecutionProvider" not in ort.get_available_providers():
        return False
    return Path("/proc/driver/nvidia").exists() or ctypes.util.find_library("cuda") is not None


def providers(prefer_gpu: bool = True) -> list[str]:
    """CUDA first when present, else CPU: the order the server uses."""
    return (["CUDAExecutionProvider"] if prefer_gpu and cuda_present() else []) + ["CPUExecutionProvider"]


def open_session(
    model: str | Path | bytes,
    level: str = DEFAULT_OPT_LEVEL,
    prefer_gpu: bool = True,
    threads: int = 0,
    optimized_out: str | Path | None = None,
) -> ort.InferenceSession:
    """An onnxruntime session at graph optimisation `level` (disable/basic/extended/all); threads 0 = ORT's
    default. `optimized_out` makes onnxruntime write the graph it optimised (offline optimisation)."""
    if level not in OPT_LEVELS:
        raise ExportError(f"graph optimisation level {level!r}; choose one of {sorted(OPT_LEVELS)}")
    so = ort.SessionOptions()
    so.graph_optimization_level = OPT_LEVELS[level]
    so.intra_op_num_threads = threads
    if optimized_out is not None:
        so.optimized_model_filepath = str(optimized_out)
    source = model if isinstance(model, bytes) else str(model)
    return ort.InferenceSession(source, so, providers=providers(prefer_gpu))


# ---------------------------------------------------------------------------------------------- graph checks


def _dtype_name(elem_type: int) -> str:
    return onnx.helper.tensor_dtype_to_np_dtype(elem_type).name


def _io_spec(values: Sequence[onnx.ValueInfoProto]) -> list[dict[str, Any]]:
    """[{"name", "dtype", "shape"}] of graph inputs or outputs; symbolic dims by name, static ones as ints."""
    out = []
    for v in values:
        t = v.type.tensor_type
        shape = [d.dim_param if d.dim_param else d.dim_value for d in t.shape.dim]
        out.append({"name": v.name, "dtype": _dtype_name(t.elem_type), "shape": shape})
    return out


def expected_io(num_classes: int) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """The declared inputs and outputs (module constants) in the manifest's form."""
    inputs = [{"name": n, "dtype": d, "shape": [BATCH_AXIS, SEQUENCE_AXIS]} for n, d in INPUTS]
    outputs = [{"name": OUTPUT[0], "dtype": OUTPUT[1], "shape": [BATCH_AXIS, num_classes]}]
    return inputs, outputs


def check_graph(model: onnx.ModelProto, num_classes: int, where: str) -> None:
    """The graph's names, dtypes and axes are the declared ones, and `onnx.checker` (full check) passes."""
    inputs, outputs = expected_io(num_classes)
    got_in, got_out = _io_spec(model.graph.input), _io_spec(model.graph.output)
    if got_in != inputs or got_out != outputs:
        raise ExportError(f"{where}: graph inputs {got_in} / outputs {got_out} differ from the declared "
                          f"inputs {inputs} / outputs {outputs}")
    try:
        onnx.checker.check_model(model, full_check=True)
    except onnx.checker.ValidationError as e:
        raise ExportError(f"{where}: onnx.checker failed: {e}") from None


# ---------------------------------------------------------------------------------------------- export


@contextlib.contextmanager
def _quiet_exporter() -> Iterator[None]:
    """The dynamo exporter warns about torchvision ops and deprecated pytree classes on every call: noise here."""
    logger = logging.getLogger("torch.onnx._internal.exporter._registration")
    level = logger.level
    logger.setLevel(logging.ERROR)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", category=FutureWarning)
            warnings.simplefilter("ignore", category=UserWarning)
            yield
    finally:
        logger.setLevel(level)


def export_onnx(model: nn.Module, path: Path, max_len: int, opset: int | None = None,
                fuse_attention: bool = True) -> onnx.ModelProto:
    """Write the fp32 graph of a Classifier to `path` (one file) and return it. Batch and sequence are dynamic
    (torch.export Dim); the example batch avoids sizes 0/1, which torch.export would specialise.
    fuse_attention: each layer's self-attention becomes one com.microsoft.Attention node (trainer/onnx_attention.py)."""
    from trainer.onnx_attention import TRANSLATION_TABLE, with_fused_attention

    wrapper = ExportWrapper(with_fused_attention(model) if fuse_attention else model).eval()
    batch = torch.export.Dim(BATCH_AXIS, min=1)
    sequence = torch.export.Dim(SEQUENCE_AXIS, min=1, max=max_len)
    t_example = min(7, max_len)
    ids = torch.full((2, t_example), 4, dtype=torch.int64)
    mask = torch.ones((2, t_example), dtype=torch.int64)
    axes = {0: batch, 1: sequence}
    with _quiet_exporter(), torch.no_grad():
        torch.onnx.export(
            wrapper,
            (ids, mask),
            str(path),
            dynamo=True,
            external_data=False,  # one file: a model loaded from bytes cannot find external data
            input_names=[n for n, _ in INPUTS],
            output_names=[OUTPUT[0]],
            dynamic_shapes={INPUTS[0][0]: axes, INPUTS[1][0]: axes},
            opset_version=opset,
            custom_translation_table=TRANSLATION_TABLE if fuse_attention else None,
            verbose=False,
        )
    return onnx.load(str(path))


def quantize_int8(src: Path, dst: Path, per_channel: bool = False, reduce_range: bool = False) -> None:
    """Dynamic int8 quantisation (weights int8 offline, activations at run time); Attention -> QAttention."""
    from onnxruntime.quantization import QuantType, quantize_dynamic

    model = onnx.load(str(src))
    # The dynamo graph's value_info carries shapes that the quantiser's own inference contradicts
    # ("Inferred shape and existing shape differ", STACK.md): drop them, onnxruntime re-infers what it needs.
    del model.graph.value_info[:]
    # onnx's shape inference cannot type the outputs of contrib ops (Attention): they are float.
    root = logging.getLogger()
    level = root.level
    root.setLevel(logging.ERROR)  # the quantiser logs "consider pre-processing" on the root logger every call
    try:
        quantize_dynamic(model, str(dst), per_channel=per_channel, reduce_range=reduce_range,
                         weight_type=QuantType.QInt8, extra_options={"DefaultTensorType": onnx.TensorProto.FLOAT})
    finally:
        root.setLevel(level)


def convert_fp16(src: Path, dst: Path) -> None:
    """Weights and activations in fp16; the graph's inputs and outputs keep their types (int64 in, fp32 out)."""
    from onnxruntime.transformers.float16 import convert_float_to_float16

    model = onnx.load(str(src))
    onnx.save(convert_float_to_float16(model, keep_io_types=True), str(dst))


# ---------------------------------------------------------------------------------------------- validation


@dataclass
class Case:
    """One validation batch: right-padded ids and the 0/1 attention mask."""

    name: str
    input_ids: np.ndarray  # (B, T) int64
    attention_mask: np.ndarray  # (B, T) int64, 1 = real


def make_batch(lengths: Sequence[int], width: int, vocab_size: int, pad_id: int, rng: np.random.Generator,
               ) -> tuple[np.ndarray, np.ndarray]:
    """(B, width) ids shaped like the tokenizer's output: <sos>=0, random pieces, <eos>=2, then <pad>."""
    ids = np.full((len(lengths), width), pad_id, dtype=np.int64)
    mask = np.zeros((len(lengths), width), dtype=np.int64)
    for b, n in enumerate(lengths):
        ids[b, :n] = rng.integers(4, vocab_size, n) if vocab_size > 4 else 3
        ids[b, 0] = 0
        if n > 1:
            ids[b, n - 1] = 2
        mask[b, :n] = 1
    return ids, mask


def validation_cases(max_len: int, vocab_size: int, pad_id: int, seed: int = 0) -> list[Case]:
    """Batch 1, 2, 13 x lengths 1, 7, max (all rows full), then padded batches of mixed lengths."""
    rng = np.random.default_rng(seed)
    cases = []
    for b in (1, 2, 13):
        for t in sorted({1, min(7, max_len), max_len}):
            cases.append(Case(f"{b}x{t}", *make_batch([t] * b, t, vocab_size, pad_id, rng)))
    for b, t in ((2, max_len), (13, min(7, max_len)), (13, max_len)):
        lengths = [t, 1, *rng.integers(1, t + 1, b - 2).tolist()]
        cases.append(Case(f"{b}x{t} padded (lengths {min(lengths)}..{max(lengths)})",
                          *make_batch(lengths, t, vocab_size, pad_id, rng)))
    return cases


def torch_logits(model: nn.Module, ids: np.ndarray, mask: np.ndarray) -> np.ndarray:
    with torch.no_grad():
        return model(torch.from_numpy(ids), torch.from_numpy(mask) == 0).float().numpy()


def ort_logits(session: ort.InferenceSession, ids: np.ndarray, mask: np.ndarray) -> np.ndarray:
    return session.run([OUTPUT[0]], {INPUTS[0][0]: ids, INPUTS[1][0]: mask})[0]


def compare(ref: np.ndarray, got: np.ndarray, bound: float) -> tuple[float, int, int]:
    """(max |diff|, rows that changed label among the decided ones, near-tie rows). A row is decided when its
    PyTorch top-2 gap is >= 2 * bound: within the bound, only a smaller gap can flip."""
    diff = float(np.abs(ref - got).max()) if ref.size else 0.0
    top2 = np.sort(ref, axis=1)[:, -2:]
    decided = (top2[:, 1] - top2[:, 0]) >= 2 * bound  # (B,)
    flipped = ref.argmax(1) != got.argmax(1)  # (B,)
    return diff, int((flipped & decided).sum()), int((~decided).sum())


def validate(model: nn.Module, session: ort.InferenceSession, precision: str, max_len: int, vocab_size: int,
             pad_id: int) -> dict[str, Any]:
    """Run every validation case on both; raise ExportValidationError on the first case beyond tolerance."""
    tol = TOLERANCES[precision]
    rows, same, total, worst = [], 0, 0, 0.0
    for case in validation_cases(max_len, vocab_size, pad_id):
        ref = torch_logits(model, case.input_ids, case.attention_mask)
        got = ort_logits(session, case.input_ids, case.attention_mask)
        if got.shape != ref.shape or got.dtype != np.float32:
            raise ExportValidationError(f"{precision} bundle on input {case.name}: logits {got.dtype} {got.shape}, "
                                        f"expected float32 {ref.shape}")
        bound = tol.bound(ref)
        diff, flipped, ties = compare(ref, got, bound)
        if diff > bound:
            raise ExportValidationError(
                f"{precision} bundle differs from PyTorch on input {case.name}: max |logit diff| {diff:.3g} "
                f"> tolerance {bound:.3g}")
        if flipped:
            raise ExportValidationError(
                f"{precision} bundle predicts another label than PyTorch on {flipped} of {len(ref)} rows of input "
                f"{case.name} whose top-2 logit gap exceeds {2 * bound:.3g} (max |logit diff| {diff:.3g})")
        rows.append({"input": case.name, "shape": list(case.input_ids.shape), "max_abs_diff": diff,
                     "tolerance": bound, "near_ties": ties})
        same += int((ref.argmax(1) == got.argmax(1)).sum())
        total += len(ref)
        worst = max(worst, diff)
    return {"cases": rows, "max_abs_diff": worst, "label_agreement": same / total, "rows": total}


# ---------------------------------------------------------------------------------------------- labelled data


def _encode_file(tokenizer_dir: Path, data_file: Path, label_values: list[str], max_len: int,
                 limit: int = 0) -> tuple[list[list[int]], np.ndarray]:
    """Ids (cut to max_len, <eos> kept) and label indices of a labelled file, read with the project's readers."""
    from trainer.data import read_labeled
    from trainer.tokenizer import Tokenizer

    tok = Tokenizer.load(tokenizer_dir)
    examples = read_labeled(data_file, label_values)
    if limit:
        examples = examples[:limit]
    seqs = [tok.encode_example(ex, max_len) for ex in examples]
    labels = np.array([ex.label for ex in examples], dtype=np.int64)
    return seqs, labels


def predict(run: Callable[[np.ndarray, np.ndarray], np.ndarray], seqs: list[list[int]], pad_id: int,
            batch_size: int = 32) -> np.ndarray:
    """(N, C) logits of id sequences in their order; `run(ids, mask)` is ORT or PyTorch. Batches are sorted by
    length so that they pad little."""
    order = sorted(range(len(seqs)), key=lambda i: len(seqs[i]))
    out: np.ndarray | None = None
    for start in range(0, len(order), batch_size):
        idx = order[start:start + batch_size]
        width = max(len(seqs[i]) for i in idx)
        ids = np.full((len(idx), width), pad_id, dtype=np.int64)
        mask = np.zeros((len(idx), width), dtype=np.int64)
        for row, i in enumerate(idx):
            ids[row, :len(seqs[i])] = seqs[i]
            mask[row, :len(seqs[i])] = 1
        logits = run(ids, mask)
        if out is None:
            out = np.zeros((len(seqs), logits.shape[1]), dtype=np.float32)
        out[idx] = logits
    assert out is not None, "no sequences"
    return out


def score_data(session: ort.InferenceSession, model: nn.Module | None, seqs: list[list[int]], labels: np.ndarray,
               pad_id: int, batch_size: int = 32) -> dict[str, Any]:
    """Accuracy of the bundle (and of PyTorch fp32 when `model` is given) and their label agreement."""
    got = predict(lambda i, m: ort_logits(session, i, m), seqs, pad_id, batch_size)
    out: dict[str, Any] = {"examples": len(seqs), "bundle_accuracy": accuracy(got, labels)}
    if model is not None:
        ref = predict(lambda i, m: torch_logits(model, i, m), seqs, pad_id, batch_size)
        out["torch_accuracy"] = accuracy(ref, labels)
        out["accuracy_change_points"] = round(out["bundle_accuracy"] - out["torch_accuracy"], 3)
        out["label_agreement"] = float((got.argmax(1) == ref.argmax(1)).mean())
        out["max_abs_diff"] = float(np.abs(got - ref).max())
    return out


def accuracy(logits: np.ndarray, labels: np.ndarray) -> float:
    """Percent of rows whose argmax is the label, rounded to 3 decimals."""
    return round(100.0 * float((logits.argmax(1) == labels).mean()), 3)


# ---------------------------------------------------------------------------------------------- bundle


def versions() -> dict[str, str]:
    def version(name: str) -> str:
        try:
            return metadata.version(name)
        except metadata.PackageNotFoundError:
            return "absent"

    return {"python": platform.python_version(), "torch": torch.__version__, "onnx": onnx.__version__,
            "onnxruntime": ort.__version__, "onnxscript": version("onnxscript"), "numpy": np.__version__,
            "transfer-sentiment": version("transfer-sentiment")}


def _file_checksums(folder: Path) -> dict[str, str]:
    files = [folder / MODEL_FILE, *sorted(p for p in (folder / "tokenizer").rglob("*") if p.is_file())]
    return {p.relative_to(folder).as_posix(): sha256_file(p) for p in files}


def _tokenizer_meta(tokenizer_dir: Path) -> dict[str, Any]:
    path = tokenizer_dir / "tokenizer.json"
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise ExportError(f"{path}: missing (the artifact's tokenizer folder is incomplete)") from None
    except json.JSONDecodeError as e:
        raise ExportError(f"{path}: invalid JSON at line {e.lineno}: {e.msg}") from None


def _prepare_out(out: Path) -> None:
    """Replacing an earlier bundle is fine; replacing some other folder is not."""
    if out.exists() and not (out / MANIFEST_FILE).is_file() and (not out.is_dir() or any(out.iterdir())):
        raise ExportError(f"{out} exists and is not a bundle (no {MANIFEST_FILE}); choose another --out")
    out.parent.mkdir(parents=True, exist_ok=True)


def export_bundle(
    artifact_dir: str | Path,
    out_dir: str | Path,
    quantize: str | None = None,
    fp16: bool = False,
    optimize: str = DEFAULT_OPT_LEVEL,
    save_optimized: bool = False,
    data_file: str | Path | None = None,
    max_len: int | None = None,
    per_channel: bool = False,
    reduce_range: bool = False,
    opset: int | None = None,
    data_limit: int = 0,
    fuse_attention: bool = True,
) -> Path:
    """Export a classifier artifact to a validated bundle folder at `out_dir`, atomically; returns its path.

    quantize: None or "int8" (dynamic); fp16: fp16 weights and activations (for GPU serving);
    optimize: the onnxruntime graph optimisation level the bundle is validated at and the manifest recommends;
    save_optimized: store the graph onnxruntime optimised at that level (basic or extended: "all" rewrites for
    this machine's CPU); data_file: a labelled file whose accuracy change is recorded (and held to the
    precision's tolerance); max_len: the longest sequence served (default: the tokenizer's max_len);
    fuse_attention: one onnxruntime Attention node per layer instead of the exporter's decomposition.
    """
    t0 = time.perf_counter()
    if quantize not in (None, "int8"):
        raise ExportError(f"quantize={quantize!r}; supported: None, 'int8'")
    if quantize and fp16:
        raise ExportError("--quantize int8 and --fp16 are exclusive: choose one precision")
    if optimize not in OPT_LEVELS:
        raise ExportError(f"optimize={optimize!r}; choose one of {sorted(OPT_LEVELS)}")
    if save_optimized and optimize not in ("basic", "extended"):
        raise ExportError(f"save_optimized needs optimize 'basic' or 'extended', got {optimize!r} "
                          "('all' writes a graph laid out for this machine's CPU)")
    precision = "int8" if quantize else "fp16" if fp16 else "fp32"

    art = artifact_mod.load(artifact_dir)
    if art.task != "classifier":
        raise ExportError(f"{art.path}: task {art.task!r}; only classifier artifacts are exported")
    mcfg = art.cfg.model
    label_names, label_values = list(art.cfg.data.label_names), list(art.cfg.data.labels)
    if len(label_names) != mcfg.num_classes:
        raise ExportError(f"{art.path}: {len(label_names)} label names {label_names} for a head of "
                          f"model.num_classes={mcfg.num_classes}")
    tok_meta = _tokenizer_meta(art.tokenizer_dir)
    max_len = int(tok_meta.get("max_len", art.cfg.tokenizer.max_len)) if max_len is None else max_len
    if max_len > mcfg.max_positions:
        raise ExportError(f"max_len {max_len} exceeds the model's positional table: model.max_positions="
                          f"{mcfg.max_positions} is the longest sequence {art.path} accepts")
    if max_len < 3:
        raise ExportError(f"max_len must be >= 3 (<sos>, one piece, <eos>), got {max_len}")
    model = art.model()

    out = Path(out_dir)
    _prepare_out(out)
    tmp = Path(tempfile.mkdtemp(dir=out.parent, prefix=f".{out.name}.tmp-"))
    try:
        fp32_path = tmp / ("fp32.onnx" if precision != "fp32" or save_optimized else MODEL_FILE)
        graph = export_onnx(model, fp32_path, max_len, opset, fuse_attention)
        check_graph(graph, mcfg.num_classes, "exported fp32 graph")
        opset_used = next(o.version for o in graph.opset_import if o.domain in ("", "ai.onnx"))
        opset_imports = {o.domain or "ai.onnx": o.version for o in graph.opset_import}
        del graph
        final = tmp / MODEL_FILE
        staged = fp32_path
        if precision == "int8":
            staged = tmp / ("int8.onnx" if save_optimized else MODEL_FILE)
            quantize_int8(fp32_path, staged, per_channel=per_channel, reduce_range=reduce_range)
        elif precision == "fp16":
            staged = tmp / ("fp16.onnx" if save_optimized else MODEL_FILE)
            convert_fp16(fp32_path, staged)
        if save_optimized:
            # onnxruntime writes the graph it optimised, so a server skips that work at load time. Measured: at
            # BASIC the dynamo graph (already folded by onnxscript) comes back with the same nodes; see
            # docs/BENCHMARKS.md (Export).
            open_session(staged, optimize, prefer_gpu=False, optimized_out=final)
        for p in (fp32_path, staged):
            if p != final:
                p.unlink(missing_ok=True)
        check_graph(onnx.load(str(final)), mcfg.num_classes, f"{precision} graph")
        shutil.copytree(art.tokenizer_dir, tmp / "tokenizer")

        validation = _validate_bundle(model, final, precision, optimize, max_len, mcfg.vocab_size, mcfg.pad_id)
        if data_file is not None:
            validation["data"] = _data_check(model, final, precision, optimize, tmp / "tokenizer", Path(data_file),
                                             label_values, max_len, mcfg.pad_id, data_limit)
        inputs, outputs = expected_io(mcfg.num_classes)
        manifest = {
            "format": FORMAT,
            "task": TASK,
            "labels": label_names,
            "label_values": label_values,
            "max_len": max_len,
            "special_ids": dict(tok_meta.get("specials", {"sos": 0, "pad": 1, "eos": 2, "oov": 3})),
            "opset": opset_used,
            "opset_imports": opset_imports,
            "precision": precision,
            "inputs": inputs,
            "outputs": outputs,
            "runtime": {"graph_optimization_level": optimize, "optimized_offline": save_optimized,
                        "fused_attention": fuse_attention,
                        "quantization": ({"method": "dynamic", "weight_type": "int8", "per_channel": per_channel,
                                          "reduce_range": reduce_range} if precision == "int8" else None)},
            "files": _file_checksums(tmp),
            "source_artifact": {
                "path": str(art.path.resolve()),
                "weights_sha256": art.meta.get("weights_sha256"),
                "created": art.meta.get("created"),
                "preset": art.cfg.preset,
                "parameters": art.meta.get("parameters"),
                "model": asdict(mcfg),
            },
            "versions": versions(),
            "validation": validation,
            "created": dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"),
            "export_seconds": round(time.perf_counter() - t0, 2),
        }
        write_text_atomic(tmp / MANIFEST_FILE, json.dumps(manifest, indent=2) + "\n")
        replace_dir(tmp, out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return out


def _validate_bundle(model: nn.Module, path: Path, precision: str, level: str, max_len: int, vocab_size: int,
                     pad_id: int) -> dict[str, Any]:
    """Validation on CPU (the deterministic reference); an fp16 graph the CPU provider cannot run is validated on
    CUDA when present, and otherwise the manifest says it was not validated."""
    tol = TOLERANCES[precision]
    base = {"reference": "PyTorch fp32 eager (trainer.model.Classifier)", "graph_optimization_level": level,
            "tolerance": asdict(tol)}
    try:
        session = open_session(path, level, prefer_gpu=False)
        result = validate(model, session, precision, max_len, vocab_size, pad_id)
    except (OrtFail, OrtNotImplemented) as e:
        if precision != "fp16":
            raise
        if not cuda_present():
            return {**base, "passed": None, "skipped": f"onnxruntime's CPU provider cannot run this fp16 graph "
                                                       f"and no CUDA device is present: {e}"}
        session = open_session(path, level, prefer_gpu=True)
        result = validate(model, session, precision, max_len, vocab_size, pad_id)
    return {**base, "provider": session.get_providers()[0], "passed": True, **result}


def _data_check(model: nn.Module, path: Path, precision: str, level: str, tokenizer_dir: Path, data_file: Path,
                label_values: list[str], max_len: int, pad_id: int, limit: int) -> dict[str, Any]:
    """Accuracy change on a labelled file, held to the precision's tolerance."""
    tol = TOLERANCES[precision]
    seqs, labels = _encode_file(tokenizer_dir, data_file, label_values, max_len, limit)
    session = open_session(path, level, prefer_gpu=False)
    report = score_data(session, model, seqs, labels, pad_id)
    report["file"] = str(data_file)
    drop = -report["accuracy_change_points"]
    if report["label_agreement"] < tol.min_data_agreement or drop > tol.max_accuracy_drop:
        raise ExportValidationError(
            f"{precision} bundle on {data_file} ({report['examples']} examples): label agreement with PyTorch "
            f"{report['label_agreement']:.2%} (required >= {tol.min_data_agreement:.1%}), accuracy "
            f"{report['bundle_accuracy']:.2f} vs {report['torch_accuracy']:.2f} (drop allowed "
            f"<= {tol.max_accuracy_drop} points)")
    return report


# ---------------------------------------------------------------------------------------------- verify / check


def verify_bundle(path: str | Path) -> dict[str, Any]:
    """Check a bundle folder against its manifest; return the manifest. Raises BundleError naming the file.
    (serving/ has its own torch-free loader; this one backs `export --check`.)"""
    path = Path(path)
    mpath = path / MANIFEST_FILE
    if not path.is_dir():
        raise BundleError(f"bundle folder not found: {path}")
    if not mpath.is_file():
        raise BundleError(f"{path}: missing {MANIFEST_FILE} (not a bundle, or an interrupted export)")
    try:
        manifest = json.loads(mpath.read_text(encoding="utf-8"))
    except json.JSONDecodeError as e:
        raise BundleError(f"{mpath}: invalid JSON at line {e.lineno}: {e.msg}") from None
    if manifest.get("format") != FORMAT:
        raise BundleError(f"{mpath}: format {manifest.get('format')!r}, expected {FORMAT}")
    if manifest.get("precision") not in PRECISIONS:
        raise BundleError(f"{mpath}: precision {manifest.get('precision')!r}, expected one of {PRECISIONS}")
    files = manifest.get("files")
    if not isinstance(files, dict) or MODEL_FILE not in files:
        raise BundleError(f"{mpath}: 'files' must map {MODEL_FILE} and the tokenizer files to sha256 checksums")
    for name, digest in files.items():
        f = path / name
        if not f.is_file():
            raise BundleError(f"{f}: listed in {MANIFEST_FILE} but missing")
        if sha256_file(f) != digest:
            raise BundleError(f"{f}: sha256 does not match {MANIFEST_FILE} (corrupt or replaced)")
    try:
        graph = onnx.load(str(path / MODEL_FILE), load_external_data=False)
    except Exception as e:  # protobuf raises its own DecodeError
        raise BundleError(f"{path / MODEL_FILE}: not a readable ONNX model: {e}") from None
    got = {"inputs": _io_spec(graph.graph.input), "outputs": _io_spec(graph.graph.output)}
    for key in ("inputs", "outputs"):
        if manifest.get(key) != got[key]:
            raise BundleError(f"{mpath}: {key} {manifest.get(key)} do not match {MODEL_FILE}'s {got[key]}")
    n_classes = got["outputs"][0]["shape"][-1] if got["outputs"] else None
    if len(manifest.get("labels", [])) != n_classes:
        raise BundleError(f"{mpath}: {len(manifest.get('labels', []))} labels for a model of {n_classes} classes")
    return manifest


def check_bundle(bundle: str | Path, data_file: str | Path, artifact_dir: str | Path | None = None,
                 batch_size: int = 32, limit: int = 0, prefer_gpu: bool = True) -> dict[str, Any]:
    """Accuracy of a bundle on a labelled file, in an onnxruntime session opened the way the server opens it,
    and its agreement with the PyTorch model of `artifact_dir` (default: the manifest's source, if present)."""
    bundle = Path(bundle)
    manifest = verify_bundle(bundle)
    source = artifact_dir or manifest.get("source_artifact", {}).get("path")
    model = None
    if source is not None and Path(source).is_dir():
        art = artifact_mod.load(source)
        if art.task != "classifier":
            raise ExportError(f"{art.path}: task {art.task!r}; --artifact must be a classifier artifact")
        model = art.model()
    elif artifact_dir is not None:
        raise ExportError(f"--artifact {artifact_dir}: not a folder")
    labels_values = manifest.get("label_values") or [str(i) for i in range(len(manifest["labels"]))]
    level = manifest.get("runtime", {}).get("graph_optimization_level", DEFAULT_OPT_LEVEL)
    session = open_session(bundle / MODEL_FILE, level, prefer_gpu=prefer_gpu)
    seqs, labels = _encode_file(bundle / "tokenizer", Path(data_file), labels_values, manifest["max_len"], limit)
    pad_id = manifest.get("special_ids", {}).get("pad", 1)
    report = score_data(session, model, seqs, labels, pad_id, batch_size)
    report.update({"bundle": str(bundle), "precision": manifest["precision"], "file": str(data_file),
                   "provider": session.get_providers()[0],
                   "artifact": str(source) if model is not None else None})
    return report


# ---------------------------------------------------------------------------------------------- CLI


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("artifact", nargs="?", help="classifier artifact folder (from finetune)")
    parser.add_argument("--out", metavar="BUNDLE", help="bundle folder to write (replaced atomically)")
    parser.add_argument("--quantize", choices=["int8"], help="dynamic int8 quantisation (CPU serving)")
    parser.add_argument("--fp16", action="store_true", help="fp16 weights and activations (GPU serving)")
    parser.add_argument("--optimize", choices=sorted(OPT_LEVELS), default=DEFAULT_OPT_LEVEL,
                        help=f"onnxruntime graph optimisation level to validate at and recommend "
                             f"(default: {DEFAULT_OPT_LEVEL})")
    parser.add_argument("--save-optimized", action="store_true",
                        help="store the graph onnxruntime optimised (basic/extended) instead of the raw export")
    parser.add_argument("--no-fuse-attention", dest="fuse_attention", action="store_false",
                        help="keep the exporter's decomposed attention (plain ONNX ops only) instead of one "
                             "onnxruntime com.microsoft.Attention node per layer")
    parser.add_argument("--per-channel", action="store_true", help="int8: per-channel weight scales")
    parser.add_argument("--reduce-range", action="store_true", help="int8: 7-bit weights (older x86 CPUs)")
    parser.add_argument("--max-len", type=int, help="longest sequence served (default: the tokenizer's max_len)")
    parser.add_argument("--data", metavar="FILE",
                        help="labelled file (.spm + .label, .tsv, .jsonl): record the accuracy change on export; "
                             "required with --check")
    parser.add_argument("--limit", type=int, default=0, help="score only the first N examples of --data")
    parser.add_argument("--check", metavar="BUNDLE", help="verify BUNDLE and report its accuracy on --data")
    parser.add_argument("--artifact", dest="check_artifact", metavar="ARTIFACT",
                        help="--check: PyTorch model to compare with (default: the manifest's source artifact)")


def main(args: argparse.Namespace) -> int:
    if args.check:
        if not args.data:
            raise ExportError("--check needs --data FILE (a labelled file)")
        report = check_bundle(args.check, args.data, args.check_artifact or args.artifact, limit=args.limit)
        line = f"{report['bundle']} ({report['precision']}, {report['provider']}): accuracy " \
               f"{report['bundle_accuracy']:.2f}% on {report['examples']} examples of {report['file']}"
        if "torch_accuracy" in report:
            line += (f"; PyTorch {report['torch_accuracy']:.2f}%, label agreement {report['label_agreement']:.2%}, "
                     f"max |logit diff| {report['max_abs_diff']:.3g}")
        else:
            line += "; no source artifact found: pass --artifact to compare with PyTorch"
        print(line)
        return 0
    if not args.artifact or not args.out:
        raise ExportError("export needs ARTIFACT and --out BUNDLE (or --check BUNDLE --data FILE)")
    out = export_bundle(args.artifact, args.out, quantize=args.quantize, fp16=args.fp16, optimize=args.optimize,
                        save_optimized=args.save_optimized, data_file=args.data, max_len=args.max_len,
                        per_channel=args.per_channel, reduce_range=args.reduce_range, data_limit=args.limit,
                        fuse_attention=args.fuse_attention)
    manifest = json.loads((out / MANIFEST_FILE).read_text(encoding="utf-8"))
    v = manifest["validation"]
    print(f"wrote {out} ({manifest['precision']}, opset {manifest['opset']}, max_len {manifest['max_len']}, "
          f"{(out / MODEL_FILE).stat().st_size / 1e6:.1f} MB) in {manifest['export_seconds']} s")
    if v.get("passed"):
        print(f"validated on {v['provider']}: {len(v['cases'])} batches, max |logit diff| {v['max_abs_diff']:.3g} "
              f"(tolerance {v['tolerance']['max_abs_diff']:g}), label agreement {v['label_agreement']:.2%}")
    else:
        print(f"not validated: {v.get('skipped')}", file=sys.stderr)
    if "data" in v:
        d = v["data"]
        print(f"{d['file']}: accuracy {d['bundle_accuracy']:.2f}% vs PyTorch {d['torch_accuracy']:.2f}% "
              f"({d['accuracy_change_points']:+.2f} points), label agreement {d['label_agreement']:.2%}")
    return 0
