"""Our model inside a DeepSpeed engine, and what the trainers ask of that engine.

- `initialize()` wraps a model with the optimizer and lr schedule of trainer/engine/optimizer.py; `step_like_torch`
  and the single-process switch below keep its step to the plain PyTorch loop's work (tests/test_step_work.py).
- `whole_weights()`, `weights_finite()`, `fp32_state_dict()`: the weights under any ZeRO stage and precision.
- `weights_only_loads()`: DeepSpeed's checkpoint reads unpickle nothing but tensors and SAFE_GLOBALS.

The stages call everything the engine offers as `eng.*` from here: the DeepSpeed JSON (trainer/engine/ds_config.py),
the process (trainer/engine/process.py), ranks and collectives (trainer/engine/distributed.py) are re-exported below.
"""

from __future__ import annotations

import contextlib
import copy
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch

from trainer.config.schema import EngineConfig, OptimConfig
from trainer.engine import optimizer
from trainer.engine.accelerator import (
    DynamicLossScaler,
    LossScaler,
    ZeroStageEnum,
    deepspeed,
    fragment_address,
    get_accelerator,
)
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
from trainer.engine.ds_config import BatchPlan, Stage, check_keys, ds_config, known_keys, precision_of  # noqa: F401
from trainer.engine.optimizer import LrGroup, lr_factor  # noqa: F401
from trainer.engine.process import finish, init_distributed, local_env, package_versions  # noqa: F401

# The only objects besides tensors and plain containers that a DeepSpeed checkpoint may unpickle: what the ZeRO 1/2
# optimizer-state files of deepspeed 0.19.8 hold (torch.serialization.get_unsafe_globals_in_checkpoint on them), and
# the dynamic loss scaler of fp16. Model-state files hold none. All are rebuilt from plain values.
SAFE_GLOBALS = (LossScaler, DynamicLossScaler, ZeroStageEnum, fragment_address)
_FORCE_WEIGHTS_ONLY = "TORCH_FORCE_WEIGHTS_ONLY_LOAD"


def compiles(setting: str, device: torch.device) -> bool:
    """engine.compile -> whether the engine compiles its module: on, off, or auto: on with CUDA, off on a CPU (where
    compiling costs minutes before the first step, and pays on long LM runs only: docs/BENCHMARKS.md)."""
    if setting not in ("off", "on", "auto"):
        raise ValueError(f"engine.compile must be off, on or auto, got {setting!r}")
    return setting == "on" or (setting == "auto" and device.type == "cuda")


def initialize(model: torch.nn.Module, ds: dict[str, Any], optim: OptimConfig, total_steps: int,
               engine_cfg: EngineConfig | None = None, groups: list[LrGroup] | None = None) -> Any:
    """A DeepSpeed engine around `model`. Our schedule drives the lr unless the user's JSON names a "scheduler".
    `engine_cfg` (the run's engine section; None: neither of these): engine.compile resolving to on compiles the
    engine's module in place (DeepSpeed's engine.compile(): inductor; parameter names, checkpoints and artifacts
    unchanged); engine.deterministic picks deterministic kernels (`deterministic`). `groups` (None: one group of
    every parameter): the optimizer's parameter groups, each at its share of the schedule's lr (optimizer.LrGroup;
    a user's "scheduler" would replace those shares, so the two are exclusive)."""
    if engine_cfg is not None and engine_cfg.deterministic:
        deterministic()
    if groups and "scheduler" in ds:
        raise EngineConfigError("the DeepSpeed JSON names a \"scheduler\", which would replace the per-group learning "
                                "rates of finetune.layer_lr_decay / unfreeze_epochs: drop one of them")
    scheduler = None if "scheduler" in ds else optimizer.schedule(optim, total_steps, groups)
    engine, _, _, _ = deepspeed.initialize(model=model, model_parameters=optimizer.param_groups(model, groups),
                                           config=copy.deepcopy(ds), lr_scheduler=scheduler)
    if world_size() == 1 and engine.zero_optimization_stage() == 0:
        # Alone, DeepSpeed would still copy every gradient into a flat buffer, all-reduce it over a group of one and
        # copy it back. DeepSpeed's own switch; ZeRO 1/2 need that pass to fill their gradient partitions.
        engine.enable_backward_allreduce = False
    if engine.zero_optimization_stage() == 0 and not (engine.bfloat16_enabled() or engine.fp16_enabled()):
        step_like_torch(engine, bool(groups))
    if engine_cfg is not None and compiles(engine_cfg.compile, torch.device(get_accelerator().device_name())):
        engine.compile()
    return engine


def step_like_torch(engine: Any, grouped: bool = False) -> None:
    """At ZeRO 0 with fp32 weights (the optimizer used bare), clip and clear the gradients as the plain loop does.

    DeepSpeed's own clipping there takes a norm and a mul_ per tensor, all-reduces the total over the data-parallel
    group (for MoE: every rank here holds the same averaged gradients) and copies constants to the device; torch's
    clip_grad_norm_ is the same formula (max_norm / (norm + 1e-6), at most 1) in foreach kernels with no sync. Its
    zero_grad walks the module's named parameters in Python; the optimizer's sets the same gradients to None. ZeRO 1-3
    and DeepSpeed's bf16/fp16 modes do both inside their optimizer wrappers: untouched. `grouped` (parameter groups
    of their own lr, LrGroup): a frozen group's (lr 0) gradients stay out of the norm; counted, they would shrink the
    steps of the groups that train."""
    def training() -> Any:
        if not grouped:
            return engine.module.parameters()
        return [p for g in engine.optimizer.param_groups if g["lr"] > 0 for p in g["params"]]

    engine.clip_fp32_gradients = lambda: torch.nn.utils.clip_grad_norm_(training(), engine.gradient_clipping())
    engine.zero_grad = lambda *_, **__: engine.optimizer.zero_grad(set_to_none=True)


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

    fp32 and bf16 (autocast over fp32 weights): every rank's module holds the full fp32 weights under ZeRO 0/1/2, read
    directly; ZeRO 3 gathers them first.
    DeepSpeed's own bf16 or fp16 mode (a user's JSON enabling "bf16" or "fp16"): the module holds bf16/fp16 copies
    and the fp32 masters live in the optimizer. ZeRO 1/2 partition them across ranks: consolidated from the
    checkpoint `tag` with deepspeed.utils.zero_to_fp32 (in-process: its CLI needs huggingface_hub). ZeRO 0 keeps
    them whole in its FP16 optimizer wrapper (which zero_to_fp32 does not read): taken from there.
    """
    mixed = engine.bfloat16_enabled() or engine.fp16_enabled()  # DeepSpeed's own modes: fp32 masters apart
    if not mixed and engine.zero_optimization_stage() == 3:
        # ZeRO 3 partitions the weights themselves: gathered whole on every rank for the copy, released after.
        with deepspeed.zero.GatheredParameters(list(engine.module.parameters())):
            return {k: v.detach().to("cpu", torch.float32).clone() for k, v in engine.module.state_dict().items()}
    own = engine.module.state_dict()
    if not mixed:
        return {k: v.detach().to("cpu", torch.float32).clone() for k, v in own.items()}
    if engine.zero_optimization_stage() >= 1:
        if ckpt_dir is None or tag is None:
            raise ValueError("bf16/fp16 under ZeRO 1-3: the fp32 weights are consolidated from a checkpoint; pass "
                             "its tag")
        with weights_only_loads():  # reads the checkpoint's files (a finished run's on --resume)
            master = deepspeed.utils.zero_to_fp32.get_fp32_state_dict_from_zero_checkpoint(str(ckpt_dir), tag=tag)
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


@contextlib.contextmanager
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
