"""How onnxruntime opens a bundle's graph: optimisation levels by name, execution providers, session options.

The exporter validates a graph at one level and records it in the manifest (runtime.graph_optimization_level);
the server opens the graph at that level unless told otherwise, on the providers chosen here.
"""

from __future__ import annotations

import ctypes
from pathlib import Path
from typing import Literal

import onnxruntime as ort

# By the names the CLIs and the manifest use.
OPT_LEVELS: dict[str, ort.GraphOptimizationLevel] = {
    "disable": ort.GraphOptimizationLevel.ORT_DISABLE_ALL,
    "basic": ort.GraphOptimizationLevel.ORT_ENABLE_BASIC,
    "extended": ort.GraphOptimizationLevel.ORT_ENABLE_EXTENDED,
    "all": ort.GraphOptimizationLevel.ORT_ENABLE_ALL,
}
# BASIC beat ALL for fp32 on a 2-core CPU: bench/export_bench.py measures it, docs/BENCHMARKS.md (Export).
DEFAULT_OPT_LEVEL = "basic"

CUDA, CPU = "CUDAExecutionProvider", "CPUExecutionProvider"
Device = Literal["auto", "cpu", "cuda"]


def cuda_driver_present() -> bool:
    """True when onnxruntime offers CUDA and the NVIDIA driver library loads. onnxruntime-gpu lists
    CUDAExecutionProvider even on machines without a GPU, and when asked for it there, logs an error and falls back
    to the CPU: 'auto' asks for CUDA only where a driver exists, and callers trust `session.get_providers()`."""
    if CUDA not in ort.get_available_providers():
        return False
    try:
        ctypes.CDLL("libcuda.so.1")
    except OSError:
        return False
    return True


def providers(device: Device) -> list[str]:
    """'auto': CUDA first where a driver exists, else CPU; 'cuda': CUDA first (onnxruntime falls back when it
    cannot load it: compare `session.get_providers()`); 'cpu': CPU only."""
    if device == "cpu":
        return [CPU]
    if device == "cuda":
        return [CUDA, CPU]
    if device == "auto":
        return [CUDA, CPU] if cuda_driver_present() else [CPU]
    raise ValueError(f"device must be 'auto', 'cpu' or 'cuda', got {device!r}")


def session_options(level: str, intra_op_threads: int = 0, inter_op_threads: int = 0,
                    spinning: bool | None = None, optimized_out: str | Path | None = None) -> ort.SessionOptions:
    """Options at graph optimisation `level` (a key of OPT_LEVELS); threads 0 = onnxruntime's default (one per
    core). spinning: whether idle intra-op threads spin between runs (None: onnxruntime's default).
    optimized_out: onnxruntime writes the graph it optimised there (offline optimisation)."""
    if level not in OPT_LEVELS:
        raise ValueError(f"graph optimisation level {level!r}; choose one of {sorted(OPT_LEVELS)}")
    so = ort.SessionOptions()
    so.graph_optimization_level = OPT_LEVELS[level]
    so.intra_op_num_threads = intra_op_threads
    so.inter_op_num_threads = inter_op_threads
    if spinning is not None:
        so.add_session_config_entry("session.intra_op.allow_spinning", "1" if spinning else "0")
    if optimized_out is not None:
        so.optimized_model_filepath = str(optimized_out)
    return so
