"""Ranks, nodes and what they tell each other; no DeepSpeed here (trainer/engine/process.py starts the process group).

- `device_type()` is the one device decision of a rank: CUDA where a CUDA device is usable, else the CPU. The
  process group (`BACKENDS`), DeepSpeed's accelerator (DS_ACCELERATOR, set from it before DeepSpeed is imported:
  trainer/engine/accelerator.py) and the module's device all follow it.
- `prepare_env()` fills the variables torch.distributed reads, under the DeepSpeed launcher, torchrun, Slurm or plain
  `python`; `dist_info()` reads them back as a `DistInfo` (usable before the process group exists: the data of a run
  is made ready before it, see trainer/tasks/pretrain.py).
- `rank()`, `is_main()`, `barrier()`, `all_reduce_sum()`: the few collectives the loops use.
- `agree()`: every rank contributes a problem (or none) and every rank gets the first one, so a fault seen on one
  node stops all of them with the same line instead of leaving the others waiting for a peer that has exited.
- `file_lock()`: one process at a time in a folder, across the ranks of a node or of every node that shares it,
  with no process group and so no collective timeout, however long the holder works.
- `hold_run()`: one run at a time in a run folder, for the whole run (taken by rank 0, released when it exits).
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import os
import socket
import subprocess
import sys
import time
from collections.abc import Iterator, MutableMapping
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist

from trainer.config.schema import ConfigError

_REPO = Path(__file__).resolve().parents[2]  # a checkout's root: trainer/engine/distributed.py
AGREE_BYTES = 1024  # the longest problem line `agree` carries (UTF-8 bytes; longer ones are cut)
# The process group's backend per device decision. On CUDA, one backend per device type: NCCL for CUDA tensors, gloo
# for CPU ones. Since PyTorch 2.7 an NCCL-only group refuses a CPU tensor ("No backend type associated with device
# type cpu"); with gloo beside it the host-side collectives (the stop flag, `agree`, the log row's sums: a few bytes)
# stay on the host, with no copy to the GPU and no wait on its stream, and a DeepSpeed path that hands a collective a
# CPU tensor works instead of stopping the run.
BACKENDS = {"cpu": "gloo", "cuda": "cpu:gloo,cuda:nccl"}


class EngineConfigError(ConfigError):
    """The training setup is invalid (a DeepSpeed JSON, or the launcher's environment); the message names the file,
    the key or the variable."""


def process_defaults(env: MutableMapping[str, str] = os.environ) -> dict[str, str]:
    """Environment defaults a training process needs before DeepSpeed compiles an op; `init_distributed` applies
    them to os.environ. Returns the variables it set or changed.

    - TORCH_EXTENSIONS_DIR: a checkout keeps DeepSpeed's JIT cache (ops compiled on first use) beside the code,
      as the Makefile does; an installed package leaves DeepSpeed's default (~/.cache/torch_extensions).
    - PATH: torch's JIT runs the first `ninja` on PATH, and two ninjas (the venv's, the system's) sharing one
      .ninja_log rebuild the op at every switch: the one beside this interpreter goes first.
    """
    changed: dict[str, str] = {}
    if (_REPO / "pyproject.toml").exists() and "TORCH_EXTENSIONS_DIR" not in env:
        changed["TORCH_EXTENSIONS_DIR"] = str(_REPO / ".cache" / "torch_extensions")
    here = str(Path(sys.executable).parent)
    if (Path(here) / "ninja").exists() and env.get("PATH", "").split(os.pathsep)[0] != here:
        changed["PATH"] = here + os.pathsep + env.get("PATH", "")
    env.update(changed)
    return changed


@dataclass(frozen=True)
class DistInfo:
    rank: int
    world_size: int
    local_rank: int
    local_size: int
    backend: str
    device: torch.device

    @property
    def node(self) -> str:
        """This rank's node as a log line names it: "node 1 (gpu07)"."""
        return f"node {node_index(self)} ({socket.gethostname()})"


def prepare_env(env: MutableMapping[str, str]) -> list[str]:
    """Fill the variables torch.distributed reads (RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR, MASTER_PORT) in `env`.

    Under the DeepSpeed launcher or torchrun they are already set. Under Slurm (`srun`, or `deepspeed --launcher
    slurm`, which sets no RANK) they come from SLURM_PROCID / SLURM_NTASKS / SLURM_LOCALID and the job's first node.
    Under Kubeflow Trainer's TrainJob (torch runtime) with one process per pod, the pod is the rank: PET_NODE_RANK /
    PET_NNODES / PET_MASTER_ADDR / PET_MASTER_PORT, the variables it sets for torchrun (deploy/train/README.md).
    Under plain `python` this is one process on loopback with a free port. Returns the names it set.
    """
    set_: list[str] = []

    def default(name: str, value: str) -> None:
        if name not in env:
            env[name] = value
            set_.append(name)

    if "RANK" not in env and "SLURM_PROCID" in env and "SLURM_NTASKS" in env:
        default("RANK", env["SLURM_PROCID"])
        default("WORLD_SIZE", env["SLURM_NTASKS"])
        default("LOCAL_RANK", env.get("SLURM_LOCALID", "0"))
        if "SLURM_NTASKS_PER_NODE" in env:
            default("LOCAL_SIZE", env["SLURM_NTASKS_PER_NODE"].split("(")[0].split(",")[0])
        default("MASTER_ADDR", _slurm_first_host(env.get("SLURM_JOB_NODELIST", env.get("SLURM_NODELIST", ""))))
        # Every rank must pick the same port without talking: derive it from the job id.
        default("MASTER_PORT", str(20000 + int(env.get("SLURM_JOB_ID", "0")) % 20000))
    if "RANK" not in env and "PET_NODE_RANK" in env and "PET_NNODES" in env:
        if env.get("PET_NPROC_PER_NODE", "1") != "1":
            raise EngineConfigError(
                f"PET_NPROC_PER_NODE={env['PET_NPROC_PER_NODE']}: a pod of several ranks needs a launcher; run "
                "`torchrun --module trainer ...` (it reads PET_*), or give the TrainJob numProcPerNode: 1"
            )
        default("RANK", env["PET_NODE_RANK"])
        default("WORLD_SIZE", env["PET_NNODES"])
        default("LOCAL_RANK", "0")
        default("LOCAL_SIZE", "1")
        default("MASTER_ADDR", env.get("PET_MASTER_ADDR", "127.0.0.1"))
        if "PET_MASTER_PORT" in env:
            default("MASTER_PORT", env["PET_MASTER_PORT"])
    default("RANK", "0")
    default("WORLD_SIZE", "1")
    default("LOCAL_RANK", "0")
    default("LOCAL_SIZE", env.get("LOCAL_WORLD_SIZE", env["WORLD_SIZE"]))  # torchrun names it LOCAL_WORLD_SIZE
    default("MASTER_ADDR", "127.0.0.1")
    if "MASTER_PORT" not in env:
        if env["WORLD_SIZE"] != "1":
            raise EngineConfigError(
                f"MASTER_PORT is not set for a world of {env['WORLD_SIZE']} processes: start the ranks with "
                "`deepspeed`, `torchrun` or `srun`, or set MASTER_ADDR and MASTER_PORT"
            )
        default("MASTER_PORT", str(free_port()))
    return set_


def _slurm_first_host(nodelist: str) -> str:
    """First host of a Slurm node list ("gpu[07-09,12],cpu1" -> "gpu07"); scontrol when available."""
    if not nodelist:
        return "127.0.0.1"
    try:
        out = subprocess.run(["scontrol", "show", "hostnames", nodelist], capture_output=True, text=True,
                             timeout=10, check=True).stdout.split()
        if out:
            return out[0]
    except (OSError, subprocess.SubprocessError):
        pass
    first = nodelist.split(",")[0] if "[" not in nodelist.split(",")[0] else nodelist
    if "[" in first:
        prefix, rest = first.split("[", 1)
        return prefix + rest.split(",")[0].split("-")[0].rstrip("]")
    return first


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def device_type() -> str:
    """The device this process trains on: "cuda" where a CUDA device is usable, else "cpu". The one decision the
    process group, DeepSpeed's accelerator and the module all follow. A node's GPUs hidden with CUDA_VISIBLE_DEVICES=
    (empty) make it train on its CPU."""
    return "cuda" if torch.cuda.is_available() and torch.cuda.device_count() > 0 else "cpu"


def dist_info() -> DistInfo:
    rank, local_rank = int(os.environ.get("RANK", 0)), int(os.environ.get("LOCAL_RANK", 0))
    world = int(os.environ.get("WORLD_SIZE", 1))
    local_size = int(os.environ.get("LOCAL_SIZE", world))
    kind = device_type()
    device = torch.device("cuda", local_rank % torch.cuda.device_count()) if kind == "cuda" else torch.device("cpu")
    return DistInfo(rank, world, local_rank, local_size, BACKENDS[kind], device)


def node_index(info: DistInfo) -> int:
    """This rank's node: the launcher's own number where it gives one (DeepSpeed's CROSS_RANK, torchrun's
    GROUP_RANK, Slurm's SLURM_NODEID), else rank // local_size (launchers number ranks node by node)."""
    for name in ("CROSS_RANK", "GROUP_RANK", "SLURM_NODEID"):
        if os.environ.get(name, "").isdigit():
            return int(os.environ[name])
    return (info.rank - info.local_rank) // max(1, info.local_size)


def rank() -> int:
    return dist.get_rank() if dist.is_initialized() else int(os.environ.get("RANK", 0))


def world_size() -> int:
    return dist.get_world_size() if dist.is_initialized() else int(os.environ.get("WORLD_SIZE", 1))


def is_main() -> bool:
    """Only rank 0 logs, plots and writes artifacts; every rank writes its engine-checkpoint shards."""
    return rank() == 0


def barrier() -> None:
    if dist.is_initialized() and dist.get_world_size() > 1:
        dist.barrier()


def host_collectives() -> bool:
    """The default group takes CPU tensors: gloo, or a backend per device type that includes one for the CPU
    (`BACKENDS`). False for an NCCL-only group that someone else started before us."""
    backend = str(dist.get_backend())
    return backend == "gloo" or "cpu:" in backend


def _collective_device() -> str:
    return "cpu" if host_collectives() else "cuda"


def all_reduce_sum(values: list[float]) -> list[float]:
    """Sum a few host floats over ranks (fp64; on the host where the group allows it)."""
    if not (dist.is_initialized() and dist.get_world_size() > 1):
        return [float(v) for v in values]
    t = torch.tensor(values, dtype=torch.float64).to(_collective_device())
    dist.all_reduce(t)
    return t.cpu().tolist()


def all_gather_bytes(data: bytes, size: int = AGREE_BYTES) -> list[bytes]:
    """Every rank's `data` (cut to `size` bytes), in rank order. Fixed-size uint8 tensors, nothing pickled."""
    data = data[:size]
    if not (dist.is_initialized() and dist.get_world_size() > 1):
        return [data]
    row = np.zeros(4 + size, dtype=np.uint8)  # (4 + size,) little-endian length, then the bytes
    row[:4] = np.frombuffer(len(data).to_bytes(4, "little"), dtype=np.uint8)
    row[4:4 + len(data)] = np.frombuffer(data, dtype=np.uint8)
    buf = torch.from_numpy(row).to(_collective_device())
    out = [torch.empty_like(buf) for _ in range(dist.get_world_size())]
    dist.all_gather(out, buf)
    rows = [t.cpu().numpy().tobytes() for t in out]
    return [r[4:4 + int.from_bytes(r[:4], "little")] for r in rows]


def agree(problem: str) -> str:
    """Collective: every rank passes its problem ("" for none) and gets the first rank's non-empty one ("" when no
    rank has one). Call it on every rank, including those with nothing to report."""
    for p in all_gather_bytes(problem.encode("utf-8")):
        if p:
            return p.decode("utf-8", errors="replace")
    return ""


RUN_LOCK = ".run.lock"  # in a run folder: held by the rank 0 of the run that writes it
_held_runs: dict[Path, int] = {}  # run folders whose lock this process holds -> the descriptor holding it


def hold_run(run_dir: Path) -> str:
    """Lock `run_dir` for this process' lifetime (rank 0 of a run calls it before writing anything there); "" when
    held, else the one line why not, naming the process that holds it. Two runs in one folder (a job started twice,
    a replacement pod while the old one still runs) would interleave their checkpoints, `latest` and logs: the second
    stops before writing. A POSIX lock, as `file_lock`: it works over NFS and goes when its process dies, so a killed
    run never leaves it stale and `--resume` continues at once."""
    path = (run_dir / RUN_LOCK).resolve()
    if path in _held_runs:
        return ""
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o666)
    try:
        fcntl.lockf(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError as e:
        said = os.read(fd, 512).decode("utf-8", "replace").splitlines()  # ours, or whatever is in the file
        holder = (said[0].strip()[:200] if said else "") or "a process that has not said which"
        os.close(fd)
        if e.errno in (errno.EACCES, errno.EAGAIN):
            return (f"{run_dir} is being written by another run ({holder}): two runs in one folder would overwrite "
                    "each other's checkpoints; wait for it to end or stop it, then --resume, or choose another --out")
        if e.errno in (errno.ENOLCK, errno.ENOSYS, errno.EOPNOTSUPP, errno.EINVAL):
            print(f"warning: {run_dir}: this filesystem does not support file locks ({e.strerror}): a second run "
                  "into this folder would not be noticed", file=sys.stderr)
            return ""
        raise
    os.ftruncate(fd, 0)  # the holder, for the message of a run that finds it taken
    os.write(fd, f"pid {os.getpid()} on {socket.gethostname()} since {time.strftime('%Y-%m-%d %H:%M:%S %Z')}\n"
             .encode())
    _held_runs[path] = fd  # never closed: closing any descriptor of the file would release the lock
    return ""


@contextlib.contextmanager
def file_lock(path: Path) -> Iterator[None]:
    """Hold an exclusive lock on `path` (created if missing): one process at a time, among the ranks of a node and
    among nodes that see the same folder (POSIX locks work over NFS; the lock goes when its process dies, so a
    killed holder never leaves it stale). Blocks without a timeout: no process group is involved."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o666)
    try:
        try:
            fcntl.lockf(fd, fcntl.LOCK_EX)
        except OSError as e:
            if e.errno in (errno.ENOLCK, errno.ENOSYS, errno.EOPNOTSUPP, errno.EINVAL):
                raise EngineConfigError(
                    f"{path}: this filesystem does not support file locks ({e.strerror}): prepare the corpus "
                    "first (python -m trainer prepare) and pass --set data.prepared=DIR") from None
            raise
        yield
    finally:
        os.close(fd)  # releases the lock
