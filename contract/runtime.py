"""How onnxruntime opens a bundle's graph: optimisation levels by name, execution providers, session options.

The exporter validates a graph at one level and records it in the manifest (runtime.graph_optimization_level);
the server opens the graph at that level unless told otherwise, on the providers chosen here.

CUDA: onnxruntime-gpu's CUDA provider is a shared library (capi/libonnxruntime_providers_cuda.so) that needs the
CUDA and cuDNN libraries of the major version it was built for (`onnxruntime.cuda_version`: 13.0 for 1.31).
pip installs them as nvidia-* wheels (onnxruntime-gpu's `cuda` and `cudnn` extras, which torch's CUDA build
depends on too) under site-packages/nvidia/*/lib, where the loader does not look: `providers` loads them first.
When the provider still does not load, `cuda_unavailable_reason` names the library that is missing.
"""

from __future__ import annotations

import contextlib
import ctypes
import functools
import io
import logging
import platform
from pathlib import Path
from typing import Literal

import onnxruntime as ort

log = logging.getLogger(__name__)

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
CUDA_PROVIDER_LIBRARY = "libonnxruntime_providers_cuda.so"
DRIVER_LIBRARY = "libcuda.so.1"  # the NVIDIA driver's: the node (or the container runtime) provides it, no wheel
CUDNN_LIBRARY = "libcudnn.so.9"  # loaded by the provider when it starts, not named among its ELF dependencies


def x86_without_vnni(cpuinfo: str | Path = "/proc/cpuinfo") -> bool:
    """True on an x86 CPU known to lack VNNI (AVX2; AVX-512 without VNNI), where onnxruntime's u8 x s8 kernel sums
    pairs of products in int16 (VPMADDUBSW) and 8-bit int8 weights overflow it (docs/BENCHMARKS.md, Export). False
    on other CPUs and where the flags cannot be read (not Linux)."""
    if platform.machine().lower() not in ("x86_64", "amd64"):
        return False
    try:
        text = Path(cpuinfo).read_text(encoding="utf-8", errors="replace")
    except OSError:
        return False
    flags = next((line.split(":", 1)[1].split() for line in text.splitlines() if line.startswith("flags")), None)
    return flags is not None and not {"avx512_vnni", "avx_vnni"} & set(flags)


def cuda_driver_present() -> bool:
    """True when onnxruntime offers CUDA and the NVIDIA driver library loads. onnxruntime-gpu lists
    CUDAExecutionProvider even on machines without a GPU, and when asked for it there, logs an error and falls back
    to the CPU: 'auto' asks for CUDA only where a driver exists, and callers trust `session.get_providers()`."""
    if CUDA not in ort.get_available_providers():
        return False
    try:
        ctypes.CDLL(DRIVER_LIBRARY)
    except OSError:
        return False
    return True


@functools.cache
def load_cuda_libraries() -> None:
    """Load the CUDA and cuDNN libraries that pip put beside onnxruntime (site-packages/nvidia/*/lib) into this
    process, by onnxruntime's own `preload_dlls`, so that the CUDA provider's dependencies resolve by soname: the
    provider library carries no search path, and only an `import torch` would otherwise have loaded them. Libraries
    on the loader's own path (LD_LIBRARY_PATH, ld.so.conf: the GPU image's) are taken from there. Once per process;
    what onnxruntime prints about a library it could not load goes to the debug log, and `cuda_unavailable_reason`
    says what is missing if the provider then fails."""
    printed = io.StringIO()
    try:
        with contextlib.redirect_stdout(printed):
            ort.preload_dlls()
    except Exception as e:  # never fatal: the provider's own load is the test that counts
        printed.write(f"onnxruntime.preload_dlls: {e}")
    if printed.getvalue().strip():
        log.debug("onnxruntime.preload_dlls: %s", " ".join(printed.getvalue().split()))


def providers(device: Device) -> list[str]:
    """'auto': CUDA first where a driver exists, else CPU; 'cuda': CUDA first (onnxruntime falls back when it
    cannot load it: compare `session.get_providers()`, and ask `cuda_unavailable_reason` why); 'cpu': CPU only.
    Asking for CUDA loads the CUDA libraries pip installed (`load_cuda_libraries`)."""
    if device == "cpu":
        return [CPU]
    if device not in ("auto", "cuda"):
        raise ValueError(f"device must be 'auto', 'cpu' or 'cuda', got {device!r}")
    if device == "auto" and not cuda_driver_present():
        return [CPU]
    load_cuda_libraries()
    return [CUDA, CPU]


def _build_cuda() -> str:
    """The CUDA version this onnxruntime was built for ('13.0'), '' for a CPU build."""
    return str(getattr(ort, "cuda_version", "") or "")


def cuda_library_problem() -> str | None:
    """None when onnxruntime's CUDA provider library, every library it needs and cuDNN load in this process;
    otherwise one line that names what is missing: the GPU package, a CUDA or cuDNN library (the loader's own
    message, e.g. 'libcublasLt.so.13: cannot open shared object file'), or the driver."""
    version = ort.__version__
    if CUDA not in ort.get_available_providers():
        return (f"this onnxruntime {version} is a CPU build (no {CUDA}): install onnxruntime-gpu "
                "(pip install 'onnxruntime-gpu[cuda,cudnn]', README.md, Install)")
    major = _build_cuda().split(".")[0] or "?"
    fix = (f"(onnxruntime-gpu {version} is built for CUDA {major} and cuDNN 9: pip install "
           f"'onnxruntime-gpu[cuda,cudnn]=={version}', or put them on LD_LIBRARY_PATH; README.md, Install)")
    load_cuda_libraries()
    provider = Path(ort.__file__).parent / "capi" / CUDA_PROVIDER_LIBRARY
    try:
        ctypes.CDLL(str(provider))
    except OSError as e:  # the loader's message names the first dependency it could not open
        missing = " ".join(str(e).split())
        if DRIVER_LIBRARY in missing:
            return (f"{CUDA_PROVIDER_LIBRARY} cannot load: {DRIVER_LIBRARY} is missing, the NVIDIA driver's "
                    "library: no NVIDIA driver here, or the container was started without the GPU (docker --gpus, "
                    f"the NVIDIA device plugin) ({missing})")
        return f"{CUDA_PROVIDER_LIBRARY} cannot load: {missing} {fix}"
    try:
        ctypes.CDLL(CUDNN_LIBRARY)
    except OSError as e:
        return f"cuDNN cannot load: {' '.join(str(e).split())} {fix}"
    return None


def cuda_unavailable_reason() -> str:
    """Why onnxruntime's CUDA provider does not run in this process, on one line (`cuda_library_problem`, else what
    remains). Asked after onnxruntime fell back to the CPU: onnxruntime logs the failure on stderr among its other
    lines, this puts it in the error or warning the user reads."""
    major = _build_cuda().split(".")[0] or "?"
    return cuda_library_problem() or (
        f"the CUDA provider's libraries load, but onnxruntime could not start it (no usable GPU, or a driver older "
        f"than CUDA {major} needs): onnxruntime's log above says why")


def inference_session(model: bytes | str | Path, level: str = DEFAULT_OPT_LEVEL, device: Device = "auto",
                      intra_op_threads: int = 0, inter_op_threads: int = 0, spinning: bool | None = None,
                      optimized_out: str | Path | None = None) -> ort.InferenceSession:
    """A graph (its bytes, or its file) in an onnxruntime session with `session_options`, on `providers(device)`."""
    options = session_options(level, intra_op_threads, inter_op_threads, spinning, optimized_out)
    return ort.InferenceSession(model if isinstance(model, bytes) else str(model), options,
                                providers=providers(device))


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
