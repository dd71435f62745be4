"""Stage 2: a graph in a lower precision than the fp32 it was exported in (dynamic int8 quantisation, fp16
conversion), and the tolerance each precision of a bundle (fp32, int8, fp16) is held to against PyTorch fp32 eager.
(The format a run trains in is trainer/engine/precision.py's.)"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import onnx

from contract.manifest import PRECISIONS

__all__ = ["INT8_CPU_BOUND", "PRECISIONS", "TOLERANCES", "Tolerance", "convert_fp16", "quantize_int8"]


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

    def __post_init__(self) -> None:
        for name in ("max_abs_diff", "rel_diff", "max_accuracy_drop"):
            value = getattr(self, name)
            if not np.isfinite(value) or value < 0:
                raise ValueError(f"tolerance {name} must be a finite number >= 0, got {value}")
        if not 0 <= self.min_data_agreement <= 1:
            raise ValueError(f"tolerance min_data_agreement must be in [0, 1], got {self.min_data_agreement}")


# fp32 differs from PyTorch by rounding only, fp16 by its 10-bit mantissa, int8 (dynamic, per-tensor) by its
# quantisation: what each measured is in docs/BENCHMARKS.md (Export). What a user sees is the label, so a
# labelled --data set is held to agreement and accuracy.
TOLERANCES: dict[str, Tolerance] = {
    "fp32": Tolerance(max_abs_diff=1e-4, rel_diff=0.0, min_data_agreement=0.999, max_accuracy_drop=0.1),
    "fp16": Tolerance(max_abs_diff=1e-2, rel_diff=1e-2, min_data_agreement=0.995, max_accuracy_drop=0.5),
    "int8": Tolerance(max_abs_diff=5e-2, rel_diff=5e-2, min_data_agreement=0.98, max_accuracy_drop=1.0),
}
assert set(TOLERANCES) == set(PRECISIONS)

# `export`'s default writes the int8 graph as the CPU graph only within this bound (the user did not ask for int8, so
# it is tighter on labelled data than TOLERANCES["int8"]): on every validation batch the int8 tolerance on logits
# and no decided label flipped; with --data, label agreement with PyTorch >= 99% and at most 0.5 accuracy points
# lost (what int8 measured against it: docs/BENCHMARKS.md, Export; docs/RESULTS.md). Beyond it, export says so and
# the CPU serves fp32.
INT8_CPU_BOUND = Tolerance(max_abs_diff=5e-2, rel_diff=5e-2, min_data_agreement=0.99, max_accuracy_drop=0.5)


def quantize_int8(src: Path, dst: Path, per_channel: bool = False, reduce_range: bool = True) -> None:
    """Dynamic int8 quantisation (weights int8 offline, activations at run time); Attention -> QAttention.
    reduce_range: 7-bit weights, export's default (ExportOptions.full_range says why)."""
    from onnxruntime.quantization import QuantType, quantize_dynamic

    model = onnx.load(str(src))
    # The dynamo graph's value_info carries shapes that the quantiser's own inference contradicts ("Inferred shape
    # and existing shape differ"): drop them, onnxruntime re-infers what it needs.
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
