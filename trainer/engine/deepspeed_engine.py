"""DeepSpeed, in one place: the only module that imports `deepspeed`.

- `ds_config()` derives DeepSpeed's JSON from our `RunConfig` (micro-batch, accumulation, ZeRO stage, precision,
  Adam/AdamW, clipping); a user's own JSON overrides it key by key, and is checked before DeepSpeed sees it
  (unknown keys and batch sizes that do not divide are errors naming the file and the key).
- `init_distributed()` starts torch.distributed with the same code under the DeepSpeed launcher, torchrun, Slurm
  (`SLURM_PROCID`... mapped to `RANK`...) or plain `python` (one process, loopback defaults): NCCL (with gloo for CPU
  tensors) on GPU, gloo on CPU. `local_env()` is the part of it that needs no process group (what a rank learns from
  its environment), and stops a rank whose DeepSpeed accelerator is not the device it trains on.
- `initialize()` wraps a model into a DeepSpeed engine with our learning-rate schedule.
- `finish()` is how every rank's entry point ends: gloo ranks intermittently abort at interpreter exit
  ("terminate called without an active exception"), so we tear down and leave with `os._exit`.
Ranks, nodes and collectives without DeepSpeed are trainer/engine/distributed.py's (re-exported below: callers say
`eng.rank()`), which precision `auto` means is trainer/engine/precision.py's, the learning-rate schedule is
trainer/engine/schedule.py's.
Importing this module sets only DS_ACCELERATOR (below, where unset); `init_distributed()` sets the rest of a rank's
environment.
"""

from __future__ import annotations

import contextlib
import copy
import functools
import os
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path
from typing import Any, Literal, NoReturn

import torch
import torch.distributed as dist

from trainer.config.schema import EngineConfig, OptimConfig, RunConfig, read_json
from trainer.engine import precision
from trainer.engine.distributed import (  # noqa: F401  (re-exported: the stages call them as eng.*)
    BACKENDS,
    DistInfo,
    EngineConfigError,
    agree,
    all_reduce_sum,
    barrier,
    device_type,
    dist_info,
    free_port,
    hold_run,
    is_main,
    prepare_env,
    process_defaults,
    rank,
    world_size,
)
from trainer.engine.schedule import LrGroup, lr_factor

Stage = Literal["pretrain", "finetune"]

# DeepSpeed picks its accelerator (where it keeps the module, which device its collectives use) while it is imported,
# from DS_ACCELERATOR. It must be the device the process group serves (distributed.device_type): a CPU accelerator
# on a GPU node keeps the module on the CPU and broadcasts CPU tensors over NCCL. The one environment default set at
# import, because it must precede `import deepspeed`; a user's own value that names another device stops the rank
# in `local_env` (one line naming both).
ACCELERATOR_ENV = "DS_ACCELERATOR"
os.environ.setdefault(ACCELERATOR_ENV, device_type())
try:
    import deepspeed  # after DS_ACCELERATOR above
except ValueError as e:  # DeepSpeed's own refusal of a DS_ACCELERATOR value (unknown, or its package missing)
    raise EngineConfigError(f"{ACCELERATOR_ENV}={os.environ[ACCELERATOR_ENV]}: {str(e).rstrip('.')}; unset it: the "
                            f"trainer sets it to the device it trains on ({device_type()} here)") from None
from deepspeed.accelerator import get_accelerator  # noqa: E402
from deepspeed.runtime.config import DeepSpeedConfig  # noqa: E402
from deepspeed.runtime.fp16.loss_scaler import DynamicLossScaler, LossScaler  # noqa: E402
from deepspeed.runtime.zero.config import ZeroStageEnum  # noqa: E402
from deepspeed.utils.tensor_fragment import fragment_address  # noqa: E402

# The only objects besides tensors and plain containers that a DeepSpeed checkpoint may unpickle: what ZeRO 1/2
# optimizer-state files of deepspeed 0.19.8 hold, fp32 and bf16 (torch.serialization.get_unsafe_globals_in_checkpoint
# on them): the loss scaler's state, the ZeRO stage enum, and a (start, numel) namedtuple (BF16_Optimizer's slice
# mappings hold it too); the dynamic loss scaler where a user's DeepSpeed JSON turns fp16 on. Model-state files hold
# none. All are rebuilt from plain values.
SAFE_GLOBALS = (LossScaler, DynamicLossScaler, ZeroStageEnum, fragment_address)
_FORCE_WEIGHTS_ONLY = "TORCH_FORCE_WEIGHTS_ONLY_LOAD"

def local_env() -> DistInfo:
    """What this process is, from its environment alone (`process_defaults`, `prepare_env`): usable before the
    process group exists, e.g. to prepare a corpus with no collective waiting on it. Checks that DeepSpeed's
    accelerator is this rank's device (`check_accelerator`)."""
    process_defaults(os.environ)
    prepare_env(os.environ)
    info = dist_info()
    check_accelerator(info)
    return info


def check_accelerator(info: DistInfo) -> None:
    """DeepSpeed's accelerator must be the device this rank's process group serves; else one line naming both
    (an EngineConfigError: exit 2), before any data is read or any collective started."""
    accel = get_accelerator().device_name()
    if accel == info.device.type:
        return
    if info.device.type == "cuda":
        why = ("CUDA is usable here: unset DS_ACCELERATOR (the trainer sets it to cuda); to train on this node's CPU, "
               "hide its GPUs with CUDA_VISIBLE_DEVICES=")
    else:
        why = "no CUDA device is usable here: unset DS_ACCELERATOR (the trainer sets it to cpu)"
    raise EngineConfigError(f"DeepSpeed's accelerator is {accel} ({ACCELERATOR_ENV}="
                            f"{os.environ.get(ACCELERATOR_ENV, '')}) but this rank's process group is "
                            f"{info.backend} on {info.device}: {why}")


def init_distributed(timeout_s: int = 1800) -> DistInfo:
    """Make this process a rank: `local_env()`, then start (or join) the process group: NCCL for CUDA tensors and
    gloo for CPU ones on a GPU, gloo on a CPU (distributed.BACKENDS). Safe to call twice."""
    info = local_env()
    if info.device.type == "cpu" and "OMP_NUM_THREADS" not in os.environ:
        # Unbound ranks on one CPU each default to a thread per core, so every core runs several ranks' threads that
        # wait on each other: split the cores between the ranks.
        # `deepspeed --bind_cores_to_rank` sets OMP_NUM_THREADS itself and pins each rank with numactl.
        torch.set_num_threads(max(1, len(os.sched_getaffinity(0)) // info.local_size))
    if info.device.type == "cuda":
        torch.cuda.set_device(info.device)
    _quiet_deepspeed(info.rank)
    if info.device.type == "cpu":
        _skip_shm_allreduce()
    if not dist.is_initialized():
        import datetime as dt

        deepspeed.init_distributed(dist_backend=info.backend, auto_mpi_discovery=False, verbose=False,
                                   timeout=dt.timedelta(seconds=timeout_s))
    return info


def _skip_shm_allreduce() -> None:
    """Keep DeepSpeed's CPU backend from building and starting its shared-memory all-reduce (deepspeed_shm_comm).

    That op serves `inference_all_reduce` only; training all-reduces go through torch.distributed (gloo). Started,
    it costs ~26 s of g++ on first use and a 66 MiB /dev/shm segment per rank per run that DeepSpeed never unlinks
    (20 GiB had piled up here after a day of runs). Where /dev/shm is smaller (64 MiB is a container's default) a rank
    dies of SIGSEGV/SIGBUS writing it and its peers spin forever waiting for its segment (seen in CI)."""
    from deepspeed import ops

    ops.__compatible_ops__["deepspeed_shm_comm"] = False  # DeepSpeed's own switch: build_shm_op() then returns None


def _quiet_deepspeed(rank_: int) -> None:
    # DeepSpeed logs every config key at INFO; our own log lines (rank 0) say what matters.
    import logging

    deepspeed.utils.logger.setLevel(logging.WARNING if rank_ == 0 else logging.ERROR)


def finish(code: int = 0) -> NoReturn:
    """End a rank: barrier, destroy the process group, flush, `os._exit(code)`.

    With the interpreter's normal exit, gloo ranks intermittently abort ("terminate called without an active
    exception", launcher rc 250: 4 runs in 10 on the 2-core CPU machine); this sequence gave 0 in 18. On failure the
    barrier is skipped (the other ranks may never reach it; the launcher stops them when one rank exits non-zero).
    """
    try:
        if dist.is_initialized():
            if code == 0:
                dist.barrier()
            dist.destroy_process_group()
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)


# ---------------------------------------------------------------------------------------------- DeepSpeed JSON


@dataclass(frozen=True)
class BatchPlan:
    """How a global batch is cut: every rank runs `grad_accum` micro-batches of `micro_batch` sequences per step."""

    micro_batch: int
    grad_accum: int
    world_size: int

    @property
    def global_batch(self) -> int:
        return self.micro_batch * self.grad_accum * self.world_size


def ds_config(cfg: RunConfig, stage: Stage, world: int, user_json: str | None = None,
              cuda: bool | None = None) -> tuple[dict[str, Any], BatchPlan]:
    """DeepSpeed's JSON for one training stage, derived from `cfg`, then overridden by `user_json`'s keys.

    DeepSpeed infers `train_batch_size` from micro-batch x accumulation x world size; a user JSON that sets it must
    agree. Returns the merged JSON and the batch plan the data loader must follow.
    """
    cuda = torch.cuda.is_available() if cuda is None else cuda
    bf16 = precision.resolve(cfg.engine.precision, cuda) == "bf16"
    micro = cfg.pretrain.micro_batch if stage == "pretrain" else cfg.finetune.micro_batch
    optim = cfg.pretrain.optim if stage == "pretrain" else cfg.finetune.optim
    derived: dict[str, Any] = {
        "train_micro_batch_size_per_gpu": micro,
        "gradient_accumulation_steps": cfg.engine.grad_accum,
        "gradient_clipping": optim.grad_clip,
        "zero_optimization": {"stage": cfg.engine.zero_stage},
        # bf16 is torch.autocast over fp32 weights inside the engine (DeepSpeed's torch_autocast): the plain PyTorch
        # loop's arithmetic, fp32 weights, gradients and optimizer, and the optimizer used bare. DeepSpeed's bf16
        # mode (bf16 weights and gradients, fp32 masters in a wrapper) measured 0.50-0.65x of the plain loop on an
        # H200 against 0.75-0.76x for this (docs/BENCHMARKS.md, GPU): at ZeRO 0 its wrapper checks every gradient
        # for inf/NaN with a device sync per tensor. A user's JSON that enables "bf16" (or "fp16") gets that mode
        # instead (below).
        "torch_autocast": {"enabled": bf16, "dtype": "bfloat16"},
        # bf16 has fp32's exponent range: no loss scale, so no step to skip. DeepSpeed's per-step overflow check
        # (ZeRO 1/2: an all-reduce and a host-device sync every step) would skip a step with a non-finite gradient
        # and carry on; without it the loop's own checks stop the run instead (loop.refuse_diverged: the loss at
        # every log row, the weights before every checkpoint), and `latest` keeps the last finite weights.
        "bf16": {"enabled": False, "check_grad_overflow": False},
        "optimizer": {
            # DeepSpeed's "Adam" is AdamW unless adam_w_mode is false: say which one we mean.
            "type": "AdamW" if optim.name == "adamw" else "Adam",
            "params": {
                "lr": optim.lr,
                "betas": list(optim.betas),
                "eps": 1e-8,
                "weight_decay": optim.weight_decay,
                "adam_w_mode": optim.name == "adamw",
                # Without torch_adam DeepSpeed picks FusedAdam, which JIT-compiles C++ for ~45 s on a CPU.
                **({} if cuda else {"torch_adam": True}),
            },
        },
        "steps_per_print": 1 << 30,  # our loop logs; DeepSpeed's per-step prints would interleave with tqdm
        "wall_clock_breakdown": False,
        # DeepSpeed's throughput timer is on by default and synchronizes the device at every forward and every step
        # (timers.throughput.synchronized) to time a figure it prints every steps_per_print steps: never, above. Two
        # full syncs per micro-step keep the host from queueing the next step while the GPU runs this one.
        "timers": {"throughput": {"enabled": False}},
    }
    source = user_json or ""
    user = read_json(user_json, "DeepSpeed config") if user_json else {}
    merged = _merge(derived, user)
    if any(_enabled(user, k) for k in ("bf16", "fp16")) and "torch_autocast" not in user:
        merged["torch_autocast"]["enabled"] = False  # the user chose DeepSpeed's own low-precision weights
    check_keys(user, source)
    modes = [k for k in ("bf16", "fp16", "torch_autocast") if _enabled(merged, k)]
    if len(modes) > 1:  # DeepSpeed accepts any mix and then runs something nobody asked for
        raise EngineConfigError(
            f"{source or 'derived DeepSpeed config'}: {' and '.join(modes)} are "
            f"{'both' if len(modes) == 2 else 'all'} enabled: choose one (torch_autocast: fp32 weights under "
            "autocast, the trainer's bf16; bf16 or fp16: DeepSpeed's low-precision weights with fp32 masters)")
    plan = _batch_plan(merged, user, world, source)
    merged["train_micro_batch_size_per_gpu"] = plan.micro_batch
    merged["gradient_accumulation_steps"] = plan.grad_accum
    merged.pop("train_batch_size", None)  # DeepSpeed infers it; we checked any user value above
    try:
        DeepSpeedConfig(copy.deepcopy(merged))  # DeepSpeed's own checks (e.g. unknown zero_optimization keys)
    except Exception as e:  # pydantic ValidationError, AssertionError, DeepSpeedConfigError...
        raise EngineConfigError(f"{source or 'derived DeepSpeed config'}: {type(e).__name__}: {e}") from None
    return merged, plan


def _enabled(ds: dict[str, Any], section: str) -> bool:
    return isinstance(ds.get(section), dict) and ds[section].get("enabled") is True


def precision_of(ds: dict[str, Any]) -> str:
    """What a DeepSpeed JSON trains in, as logs and checkpoints name it: fp32, bf16-autocast (ours), or DeepSpeed's
    bf16 / fp16 modes (low-precision weights, fp32 masters in its optimizer wrapper)."""
    for section in ("bf16", "fp16"):
        if _enabled(ds, section):
            return section
    if not _enabled(ds, "torch_autocast"):
        return "fp32"
    return ("bf16" if str(ds["torch_autocast"].get("dtype", "bfloat16")) in ("bfloat16", "bf16") else "fp16") + \
        "-autocast"


def _merge(base: dict[str, Any], over: dict[str, Any]) -> dict[str, Any]:
    out = copy.deepcopy(base)
    for k, v in over.items():
        out[k] = _merge(out[k], v) if isinstance(v, dict) and isinstance(out.get(k), dict) else copy.deepcopy(v)
    return out


@lru_cache(maxsize=1)
def known_keys() -> frozenset[str]:
    """The top-level keys the installed DeepSpeed reads, found by watching `DeepSpeedConfig` read a config.

    DeepSpeed silently ignores a top-level key it does not know (a typo like "gradient_clippping" would do nothing),
    so we ask it which names it looks up instead of keeping a list that goes stale with each release.
    """
    seen: set[str] = set()

    class Keys:  # what `param_dict.keys()` returns: DeepSpeed tests `NAME in param_dict.keys()`
        def __init__(self, d: dict[str, Any]) -> None:
            self.d = d

        def __contains__(self, k: object) -> bool:
            seen.add(str(k))
            return k in self.d

        def __iter__(self) -> Any:
            return iter(self.d)

        def __len__(self) -> int:
            return len(self.d)

    class Watch(dict):
        def get(self, k: Any, default: Any = None) -> Any:
            seen.add(k)
            return super().get(k, default)

        def __getitem__(self, k: Any) -> Any:
            seen.add(k)
            return super().__getitem__(k)

        def __contains__(self, k: object) -> bool:
            seen.add(str(k))
            return super().__contains__(k)

        def keys(self) -> Any:  # type: ignore[override]
            return Keys(self)

    DeepSpeedConfig(Watch({"train_micro_batch_size_per_gpu": 1}))
    return frozenset(seen)


def check_keys(user: dict[str, Any], source: str) -> None:
    unknown = sorted(set(user) - known_keys())
    if unknown:
        raise EngineConfigError(
            f"{source}: unknown DeepSpeed key(s) {unknown} (deepspeed {deepspeed.__version__} would ignore them); "
            f"known keys: {', '.join(sorted(known_keys()))}"
        )


def _batch_plan(merged: dict[str, Any], user: dict[str, Any], world: int, source: str) -> BatchPlan:
    """Resolve micro-batch and accumulation; a user's train_batch_size must divide and agree (DeepSpeed asserts)."""
    micro = merged["train_micro_batch_size_per_gpu"]
    accum = merged["gradient_accumulation_steps"]
    for key, value in (("train_micro_batch_size_per_gpu", micro), ("gradient_accumulation_steps", accum)):
        if not isinstance(value, int) or value < 1:
            raise EngineConfigError(f"{source}: {key} must be an integer >= 1, got {value!r}")
    if "train_batch_size" in user:
        total = user["train_batch_size"]
        if not isinstance(total, int) or total < 1:
            raise EngineConfigError(f"{source}: train_batch_size must be an integer >= 1, got {total!r}")
        if "train_micro_batch_size_per_gpu" not in user:
            # The user fixed the global batch: the micro-batch follows from it, and must come out whole.
            if total % (accum * world):
                raise EngineConfigError(
                    f"{source}: train_batch_size={total} is not divisible by gradient_accumulation_steps={accum} "
                    f"x world size {world}"
                )
            micro = total // (accum * world)
        elif total != micro * accum * world:
            raise EngineConfigError(
                f"{source}: train_batch_size={total} != train_micro_batch_size_per_gpu={micro} x "
                f"gradient_accumulation_steps={accum} x world size {world} (= {micro * accum * world})"
            )
    return BatchPlan(micro, accum, world)


# ---------------------------------------------------------------------------------------------- engine


def compiles(setting: str, device: torch.device) -> bool:
    """engine.compile -> whether the engine compiles its module: on, off, or auto: on with CUDA, off on a CPU (where
    compiling costs minutes before the first step, and the compiled step measured faster on the LM, slower on the
    classifier: docs/BENCHMARKS.md, torch.compile)."""
    if setting not in ("off", "on", "auto"):
        raise ValueError(f"engine.compile must be off, on or auto, got {setting!r}")
    return setting == "on" or (setting == "auto" and device.type == "cuda")


def initialize(model: torch.nn.Module, ds: dict[str, Any], optim: OptimConfig, total_steps: int,
               engine_cfg: EngineConfig | None = None, groups: list[LrGroup] | None = None) -> Any:
    """A DeepSpeed engine around `model`. Our schedule drives the lr unless the user's JSON names a "scheduler".
    `engine_cfg` (the run's engine section; None: neither of these): engine.compile resolving to on compiles the
    engine's module in place (engine.compile(): torch.compile with inductor; parameter names, checkpoints and
    artifacts unchanged; the first steps of each new input shape pay for compiling); engine.deterministic picks
    deterministic kernels (`deterministic`). `groups` (None: one group of every parameter): the optimizer's
    parameter groups, each at its share of the schedule's lr (schedule.LrGroup; a user's "scheduler" would
    replace those shares, so the two are exclusive)."""
    if engine_cfg is not None and engine_cfg.deterministic:
        deterministic()
    if groups and "scheduler" in ds:
        raise EngineConfigError("the DeepSpeed JSON names a \"scheduler\", which would replace the per-group learning "
                                "rates of finetune.layer_lr_decay / unfreeze_epochs: drop one of them")
    factors = [lambda s: lr_factor(s, optim, total_steps)] if not groups else \
        [functools.partial(g.factor, optim=optim, total_steps=total_steps) for g in groups]
    scheduler = None
    if "scheduler" not in ds:
        def scheduler(opt: torch.optim.Optimizer) -> torch.optim.lr_scheduler.LambdaLR:
            return torch.optim.lr_scheduler.LambdaLR(opt, factors)
    params = model.parameters() if not groups else [{"params": g.params} for g in groups]
    engine, _, _, _ = deepspeed.initialize(model=model, model_parameters=params,
                                           config=copy.deepcopy(ds), lr_scheduler=scheduler)
    if world_size() == 1 and engine.zero_optimization_stage() == 0:
        # Alone, DeepSpeed would still copy every gradient into a flat buffer, all-reduce it over a group of one and
        # copy it back after each backward: ~15% of a lab-size LM step on 2 CPU cores (bench/train_throughput.py).
        # DeepSpeed's own switch; ZeRO 1/2 need that pass to fill their gradient partitions, so they keep it.
        engine.enable_backward_allreduce = False
    if engine.zero_optimization_stage() == 0 and not (engine.bfloat16_enabled() or engine.fp16_enabled()):
        # fp32 weights, no DeepSpeed optimizer wrapper: DeepSpeed clips through this method of its engine, with a
        # norm and a mul_ per tensor, an all-reduce of the total over the data-parallel group (for MoE, of which we
        # have none: every rank holds the same averaged gradients) and two host-to-device copies of constants that
        # wait for the stream. torch's clip_grad_norm_ is the same formula (max_norm / (norm + 1e-6), at most 1)
        # in one foreach norm and one foreach mul on a GPU, without waiting: what the plain loop runs. ZeRO 1/2 and
        # DeepSpeed's own bf16/fp16 modes clip inside their optimizer wrappers (partitioned gradients): untouched.
        # With parameter groups, a frozen group's (lr 0) gradients stay out of the norm: counted, they would shrink
        # the steps of the groups that train. One group: every parameter, in the module's order, as before.
        def training() -> Any:
            if not groups:
                return engine.module.parameters()
            return [p for g in engine.optimizer.param_groups if g["lr"] > 0 for p in g["params"]]

        engine.clip_fp32_gradients = lambda: torch.nn.utils.clip_grad_norm_(training(), engine.gradient_clipping())
    if engine_cfg is not None and compiles(engine_cfg.compile, torch.device(get_accelerator().device_name())):
        engine.compile()
    return engine


def deterministic() -> None:
    """Deterministic kernels from here on (torchtitan's debug.deterministic): PyTorch's deterministic algorithms
    (a kernel without one warns instead of stopping the run), cuDNN without autotuning, and the fixed cuBLAS workspace
    that deterministic cuBLAS needs (read when its first handle is made: before the first forward)."""
    os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
    torch.use_deterministic_algorithms(True, warn_only=True)
    torch.backends.cudnn.deterministic, torch.backends.cudnn.benchmark = True, False


def whole_weights(engine: Any) -> contextlib.AbstractContextManager:
    """Around an evaluation (call on every rank): under ZeRO 3 every weight gathered whole on every rank for the
    block, so that each rank can score its own share of the batches, however many: a ZeRO 3 forward otherwise
    gathers each layer with a collective that every rank must join, and a rank with one batch more waits for ever.
    Elsewhere nothing (the module holds the whole weights already)."""
    if engine.zero_optimization_stage() != 3:
        return contextlib.nullcontext()
    return deepspeed.zero.GatheredParameters(list(engine.module.parameters()))


def weights_finite(engine: Any) -> bool:
    """Every parameter of the engine's module is finite on every rank (call on every rank: one all-reduce). Under
    ZeRO 3 each rank checks its own share of every weight (`ds_tensor`; the module's tensors are empty there)."""
    ok = torch.stack([getattr(p, "ds_tensor", p).detach().isfinite().all() for p in engine.module.parameters()]).all()
    return all_reduce_sum([0.0 if bool(ok) else 1.0])[0] == 0.0


def current_lr(engine: Any) -> float:
    return float(engine.get_lr()[0])


def fp32_state_dict(engine: Any, ckpt_dir: str | Path | None = None, tag: str | None = None) -> dict[str, torch.Tensor]:
    """The model's fp32 weights, for the artifact (call on every rank; use the result on rank 0).

    fp32 and bf16 (autocast over fp32 weights): every rank's module holds the full fp32 weights under ZeRO 0/1/2
    (ZeRO 1/2 partition optimizer state and gradients, not parameters), so they are read directly: exact; ZeRO 3
    gathers them first.
    DeepSpeed's own bf16 or fp16 mode (a user's JSON enabling "bf16" or "fp16"): the module holds bf16/fp16 copies
    and the fp32 master weights live in the optimizer. ZeRO 1/2 partition them across ranks: consolidated from the
    checkpoint `tag` with deepspeed.utils.zero_to_fp32 (in-process: its CLI needs huggingface_hub). ZeRO 0 keeps
    them whole in its FP16 optimizer wrapper (which zero_to_fp32 does not read): taken from there. (fp16 once took
    the module's fp16 copies: an artifact rounded to fp16, found by tests/test_engine.py.)
    """
    mixed = engine.bfloat16_enabled() or engine.fp16_enabled()  # DeepSpeed's own modes: fp32 masters apart
    if not mixed and engine.zero_optimization_stage() == 3:
        # ZeRO 3 partitions the weights themselves: gathered whole on every rank for the copy (exact: they are the
        # fp32 weights), released at the end of the block.
        with deepspeed.zero.GatheredParameters(list(engine.module.parameters())):
            return {k: v.detach().to("cpu", torch.float32).clone() for k, v in engine.module.state_dict().items()}
    own = engine.module.state_dict()
    if not mixed:
        return {k: v.detach().to("cpu", torch.float32).clone() for k, v in own.items()}
    if engine.zero_optimization_stage() >= 1:
        if ckpt_dir is None or tag is None:
            raise ValueError("bf16/fp16 under ZeRO 1-3: the fp32 weights are consolidated from a checkpoint; pass "
                             "its tag")
        from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint

        with weights_only_loads():  # reads the checkpoint's files (a finished run's on --resume)
            master = get_fp32_state_dict_from_zero_checkpoint(str(ckpt_dir), tag=tag)
    else:
        from torch._utils import _unflatten_dense_tensors

        opt = engine.optimizer  # FP16_Optimizer (fused: flat fp32 groups) or FP16_UnfusedOptimizer (torch Adam)
        masters = ([_unflatten_dense_tensors(f, g) for f, g in zip(opt.fp32_groups_flat, opt.fp16_groups, strict=True)]
                   if hasattr(opt, "fp32_groups_flat") else opt.fp32_groups)
        by_id = {id(p): m for group, ms in zip(opt.fp16_groups, masters, strict=True)
                 for p, m in zip(group, ms, strict=True)}
        master = {name: by_id[id(p)] for name, p in engine.module.named_parameters() if id(p) in by_id}
    # Parameters come from the fp32 masters; buffers (none persistent in our models today) from the module.
    return {k: (master[k] if k in master else v).detach().to("cpu", torch.float32).clone() for k, v in own.items()}


# ---------------------------------------------------------------------------------------------- loading checkpoints


def safe_global_names() -> frozenset[str]:
    """SAFE_GLOBALS as torch.serialization names them ("module.Class")."""
    return frozenset(f"{t.__module__}.{t.__qualname__}" for t in SAFE_GLOBALS)


@contextmanager
def weights_only_loads() -> Iterator[None]:
    """Inside, every torch.load unpickles only tensors, plain containers and SAFE_GLOBALS, whatever its caller asks:
    DeepSpeed's TorchCheckpointEngine.load and its zero_to_fp32 both pass weights_only=False, so a planted pickle in
    a checkpoint would run code on --resume. torch's own switch (TORCH_FORCE_WEIGHTS_ONLY_LOAD, read at every
    torch.load) makes weights_only=True win over the argument; it is set only for the duration."""
    old = os.environ.get(_FORCE_WEIGHTS_ONLY)
    os.environ[_FORCE_WEIGHTS_ONLY] = "1"
    try:
        with torch.serialization.safe_globals(list(SAFE_GLOBALS)):
            yield
    finally:
        if old is None:
            os.environ.pop(_FORCE_WEIGHTS_ONLY, None)
        else:
            os.environ[_FORCE_WEIGHTS_ONLY] = old


def package_versions() -> dict[str, str]:
    import platform

    import numpy

    out = {"python": platform.python_version(), "torch": torch.__version__, "deepspeed": deepspeed.__version__,
           "numpy": numpy.__version__}
    try:
        import sentencepiece

        out["sentencepiece"] = sentencepiece.__version__
    except ImportError:
        pass
    return out
