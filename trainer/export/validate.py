"""Stage 3: onnxruntime against PyTorch on the same batches (batch 1, 2, 13; lengths 1, 7, max; padded rows of
mixed lengths). A difference beyond the precision's tolerance raises ExportValidationError naming the batch.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import numpy as np
import onnxruntime as ort
import torch
from onnxruntime.capi.onnxruntime_pybind11_state import Fail as OrtFail
from onnxruntime.capi.onnxruntime_pybind11_state import NotImplemented as OrtNotImplemented
from torch import nn

from contract.graph import ATTENTION_MASK, INPUT_IDS, LOGITS
from contract.runtime import cuda_driver_present, inference_session
from contract.tokens import EOS, N_SPECIALS, OOV, SOS
from trainer.export.errors import ExportValidationError
from trainer.export.quantize import TOLERANCES, Tolerance


@dataclass
class Case:
    """One validation batch: right-padded ids and the 0/1 attention mask."""

    name: str
    input_ids: np.ndarray  # (B, T) int64
    attention_mask: np.ndarray  # (B, T) int64, 1 = real


def make_batch(lengths: Sequence[int], width: int, vocab_size: int, pad_id: int, rng: np.random.Generator,
               ) -> tuple[np.ndarray, np.ndarray]:
    """(B, width) ids shaped like the tokenizer's output: <sos>, random pieces, <eos>, then <pad>."""
    ids = np.full((len(lengths), width), pad_id, dtype=np.int64)
    mask = np.zeros((len(lengths), width), dtype=np.int64)
    for b, n in enumerate(lengths):
        ids[b, :n] = rng.integers(N_SPECIALS, vocab_size, n) if vocab_size > N_SPECIALS else OOV
        ids[b, 0] = SOS
        if n > 1:
            ids[b, n - 1] = EOS
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
    return session.run([LOGITS], {INPUT_IDS: ids, ATTENTION_MASK: mask})[0]


def compare(ref: np.ndarray, got: np.ndarray, bound: float) -> tuple[float, int, int]:
    """(max |diff|, rows that changed label among the decided ones, near-tie rows). A row is decided when its
    PyTorch top-2 gap is >= 2 * bound: within the bound, only a smaller gap can flip."""
    diff = float(np.abs(ref - got).max()) if ref.size else 0.0
    top2 = np.sort(ref, axis=1)[:, -2:]
    decided = (top2[:, 1] - top2[:, 0]) >= 2 * bound  # (B,)
    flipped = ref.argmax(1) != got.argmax(1)  # (B,)
    return diff, int((flipped & decided).sum()), int((~decided).sum())


def validate(model: nn.Module, session: ort.InferenceSession, precision: str, max_len: int, vocab_size: int,
             pad_id: int, tol: Tolerance | None = None,
             references: dict[str, np.ndarray] | None = None) -> dict[str, Any]:
    """Run every validation case on both; raise ExportValidationError on the first case beyond `tol` (default: the
    precision's). references: PyTorch's logits by case name, filled on first use and reused (one export validates
    several graphs against the same model)."""
    tol = tol or TOLERANCES[precision]
    references = {} if references is None else references
    rows, same, total, worst = [], 0, 0, 0.0
    for case in validation_cases(max_len, vocab_size, pad_id):
        if case.name not in references:
            references[case.name] = torch_logits(model, case.input_ids, case.attention_mask)
        ref = references[case.name]
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


def validate_graph(model: nn.Module, path: Path, precision: str, level: str, max_len: int, vocab_size: int,
                   pad_id: int, tol: Tolerance | None = None,
                   references: dict[str, np.ndarray] | None = None) -> dict[str, Any]:
    """Validation on CPU (the deterministic reference); an fp16 graph the CPU provider cannot run is validated on
    CUDA when present, and otherwise the manifest says it was not validated."""
    tol = tol or TOLERANCES[precision]
    base = {"reference": "PyTorch fp32 eager (trainer.model.encoder.Classifier)", "graph_optimization_level": level,
            "tolerance": asdict(tol)}
    try:
        session = inference_session(path, level, "cpu")
        result = validate(model, session, precision, max_len, vocab_size, pad_id, tol, references)
    except (OrtFail, OrtNotImplemented) as e:
        if precision != "fp16":
            raise
        if not cuda_driver_present():
            return {**base, "passed": None, "skipped": f"onnxruntime's CPU provider cannot run this fp16 graph "
                                                       f"and no CUDA device is present: {e}"}
        session = inference_session(path, level, "auto")
        result = validate(model, session, precision, max_len, vocab_size, pad_id, tol, references)
    return {**base, "provider": session.get_providers()[0], "passed": True, **result}
