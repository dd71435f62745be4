"""Which number format a run trains in: `engine.precision` = fp32, bf16 or auto.

bf16 halves the bytes of activations and weight copies and runs matrix multiplies on bf16 units where the hardware
has them: NVIDIA GPUs from Ampere on (`torch.cuda.is_bf16_supported()`), and x86 CPUs with AVX512_BF16 or AMX (the
`avx512_bf16` / `amx_bf16` flags in /proc/cpuinfo). Elsewhere bf16 is emulated, slower than fp32. `auto` is bf16
exactly where those units exist, fp32 elsewhere; what it gains on a given model and machine, and how far its losses
stay from fp32's, is what `bench/train_throughput.py --precisions fp32,bf16` measures side by side in one run
(docs/BENCHMARKS.md, Precision). The rule reads only the hardware, so every rank of a node, and a resumed run on the
same machines, resolve it alike.

bf16 training is torch.autocast over fp32 weights, in the plain loop and in the DeepSpeed engine alike (its
torch_autocast: trainer/engine/ds_config.py says why not DeepSpeed's bf16 mode); the artifact always holds fp32
weights (trainer/engine/deepspeed_engine.py, fp32_state_dict). No torch import at module level: config-level code may
ask.
"""

from __future__ import annotations

import contextlib
from functools import lru_cache
from pathlib import Path
from typing import TYPE_CHECKING, Literal

if TYPE_CHECKING:
    import torch

Precision = Literal["fp32", "bf16"]
CPU_BF16_FLAGS = ("avx512_bf16", "amx_bf16")  # /proc/cpuinfo flags of native bf16 dot products on x86


@lru_cache(maxsize=1)
def cpu_has_bf16(cpuinfo: str = "/proc/cpuinfo") -> bool:
    """The CPU multiplies bf16 natively (AVX512_BF16 or AMX); False where /proc/cpuinfo is absent (not Linux)."""
    try:
        flags = next((ln.split(":", 1)[1].split() for ln in Path(cpuinfo).read_text().splitlines()
                      if ln.startswith("flags")), [])
    except OSError:
        return False
    return any(f in flags for f in CPU_BF16_FLAGS)


def has_bf16(cuda: bool) -> bool:
    """bf16 runs on native units of the device a rank trains on (a CUDA GPU when `cuda`, else the CPU)."""
    if cuda:
        import torch

        return bool(torch.cuda.is_bf16_supported(including_emulation=False))
    return cpu_has_bf16()


def resolve(setting: str, cuda: bool) -> Precision:
    """engine.precision -> the format the engine trains in: fp32 and bf16 as set, auto by `has_bf16`."""
    if setting == "auto":
        return "bf16" if has_bf16(cuda) else "fp32"
    if setting not in ("fp32", "bf16"):
        raise ValueError(f"engine.precision must be fp32, bf16 or auto, got {setting!r}")
    return setting  # type: ignore[return-value]


def autocast(prec: Precision, device: torch.device) -> contextlib.AbstractContextManager:
    """For a plain PyTorch loop over fp32 weights: bf16 autocast, or nothing (the DeepSpeed engine applies the same
    autocast itself, from its JSON's torch_autocast)."""
    import torch

    if prec == "bf16":
        return torch.autocast(device.type, dtype=torch.bfloat16)
    return contextlib.nullcontext()
