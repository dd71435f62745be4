"""DeepSpeed's JSON, derived from our RunConfig in one function (`ds_config`): micro-batch and accumulation
(DeepSpeed infers the global batch), ZeRO stage, precision, optimizer, clipping. A user's own JSON overrides it key by
key, checked before DeepSpeed sees it: unknown keys and batch sizes that do not divide are errors naming the file and
the key.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass
from functools import lru_cache
from typing import Any, Literal

import torch

from trainer.config.schema import RunConfig, read_json
from trainer.engine import optimizer, precision
from trainer.engine.accelerator import DeepSpeedConfig, deepspeed
from trainer.engine.distributed import EngineConfigError

Stage = Literal["pretrain", "finetune"]


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
        # bf16 is torch.autocast over fp32 weights (the plain loop's arithmetic, the optimizer used bare), not
        # DeepSpeed's bf16 mode, whose optimizer wrapper syncs the device per gradient (docs/BENCHMARKS.md, GPU).
        # A user's JSON that enables "bf16" (or "fp16") gets that mode instead (below).
        "torch_autocast": {"enabled": bf16, "dtype": "bfloat16"},
        # bf16 has fp32's exponent range: no loss scale, so no overflow check (an all-reduce and a sync per step at
        # ZeRO 1/2). A non-finite loss or weight stops the run instead (loop.refuse_diverged).
        "bf16": {"enabled": False, "check_grad_overflow": False},
        "optimizer": optimizer.ds_section(optim, cuda),
        "steps_per_print": 1 << 30,  # our loop logs; DeepSpeed's per-step prints would interleave with tqdm
        "wall_clock_breakdown": False,
        # DeepSpeed's throughput timer (on by default) syncs the device at every forward and step for a figure it
        # prints every steps_per_print steps: never, above.
        "timers": {"throughput": {"enabled": False}},
    }
    source = user_json or ""
    user = read_json(user_json, "DeepSpeed config") if user_json else {}
    merged = _merge(derived, user)
    if any(_enabled(user, k) for k in ("bf16", "fp16")) and "torch_autocast" not in user:
        merged["torch_autocast"]["enabled"] = False  # the user chose DeepSpeed's own low-precision weights
    zero = merged["zero_optimization"]
    if isinstance(zero, dict) and zero.get("stage") in (1, 2):
        # ZeRO 1/2 otherwise copy every gradient into a contiguous buffer in a hook of its own as the backward makes
        # it; without, a bucket is flattened in one cat when reduced (docs/BENCHMARKS.md, "What a step does").
        zero.setdefault("contiguous_gradients", False)
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
    """The top-level keys the installed DeepSpeed reads, found by watching `DeepSpeedConfig` read a config: DeepSpeed
    ignores a key it does not know (a typo would do nothing), and a list of our own would go stale."""
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
