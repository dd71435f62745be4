"""DeepSpeed's import, the only one in the project: DeepSpeed picks its accelerator (where it keeps the module, which
device its collectives use) while it is imported, from DS_ACCELERATOR, so that variable is set first, to the device
the process group serves (distributed.device_type). Other modules take `deepspeed` and its names from here.

Importing this module sets only DS_ACCELERATOR (where unset); a user's own value naming another device stops the rank
in `check_accelerator` with one line naming both.
"""

from __future__ import annotations

import os

from trainer.engine.distributed import DistInfo, EngineConfigError, device_type

ACCELERATOR_ENV = "DS_ACCELERATOR"
# A CPU accelerator on a GPU node would keep the module on the CPU and broadcast CPU tensors over NCCL.
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

__all__ = ["ACCELERATOR_ENV", "DeepSpeedConfig", "DynamicLossScaler", "LossScaler", "ZeroStageEnum",
           "check_accelerator", "deepspeed", "fragment_address", "get_accelerator"]


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
