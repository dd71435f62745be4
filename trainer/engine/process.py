"""How a process becomes a DeepSpeed rank and how it ends.

- `local_env()`: what this rank is, from its environment alone (usable before the process group exists), and a check
  that DeepSpeed's accelerator is the device it trains on.
- `init_distributed()`: the process group, under the DeepSpeed launcher, torchrun, Slurm or plain `python`: NCCL
  (with gloo for CPU tensors) on a GPU, gloo on a CPU.
- `finish()`: how every rank's entry point ends (gloo ranks can abort at a normal interpreter exit).
"""

from __future__ import annotations

import datetime as dt
import logging
import os
import platform
import sys
from typing import NoReturn

import torch
import torch.distributed as dist

from trainer.engine.accelerator import check_accelerator, deepspeed
from trainer.engine.distributed import DistInfo, dist_info, prepare_env, process_defaults


def local_env() -> DistInfo:
    """This rank from its environment (`process_defaults`, `prepare_env`), its accelerator checked: e.g. to prepare a
    corpus before the process group exists, with no collective waiting on it."""
    process_defaults(os.environ)
    prepare_env(os.environ)
    info = dist_info()
    check_accelerator(info)
    return info


def init_distributed(timeout_s: int = 1800) -> DistInfo:
    """Make this process a rank: `local_env()`, then start (or join) the process group (distributed.BACKENDS).
    Safe to call twice."""
    info = local_env()
    if info.device.type == "cpu" and "OMP_NUM_THREADS" not in os.environ:
        # Ranks sharing a CPU would each start a thread per core: split the cores between them instead.
        # (`deepspeed --bind_cores_to_rank` sets OMP_NUM_THREADS itself and pins each rank with numactl.)
        torch.set_num_threads(max(1, len(os.sched_getaffinity(0)) // info.local_size))
    if info.device.type == "cuda":
        torch.cuda.set_device(info.device)
    # DeepSpeed logs every config key at INFO; our own log lines (rank 0) say what matters.
    deepspeed.utils.logger.setLevel(logging.WARNING if info.rank == 0 else logging.ERROR)
    if info.device.type == "cpu":
        _skip_shm_allreduce()
    if not dist.is_initialized():
        deepspeed.init_distributed(dist_backend=info.backend, auto_mpi_discovery=False, verbose=False,
                                   timeout=dt.timedelta(seconds=timeout_s))
    return info


def _skip_shm_allreduce() -> None:
    """Keep DeepSpeed's CPU backend from building and starting its shared-memory all-reduce (deepspeed_shm_comm).

    It serves `inference_all_reduce` only (training all-reduces go through gloo), yet costs a g++ build on first use
    and a /dev/shm segment per rank that is never unlinked; where /dev/shm is small a rank dies writing it and its
    peers wait for ever."""
    deepspeed.ops.__compatible_ops__["deepspeed_shm_comm"] = False  # DeepSpeed's switch: build_shm_op() -> None


def finish(code: int = 0) -> NoReturn:
    """End a rank: barrier, destroy the process group, flush, `os._exit(code)`.

    A normal interpreter exit lets gloo ranks abort intermittently ("terminate called without an active exception",
    launcher rc 250). On failure the barrier is skipped: the other ranks may never reach it (the launcher stops them
    when one rank exits non-zero)."""
    try:
        if dist.is_initialized():
            if code == 0:
                dist.barrier()
            dist.destroy_process_group()
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)


def package_versions() -> dict[str, str]:
    """The versions a run's env.json records."""
    import numpy

    out = {"python": platform.python_version(), "torch": torch.__version__, "deepspeed": deepspeed.__version__,
           "numpy": numpy.__version__}
    try:
        import sentencepiece

        out["sentencepiece"] = sentencepiece.__version__
    except ImportError:
        pass
    return out
